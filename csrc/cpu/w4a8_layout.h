// Packed layout of one expert's int4 weights for the CPU W4A8 GEMM.
//
// A GEMM with N outputs, K inputs and group size g (g = K for channel-wise)
// has G = K / g groups. N % 16 == 0 and K % 8 == 0. Bytes, in order:
//
//   for tile nt in [0, N/16):          16 output rows, one SIMD register wide
//     for group gi in [0, G):
//       g/8 blocks of 64 bytes; block kb covers k0 = gi*g + 8*kb:
//         byte[4*r + j] = (q[16nt+r][k0+j] + 8) | (q[16nt+r][k0+4+j] + 8) << 4
//       16 x float32 scales sw[16nt + r][gi]
//   row_corr: N x float32, sum_gi sw[n][gi] * sum_{k in gi} q[n][k]
//   bias:     N x float32 (zeros when the layer has none)
//
// Why: one 64-byte block is the operand of vpdpbusd for 16 rows x 4 inputs
// (low nibbles) plus 16 rows x 4 inputs (high nibbles); a tile is one
// sequential stream (weights, then its scales), which the hardware prefetcher
// follows; the activations' zero point enters once per row via row_corr:
//   y[t][n] = s_t * (sum_g sw[n][g] * (dot_g(q + 8, qa_t) - 8 * asum_g(qa_t))
//                    - zp_t * row_corr[n]) + bias[n]
// jax_moeq/ops/w4a8_cpu.py writes this layout; keep the two in step.
#pragma once

#include <cstdint>

namespace jax_moeq::cpu {

inline constexpr int64_t kTileRows = 16;     // output rows per tile
inline constexpr int64_t kBlockInputs = 8;   // inputs per 64-byte block
inline constexpr int64_t kBlockBytes = 64;

struct PackedGemmShape {
  int64_t n;      // outputs
  int64_t k;      // inputs
  int64_t group;  // effective group size (k for channel-wise)

  int64_t groups() const { return k / group; }
  // Bytes of one (tile, group) chunk: weights then 16 scales.
  int64_t chunk_bytes() const { return group / kBlockInputs * kBlockBytes + kTileRows * 4; }
  int64_t tile_bytes() const { return groups() * chunk_bytes(); }
  int64_t row_corr_offset() const { return n / kTileRows * tile_bytes(); }
  int64_t bias_offset() const { return row_corr_offset() + n * 4; }
  int64_t total_bytes() const { return bias_offset() + n * 4; }
};

}  // namespace jax_moeq::cpu
