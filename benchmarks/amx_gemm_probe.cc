// Where an AMX W4A8 GEMM's time goes: the production kernels (csrc/cpu) beside a copy of the
// AMX loop with one part left out at a time (results then wrong; timing only) and with the
// activations laid out per 64-input chunk. Each kernel runs in 32-tile work items. Built and run on an AMX host by
// benchmarks/amx_gemm_probe.sh; prints GMAC/s per variant, row count and thread count.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cpu/amx_tile_config.h"
#include "cpu/cpu_isa.h"
#include "cpu/w4a8_gemm.h"

using namespace jax_moeq::cpu;

namespace {

constexpr int64_t kTileM = 16;
constexpr int64_t kItemTiles = 32;  // OLMoE's GEMM1 items at T >= 128 (w4a8_work.h)

// Output tile nt of every row from its float accumulators (row_corr, zero point, scale, bias).
void StoreTile(const W4A8GemmArgs& a, int64_t nt, const float* acc) {
  const PackedGemmShape& s = a.shape;
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  const __m512 corr = _mm512_loadu_ps(row_corr + nt * 16), b = _mm512_loadu_ps(bias + nt * 16);
  for (int64_t i = 0; i < a.m; ++i) {
    const int64_t row = a.rows[i];
    const __m512 zp = _mm512_set1_ps(static_cast<float>(a.act.zero_point[row]));
    const __m512 xs = _mm512_set1_ps(a.act.scale[row]);
    const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(zp, corr, _mm512_loadu_ps(&acc[i * 16])), xs, b);
    _mm512_storeu_ps(a.out + i * s.n + nt * 16, y);
  }
}

// One (tile, group) chunk's stream ahead asked of the L2, as the production loop does.
inline void PrefetchChunkAhead(const PackedGemmShape& s, const uint8_t* p) {
  for (int64_t ahead = 0; ahead < s.chunk_bytes(); ahead += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kIntelStreamPrefetch.l2_bytes + ahead),
                 _MM_HINT_T1);
  }
}

// A group's `blocks` packed blocks as B rows (block kb's low nibbles are row 2 kb, its high
// nibbles 2 kb + 1); kSigned: nibble - 8, for TDPBSSD.
template <bool kSigned>
inline void UnpackGroupRows(const uint8_t* p, int64_t blocks, void* dst) {
  const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  uint8_t* b = static_cast<uint8_t*>(dst);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const __m512i v = _mm512_loadu_si512(p + kb * 64);
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (kSigned) { lo = _mm512_sub_epi8(lo, eight); hi = _mm512_sub_epi8(hi, eight); }
    _mm512_storeu_si512(b + 2 * kb * 64, lo);
    _mm512_storeu_si512(b + (2 * kb + 1) * 64, hi);
  }
}

// The row block's C tiles stored (kStore) and promoted into acc (kPromote); kCentred: the sums
// are centred already (signed B), else sum8 is subtracted per row.
template <bool kStore, bool kPromote, bool kCentred>
inline void StoreAndPromote(const W4A8GemmArgs& a, int64_t tiles, int64_t row0, int64_t gi,
                            __m512 scale, int32_t* c, float* acc) {
  if (kStore) {
    _tile_stored(0, c, 64);
    if (tiles > 1) _tile_stored(1, c + 256, 64);
    if (tiles > 2) _tile_stored(2, c + 512, 64);
    if (tiles > 3) _tile_stored(3, c + 768, 64);
  }
  if (kPromote) {
    const int64_t groups = a.shape.groups();
    const int64_t rows = std::min<int64_t>(tiles * 16, a.m - row0);
    for (int64_t i = 0; i < rows; ++i) {
      __m512i cen = _mm512_loadu_si512(c + i * 16);
      if (!kCentred) {
        const int64_t row = a.rows[row0 + i];
        cen = _mm512_sub_epi32(cen, _mm512_set1_epi32(a.act.sum8[row * groups + gi]));
      }
      float* dst = acc + (row0 + i) * 16;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(cen), scale, _mm512_loadu_ps(dst)));
    }
  }
}

