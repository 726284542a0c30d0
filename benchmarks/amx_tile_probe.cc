// What the AMX tile unit of this host sustains under the load patterns a W4A8 GEMM can choose:
// TDPBSUD alone, with its A and B tiles loaded from L1, with A streamed from L2 in contiguous
// 1 KB tiles or in rows K bytes apart (the production loop's), and with the per-group C-tile
// store and float promotion. Results are not checked: timing only. Built and run on an AMX
// host by benchmarks/amx_tile_probe.sh; prints GMAC/s and MACs per cycle of the core clock
// measured by a dependent multiply chain.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu/amx_tile_config.h"
#include "cpu/cpu_isa.h"

using jax_moeq::cpu::Isa;
using jax_moeq::cpu::TileConfig;

namespace {

constexpr int64_t kMacsPerDot = 16 * 16 * 64;

void Configure() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Core GHz from a chain of dependent 64-bit multiplies (3 cycles each on Intel cores; a chain of
// adds of an immediate can be folded at rename on recent cores, so it would overstate the clock).
double CoreGhz() {
  const int64_t n = 200000000;
  uint64_t x = 3, y = 1;
  const double t0 = Seconds();
  for (int64_t i = 0; i < n; i += 8) {
    asm volatile("imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\t"
                 "imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0" : "+r"(x) : "r"(y));
  }
  return 3.0 * n / (Seconds() - t0) / 1e9;
}

struct Buffers {
  std::vector<int8_t> a_l1, a_l2;     // 4 KB; 256 KB
  std::vector<uint8_t> b_l1;          // 8 KB
  std::vector<int32_t> c;             // 4 C tiles
  std::vector<float> acc;             // 64 rows x 16
  Buffers() : a_l1(4096, 3), a_l2(256 << 10, 5), b_l1(8192, 7), c(1024), acc(1024, 0.f) {}
};

// Each variant runs `iters` steps and returns the TDPBSUDs it issued.
using Variant = int64_t (*)(Buffers&, int64_t iters);

// Four independent C tiles, A and B never reloaded.
int64_t DotsOnly(Buffers& b, int64_t iters) {
  _tile_loadd(4, b.a_l1.data(), 64);
  _tile_loadd(5, b.a_l1.data() + 1024, 64);
  _tile_loadd(6, b.b_l1.data(), 64);
  _tile_loadd(7, b.b_l1.data() + 1024, 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
  }
  return 4 * iters;
}

// One step of 2 x 2: A tiles at a and a + 1 KB, B tiles at b and b + 1 KB, four products on C
// tiles 0-3.
inline void TwoByTwoStep(const int8_t* a, const uint8_t* b) {
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + 1024, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + 1024, 64);
  _tile_dpbsud(0, 4, 6);
  _tile_dpbsud(1, 4, 7);
  _tile_dpbsud(2, 5, 6);
  _tile_dpbsud(3, 5, 7);
}

// Step i of 2 x 2 from L1 (the halves of 4 KB, alternating).
inline void TwoByTwoStepL1(const Buffers& b, int64_t i) {
  const int64_t o = (i & 1) * 2048;
  TwoByTwoStep(b.a_l1.data() + o, b.b_l1.data() + o);
}

inline void ZeroCTiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

inline void StoreCTiles(int32_t* c) {
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

// The promotion of `rows` rows of 16 int32 sums: converted, scaled and added into float rows.
inline void PromoteRows(const int32_t* c, float* acc, int rows, __m512 scale) {
  for (int r = 0; r < rows; ++r) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 16));
    _mm512_storeu_ps(acc + r * 16, _mm512_fmadd_ps(f, scale, _mm512_loadu_ps(acc + r * 16)));
  }
}

// 2 x 2: two A and two B tiles loaded from L1 per four products.
int64_t TwoByTwoL1(Buffers& b, int64_t iters) {
  for (int64_t i = 0; i < iters; ++i) TwoByTwoStepL1(b, i);
  return 4 * iters;
}

// 2 x 2 with A streamed through a 256 KB buffer (L2) in contiguous 1 KB tiles, B from L1.
int64_t TwoByTwoAL2(Buffers& b, int64_t iters) {
  const int64_t wrap = (256 << 10) / 2048;
  for (int64_t i = 0; i < iters; ++i) {
    TwoByTwoStep(b.a_l2.data() + (i % wrap) * 2048, b.b_l1.data() + (i & 3) * 2048);
  }
  return 4 * iters;
}

