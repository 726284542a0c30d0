// L2 prefetch of weights at decode: the flags the ops pass (`l2_prefetch` attribute) and the
// device helpers that request a byte range into L2 with the copy engine's bulk prefetch (sm_90).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_moeq::cuda {

// L2 prefetch at decode (the ops' `l2_prefetch` attribute, a set of these bits). A decode call is
// a chain of short kernels, each starting its own DRAM latency chain for a few MB of weights;
// requesting bytes into L2 early lets one kernel's streaming overlap another's latency.
enum L2PrefetchFlag : int {
  kPrefetchNextGemm = 1,     // GEMM1's CTAs request GEMM2's weights of their expert
  kPrefetchOwnRange = 2,     // each GEMM warp requests its whole weight range of the split at once
  kPrefetchFromRouting = 4,  // (MxInt4) the routing warp requests its experts' GEMM1 weights
};
constexpr int kL2PrefetchFlags = 7;

// One array of per-expert regions: expert e's bytes are [base + e * bytes, + bytes); bytes is a
// multiple of 16 (the packed weights, scales and zero points all are).
struct ExpertRegion {
  const void* base = nullptr;
  int64_t bytes = 0;
};

// Requests [p, p + bytes) into L2 (bytes a multiple of 16, p 16-byte aligned) without waiting:
// the copy engine's bulk prefetch, one instruction per 64 KB.
__device__ __forceinline__ void PrefetchL2(const void* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int64_t kPiece = 64 * 1024;
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += kPiece) {
    const uint32_t n = static_cast<uint32_t>(min(kPiece, bytes - off));
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c + off), "r"(n) : "memory");
  }
#endif
}

// Share `share` of `shares` of expert e's region into L2 (16-byte pieces; later shares may be
// empty).
__device__ __forceinline__ void PrefetchExpertShare(const ExpertRegion& r, int expert, int share,
                                                    int shares) {
  if (!r.base) return;
  const int64_t piece = (r.bytes / 16 + shares - 1) / shares * 16;
  const int64_t begin = share * piece;
  if (begin >= r.bytes) return;
  PrefetchL2(static_cast<const char*>(r.base) + expert * r.bytes + begin,
             min(piece, r.bytes - begin));
}

}  // namespace jax_moeq::cuda
