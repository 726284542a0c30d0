// Scratch growth and work splitting shared by the CPU W4A8 ops (w4a8_moe.cc, w4a8_linear.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cpu/types.h"
#include "cpu/w4a8_moe.h"

namespace jax_moeq::cpu {

// At least n elements (contents not kept); a new allocation is exactly n, not the doubling of
// resize, so the scratch stays within the chunk's budget. Adds the capacity to *bytes.
template <typename T>
T* Grow(std::vector<T>& v, int64_t n, int64_t* bytes) {
  if (static_cast<int64_t>(v.size()) < n) std::vector<T>(static_cast<size_t>(n)).swap(v);
  *bytes += static_cast<int64_t>(v.capacity() * sizeof(T));
  return v.data();
}

// Scratch sets shared by every calling thread: a call leases a free set (a new one when all are
// leased by concurrent calls) and gives it back at its end, so the sets number the most calls
// that ever ran at once. XLA runs an op on whichever of its pool's threads is free; with scratch
// per thread, each new calling thread grew and first-touched its own set (OLMoE T=512: ~80 MB,
// ~20k page faults, +10-35 ms on that call, 16-core Xeon), and a pool of 16 held 16 sets.
template <typename T>
class ScratchPool {
 public:
  class Lease {
   public:
    explicit Lease(ScratchPool& pool) : pool_(pool), item_(pool.Take()) {}
    ~Lease() { pool_.Give(std::move(item_)); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    T& operator*() { return *item_; }

   private:
    ScratchPool& pool_;
    std::unique_ptr<T> item_;
  };

  // The process's pool for T, never destroyed (a call may run during static destruction).
  static ScratchPool& Get() {
    static ScratchPool* pool = new ScratchPool;
    return *pool;
  }

  // Sets made so far: the most calls that ever held one at once.
  int64_t Sets() {
    std::lock_guard<std::mutex> lock(mutex_);
    return sets_;
  }

 private:
  std::unique_ptr<T> Take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) {
      ++sets_;
      return std::make_unique<T>();
    }
    std::unique_ptr<T> item = std::move(free_.back());
    free_.pop_back();
    return item;
  }
  void Give(std::unique_ptr<T> item) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(item));
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<T>> free_;
  int64_t sets_ = 0;
};

inline size_t ElementBytes(ElementType t) { return t == ElementType::kF32 ? 4 : 2; }

// Row stages (quantize, activate, combine, store) this small run on the calling thread.
inline constexpr int64_t kInlineStageElements = 16384;

// 16-row tiles per GEMM work item when `gemms` GEMMs of `tiles` tiles each share `threads`
// threads: ranges shrink when there are few GEMMs so that every thread gets work in decode,
// about kPiecesPerThread items a thread, so that threads finish within a small item of each
// other (64 items left threads idle for a quarter of GEMM1 at T=1 on 16 cores, Xeon,
// 2026-11-25). That is an item per ParallelFor piece: smaller items only split a piece into
// more GEMM calls and column ranges (2-core Zen 2, T = 1, 16 layers a call: 32 items on 2
// threads streamed 1.2-3.1 % more than 256, 2026-11-28). `gemms` counts every GEMM whose items
// share one ParallelFor: the decode region's two passes count both (they were sized as if each
// had the ParallelFor alone, two items a piece: 16-core Xeon, T = 1, 2-5 % slower; T = 8 level;
// 2026-11-29).
inline int64_t TilesPerGemmItem(int64_t tiles, int64_t gemms, int64_t threads) {
  const int64_t items = std::max<int64_t>(1, threads) * kPiecesPerThread;
  const int64_t per_gemm = std::max<int64_t>(1, items / std::max<int64_t>(1, gemms));
  return std::max<int64_t>(2, (tiles + per_gemm - 1) / per_gemm);
}

}  // namespace jax_moeq::cpu
