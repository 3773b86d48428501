// The int8 route's GEMM on CPUs with AVX2 and no VNNI (ops.cpp int8_gemm_avx2), compiled with
// AVX2 flags (native/build.py). Without VNNI there is no int8 dot-product instruction that
// cannot saturate, but vpmaddwd multiplies int16 pairs and adds each pair's two products into
// int32 exactly: the int8 codes travel as int16, two input values per lane, and the sums are
// the same exact integers as any other int8 GEMM's. The rescale follows torch's order of the
// route's arithmetic (int8._rescale: sum as fp32, times the row's scale, times the channel's),
// so the outputs are torch's bits.
#include <immintrin.h>
#include <string.h>

#include "gemm.h"

namespace qe {
namespace gemm {
namespace {

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

// Rows [row, row + R) x the 16 channels of the panel at `col`, over the whole depth: the sums
// stay in 2R named registers (GCC keeps an array of them in memory), then the rescale and a
// store of the channels below `cols`.
template <int R>
void block(const PairsGemm& g, int64_t row, int64_t col, int64_t cols) {
  static_assert(R >= 1 && R <= 4);
  const int64_t k = g.k_pad;
  const int16_t* w = g.packed + col * k;  // the panel: [k_pad / 2][16][2]
  const int16_t* a = g.a + row * k;
  __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00,
          s30 = s00, s31 = s00;
  for (int64_t p = 0; p < k; p += 2) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 16));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 16 + 16));
    __m256i x = pair_at(a, p);
    multiply_add(s00, x, w0);
    multiply_add(s01, x, w1);
    if constexpr (R > 1) {
      x = pair_at(a + k, p);
      multiply_add(s10, x, w0);
      multiply_add(s11, x, w1);
    }
    if constexpr (R > 2) {
      x = pair_at(a + 2 * k, p);
      multiply_add(s20, x, w0);
      multiply_add(s21, x, w1);
    }
    if constexpr (R > 3) {
      x = pair_at(a + 3 * k, p);
      multiply_add(s30, x, w0);
      multiply_add(s31, x, w1);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
  const __m256 ws0 = _mm256_loadu_ps(g.w_scale + col), ws1 = _mm256_loadu_ps(g.w_scale + col + 8);
  const __m256i sums[4][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};
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
    for (; row + 4 <= row1; row += 4) block<4>(g, row, col, cols);
    switch (row1 - row) {
      case 3: block<3>(g, row, col, cols); break;
      case 2: block<2>(g, row, col, cols); break;
      case 1: block<1>(g, row, col, cols); break;
    }
  }
}

}  // namespace

extern const PairsKernel pairs_avx2 = pairs;

}  // namespace gemm
}  // namespace qe
