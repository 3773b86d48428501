// The int8 route's row work around its integer GEMM (ops.cpp runs the GEMM on our AMX int8 tile
// kernel, tiles_amx.cpp, where the CPU has the tiles, and on our VNNI panel kernel elsewhere,
// panels_vnni.cpp), and the store of the bf16 GEMM's sums (batch_invariant, panel kernels),
// compiled with AVX-512 flags (native/build.py) and chosen at run time (ops.cpp).
//
// Activations are quantized per row (symmetric, 127 levels) and stored as uint8 codes + 128;
// weights are int8 per output channel, packed at load in panels of 64 channels as
// [n / 64][k / 4][64 channels][4 k] (int8.py, oneDNN brgemm's VNNI layout), with each channel's sum
// times 128 subtracted from its int32 total to undo the offset. Integer sums are exact, so a
// row's outputs never depend on the rows computed beside it; `finish` rescales (row scale, then
// channel scale), adds the bias and rounds to the output dtype while a block of sums is in
// cache, so no int32 matrix ever reaches memory. A layer may rotate its rows first (a block
// Walsh-Hadamard transform, int8.py), as it rotated its weights at load: an outlier spreads
// over its block and the row's scale fits the rest better.
#include <algorithm>
#include <vector>

#include "finish.h"

namespace qe {
namespace gemm {
namespace {

// One row of k values, whose largest magnitude is amax -> k_pad codes (the padding codes stand
// for 0) and its scale. Values are multiplied by the scale's reciprocal, as int8.quantize_rows
// does: a vector division costs many multiplies' time.
template <typename T>
void codes(const T* row, int64_t k, int64_t k_pad, float amax, uint8_t* dst, float* scale) {
  const float s = __builtin_fmaxf(amax, 1e-12f) / 127.0f;
  *scale = s;
  const __m512 inv = _mm512_set1_ps(1.0f / s);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t j = 0; j < k_pad; j += 16) {
    __m512 v = _mm512_mul_ps(load16(row + j, j < k ? first_lanes(k - j) : 0), inv);
    v = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT), lo), hi);
    __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(dst + j, first_lanes(k_pad - j), _mm512_cvtepi32_epi8(c));
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
      amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + j, first_lanes(k - j))));
    codes(row, k, k_pad, _mm512_reduce_max_ps(amax), q + i * k_pad, scale + i);
  }
}

// Rows [row, row + rows) x channels [col, col + cols) from their int32 sums (`sums`, ld values
// per row, from channel col): (sum - offset) * row scale * channel scale + bias, rounded. A
// gate|up projection's (g.up): silu(gate) * up of gate's channels from col and up's g.up
// further, whose sums follow gate's, `rows` x ld of them.
template <typename T>
void finish(const Int8Gemm<T>& g, const int32_t* sums, int64_t ld, int64_t row, int64_t rows,
            int64_t col, int64_t cols) {
  // a row's channels together: whole cache lines of the output, written once
  constexpr int64_t kGroups = kPanel / kChannels;
  ChannelGroup group[kGroups][2];
  const int64_t groups = (cols + kChannels - 1) / kChannels;
  for (int64_t j = 0; j < groups; ++j) {
    group[j][0] = channel_group(g, col + j * kChannels);
    if (g.up) group[j][1] = channel_group(g, g.up + col + j * kChannels);
  }
  const int32_t* up = sums + rows * ld;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 a_scale = _mm512_set1_ps(g.a_scale[row + r]);
    T* out = g.out + (row + r) * g.ldo + col;
    for (int64_t j = 0; j < groups; ++j) {
      const int64_t at = r * ld + j * kChannels;
      if (g.up)
        finish_gated16(g, sums + at, up + at, a_scale, group[j], out + j * kChannels);
      else
        finish16(g, sums + at, a_scale, group[j][0], out + j * kChannels);
    }
  }
}

