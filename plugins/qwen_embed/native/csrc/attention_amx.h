// bf16 attention on AMX tiles (Intel Sapphire Rapids and later), for kernels_amx.cpp: the same
// task and numerics as attention.h (fp32 scores and online softmax over key blocks at fixed
// positions, every row alone), with Q K^T and P V as tile products. Keys and values are first
// packed per (segment, kv head) into the tiles' pair-interleaved layout, once for all the query
// heads and blocks that read them; P is rounded to bf16 for its product, as torch's kernel does.
#pragma once
#include <immintrin.h>

#include "attention.h"
#include "tiles.h"

namespace qe {
namespace QE_ISA {
namespace {

constexpr int64_t kTileKeys = 32;  // a chunk of keys: the depth of one tile product
static_assert(kBlockQ == 32, "two tiles of 16 query rows");

// A score row's floats: one cache line past kSpan's 2 KB, so that the 16 rows of a tile store
// fall in 16 L1 sets; 2 KB apart they met in two, which made the stores slow.
constexpr int64_t kScoreStride = kSpan + 16;

// r[i] = lane i of the 16 inputs: a 16 x 16 transpose of 32-bit values.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit blocks: rows i, 4 + i, 8 + i, 12 + i
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// Asks for a row of D bf16 values before it is read (or, ET0, written).
template <int D, _mm_hint Hint = _MM_HINT_T0>
inline void prefetch_row(const uint16_t* row) {
  for (int l = 0; l < D * 2; l += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + l, Hint);
}

// A segment's keys of one kv head -> blocks of [D/2][32 keys][2] (the right operand of Q K^T,
// a transpose of the keys' value pairs), its values -> blocks of [16 key pairs][D][2] (of P V,
// each two keys' rows interleaved); keys past n_k are zeros.
template <int D>
void pack_tile_heads(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                     int64_t n_k, uint16_t* kp, uint16_t* vp) {
  constexpr int64_t K = kTileKeys;
  alignas(64) static const uint16_t zeros[D] = {};
  __m512i first_half, second_half;  // vpermt2w indices: a0 b0 a1 b1 ... / a16 b16 ...
  {
    alignas(64) uint16_t lo[32], hi[32];
    for (int i = 0; i < 16; ++i) {
      lo[2 * i] = i, lo[2 * i + 1] = 32 + i;
      hi[2 * i] = 16 + i, hi[2 * i + 1] = 48 + i;
    }
    first_half = _mm512_load_si512(lo);
    second_half = _mm512_load_si512(hi);
  }
  for (int64_t start = 0; start < n_k; start += K) {
    uint16_t* kb = kp + start * D;
    uint16_t* vb = vp + start * D;
    const uint16_t* keys[K];
    const uint16_t* values[K];
    for (int64_t j = 0; j < K; ++j) {
      keys[j] = start + j < n_k ? k + (start + j) * k_stride : zeros;
      values[j] = start + j < n_k ? v + (start + j) * v_stride : zeros;
      if (start + K + j < n_k) {  // the next chunk's rows, strided: no hardware prefetch
        prefetch_row<D>(k + (start + K + j) * k_stride);
        prefetch_row<D>(v + (start + K + j) * v_stride);
      }
    }
    for (int64_t j0 = 0; j0 < K; j0 += 16)
      for (int64_t d0 = 0; d0 < D; d0 += 32) {  // 16 keys x 16 value pairs
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(keys[j0 + j] + d0);
        transpose16(r);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kb + ((d0 / 2 + p) * K + j0) * 2, r[p]);
      }
    for (int64_t j = 0; j < K; j += 2)
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const __m512i a = _mm512_loadu_si512(values[j] + d0);
        const __m512i b = _mm512_loadu_si512(values[j + 1] + d0);
        _mm512_storeu_si512(vb + j * D + 2 * d0, _mm512_permutex2var_epi16(a, first_half, b));
        _mm512_storeu_si512(vb + j * D + 2 * d0 + 32,
                            _mm512_permutex2var_epi16(a, second_half, b));
      }
  }
}

void pack_tiles(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                int64_t n_k, int64_t head_dim, void* kp, void* vp) {
  with_head_dim(head_dim, [&](auto d) {
    pack_tile_heads<d>(k, k_stride, v, v_stride, n_k, static_cast<uint16_t*>(kp),
                       static_cast<uint16_t*>(vp));
  });
}

// 2^x where the result is rounded to bf16 next (P for P V): a degree-3 polynomial for 2^f, f in
// [-0.5, 0.5], within 1e-4 of it (a bf16 step is 2^-8), and the integer part by scalef.
inline __m512 exp2_for_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));  // no denormals
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, k);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(5.5175911635e-02f),
                             _mm512_set1_ps(2.4261151254e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9326019287e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992799759e-01f));
  return _mm512_scalef_ps(p, k);
}

