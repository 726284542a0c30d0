// Pieces shared by the two AArch64 NEON GEMMs (w4a8_gemm_neon_dotprod.cc,
// w4a8_gemm_neon_i8mm.cc). Only for those files: it needs <arm_neon.h>.
//
// Their float steps are the portable path's operations in its order, one
// rounding each (separate vmulq/vaddq, files built with -ffp-contract=off), and
// their int32 dot products are exact, so NEON outputs equal the portable ones
// bit for bit.
#pragma once

#include <arm_neon.h>

#include <cstdint>

#include "cpu/w4a8_gemm.h"

namespace jax_moeq::cpu {

// Tokens [i0, i0 + count) of output tile nt with SDOT (w4a8_gemm_neon_dotprod.cc).
// The i8mm path runs an odd last token through it.
void W4A8NeonDotprodTokens(const W4A8GemmArgs& a, int64_t nt, int64_t i0, int64_t count);

// Internal linkage on purpose: the two files are compiled for different -march
// levels, and one shared (inline, external) copy could be the i8mm-level one.
namespace {

// acc += float(dot - sum8) * scale for 4 rows: portable `acc[r] += ...`.
inline float32x4_t NeonAddGroup(float32x4_t acc, int32x4_t dot, int32_t sum8, float32x4_t scale) {
  const float32x4_t centered = vcvtq_f32_s32(vsubq_s32(dot, vdupq_n_s32(sum8)));
  return vaddq_f32(acc, vmulq_f32(centered, scale));
}

// Scales of 16 rows (after a group's weight blocks) as 4 registers.
inline void NeonLoadScales(const uint8_t* p, float32x4_t scale[4]) {
  const float* s = reinterpret_cast<const float*>(p);
  for (int q = 0; q < 4; ++q) scale[q] = vld1q_f32(s + 4 * q);
}

// Writes token i's 16 outputs of tile nt: (acc - zp * row_corr) * xs + bias, the
// portable expression, one operation at a time.
inline void NeonStoreTile(const W4A8GemmArgs& a, int64_t nt, int64_t i, const float32x4_t acc[4]) {
  const PackedGemmShape& s = a.shape;
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  const int64_t row = a.rows[i];
  const float32x4_t zp = vdupq_n_f32(static_cast<float>(a.act.zero_point[row]));
  const float32x4_t xs = vdupq_n_f32(a.act.scale[row]);
  for (int q = 0; q < 4; ++q) {
    const int64_t n0 = nt * kTileRows + 4 * q;
    const float32x4_t corrected = vsubq_f32(acc[q], vmulq_f32(zp, vld1q_f32(row_corr + n0)));
    const float32x4_t y = vaddq_f32(vmulq_f32(corrected, xs), vld1q_f32(bias + n0));
    vst1q_f32(a.out + i * s.n + n0, y);
  }
}

}  // namespace
}  // namespace jax_moeq::cpu