// The production pattern: one B tile (L1) shared by four products, each with its own A tile
// load. kStride: A's rows 2048 bytes apart (rows of K = 2048) instead of a contiguous 1 KB;
// kL2: A walks the 256 KB buffer, else a 4 KB one.
template <bool kL2, bool kStride>
int64_t OneBFourA(Buffers& b, int64_t iters) {
  const int64_t stride = kStride ? 2048 : 64;
  const int64_t span = kL2 ? (256 << 10) : 4096;
  const int8_t* base = kL2 ? b.a_l2.data() : b.a_l1.data();
  // Tile starts: contiguous tiles step by 1 KB; strided ones by 64 bytes (the next chunk).
  const int64_t step = kStride ? 64 : 1024;
  const int64_t starts = kStride ? 2048 / 64 : span / 1024;
  const int64_t row_blocks = kStride ? span / (16 * 2048) : 1;
  int64_t s = 0;
  for (int64_t i = 0; i < iters; ++i) {
    _tile_loadd(6, b.b_l1.data() + (i & 7) * 1024, 64);
    for (int t = 0; t < 4; ++t, ++s) {
      const int8_t* a = kStride
                            ? base + ((s / starts) % std::max<int64_t>(1, row_blocks)) * 16 * 2048 +
                                  (s % starts) * step
                            : base + (s % starts) * step;
      _tile_loadd(4, a, stride);
      switch (t) {
        case 0: _tile_dpbsud(0, 4, 6); break;
        case 1: _tile_dpbsud(1, 4, 6); break;
        case 2: _tile_dpbsud(2, 4, 6); break;
        default: _tile_dpbsud(3, 4, 6); break;
      }
    }
  }
  return 4 * iters;
}

