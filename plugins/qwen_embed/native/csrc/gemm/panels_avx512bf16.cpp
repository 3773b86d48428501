// batch_invariant's bf16 GEMM on CPUs with AVX512_BF16 and no AMX (Zen 4 and later, Cooper
// Lake), in place of oneDNN's brgemm micro-kernel: one panel of 64 channels times all of a
// task's rows, in blocks of up to 6 rows whose 6 x 4 vectors of sums stay in registers, each
// sum one chain of vdpbf16ps along the whole width in ascending pairs from zero, as the
// micro-kernel's, so the two give the same bits (tested) and a row's sums never depend on the
// rows beside it. Faster on few rows, whose weights stream from memory: one row's loop is a
// plain stream of the panel, and where rows take several blocks the next panel is fetched into
// L2 meanwhile (spread over the blocks), so memory and the vector units work at once; the
// micro-kernel reads the panel in its first row block and leaves memory idle during the others.
// Compiled with AVX-512 and AVX512_BF16 flags (native/build.py), chosen at run time (ops.cpp).
#include <immintrin.h>
#include <string.h>

#include "gemm.h"

namespace qe {
namespace gemm {
namespace {

constexpr int kVectors = kPanel / 16;  // vectors of 16 fp32 sums per row of a panel
constexpr int kMostRows = 6;           // rows per block: 6 x 4 sums and 4 weight vectors
constexpr int64_t kLine = 64;

// The next panel's cache lines fetched into L2 a few per step, from `next` to `end`.
struct Ahead {
  const char *next, *end;
  int per_step;

  inline void step() {
    for (int i = 0; i < per_step && next < end; ++i, next += kLine)
      _mm_prefetch(next, _MM_HINT_T1);
  }
};

// R rows of `a` (k = 2 x pairs bf16 values, row stride lda) times one panel ([pairs][64][2])
// -> sums [R][64].
template <int R>
void row_block(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t pairs,
               float* sums, Ahead ahead) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* w = panel + j * 2 * kPanel;
    __m512bh b[kVectors];
    for (int v = 0; v < kVectors; ++v)
      b[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + v * 32));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      memcpy(&pair, a + r * lda + 2 * j, sizeof pair);
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, b[v]);
    }
    ahead.step();
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(sums + r * kPanel + v * 16, acc[r][v]);
}

using RowBlock = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, Ahead);
constexpr RowBlock kRowBlocks[kMostRows] = {row_block<1>, row_block<2>, row_block<3>,
                                            row_block<4>, row_block<5>, row_block<6>};

// `rows` rows of `a` times one panel of k values per channel -> sums [rows][64]; `next` the
// panel to fetch meanwhile (or null).
void panel_sums(const uint16_t* a, int64_t lda, int64_t rows, const uint16_t* panel, int64_t k,
                const uint16_t* next, float* sums) {
  const int64_t pairs = k / 2, blocks = (rows + kMostRows - 1) / kMostRows;
  // one block reads the panel once, on demand, and the CPU's own prefetch keeps memory busy
  // (fetching ahead as well made it slower); memory idles while later blocks reread it
  const int64_t lines = next && blocks > 1 ? k * kPanel * 2 / kLine : 0;
  const int per_step = static_cast<int>((lines + pairs * blocks - 1) / (pairs * blocks));
  const char* fetch = reinterpret_cast<const char*>(next);
  for (int64_t i = 0, row = 0; i < blocks; ++i) {
    // blocks as even as they come: 15 rows are 5 + 5 + 5
    const int64_t count = rows / blocks + (i < rows % blocks);
    const int64_t share = lines * (i + 1) / blocks - lines * i / blocks;
    const Ahead ahead{fetch, fetch + share * kLine, per_step};
    kRowBlocks[count - 1](a + row * lda, lda, panel, pairs, sums + row * kPanel, ahead);
    fetch += share * kLine;
    row += count;
  }
}

}  // namespace

extern const Bf16Panels bf16_panels = {panel_sums};

}  // namespace gemm
}  // namespace qe
