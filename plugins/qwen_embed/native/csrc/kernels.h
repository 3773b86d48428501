// The kernels' table, one per instruction set (rows.h, attention.h); bf16 values travel as
// uint16_t.
#pragma once
#include <stdint.h>

namespace qe {

constexpr int64_t kMaxHeadDim = 512;

// One attention task: `rows` query rows of one head (row i at key position first_pos + i)
// against the first n_k keys/values of that head's segment; strides count elements between
// consecutive tokens. Head sizes 64, 128 and 256.
template <typename T>
using AttendFn = void (*)(const T* q, int64_t q_stride, const T* k, int64_t k_stride,
                          const T* v, int64_t v_stride, T* out, int64_t out_stride, int64_t rows,
                          int64_t first_pos, int64_t n_k, int64_t head_dim, bool causal,
                          float scale);

struct Kernels {
  void (*rms_norm_f32)(const float*, int64_t, const float*, float*, int64_t, int64_t, float);
  void (*rms_norm_bf16)(const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t,
                        float);
  void (*rope_f32)(const float*, int64_t, const float*, const float*, const float*, float,
                   float*, int64_t, int64_t, int64_t);
  void (*rope_bf16)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*,
                    const uint16_t*, float, uint16_t*, int64_t, int64_t, int64_t);
  void (*silu_mul_f32)(const float*, int64_t, float*, int64_t, int64_t);
  void (*silu_mul_bf16)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
  AttendFn<float> attend_f32;
  AttendFn<uint16_t> attend_bf16;
  // AMX only (else null): bf16 keys/values packed per (segment, kv head) for the tiles, then
  // attend_bf16's tasks over the packed copies.
  void (*pack_bf16)(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                    int64_t n_k, int64_t head_dim, uint16_t* kp, uint16_t* vp);
  void (*attend_packed_bf16)(const uint16_t* q, int64_t q_stride, const uint16_t* kp,
                             const uint16_t* vp, uint16_t* out, int64_t out_stride,
                             int64_t rows, int64_t first_pos, int64_t n_k, int64_t head_dim,
                             bool causal, float scale);
};

// Query rows per attention task; key blocks start at multiples of kBlockK within a segment (of
// kPackedKeys on AMX, whose packed blocks ops.cpp allocates).
constexpr int64_t kBlockQ = 32;
constexpr int64_t kBlockK = 64;
constexpr int64_t kPackedKeys = 32;

namespace generic { extern const Kernels kernels; }
namespace avx2 { extern const Kernels kernels; }
namespace avx512 { extern const Kernels kernels; }
namespace amx { extern const Kernels kernels; }

}  // namespace qe
