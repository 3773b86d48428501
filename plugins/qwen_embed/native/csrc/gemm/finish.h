// The int8 route's rescale of one row's 16 channel sums, (sum - offset) * row scale * channel
// scale + bias, rounded, and the bf16 route's store of 16 fp32 sums: shared by the panel
// routes (rows.cpp) and the AMX tile GEMMs (tiles_amx.cpp), both compiled with the same
// vector flags, so both give the same bits. And the gated store of a gate|up projection,
// silu(gate) * up, for both.
#pragma once
#include <immintrin.h>

// numerics.h's helpers for these sources' flags, in a namespace of their own (qe::gemm)
#define QE_ISA gemm
#include "../numerics.h"
#include "gemm.h"

namespace qe {
namespace gemm {
namespace {

constexpr int64_t kChannels = 16;  // output channels per vector of int32 sums

// Masked forms of numerics.h's 16-lane loads and stores (bf16 converted as there).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return reinterpret_cast<__m512>(
      from_bf16(reinterpret_cast<U16x16>(_mm256_maskz_loadu_epi16(m, p))));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(to_bf16(reinterpret_cast<F16>(v))));
}

// One group of 16 output channels from channel c: what their rescale needs.
struct ChannelGroup {
  __m512i offset;
  __m512 w_scale, bias;
  __mmask16 mask;
};

template <typename T>
inline ChannelGroup channel_group(const Int8Gemm<T>& g, int64_t c) {
  ChannelGroup group;
  group.mask = first_lanes(g.n - c);
  group.offset = _mm512_maskz_loadu_epi32(group.mask, g.offset + c);
  group.w_scale = _mm512_maskz_loadu_ps(group.mask, g.w_scale + c);
  group.bias = g.bias ? _mm512_maskz_loadu_ps(group.mask, g.bias + c) : _mm512_setzero_ps();
  return group;
}

template <typename T>
inline __m512 rescale16(const Int8Gemm<T>& g, const int32_t* sums, __m512 a_scale,
                        const ChannelGroup& group) {
  const __m512i sum = _mm512_maskz_loadu_epi32(group.mask, sums);
  __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, group.offset));
  y = _mm512_mul_ps(_mm512_mul_ps(y, a_scale), group.w_scale);
  return g.bias ? _mm512_add_ps(y, group.bias) : y;
}

template <typename T>
inline void finish16(const Int8Gemm<T>& g, const int32_t* sums, __m512 a_scale,
                     const ChannelGroup& group, T* out) {
  store16(out, rescale16(g, sums, a_scale, group), group.mask);
}

// silu(gate) * up of 16 channels, each half first rounded to T as the plain GEMM stores it,
// then the row kernels' silu_mul (rows.h): the unfused route's bits.
template <typename T>
inline void store_gated16(__m512 gate, __m512 up, __mmask16 mask, T* out) {
  const F16 g = round16<T>(reinterpret_cast<F16>(gate));
  const F16 u = round16<T>(reinterpret_cast<F16>(up));
  store16(out, reinterpret_cast<__m512>(silu(g) * u), mask);
}

// The gate|up projection's 16 channels: gate's sums at `gate`, up's at `up` (groups[0] and [1]
// their channels).
template <typename T>
inline void finish_gated16(const Int8Gemm<T>& g, const int32_t* gate, const int32_t* up,
                           __m512 a_scale, const ChannelGroup* groups, T* out) {
  store_gated16(rescale16(g, gate, a_scale, groups[0]), rescale16(g, up, a_scale, groups[1]),
                groups[0].mask, out);
}

// The bf16 routes' store: 16 fp32 sums plus bias (fp32, or null), rounded.
inline void store_sums16(const float* sums, const float* bias, __mmask16 mask, uint16_t* out) {
  __m512 y = _mm512_maskz_loadu_ps(mask, sums);
  if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias));
  store16(out, y, mask);
}

}  // namespace
}  // namespace gemm
}  // namespace qe
