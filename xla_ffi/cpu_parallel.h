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

// The integer in environment variable `name` (read per call, as JAX_MOEQ_CPU_ISA): `fallback`
// when unset or empty; sets *error, naming the variable, the value and `expected`, when it is not
// an integer in [lo, hi].
inline int64_t IntFromEnv(const char* name, int64_t fallback, int64_t lo, int64_t hi,
                          const char* expected, std::string* error) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(value, &end, 10);
  if (*end != '\0' || n < lo || n > hi) {
    *error = std::string(name) + "='" + value + "' is not " + expected;
    return fallback;
  }
  return n;
}

// JAX_MOEQ_CPU_SPIN_US's default. A worker that runs out of pieces may stay, spinning, for the
// next call's job instead of going back to XLA's pool, where it sleeps: the last of 16 threads
// started its first piece of the next call 40-90 us after the launch (16-core Xeon, T = 1,
// 2026-11-27), in layers of ~0.25 ms, and with 2000 us the chained layers ran 1.05-1.17x faster
// at T <= 8. Off by default: a 4-layer model's decode moved within the host's process-to-process
// spread, and spinning workers hold pool threads that XLA's own ops may want.
inline constexpr int64_t kDefaultSpinUs = 0;

// The handlers' ParallelFor on XLA's pool, with the settings read per call:
// JAX_MOEQ_CPU_WORKERS=N (at most N threads on one call, the caller included; default the pool's
// size) and JAX_MOEQ_CPU_SPIN_US=N (how long, in [0, 1e6] us, a worker waits for the next call).
// Sets *error on a bad value.
inline cpu::ParallelFor ParallelForFromEnv(xla::ffi::ThreadPool pool, std::string* error) {
  const int64_t pool_threads = pool.num_threads();
  const int64_t workers =
      std::min<int64_t>(pool_threads, IntFromEnv("JAX_MOEQ_CPU_WORKERS", pool_threads, 1,
                                                 INT64_MAX, "a positive integer", error));
  if (!error->empty()) return {};
  const int64_t spin_us = IntFromEnv("JAX_MOEQ_CPU_SPIN_US", kDefaultSpinUs, 0, 1000000,
                                     "an integer in [0, 1000000]", error);
  return MakeParallelFor(pool, workers, spin_us);
}

}  // namespace jax_moeq::ffi_cpu