// kPromote: int32 sums promoted each group; kStore: C tiles stored each group; kUnpack: the
// group's nibbles unpacked each group; kChunkA: A laid out [chunk][row][64] (stride 64 bytes).
template <bool kPromote, bool kStore, bool kUnpack, bool kChunkA>
void AmxVariant(const W4A8GemmArgs& a) {
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups(), bpg = s.group / kBlockInputs, k = s.k;
  const int64_t m_pad = (a.m + kTileM - 1) / kTileM * kTileM;
  static thread_local std::vector<int8_t> abuf;
  static thread_local std::vector<uint8_t> bbuf;
  static thread_local std::vector<float> acc;
  static thread_local std::vector<int32_t> c;
  abuf.assign(m_pad * k, 0);
  bbuf.assign(s.group * kTileRows, 0);
  acc.assign(m_pad * kTileRows, 0.f);
  c.assign(4 * 256, 0);
  for (int64_t i = 0; i < a.m; ++i) {
    const int8_t* src = a.act.values + a.rows[i] * k;
    if (kChunkA) {
      for (int64_t ch = 0; ch < k / 64; ++ch) std::memcpy(&abuf[(ch * m_pad + i) * 64], src + ch * 64, 64);
    } else {
      std::memcpy(&abuf[i * k], src, k);
    }
  }
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  cfg.rows[4] = 16; cfg.colsb[4] = 64;
  cfg.rows[6] = 16; cfg.colsb[6] = 64;
  _tile_loadconfig(&cfg);
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    const uint8_t* p = a.weights + nt * s.tile_bytes();
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t gi = 0; gi < groups; ++gi, p += s.chunk_bytes()) {
      PrefetchChunkAhead(s, p);
      if (kUnpack || gi == 0) UnpackGroupRows<false>(p, bpg, bbuf.data());
      const __m512 scale = _mm512_loadu_ps(p + bpg * 64);
      for (int64_t row0 = 0; row0 < m_pad; row0 += 64) {
        const int64_t tiles = std::min<int64_t>(4, (m_pad - row0) / 16);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t ch = 0; ch < s.group / 64; ++ch) {
          _tile_loadd(6, &bbuf[ch * 16 * 64], 64);
          const int64_t kc = gi * s.group / 64 + ch;
          for (int64_t t = 0; t < tiles; ++t) {
            const int8_t* ap = kChunkA ? &abuf[(kc * m_pad + row0 + 16 * t) * 64]
                                       : &abuf[(row0 + 16 * t) * k + kc * 64];
            _tile_loadd(4, ap, kChunkA ? 64 : k);
            switch (t) {
              case 0: _tile_dpbsud(0, 4, 6); break;
              case 1: _tile_dpbsud(1, 4, 6); break;
              case 2: _tile_dpbsud(2, 4, 6); break;
              default: _tile_dpbsud(3, 4, 6); break;
            }
          }
        }
        StoreAndPromote<kStore, kPromote, false>(a, tiles, row0, gi, scale, c.data(), acc.data());
      }
    }
    StoreTile(a, nt, acc.data());
  }
  _tile_release();
}

// The production loop with each tile load going to the tile register the previous product did
// not read (A alternates tmm4 / tmm5, a group's two B chunks sit in tmm6 / tmm7), so a load need
// not wait for the product before it. kSigned: B unpacked as nibble - 8 (TDPBSSD), so the sums
// come out centred and the promotion drops its sum8 subtraction (the same int32 values).
// kPromote / kStore as above (false: timing only).
template <int kTiles, bool kSigned>
inline void PingPongGroup(const int8_t* a0, int64_t stride, const uint8_t* b) {
  _tile_zero(0);
  if constexpr (kTiles > 1) _tile_zero(1);
  if constexpr (kTiles > 2) _tile_zero(2);
  if constexpr (kTiles > 3) _tile_zero(3);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + 1024, 64);
