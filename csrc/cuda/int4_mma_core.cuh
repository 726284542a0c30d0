// Warp-level int4 x (bf16|fp16) tensor-core building blocks shared by the
// GPU MoE kernels (WNA16 and MxInt4). No XLA types; header-only device code.
//
// Operand roles ("swap AB"): the weights are the A operand of
// mma.sync.m16n8k16 (16 output channels per tile) and the tokens are the B
// operand (8 tokens per tile), so a decode step with one token wastes
// tensor-core work but no memory traffic.
//
// Packed weight layout (one GEMM of N outputs, K inputs, per expert):
//   uint4 w[N/16][K/64][32 lanes]   (16 bytes per lane per 64-deep chunk)
// Lane l = 4*g + t holds, for 16-row subtile rows {g, g+8} and the physical
// inputs k0 + 16*t + [0, 16), four 32-bit words, one per mma k-step s:
//   word s, nibble i (i < 4): row g + 8*(i & 1), k = k0 + 16t + 4s + 2*(i >> 1)
//   word s, nibble i + 4     : the same row, k + 1
// i.e. nibbles i and i+4 are the low and high halves of A register i of
// step s. Nibbles hold q + 8 (uint4b8) unless the code is kSignedInt4.
// The B operand uses the matching order: lane (g, t) reads tokens' inputs
// k0 + 16t + [0, 16) as two 16-byte loads; word 2s and 2s+1 feed step s.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/dependent_launch.cuh"

// sm_90 instructions (bulk copies, mbarrier transaction counts, proxy fences) exist only on
// sm_90+: a portable build's older targets (JAX_MOEQ_CUDA_EXTRA_ARCHS) compile the helpers below
// as traps. Kernels that use them are never launched there: the ops need compute capability 9.0
// (wna16_gpu_available, is_mxint4_moe_available).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define JAX_MOEQ_BEFORE_SM90 1
#else
#define JAX_MOEQ_BEFORE_SM90 0
#endif

namespace jax_moeq::cuda {

enum class NibbleCode { kUint4b8, kSignedInt4 };

template <typename T>
struct HalfType;

template <>
struct HalfType<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  // 128.0 in each half: OR-ing a nibble n into the mantissa gives 128 + n.
  static constexpr uint32_t kMagic = 0x43004300u;
  static constexpr float kMagicValue = 128.0f;
  static constexpr uint32_t kMagicPlus8 = 0x43084308u;  // 136.0: zero point of uint4b8
  static constexpr uint32_t kOnes = 0x3f803f80u;        // 1.0 in each half
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) {
    return __float2bfloat16_rn(v);
  }
};

template <>
struct HalfType<__half> {
  using T2 = __half2;
  // 1024.0 in each half: 1024 + n for a nibble n.
  static constexpr uint32_t kMagic = 0x64006400u;
  static constexpr float kMagicValue = 1024.0f;
  static constexpr uint32_t kMagicPlus8 = 0x64086408u;  // 1032.0
  static constexpr uint32_t kOnes = 0x3c003c00u;        // 1.0 in each half
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
};

template <typename T>
__device__ __forceinline__ float RoundTo(float v) {
  return HalfType<T>::to_float(HalfType<T>::from_float(v));
}

template <typename T2>
__device__ __forceinline__ T2 AsHalf2(uint32_t bits) {
  return *reinterpret_cast<T2*>(&bits);
}

template <typename T2>
__device__ __forceinline__ uint32_t AsBits(T2 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// Both halves set to the low (hi=false) or high half of a packed pair.
__device__ __forceinline__ uint32_t BroadcastHalf(uint32_t pair, bool hi) {
  return __byte_perm(pair, 0, hi ? 0x3232 : 0x1010);
}

// 16-byte streaming load of packed weights: read once, keep out of L1.
__device__ __forceinline__ uint4 LoadStreaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// cp.async (sm_80+): 16-byte copies global -> shared that complete asynchronously, in
// per-thread groups. "memory" clobbers keep ordinary shared loads on the right side of them.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Streaming data: bypass L1 (.cg). The forms on a 32-bit shared-window address serve loops that
// keep their shared-memory offsets as integers.
__device__ __forceinline__ void CpAsyncSharedStream(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsyncStream16(void* smem, const void* gmem) {
  CpAsyncSharedStream(SharedAddress(smem), gmem);
}
// ... zero-filled without a read when src_bytes is 0 (padding rows).
__device__ __forceinline__ void CpAsyncSharedOrZero(uint32_t dst, const void* src,
                                                    uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// Activations, shared by the CTA's warps through L1 (.ca); zero-filled when !valid (no read).
__device__ __forceinline__ void CpAsyncShared16OrZero(uint32_t dst, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsyncShared4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

// Shared-memory loads on a 32-bit shared-window address.
__device__ __forceinline__ uint4 LdShared128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a)
               : "memory");
  return v;
}
__device__ __forceinline__ uint32_t LdShared32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
  return v;
}

