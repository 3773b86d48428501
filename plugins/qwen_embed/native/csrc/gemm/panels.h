// The frame of our panel kernels (panels_avx512bf16.cpp: bf16 pairs, vdpbf16ps; panels_vnni.cpp:
// int8 quads, vpdpbusd): all of a task's rows times one panel of 64 channels, each step of the
// width 4 bytes of a row against the panel's 256 bytes for that step (weights packed
// [n_pad / 64][steps][64][4 bytes]: native.pack_panels, int8.pack), in blocks of up to 6 rows
// whose 6 x 4 vectors of sums stay in registers; each sum one chain of the step instruction
// along the whole width from zero, as oneDNN's brgemm micro-kernel sums, so the two give the same
// bits and a row's sums never depend on the rows beside it. Faster on few rows, whose weights
// stream from memory: one block's loop is a plain stream of the panel, and where rows take
// several blocks the next panel is fetched into L2 meanwhile (ahead.h), so memory and the
// vector units work at once, where the micro-kernel leaves memory idle after its first row
// block. Each source includes this with its own flags.
#pragma once
#include <immintrin.h>
#include <string.h>

#include "ahead.h"
#include "gemm.h"

namespace qe {
namespace gemm {
namespace {

constexpr int kVectors = kPanel / 16;  // vectors of 16 sums per row of a panel
constexpr int64_t kStepBytes = kPanel * 4;

// R rows of `a` (4 bytes per step, row stride lda bytes) times one panel -> sums [R][64]. Step:
// zero() and the vector type of the sums, add(sums, 16 copies of a row's 4 bytes, 16 channels'
// 4 bytes), store(p, sums), and kMostRows, the most rows per block (6: 6 x 4 sums and 4
// weight vectors in registers).
template <typename Step, int R>
void row_block(const char* a, int64_t lda, const char* panel, int64_t steps, void* out,
               Ahead ahead) {
  using Sums = decltype(Step::zero());
  Sums acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = Step::zero();
  for (int64_t j = 0; j < steps; ++j) {
    const char* w = panel + j * kStepBytes;
    __m512i b[kVectors];
    for (int v = 0; v < kVectors; ++v) b[v] = _mm512_loadu_si512(w + v * 64);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      memcpy(&quad, a + r * lda + 4 * j, sizeof quad);
      const __m512i x = _mm512_set1_epi32(quad);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = Step::add(acc[r][v], x, b[v]);
    }
    ahead.step();
  }
  char* sums = static_cast<char*>(out);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) Step::store(sums + (r * kPanel + v * 16) * 4, acc[r][v]);
}

// gemm.h's PanelKernel::sums on Step: `rows` rows of `a` (lda values apart) times one panel of k
// values per channel -> sums [rows][64]; `next` the panel to fetch meanwhile (or null).
template <typename Step, typename A, typename B, typename Sum>
void panel_sums(const A* a, int64_t lda, int64_t rows, const B* panel, int64_t k, const B* next,
                Sum* sums) {
  using RowBlock = void (*)(const char*, int64_t, const char*, int64_t, void*, Ahead);
  static constexpr RowBlock blocks_of[] = {row_block<Step, 1>, row_block<Step, 2>,
                                           row_block<Step, 3>, row_block<Step, 4>,
                                           row_block<Step, 5>, row_block<Step, 6>};
  static_assert(Step::kMostRows <= 6);
  const char* row_bytes = reinterpret_cast<const char*>(a);
  const int64_t stride = lda * sizeof(A), steps = k * sizeof(B) / 4;
  const int64_t blocks = (rows + Step::kMostRows - 1) / Step::kMostRows;
  for (int64_t i = 0, row = 0; i < blocks; ++i) {
    const int64_t count = block_rows(rows, blocks, i);
    blocks_of[count - 1](row_bytes + row * stride, stride, reinterpret_cast<const char*>(panel),
                         steps, sums + row * kPanel,
                         Ahead::share(next, steps * kStepBytes, blocks, i, steps));
    row += count;
  }
}

}  // namespace
}  // namespace gemm
}  // namespace qe
