// Qwen3.5's gated delta rule (gated_delta.py) as its recurrence, in fp32: per token,
//   S = exp(g) S,   S = S + k (beta (v - S^T k))^T,   o = S^T q
// with q and k L2-normalised (q also scaled), as transformers' recurrent form computes it. The
// state's value columns never mix: a task is one head of one sequence, its state in blocks of
// 16 columns (key dim x 16 values each, in L1 while it goes through a tile of rows). A block
// short of 16 columns, and the key dim rounded up to the sums' chains (kStateChains
// independent sums: the adds' latency), compute on zeros, which stay zero. The chunked torch
// form (the reference) does the same arithmetic in another order.
#pragma once
#include "numerics.h"

namespace qe {
namespace QE_ISA {
namespace {

// Each head of d values of `rows` rows (strided) L2-normalised in fp32, then times `scale`
// (transformers' l2norm), into out [rows, heads, padded] (zeros after the d values): once per
// token, for every value column block to read.
template <typename T>
void l2_heads(const T* x, int64_t stride, int64_t rows, int64_t heads, int64_t d,
              int64_t padded, float scale, float eps, float* out) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const T* head = x + t * stride + h * d;
      float* dst = out + (t * heads + h) * padded;
      const float inverse = 1.0f / __builtin_sqrtf(sum_squares(head, d) + eps);
      for (int64_t i = 0; i < d; ++i) dst[i] = to_float(head[i]) * inverse * scale;
      for (int64_t i = d; i < padded; ++i) dst[i] = 0.0f;
    }
}

// The first `width` of 16 values (the rest zero), and back.
template <typename T>
inline F16 load_first(const T* p, int64_t width) {
  if (width == 16) return load16(p);
  float part[16] = {};
  for (int64_t j = 0; j < width; ++j) part[j] = to_float(p[j]);
  return load16(part);
}
inline void store_first(float* p, F16 v, int64_t width) {
  if (width == 16) return store16(p, v);
  float part[16];
  store16(part, v);
  for (int64_t j = 0; j < width; ++j) p[j] = part[j];
}

// One block's state s (16 columns, `width` of them real) over rows [first, end): q, k rows of
// `keys` values apart (normalised, the key dim padded to `chained`), v of the block's columns,
// decays and rates `heads` apart, outputs `out_stride` apart.
template <typename T>
inline void delta_block(F16* s, int64_t chained, const float* q, const float* k, int64_t keys,
                        const T* v, int64_t v_stride, const float* g, const float* beta,
                        int64_t heads, float* out, int64_t out_stride, int64_t width,
                        int64_t first, int64_t end) {
  for (int64_t t = first; t < end; ++t) {
    const float* kn = k + t * keys;
    const float* qn = q + t * keys;
    const float decay = __builtin_expf(g[t * heads]), rate = beta[t * heads];
    F16 sums[kStateChains] = {};
    for (int64_t i = 0; i < chained; i += kStateChains)
      for (int j = 0; j < kStateChains; ++j) sums[j] += s[i + j] * kn[i + j];
    const F16 recalled = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    const F16 update = (load_first(v + t * v_stride, width) - recalled * decay) * rate;
    F16 outs[kStateChains] = {};
    for (int64_t i = 0; i < chained; i += kStateChains)
      for (int j = 0; j < kStateChains; ++j) {
        s[i + j] = s[i + j] * decay + update * kn[i + j];
        outs[j] += s[i + j] * qn[i + j];
      }
    store_first(out + t * out_stride, (outs[0] + outs[1]) + (outs[2] + outs[3]), width);
  }
}

constexpr int64_t kTileRows = 16;  // rows each block goes through before the next block's turn

// Value head `head` of one sequence (`sequence`, rows [first, end)): outputs into a.out; the
// state from a.states or zero, copied to a.exports after each row in cut_row[0..cuts)
// (ascending) at slot cut_slot[c]. Its value columns go in blocks of 16 (`scratch` holds their
// states: blocks x chained x 16 floats, 64-byte aligned), a tile of rows at a time, so that the
// tile's q and k rows are read from L1 by every block.
template <typename T>
void delta_rule(const DeltaRuleArgs& a, int64_t sequence, int64_t first, int64_t end,
                int64_t head, float* scratch, const int64_t* cut_row, const int64_t* cut_slot,
                int64_t cuts) {
  const int64_t dk = a.key_dim, dv = a.value_dim, hv = a.value_heads, chained = a.chained;
  const int64_t key_head = head / a.repeat, head_state = head * dk * dv;
  const int64_t keys = hv / a.repeat * chained;
  const int64_t blocks = (dv + kStateColumns - 1) / kStateColumns;
  F16* states = reinterpret_cast<F16*>(scratch);
  for (int64_t b = 0; b < blocks; ++b) {
    F16* s = states + b * chained;
    const int64_t col = b * kStateColumns;
    const int64_t width = dv - col < kStateColumns ? dv - col : kStateColumns;
    const float* start =
        a.states ? a.states + sequence * hv * dk * dv + head_state + col : nullptr;
    for (int64_t i = 0; i < chained; ++i)
      s[i] = start && i < dk ? load_first(start + i * dv, width) : F16{};
  }
  int64_t c = 0;
  for (int64_t tile = first; tile < end; tile += kTileRows) {
    const int64_t tile_end = tile + kTileRows < end ? tile + kTileRows : end;
    const int64_t tile_cuts = c;
    for (int64_t b = 0; b < blocks; ++b) {
      F16* s = states + b * chained;
      const int64_t col = b * kStateColumns;
      const int64_t width = dv - col < kStateColumns ? dv - col : kStateColumns;
      // up to each cut in the tile, its state exported, then on
      c = tile_cuts;
      for (int64_t at = tile; at < tile_end;) {
        const int64_t stop = c < cuts && cut_row[c] < tile_end ? cut_row[c] + 1 : tile_end;
        delta_block(s, chained, a.q + key_head * chained, a.k + key_head * chained, keys,
                    static_cast<const T*>(a.v) + head * dv + col, a.v_stride, a.g + head,
                    a.beta + head, hv, a.out + head * dv + col, hv * dv, width, at, stop);
        for (; c < cuts && cut_row[c] == stop - 1; ++c) {
          float* exported = a.exports + cut_slot[c] * hv * dk * dv + head_state + col;
          for (int64_t i = 0; i < dk; ++i) store_first(exported + i * dv, s[i], width);
        }
        at = stop;
      }
    }
  }
}

}  // namespace
}  // namespace QE_ISA
}  // namespace qe
