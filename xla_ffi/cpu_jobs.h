// The parallel_for behind the CPU handlers, apart from XLA (tests/test_native_safety.py builds it
// under ThreadSanitizer with a pool of its own): pieces handed out dynamically to the caller and
// the pool's workers, and, when asked, workers that wait for the next call instead of sleeping.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "cpu/w4a8_moe.h"

namespace jax_moeq::ffi_cpu {

inline int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One calling thread's parallel_for job, reused call after call and never freed, so that a
// worker holding a stale pointer can always read it. A call is a generation; a worker takes a
// seat with a compare-and-swap on (generation, seats), so a seat of an old call is refused. No
// lock anywhere: a thread blocked on a lock sleeps, and waking is the cost this avoids.
class Job {
 public:
  static Job& OfThisThread() {
    thread_local Job* job = new Job;
    return *job;
  }

  // Starts a call over [0, n) in at most `chunks` pieces (the caller holds the first seat) and
  // returns its generation.
  uint64_t Start(int64_t n, int64_t chunks, int64_t workers,
                 const std::function<void(int64_t, int64_t)>* body) {
    n_ = n;
    chunks_ = std::clamp<int64_t>(chunks, 1, n);  // no more pieces than indices: none empty
    workers_.store(workers, std::memory_order_relaxed);
    body_ = body;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    left_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (seats_.load(std::memory_order_relaxed) >> kSeatBits) + 1;
    seats_.store(gen << kSeatBits | 1, std::memory_order_release);
    return gen;
  }

  // A seat in call `gen`, while it has one free.
  bool Join(uint64_t gen) {
    uint64_t seen = seats_.load(std::memory_order_acquire);
    for (;;) {
      if (seen >> kSeatBits != gen) return false;
      const int64_t taken = static_cast<int64_t>(seen & kSeatMask);
      // A stale generation's worker may read this while Start writes it: atomic.
      if (taken >= workers_.load(std::memory_order_relaxed)) return false;
      if (seats_.compare_exchange_weak(seen, seen + 1, std::memory_order_acq_rel)) return true;
    }
  }
  uint64_t Generation() const { return seats_.load(std::memory_order_acquire) >> kSeatBits; }

  // Runs pieces until none is left (a seated worker then Leaves).
  void Work() {
    for (;;) {
      const int64_t c = next_.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks_) break;
      // Piece c is [c n / chunks, (c + 1) n / chunks): sizes differ by one at most and none is
      // empty (Start keeps chunks <= n). A rounded-up grain left the last pieces empty: 408
      // items in 256 pieces of 2 ran 204 pieces of work and 52 of nothing (DeepSeek-V2-Lite
      // T = 1, 16 threads).
      (*body_)(c * n_ / chunks_, (c + 1) * n_ / chunks_);
      done_.fetch_add(1, std::memory_order_release);
    }
  }
  void Leave() { left_.fetch_add(1, std::memory_order_release); }

  // The caller, after its own Work: every piece done, no new seat, every seated worker gone
  // (then Start may reuse this job).
  void Finish() {
    while (done_.load(std::memory_order_acquire) < chunks_) std::this_thread::yield();
    const uint64_t closed = seats_.fetch_or(kSeatMask, std::memory_order_acq_rel);
    const int64_t workers = static_cast<int64_t>(closed & kSeatMask) - 1;
    while (left_.load(std::memory_order_acquire) < workers) CpuRelax();
  }

 private:
  static constexpr int kSeatBits = 20;
  static constexpr uint64_t kSeatMask = (uint64_t{1} << kSeatBits) - 1;
  int64_t n_ = 0, chunks_ = 0;  // read only by seated threads (after Join)
  std::atomic<int64_t> workers_{0};
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  std::atomic<int64_t> next_{0}, done_{0}, left_{0};
  std::atomic<uint64_t> seats_{0};
};

// The job of the latest call that wants spinning workers (process-wide), and a worker's wait.
class JobBoard {
 public:
  static JobBoard& Get() {
    static JobBoard* board = new JobBoard;  // never destroyed: workers may outlive statics
    return *board;
  }
  void Post(Job* job) { posted_.store(job, std::memory_order_release); }
  void Unpost(Job* job) {
    Job* expected = job;
    posted_.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel);
  }
  int64_t Spinning() const { return spinning_.load(std::memory_order_acquire); }

  // A worker's life from its first seat: work, then for up to spin_ns take a seat in any call
  // posted later.
  void Serve(Job* job, int64_t spin_ns) {
    for (;;) {
      job->Work();
      job->Leave();
      if (spin_ns <= 0) return;
      spinning_.fetch_add(1, std::memory_order_acq_rel);
      job = nullptr;
      const int64_t deadline = SteadyNs() + spin_ns;
      while (job == nullptr && SteadyNs() < deadline) {
        Job* posted = posted_.load(std::memory_order_acquire);
        if (posted != nullptr && posted->Join(posted->Generation())) {
          job = posted;
          break;
        }
        for (int i = 0; i < 8; ++i) CpuRelax();
      }
      spinning_.fetch_sub(1, std::memory_order_acq_rel);
      if (job == nullptr) return;
    }
  }

 private:
  std::atomic<Job*> posted_{nullptr};
  std::atomic<int64_t> spinning_{0};
};

// A ParallelFor over `pool` (anything with Schedule(std::function<void()>)): `workers` threads
// at most, the caller included; workers stay up to `spin_us` for later calls.
template <typename Pool>
cpu::ParallelFor MakeParallelFor(Pool pool, int64_t workers, int64_t spin_us) {
  const int64_t threads = std::max<int64_t>(1, workers);
  const int64_t spin_ns = spin_us * 1000;
  auto run = [pool, threads, spin_ns](int64_t n,
                                      const std::function<void(int64_t, int64_t)>& body) mutable {
    if (n <= 0) return;
    const int64_t workers = std::min(threads, n);
    if (workers <= 1) {
      body(0, n);
      return;
    }
    // Chunks are handed out dynamically; the caller works too and then waits only for chunks
    // already taken (and seated workers), so a busy pool can never deadlock it.
    Job& job = Job::OfThisThread();
    const uint64_t gen = job.Start(n, workers * cpu::kPiecesPerThread, workers, &body);
    JobBoard& board = JobBoard::Get();
    int64_t spinning = 0;
    if (spin_ns > 0) {
      board.Post(&job);
      spinning = board.Spinning();
    }
    Job* shared = &job;
    for (int64_t w = 1 + spinning; w < workers; ++w) {
      pool.Schedule([shared, gen, spin_ns]() {
        if (shared->Join(gen)) JobBoard::Get().Serve(shared, spin_ns);
      });
    }
    job.Work();
    if (spin_ns > 0) board.Unpost(&job);
    job.Finish();
  };
  return cpu::ParallelFor{run, threads};
}

}  // namespace jax_moeq::ffi_cpu
