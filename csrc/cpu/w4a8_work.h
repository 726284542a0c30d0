// Scratch growth and work splitting shared by the CPU W4A8 ops (w4a8_moe.cc, w4a8_linear.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu/types.h"

namespace jax_moeq::cpu {

// At least n elements (contents not kept); a new allocation is exactly n, not the doubling of
// resize, so the scratch stays within the chunk's budget. Adds the capacity to *bytes.
template <typename T>
T* Grow(std::vector<T>& v, int64_t n, int64_t* bytes) {
  if (static_cast<int64_t>(v.size()) < n) std::vector<T>(static_cast<size_t>(n)).swap(v);
  *bytes += static_cast<int64_t>(v.capacity() * sizeof(T));
  return v.data();
}

inline size_t ElementBytes(ElementType t) { return t == ElementType::kF32 ? 4 : 2; }

// Row stages (quantize, activate, combine, store) this small run on the calling thread.
inline constexpr int64_t kInlineStageElements = 16384;

// 16-row tiles per GEMM work item when `gemms` GEMMs of `tiles` tiles each share the pool:
// ranges shrink when there are few GEMMs so that every thread gets work in decode, about 256
// items in all, so that 16 threads each take ~16 and finish within a small item of each other
// (64 items left threads idle for a quarter of GEMM1 at T=1 on 16 cores, Xeon, 2026-11-25).
inline int64_t TilesPerGemmItem(int64_t tiles, int64_t gemms) {
  const int64_t per_gemm = std::max<int64_t>(1, 256 / std::max<int64_t>(1, gemms));
  return std::max<int64_t>(2, (tiles + per_gemm - 1) / per_gemm);
}

}  // namespace jax_moeq::cpu