#define PP_DP(c, a, bb) \
  if constexpr (kSigned) _tile_dpbssd(c, a, bb); else _tile_dpbsud(c, a, bb);
  _tile_loadd(4, a0, stride);
  PP_DP(0, 4, 6);
  if constexpr (kTiles > 1) { _tile_loadd(5, a0 + 16 * stride, stride); PP_DP(1, 5, 6); }
  if constexpr (kTiles > 2) { _tile_loadd(4, a0 + 32 * stride, stride); PP_DP(2, 4, 6); }
  if constexpr (kTiles > 3) { _tile_loadd(5, a0 + 48 * stride, stride); PP_DP(3, 5, 6); }
  // chunk 1 (inputs 64..127 of the group): tmm4 / tmm5 swapped so the first load follows the
  // product two back
  if constexpr (kTiles > 1) { _tile_loadd(5, a0 + 64, stride); PP_DP(0, 5, 7); }
  else { _tile_loadd(4, a0 + 64, stride); PP_DP(0, 4, 7); }
  if constexpr (kTiles > 1) { _tile_loadd(4, a0 + 16 * stride + 64, stride); PP_DP(1, 4, 7); }
  if constexpr (kTiles > 2) { _tile_loadd(5, a0 + 32 * stride + 64, stride); PP_DP(2, 5, 7); }
  if constexpr (kTiles > 3) { _tile_loadd(4, a0 + 48 * stride + 64, stride); PP_DP(3, 4, 7); }
#undef PP_DP
}

template <bool kPromote, bool kStore, bool kSigned>
void AmxPingPong(const W4A8GemmArgs& a) {
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups(), bpg = s.group / kBlockInputs, k = s.k;
  if (s.group != 128) return;  // the probe's shape
  const int64_t m_pad = (a.m + kTileM - 1) / kTileM * kTileM;
  static thread_local std::vector<int8_t> abuf;
  static thread_local std::vector<uint8_t> bbuf;
  static thread_local std::vector<float> acc;
  static thread_local std::vector<int32_t> c;
  if (static_cast<int64_t>(abuf.size()) < m_pad * k) abuf.resize(m_pad * k);
  bbuf.resize(s.group * kTileRows);
  if (static_cast<int64_t>(acc.size()) < m_pad * kTileRows) acc.resize(m_pad * kTileRows);
  c.resize(4 * 256);
  for (int64_t i = 0; i < a.m; ++i) std::memcpy(&abuf[i * k], a.act.values + a.rows[i] * k, k);
  std::memset(&abuf[a.m * k], 0, (m_pad - a.m) * k);
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    const uint8_t* p = a.weights + nt * s.tile_bytes();
    std::memset(acc.data(), 0, m_pad * kTileRows * sizeof(float));
    for (int64_t gi = 0; gi < groups; ++gi, p += s.chunk_bytes()) {
      PrefetchChunkAhead(s, p);
      UnpackGroupRows<kSigned>(p, bpg, bbuf.data());
      const __m512 scale = _mm512_loadu_ps(p + bpg * 64);
      for (int64_t row0 = 0; row0 < m_pad; row0 += 64) {
        const int64_t tiles = std::min<int64_t>(4, (m_pad - row0) / 16);
        const int8_t* a0 = &abuf[row0 * k + gi * 128];
        switch (tiles) {
          case 4: PingPongGroup<4, kSigned>(a0, k, bbuf.data()); break;
          case 3: PingPongGroup<3, kSigned>(a0, k, bbuf.data()); break;
          case 2: PingPongGroup<2, kSigned>(a0, k, bbuf.data()); break;
          default: PingPongGroup<1, kSigned>(a0, k, bbuf.data()); break;
        }
        StoreAndPromote<kStore, kPromote, kSigned>(a, tiles, row0, gi, scale, c.data(), acc.data());
      }
    }
    StoreTile(a, nt, acc.data());
  }
  _tile_release();
}