// softmax_span (attention.h) for the tile path, in two light passes over the row's n scores
// (n a multiple of 32): the largest of its first `valid` raw scores, then
// p = 2^(s log2(e) scale - max) by one FMA and exp2_for_bf16, stored to p as bf16 and summed
// in a fixed order (key j in a fixed lane); the running max as there (raise_max).
inline float softmax_span_bf16(const float* s, int64_t n, int64_t valid, float scale, float& max,
                               float& sum, uint16_t* p) {
  const float scale2 = scale * 1.44269504088896341f;  // log2(e)
  const int64_t seen = valid < n ? valid : n;
  __m512 top0 = _mm512_set1_ps(kNegInf), top1 = top0;
  int64_t c = 0;
  for (; c + 32 <= seen; c += 32) {
    top0 = _mm512_max_ps(top0, _mm512_loadu_ps(s + c));
    top1 = _mm512_max_ps(top1, _mm512_loadu_ps(s + c + 16));
  }
  for (; c < seen; c += 16)
    top0 = _mm512_mask_max_ps(top0, first_lanes(seen - c), top0, _mm512_loadu_ps(s + c));
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(top0, top1));
  // scale > 0 (the operator checks it), so the largest scaled score is the largest score scaled.
  const float alpha = raise_max(max, top * scale2);
  const __m512 step = _mm512_set1_ps(scale2), shift = _mm512_set1_ps(-max);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
  for (c = 0; c < n; c += 32) {
    __m512 p0 = exp2_for_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(s + c), step, shift));
    __m512 p1 = exp2_for_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(s + c + 16), step, shift));
    if (c + 32 > seen) {
      p0 = _mm512_maskz_mov_ps(first_lanes(seen - c), p0);
      p1 = _mm512_maskz_mov_ps(first_lanes(seen - c - 16), p1);
    }
    store16(p + c, reinterpret_cast<F16>(p0));
    store16(p + c + 16, reinterpret_cast<F16>(p1));
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
  }
  sum = sum * alpha + _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  return alpha;
}

