// bf16 attention on AVX512_BF16's dot products (vdpbf16ps: each fp32 lane adds the products of
// a pair of bf16 values), for CPUs that have them but no AMX. attention.h's task (spans, online
// softmax, row independence) with another Path; what changes is the data: keys are
// packed as pairs of consecutive dimensions, transposed ([D / 2][kChunk] pairs per chunk),
// values as pairs of consecutive keys ([n_k / 2][D] pairs), and the probabilities are rounded
// to bf16 pairs before P V, as the AMX kernels do. q K^T is exact products of the bf16 inputs
// summed in fp32.
#pragma once
#include <immintrin.h>

#include "attention.h"

namespace qe {
namespace QE_ISA {
namespace {

// A segment's keys of one kv head -> chunks of [D / 2][kChunk] dimension pairs (32 bits each,
// transposed as attention.h's fp32 keys are; keys past n_k are zeros), its values -> [n_k / 2]
// rows of D key pairs (the even key in the low half; a missing odd key is zero).
template <int D>
void pack_pairs_heads(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                      int64_t n_k, uint32_t* kp, uint32_t* vp) {
  static_assert(D / 2 % kVec == 0 && kVec == 16);
  const uint16_t zeros[D] = {};
  for (int64_t start = 0; start < n_k; start += kChunk) {
    uint32_t* kt = kp + start * D / 2;
    for (int64_t j0 = 0; j0 < kChunk; j0 += kVec)
      for (int p0 = 0; p0 < D / 2; p0 += kVec) {
        Vec r[kVec];
        for (int i = 0; i < kVec; ++i) {
          const int64_t j = start + j0 + i;
          __builtin_memcpy(&r[i], (j < n_k ? k + j * k_stride : zeros) + 2 * p0, sizeof r[i]);
        }
        transpose(r);  // 32-bit lanes: a pair of bf16 moves as one float would
        float* rows = reinterpret_cast<float*>(kt) + p0 * kChunk + j0;
        for (int i = 0; i < kVec; ++i) store(rows + i * kChunk, r[i]);
      }
  }
  const int64_t pairs = (n_k + kChunk - 1) / kChunk * kChunk / 2;
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const uint16_t* even = 2 * jp < n_k ? v + 2 * jp * v_stride : zeros;
    const uint16_t* odd = 2 * jp + 1 < n_k ? v + (2 * jp + 1) * v_stride : zeros;
    for (int d0 = 0; d0 < D; d0 += 32) {  // 32 values of each key -> 32 pairs
      const __m512i a = _mm512_loadu_si512(even + d0), b = _mm512_loadu_si512(odd + d0);
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      // unpack works within 128-bit lanes: put the pairs back in dimension order
      const __m512i first = _mm512_permutex2var_epi64(
          lo, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi);
      const __m512i second = _mm512_permutex2var_epi64(
          lo, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), hi);
      _mm512_storeu_si512(vp + jp * D + d0, first);
      _mm512_storeu_si512(vp + jp * D + d0 + 16, second);
    }
  }
}

void pack_pairs(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                int64_t n_k, int64_t head_dim, void* kp, void* vp) {
  with_head_dim(head_dim, [&](auto d) {
    pack_pairs_heads<d>(k, k_stride, v, v_stride, n_k, static_cast<uint32_t*>(kp),
                        static_cast<uint32_t*>(vp));
  });
}

// Two consecutive bf16 values (a query's dimension pair, or a row's probabilities of a key
// pair) in every 32-bit lane, for vdpbf16ps.
inline __m512bh broadcast_pair(const uint16_t* x) {
  uint32_t pair;
  __builtin_memcpy(&pair, x, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// s[r][0:N kVec] = q[r] . k_j for R rows of bf16 queries (pairs read as 32 bits).
template <int D, int R, int N>
inline void scores_pairs(const uint16_t* q, const uint32_t* kt, float* s) {
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh k[N];
    for (int n = 0; n < N; ++n)
      k[n] = (__m512bh)_mm512_loadu_si512(kt + p * kChunk + n * kVec);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = broadcast_pair(q + r * D + 2 * p);
      for (int n = 0; n < N; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], x, k[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(s + r * kSpan + n * kVec, acc[r][n]);
}

// acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v_j over n keys (pairs), R rows of bf16
// probabilities kSpan apart, C vectors of values at a time.
template <int D, int R, int C>
inline void accumulate_pairs(float* acc, const uint16_t* p, const float* alpha,
                             const uint32_t* v, int64_t n) {
  static_assert(D % (C * kVec) == 0);
  const int64_t pairs = (n + 1) / 2;
  for (int c0 = 0; c0 < D; c0 += C * kVec) {
    __m512 o[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + c0 + c * kVec),
                                _mm512_set1_ps(alpha[r]));
    for (int64_t jp = 0; jp < pairs; ++jp) {
      __m512bh vj[C];
      for (int c = 0; c < C; ++c)
        vj[c] = (__m512bh)_mm512_loadu_si512(v + jp * D + c0 + c * kVec);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = broadcast_pair(p + r * kSpan + 2 * jp);
        for (int c = 0; c < C; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], x, vj[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + c0 + c * kVec, o[r][c]);
  }
}

// attention.h's attend_task on the pair layouts: bf16 queries, probabilities rounded to bf16.
struct PairPath {
  using Query = uint16_t;
  using Prob = uint16_t;
  using Packed = uint32_t;
  static uint16_t query(uint16_t x) { return x; }
  static uint16_t* probs(float*, uint16_t* pb) { return pb; }
  static void put(uint16_t* row, int64_t j, Vec p) {
    __m512 x;
    __builtin_memcpy(&x, &p, sizeof x);
    const __m256bh h = _mm512_cvtneps_pbh(x);
    __builtin_memcpy(row + j, &h, sizeof h);
  }
  template <int D, int R, int N>
  static void score_tile(const uint16_t* q, const uint32_t* kp, int64_t key, float* s) {
    scores_pairs<D, R, N>(q, kp + key * D / 2, s);
  }
  template <int D, int R, int C>
  static void value_tile(float* acc, const uint16_t* p, const float* alpha, const uint32_t* vp,
                         int64_t key, int64_t n) {
    accumulate_pairs<D, R, C>(acc, p, alpha, vp + key / 2 * D, n);
  }
};

void attend_pairs(const uint16_t* q, int64_t q_stride, const void* kp, const void* vp,
                  uint16_t* out, int64_t out_stride, int64_t rows, int64_t first_pos, int64_t n_k,
                  int64_t head_dim, bool causal, float scale) {
  attend_with<PairPath>(q, q_stride, kp, vp, out, out_stride, rows, first_pos, n_k, head_dim,
                        causal, scale);
}

}  // namespace
}  // namespace QE_ISA
}  // namespace qe
