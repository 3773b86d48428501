// The int8 route's GEMM on AMX int8 tiles (Intel Sapphire Rapids and later), in place of
// oneDNN's micro-kernel where the CPU has them: blocks of 32 rows x 32 channels, four int32
// result tiles, each product 64 input values deep, along the whole input width (integer sums:
// the same at any blocking or row count). A block's sums go to a buffer in L1, and their rescale
// (int8_finish.h, the brgemm route's own arithmetic) runs while the next block's tile products
// do: the tile unit works beside the vector units, where a micro-kernel call followed by its
// rescale leaves each idle in turn. Compiled with the brgemm route's vector flags plus AMX
// (native/build.py), so both routes give the same bits.
#include "int8_finish.h"
#include "tiles.h"

namespace qe {
namespace int8 {
namespace {

constexpr int64_t kBlock = 32;       // rows and channels of a block: 2 x 2 result tiles
constexpr int64_t kDepth = 64;       // input values per tile product
constexpr int64_t kPanelBytes = kPanel * 4;  // a panel's bytes per group of 4 input values
constexpr int64_t kPrefetchSteps = 2;  // how far ahead the weights are fetched
constexpr int64_t kRowsResident = 1024;  // the widest input whose row blocks stay in L1

// The sums of one finished block, waiting for their rescale.
template <typename T>
struct Pending {
  const int32_t* sums = nullptr;
  int64_t row = 0, rows = 0, col = 0;
  ChannelGroup group[2];
};

// Rows [i0, i1) of a pending block: its 32 channels, 16 at a time.
template <typename T>
inline void finish_rows(const Int8Gemm<T>& g, const Pending<T>& p, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1 && i < p.rows; ++i) {
    const __m512 a_scale = _mm512_set1_ps(g.a_scale[p.row + i]);
    T* out = g.out + (p.row + i) * g.ldo + p.col;
    finish16(g, p.sums + i * kBlock, a_scale, p.group[0], out);
    if (p.col + kChannels < g.n)
      finish16(g, p.sums + i * kBlock + kChannels, a_scale, p.group[1], out + kChannels);
  }
}

// One block: rows [r, r + 32) x channels [c, c + 32) summed over the whole input width into
// tiles 0-3, then stored to `sums` and left pending. Meanwhile the previous pending block is
// rescaled, a share of its rows per step, and the weights two steps ahead are fetched into L1
// (a tile load from L2 stalls the products behind it).
template <typename T>
void block(const Int8Gemm<T>& g, int64_t r, int64_t c, int64_t row1, int32_t* sums,
           Pending<T>& pending) {
  const int64_t steps = g.k_pad / kDepth, lda = g.k_pad;
  const int64_t b_step = (kDepth / 4) * kPanelBytes;  // a step's bytes of a panel
  const int8_t* b0 = g.packed + (c / kPanel) * kPanel * g.k_pad + (c % kPanel) * 4;
  const int8_t* b1 = b0 + kChannels * 4;
  const uint8_t* a0 = g.a + r * lda;
  const uint8_t* a1 = a0 + 16 * lda;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    // each load between the products that free its tile
    _tile_loadd(4, a0 + s * kDepth, lda);
    _tile_loadd(6, b0 + s * b_step, kPanelBytes);
    _tile_dpbusd(0, 4, 6);
    _tile_loadd(7, b1 + s * b_step, kPanelBytes);
    _tile_dpbusd(1, 4, 7);
    _tile_loadd(5, a1 + s * kDepth, lda);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
    if (s + kPrefetchSteps < steps) {
      const int8_t* ahead = b0 + (s + kPrefetchSteps) * b_step;
      for (int64_t i = 0; i < kDepth / 4; ++i) {  // both tiles' rows: 128 bytes of each
        _mm_prefetch(reinterpret_cast<const char*>(ahead + i * kPanelBytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + i * kPanelBytes + 64), _MM_HINT_T0);
      }
    }
    if (pending.sums) finish_rows(g, pending, s * kBlock / steps, (s + 1) * kBlock / steps);
  }
  _tile_stored(0, sums, kBlock * 4);
  _tile_stored(1, sums + 16, kBlock * 4);
  _tile_stored(2, sums + 16 * kBlock, kBlock * 4);
  _tile_stored(3, sums + 16 * kBlock + 16, kBlock * 4);
  pending.sums = sums;
  pending.row = r;
  pending.rows = row1 - r < kBlock ? row1 - r : kBlock;
  pending.col = c;
  pending.group[0] = channel_group(g, c);
  pending.group[1] = channel_group(g, c + kChannels);
}

// Rows [row0, row1) x channels [col0, col1) of the GEMM (row0 and col0 multiples of 32; the
// codes hold whole blocks of rows and the weights whole panels, so tiles never read past them).
// Where a block of rows' codes fits in L1 beside the weights passing through (k_pad <= 1,024),
// it stays there while the task's channels stream past; wider, each block of channels serves
// the task's rows in turn, from L2.
template <typename T>
void gemm_task(const Int8Gemm<T>& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1) {
  alignas(64) int32_t sums[2][kBlock * kBlock];
  Pending<T> pending;
  int buffer = 0;
  auto next = [&](int64_t r, int64_t c) {
    block(g, r, c, row1, sums[buffer], pending);
    buffer ^= 1;
  };
  configure_tiles();
  if (g.k_pad <= kRowsResident) {
    for (int64_t r = row0; r < row1; r += kBlock)
      for (int64_t c = col0; c < col1; c += kBlock) next(r, c);
  } else {
    for (int64_t c = col0; c < col1; c += kBlock)
      for (int64_t r = row0; r < row1; r += kBlock) next(r, c);
  }
  if (pending.sums) finish_rows(g, pending, 0, kBlock);
}

}  // namespace

extern const Int8Tiles tiles = {gemm_task<float>, gemm_task<uint16_t>};

}  // namespace int8
}  // namespace qe