// One 16-row block's float sums of one output tile held in 16 zmm registers across all groups,
// instead of a float row in memory per group: the promotion is a load-and-convert and an FMA per
// row. Two C tiles alternate between groups, so that group g + 1's products are issued before
// group g's sums are promoted. The output tile's whole K is unpacked once, signed (nibble - 8,
// TDPBSSD: the sums come out centred), and A is laid out per row block and chunk ([block][chunk]
// [16][64]), so every tile load reads 1 KB in one piece. Bit-identical to the production loop.
// (The tile intrinsics paste their register numbers into the instruction: literal ones only.)
template <int kC>
__attribute__((always_inline)) inline void RegAccProducts(const int8_t* a_chunks, const int8_t* b_chunks, int64_t chunks) {
  if constexpr (kC == 0) _tile_zero(0); else _tile_zero(1);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    _tile_loadd(6, b_chunks + ch * 1024, 64);
    _tile_loadd(4, a_chunks + ch * 1024, 64);
    if constexpr (kC == 0) _tile_dpbssd(0, 4, 6); else _tile_dpbssd(1, 4, 6);
  }
}

__attribute__((always_inline)) inline void RegAccPromote(const int32_t* c, __m512 scale, __m512 (&acc)[16]) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + r * 16)), scale, acc[r]);
  }
}

// kPromote false: the products alone (no C-tile store, no promotion; timing only).
template <bool kPromote>
void AmxRegAcc(const W4A8GemmArgs& a) {
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups(), bpg = s.group / kBlockInputs, k = s.k;
  if (s.group % 64 != 0) return;  // the probe's shapes: chunks of 64 inputs
  const int64_t kc_all = k / 64, chunks = s.group / 64;
  const int64_t m_pad = (a.m + kTileM - 1) / kTileM * kTileM, blocks = m_pad / kTileM;
  static thread_local std::vector<int8_t> abuf, bbuf;
  static thread_local std::vector<float> scales;
  abuf.assign(m_pad * k, 0);
  bbuf.resize(k * kTileRows);
  scales.resize(groups * kTileRows);
  for (int64_t i = 0; i < a.m; ++i) {
    const int8_t* src = a.act.values + a.rows[i] * k;
    int8_t* dst = &abuf[(i / kTileM) * kc_all * 1024 + (i % kTileM) * 64];
    for (int64_t kc = 0; kc < kc_all; ++kc) std::memcpy(dst + kc * 1024, src + kc * 64, 64);
  }
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t : {0, 1, 4, 6}) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    const uint8_t* p = a.weights + nt * s.tile_bytes();
    for (int64_t gi = 0; gi < groups; ++gi, p += s.chunk_bytes()) {
      PrefetchChunkAhead(s, p);
      UnpackGroupRows<true>(p, bpg, &bbuf[gi * s.group * kTileRows]);
      std::memcpy(&scales[gi * kTileRows], p + bpg * 64, kTileRows * 4);
    }
    const __m512 corr = _mm512_loadu_ps(row_corr + nt * 16), bv = _mm512_loadu_ps(bias + nt * 16);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      alignas(64) int32_t c[2][256];
      const int8_t* ab = &abuf[blk * kc_all * 1024];
      __m512 acc[16];
      for (auto& v : acc) v = _mm512_setzero_ps();
      const int64_t gchunk = chunks * 1024;
      if constexpr (!kPromote) {  // every group's products into one C tile, stored once
        for (int64_t g = 0; g < groups; ++g) {
          RegAccProducts<0>(ab + g * gchunk, bbuf.data() + g * gchunk, chunks);
        }
        _tile_stored(0, c[0], 64);
        acc[0] = _mm512_cvtepi32_ps(_mm512_load_si512(c[0]));
      } else {
        RegAccProducts<0>(ab, bbuf.data(), chunks);
        _tile_stored(0, c[0], 64);
        int64_t gi = 0;
        for (; gi + 2 <= groups; gi += 2) {
          RegAccProducts<1>(ab + (gi + 1) * gchunk, bbuf.data() + (gi + 1) * gchunk, chunks);
          RegAccPromote(c[0], _mm512_loadu_ps(&scales[gi * 16]), acc);
          _tile_stored(1, c[1], 64);
          if (gi + 2 < groups) {
            RegAccProducts<0>(ab + (gi + 2) * gchunk, bbuf.data() + (gi + 2) * gchunk, chunks);
          }
          RegAccPromote(c[1], _mm512_loadu_ps(&scales[(gi + 1) * 16]), acc);
          if (gi + 2 < groups) _tile_stored(0, c[0], 64);
        }
        if (gi < groups) RegAccPromote(c[0], _mm512_loadu_ps(&scales[gi * 16]), acc);
      }
      const int64_t rows = std::min<int64_t>(kTileM, a.m - blk * kTileM);
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {  // unrolled, so that acc stays in registers
        if (r >= rows) break;
        const int64_t i = blk * kTileM + r, row = a.rows[i];
        const __m512 zp = _mm512_set1_ps(static_cast<float>(a.act.zero_point[row]));
        const __m512 xs = _mm512_set1_ps(a.act.scale[row]);
        _mm512_storeu_ps(a.out + i * s.n + nt * 16,
                         _mm512_fmadd_ps(_mm512_fnmadd_ps(zp, corr, acc[r]), xs, bv));
      }
    }
  }
  _tile_release();
}

