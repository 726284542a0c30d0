// AArch64 NEON W4A8 GEMM with SDOT (vdotq_s32, FEAT_DotProd). A 64-byte block
// is 4 q-registers of 4 rows x 4 bytes. The low nibbles (q + 8, 0..15: valid
// signed bytes, so s8 x s8 is exact) of a 32-bit lane meet x[k0..k0+3], the
// high nibbles x[k0+4..k0+7]; vdotq_lane_s32 picks those 4 activation bytes
// from one 8-byte load. Four int32x4 accumulators per token hold the tile's 16
// rows; up to kTokenBlock tokens share each weight load.
#include <arm_neon.h>

#include "cpu/w4a8_gemm.h"
#include "cpu/w4a8_gemm_neon.h"

namespace jax_moeq::cpu {
namespace {

// 4 tokens x 4 int32 accumulators + 8 nibble registers stay within the 32
// vector registers; the float accumulators change once per group only.
constexpr int kTokenBlock = 4;

template <int M>
void TileTokens(const W4A8GemmArgs& a, int64_t nt, int64_t i0) {
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups();
  const int64_t blocks_per_group = s.group / kBlockInputs;
  const int8_t* x[M];
  const int32_t* sum8[M];
  for (int i = 0; i < M; ++i) {
    const int64_t row = a.rows[i0 + i];
    x[i] = a.act.values + row * s.k;
    sum8[i] = a.act.sum8 + row * groups;
  }
  const uint8x16_t low_mask = vdupq_n_u8(0x0F);
  float32x4_t acc[M][4];
  for (int i = 0; i < M; ++i) {
    for (int q = 0; q < 4; ++q) acc[i][q] = vdupq_n_f32(0.0f);
  }
  const uint8_t* p = a.weights + nt * s.tile_bytes();
  for (int64_t gi = 0; gi < groups; ++gi) {
    int32x4_t dot[M][4];
    for (int i = 0; i < M; ++i) {
      for (int q = 0; q < 4; ++q) dot[i][q] = vdupq_n_s32(0);
    }
    const int64_t k_group = gi * s.group;
    for (int64_t kb = 0; kb < blocks_per_group; ++kb, p += kBlockBytes) {
      // Unrolled loops (pragmas) keep the accumulators in registers at -O2 as well.
      int8x16_t lo[4], hi[4];
      #pragma GCC unroll 8
      for (int q = 0; q < 4; ++q) {
        const uint8x16_t packed = vld1q_u8(p + 16 * q);
        lo[q] = vreinterpretq_s8_u8(vandq_u8(packed, low_mask));
        hi[q] = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4));
      }
      const int64_t k0 = k_group + kb * kBlockInputs;
      #pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const int8x8_t xk = vld1_s8(x[i] + k0);  // lane 0: x[k0..k0+3], lane 1: x[k0+4..k0+7]
        #pragma GCC unroll 8
        for (int q = 0; q < 4; ++q) {
          dot[i][q] = vdotq_lane_s32(dot[i][q], lo[q], xk, 0);
          dot[i][q] = vdotq_lane_s32(dot[i][q], hi[q], xk, 1);
        }
      }
    }
    float32x4_t scale[4];
    NeonLoadScales(p, scale);
    p += kTileRows * 4;
    for (int i = 0; i < M; ++i) {
      for (int q = 0; q < 4; ++q) {
        acc[i][q] = NeonAddGroup(acc[i][q], dot[i][q], sum8[i][gi], scale[q]);
      }
    }
  }
  for (int i = 0; i < M; ++i) NeonStoreTile(a, nt, i0 + i, acc[i]);
}

}  // namespace

void W4A8NeonDotprodTokens(const W4A8GemmArgs& a, int64_t nt, int64_t i0, int64_t count) {
  const int64_t end = i0 + count;
  int64_t i = i0;
  for (; i + kTokenBlock <= end; i += kTokenBlock) TileTokens<kTokenBlock>(a, nt, i);
  switch (end - i) {
    case 3: TileTokens<3>(a, nt, i); break;
    case 2: TileTokens<2>(a, nt, i); break;
    case 1: TileTokens<1>(a, nt, i); break;
    default: break;
  }
}

void W4A8GemmNeonDotprod(const W4A8GemmArgs& a) {
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) W4A8NeonDotprodTokens(a, nt, 0, a.m);
}

}  // namespace jax_moeq::cpu