__device__ __forceinline__ void StShared16(uint32_t a, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(a), "h"(v) : "memory");
}
__device__ __forceinline__ void StShared32(uint32_t a, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Bulk copies (sm_90): one thread moves a contiguous run of global memory into shared memory
// through the copy engine and an mbarrier counts the bytes in, so a warp keeps many KB in flight
// for a handful of instructions.
// `count` arrivals complete a phase (1: the one expect-bytes arrival of the bulk-copy rings).
__device__ __forceinline__ void MbarrierInit(uint64_t* bar, uint32_t count = 1) {
#if JAX_MOEQ_BEFORE_SM90
  __trap();
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)), "r"(count)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// The one arrival of a phase, announcing the bytes its copies will bring.
__device__ __forceinline__ void MbarrierExpectBytes(uint64_t* bar, uint32_t bytes) {
#if JAX_MOEQ_BEFORE_SM90
  __trap();
#else
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// bytes: a multiple of 16; both addresses 16-byte aligned.
__device__ __forceinline__ void BulkCopyToShared(void* smem, const void* gmem, uint32_t bytes,
                                                 uint64_t* bar) {
#if JAX_MOEQ_BEFORE_SM90
  __trap();
#else
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          SharedAddress(smem)),
      "l"(gmem), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
#endif
}

__device__ __forceinline__ void MbarrierWait(uint64_t* bar, uint32_t parity) {
#if JAX_MOEQ_BEFORE_SM90
  __trap();
#else
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_AGAIN:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_AGAIN;\n"
      "}\n" ::"r"(SharedAddress(bar)),
      "r"(parity)
      : "memory");
#endif
}

// An arrival on `bar` once all of this thread's earlier cp.async copies have landed (counted
// against the barrier's expected arrivals).
__device__ __forceinline__ void CpAsyncArriveNoinc(uint64_t* bar) {
#if JAX_MOEQ_BEFORE_SM90
  __trap();
#else
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(SharedAddress(bar))
               : "memory");
#endif
}

// A plain arrival (no byte count) on `bar`.
__device__ __forceinline__ void MbarrierArrive(uint64_t* bar) {
#if JAX_MOEQ_BEFORE_SM90
  __trap();
#else
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SharedAddress(bar)) : "memory");
#endif
}

// Orders this thread's earlier shared-memory accesses before its later copy-engine writes.
__device__ __forceinline__ void FenceProxyAsync() {
#if JAX_MOEQ_BEFORE_SM90
  __trap();
#else
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// The nibble pair of v (bits 0-3 and 16-19) as two halves magic + u, u = the nibble (uint4b8) or
// nibble ^ 8 = q + 8 (two's-complement nibbles), in one LOP3: (v & 0x000f000f) | kMagic, or
// (v & 0x000f000f) ^ (kMagic | 0x00080008) (kMagic has no bits under the nibbles, so | and ^
// agree there). Written in C the compiler spends an AND and an OR (and an XOR), as a LOP3 takes
// only one immediate.
template <uint32_t kMagic, NibbleCode kCode>
__device__ __forceinline__ uint32_t BiasedNibblePair(uint32_t v) {
  static_assert((kMagic & 0x000f000fu) == 0, "the magic number must leave the nibble bits clear");
  uint32_t r;
  if constexpr (kCode == NibbleCode::kSignedInt4) {
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;"  // (a & b) ^ c
        : "=r"(r) : "r"(v), "r"(0x000f000fu), "n"(kMagic | 0x00080008u));
  } else {
    asm("lop3.b32 %0, %1, %2, %3, 0xea;"  // (a & b) | c
        : "=r"(r) : "r"(v), "r"(0x000f000fu), "n"(kMagic));
  }
  return r;
}

// Dequantizes one word (the A fragment of one k-step) into four registers:
// (nibble + magic - zero_magic) * scale, exact before the one rounding of the
// product, so each value equals round_to_T(q * s) as in the reference.
// scale_lo/zm_lo: row g (registers 0, 2); scale_hi/zm_hi: row g+8 (1, 3).
// zm_* = magic + zero point (both halves), e.g. magic + 8 for uint4b8.
template <typename T, NibbleCode kCode>
__device__ __forceinline__ void DequantWord(uint32_t word, uint32_t scale_lo, uint32_t scale_hi,
                                            uint32_t zm_lo, uint32_t zm_hi, uint32_t (&a)[4]) {
  using T2 = typename HalfType<T>::T2;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t biased = BiasedNibblePair<HalfType<T>::kMagic, kCode>(word >> (4 * i));
    const bool hi = (i & 1) != 0;
    T2 v = __hsub2(AsHalf2<T2>(biased), AsHalf2<T2>(hi ? zm_hi : zm_lo));
    v = __hmul2(v, AsHalf2<T2>(hi ? scale_hi : scale_lo));
    a[i] = AsBits(v);
  }
}

template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Word j (0..7) of a lane's 16 activations (two 16-byte loads).
__device__ __forceinline__ uint32_t ActWord(const uint4 (&x)[2], int j) {
  const uint4& h = x[j >> 2];
  switch (j & 3) {
    case 0: return h.x;
    case 1: return h.y;
    case 2: return h.z;
    default: return h.w;
  }
}