using Kernel = void (*)(const W4A8GemmArgs&);

struct Problem {
  PackedGemmShape shape;
  std::vector<uint8_t> weights;
  std::vector<int8_t> values;
  std::vector<float> scale;
  std::vector<int32_t> zp, sum8, rows;
  std::vector<float> out;
};

Problem MakeProblem(int64_t n, int64_t k, int64_t group, int64_t m, uint32_t seed) {
  Problem p;
  p.shape = {n, k, group};
  std::mt19937 rng(seed);
  p.weights.resize(p.shape.total_bytes());
  for (auto& b : p.weights) b = static_cast<uint8_t>(rng());
  // Scales, row_corr and bias as small floats (random bytes would be NaN or huge).
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  const int64_t bpg = group / kBlockInputs;
  for (int64_t nt = 0; nt < n / 16; ++nt) {
    for (int64_t gi = 0; gi < p.shape.groups(); ++gi) {
      float* sc = reinterpret_cast<float*>(&p.weights[nt * p.shape.tile_bytes() + gi * p.shape.chunk_bytes() + bpg * 64]);
      for (int r = 0; r < 16; ++r) sc[r] = u(rng) * 1e-3f;
    }
  }
  float* tail = reinterpret_cast<float*>(&p.weights[p.shape.row_corr_offset()]);
  for (int64_t i = 0; i < 2 * n; ++i) tail[i] = u(rng);
  p.values.resize(m * k);
  for (auto& v : p.values) v = static_cast<int8_t>(rng());
  p.scale.assign(m, 0.01f);
  p.zp.resize(m);
  for (auto& z : p.zp) z = static_cast<int32_t>(rng() % 255) - 127;
  // sum8 as the row quantizer gives it (8 x the group's sum): the signed-B variant relies on it.
  p.sum8.assign(m * p.shape.groups(), 0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) p.sum8[i * p.shape.groups() + j / group] += 8 * p.values[i * k + j];
  }
  p.rows.resize(m);
  for (int64_t i = 0; i < m; ++i) p.rows[i] = static_cast<int32_t>(i);
  p.out.assign(m * n, 0.f);
  return p;
}

