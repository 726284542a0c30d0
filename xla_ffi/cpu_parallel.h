// ParallelFor over XLA's intra-op thread pool (the FFI's ThreadPool context),
// so the kernel shares the cores XLA already uses instead of adding threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cpu/w4a8_moe.h"
#include "cpu_jobs.h"
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

// JAX_MOEQ_CPU_SPIN_US=N (read per call): how long a worker that ran out of pieces stays,
// spinning, for the next call's job instead of going back to XLA's pool (unset: kDefaultSpinUs;
// 0: never). A pool thread that goes back sleeps, and the last of 16 threads started its first
// piece of the next call 40-90 us after the launch (16-core Xeon, T = 1, 2026-11-27), in layers
// of ~0.25 ms; with 2000 the chained layers ran 1.05-1.17x faster at T <= 8. Off by default: a
// 4-layer model's decode moved within the host's process-to-process spread, and spinning
// workers hold pool threads that XLA's own ops may want. Sets *error on a value that is not an
// integer in [0, 1e6].
inline constexpr int64_t kDefaultSpinUs = 0;
inline int64_t SpinUsFromEnv(std::string* error) {
  const char* value = std::getenv("JAX_MOEQ_CPU_SPIN_US");
  if (value == nullptr || *value == '\0') return kDefaultSpinUs;
  char* end = nullptr;
  const long long n = std::strtoll(value, &end, 10);
  if (*end != '\0' || n < 0 || n > 1000000) {
    *error = std::string("JAX_MOEQ_CPU_SPIN_US='") + value + "' is not an integer in [0, 1000000]";
    return 0;
  }
  return n;
}

// `workers`: the threads one call may use, the caller included (WorkersFromEnv: at most the
// pool's size). `spin_us`: SpinUsFromEnv.
inline cpu::ParallelFor MakeParallelFor(xla::ffi::ThreadPool pool, int64_t workers,
                                        int64_t spin_us = 0) {
  return MakeParallelForOn(pool, workers, spin_us);
}

}  // namespace jax_moeq::ffi_cpu
