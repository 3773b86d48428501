// The row kernels' table, one per instruction set (rows.h); bf16 values travel as uint16_t.
#pragma once
#include <stdint.h>

namespace qe {

constexpr int64_t kMaxHeadDim = 512;

struct RowKernels {
  void (*rms_norm_f32)(const float*, int64_t, const float*, float*, int64_t, int64_t, float);
  void (*rms_norm_bf16)(const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t,
                        float);
  void (*rope_f32)(const float*, int64_t, const float*, const float*, const float*, float,
                   float*, int64_t, int64_t, int64_t);
  void (*rope_bf16)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*,
                    const uint16_t*, float, uint16_t*, int64_t, int64_t, int64_t);
  void (*silu_mul_f32)(const float*, int64_t, float*, int64_t, int64_t);
  void (*silu_mul_bf16)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
};

namespace generic { extern const RowKernels kernels; }
namespace avx2 { extern const RowKernels kernels; }
namespace avx512 { extern const RowKernels kernels; }

}  // namespace qe