// 1 x 4: one A tile (streamed from L2, contiguous) shared by four output tiles' B (L1).
int64_t OneAFourB(Buffers& b, int64_t iters) {
  const int64_t wrap = (256 << 10) / 1024;
  for (int64_t i = 0; i < iters; ++i) {
    _tile_loadd(4, b.a_l2.data() + (i % wrap) * 1024, 64);
    const uint8_t* bb = b.b_l1.data() + (i & 1) * 4096;
    _tile_loadd(6, bb, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_loadd(7, bb + 1024, 64);
    _tile_dpbsud(1, 4, 7);
    _tile_loadd(6, bb + 2048, 64);
    _tile_dpbsud(2, 4, 6);
    _tile_loadd(7, bb + 3072, 64);
    _tile_dpbsud(3, 4, 7);
  }
  return 4 * iters;
}

// 2 x 2 from L1 with a group's end every two steps (128 inputs): the four C tiles stored, and
// (kPromote) their 64 rows converted and added into float rows, then the tiles zeroed.
template <bool kPromote>
int64_t TwoByTwoGroups(Buffers& b, int64_t iters) {
  const __m512 scale = _mm512_set1_ps(0.5f);
  for (int64_t i = 0; i < iters; ++i) {
    if ((i & 1) == 0) ZeroCTiles();
    TwoByTwoStepL1(b, i);
    if ((i & 1) == 1) {
      StoreCTiles(b.c.data());
      if (kPromote) PromoteRows(b.c.data(), b.acc.data(), 64, scale);
    }
  }
  return 4 * iters;
}

// The promotion's vector work alone, no tile instructions: per "step", half a group of 2 x 2
// (32 rows of 16 int32 converted and added into float rows), the rate at which TwoByTwoGroups'
// promotion alone would let the products run.
int64_t PromoteOnly(Buffers& b, int64_t iters) {
  const __m512 scale = _mm512_set1_ps(0.5f);
  for (int64_t i = 0; i < iters; ++i) {
    const int r0 = (i & 1) * 32;
    PromoteRows(b.c.data() + r0 * 16, b.acc.data() + r0 * 16, 32, scale);
    asm volatile("" ::: "memory");
  }
  return 4 * iters;
}

// 2 x 2 from L1, C stored each group into one of two buffers in turn, and the other buffer (the
// group before's sums) promoted: the vector loads never read a tile store still in flight.
int64_t TwoByTwoPromoteBehind(Buffers& b, int64_t iters) {
  const __m512 scale = _mm512_set1_ps(0.5f);
  static thread_local std::vector<int32_t> c2(2048);
  for (int64_t i = 0; i < iters; ++i) {
    if ((i & 1) == 0) ZeroCTiles();
    TwoByTwoStepL1(b, i);
    if ((i & 1) == 1) {
      const int64_t half = (i >> 1) & 1;
      StoreCTiles(c2.data() + half * 1024);
      PromoteRows(c2.data() + (half ^ 1) * 1024, b.acc.data(), 64, scale);
    }
  }
  return 4 * iters;
}

// 1 x 2 from L1 with two C sets (tmm0-1, tmm2-3) alternating by group: a group's products are
// issued, then the other set (the group before) is stored and promoted while they run.
int64_t OneByTwoTwoSets(Buffers& b, int64_t iters) {
  const __m512 scale = _mm512_set1_ps(0.5f);
  int32_t* c = b.c.data();
  // Each step: one group (two chunks) of 1 x 2 on one set, four products.
  for (int64_t i = 0; i < iters; ++i) {
    const bool x = (i & 1) == 0;
    for (int ch = 0; ch < 2; ++ch) {
      const int64_t o = ch * 1024;
      _tile_loadd(4, b.a_l1.data() + o, 64);
      _tile_loadd(6, b.b_l1.data() + 2 * o, 64);
      _tile_loadd(7, b.b_l1.data() + 2 * o + 1024, 64);
      if (x) {
        if (ch == 0) { _tile_zero(0); _tile_zero(1); }
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
      } else {
        if (ch == 0) { _tile_zero(2); _tile_zero(3); }
        _tile_dpbsud(2, 4, 6);
        _tile_dpbsud(3, 4, 7);
      }
    }
    if (x) {
      _tile_stored(2, c, 64);
      _tile_stored(3, c + 256, 64);
    } else {
      _tile_stored(0, c, 64);
      _tile_stored(1, c + 256, 64);
    }
    PromoteRows(c, b.acc.data() + (x ? 0 : 32) * 16, 32, scale);
  }
  return 4 * iters;
}

struct Named {
  const char* name;
  Variant run;
};

double Rate(Variant v, int threads, int64_t iters) {
  std::vector<double> rate(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Configure();
      Buffers b;
      v(b, iters / 10);  // warm
      const double t0 = Seconds();
      const int64_t dots = v(b, iters);
      rate[t] = dots * static_cast<double>(kMacsPerDot) / (Seconds() - t0) / 1e9;
      _tile_release();
    });
  }
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double r : rate) sum += r;
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  // AvailableIsas: CPUID, the OS's tile state and this process's grant of it (cpu_isa.cc).
  bool amx = false;
  for (Isa isa : jax_moeq::cpu::AvailableIsas()) amx |= isa == Isa::kAmxInt8;
  if (!amx) {
    std::printf("no usable AMX-INT8 on this machine\n");
    return 1;
  }
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : 16;
  const Named variants[] = {
      {"products alone (A, B in tiles)", DotsOnly},
      {"2x2, A and B from L1", TwoByTwoL1},
      {"2x2, A from L2 contiguous", TwoByTwoAL2},
      {"1 B x 4 A, A from L1 contiguous", OneBFourA<false, false>},
      {"1 B x 4 A, A from L2 contiguous", OneBFourA<true, false>},
      {"1 B x 4 A, A from L2 rows 2 KB apart", OneBFourA<true, true>},
      {"1 A x 4 B, A from L2 contiguous", OneAFourB},
      {"2x2 L1, C stored each group", TwoByTwoGroups<false>},
      {"2x2 L1, C stored and promoted", TwoByTwoGroups<true>},
      {"promotion alone (2x2's share)", PromoteOnly},
      {"2x2 L1, promoted a group behind", TwoByTwoPromoteBehind},
      {"1x2 L1, two C sets by group", OneByTwoTwoSets},
  };
  const double ghz = CoreGhz();
  std::printf("core clock by multiply chain: %.2f GHz; peak 1024 MACs/cycle/core\n", ghz);
  for (int threads : {1, max_threads}) {
    for (const Named& v : variants) {
      const double r = Rate(v.run, threads, 2000000);
      std::printf("threads %2d  %-40s %9.1f GMAC/s  %6.1f MACs/cycle/core (at %.2f GHz)\n", threads,
                  v.name, r, r / threads / ghz, ghz);
      std::fflush(stdout);
    }
  }
  std::printf("core clock by multiply chain after: %.2f GHz\n", CoreGhz());
  return 0;
}