// Scores of the query tile (two 16-row halves, or one when `half`) against `chunks` chunks of
// 32 packed keys -> s [32][kScoreStride] fp32.
template <int D>
inline void tile_scores(const uint16_t* q, const uint16_t* kb, int64_t chunks, bool half,
                        float* s) {
  constexpr int64_t K = kTileKeys;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint16_t* keys = kb + ch * K * D;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < D / 32; ++c) {  // 32 of the head's values per product
      _tile_loadd(4, q + c * 32, D * 2);
      _tile_loadd(6, keys + c * 16 * K * 2, K * 4);
      _tile_loadd(7, keys + c * 16 * K * 2 + 32, K * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (!half) {
        _tile_loadd(5, q + 16 * D + c * 32, D * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, s + ch * K, kScoreStride * 4);
    _tile_stored(1, s + ch * K + 16, kScoreStride * 4);
    if (!half) {
      _tile_stored(2, s + 16 * kScoreStride + ch * K, kScoreStride * 4);
      _tile_stored(3, s + 16 * kScoreStride + ch * K + 16, kScoreStride * 4);
    }
  }
}

// o [32][D] += P [32][chunks * 32] (bf16, row stride kSpan) times the packed values; the first
// span's products start from zero.
template <int D>
inline void tile_values(const uint16_t* pb, const uint16_t* vb, int64_t chunks, bool half,
                        bool first, float* o) {
  constexpr int64_t K = kTileKeys;
  for (int c = 0; c < D / 32; ++c) {  // 32 of the head's values per product
    float* oc = o + c * 32;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, oc, D * 4);
      _tile_loadd(1, oc + 16, D * 4);
      if (!half) {
        _tile_loadd(2, oc + 16 * D, D * 4);
        _tile_loadd(3, oc + 16 * D + 16, D * 4);
      }
    }
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const uint16_t* values = vb + ch * K * D + c * 64;
      _tile_loadd(4, pb + ch * K, kSpan * 2);
      _tile_loadd(6, values, D * 4);
      _tile_loadd(7, values + 32, D * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (!half) {
        _tile_loadd(5, pb + 16 * kSpan + ch * K, kSpan * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, oc, D * 4);
    _tile_stored(1, oc + 16, D * 4);
    if (!half) {
      _tile_stored(2, oc + 16 * D, D * 4);
      _tile_stored(3, oc + 16 * D + 16, D * 4);
    }
  }
}

// A task of up to kTaskRows query rows, in blocks of 32 (two 16-row tiles): keys in spans of
// kSpan (at multiples of kSpan in the segment, one softmax rescale per span), each span's
// products in chunks of 32 keys. Every block takes a span in turn, so the span's keys and
// values are read from memory once for all of them.
template <int D>
void attend_tile_heads(const uint16_t* q, int64_t q_stride, const uint16_t* kp,
                       const uint16_t* vp, uint16_t* out, int64_t out_stride, int64_t rows,
                       int64_t first_pos, int64_t n_k, bool causal, float scale) {
  constexpr int64_t R = kBlockQ, K = kTileKeys, G = kTaskRows / kBlockQ;
  alignas(64) static thread_local uint16_t qb[G][R * D], pb[R * kSpan];
  alignas(64) static thread_local float s[R * kScoreStride], o[G][R * D];
  RowBlocks rb(rows, 16, first_pos, n_k, causal);  // one or two 16-row tiles per block
  for (int64_t b = 0; b < rb.count; ++b)
    for (int64_t i = 0; i < rb.used[b]; ++i) {  // the queries, contiguous (tiles reread them)
      if (b * R + i + 8 < rows) prefetch_row<D>(q + (b * R + i + 8) * q_stride);
      if (b * R + i < rows)
        __builtin_memcpy(qb[b] + i * D, q + (b * R + i) * q_stride, D * 2);
      else
        __builtin_memset(qb[b] + i * D, 0, D * 2);
    }
  configure_tiles();
  for (int64_t start = 0; start < rb.last; start += kSpan)
    for (int64_t b = 0; b < rb.count; ++b) {
      if (start >= rb.end[b]) continue;
      if (start + kSpan >= rb.end[b])  // its last span: fetch the rows it writes at the end
        for (int64_t i = b * R; i < b * R + R && i < rows; ++i)
          prefetch_row<D, _MM_HINT_ET0>(out + i * out_stride);
      const bool half = rb.used[b] == 16;
      const int64_t chunks = ((rb.end[b] - start < kSpan ? rb.end[b] - start : kSpan) + K - 1) / K;
      tile_scores<D>(qb[b], kp + start * D, chunks, half, s);
      for (int64_t i = 0; i < rb.used[b]; ++i) {
        uint16_t* p = pb + i * kSpan;
        const int64_t valid = rb.limit[b][i] - start;
        if (valid <= 0) {  // this span is past the row's last key: leave the row as it is
          __builtin_memset(p, 0, chunks * K * 2);
          continue;
        }
        const float alpha = softmax_span_bf16(s + i * kScoreStride, chunks * K, valid, scale,
                                              rb.max[b][i], rb.sum[b][i], p);
        if (start > 0 && alpha != 1.0f)
          for (int d = 0; d < D; ++d) o[b][i * D + d] *= alpha;
      }
      tile_values<D>(pb, vp + start * D, chunks, half, start == 0, o[b]);
    }
  write_rows<uint16_t, D>(rb, o[0], rows, out, out_stride);
}

void attend_tiles(const uint16_t* q, int64_t q_stride, const void* kp, const void* vp,
                  uint16_t* out, int64_t out_stride, int64_t rows, int64_t first_pos,
                  int64_t n_k, int64_t head_dim, bool causal, float scale) {
  with_head_dim(head_dim, [&](auto d) {
    attend_tile_heads<d>(q, q_stride, static_cast<const uint16_t*>(kp),
                         static_cast<const uint16_t*>(vp), out, out_stride, rows, first_pos, n_k,
                         causal, scale);
  });
}

}  // namespace
}  // namespace QE_ISA
}  // namespace qe
