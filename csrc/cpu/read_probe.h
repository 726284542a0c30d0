// Sustained DRAM read bandwidth of this machine, for the benchmarks' "% of DRAM" figures.
// Each thread sums its slice of one buffer (larger than the last-level cache) with independent
// accumulators, so that loads, not the adds, bound it; the buffer is written once before timing
// so that every page is mapped. Not used by the kernels.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace jax_moeq::cpu {

inline uint64_t SumWords(const uint64_t* p, int64_t n) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
    a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
  }
  for (; i < n; ++i) a0 += p[i];
  return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

// Median GB/s (1e9 bytes per second) over `repeats` passes of `threads` threads over `bytes`.
// The median, not the best: on a shared virtual machine a single pass now and then reads
// ~1.5x faster than the rest (AMD EPYC VM, 2026-11-25: 50 against 30-35 GB/s).
inline double MeasureReadBandwidth(int64_t bytes, int threads, int repeats) {
  const int64_t words = std::max<int64_t>(bytes / 8, threads);
  std::vector<uint64_t> data(words, 1);
  std::vector<uint64_t> sums(threads);
  std::vector<double> rates;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const int64_t begin = words * t / threads, end = words * (t + 1) / threads;
        sums[t] = SumWords(data.data() + begin, end - begin);
      });
    }
    for (auto& th : pool) th.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    uint64_t total = 0;
    for (uint64_t s : sums) total += s;
    if (total != static_cast<uint64_t>(words)) return 0.0;  // keeps the sums alive
    rates.push_back(static_cast<double>(words) * 8 / seconds / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  const size_t n = rates.size();
  return n % 2 ? rates[n / 2] : 0.5 * (rates[n / 2 - 1] + rates[n / 2]);
}

}  // namespace jax_moeq::cpu
