// The torch operators of the library: qwen_embed::select_isa, the row-wise ops, the GEMMs and
// varlen attention, CPU tensors (qwen_embed.native loads the library and chooses the kernels).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(qwen_embed, m) {
  m.def("select_isa(str requested) -> str", &qe::select_isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int head_dim, Tensor? norm_weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("hadamard_rows(Tensor x, int block) -> Tensor");
  m.def("weight_codes(Tensor w, int block) -> (Tensor, Tensor, Tensor)");
  m.def("causal_conv_silu(Tensor x, Tensor weight, Tensor position) -> Tensor");
  m.def(
      "gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor? states, Tensor cut_rows, Tensor(a!)? exports, float q_scale, float eps) -> Tensor");
  m.def("int8_supported() -> bool", &qe::int8_supported);
  m.def("bf16_supported() -> bool", &qe::bf16_supported);
  m.def("avx2_supported() -> bool", &qe::avx2_supported);
  m.def("bf16_panel(int k) -> int", &qe::bf16_panel);
  m.def("int8_panel() -> int", &qe::int8_panel);
  m.def(
      "bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n, int task_rows=64, "
      "int task_channels=512, bool channels_outer=True, bool gated=False) -> Tensor");
  m.def("bf16_merge_pair(Tensor packed, Tensor a, Tensor b) -> Tensor");
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor offset, Tensor w_scale, Tensor? bias, int n, "
      "int rotation=1, int task_rows=96, int task_channels=1024, bool channels_outer=True, "
      "bool gated=False) -> Tensor");
  m.def(
      "int8_linear_avx2(Tensor x, Tensor packed, Tensor w_scale, int n, int rotation=1, "
      "int task_rows=96, int task_channels=256, bool channels_outer=True) -> Tensor");
  m.def(
      "f32_linear(Tensor x, Tensor packed, Tensor? bias, int n, int task_rows=96, "
      "int task_channels=256, bool channels_outer=True) -> Tensor");
  m.def(
      "gemm_task_channels(int m, int n, int task_rows, int task_channels, int panel, "
      "int threads, bool channels_outer=True) -> int",
      &qe::gemm_task_channels);
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, bool causal, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(qwen_embed, CPU, m) {
  m.impl("rms_norm", &qe::rms_norm);
  m.impl("add_rms_norm", &qe::add_rms_norm);
  m.impl("rope", &qe::rope);
  m.impl("silu_mul", &qe::silu_mul);
  m.impl("gelu_tanh", &qe::gelu_tanh);
  m.impl("hadamard_rows", &qe::hadamard_rows);
  m.impl("weight_codes", &qe::weight_codes);
  m.impl("causal_conv_silu", &qe::causal_conv_silu);
  m.impl("gated_delta_rule", &qe::gated_delta_rule);
  m.impl("int8_linear", &qe::int8_linear);
  m.impl("bf16_linear", &qe::bf16_linear);
  m.impl("bf16_merge_pair", &qe::bf16_merge_pair);
  m.impl("int8_linear_avx2", &qe::int8_linear_avx2);
  m.impl("f32_linear", &qe::f32_linear);
  m.impl("varlen_attention", &qe::varlen_attention);
}

