// AMX tile configuration shared by the tile kernels (attention_amx.h, gemm/tiles_amx.cpp).
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace qe {
namespace {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every kernel's layout: tiles 0-3 results (16 x 16 32-bit sums); 4-5 the left operand's two
// 16-row halves; 6-7 the right operand's. A task calls it before its first tile instruction:
// oneDNN's micro-kernel and the other tile kernels leave their own configuration behind.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

}  // namespace
}  // namespace qe
