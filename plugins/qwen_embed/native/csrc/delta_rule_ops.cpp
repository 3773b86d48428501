// Qwen3.5's gated delta rule over a flat varlen batch (delta_rule.h's recurrence), fp32 and bf16
// q, k, v; the tasks (sequence, value head) in parallel.
#include "ops.h"

#include <numeric>
#include <tuple>
#include <vector>

namespace qe {
namespace {

void check_heads(const at::Tensor& x, int64_t t, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == t, name, " must be [", t, ", heads, head_dim]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), name,
              "'s heads must be contiguous within a token");
}

void check_floats(const at::Tensor& x, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.sizes() == shape, name,
              " must be contiguous fp32 ", shape);
}

}  // namespace

// q, k [T, key heads, dk], v [T, value heads, dv] (rows may be strided), g, beta fp32 [T, value
// heads], cu_seqlens int64 [n + 1] -> fp32 [T, value heads, dv]; each sequence from states[i]
// (fp32 [n, value heads, dk, dv]) or zero; exports[c] filled with the state after row
// cut_rows[c].
at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta,
                            const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& states,
                            const at::Tensor& cut_rows, const std::optional<at::Tensor>& exports,
                            double q_scale, double eps) {
  const int64_t t = v.size(0);
  check_heads(q, t, "q");
  check_heads(k, t, "k");
  check_heads(v, t, "v");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "qwen_embed native kernels run on CPU tensors");
  TORCH_CHECK(v.scalar_type() == at::kFloat || v.scalar_type() == at::kBFloat16,
              "q, k and v must be float32 or bfloat16");
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k and v must have one dtype");
  TORCH_CHECK(q.sizes() == k.sizes(), "q and k must have one shape");
  const int64_t hk = k.size(1), dk = k.size(2), hv = v.size(1), dv = v.size(2);
  TORCH_CHECK(hk > 0 && hv % hk == 0, "value heads (", hv, ") must be a multiple of key heads (",
              hk, ")");
  check_floats(g, {t, hv}, "g");
  check_floats(beta, {t, hv}, "beta");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() &&
                  cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "cu_seqlens must be int64 [sequences + 1]");
  const int64_t n = cu_seqlens.numel() - 1;
  const int64_t* bounds = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[n] == t, "cu_seqlens must run from 0 to ", t);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(bounds[i] <= bounds[i + 1], "cu_seqlens must not decrease");
  if (states) check_floats(*states, {n, hv, dk, dv}, "states");
  TORCH_CHECK(cut_rows.scalar_type() == at::kLong && cut_rows.is_contiguous() &&
                  cut_rows.dim() == 1,
              "cut_rows must be int64 [cuts]");
  const int64_t cuts = cut_rows.numel();
  const int64_t* cut_at = cut_rows.data_ptr<int64_t>();
  for (int64_t c = 0; c < cuts; ++c)
    TORCH_CHECK(cut_at[c] >= 0 && cut_at[c] < t, "cut_rows[", c, "] = ", cut_at[c],
                " is outside the rows");
  if (cuts) {
    TORCH_CHECK(exports, "exports must be given with cut_rows");
    check_floats(*exports, {cuts, hv, dk, dv}, "exports");
  }
  // the cuts by row (their slots kept), so that each task walks its sequence's in order
  std::vector<int64_t> slot(cuts), row(cuts);
  std::iota(slot.begin(), slot.end(), 0);
  std::stable_sort(slot.begin(), slot.end(), [&](int64_t a, int64_t b) {
    return cut_at[a] < cut_at[b];
  });
  for (int64_t c = 0; c < cuts; ++c) row[c] = cut_at[slot[c]];

  const auto& kern = kernels();
  const bool bf16 = v.scalar_type() == at::kBFloat16;
  const auto f32 = v.options().dtype(at::kFloat);
  const int64_t chained = (dk + kStateChains - 1) / kStateChains * kStateChains;
  at::Tensor qn = at::empty({t, hk, chained}, f32), kn = at::empty({t, hk, chained}, f32);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, grain(hk * dk), [&](int64_t b, int64_t end) {
    for (const auto& [x, norm, scale] : {std::tuple{&q, &qn, static_cast<float>(q_scale)},
                                          std::tuple{&k, &kn, 1.0f}}) {
      float* dst = norm->data_ptr<float>() + b * hk * chained;
      if (bf16)
        kern.l2_heads_bf16(ptr<uint16_t>(*x) + b * x->stride(0), x->stride(0), end - b, hk, dk,
                           chained, scale, e, dst);
      else
        kern.l2_heads_f32(ptr<float>(*x) + b * x->stride(0), x->stride(0), end - b, hk, dk,
                          chained, scale, e, dst);
    }
  });
  at::Tensor out = at::empty({t, hv, dv}, f32);
  const DeltaRuleArgs args{qn.data_ptr<float>(), kn.data_ptr<float>(), v.data_ptr(), v.stride(0),
                           g.data_ptr<float>(), beta.data_ptr<float>(), out.data_ptr<float>(),
                           states ? states->data_ptr<float>() : nullptr,
                           cuts ? exports->data_ptr<float>() : nullptr, hv, dk, chained, dv,
                           hv / hk};
  const int64_t blocks = (dv + kStateColumns - 1) / kStateColumns;
  at::parallel_for(0, n * hv, 1, [&](int64_t begin, int64_t end) {
    at::Tensor scratch = at::empty({blocks * chained * kStateColumns}, f32);  // 64-byte aligned
    for (int64_t task = begin; task < end; ++task) {
      const int64_t sequence = task / hv, head = task % hv;
      const int64_t first = bounds[sequence], last = bounds[sequence + 1];
      const int64_t from = std::lower_bound(row.begin(), row.end(), first) - row.begin();
      const int64_t to = std::lower_bound(row.begin(), row.end(), last) - row.begin();
      (bf16 ? kern.delta_rule_bf16 : kern.delta_rule_f32)(
          args, sequence, first, last, head, scratch.data_ptr<float>(), row.data() + from,
          slot.data() + from, to - from);
    }
  });
  return out;
}

}  // namespace qe
