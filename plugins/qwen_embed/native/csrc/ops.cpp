// torch operators over the row kernels: qwen_embed::rms_norm, ::rope, ::silu_mul (CPU, fp32 and
// bf16), and qwen_embed::select_isa to choose the instruction set (the best the CPU has unless
// asked for another, e.g. by the tests).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "kernels.h"

namespace qe {
namespace {

const RowKernels* active = nullptr;
std::string active_name;

bool cpu_has(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "generic";
}

// "" picks the widest the CPU has; naming one it lacks is an error.
std::string select_isa(std::string requested) {
  if (requested.empty()) requested = cpu_has("avx512") ? "avx512" : cpu_has("avx2") ? "avx2" : "generic";
  TORCH_CHECK(cpu_has(requested), "this CPU cannot run the '", requested, "' kernels");
  active = requested == "avx512" ? &avx512::kernels
           : requested == "avx2" ? &avx2::kernels
                                 : &generic::kernels;
  active_name = requested;
  return active_name;
}

const RowKernels& kernels() {
  if (!active) select_isa("");
  return *active;
}

// Rows of `n` values: the last dimension contiguous, the others collapsible into one stride.
at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), "qwen_embed native kernels run on CPU tensors");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "qwen_embed native kernels take float32 or bfloat16, not ", t.scalar_type());
  at::Tensor rows = t.dim() == 2 ? t : t.reshape({-1, n});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

void same_dtype(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(b.scalar_type() == a.scalar_type() && b.is_contiguous(), name,
              " must be contiguous and of the input's dtype");
}

// Enough rows per task that a thread's share is worth its start.
int64_t grain(int64_t values_per_row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(values_per_row, 1)); }

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1);
  at::Tensor rows = as_rows(x, n);
  same_dtype(x, weight, "weight");
  TORCH_CHECK(weight.numel() == n, "weight has ", weight.numel(), " values for rows of ", n);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t stride = rows.stride(0);
  const auto& k = kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows.size(0), grain(n), [&](int64_t begin, int64_t end) {
    if (bf16)
      k.rms_norm_bf16(ptr<uint16_t>(rows) + begin * stride, stride, ptr<uint16_t>(weight),
                      ptr<uint16_t>(out) + begin * n, end - begin, n, static_cast<float>(eps));
    else
      k.rms_norm_f32(ptr<float>(rows) + begin * stride, stride, ptr<float>(weight),
                     ptr<float>(out) + begin * n, end - begin, n, static_cast<float>(eps));
  });
  return out;
}

// x [T, heads * head_dim] (rows may be strided), cos/sin [T, head_dim / 2] -> [T, heads, head_dim]
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                int64_t head_dim, const std::optional<at::Tensor>& norm_weight, double eps) {
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "head_dim ", head_dim,
              " must be even and at most ", kMaxHeadDim);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % head_dim == 0, "x must be [tokens, heads * head_dim]");
  at::Tensor rows = as_rows(x, x.size(1));
  const int64_t t = rows.size(0), heads = rows.size(1) / head_dim, half = head_dim / 2;
  same_dtype(x, cos, "cos");
  same_dtype(x, sin, "sin");
  TORCH_CHECK(cos.numel() == t * half && sin.numel() == t * half, "cos/sin must be [", t, ", ",
              half, "]");
  if (norm_weight) {
    same_dtype(x, *norm_weight, "norm_weight");
    TORCH_CHECK(norm_weight->numel() == head_dim, "norm_weight must have head_dim values");
  }
  at::Tensor out = at::empty({t, heads, head_dim}, x.options());
  const int64_t stride = rows.stride(0);
  const auto& k = kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, grain(heads * head_dim), [&](int64_t b, int64_t end) {
    if (bf16)
      k.rope_bf16(ptr<uint16_t>(rows) + b * stride, stride, ptr<uint16_t>(cos) + b * half,
                  ptr<uint16_t>(sin) + b * half,
                  norm_weight ? ptr<uint16_t>(*norm_weight) : nullptr, e,
                  ptr<uint16_t>(out) + b * heads * head_dim, end - b, heads, head_dim);
    else
      k.rope_f32(ptr<float>(rows) + b * stride, stride, ptr<float>(cos) + b * half,
                 ptr<float>(sin) + b * half, norm_weight ? ptr<float>(*norm_weight) : nullptr, e,
                 ptr<float>(out) + b * heads * head_dim, end - b, heads, head_dim);
  });
  return out;
}

// gate_up [T, 2n] -> silu(gate) * up [T, n]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate_up's last dimension must be even");
  at::Tensor rows = as_rows(gate_up, gate_up.size(-1));
  const int64_t n = rows.size(1) / 2, stride = rows.stride(0);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const auto& k = kernels();
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows.size(0), grain(2 * n), [&](int64_t b, int64_t end) {
    if (bf16)
      k.silu_mul_bf16(ptr<uint16_t>(rows) + b * stride, stride, ptr<uint16_t>(out) + b * n,
                      end - b, n);
    else
      k.silu_mul_f32(ptr<float>(rows) + b * stride, stride, ptr<float>(out) + b * n, end - b, n);
  });
  return out;
}

}  // namespace
}  // namespace qe

TORCH_LIBRARY(qwen_embed, m) {
  m.def("select_isa(str requested) -> str", &qe::select_isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int head_dim, Tensor? norm_weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(qwen_embed, CPU, m) {
  m.impl("rms_norm", &qe::rms_norm);
  m.impl("rope", &qe::rope);
  m.impl("silu_mul", &qe::silu_mul);
}
