// The GEMMs of the int8 route and of batch_invariant's bf16 route on AMX tiles (Intel Sapphire
// Rapids and later), in place of oneDNN's micro-kernel: blocks of 32 rows x 32 channels, four
// 32-bit result tiles, each product one 64-byte step of the rows (64 int8 or 32 bf16 values),
// along the whole input width in ascending order, so a row's sums depend on that row and the
// weights only. A block's sums go to a buffer in L1, and their rescale and rounding (the
// brgemm routes' own arithmetic: finish.h, store16) run while the next block's tile products
// do: the tile unit works beside the vector units, where a micro-kernel call followed by its
// store leaves each idle in turn. A gate|up projection's block is 16 gate and the same 16 up
// channels, stored as silu(gate) * up (gemm.h): the MLP's gating costs no pass of its own.
// Compiled with rows.cpp's vector flags plus AMX (native/build.py), so the rounding is the
// same instructions.
#include "../tiles.h"
#include "finish.h"

namespace qe {
namespace gemm {
namespace {

constexpr int64_t kBlock = 32;            // rows and channels of a block: 2 x 2 result tiles
constexpr int64_t kStep = 64;             // bytes of a row per tile product
constexpr int64_t kPrefetchSteps = 2;     // how far ahead strided weights are fetched
constexpr int64_t kResidentBytes = 1024;  // the widest rows whose 32-row blocks stay in L1

// The operands in bytes. Rows: a tile's 16 rows `stride` apart, a row's 64-byte steps `step`
// apart, 32-row blocks `block_bytes` apart from row 0; row-major
// (stride the row pitch, step 64) or packed by pack_rows (stride 64, step 2 KB). Weights in
// panels of kPanelChannels channels, `width` bytes per channel ([n_pad / panel][width / 4][panel]
// [4 bytes]: int8.pack, native.pack_panels); channels from `n` on are never stored. `up` > 0:
// a gate|up projection, whose block c is gate's channels [c, c + 16) and up's `up` further.
template <int64_t kPanelChannels>
struct TileOperands {
  static constexpr int64_t kPanelBytes = kPanelChannels * 4;  // per step row (4 int8, 2 bf16)
  const uint8_t* a;
  int64_t stride, step, block_bytes;
  const uint8_t* b;
  int64_t width, n, up;

  // output channels per block
  int64_t block_channels() const { return up ? kGatedChannels : kBlock; }

  // channel c's first 4 bytes
  const uint8_t* weights(int64_t c) const {
    return b + (c / kPanelChannels) * kPanelChannels * width + (c % kPanelChannels) * 4;
  }
};

// A finished block whose sums wait for their rescale.
struct Pending {
  const void* sums = nullptr;
  int64_t row = 0, rows = 0, col = 0;
};

// One block: rows [r, r + 32) x channels [c, c + 32) (gated: gate's and up's 16) summed into
// tiles 0-3, then stored to `sums` and left pending. Meanwhile the previous pending block is
// finished, a share of its rows per step. Weights in panels of 16 channels are read in a row,
// 1 KB a step, as the hardware's prefetcher expects; wider panels' tiles are 64 bytes of each
// of 16 rows, so those two steps ahead are fetched into L1 (a tile load from L2 stalls the
// products behind it).
template <bool kInt8, typename Operands, typename Finish>
void block(const Operands& t, int64_t r, int64_t c, int64_t row1, void* sums, Pending& pending,
           Finish& finish) {
  constexpr int64_t panel_bytes = Operands::kPanelBytes;
  constexpr bool fetch_ahead = panel_bytes > kStep;
  const int64_t steps = t.width / kStep, b_step = (kStep / 4) * panel_bytes;
  const uint8_t* b0 = t.weights(c);
  // past the last channel any weights do (those channels are never stored)
  const uint8_t* b1 = t.up                   ? t.weights(t.up + c)
                      : c + kChannels < t.n ? t.weights(c + kChannels)
                                            : b0;
  const uint8_t* a0 = t.a + r / kBlock * t.block_bytes;
  const uint8_t* a1 = a0 + 16 * t.stride;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    // each load between the products that free its tile
    _tile_loadd(4, a0 + s * t.step, t.stride);
    _tile_loadd(6, b0 + s * b_step, panel_bytes);
    if constexpr (kInt8) _tile_dpbusd(0, 4, 6); else _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + s * b_step, panel_bytes);
    if constexpr (kInt8) _tile_dpbusd(1, 4, 7); else _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + s * t.step, t.stride);
    if constexpr (kInt8) _tile_dpbusd(2, 5, 6); else _tile_dpbf16ps(2, 5, 6);
    if constexpr (kInt8) _tile_dpbusd(3, 5, 7); else _tile_dpbf16ps(3, 5, 7);
    if (fetch_ahead && s + kPrefetchSteps < steps) {
      const uint8_t* ahead0 = b0 + (s + kPrefetchSteps) * b_step;
      const uint8_t* ahead1 = b1 + (s + kPrefetchSteps) * b_step;
      for (int64_t i = 0; i < kStep / 4; ++i) {  // both tiles' rows
        _mm_prefetch(reinterpret_cast<const char*>(ahead0 + i * panel_bytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead1 + i * panel_bytes), _MM_HINT_T0);
      }
    }
    if (pending.sums) finish.rows(pending, s * kBlock / steps, (s + 1) * kBlock / steps);
  }
  auto* out = static_cast<uint32_t*>(sums);
  _tile_stored(0, out, kBlock * 4);
  _tile_stored(1, out + 16, kBlock * 4);
  _tile_stored(2, out + 16 * kBlock, kBlock * 4);
  _tile_stored(3, out + 16 * kBlock + 16, kBlock * 4);
  pending = {sums, r, row1 - r < kBlock ? row1 - r : kBlock, c};
  finish.start(c);
}