// One 64-deep chunk for NSUB weight subtiles x MT token tiles:
// acc[j][m] += dequant(w[j]) * x[m].
template <typename T, NibbleCode kCode, int NSUB, int MT>
__device__ __forceinline__ void MmaChunk(const uint4 (&w)[NSUB], const uint4 (&x)[MT][2],
                                         const uint32_t (&scale)[NSUB],
                                         const uint32_t (&zero_magic)[NSUB],
                                         float (&acc)[NSUB][MT][4]) {
#pragma unroll
  for (int j = 0; j < NSUB; ++j) {
    const uint32_t s_lo = BroadcastHalf(scale[j], false), s_hi = BroadcastHalf(scale[j], true);
    const uint32_t z_lo = BroadcastHalf(zero_magic[j], false);
    const uint32_t z_hi = BroadcastHalf(zero_magic[j], true);
    const uint32_t words[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t a[4];
      DequantWord<T, kCode>(words[s], s_lo, s_hi, z_lo, z_hi, a);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        Mma16816<T>(acc[j][m], a, ActWord(x[m], 2 * s), ActWord(x[m], 2 * s + 1));
      }
    }
  }
}

// The folded form of MmaChunk, for groups that cover whole chunks: the A operand is
// magic + nibble exactly (one shift and one lop3 per register, no subtract or multiply), and
// xsum gathers each token's sum of inputs through an all-ones A operand. FoldGroup then applies
// the group's zero point and scale in f32 once per group instead of once per weight pair:
//   acc += s * (sum_k (magic + n_k) x_k - (magic + zero) * sum_k x_k) = s * sum_k (n_k - zero) x_k.
// The weight is q * s exactly (not rounded to T first as in MmaChunk): within 2^-9 relative
// of the reference's rounding point, far inside the bf16 tolerance.
template <typename T, NibbleCode kCode, int NSUB, int MT>
__device__ __forceinline__ void MmaChunkFolded(const uint4 (&w)[NSUB], const uint4 (&x)[MT][2],
                                               float (&gacc)[NSUB][MT][4],
                                               float (&xsum)[MT][4]) {
  const uint32_t ones[4] = {HalfType<T>::kOnes, HalfType<T>::kOnes, HalfType<T>::kOnes,
                            HalfType<T>::kOnes};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      Mma16816<T>(xsum[m], ones, ActWord(x[m], 2 * s), ActWord(x[m], 2 * s + 1));
    }
  }
#pragma unroll
  for (int j = 0; j < NSUB; ++j) {
    uint32_t words[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t a[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = BiasedNibblePair<HalfType<T>::kMagic, kCode>(words[s] >> (4 * i));
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        Mma16816<T>(gacc[j][m], a, ActWord(x[m], 2 * s), ActWord(x[m], 2 * s + 1));
      }
    }
  }
}

// The two halves of a packed pair as floats (low, high). bf16 is the top half of an f32, so its
// halves are a shift and a mask (one instruction each, where the conversions take three).
template <typename T>
__device__ __forceinline__ void HalvesToFloat(uint32_t pair, float (&f)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    f[0] = __uint_as_float(pair << 16);
    f[1] = __uint_as_float(pair & 0xffff0000u);
  } else {
    using T2 = typename HalfType<T>::T2;
    const T2 v = AsHalf2<T2>(pair);
    f[0] = __low2float(v);
    f[1] = __high2float(v);
  }
}

// Ends a group of MmaChunkFolded: acc += s * (gacc - zero_magic * xsum) per row half
// (c = 0, 1: row g, the low halves of scale and zero_magic; c = 2, 3: row g + 8), then
// clears gacc and xsum for the next group.
template <typename T, int NSUB, int MT>
__device__ __forceinline__ void FoldGroup(const uint32_t (&scale)[NSUB],
                                          const uint32_t (&zero_magic)[NSUB],
                                          float (&gacc)[NSUB][MT][4], float (&xsum)[MT][4],
                                          float (&acc)[NSUB][MT][4]) {
#pragma unroll
  for (int j = 0; j < NSUB; ++j) {
    float s[2], z[2];
    HalvesToFloat<T>(scale[j], s);
    HalvesToFloat<T>(zero_magic[j], z);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = c >> 1;
        acc[j][m][c] = fmaf(s[r], fmaf(-z[r], xsum[m][c], gacc[j][m][c]), acc[j][m][c]);
        gacc[j][m][c] = 0.0f;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) xsum[m][c] = 0.0f;
}

// n / d for 0 <= n < 2^31 with one multiply-high, an add and a shift (d >= 1; the host makes
// mul and shift with MakeFastDiv).
struct FastDiv {
  uint32_t mul = 1, shift = 0;
  __device__ __forceinline__ int operator()(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
    return static_cast<int>((__umulhi(u, mul) + u) >> shift);
  }
};

inline FastDiv MakeFastDiv(uint32_t d) {
  FastDiv f;
  while ((1u << f.shift) < d) ++f.shift;
  f.mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
  return f;
}

}  // namespace jax_moeq::cuda
