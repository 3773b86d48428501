// Fetching the next panel into L2 while a task's row blocks reread the current one (panels.h;
// not the AVX2 fp32 GEMM, where it measured no gain): with few rows a GEMM's weights stream
// from memory once, and a kernel that reads a panel in its first row block leaves memory idle
// during the others. Each block of rows fetches its share of the next panel's lines, a few
// per step: only where one task of rows holds all of a GEMM's rows (reads_panels_once: with
// more, fetching the panels that the next tasks reread from cache measured slower), and not
// with one block of rows, where the CPU's own prefetch does better (measured).
#pragma once
#include <stdint.h>
#include <xmmintrin.h>

namespace qe {
namespace gemm {
namespace {

constexpr int64_t kLine = 64;

struct Ahead {
  const char *next, *end;
  int64_t per_step;

  // Block i of `blocks` blocks of rows, each `steps` steps long: its share of the `bytes`
  // bytes from `panel` (the next panel, or null for none).
  static Ahead share(const void* panel, int64_t bytes, int64_t blocks, int64_t i, int64_t steps) {
    if (!panel || blocks <= 1) return {nullptr, nullptr, 0};
    const char* start = static_cast<const char*>(panel);
    const int64_t lines = bytes / kLine;
    const int64_t per_step = (lines + steps * blocks - 1) / (steps * blocks);
    return {start + lines * i / blocks * kLine, start + lines * (i + 1) / blocks * kLine,
            per_step};
  }

  inline void step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += kLine)
      _mm_prefetch(next, _MM_HINT_T1);
  }
};

// Whether a GEMM of m rows in tasks of task_rows rows reads each panel once, from memory.
inline bool reads_panels_once(int64_t m, int64_t task_rows) { return m <= task_rows; }

// Rows in row block i of `blocks` blocks of `rows` rows, as even as they come: 15 rows in
// blocks of up to 6 are 5 + 5 + 5.
inline int64_t block_rows(int64_t rows, int64_t blocks, int64_t i) {
  return rows / blocks + (i < rows % blocks);
}

}  // namespace
}  // namespace gemm
}  // namespace qe