// Rows [row0, row1) x channels [col0, col1) of the output (row0 a multiple of 32, col0 of the
// blocks' channels; `a` holds whole blocks of rows and the weights whole panels, and a block's
// second tile past the last channel reads the first's, so tiles never read past them). Where a
// block of rows fits in L1 beside the weights passing through (rows of up to 1 KB), it stays
// there while the task's channels stream past; wider, each block of channels serves the task's
// rows in turn, from L2.
template <bool kInt8, typename Operands, typename Finish>
void tile_task(const Operands& t, int64_t row0, int64_t row1, int64_t col0, int64_t col1,
               Finish& finish) {
  alignas(64) uint32_t sums[2][kBlock * kBlock];
  Pending pending;
  int buffer = 0;
  auto next = [&](int64_t r, int64_t c) {
    block<kInt8>(t, r, c, row1, sums[buffer], pending, finish);
    buffer ^= 1;
  };
  const int64_t channels = t.block_channels();
  configure_tiles();
  if (t.width <= kResidentBytes) {
    for (int64_t r = row0; r < row1; r += kBlock)
      for (int64_t c = col0; c < col1; c += channels) next(r, c);
  } else {
    for (int64_t c = col0; c < col1; c += channels)
      for (int64_t r = row0; r < row1; r += kBlock) next(r, c);
  }
  if (pending.sums) finish.rows(pending, 0, kBlock);
}

// int8: (sum - offset) * row scale * channel scale + bias, rounded (finish.h); gated, then
// silu(gate) * up.
template <typename T>
struct Int8Finish {
  const Int8Gemm<T>& g;
  ChannelGroup group[2];

  void start(int64_t c) {
    group[0] = channel_group(g, c);
    group[1] = channel_group(g, g.up ? g.up + c : c + kChannels);
  }
  void rows(const Pending& p, int64_t i0, int64_t i1) const {
    const auto* sums = static_cast<const int32_t*>(p.sums);
    for (int64_t i = i0; i < i1 && i < p.rows; ++i) {
      const __m512 a_scale = _mm512_set1_ps(g.a_scale[p.row + i]);
      T* out = g.out + (p.row + i) * g.ldo + p.col;
      if (g.up) {
        finish_gated16(g, sums + i * kBlock, sums + i * kBlock + kChannels, a_scale, group, out);
        continue;
      }
      finish16(g, sums + i * kBlock, a_scale, group[0], out);
      if (p.col + kChannels < g.n)
        finish16(g, sums + i * kBlock + kChannels, a_scale, group[1], out + kChannels);
    }
  }
};

