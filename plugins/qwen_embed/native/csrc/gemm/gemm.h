// The GEMM operators' operands and kernels (namespace qe::gemm): the int8 route's,
// batch_invariant's bf16 GEMM and the fp32 GEMM of AVX2 CPUs. rows.cpp and tiles_amx.cpp are
// compiled with AVX-512 flags (and AMX for the tiles), panels_avx512bf16.cpp and panels_vnni.cpp
// with AVX512_BF16's and VNNI's, pairs_avx2.cpp and floats_avx2.cpp with AVX2's
// (native/build.py); ops.cpp schedules them.
#pragma once
#include <stdint.h>

#include <algorithm>

namespace qe {
namespace gemm {

constexpr int64_t kPanel = 64;  // channels per panel of packed GEMM weights (int8, bf16)
// Weights for the AMX tile kernels: a panel of 16 channels makes each step's weight tile 1 KB
// in a row, not 64 bytes of each of 16 rows 256 bytes apart (a strided tile load is slower).
constexpr int64_t kTilePanel = 16;
// Output channels of a gated tile block (a gate|up projection's: 16 gate, 16 up channels).
constexpr int64_t kGatedChannels = 16;

// One int8 linear layer's operands (rows.cpp, ops.cpp): `a` rows of k_pad uint8 codes (the
// activation / a_scale rounded, + 128), `packed` the int8 weights in panels of `panel`
// channels (kPanel, or kTilePanel for the tile kernel), [n_pad / panel][k_pad / 4][panel][4],
// `offset` 128 x each channel's weight sum, `w_scale` per channel, `bias` fp32 or null;
// out[row][c] = (sum - offset[c]) * a_scale[row] * w_scale[c] + bias[c], at row stride ldo.
// `up` > 0: the n channels are a gate|up projection, gate's `up` channels then up's, and out
// holds silu(gate) * up (up channels), each half rounded to T first: the plain GEMM's output,
// then the row kernels' silu_mul, fused into the store.
template <typename T>
struct Int8Gemm {
  const uint8_t* a;
  const float* a_scale;
  const int8_t* packed;
  const int32_t* offset;
  const float* w_scale;
  const float* bias;
  T* out;
  int64_t k_pad, n, ldo, panel;
  int64_t up = 0;
};

// The row work around the GEMMs (rows.cpp). int8: rows of activations -> codes and scales
// (quantize; block > 1: each row rotated first by a Walsh-Hadamard transform per `block`
// values), and the GEMM's int32 sums -> outputs (finish_int8: `rows` rows x `cols` channels
// from `row`, `col`, `ld` sums per row; g.up > 0: silu(gate) * up, up's sums after gate's,
// `rows` x ld of them).
struct RowKernels {
  void (*quantize_f32)(const float* x, int64_t stride, int64_t rows, int64_t k, int64_t k_pad,
                       int64_t block, uint8_t* codes, float* scale);
  void (*quantize_bf16)(const uint16_t* x, int64_t stride, int64_t rows, int64_t k,
                        int64_t k_pad, int64_t block, uint8_t* codes, float* scale);
  void (*finish_int8_f32)(const Int8Gemm<float>& g, const int32_t* sums, int64_t ld, int64_t row,
                     int64_t rows, int64_t col, int64_t cols);
  void (*finish_int8_bf16)(const Int8Gemm<uint16_t>& g, const int32_t* sums, int64_t ld, int64_t row,
                      int64_t rows, int64_t col, int64_t cols);
  // The bf16 GEMM's fp32 sums (`ld` per row) -> `rows` x `cols` bf16 outputs at row stride ldo,
  // plus bias (fp32, or null) before rounding.
  void (*store_bf16)(const float* sums, int64_t ld, int64_t rows, int64_t cols, const float* bias,
                     uint16_t* out, int64_t ldo);
  // A gate|up projection's: `rows` x ld sums of gate's channels, then as many of up's ->
  // silu(gate) * up, each half rounded to bf16 first (Int8Gemm's `up`).
  void (*store_gated_bf16)(const float* sums, int64_t ld, int64_t rows, int64_t cols,
                           uint16_t* out, int64_t ldo);
  // Panels [p0, p1) of bf16_linear's packed weights ([panels][steps][panel][2], 2 * steps
  // values per channel) plus a low-rank pair's product, bt [r][n] (B transposed) and a
  // [r][2 * steps], fp32: each weight float(w) + the sum over r of b * a (multiply-adds in r's
  // order, from the first to the last rank whose b is not zero on the channel's group of 16),
  // rounded once, into out (the same layout); channels past n (padding) unchanged.
  void (*merge_pair_bf16)(const uint16_t* packed, int64_t steps, int64_t panel, const float* bt,
                          const float* a, int64_t n, int64_t r, int64_t p0, int64_t p1,
                          uint16_t* out);
};

// batch_invariant's bf16 GEMM on AMX tiles (ops.cpp bf16_linear): rows packed by pack_rows (k bf16
// values each) times weights packed [n_pad / panel][k / 2][panel][2], panel kTilePanel or kPanel,
// -> out (row stride ldo) + bias (fp32 or null); `up` > 0: a gate|up projection as Int8Gemm's.
struct Bf16Gemm {
  const uint16_t* a;
  int64_t k;
  const uint16_t* packed;
  const float* bias;
  uint16_t* out;
  int64_t ldo, n, panel;
  int64_t up = 0;
};

// The GEMMs on AMX tiles (tiles_amx.cpp): rows [row0, row1) x channels [col0, col1) of out, row0
// a multiple of 32 and col0 of 32 (of 16 where gated). int8: `a` holds whole 32-row blocks of
// codes and k_pad is a multiple of 64; bf16: k a multiple of 32.
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

// The int8 route's GEMM on AVX2 without VNNI (pairs_avx2.cpp): rows of k_pad int16 codes (`a`,
// int8 values, k_pad even) times int8 weights packed in panels of kPairsPanel channels
// [n_pad / 16][k_pad / 2][16][2] (vpmaddwd's pairs of input values, once widened), exact
// int32 sums; out[row][c] = float(sum) * a_scale[row] * w_scale[c] (w_scale padded to n_pad),
// row stride n.
constexpr int64_t kPairsPanel = 16;
struct PairsGemm {
  const int16_t* a;
  const float* a_scale;
  const int8_t* packed;
  const float* w_scale;
  float* out;
  int64_t k_pad, n;
};
struct PairsKernels {
  // rows of x (fp32, bf16) -> codes [rows][k_pad] and their scales, each row rotated first per
  // `block` values when block > 1 (int8.hadamard_rows, then int8.quantize_rows: their bits)
  void (*quantize_f32)(const float* x, int64_t stride, int64_t rows, int64_t k, int64_t k_pad,
                       int64_t block, int16_t* codes, float* scale);
  void (*quantize_bf16)(const uint16_t* x, int64_t stride, int64_t rows, int64_t k,
                        int64_t k_pad, int64_t block, int16_t* codes, float* scale);
  // rows [row0, row1) x channels [col0, col1) of out, col0 a multiple of kPairsPanel
  void (*gemm)(const PairsGemm& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1);
};

// The fp32 GEMM on AVX2 (floats_avx2.cpp): rows of k fp32 values (`a`, row stride lda) times
// weights packed in panels of kFloatPanel channels [n_pad / 16][k][16] -> out (row stride ldo)
// + bias (fp32 [n], or null); each output one chain of multiply-adds in input order. The
// weights are fp32 (`packed`) or, where each is a bf16 value, bf16 (`packed_bf16`, the other
// null) with each depth's 16 channels in the order 0, 8, 1, 9, ..., 7, 15 (a 32-bit lane holds
// channels c and c + 8), widened exactly as they are loaded.
constexpr int64_t kFloatPanel = 16;
struct FloatGemm {
  const float* a;
  int64_t lda;
  const float* packed;
  const uint16_t* packed_bf16;
  const float* bias;
  float* out;
  int64_t ldo, k, n;
};
struct FloatKernels {
  // rows [row0, row1) x channels [col0, col1) of out, col0 a multiple of kFloatPanel
  void (*gemm)(const FloatGemm& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1);
};

// Our panel kernels (panels.h): `rows` rows of `a` (row stride lda) times one panel of kPanel
// channels of the packed weights, k values per channel -> sums [rows][kPanel], oneDNN brgemm's
// bits; `next` (or null) the panel to fetch into cache meanwhile. bf16_panels (AVX512_BF16):
// bf16 rows, fp32 sums; int8_panels (AVX512_VNNI): uint8 codes, int32 sums, k a multiple of 4.
template <typename A, typename B, typename Sum>
struct PanelKernel {
  void (*sums)(const A* a, int64_t lda, int64_t rows, const B* panel, int64_t k, const B* next,
               Sum* sums);
};

extern const RowKernels rows;
extern const PanelKernel<uint16_t, uint16_t, float> bf16_panels;
extern const PanelKernel<uint8_t, int8_t, int32_t> int8_panels;
extern const PairsKernels pairs_avx2;
extern const FloatKernels floats_avx2;
extern const GemmTiles tiles;  // where the AMX kernels are built

}  // namespace gemm
}  // namespace qe
