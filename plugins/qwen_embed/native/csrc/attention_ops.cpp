// The varlen attention operator over the kernel table (attention*.h): every segment of a
// batch in one call, tasks of (segment, kv head) or (segment, rows, head) on torch's threads.
#include <vector>

#include "ops.h"

namespace qe {
namespace {

// Segments of up to kShortKeys keys: one task per (segment, kv head) packs its keys and values
// into the thread's scratch, still in cache, and attends every query of the heads that share
// them. Longer segments (and batches of too few short ones to keep the threads busy): every
// (segment, kv head) packed into one buffer first, then one task per (segment, block of query
// rows, head). Tasks go to the next free thread, longest first. Either way a query row's
// numbers are the same: each task's arithmetic is its own.
constexpr int64_t kShortKeys = 512;

template <typename T>
void attend_segments(const AttentionKernels<T>& kern, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const int32_t* cq, const int32_t* ck, int64_t segments,
                     bool causal, float scale, at::Tensor& out) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2), group = heads / kv_heads;
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0), v_stride = v.stride(0);
  const int64_t out_stride = heads * d;
  auto packed_bytes = [&](int64_t n_k) {  // of one kv head's keys (or values)
    return (n_k + kern.key_multiple - 1) / kern.key_multiple * kern.key_multiple * d *
           kern.packed_bytes;
  };
  auto pack = [&](int64_t s, int64_t kvh, uint8_t* kp, uint8_t* vp) {
    kern.pack(ptr<T>(k) + ck[s] * k_stride + kvh * d, k_stride,
              ptr<T>(v) + ck[s] * v_stride + kvh * d, v_stride, ck[s + 1] - ck[s], d, kp, vp);
  };
  // rows [first, first + kTaskRows) of the segment's queries, head h, against packed keys/values
  auto attend = [&](int64_t s, int64_t first, int64_t h, const uint8_t* kp, const uint8_t* vp) {
    const int64_t n_q = cq[s + 1] - cq[s], n_k = ck[s + 1] - ck[s], q0 = cq[s] + first;
    kern.attend(ptr<T>(q) + q0 * q_stride + h * d, q_stride, kp, vp,
                ptr<T>(out) + q0 * out_stride + h * d, out_stride,
                std::min(kTaskRows, n_q - first), n_k - n_q + first, n_k, d, causal, scale);
  };
  auto last_block = [&](int64_t s) { return (cq[s + 1] - cq[s] - 1) / kTaskRows * kTaskRows; };

  std::vector<int64_t> short_segments, long_segments;
  for (int64_t s = 0; s < segments; ++s)
    if (cq[s + 1] > cq[s])
      (ck[s + 1] - ck[s] <= kShortKeys ? short_segments : long_segments).push_back(s);
  if (static_cast<int64_t>(short_segments.size()) * kv_heads < 2 * at::get_num_threads()) {
    long_segments.insert(long_segments.end(), short_segments.begin(), short_segments.end());
    short_segments.clear();
  }

  std::vector<int64_t> packed(long_segments.size() + 1, 0);  // where each one's heads start
  for (size_t i = 0; i < long_segments.size(); ++i) {
    const int64_t s = long_segments[i];
    packed[i + 1] = packed[i] + packed_bytes(ck[s + 1] - ck[s]) * kv_heads;
  }
  at::Tensor kp = at::empty({packed.back()}, q.options().dtype(at::kByte));
  at::Tensor vp = at::empty({packed.back()}, q.options().dtype(at::kByte));
  auto packed_at = [&](size_t i, int64_t kvh) {
    return packed[i] + kvh * (packed[i + 1] - packed[i]) / kv_heads;
  };
  in_parallel(static_cast<int64_t>(long_segments.size()) * kv_heads, [&](int64_t task) {
    const int64_t i = task / kv_heads, kvh = task % kv_heads, at = packed_at(i, kvh);
    pack(long_segments[i], kvh, ptr<uint8_t>(kp) + at, ptr<uint8_t>(vp) + at);
  });

  struct Block {
    int64_t index, first;  // long_segments[index], its query rows from `first`
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < long_segments.size(); ++i)
    for (int64_t first = last_block(long_segments[i]); first >= 0; first -= kTaskRows)
      blocks.push_back({static_cast<int64_t>(i), first});
  const int64_t long_tasks = static_cast<int64_t>(blocks.size()) * heads;
  const int64_t short_tasks = static_cast<int64_t>(short_segments.size()) * kv_heads;
  in_parallel(long_tasks + short_tasks, [&](int64_t t) {
    if (t < long_tasks) {
      const Block& b = blocks[t / heads];
      const int64_t h = t % heads, at = packed_at(b.index, h / group);
      attend(long_segments[b.index], b.first, h, ptr<uint8_t>(kp) + at, ptr<uint8_t>(vp) + at);
      return;
    }
    t -= long_tasks;
    const int64_t s = short_segments[t / kv_heads], kvh = t % kv_heads;
    static thread_local std::vector<uint8_t> scratch;
    const int64_t bytes = packed_bytes(ck[s + 1] - ck[s]);
    if (static_cast<int64_t>(scratch.size()) < 2 * bytes + 64) scratch.resize(2 * bytes + 64);
    uint8_t* kb = scratch.data() + (-reinterpret_cast<uintptr_t>(scratch.data()) & 63);
    pack(s, kvh, kb, kb + bytes);
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
      for (int64_t first = last_block(s); first >= 0; first -= kTaskRows)
        attend(s, first, h, kb, kb + bytes);
  });
}

