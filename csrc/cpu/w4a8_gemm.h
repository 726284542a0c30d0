// int4-weight x int8-activation GEMM over the packed layout of w4a8_layout.h.
// One implementation per ISA (w4a8_gemm_<isa>.cc), all with this signature.
#pragma once

#include <cstdint>

#include "cpu/cpu_isa.h"
#include "cpu/w4a8_layout.h"

namespace jax_moeq::cpu {

// Rows of quantized activations, selected through an index list so that one
// quantized token can feed every expert it is routed to without copies.
struct QuantizedActivations {
  const int8_t* values;   // [rows][k]
  const float* scale;     // [rows]
  const int32_t* zero_point;  // [rows]
  const int32_t* sum8;    // [rows][groups]: 8 * sum of the group's values
};

// Software prefetch of the weight stream, per 64-byte block: to L1 a little ahead, and to L2
// further ahead. One core's L1 tracks ~16 lines in flight (1 KB): at a loaded DRAM latency of
// ~200 ns that caps a thread near 5 GB/s, where a decode needs each of 16 threads at ~8. The
// L2 queue holds ~48 lines, so the L2 prefetch sets the rate.
inline constexpr int64_t kPrefetchL1Bytes = 1024;
inline constexpr int64_t kPrefetchL2Bytes = 4096;
// The AVX2 loop issues ~20 instructions per block against VNNI's ~8, so fewer blocks fit its
// out-of-order window. It prefetches each line once, into L1, as far ahead as the L2 prefetch of
// the other paths: one prefetch instruction per block fewer, and the lines in L1 when the loop
// reaches them. AMD EPYC, 2 threads, AVX2 / VNNI time in one process, 3 processes per build
// (2026-11-28): OLMoE T=1 1.10-1.14 -> 1.05-1.08, T=8 1.16-1.20 -> 1.14-1.17; Qwen3-30B-A3B
// T=1 1.16-1.18 -> 1.12-1.13, T=8 1.17-1.19 -> 1.11-1.12; T = 32 and 128 level. (Before that,
// 2 KB into L1 plus 4 KB into L2; 1 KB into L1 was slower still.)
inline constexpr int64_t kPrefetchL1BytesAvx2 = 4096;

struct W4A8GemmArgs {
  const uint8_t* weights;     // one expert, packed
  PackedGemmShape shape;
  QuantizedActivations act;
  const int32_t* rows;        // [m]: rows of `act` to multiply
  int64_t m;
  float* out;                 // [m][shape.n], row i for rows[i]
  int64_t tile_begin;         // output tiles [tile_begin, tile_end) of 16 rows
  int64_t tile_end;
};

void W4A8GemmPortable(const W4A8GemmArgs& args);
#if defined(JAX_MOEQ_X86)
void W4A8GemmAvx2(const W4A8GemmArgs& args);
void W4A8GemmAvx512Vnni(const W4A8GemmArgs& args);
void W4A8GemmAmx(const W4A8GemmArgs& args);
// GEMMs of fewer rows run on the VNNI code: a 16-row tile would be mostly padding.
inline constexpr int64_t kAmxMinRows = 16;
#endif
#if defined(JAX_MOEQ_AARCH64)
void W4A8GemmNeonDotprod(const W4A8GemmArgs& args);
void W4A8GemmNeonI8mm(const W4A8GemmArgs& args);
#endif

inline void W4A8Gemm(Isa isa, const W4A8GemmArgs& args) {
  switch (isa) {
#if defined(JAX_MOEQ_X86)
    case Isa::kAmxInt8: return W4A8GemmAmx(args);
    case Isa::kAvx512Vnni: return W4A8GemmAvx512Vnni(args);
    case Isa::kAvx2: return W4A8GemmAvx2(args);
#endif
#if defined(JAX_MOEQ_AARCH64)
    case Isa::kNeonI8mm: return W4A8GemmNeonI8mm(args);
    case Isa::kNeonDotprod: return W4A8GemmNeonDotprod(args);
#endif
    default: return W4A8GemmPortable(args);
  }
}

}  // namespace jax_moeq::cpu
