// Row-wise stages of the W4A8 MoE around the GEMMs: dtype rounding, gated
// activation, int8 activation quantization (SPEC §3), weighted accumulation.
// A portable version and SIMD ones (w4a8_rows_simd.h, for AVX2 and AVX-512);
// they give the same int8 values (same float32 operations in the same order,
// no contraction; the SIMD widths share one exp polynomial, so AVX2 and
// AVX-512 agree bit for bit), and row lengths are always multiples of 16.
#pragma once

#include <cstdint>

#include "cpu/cpu_isa.h"
#include "cpu/types.h"

namespace jax_moeq::cpu {

struct RowOps {
  // Loads row `row` of a [rows][n] array of `type` as float32.
  void (*load)(ElementType type, const void* base, int64_t row, int64_t n, float* dst);
  // Stores float32 values (already representable) as `type`.
  void (*store)(ElementType type, const float* src, int64_t n, void* base, int64_t row);
  // v[i] = round_to_type(v[i] * scale) (scale 1 just rounds).
  void (*scale_round)(ElementType type, float scale, float* v, int64_t n);
  // out = round(act(round(gate), round(up))): gate/up rounded in place first.
  void (*activate)(ElementType type, ActivationKind kind, float* gate, float* up, int64_t n,
                   float* out);
  // Asymmetric int8 quantization of x [k], groups of `group`: values q, the
  // row's scale and zero point, and 8 * sum(q) per group. A row holding a NaN
  // or an infinity gives q = 0, zero point 0 and scale NaN (its GEMM outputs
  // are all NaN).
  void (*quantize)(const float* x, int64_t k, int64_t group, int8_t* q, float* scale,
                   int32_t* zero_point, int32_t* sum8);
  // acc = round(acc + round(round(y) * w)), or round(acc + round(y)) when
  // `weighted` is false.
  void (*accumulate)(ElementType type, const float* y, float w, bool weighted, float* acc,
                     int64_t n);
};

const RowOps& PortableRowOps();
#if defined(JAX_MOEQ_X86)
const RowOps& Avx2RowOps();
const RowOps& Avx512RowOps();
#endif

// The NEON GEMM paths use the portable row ops.
inline const RowOps& RowOpsFor(Isa isa) {
#if defined(JAX_MOEQ_X86)
  if (isa == Isa::kAvx512Vnni || isa == Isa::kAmxInt8) return Avx512RowOps();
  if (isa == Isa::kAvx2) return Avx2RowOps();
#endif
  (void)isa;
  return PortableRowOps();
}

}  // namespace jax_moeq::cpu
