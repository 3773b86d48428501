// The fp32 GEMM of CPUs with AVX2 and no AVX-512 (ops.cpp f32_linear), compiled with AVX2 flags
// (native/build.py). Each output is one chain of fused multiply-adds over the input values in
// ascending order, then its bias: the depth is cut into blocks for the caches, but a block's
// partial sums go to the output and come back unchanged, so a row's result never depends on
// the rows or the threads beside it, with no rows padded (oneDNN's packed GEMM needs its one-row
// path avoided: row_plans.py). Weights that are bf16 values (a 16-bit checkpoint's) are held
// in bf16 and widened as they are loaded, exactly: the same products on half the bytes.
#include <immintrin.h>

#include <algorithm>

#include "gemm.h"

namespace qe {
namespace gemm {
namespace {

// Input values per depth block: a panel's block stays in L2 while the task's rows pass over it
// (L1-sized blocks, with their more frequent reloads of the partial sums, measured slower).
constexpr int64_t kDepthBlock = 1024;
constexpr int kTileRows = 6;  // 12 sums, 2 weight vectors, 1 input value: 15 of 16 registers

// One depth's 16 channels of a panel: channels 0-7 and 8-15 as fp32 vectors.
inline void weights_at(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}
// bf16 (gemm.h's order): a lane's low half is channel c, its high half channel c + 8.
inline void weights_at(const uint16_t* w, __m256& w0, __m256& w1) {
  const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(-65536)));
}

// Rows [0, R) of `a` (row stride lda) x the 16 channels of a panel block `w` ([depth][16]),
// over `depth` input values, into c (row stride ldc): started from zero when `first`, else from
// c; plus bias (16 values) when given. The sums live in 2R named registers (GCC keeps an array
// of them in memory).
template <int R, typename W>
void tile(const float* a, int64_t lda, const W* w, int64_t depth, bool first,
          const float* bias, float* c, int64_t ldc) {
  static_assert(R >= 1 && R <= kTileRows);
  const __m256 zero = _mm256_setzero_ps();
  __m256 s00 = zero, s01 = zero, s10 = zero, s11 = zero, s20 = zero, s21 = zero, s30 = zero,
         s31 = zero, s40 = zero, s41 = zero, s50 = zero, s51 = zero;
#define QE_LOAD(i, lo, hi)                  \
  if (R > i && !first) {                    \
    lo = _mm256_loadu_ps(c + i * ldc);      \
    hi = _mm256_loadu_ps(c + i * ldc + 8);  \
  }
  QE_LOAD(0, s00, s01) QE_LOAD(1, s10, s11) QE_LOAD(2, s20, s21)
  QE_LOAD(3, s30, s31) QE_LOAD(4, s40, s41) QE_LOAD(5, s50, s51)
#undef QE_LOAD
  for (int64_t p = 0; p < depth; ++p, w += kFloatPanel, ++a) {
    __m256 w0, w1, x;
    weights_at(w, w0, w1);
#define QE_FMA(i, lo, hi)                     \
  if (R > i) {                                \
    x = _mm256_broadcast_ss(a + i * lda);     \
    lo = _mm256_fmadd_ps(x, w0, lo);          \
    hi = _mm256_fmadd_ps(x, w1, hi);          \
  }
    QE_FMA(0, s00, s01) QE_FMA(1, s10, s11) QE_FMA(2, s20, s21)
    QE_FMA(3, s30, s31) QE_FMA(4, s40, s41) QE_FMA(5, s50, s51)
#undef QE_FMA
  }
  __m256 b0 = zero, b1 = zero;
  if (bias) {
    b0 = _mm256_loadu_ps(bias);
    b1 = _mm256_loadu_ps(bias + 8);
  }
#define QE_STORE(i, lo, hi)                                                \
  if (R > i) {                                                             \
    _mm256_storeu_ps(c + i * ldc, bias ? _mm256_add_ps(lo, b0) : lo);     \
    _mm256_storeu_ps(c + i * ldc + 8, bias ? _mm256_add_ps(hi, b1) : hi); \
  }
  QE_STORE(0, s00, s01) QE_STORE(1, s10, s11) QE_STORE(2, s20, s21)
  QE_STORE(3, s30, s31) QE_STORE(4, s40, s41) QE_STORE(5, s50, s51)
#undef QE_STORE
}

template <typename W>
using Tile = void (*)(const float*, int64_t, const W*, int64_t, bool, const float*, float*,
                      int64_t);
template <typename W>
constexpr Tile<W> kTiles[kTileRows + 1] = {nullptr,     tile<1, W>, tile<2, W>, tile<3, W>,
                                           tile<4, W>, tile<5, W>, tile<6, W>};

// Up to 6 rows x one panel's `cols` channels (fewer than 16, the last panel): through a 16-wide
// copy of the outputs and of the bias, so the tile kernel reads and writes whole vectors.
template <typename W>
void narrow_tile(int rows, const float* a, int64_t lda, const W* w, int64_t depth, bool first,
                 const float* bias, bool last, float* c, int64_t ldc, int64_t cols) {
  float sums[kTileRows][kFloatPanel] = {}, bias16[kFloatPanel] = {};
  for (int r = 0; r < rows; ++r) std::copy(c + r * ldc, c + r * ldc + cols, sums[r]);
  if (bias && last) std::copy(bias, bias + cols, bias16);
  kTiles<W>[rows](a, lda, w, depth, first, bias && last ? bias16 : nullptr, sums[0],
                  kFloatPanel);
  for (int r = 0; r < rows; ++r) std::copy(sums[r], sums[r] + cols, c + r * ldc);
}

template <typename W>
void floats_of(const FloatGemm& g, const W* packed, int64_t row0, int64_t row1, int64_t col0,
               int64_t col1) {
  for (int64_t p0 = 0; p0 < g.k; p0 += kDepthBlock) {
    const int64_t depth = std::min(kDepthBlock, g.k - p0);
    const bool first = p0 == 0, last = p0 + depth == g.k;
    for (int64_t col = col0; col < col1; col += kFloatPanel) {
      const W* w = packed + col * g.k + p0 * kFloatPanel;  // panel [k][16], from p0
      const float* bias = g.bias && last ? g.bias + col : nullptr;
      const int64_t cols = std::min(kFloatPanel, g.n - col);
      for (int64_t row = row0; row < row1; row += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, row1 - row));
        const float* a = g.a + row * g.lda + p0;
        float* c = g.out + row * g.ldo + col;
        if (cols == kFloatPanel)
          kTiles<W>[rows](a, g.lda, w, depth, first, bias, c, g.ldo);
        else
          narrow_tile(rows, a, g.lda, w, depth, first, g.bias ? g.bias + col : nullptr, last, c,
                      g.ldo, cols);
      }
    }
  }
}

void floats(const FloatGemm& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1) {
  if (g.packed_bf16)
    floats_of(g, g.packed_bf16, row0, row1, col0, col1);
  else
    floats_of(g, g.packed, row0, row1, col0, col1);
}

}  // namespace

extern const FloatKernels floats_avx2 = {floats};

}  // namespace gemm
}  // namespace qe
