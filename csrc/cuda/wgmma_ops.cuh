// Hopper warpgroup MMA (wgmma, sm_90a) building blocks for the prefill GEMM: the shared-memory
// matrix descriptor of a 128-byte-swizzled K-major B tile, the m64n128k16 MMA with A from
// registers, and the fence / commit / wait of the asynchronous MMA groups. No XLA types.
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

#define JAX_MOEQ_WGMMA_ACC_LIST                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define JAX_MOEQ_WGMMA_ACC_OPERANDS(d)                                                           \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),             \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
      "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
      "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
      "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
      "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
      "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
      "+f"(d[63])

// d[64] += A (64 x 16, this warpgroup's registers: warp w holds rows 16w..16w+15 in the
// mma.m16n8k16 A-fragment layout) x B (16 x 128 from the descriptor). Accumulator layout: warp w,
// lane (g, t) holds d[4j + c] = row 16w + g + 8 (c >> 1), column 8j + 2t + (c & 1).
template <typename T>
__device__ __forceinline__ void WgmmaM64N128K16(float (&d)[64], const uint32_t (&a)[4],
                                                uint64_t desc_b) {
#if JAX_MOEQ_HAS_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " JAX_MOEQ_WGMMA_ACC_LIST
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : JAX_MOEQ_WGMMA_ACC_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " JAX_MOEQ_WGMMA_ACC_LIST
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : JAX_MOEQ_WGMMA_ACC_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
#else
  (void)d;
  (void)a;
  (void)desc_b;
  __trap();
#endif
}

#define JAX_MOEQ_WGMMA_ACC_OPERANDS_S32(d)                                                       \
  "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]),             \
      "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]),    \
      "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), \
      "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), \
      "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), \
      "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), \
      "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), \
      "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), \
      "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), \
      "+r"(d[63])

// s32 d[64] (+)= A (64 x 32 int8, this warpgroup's registers: warp w holds rows 16w..16w+15,
// lane (g, t) a[0] = row g, inputs 4t..4t+3 (byte i = input 4t + i), a[1] = row g + 8, same
// inputs, a[2] / a[3] = rows g / g + 8, inputs 16 + 4t..16 + 4t + 3) x B (32 x 128 int8, K-major
// from the descriptor: 32 bytes of each token row). accumulate false: d = A x B (a fresh sum).
// Accumulator layout as WgmmaM64N128K16's.
__device__ __forceinline__ void WgmmaS8M64N128K32(int32_t (&d)[64], const uint32_t (&a)[4],
                                                  uint64_t desc_b, bool accumulate) {
#if JAX_MOEQ_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " JAX_MOEQ_WGMMA_ACC_LIST
      ", {%64, %65, %66, %67}, %68, p;\n}\n"
      : JAX_MOEQ_WGMMA_ACC_OPERANDS_S32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate ? 1 : 0));
#else
  (void)d;
  (void)a;
  (void)desc_b;
  (void)accumulate;
  __trap();
#endif
}

// s32 d[32] (+)= A (64 x 32 int8, registers as WgmmaS8M64N128K32) x B (32 x 64 int8, K-major
// from the descriptor). Accumulator layout as WgmmaM64N128K16's, columns 0..63.
__device__ __forceinline__ void WgmmaS8M64N64K32(int32_t (&d)[32], const uint32_t (&a)[4],
                                                 uint64_t desc_b, bool accumulate) {
#if JAX_MOEQ_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
      ", {%32, %33, %34, %35}, %36, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]),
        "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]),
        "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]),
        "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]),
        "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate ? 1 : 0));
#else
  (void)d;
  (void)a;
  (void)desc_b;
  (void)accumulate;
  __trap();
#endif
}

// wgmma.m64n32k16 and m64n64k16 as WgmmaM64N128K16 (TY: "bf16" or "f16").
#define JAX_MOEQ_WGMMA_M64N32K16(TY)                                                               \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {"                                 \
      "%0, %1, %2, %3, %4, %5, %6, %7, "                                                           \
      "%8, %9, %10, %11, %12, %13, %14, %15"                                                       \
      "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"                                             \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15])                                                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

#define JAX_MOEQ_WGMMA_M64N64K16(TY)                                                               \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                                 \
      "%0, %1, %2, %3, %4, %5, %6, %7, "                                                           \
      "%8, %9, %10, %11, %12, %13, %14, %15, "                                                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, "                                                   \
      "%24, %25, %26, %27, %28, %29, %30, %31"                                                     \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                             \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                         \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

// As WgmmaM64N128K16 with an N-token B tile (N = 32 or 64): d[N / 2], columns 0..N-1.
template <typename T, int N>
__device__ __forceinline__ void WgmmaM64NxK16(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b) {
  static_assert(N == 32 || N == 64, "32- or 64-token tiles");
#if JAX_MOEQ_HAS_WGMMA
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 32 && kBf16) {
    JAX_MOEQ_WGMMA_M64N32K16("bf16");
  } else if constexpr (N == 32) {
    JAX_MOEQ_WGMMA_M64N32K16("f16");
  } else if constexpr (kBf16) {
    JAX_MOEQ_WGMMA_M64N64K16("bf16");
  } else {
    JAX_MOEQ_WGMMA_M64N64K16("f16");
  }
#else
  (void)d;
  (void)a;
  (void)desc_b;
  __trap();
#endif
}
#undef JAX_MOEQ_WGMMA_M64N32K16
#undef JAX_MOEQ_WGMMA_M64N64K16

template <int N>
__device__ __forceinline__ void FenceAccumulators(int32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

#undef JAX_MOEQ_WGMMA_ACC_LIST
#undef JAX_MOEQ_WGMMA_ACC_OPERANDS
#undef JAX_MOEQ_WGMMA_ACC_OPERANDS_S32

}  // namespace jax_moeq::cuda