void store_bf16(const float* sums, int64_t ld, int64_t rows, int64_t cols, const float* bias,
                uint16_t* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)  // as finish: a row's channels together
    for (int64_t j = 0; j < cols; j += kChannels)
      store_sums16(sums + r * ld + j, bias ? bias + j : nullptr, first_lanes(cols - j),
                   out + r * ldo + j);
}

void store_gated_bf16(const float* sums, int64_t ld, int64_t rows, int64_t cols, uint16_t* out,
                      int64_t ldo) {
  const float* up = sums + rows * ld;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; j += kChannels)
      store_gated16(_mm512_loadu_ps(sums + r * ld + j), _mm512_loadu_ps(up + r * ld + j),
                    first_lanes(cols - j), out + r * ldo + j);
}

// Q steps of 16 channels: 2 * Q sums of the pair's product over ranks [t0, t1) in registers,
// each of b's vectors read once for all of them.
template <int Q>
void merge_steps(const uint16_t* packed, int64_t steps, int64_t panel, const float* bt,
                 const float* a, int64_t n, int64_t t0, int64_t t1, int64_t p, int64_t q,
                 int64_t c, uint16_t* out) {
  const int64_t k = 2 * steps, channel = p * panel + c;
  const __mmask16 mask = first_lanes(n - channel);  // none past n: the padding stays
  __m512 sums[Q][2];
  for (int i = 0; i < Q; ++i) sums[i][0] = sums[i][1] = _mm512_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    const __m512 b = _mm512_maskz_loadu_ps(mask, bt + t * n + channel);
    const float* values = a + t * k + 2 * q;
    for (int i = 0; i < Q; ++i)
      for (int e = 0; e < 2; ++e)
        sums[i][e] = _mm512_fmadd_ps(_mm512_set1_ps(values[2 * i + e]), b, sums[i][e]);
  }
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  auto rounded = [](__m512 v) {  // 16 bf16 in the low halves of 32-bit lanes
    return _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(to_bf16(reinterpret_cast<F16>(v))));
  };
  for (int i = 0; i < Q; ++i) {
    // 16 channels' values 2q (low half of each 32-bit lane) and 2q + 1 (high half)
    const int64_t at = ((p * steps + q + i) * panel + c) * 2;
    const __m512i w = _mm512_loadu_si512(packed + at);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, high));
    const __m512i lo = rounded(_mm512_add_ps(even, sums[i][0]));
    const __m512i hi = rounded(_mm512_add_ps(odd, sums[i][1]));
    _mm512_storeu_si512(out + at, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

void merge_pair_bf16(const uint16_t* packed, int64_t steps, int64_t panel, const float* bt,
                     const float* a, int64_t n, int64_t r, int64_t p0, int64_t p1,
                     uint16_t* out) {
  constexpr int kSteps = 6;  // 12 sums, 1 vector of b and a broadcast value in registers
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t c = 0; c < panel; c += kChannels) {
      // the ranks whose b is not all zero on these channels (a packed layer's pairs are
      // stacked block-diagonally: each shard's channels take its own ranks), [t0, t1)
      const int64_t channel = p * panel + c;
      const __mmask16 mask = first_lanes(n - channel);
      int64_t t0 = r, t1 = 0;
      for (int64_t t = 0; t < r; ++t) {
        const __m512 b = _mm512_maskz_loadu_ps(mask, bt + t * n + channel);
        if (_mm512_cmpneq_ps_mask(b, _mm512_setzero_ps())) t0 = std::min(t0, t), t1 = t + 1;
      }
      int64_t q = 0;
      for (; q + kSteps <= steps; q += kSteps)
        merge_steps<kSteps>(packed, steps, panel, bt, a, n, t0, t1, p, q, c, out);
      for (; q < steps; ++q) merge_steps<1>(packed, steps, panel, bt, a, n, t0, t1, p, q, c, out);
    }
}

}  // namespace

extern const RowKernels rows = {quantize<float>,  quantize<uint16_t>, finish<float>,
                                finish<uint16_t>, store_bf16,         store_gated_bf16,
                                merge_pair_bf16};

}  // namespace gemm
}  // namespace qe
