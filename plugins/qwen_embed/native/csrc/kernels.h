// The kernels' table, one per instruction set (rows.h, attention.h); bf16 values travel as
// uint16_t. The GEMMs' kernels: gemm/gemm.h.
#pragma once
#include <stdint.h>

namespace qe {

constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kMaxHeads = 1024;     // heads of one token that the rotary kernel takes
constexpr int64_t kStateChains = 4;    // the gated delta rule's sums over the key dim
constexpr int64_t kStateColumns = 16;  // value columns of one of its state blocks (a vector)

// The gated delta rule's inputs and outputs (delta_rule.h): q, k normalised, fp32 [T, key
// heads, chained] (key_dim values, then zeros to a multiple of kStateChains); v [T,
// value_heads, value_dim] of the kernel's dtype, v_stride values between tokens; g, beta fp32
// [T, value_heads]; out fp32 [T, value_heads, value_dim]; states (or null) fp32 [sequences,
// value_heads, key_dim, value_dim], exports fp32 [cuts, ...] of that shape.
struct DeltaRuleArgs {
  const float* q;
  const float* k;
  const void* v;
  int64_t v_stride;
  const float* g;
  const float* beta;
  float* out;
  const float* states;
  float* exports;
  int64_t value_heads, key_dim, chained, value_dim, repeat;  // repeat: value heads per key head
};

// Attention in two steps (attention.h, attention_amx.h): `pack` copies one segment's keys and
// values of one kv head into the layout `attend` reads (n_k rounded up to key_multiple keys of
// head_dim values of packed_bytes each, for keys and for values); `attend` computes `rows` query
// rows of one head (row i at key position first_pos + i) against the segment's first n_k packed
// keys. Strides count elements between consecutive tokens. Head sizes 32, 64, 128 and 256.
template <typename T>
struct AttentionKernels {
  void (*pack)(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t n_k,
               int64_t head_dim, void* kp, void* vp);
  void (*attend)(const T* q, int64_t q_stride, const void* kp, const void* vp, T* out,
                 int64_t out_stride, int64_t rows, int64_t first_pos, int64_t n_k,
                 int64_t head_dim, bool causal, float scale);
  int64_t key_multiple;
  int64_t packed_bytes;
};

struct Kernels {
  void (*rms_norm_f32)(const float*, int64_t, const float*, float*, int64_t, int64_t, float);
  void (*rms_norm_bf16)(const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t,
                        float);
  void (*add_rms_norm_f32)(float*, const float*, const float*, float*, int64_t, int64_t, float);
  void (*add_rms_norm_bf16)(uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t,
                            int64_t, float);
  // bf16 rows, an fp32 weight (Qwen3.5's norms)
  void (*rms_norm_bf16_f32)(const uint16_t*, int64_t, const float*, uint16_t*, int64_t, int64_t,
                            float);
  void (*add_rms_norm_bf16_f32)(uint16_t*, const uint16_t*, const float*, uint16_t*, int64_t,
                                int64_t, float);
  void (*rope_f32)(const float*, int64_t, const float*, const float*, const float*, float,
                   float*, int64_t, int64_t, int64_t);
  void (*rope_bf16)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*,
                    const uint16_t*, float, uint16_t*, int64_t, int64_t, int64_t);
  // bf16 rows, fp32 tables, no norm (the vision tower's rotation)
  void (*rope_bf16_f32)(const uint16_t*, int64_t, const float*, const float*, const uint16_t*,
                        float, uint16_t*, int64_t, int64_t, int64_t);
  void (*silu_mul_f32)(const float*, int64_t, float*, int64_t, int64_t);
  void (*silu_mul_bf16)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
  void (*gelu_tanh_f32)(const float*, int64_t, float*, int64_t, int64_t);
  void (*gelu_tanh_bf16)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
  void (*hadamard_f32)(const float*, int64_t, int64_t, int64_t, int64_t, float*);
  void (*hadamard_bf16)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, float*);
  // (w, stride, rows, k, block, k doubles of scratch, codes [rows][k], scales, code sums [rows])
  void (*weight_codes_f32)(const float*, int64_t, int64_t, int64_t, int64_t, double*, int8_t*,
                           float*, int32_t*);
  void (*weight_codes_bf16)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, double*,
                            int8_t*, float*, int32_t*);
  void (*conv_silu_f32)(const float*, int64_t, const float*, int64_t, const int64_t*, float*,
                        int64_t, int64_t, int64_t);
  void (*conv_silu_bf16)(const uint16_t*, int64_t, const float*, int64_t, const int64_t*,
                         uint16_t*, int64_t, int64_t, int64_t);
  // (args, sequence, its rows [first, end), value head, scratch for its states, the
  // sequence's cuts: rows ascending, their export slots, count)
  void (*delta_rule_f32)(const DeltaRuleArgs&, int64_t, int64_t, int64_t, int64_t, float*,
                         const int64_t*, const int64_t*, int64_t);
  void (*delta_rule_bf16)(const DeltaRuleArgs&, int64_t, int64_t, int64_t, int64_t, float*,
                          const int64_t*, const int64_t*, int64_t);
  // (x, stride, rows, heads, head size, padded size, scale, eps, out): heads L2-normalised
  void (*l2_heads_f32)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                       float*);
  void (*l2_heads_bf16)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                        float, float*);
  AttentionKernels<float> attention_f32;
  AttentionKernels<uint16_t> attention_bf16;
};

constexpr int64_t kBlockQ = 32;     // query rows computed together
constexpr int64_t kTaskRows = 512;  // query rows per attention task (blocks sharing keys)

namespace generic { extern const Kernels kernels; }
namespace avx2 { extern const Kernels kernels; }
namespace avx512 { extern const Kernels kernels; }
namespace avx512bf16 { extern const Kernels kernels; }
namespace amx { extern const Kernels kernels; }
}  // namespace qe
