// Hopper warpgroup MMA (wgmma, sm_90a) building blocks for the prefill GEMM: the shared-memory
// matrix descriptor of a 128-byte-swizzled K-major B tile, the MMAs with A from registers (f32 +=
// bf16 / f16 and s32 += s8), and the fence / commit / wait of the asynchronous MMA groups. No XLA
// types.
//
// Only an sm_90a build has these instructions (JAX_MOEQ_HAS_WGMMA); other targets of a portable
// build compile the kernels that use them as traps and never launch them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_MOEQ_HAS_WGMMA 1
#else
#define JAX_MOEQ_HAS_WGMMA 0
#endif

namespace jax_moeq::cuda {

// Descriptor of a K-major tile in shared memory with the 128-byte swizzle: rows of 64 16-bit
// elements (128 bytes), 8-row atoms of 1024 bytes (the tile must start 1024-byte aligned), the
// 16-byte piece j of row r stored at piece j ^ (r % 8). Advancing along K by 16 elements inside
// the atom adds 32 bytes to the start address. Fields: start >> 4 (bits 0-13), leading byte
// offset (unused with this swizzle, 1), stride byte offset 1024 >> 4 between 8-row groups
// (bits 32-45), swizzle mode 1 = 128 B (bits 62-63).
__device__ __forceinline__ uint64_t SmemDescSwizzle128(uint32_t smem_address) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// Orders this warpgroup's register writes (A fragments, accumulators) before its next wgmma.
__device__ __forceinline__ void WgmmaFence() {
#if JAX_MOEQ_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void WgmmaCommit() {
#if JAX_MOEQ_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Waits until at most kPending committed groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
#if JAX_MOEQ_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}

// Keeps the compiler from moving or reading accumulator registers across the asynchronous MMAs
// (it sees each wgmma as finished when its asm statement ends).
template <int N>
__device__ __forceinline__ void FenceAccumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
__device__ __forceinline__ void FenceAccumulators(int32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// ------------------------------------------------------------------ wgmma.mma_async plumbing
// Operands of every MMA below: %0 .. %(NACC - 1) the accumulators d (in and out), then the four
// A registers, B's descriptor and the value whose non-zero-ness is scale-d (accumulate, else
// overwrite). Inline PTX takes only string literals, so the operand numbers per accumulator
// count are spelled out.
#define JAX_MOEQ_WGMMA_REGS_16                                                                   \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define JAX_MOEQ_WGMMA_REGS_32                                                                   \
  JAX_MOEQ_WGMMA_REGS_16 ", %16, %17, %18, %19, %20, %21, %22, %23, "                            \
                         "%24, %25, %26, %27, %28, %29, %30, %31"
#define JAX_MOEQ_WGMMA_REGS_64                                                                   \
  JAX_MOEQ_WGMMA_REGS_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "   \
                         "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "     \
                         "%58, %59, %60, %61, %62, %63"
// The A registers and B's descriptor, then the scale-d source, after NACC accumulators.
#define JAX_MOEQ_WGMMA_A_B_16 "{%16, %17, %18, %19}, %20"
#define JAX_MOEQ_WGMMA_A_B_32 "{%32, %33, %34, %35}, %36"
#define JAX_MOEQ_WGMMA_A_B_64 "{%64, %65, %66, %67}, %68"
#define JAX_MOEQ_WGMMA_SCALE_D_16 "%21"
#define JAX_MOEQ_WGMMA_SCALE_D_32 "%37"
#define JAX_MOEQ_WGMMA_SCALE_D_64 "%69"

// Accumulator operands d[i ..], constraint C ("+f" f32, "+r" s32).
#define JAX_MOEQ_WGMMA_ACC_8(C, d, i)                                                            \
  C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]),          \
      C(d[i + 7])
#define JAX_MOEQ_WGMMA_ACC_16(C, d, i) \
  JAX_MOEQ_WGMMA_ACC_8(C, d, i), JAX_MOEQ_WGMMA_ACC_8(C, d, i + 8)
#define JAX_MOEQ_WGMMA_ACC_32(C, d, i) \
  JAX_MOEQ_WGMMA_ACC_16(C, d, i), JAX_MOEQ_WGMMA_ACC_16(C, d, i + 16)
#define JAX_MOEQ_WGMMA_ACC_64(C, d, i) \
  JAX_MOEQ_WGMMA_ACC_32(C, d, i), JAX_MOEQ_WGMMA_ACC_32(C, d, i + 32)

// The wrapper's d (NACC accumulators, constraint C) (+)= A (its registers a) x B (its descriptor
// desc_b), scale-d from scale_d. SHAPE_TYPES: the instruction's shape and types, e.g.
// "m64n64k32.s32.s8.s8". TAIL: the operands after scale-d, ", 1, 1, 0" (A and B scales 1, B
// K-major) for 16-bit inputs and "" for s8 (which has neither).
#if JAX_MOEQ_HAS_WGMMA
#define JAX_MOEQ_WGMMA_MMA_ASYNC(NACC, SHAPE_TYPES, TAIL, C, scale_d)                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " JAX_MOEQ_WGMMA_SCALE_D_##NACC ", 0;\n"        \
               "wgmma.mma_async.sync.aligned." SHAPE_TYPES " {" JAX_MOEQ_WGMMA_REGS_##NACC "}, " \
               JAX_MOEQ_WGMMA_A_B_##NACC ", p" TAIL ";\n}\n"                                     \
               : JAX_MOEQ_WGMMA_ACC_##NACC(C, d, 0)                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
#else
#define JAX_MOEQ_WGMMA_MMA_ASYNC(NACC, SHAPE_TYPES, TAIL, C, scale_d) \
  WgmmaUnavailable(d, a, desc_b, scale_d)
#endif

// f32 d (+)= T x T with T bf16 or f16 (A and B scales 1, B K-major, always accumulating).
#define JAX_MOEQ_WGMMA_F32_MMA_ASYNC(T, NACC, SHAPE)                                             \
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {                                              \
    JAX_MOEQ_WGMMA_MMA_ASYNC(NACC, SHAPE ".f32.bf16.bf16", ", 1, 1, 0", "+f", 1);                \
  } else {                                                                                       \
    JAX_MOEQ_WGMMA_MMA_ASYNC(NACC, SHAPE ".f32.f16.f16", ", 1, 1, 0", "+f", 1);                  \
  }

// s32 d (+)= s8 x s8: accumulate false overwrites d (a fresh sum).
#define JAX_MOEQ_WGMMA_S32_MMA_ASYNC(NACC, SHAPE) \
  JAX_MOEQ_WGMMA_MMA_ASYNC(NACC, SHAPE ".s32.s8.s8", "", "+r", accumulate ? 1 : 0)

// What a build without wgmma runs in its place: the kernels using it are never launched there.
template <typename... Operands>
__device__ __forceinline__ void WgmmaUnavailable(const Operands&...) {
  __trap();
}

// d[64] += A (64 x 16, this warpgroup's registers: warp w holds rows 16w..16w+15 in the
// mma.m16n8k16 A-fragment layout) x B (16 x 128 from the descriptor). Accumulator layout: warp w,
// lane (g, t) holds d[4j + c] = row 16w + g + 8 (c >> 1), column 8j + 2t + (c & 1).
template <typename T>
__device__ __forceinline__ void WgmmaM64N128K16(float (&d)[64], const uint32_t (&a)[4],
                                                uint64_t desc_b) {
  JAX_MOEQ_WGMMA_F32_MMA_ASYNC(T, 64, "m64n128k16")
}

// As WgmmaM64N128K16 with an N-token B tile (N = 32 or 64): d[N / 2], columns 0..N-1.
template <typename T, int N>
__device__ __forceinline__ void WgmmaM64NxK16(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b) {
  static_assert(N == 32 || N == 64, "32- or 64-token tiles");
  if constexpr (N == 32) {
    JAX_MOEQ_WGMMA_F32_MMA_ASYNC(T, 16, "m64n32k16")
  } else {
    JAX_MOEQ_WGMMA_F32_MMA_ASYNC(T, 32, "m64n64k16")
  }
}

// s32 d[N / 2] (+)= A (64 x 32 int8, this warpgroup's registers: warp w holds rows 16w..16w+15,
// lane (g, t) a[0] = row g, inputs 4t..4t+3 (byte i = input 4t + i), a[1] = row g + 8, same
// inputs, a[2] / a[3] = rows g / g + 8, inputs 16 + 4t..16 + 4t + 3) x B (32 x N int8, N = 32 or
// 64 tokens, K-major from the descriptor: 32 bytes of each token row). accumulate false: d = A x B
// (a fresh sum). Accumulator layout as WgmmaM64N128K16's, columns 0..N-1.
template <int N>
__device__ __forceinline__ void WgmmaS8M64NxK32(int32_t (&d)[N / 2], const uint32_t (&a)[4],
                                                uint64_t desc_b, bool accumulate) {
  static_assert(N == 32 || N == 64, "32- or 64-token tiles");
  if constexpr (N == 32) {
    JAX_MOEQ_WGMMA_S32_MMA_ASYNC(16, "m64n32k32");
  } else {
    JAX_MOEQ_WGMMA_S32_MMA_ASYNC(32, "m64n64k32");
  }
}

#undef JAX_MOEQ_WGMMA_S32_MMA_ASYNC
#undef JAX_MOEQ_WGMMA_F32_MMA_ASYNC
#undef JAX_MOEQ_WGMMA_MMA_ASYNC
#undef JAX_MOEQ_WGMMA_ACC_64
#undef JAX_MOEQ_WGMMA_ACC_32
#undef JAX_MOEQ_WGMMA_ACC_16
#undef JAX_MOEQ_WGMMA_ACC_8
#undef JAX_MOEQ_WGMMA_SCALE_D_64
#undef JAX_MOEQ_WGMMA_SCALE_D_32
#undef JAX_MOEQ_WGMMA_SCALE_D_16
#undef JAX_MOEQ_WGMMA_A_B_64
#undef JAX_MOEQ_WGMMA_A_B_32
#undef JAX_MOEQ_WGMMA_A_B_16
#undef JAX_MOEQ_WGMMA_REGS_64
#undef JAX_MOEQ_WGMMA_REGS_32
#undef JAX_MOEQ_WGMMA_REGS_16

}  // namespace jax_moeq::cuda
