// The kernels' table, one per instruction set (rows.h, attention.h); bf16 values travel as
// uint16_t.
#pragma once
#include <stdint.h>

namespace qe {

constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kMaxHeads = 1024;  // heads of one token that the rotary kernel takes

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
  void (*rope_f32)(const float*, int64_t, const float*, const float*, const float*, float,
                   float*, int64_t, int64_t, int64_t);
  void (*rope_bf16)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*,
                    const uint16_t*, float, uint16_t*, int64_t, int64_t, int64_t);
  void (*silu_mul_f32)(const float*, int64_t, float*, int64_t, int64_t);
  void (*silu_mul_bf16)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
  void (*hadamard_f32)(const float*, int64_t, int64_t, int64_t, int64_t, float*);
  void (*hadamard_bf16)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, float*);
  AttentionKernels<float> attention_f32;
  AttentionKernels<uint16_t> attention_bf16;
};

constexpr int64_t kPanel = 64;  // channels per panel of packed GEMM weights (int8, bf16)

// One int8 linear layer's operands (int8_rows.cpp, ops.cpp): `a` rows of k_pad uint8 codes (the
// activation / a_scale rounded, + 128), `packed` the int8 weights in panels of kPanel
// channels, [n_pad / kPanel][k_pad / 4][kPanel][4], `offset` 128 x each channel's weight
// sum, `w_scale` per channel, `bias` fp32 or null;
// out[row][c] = (sum - offset[c]) * a_scale[row] * w_scale[c] + bias[c], at row stride ldo.
template <typename T>
struct Int8Gemm {
  const uint8_t* a;
  const float* a_scale;
  const int8_t* packed;
  const int32_t* offset;
  const float* w_scale;
  const float* bias;
  T* out;
  int64_t k_pad, n, ldo;
};

// Rows of activations -> codes and scales (quantize; block > 1: each row rotated first by a
// Walsh-Hadamard transform per `block` values), and the GEMM's int32 sums -> outputs (finish:
// `rows` rows x `cols` channels from `row`, `col`, `ld` sums per row).
struct Int8Kernels {
  void (*quantize_f32)(const float* x, int64_t stride, int64_t rows, int64_t k, int64_t k_pad,
                       int64_t block, uint8_t* codes, float* scale);
  void (*quantize_bf16)(const uint16_t* x, int64_t stride, int64_t rows, int64_t k,
                        int64_t k_pad, int64_t block, uint8_t* codes, float* scale);
  void (*finish_f32)(const Int8Gemm<float>& g, const int32_t* sums, int64_t ld, int64_t row,
                     int64_t rows, int64_t col, int64_t cols);
  void (*finish_bf16)(const Int8Gemm<uint16_t>& g, const int32_t* sums, int64_t ld, int64_t row,
                      int64_t rows, int64_t col, int64_t cols);
  // The bf16 GEMM's fp32 sums (`ld` per row) -> `rows` x `cols` bf16 outputs at row stride ldo,
  // plus bias (fp32, or null) before rounding.
  void (*store_sums)(const float* sums, int64_t ld, int64_t rows, int64_t cols, const float* bias,
                     uint16_t* out, int64_t ldo);
};

// batch_invariant's bf16 GEMM on AMX tiles (ops.cpp bf16_linear): rows packed by pack_rows (k bf16
// values each) times weights packed [n_pad / kPanel][k / 2][kPanel][2] -> out (row stride ldo)
// + bias (fp32 or null).
struct Bf16Gemm {
  const uint16_t* a;
  int64_t k;
  const uint16_t* packed;
  const float* bias;
  uint16_t* out;
  int64_t ldo, n;
};

// The GEMMs on AMX tiles (gemm_amx.cpp): rows [row0, row1) x channels [col0, col1) of out, row0
// and col0 multiples of 32. int8: `a` holds whole 32-row blocks of codes and k_pad is a
// multiple of 64; bf16: k a multiple of 32.
struct GemmTiles {
  void (*int8_f32)(const Int8Gemm<float>& g, int64_t row0, int64_t row1, int64_t col0,
                   int64_t col1);
  void (*int8_bf16)(const Int8Gemm<uint16_t>& g, int64_t row0, int64_t row1, int64_t col0,
                    int64_t col1);
  // bf16: rows [row0, row1) of x packed into 32-row blocks for `bf16` (`a` = the blocks)
  void (*pack_rows)(const uint16_t* x, int64_t lda, int64_t m, int64_t k, int64_t row0,
                    int64_t row1, uint16_t* out);
  void (*bf16)(const Bf16Gemm& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1);
};

constexpr int64_t kBlockQ = 32;     // query rows computed together
constexpr int64_t kTaskRows = 512;  // query rows per attention task (blocks sharing keys)

namespace generic { extern const Kernels kernels; }
namespace avx2 { extern const Kernels kernels; }
namespace avx512 { extern const Kernels kernels; }
namespace avx512bf16 { extern const Kernels kernels; }
namespace amx { extern const Kernels kernels; }
namespace int8 {
extern const Int8Kernels kernels;
extern const GemmTiles tiles;  // where the AMX kernels are built
}  // namespace int8

}  // namespace qe
