// The int8 route's row work and GEMM on CPUs with AVX2 and no VNNI (ops.cpp int8_linear_avx2),
// compiled with AVX2 flags (native/build.py). Without VNNI there is no int8 dot-product
// instruction that cannot saturate, but vpmaddwd multiplies int16 pairs and adds each pair's
// two products into int32 exactly: the int8 codes travel as int16, two input values per lane,
// and the sums are the same exact integers as any other int8 GEMM's. The weights stay int8 in
// memory and are widened as they are loaded: on few rows, where they stream from memory, half
// the bytes to read. The rotation, the quantisation and the rescale repeat torch's operations
// in torch's order (int8.hadamard_rows, quantize_rows, _rescale: sum as fp32, times the row's
// scale, times the channel's), so the outputs are the torch route's bits.
#include <immintrin.h>
#include <string.h>

#include <vector>

#include "gemm.h"

// numerics.h's helpers (the rotation, bf16 values) for these sources' flags, in a namespace of
// their own (qe::gemm)
#define QE_ISA gemm
#include "../numerics.h"

namespace qe {
namespace gemm {
namespace {

// The largest magnitude of k values.
inline float largest_magnitude(const float* values, int64_t k) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= k; j += 8)
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(values + j)));
  float lanes[8];
  _mm256_storeu_ps(lanes, amax);
  float most = 0.0f;
  for (float l : lanes) most = std::max(most, l);
  for (; j < k; ++j) most = std::max(most, __builtin_fabsf(values[j]));
  return most;
}

// A row of k values (rotated first per `block` values when block > 1, into `rotated`) -> k_pad
// int16 codes (int8.quantize_rows's: the values times the reciprocal of amax / 127, rounded to
// nearest even; the padding 0) and its scale.
template <typename T>
void quantize_row(const T* row, int64_t k, int64_t k_pad, int64_t block, float* rotated,
                  int16_t* codes, float* scale) {
  const float* values = rotated;
  float most;
  if (block > 1) {
    most = hadamard_row(row, k, block, rotated);  // numerics.h, as the other kernels rotate
  } else {
    if constexpr (sizeof(T) == sizeof(float))
      values = row;
    else
      for (int64_t j = 0; j < k; ++j) rotated[j] = to_float(row[j]);
    most = largest_magnitude(values, k);
  }
  const float s = std::max(most, 1e-12f) / 127.0f;
  *scale = s;
  const float inv = 1.0f / s;
  const __m256 inv8 = _mm256_set1_ps(inv);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    __m256i c[2];
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(values + j + 8 * h), inv8),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    }
    // packs works per 128-bit half: put the halves back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j), packed);
  }
  for (; j < k; ++j) {
    const float v = __builtin_nearbyintf(values[j] * inv);
    codes[j] = static_cast<int16_t>(std::min(std::max(v, -127.0f), 127.0f));
  }
  for (; j < k_pad; ++j) codes[j] = 0;
}

template <typename T>
void quantize(const T* x, int64_t stride, int64_t rows, int64_t k, int64_t k_pad, int64_t block,
              int16_t* codes, float* scale) {
  thread_local std::vector<float> rotated;
  rotated.resize(k);
  for (int64_t i = 0; i < rows; ++i)
    quantize_row(x + i * stride, k, k_pad, block, rotated.data(), codes + i * k_pad, scale + i);
}

// Input values p and p + 1 of a row, broadcast as one int16 pair per lane.
inline __m256i pair_at(const int16_t* row, int64_t p) {
  int32_t pair;
  memcpy(&pair, row + p, sizeof pair);
  return _mm256_set1_epi32(pair);
}

inline void multiply_add(__m256i& sums, __m256i pairs, __m256i weights) {
  sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, weights));
}

// 8 channels' fp32 outputs of one row: sum as fp32, times the row's scale, times the channels'.
inline void store8(float* out, __m256i sums, float a_scale, __m256 w_scale, __m256i mask) {
  const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(a_scale));
  _mm256_maskstore_ps(out, mask, _mm256_mul_ps(v, w_scale));
}

// 8 channels' pairs of int8 weights, widened to int16.
inline __m256i weights_at(const int8_t* w) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

// Rows [row, row + R) x the 16 channels of the panel at `col`, over the whole depth: the sums
// stay in 2R named registers (GCC keeps an array of them in memory), then the rescale and a
// store of the channels below `cols`.
template <int R>
void block(const PairsGemm& g, int64_t row, int64_t col, int64_t cols) {
  static_assert(R >= 1 && R <= 6);
  const int64_t k = g.k_pad;
  const int8_t* w = g.packed + col * k;  // the panel: [k_pad / 2][16][2]
  const int16_t* a = g.a + row * k;
  __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00,
          s30 = s00, s31 = s00, s40 = s00, s41 = s00, s50 = s00, s51 = s00;
  for (int64_t p = 0; p < k; p += 2) {
    const __m256i w0 = weights_at(w + p * 16);
    const __m256i w1 = weights_at(w + p * 16 + 16);
#define QE_PAIRS(i, lo, hi)                  \
  if constexpr (R > i) {                     \
    const __m256i x = pair_at(a + i * k, p); \
    multiply_add(lo, x, w0);                 \
    multiply_add(hi, x, w1);                 \
  }
    QE_PAIRS(0, s00, s01) QE_PAIRS(1, s10, s11) QE_PAIRS(2, s20, s21)
    QE_PAIRS(3, s30, s31) QE_PAIRS(4, s40, s41) QE_PAIRS(5, s50, s51)
#undef QE_PAIRS
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
  const __m256 ws0 = _mm256_loadu_ps(g.w_scale + col), ws1 = _mm256_loadu_ps(g.w_scale + col + 8);
  const __m256i sums[6][2] = {{s00, s01}, {s10, s11}, {s20, s21},
                              {s30, s31}, {s40, s41}, {s50, s51}};
  for (int r = 0; r < R; ++r) {
    float* out = g.out + (row + r) * g.n + col;
    store8(out, sums[r][0], g.a_scale[row + r], ws0, m0);
    store8(out + 8, sums[r][1], g.a_scale[row + r], ws1, m1);
  }
}

void pairs(const PairsGemm& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1) {
  for (int64_t col = col0; col < col1; col += kPairsPanel) {
    const int64_t cols = std::min<int64_t>(kPairsPanel, g.n - col);
    int64_t row = row0;
    for (; row + 6 <= row1; row += 6) block<6>(g, row, col, cols);
    switch (row1 - row) {
      case 5: block<5>(g, row, col, cols); break;
      case 4: block<4>(g, row, col, cols); break;
      case 3: block<3>(g, row, col, cols); break;
      case 2: block<2>(g, row, col, cols); break;
      case 1: block<1>(g, row, col, cols); break;
    }
  }
}

}  // namespace

extern const PairsKernels pairs_avx2 = {quantize<float>, quantize<uint16_t>, pairs};

}  // namespace gemm
}  // namespace qe
