// ParallelFor over XLA's intra-op thread pool (the FFI's ThreadPool context),
// so the kernel shares the cores XLA already uses instead of adding threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "cpu/w4a8_moe.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moeq::ffi_cpu {

// JAX_MOEQ_CPU_WORKERS=N (read per call, as JAX_MOEQ_CPU_ISA): at most N threads work on one
// call, the calling thread included (unset or empty: the pool's size). Sets *error on a value
// that is not a positive integer.
inline int64_t WorkersFromEnv(int64_t pool_threads, std::string* error) {
  const char* value = std::getenv("JAX_MOEQ_CPU_WORKERS");
  if (value == nullptr || *value == '\0') return pool_threads;
  char* end = nullptr;
  const long long n = std::strtoll(value, &end, 10);
  if (*end != '\0' || n < 1) {
    *error = std::string("JAX_MOEQ_CPU_WORKERS='") + value + "' is not a positive integer";
    return pool_threads;
  }
  return std::min<int64_t>(pool_threads, n);
}

// `workers`: the threads one call may use, the caller included (WorkersFromEnv: at most the
// pool's size).
inline cpu::ParallelFor MakeParallelFor(xla::ffi::ThreadPool pool, int64_t workers) {
  const int64_t threads = std::max<int64_t>(1, workers);
  return [pool, threads](int64_t n, const std::function<void(int64_t, int64_t)>& body) mutable {
    if (n <= 0) return;
    const int64_t workers = std::min(threads, n);
    if (workers <= 1) {
      body(0, n);
      return;
    }
    // Chunks are handed out dynamically; the caller works too and then waits
    // only for chunks already taken, so a busy pool can never deadlock it.
    const int64_t chunks = std::min<int64_t>(n, workers * 16);
    const int64_t grain = (n + chunks - 1) / chunks;
    struct State {
      std::atomic<int64_t> next{0};
      std::atomic<int64_t> done{0};
    };
    auto state = std::make_shared<State>();
    auto work = [state, &body, n, grain, chunks]() {
      for (;;) {
        const int64_t c = state->next.fetch_add(1);
        if (c >= chunks) return;
        body(c * grain, std::min(n, (c + 1) * grain));
        state->done.fetch_add(1, std::memory_order_release);
      }
    };
    // Late tasks only touch `state` (shared) and exit before calling body.
    for (int64_t w = 1; w < workers; ++w) pool.Schedule([work]() { work(); });
    work();
    while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
  };
}

}  // namespace jax_moeq::ffi_cpu
