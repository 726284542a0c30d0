// AArch64 NEON W4A8 GEMM with SMMLA (vmmlaq_s32, FEAT_I8MM): one instruction
// multiplies 2 weight rows x 8 inputs by 2 tokens x 8 inputs into the 2x2
// int32 block [row a: t0, t1 | row b: t0, t1]. A 64-byte block's low and high
// nibble registers (4 rows x 4 inputs each) zipped by 32-bit lanes give rows
// (4q, 4q+1) and (4q+2, 4q+3) with their 8 inputs k0..k0+7 in order. Tokens go
// in pairs, up to kPairBlock pairs per weight load; an odd last token runs the
// SDOT code.
#include <arm_neon.h>

#include "cpu/w4a8_gemm.h"
#include "cpu/w4a8_gemm_neon.h"

namespace jax_moeq::cpu {
namespace {

// 2 pairs x 8 accumulators + 8 zipped weight registers fit the 32 vector registers.
constexpr int kPairBlock = 2;

// Zipped weights of one block: w[2q] = rows 4q, 4q+1; w[2q+1] = rows 4q+2, 4q+3.
inline void LoadRowPairs(const uint8_t* p, int8x16_t w[8]) {
  const uint8x16_t low_mask = vdupq_n_u8(0x0F);
  #pragma GCC unroll 8
  for (int q = 0; q < 4; ++q) {
    const uint8x16_t packed = vld1q_u8(p + 16 * q);
    const int32x4_t lo = vreinterpretq_s32_u8(vandq_u8(packed, low_mask));
    const int32x4_t hi = vreinterpretq_s32_u8(vshrq_n_u8(packed, 4));
    w[2 * q] = vreinterpretq_s8_s32(vzip1q_s32(lo, hi));
    w[2 * q + 1] = vreinterpretq_s8_s32(vzip2q_s32(lo, hi));
  }
}

// Tokens i0 .. i0 + 2P - 1 of tile nt, as P pairs.
template <int P>
void TilePairs(const W4A8GemmArgs& a, int64_t nt, int64_t i0) {
  constexpr int M = 2 * P;
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
  float32x4_t acc[M][4];
  for (int i = 0; i < M; ++i) {
    for (int q = 0; q < 4; ++q) acc[i][q] = vdupq_n_f32(0.0f);
  }
  const uint8_t* p = a.weights + nt * s.tile_bytes();
  for (int64_t gi = 0; gi < groups; ++gi) {
    int32x4_t dot[P][8];
    for (int pr = 0; pr < P; ++pr) {
      for (int j = 0; j < 8; ++j) dot[pr][j] = vdupq_n_s32(0);
    }
    const int64_t k_group = gi * s.group;
    for (int64_t kb = 0; kb < blocks_per_group; ++kb, p += kBlockBytes) {
      // Unrolled loops (pragmas) keep the accumulators in registers at -O2 as well.
      int8x16_t w[8];
      LoadRowPairs(p, w);
      const int64_t k0 = k_group + kb * kBlockInputs;
      #pragma GCC unroll 8
      for (int pr = 0; pr < P; ++pr) {
        const int8x16_t tokens = vcombine_s8(vld1_s8(x[2 * pr] + k0), vld1_s8(x[2 * pr + 1] + k0));
        #pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) dot[pr][j] = vmmlaq_s32(dot[pr][j], w[j], tokens);
      }
    }
    float32x4_t scale[4];
    NeonLoadScales(p, scale);
    p += kTileRows * 4;
    for (int pr = 0; pr < P; ++pr) {
      for (int q = 0; q < 4; ++q) {
        // Even lanes of the two 2x2 blocks are the pair's first token, rows 4q..4q+3.
        const int32x4_t first = vuzp1q_s32(dot[pr][2 * q], dot[pr][2 * q + 1]);
        const int32x4_t second = vuzp2q_s32(dot[pr][2 * q], dot[pr][2 * q + 1]);
        const int i = 2 * pr;
        acc[i][q] = NeonAddGroup(acc[i][q], first, sum8[i][gi], scale[q]);
        acc[i + 1][q] = NeonAddGroup(acc[i + 1][q], second, sum8[i + 1][gi], scale[q]);
      }
    }
  }
  for (int i = 0; i < M; ++i) NeonStoreTile(a, nt, i0 + i, acc[i]);
}

}  // namespace

void W4A8GemmNeonI8mm(const W4A8GemmArgs& a) {
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    int64_t i = 0;
    for (; i + 2 * kPairBlock <= a.m; i += 2 * kPairBlock) TilePairs<kPairBlock>(a, nt, i);
    if (i + 2 <= a.m) {
      TilePairs<1>(a, nt, i);
      i += 2;
    }
    if (i < a.m) W4A8NeonDotprodTokens(a, nt, i, a.m - i);
  }
}

}  // namespace jax_moeq::cpu
