// int4-weight x int8-activation GEMM over the packed layout of w4a8_layout.h.
// One implementation per ISA (w4a8_gemm_<isa>.cc), all with this signature.
#pragma once

#include <cstdint>

#if defined(JAX_MOEQ_X86)
#include <immintrin.h>
#endif

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

// Software prefetch of the weight stream, in bytes ahead of the 64-byte block being read (0:
// none). Intel: into L1 a little ahead and into L2 further ahead. One core's L1 tracks ~16 lines
// in flight (1 KB): at a loaded DRAM latency of ~200 ns that caps a thread near 5 GB/s, where a
// decode needs each of 16 threads at ~8; the L2 queue holds ~48 lines, so the L2 prefetch sets
// the rate. On the 16-core Xeon (2026-11-28, T = 1 and 8, three shapes) no other pair or single
// prefetch was faster by more than the run's spread. AMD: one prefetch a line, into L1 6 KB
// ahead. On a 2-core Zen 4 EPYC (2026-11-28, Qwen3-30B-A3B, the settings in turn with the DRAM probe
// in one process) it streamed 44.6 / 46.4 GB/s at T = 1 / 8 where the Intel pair streamed 42.7 /
// 45.2 (the VM's slow memory phase), and 56.7 / 64.6 against 48.4 / 54.9 in its fast one. A
// second prefetch of a line already requested takes a miss buffer of its own.
// docs/performance.md has the sweeps.
struct StreamPrefetch {
  int64_t l1_bytes;
  int64_t l2_bytes;
};
inline constexpr StreamPrefetch kIntelStreamPrefetch{1024, 4096};
inline constexpr StreamPrefetch kAmdStreamPrefetch{6144, 0};
// The VNNI loop takes the plan of DetectedCpuVendor() (other makers: Intel's; AMD's CPUs with
// AVX-512 are Zen 4 and later); the AMX loop runs on Intel only.
//
// The AVX2 loop issues ~20 instructions per block against VNNI's ~8, so fewer blocks fit its
// out-of-order window. It prefetches as the VNNI loop does on AMD from Zen 3 on (family 0x19+;
// 2-core Zen 4 EPYC, 2026-11-28, the settings in turn with the probe in one process: 6 KB ahead
// into L1 streamed 47.7 / 49.0 GB/s at T = 1 / 8 in the fast memory phase where 4 KB streamed
// 45.4 / 47.3, level in the slow phase). On Zen 2 and older (family 0x17, Hygon 0x18) it takes
// Intel's pair: on an AVX2-only Zen 2 EPYC (2026-11-28, Qwen3-30B-A3B, five settings in turn in
// one process, 173 blocks at each of T = 1 and 8) the pair streamed 1.036 / 1.034x the 6 KB
// plan (median of the blocks' ratios); 2 KB / 8 KB, 1 KB / 12 KB and 4 KB / 16 KB 1.01-1.03x.
// Elsewhere (no Intel AVX2-only CPU was measured) one prefetch 4 KB into L1.
inline constexpr StreamPrefetch kAvx2StreamPrefetch{4096, 0};

#if defined(JAX_MOEQ_X86)
// The prefetches of the plan for the 64-byte block at p (a template argument: no test per block).
template <const StreamPrefetch& kPrefetch>
inline void PrefetchWeightBlock(const uint8_t* p) {
  if constexpr (kPrefetch.l1_bytes != 0) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch.l1_bytes, _MM_HINT_T0);
  }
  if constexpr (kPrefetch.l2_bytes != 0) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch.l2_bytes, _MM_HINT_T1);
  }
}
#endif

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