W4A8GemmArgs Args(Problem& p) {
  W4A8GemmArgs a;
  a.weights = p.weights.data();
  a.shape = p.shape;
  a.act = {p.values.data(), p.scale.data(), p.zp.data(), p.sum8.data()};
  a.rows = p.rows.data();
  a.m = static_cast<int64_t>(p.rows.size());
  a.out = p.out.data();
  a.tile_begin = 0;
  a.tile_end = p.shape.n / 16;
  return a;
}

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// GMAC/s of `kernel` on `threads` threads, each on its own problem, for ~0.3 s.
double Rate(Kernel kernel, std::vector<Problem>& probs) {
  const int threads = static_cast<int>(probs.size());
  std::vector<double> rates(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      W4A8GemmArgs a = Args(probs[t]);
      // In work items of kItemTiles output tiles, as the MoE op hands them out.
      auto run = [&] {
        for (int64_t t0 = 0; t0 < a.shape.n / 16; t0 += kItemTiles) {
          W4A8GemmArgs item = a;
          item.tile_begin = t0;
          item.tile_end = std::min<int64_t>(a.shape.n / 16, t0 + kItemTiles);
          kernel(item);
        }
      };
      run();  // warm
      const double macs = static_cast<double>(a.m) * a.shape.n * a.shape.k;
      int reps = 0;
      const double t0 = Seconds();
      double t1 = t0;
      while (t1 - t0 < 0.3) { run(); ++reps; t1 = Seconds(); }
      rates[t] = macs * reps / (t1 - t0) / 1e9;
    });
  }
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double r : rates) sum += r;
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  bool amx = false;
  for (Isa i : AvailableIsas()) amx |= i == Isa::kAmxInt8;
  // PROBE_CHECK_ONLY=1: the bit-equality checks alone, one thread (with tests/native/amx_emulation.h
  // included, on any x86 machine).
  const bool check_only = std::getenv("PROBE_CHECK_ONLY") != nullptr;
  if (!amx && !check_only) { std::printf("no AMX on this machine\n"); return 1; }
  const int64_t n = 2048, k = 2048, group = 128;
  struct V { const char* name; Kernel kernel; };
  const V variants[] = {
      {"vnni (production)", W4A8GemmAvx512Vnni},
      {"amx (production)", W4A8GemmAmx},
      {"amx, the same loop here", AmxVariant<true, true, true, false>},
      {"amx chunk-major A", AmxVariant<true, true, true, true>},
      {"amx no promote", AmxVariant<false, true, true, false>},
      {"amx no store+promote", AmxVariant<false, false, true, false>},
      {"amx no unpack", AmxVariant<true, true, false, false>},
      {"amx products only, chunk-major A", AmxVariant<false, false, false, true>},
      {"amx ping-pong", AmxPingPong<true, true, false>},
      {"amx ping-pong, signed B", AmxPingPong<true, true, true>},
      {"amx ping-pong, no store+promote", AmxPingPong<false, false, false>},
      {"amx register sums, signed B", AmxRegAcc<true>},
      {"amx register sums, products only", AmxRegAcc<false>},
  };
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : 16;
  std::printf("N=%ld K=%ld group %ld; GMAC/s summed over threads, each on its own weights\n",
              (long)n, (long)k, (long)group);
  for (int threads : {1, max_threads}) {
    if (check_only && threads > 1) break;
    for (int64_t m : {16, 64, 128, 512}) {
      std::vector<Problem> probs;
      for (int t = 0; t < threads; ++t) probs.push_back(MakeProblem(n, k, group, m, 1234 + t));
      // Bit-equality of the variants that keep every part with the production AMX kernel.
      W4A8GemmArgs a = Args(probs[0]);
      W4A8GemmAmx(a);
      const std::vector<float> ref = probs[0].out;
      for (Kernel kv : {AmxVariant<true, true, true, false>, AmxVariant<true, true, true, true>, W4A8GemmAvx512Vnni,
                        AmxPingPong<true, true, false>, AmxPingPong<true, true, true>,
                        AmxRegAcc<true>}) {
        std::fill(probs[0].out.begin(), probs[0].out.end(), -1.f);
        kv(a);
        if (std::memcmp(ref.data(), probs[0].out.data(), ref.size() * 4) != 0) {
          std::printf("MISMATCH at m=%ld\n", (long)m);
        }
      }
      if (check_only) {
        std::printf("m %ld checked\n", (long)m);
        continue;
      }
      for (const V& v : variants) {
        std::printf("threads %2d m %4ld  %-34s %8.1f GMAC/s\n", threads, (long)m, v.name, Rate(v.kernel, probs));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