template <typename T, int64_t kPanelChannels>
void int8_panels_task(const Int8Gemm<T>& g, int64_t row0, int64_t row1, int64_t col0,
                      int64_t col1) {
  const TileOperands<kPanelChannels> t{g.a,
                                       g.k_pad,
                                       kStep,
                                       kBlock * g.k_pad,
                                       reinterpret_cast<const uint8_t*>(g.packed),
                                       g.k_pad,
                                       g.n,
                                       g.up};
  Int8Finish<T> finish{g, {}};
  tile_task<true>(t, row0, row1, col0, col1, finish);
}

// The weights in panels of kTilePanel or kPanel channels.
template <typename T>
void int8_task(const Int8Gemm<T>& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1) {
  if (g.panel == kTilePanel)
    int8_panels_task<T, kTilePanel>(g, row0, row1, col0, col1);
  else
    int8_panels_task<T, kPanel>(g, row0, row1, col0, col1);
}

// bf16: the fp32 sums plus bias, rounded (finish.h, as the brgemm route stores them); gated,
// then silu(gate) * up (no bias).
struct Bf16Finish {
  const Bf16Gemm& g;

  void start(int64_t) {}
  void rows(const Pending& p, int64_t i0, int64_t i1) const {
    const auto* sums = static_cast<const float*>(p.sums);
    if (g.up) {
      for (int64_t i = i0; i < i1 && i < p.rows; ++i)
        store_gated16(_mm512_loadu_ps(sums + i * kBlock),
                      _mm512_loadu_ps(sums + i * kBlock + kChannels), first_lanes(g.up - p.col),
                      g.out + (p.row + i) * g.ldo + p.col);
      return;
    }
    for (int64_t i = i0; i < i1 && i < p.rows; ++i)
      for (int64_t c = p.col; c < p.col + kBlock && c < g.n; c += kChannels)
        store_sums16(sums + i * kBlock + (c - p.col), g.bias ? g.bias + c : nullptr,
                     first_lanes(g.n - c), g.out + (p.row + i) * g.ldo + c);
  }
};

// Rows [row0, row1) of x (k bf16 values, lda apart) -> 32-row blocks of [k / 32][32 rows][32
// values] from block row0 / 32 of `out`, rows past m zeros: a tile's 16 rows are 1 KB in a row,
// where rows 2-6 KB apart would meet in a few L1 sets.
void pack_rows(const uint16_t* x, int64_t lda, int64_t m, int64_t k, int64_t row0, int64_t row1,
               uint16_t* out) {
  constexpr int64_t step = kStep / 2;  // bf16 values per tile step
  for (int64_t r = row0; r < row1; ++r) {
    uint16_t* dst = out + (r / kBlock) * kBlock * k + (r % kBlock) * step;
    for (int64_t s = 0; s < k / step; ++s) {
      const __m512i values =
          r < m ? _mm512_loadu_si512(x + r * lda + s * step) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + s * kBlock * step, values);
    }
  }
}

// `a` holds the rows packed by pack_rows.
template <int64_t kPanelChannels>
void bf16_panels_task(const Bf16Gemm& g, int64_t row0, int64_t row1, int64_t col0,
                      int64_t col1) {
  const int64_t width = g.k * 2;
  const TileOperands<kPanelChannels> t{reinterpret_cast<const uint8_t*>(g.a),
                                       kStep,
                                       kBlock * kStep,
                                       kBlock * width,
                                       reinterpret_cast<const uint8_t*>(g.packed),
                                       width,
                                       g.n,
                                       g.up};
  Bf16Finish finish{g};
  tile_task<false>(t, row0, row1, col0, col1, finish);
}

// The weights in panels of kTilePanel or kPanel channels.
void bf16_task(const Bf16Gemm& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1) {
  if (g.panel == kTilePanel)
    bf16_panels_task<kTilePanel>(g, row0, row1, col0, col1);
  else
    bf16_panels_task<kPanel>(g, row0, row1, col0, col1);
}

}  // namespace

extern const GemmTiles tiles = {int8_task<float>, int8_task<uint16_t>, pack_rows, bf16_task};

}  // namespace gemm
}  // namespace qe
