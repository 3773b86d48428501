// What the operator sources share (cpu_features.cpp, row_ops.cpp, attention_ops.cpp,
// gemm/ops.cpp, bindings.cpp): the kernel table chosen for this CPU, the checks and helpers of
// tensors as rows, and the operators bindings.cpp registers.
#pragma once
// The ATen headers the operators use, not ATen/ATen.h (every torch operator's declarations):
// they take most of each source's compile time, the sanitized build's most of all.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace qe {

// cpu_features.cpp: whether this CPU (and build) runs an instruction set's kernels; the table
// of the one qwen_embed.native chose.
bool cpu_has(const std::string& isa);
std::string select_isa(std::string requested);
const Kernels& kernels();

// row_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                int64_t head_dim, const std::optional<at::Tensor>& norm_weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh(const at::Tensor& x);
at::Tensor hadamard_rows(const at::Tensor& x, int64_t block);
std::tuple<at::Tensor, at::Tensor, at::Tensor> weight_codes(const at::Tensor& w, int64_t block);
at::Tensor causal_conv_silu(const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& position);

// delta_rule_ops.cpp
at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta,
                            const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& states,
                            const at::Tensor& cut_rows, const std::optional<at::Tensor>& exports,
                            double q_scale, double eps);

// gemm/ops.cpp
bool int8_supported();
bool bf16_supported();
// Channels per panel of the weights bf16_linear (of k values each) and int8_linear read fastest
// here (native.pack_panels): 16 where our AMX tile kernels run, else 64.
int64_t bf16_panel(int64_t k);
int64_t int8_panel();
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offset,
                       const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                       int64_t n, int64_t rotation, int64_t task_rows, int64_t task_channels,
                       bool channels_outer, bool gated);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t task_rows,
                       int64_t task_channels, bool channels_outer, bool gated);
at::Tensor bf16_merge_pair(const at::Tensor& packed, const at::Tensor& a, const at::Tensor& b);
bool avx2_supported();
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t n, int64_t task_rows,
                      int64_t task_channels, bool channels_outer);
int64_t gemm_task_channels(int64_t m, int64_t n, int64_t task_rows, int64_t task_channels,
                           int64_t panel, int64_t threads, bool channels_outer);
at::Tensor int8_linear_avx2(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& w_scale, int64_t n, int64_t rotation,
                            int64_t task_rows, int64_t task_channels, bool channels_outer);

// attention_ops.cpp
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_q, const at::Tensor& cu_k, bool causal,
                            double scale);

// Rows of `n` values: the last dimension contiguous, the others collapsible into one stride.
inline at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), "qwen_embed native kernels run on CPU tensors");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "qwen_embed native kernels take float32 or bfloat16, not ", t.scalar_type());
  at::Tensor rows = t.dim() == 2 ? t : t.reshape({-1, n});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

inline void same_dtype(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(b.scalar_type() == a.scalar_type() && b.is_contiguous(), name,
              " must be contiguous and of the input's dtype");
}

// Enough rows per task that a thread's share is worth its start.
inline int64_t grain(int64_t values_per_row) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(values_per_row, 1));
}

// body(0 .. n-1) on torch's threads, each taking the next task when done with one (tasks differ
// in cost: causal blocks late in long segments cost most).
template <typename F>
void in_parallel(int64_t n, const F& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < n; t = next++) body(t);
  });
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

inline void check_rotation(int64_t block, int64_t k) {
  TORCH_CHECK(block == 1 || ((block == 16 || block == 32 || block == 64 || block == 128) &&
                             k % block == 0),
              "rotation must be 1 or 16, 32, 64 or 128 dividing ", k, ", got ", block);
}


}  // namespace qe
