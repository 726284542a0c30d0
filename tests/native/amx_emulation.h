// Scalar stand-ins for the AMX tile intrinsics that csrc/cpu/w4a8_gemm_amx.cc uses, so that its
// loops (tile configuration, operand layout, row and tile remainders) can be checked bit for bit
// against the VNNI path on a machine without AMX. Force-included ahead of the kernel
// (-include tests/native/amx_emulation.h); its other intrinsics stay the real AVX-512 ones.
// Each emulated TDPBSUD checks its operands' shapes against the configuration, as the hardware
// would fault on a mismatch.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace amx_emulation {

struct Tiles {
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  uint8_t data[8][16][64] = {};
  bool configured = false;
};

inline Tiles& State() {
  static thread_local Tiles tiles;
  return tiles;
}

[[noreturn]] inline void Fail(const char* what) {
  std::fprintf(stderr, "amx emulation: %s\n", what);
  std::abort();
}

inline void LoadConfig(const void* config) {
  const uint8_t* cfg = static_cast<const uint8_t*>(config);
  if (cfg[0] != 1) Fail("palette must be 1");
  Tiles& t = State();
  for (int i = 0; i < 8; ++i) {
    std::memcpy(&t.colsb[i], cfg + 16 + 2 * i, 2);
    t.rows[i] = cfg[48 + i];
    if (t.rows[i] > 16 || t.colsb[i] > 64) Fail("tile larger than 16 x 64 bytes");
  }
  t.configured = true;
}

inline void Release() { State() = Tiles(); }

inline void Load(int tile, const void* base, int64_t stride) {
  Tiles& t = State();
  if (!t.configured) Fail("tile load before configuration");
  for (int r = 0; r < t.rows[tile]; ++r) {
    std::memcpy(t.data[tile][r], static_cast<const uint8_t*>(base) + r * stride, t.colsb[tile]);
  }
}

inline void Store(int tile, void* base, int64_t stride) {
  Tiles& t = State();
  for (int r = 0; r < t.rows[tile]; ++r) {
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[tile][r], t.colsb[tile]);
  }
}

inline void Zero(int tile) { std::memset(State().data[tile], 0, sizeof(State().data[tile])); }

// C[m][n] += sum_k int8(A[m][4k + i]) * B[k][4n + i], int32 lanes: B bytes unsigned (TDPBSUD)
// or signed (kSignedB, TDPBSSD).
template <bool kSignedB>
inline void Dot(int c, int a, int b) {
  Tiles& t = State();
  const int m = t.rows[c], n = t.colsb[c] / 4, k = t.colsb[a] / 4;
  if (t.rows[a] != m || t.rows[b] != k || t.colsb[b] != t.colsb[c]) Fail("TDPB*D shape mismatch");
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      int32_t sum;
      std::memcpy(&sum, &t.data[c][i][4 * j], 4);
      for (int q = 0; q < k; ++q) {
        for (int e = 0; e < 4; ++e) {
          const uint8_t bv = t.data[b][q][4 * j + e];
          sum += static_cast<int32_t>(static_cast<int8_t>(t.data[a][i][4 * q + e])) *
                 (kSignedB ? static_cast<int32_t>(static_cast<int8_t>(bv)) : static_cast<int32_t>(bv));
        }
      }
      std::memcpy(&t.data[c][i][4 * j], &sum, 4);
    }
  }
}

}  // namespace amx_emulation

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbsud
#undef _tile_dpbssd
#define _tile_loadconfig(cfg) ::amx_emulation::LoadConfig(cfg)
#define _tile_release() ::amx_emulation::Release()
#define _tile_loadd(tile, base, stride) ::amx_emulation::Load((tile), (base), (stride))
#define _tile_stored(tile, base, stride) ::amx_emulation::Store((tile), (base), (stride))
#define _tile_zero(tile) ::amx_emulation::Zero(tile)
#define _tile_dpbsud(c, a, b) ::amx_emulation::Dot<false>((c), (a), (b))
#define _tile_dpbssd(c, a, b) ::amx_emulation::Dot<true>((c), (a), (b))
