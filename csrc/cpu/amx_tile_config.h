// AMX palette 1's tile configuration: LDTILECFG's 64-byte operand (Intel SDM, "TILECFG"). Shared
// by the AMX GEMM (w4a8_gemm_amx.cc) and the AMX benchmarks.
#pragma once

#include <cstdint>

namespace jax_moeq::cpu {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of tiles 0-15
  uint8_t rows[16];    // rows of tiles 0-15
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

}  // namespace jax_moeq::cpu
