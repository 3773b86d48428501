// The int8 route's linear layers on AVX512_VNNI (vpdpbusd: uint8 x int8 -> int32), compiled with
// its flags alone (native/build.py) and chosen at run time (ops.cpp).
//
// Activations are quantized per row (symmetric, 127 levels) and stored as uint8 codes + 128;
// weights are int8 per output channel, packed at load as [n / 16][k / 4][16 channels][4 k]
// (int8.py), with each channel's sum times 128 subtracted from its int32 total to undo the
// offset. Integer sums are exact, so a row's outputs never depend on the rows computed beside
// it; the rescale (row scale, then channel scale), the bias and the rounding to the output dtype
// happen while the sums are still in registers, so no int32 matrix ever reaches memory. A layer
// may rotate its rows first (a block Walsh-Hadamard transform, int8.py), as it rotated its
// weights at load: an outlier spreads over its block and the row's scale fits the rest better.
#include <immintrin.h>

#include <vector>

#define QE_ISA vnni
#include "numerics.h"

namespace qe {
namespace vnni {
namespace {

constexpr int64_t kChannels = 16;  // output channels per vector of int32 sums
constexpr int kVectors = 4;        // vectors of channels per tile: 64 channels
constexpr int kRows = 6;           // rows per tile: 24 accumulators, 4 weight vectors, 1 row

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

inline __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

// One row of k values, whose largest magnitude is amax -> k_pad codes (the padding codes stand
// for 0) and its scale.
template <typename T>
void codes(const T* row, int64_t k, int64_t k_pad, float amax, uint8_t* dst, float* scale) {
  const float s = __builtin_fmaxf(amax, 1e-12f) / 127.0f;
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t j = 0; j < k_pad; j += 16) {
    __m512 v = _mm512_div_ps(load16(row + j, j < k ? first(k - j) : 0), sv);
    v = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT), lo), hi);
    __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(dst + j, first(k_pad - j), _mm512_cvtepi32_epi8(c));
  }
}

// Row i of x -> its codes and scale; with block > 1 the row is rotated first (hadamard_row,
// numerics.h), in fp32, as the weights were at load (int8.py).
template <typename T>
void quantize(const T* x, int64_t stride, int64_t rows, int64_t k, int64_t k_pad, int64_t block,
              uint8_t* q, float* scale) {
  thread_local std::vector<float> rotated;
  if (block > 1) rotated.resize(k);
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = x + i * stride;
    if (block > 1) {
      const float amax = hadamard_row(row, k, block, rotated.data());
      codes(rotated.data(), k, k_pad, amax, q + i * k_pad, scale + i);
      continue;
    }
    __m512 amax = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16)
      amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + j, first(k - j))));
    codes(row, k, k_pad, _mm512_reduce_max_ps(amax), q + i * k_pad, scale + i);
  }
}

// R rows x V vectors of channels from `row`, `col`: int32 sums over k_pad / 4 groups of 4, then
// the rescale. The sums are locals of this one function so that they stay in registers.
template <typename T, int R, int V>
void tile(const Int8Gemm<T>& g, int64_t row, int64_t col) {
  const uint8_t* a = g.a + row * g.k_pad;
  const int8_t* b = g.packed + col * g.k_pad;
  const int64_t b_vector = g.k_pad * kChannels, groups = g.k_pad / 4;
  __m512i acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t grp = 0; grp < groups; ++grp) {
    __m512i w[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(b + v * b_vector + grp * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;
      __builtin_memcpy(&four, a + r * g.k_pad + grp * 4, 4);
      const __m512i x = _mm512_set1_epi32(four);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], x, w[v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const int64_t c = col + v * kChannels;
    const __mmask16 m = first(g.n - c);
    const __m512i offset = _mm512_maskz_loadu_epi32(m, g.offset + c);
    const __m512 w_scale = _mm512_maskz_loadu_ps(m, g.w_scale + c);
    const __m512 bias = g.bias ? _mm512_maskz_loadu_ps(m, g.bias + c) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], offset));
      y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(g.a_scale[row + r])), w_scale);
      if (g.bias) y = _mm512_add_ps(y, bias);
      store16(g.out + (row + r) * g.ldo + c, y, m);
    }
  }
}

template <typename T, int V>
void rows_of(const Int8Gemm<T>& g, int64_t row, int64_t rows, int64_t col) {
  switch (rows) {
    case 1: return tile<T, 1, V>(g, row, col);
    case 2: return tile<T, 2, V>(g, row, col);
    case 3: return tile<T, 3, V>(g, row, col);
    case 4: return tile<T, 4, V>(g, row, col);
    case 5: return tile<T, 5, V>(g, row, col);
    default: return tile<T, 6, V>(g, row, col);
  }
}

// Rows [row0, row1) x channels [col0, col1) (col0 a multiple of 64): each 64-channel panel of
// weights stays in cache while the rows pass it.
template <typename T>
void gemm(const Int8Gemm<T>& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1) {
  for (int64_t col = col0; col < col1; col += kVectors * kChannels) {
    const int64_t end = col1 < g.n ? col1 : g.n, vectors = (end - col + kChannels - 1) / kChannels;
    for (int64_t row = row0; row < row1; row += kRows) {
      const int64_t rows = row1 - row < kRows ? row1 - row : kRows;
      switch (vectors) {
        case 1: rows_of<T, 1>(g, row, rows, col); break;
        case 2: rows_of<T, 2>(g, row, rows, col); break;
        case 3: rows_of<T, 3>(g, row, rows, col); break;
        default: rows_of<T, 4>(g, row, rows, col); break;
      }
    }
  }
}

}  // namespace

extern const Int8Kernels kernels = {
    quantize<float>, quantize<uint16_t>, gemm<float>, gemm<uint16_t>,
};

}  // namespace vnni
}  // namespace qe