// q [Tq, heads, d], k/v [Tk, kv_heads, d] (rows may be strided), split into segments by the
// host offsets cu_q/cu_k (int32 [s + 1]); a segment's queries sit at its last keys' positions
// (bottom-right causal).

}  // namespace

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_q, const at::Tensor& cu_k, bool causal,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, d]");
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TORCH_CHECK(d == 32 || d == 64 || d == 128 || d == 256, "head_dim ", d,
              " is not 32, 64, 128 or 256");
  TORCH_CHECK(k.size(2) == d && v.sizes() == k.sizes() && heads % kv_heads == 0,
              "k and v must be [tokens, kv_heads, ", d, "] with heads a multiple of kv_heads");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "qwen_embed attention takes float32 or bfloat16, not ", q.scalar_type());
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  auto heads_of = [&](const at::Tensor& t) {  // rows of heads, each head's d values contiguous
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == q.scalar_type(),
                "q, k and v must be CPU tensors of one dtype");
    return t.stride(2) == 1 && t.stride(1) == d ? t : t.contiguous();
  };
  TORCH_CHECK(cu_q.device().is_cpu() && cu_k.device().is_cpu() &&
                  cu_q.scalar_type() == at::kInt && cu_k.scalar_type() == at::kInt &&
                  cu_q.is_contiguous() && cu_k.is_contiguous() && cu_q.numel() == cu_k.numel(),
              "cu_q and cu_k must be contiguous int32 CPU offsets of one length");
  const int32_t* cq = cu_q.data_ptr<int32_t>();
  const int32_t* ck = cu_k.data_ptr<int32_t>();
  const int64_t segments = cu_q.numel() - 1;
  TORCH_CHECK(segments >= 0 && cq[0] == 0 && ck[0] == 0 && cq[segments] == q.size(0) &&
                  ck[segments] == k.size(0),
              "cu_q/cu_k must run from 0 to the number of query/key rows");
  for (int64_t s = 0; s < segments; ++s)
    TORCH_CHECK(0 <= cq[s + 1] - cq[s] && cq[s + 1] - cq[s] <= ck[s + 1] - ck[s], "segment ", s,
                " has ", cq[s + 1] - cq[s], " queries for ", ck[s + 1] - ck[s], " keys");
  at::Tensor out = at::empty({q.size(0), heads, d}, q.options());
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    attend_segments(kernels().attention_bf16, heads_of(q), heads_of(k), heads_of(v), cq, ck,
                    segments, causal, sc, out);
  else
    attend_segments(kernels().attention_f32, heads_of(q), heads_of(k), heads_of(v), cq, ck,
                    segments, causal, sc, out);
  return out;
}

}  // namespace qe
