// Varlen attention, written once and compiled per instruction set like rows.h: a segment's keys
// and values of one kv head are packed (keys transposed, fp32), then a task attends up to
// kTaskRows query rows of one head to them (attention_ops.cpp decides the tasks and spreads them over
// torch's threads; attention_amx.h is the same on AMX tiles).
//
// fp32 arithmetic and an online softmax over spans of keys that start at multiples of kSpan
// within the segment. Every query row is computed alone in a fixed order: its output depends
// only on its query and the keys it sees, never on the rows or segments beside it, so a text
// gets the same vector alone, in any batch, and after a cached prefix.
#pragma once
#include <type_traits>

#include "numerics.h"

namespace qe {
namespace QE_ISA {
namespace {

// One vector register of floats, and how many registers the blocking below may fill.
#if defined(__AVX512F__)
constexpr int kVec = 16, kRegisters = 32;
#elif defined(__AVX__)
constexpr int kVec = 8, kRegisters = 16;
#else
constexpr int kVec = 4, kRegisters = 16;
#endif
typedef float Vec __attribute__((vector_size(kVec * sizeof(float))));
typedef int32_t VecInt __attribute__((vector_size(kVec * sizeof(int32_t))));
constexpr float kNegInf = -__builtin_inff();
constexpr int64_t kSpan = 512;  // keys per softmax rescale, at fixed positions in the segment
constexpr int64_t kChunk = 4 * kVec;  // keys per score product
constexpr int64_t kHalfChunk = kChunk / 2;  // a span's last keys when no more are left
constexpr float kLazyMax = 8.0f;  // see softmax_span

// f(D) with D the head size as a compile-time constant (32, 64, 128 or 256: the operator checks
// it), for the kernels written per head size.
template <typename F>
inline void with_head_dim(int64_t head_dim, F f) {
  if (head_dim == 32) return f(std::integral_constant<int, 32>{});
  if (head_dim == 64) return f(std::integral_constant<int, 64>{});
  if (head_dim == 128) return f(std::integral_constant<int, 128>{});
  return f(std::integral_constant<int, 256>{});
}

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof v); }

// s[r][0:N kVec] = q[r] . k_j for R rows; kt holds a chunk of keys transposed [D][kChunk] (of
// which the first N vectors of keys are read).
template <int D, int R, int N>
inline void scores(const float* q, const float* kt, float* s) {
  Vec acc[R][N] = {};
  for (int d = 0; d < D; ++d) {
    Vec k[N];
    for (int n = 0; n < N; ++n) k[n] = load(kt + d * kChunk + n * kVec);
    for (int r = 0; r < R; ++r) {
      const float x = q[r * D + d];
      for (int n = 0; n < N; ++n) acc[r][n] += x * k[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) store(s + r * kSpan + n * kVec, acc[r][n]);
}

inline VecInt lane_index() {
  VecInt v;
  for (int l = 0; l < kVec; ++l) v[l] = l;
  return v;
}

// 2^x on 16 lanes: x split into an integer and f in [-0.5, 0.5], 2^f by a degree-5 polynomial
// fitted on that range (to fp32's precision). Softmax works in base 2: the scores are scaled by
// log2(e) once, which spares exp its own multiplication.
inline Vec exp2_vec(Vec x) {
  x = x > -126.0f ? x : -126.0f;  // 2^-126, the smallest normal: no denormal, no wrap
  const Vec k = (x + 12582912.0f) - 12582912.0f;  // round to the nearest integer
  const Vec f = x - k;
  Vec p = f * 1.3266970386e-03f + 9.6754597455e-03f;
  p = p * f + 5.5507426160e-02f;
  p = p * f + 2.4022121754e-01f;
  p = p * f + 6.9314694916e-01f;
  p = p * f + 1.0000000710e+00f;
  const VecInt bits = (__builtin_convertvector(k, VecInt) + 127) << 23;
  Vec scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A row's running max (base 2) after a span whose largest scaled score is block_max: it moves
// only when the span's exceeds it by kLazyMax (until then the probabilities may grow up to
// 2^kLazyMax, and nothing summed before needs rescaling). Returns the factor that rescales what
// was summed before (0 for the row's first span).
inline float raise_max(float& max, float block_max) {
  if (max == kNegInf) {
    max = block_max;
    return 0.0f;
  }
  if (block_max <= max + kLazyMax) return 1.0f;
  const float alpha = exp2_vec(Vec{} + (max - block_max))[0];
  max = block_max;
  return alpha;
}

// One row's n scores (n a multiple of 2 kVec) -> probabilities exp(scale * s - max) for its first
// `valid` keys (0 beyond), handed 16 at a time to put(j, p); updates the row's running max and
// sum (both in base 2) and returns the factor that rescales what was summed before. Key j goes
// to a fixed lane of a fixed sum tree, so the padding past `valid` (zeros) never changes a
// row's numbers.
template <typename Put>
inline float softmax_span(float* s, int64_t n, int64_t valid, float scale, float& max,
                          float& sum, Put put) {
  const float scale2 = scale * 1.44269504088896341f;  // log2(e)
  const int32_t seen = static_cast<int32_t>(valid < n ? valid : n);
  const VecInt lanes = lane_index();
  auto masked = [&](Vec x, int64_t c, float off) {
    return c + kVec > seen ? (lanes + static_cast<int32_t>(c) < seen ? x : off) : x;
  };
  // Two accumulators (alternate vectors of keys; n is a multiple of 2 kVec): no add waits on
  // the one before.
  Vec top0 = kNegInf + Vec{}, top1 = top0;
  for (int64_t c = 0; c < n; c += 2 * kVec) {
    const Vec x0 = masked(load(s + c) * scale2, c, kNegInf);
    const Vec x1 = masked(load(s + c + kVec) * scale2, c + kVec, kNegInf);
    store(s + c, x0);
    store(s + c + kVec, x1);
    top0 = top0 > x0 ? top0 : x0;
    top1 = top1 > x1 ? top1 : x1;
  }
  top0 = top0 > top1 ? top0 : top1;
  float block_max = kNegInf;
  for (int l = 0; l < kVec; ++l) block_max = block_max > top0[l] ? block_max : top0[l];
  const float alpha = raise_max(max, block_max);
  Vec sum0 = {}, sum1 = {};
  for (int64_t c = 0; c < n; c += 2 * kVec) {
    const Vec p0 = masked(exp2_vec(load(s + c) - max), c, 0.0f);
    const Vec p1 = masked(exp2_vec(load(s + c + kVec) - max), c + kVec, 0.0f);
    put(c, p0);
    put(c + kVec, p1);
    sum0 += p0;
    sum1 += p1;
  }
  float total[kVec];
  store(total, sum0 + sum1);
  for (int width = kVec / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) total[l] += total[l + width];
  sum = sum * alpha + total[0];
  return alpha;
}

// acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v_j over n keys, for R rows (p's rows kSpan
// apart), C vectors of the head's values at a time: R x C accumulators stay in registers.
template <int D, int R, int C>
inline void accumulate(float* acc, const float* p, const float* alpha, const float* v,
                       int64_t n) {
  static_assert(D % (C * kVec) == 0);
  for (int c0 = 0; c0 < D; c0 += C * kVec) {
    Vec o[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) o[r][c] = load(acc + r * D + c0 + c * kVec) * alpha[r];
    for (int64_t j = 0; j < n; ++j) {
      Vec vj[C];
      for (int c = 0; c < C; ++c) vj[c] = load(v + j * D + c0 + c * kVec);
      for (int r = 0; r < R; ++r) {
        const float x = p[r * kSpan + j];
        for (int c = 0; c < C; ++c) o[r][c] += x * vj[c];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) store(acc + r * D + c0 + c * kVec, o[r][c]);
  }
}

// A task's query rows (up to kTaskRows, in blocks of kBlockQ), as both attention paths keep
// them: the rows each block computes (its real rows rounded up to a multiple of `pad`), how
// many keys each row sees (0 for padding; causal rows up to their own position), the most any
// row of a block sees, and each row's running max and sum.
struct RowBlocks {
  static constexpr int64_t R = kBlockQ, G = kTaskRows / kBlockQ;
  float max[G][R], sum[G][R];
  int64_t limit[G][R], end[G], used[G], count, last = 0;

  RowBlocks(int64_t rows, int64_t pad, int64_t first_pos, int64_t n_k, bool causal)
      : count((rows + R - 1) / R) {
    for (int64_t b = 0; b < count; ++b) {
      const int64_t block_rows = rows - b * R < R ? rows - b * R : R;
      used[b] = (block_rows + pad - 1) / pad * pad;
      end[b] = 0;
      for (int64_t i = 0; i < used[b]; ++i) {
        const int64_t pos = first_pos + b * R + i;
        limit[b][i] = i >= block_rows ? 0 : causal && pos + 1 < n_k ? pos + 1 : n_k;
        end[b] = end[b] > limit[b][i] ? end[b] : limit[b][i];
        max[b][i] = kNegInf;
        sum[b][i] = 0.0f;
      }
      last = last > end[b] ? last : end[b];
    }
  }
};

// out row i = o row i / its softmax sum, for the task's `rows` rows (o: rows of D, contiguous).
template <typename T, int D>
inline void write_rows(const RowBlocks& rb, const float* o, int64_t rows, T* out,
                       int64_t out_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const float inverse = 1.0f / rb.sum[i / kBlockQ][i % kBlockQ];
    for (int d = 0; d < D; d += 16)
      store16(out + i * out_stride + d, load16(o + i * D + d) * inverse);
  }
}

// kVec rows of kVec floats, transposed in registers: log2(kVec) stages, each swapping the
// off-diagonal blocks of h x h (h = kVec / 2, ..., 1) between rows i and i + h with two-input
// lane shuffles (one permute instruction each where the CPU has them).
inline void transpose(Vec* r) {
  for (int h = kVec / 2; h > 0; h /= 2) {
    VecInt low, high;
    for (int l = 0; l < kVec; ++l) {
      low[l] = l & h ? kVec + l - h : l;
      high[l] = l & h ? kVec + l : l + h;
    }
    for (int i = 0; i < kVec; ++i)
      if (!(i & h)) {
        const Vec a = r[i], b = r[i + h];
        r[i] = __builtin_shuffle(a, b, low);
        r[i + h] = __builtin_shuffle(a, b, high);
      }
  }
}

inline Vec load_float(const float* p) { return load(p); }
inline Vec load_float(const uint16_t* p) {  // bf16: the high half of a float
  typedef uint16_t Halves __attribute__((vector_size(kVec * sizeof(uint16_t))));
  Halves h;
  __builtin_memcpy(&h, p, sizeof h);
  const VecInt bits = __builtin_convertvector(h, VecInt) << 16;
  Vec v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

// A segment's keys of one kv head -> fp32 chunks of [D][kChunk] (transposed kVec x kVec at a
// time; keys past n_k are zeros), its values -> fp32 rows [n_k][D].
template <typename T, int D>
void pack_heads(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t n_k,
                float* kp, float* vp) {
  static_assert(D % kVec == 0 && kChunk % kVec == 0);
  const T zeros[D] = {};
  for (int64_t start = 0; start < n_k; start += kChunk) {
    float* kt = kp + start * D;
    for (int64_t j0 = 0; j0 < kChunk; j0 += kVec)
      for (int d0 = 0; d0 < D; d0 += kVec) {
        Vec r[kVec];
        for (int i = 0; i < kVec; ++i) {
          const int64_t j = start + j0 + i;
          r[i] = load_float((j < n_k ? k + j * k_stride : zeros) + d0);
        }
        transpose(r);
        for (int i = 0; i < kVec; ++i) store(kt + (d0 + i) * kChunk + j0, r[i]);
      }
  }
  for (int64_t j = 0; j < n_k; ++j)
    for (int d0 = 0; d0 < D; d0 += kVec) store(vp + j * D + d0, load_float(v + j * v_stride + d0));
}

template <typename T>
void pack(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t n_k,
          int64_t head_dim, void* kp, void* vp) {
  with_head_dim(head_dim, [&](auto d) {
    pack_heads<T, d>(k, k_stride, v, v_stride, n_k, static_cast<float*>(kp),
                     static_cast<float*>(vp));
  });
}

// How the vector path holds a task's queries and probabilities (fp32) and multiplies them
// (attention_bf16.h's PairPath is the other): the probabilities overwrite their scores.
template <typename T>
struct FloatPath {
  using Query = float;
  using Prob = float;
  using Packed = float;
  static float query(T x) { return to_float(x); }
  static float* probs(float* s, float*) { return s; }
  static void put(float* row, int64_t j, Vec p) { store(row + j, p); }
  template <int D, int R, int N>
  static void score_tile(const float* q, const float* kp, int64_t key, float* s) {
    scores<D, R, N>(q, kp + key * D, s);
  }
  template <int D, int R, int C>
  static void value_tile(float* acc, const float* p, const float* alpha, const float* vp,
                         int64_t key, int64_t n) {
    accumulate<D, R, C>(acc, p, alpha, vp + key * D, n);
  }
};

// A task of up to kTaskRows query rows, in blocks of 32: keys in spans of kSpan (at multiples
// of kSpan in the segment, one softmax rescale per span), scores in chunks of kChunk keys (the
// last one half as wide where that covers the keys left: short texts are mostly that chunk).
// Every block takes a span in turn, so the span's keys and values are read from memory once.
template <typename Path, typename T, int D>
void attend_task(const T* q, int64_t q_stride, const typename Path::Packed* kp,
                 const typename Path::Packed* vp, T* out, int64_t out_stride, int64_t rows,
                 int64_t first_pos, int64_t n_k, bool causal, float scale) {
  using Query = typename Path::Query;
  using Prob = typename Path::Prob;
  constexpr int64_t R = kBlockQ, G = kTaskRows / kBlockQ;
  // Register blocking: score tiles of kScoreRows x kChunk keys, value tiles of kValueRows x
  // kValueCols vectors, each within half the vector registers. Value tiles are narrow (at most
  // a quarter of the registers wide) so that each value vector loaded serves several rows.
  constexpr int kScoreRows = kRegisters / 8;
  constexpr int kValueCols = D / kVec < kRegisters / 8 ? D / kVec : kRegisters / 8;
  constexpr int kValueRows = kRegisters / 2 / kValueCols;
  static_assert(R % kScoreRows == 0 && R % kValueRows == 0);
  alignas(64) static thread_local Query qb[G][R * D];
  alignas(64) static thread_local Prob pb[R * kSpan];
  alignas(64) static thread_local float acc[G][R * D], s[R * kSpan];
  Prob* probs = Path::probs(s, pb);
  float alpha[R];
  RowBlocks rb(rows, kScoreRows, first_pos, n_k, causal);
  for (int64_t b = 0; b < rb.count; ++b)
    for (int64_t i = 0; i < rb.used[b]; ++i)
      for (int d = 0; d < D; ++d) {
        qb[b][i * D + d] = b * R + i < rows ? Path::query(q[(b * R + i) * q_stride + d]) : Query{};
        acc[b][i * D + d] = 0.0f;
      }
  for (int64_t start = 0; start < rb.last; start += kSpan)
    for (int64_t b = 0; b < rb.count; ++b) {
      if (start >= rb.end[b]) continue;
      const int64_t n = rb.end[b] - start < kSpan ? rb.end[b] - start : kSpan;
      const int64_t width = (n + kHalfChunk - 1) / kHalfChunk * kHalfChunk;  // keys scored
      for (int64_t c = 0; c < width; c += kChunk)
        for (int64_t i = 0; i < rb.used[b]; i += kScoreRows) {
          const Query* qi = qb[b] + i * D;
          float* si = s + i * kSpan + c;
          if (width - c >= kChunk)
            Path::template score_tile<D, kScoreRows, kChunk / kVec>(qi, kp, start + c, si);
          else
            Path::template score_tile<D, kScoreRows, kHalfChunk / kVec>(qi, kp, start + c, si);
        }
      for (int64_t i = 0; i < rb.used[b]; ++i) {
        const int64_t valid = rb.limit[b][i] - start;
        Prob* row = probs + i * kSpan;
        if (valid > 0) {
          alpha[i] = softmax_span(s + i * kSpan, width, valid, scale, rb.max[b][i], rb.sum[b][i],
                                  [row](int64_t j, Vec p) { Path::put(row, j, p); });
        } else {  // this span is past the row's last key: leave the row as it is
          alpha[i] = 1.0f;
          for (int64_t j = 0; j < width; ++j) row[j] = Prob{};
        }
      }
      for (int64_t i = 0; i < rb.used[b]; i += kValueRows)
        Path::template value_tile<D, kValueRows, kValueCols>(acc[b] + i * D, probs + i * kSpan,
                                                             alpha + i, vp, start, n);
    }
  write_rows<T, D>(rb, acc[0], rows, out, out_stride);
}

template <typename Path, typename T>
void attend_with(const T* q, int64_t q_stride, const void* kp, const void* vp, T* out,
                 int64_t out_stride, int64_t rows, int64_t first_pos, int64_t n_k,
                 int64_t head_dim, bool causal, float scale) {
  using Packed = typename Path::Packed;
  with_head_dim(head_dim, [&](auto d) {
    attend_task<Path, T, d>(q, q_stride, static_cast<const Packed*>(kp),
                            static_cast<const Packed*>(vp), out, out_stride, rows, first_pos, n_k,
                            causal, scale);
  });
}

template <typename T>
void attend(const T* q, int64_t q_stride, const void* kp, const void* vp, T* out,
            int64_t out_stride, int64_t rows, int64_t first_pos, int64_t n_k, int64_t head_dim,
            bool causal, float scale) {
  attend_with<FloatPath<T>>(q, q_stride, kp, vp, out, out_stride, rows, first_pos, n_k, head_dim,
                            causal, scale);
}

}  // namespace
}  // namespace QE_ISA
}  // namespace qe
