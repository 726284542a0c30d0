// Zeroing of f32 workspaces by the extra CTAs of a launch that has other work (the alignment,
// MxInt4's routing), so that the kernel accumulating into them needs no memset before it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_moeq::cuda {

constexpr int kZeroBlocks = 64;  // the most CTAs a launch adds for zeroing

// Zeroes up to two f32 workspaces with the blocks after the first `skip`.
__device__ __forceinline__ void ZeroWorkspaces(float* ws_a, int64_t count_a, float* ws_b,
                                               int64_t count_b, int skip) {
  const int64_t stride = static_cast<int64_t>(gridDim.x - skip) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x - skip) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < count_a; i += stride) ws_a[i] = 0.0f;
  for (int64_t i = first; i < count_b; i += stride) ws_b[i] = 0.0f;
}

}  // namespace jax_moeq::cuda
