// The one-token MoE layer in one kernel ("fused decode"): GEMM1 + activation, a grid-wide
// barrier, GEMM2 + top-k weighting + reduction over k, for a token whose K pairs' weights fit in
// the GPU's shared memory (small-expert models: Qwen3-30B-A3B, DeepSeek-V2-Lite). No XLA types.
//
// Status (2026-11-24, H100): correct and tested, opt-in (fused_decode=True), not faster yet:
// Qwen3-30B-A3B T=1 WNA16 kernel 25.7 us under ncu; its weights have all landed at 13.0 us
// (JAX_MOEQ_DECODE_STOP_AFTER=1), GEMM1 ends at 18.7 us, the grid barrier at 19.9 us.
//
// Why: at one token the multi-kernel path is three to four short launches, each a chain of
// dependent steps with few warps in flight (19-34 % of the copy rate at Qwen3 shapes, 2026-11-23).
// Here one CTA per SM (cooperative launch, so every CTA is resident for the grid barrier) requests
// *all* its weights, GEMM2's included, as soon as the token's experts are known:
// the layer's weights stream as one burst while GEMM1 computes behind the arrivals, and GEMM2
// finds its weights in shared memory when the barrier releases it.
//
// The weights move by 16-byte cp.async from every thread (18 per thread at Qwen3), tracked by
// mbarriers. Bulk copies (the copy engine) streamed at ~1 TB/s here, whether as 1 KB copies per
// warp or whole 16 KB subtiles (H100, Qwen3 T=1, ncu): the SM's copy engine keeps too few bytes
// in flight for a whole layer's share.
//
// Work split (the plan, PlanDecodeLayer; jax_moeq/ops/_gpu_launch.py repeats its arithmetic):
//  GEMM1 unit  = (pair p, 16 activation columns u): gate subtile u and up subtile I/16 + u of
//                pair p's expert over all of K = H. CTA c takes units [c U1 / G, (c+1) U1 / G);
//                warp w of every CTA takes the chunk slice [w C1 / W, (w+1) C1 / W) of each, and
//                the warps' sums meet in shared f32 (atomics), then the CTA applies the
//                activation and stores act[p][16 u + r] (global, read back after the barrier).
//  GEMM2 item  = (output subtile, pair, 64-deep chunk); CTA c takes subtiles
//                [c U2 / G, (c+1) U2 / G) and warp w a contiguous range of their items.
// Weights are the layouts of int4_mma_core.cuh; the arithmetic is MmaChunk's (each weight
// round_to_T(q s), f32 accumulation), so results match the multi-kernel path's rounding points.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>

#include "cuda/moe_int4_gemm.cuh"
#include "cuda/moe_int4_one_token.cuh"

namespace jax_moeq::cuda {

constexpr int kDecodeWarps = 16;
constexpr int kDecodeMaxSlice1 = 4;   // GEMM1 chunks per warp and unit (hidden <= 4096)
constexpr int kDecodeMaxItems2 = 16;  // GEMM2 chunks per warp (scales held in registers)
constexpr int kDecodeChunkBytes = 512;
constexpr int kDecodeMaxTopK = 32;    // expert ids and weights staged in shared memory
// Static shared memory beside the plan's dynamic bytes (ptxas: 1024 for the staged expert ids
// and weights and the grid barrier's needs); the plan's check counts it.
constexpr int kDecodeStaticSmemBytes = 1024;

// Shared-memory layout and work split of one call, from (ctas, top_k, hidden, inter) alone.
struct DecodeLayerPlan {
  int ctas = 0;
  int top_k = 0;
  int units1 = 0, units2 = 0;          // GEMM1: K x I/16; GEMM2: H/16 output subtiles
  int max_units1 = 0, max_units2 = 0;  // most of either a CTA takes
  int slice1 = 0;                      // most GEMM1 chunks a warp takes per unit
  int items2 = 0;                      // most GEMM2 chunks a warp takes
  // Shared memory: GEMM1's weights [unit][2 subtiles][H/64 chunks][512 B], GEMM2's
  // [subtile][pair][I/64 chunks][512 B], the token, the activations, the f32 sums, the barriers.
  int w2_offset = 0, x_offset = 0, act_offset = 0, red1_offset = 0, red2_offset = 0;
  int bar_offset = 0;
  int smem_bytes = 0;
};

inline int CeilDiv(int a, int b) { return (a + b - 1) / b; }
inline int64_t CeilDiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t Align16(int64_t a) { return (a + 15) / 16 * 16; }

// Byte offsets in int64: a shape far past what fits (a large intermediate size) must come out as
// a plan too large for the device, not as a wrapped int (smem_bytes saturates at INT_MAX).
inline DecodeLayerPlan PlanDecodeLayer(int ctas, int top_k, int hidden, int inter) {
  DecodeLayerPlan p;
  p.ctas = ctas;
  p.top_k = top_k;
  p.units1 = top_k * (inter / 16);
  p.units2 = hidden / 16;
  p.max_units1 = CeilDiv(p.units1, ctas);
  p.max_units2 = CeilDiv(p.units2, ctas);
  p.slice1 = CeilDiv(hidden / 64, kDecodeWarps);
  auto narrow = [](int64_t v) {
    return static_cast<int>(std::min<int64_t>(v, std::numeric_limits<int>::max()));
  };
  p.items2 = narrow(CeilDiv64(int64_t{p.max_units2} * top_k * (inter / 64), kDecodeWarps));
  int64_t offset = int64_t{p.max_units1} * 2 * (hidden / 64) * kDecodeChunkBytes;
  p.w2_offset = narrow(offset);
  offset += int64_t{p.max_units2} * top_k * (inter / 64) * kDecodeChunkBytes;
  p.x_offset = narrow(offset);
  offset += Align16(int64_t{hidden} * 2);
  p.act_offset = narrow(offset);
  offset += Align16(int64_t{top_k} * inter * 2);
  p.red1_offset = narrow(offset);
  offset += int64_t{p.max_units1} * 32 * 4;
  p.red2_offset = narrow(offset);
  offset += Align16(int64_t{p.max_units2} * top_k * 16 * 4);
  p.bar_offset = narrow(offset);
  offset += (int64_t{p.max_units1} + 1) * 8;
  p.smem_bytes = narrow(offset);
  return p;
}

// Why a plan cannot run, or "" (max_smem: the device's opt-in shared memory per block).
inline std::string DecodeLayerPlanError(const DecodeLayerPlan& p, int max_smem) {
  if (p.top_k > kDecodeMaxTopK) {
    return "fused decode needs top_k <= " + std::to_string(kDecodeMaxTopK);
  }
  if (p.slice1 > kDecodeMaxSlice1) return "fused decode needs hidden <= 4096";
  if (p.items2 > kDecodeMaxItems2) {
    return "fused decode: GEMM2 has more than " + std::to_string(kDecodeMaxItems2) +
           " chunks per warp";
  }
  if (p.smem_bytes + kDecodeStaticSmemBytes > max_smem) {
    return "fused decode needs " + std::to_string(p.smem_bytes + kDecodeStaticSmemBytes) +
           " bytes of shared memory per CTA, the device has " + std::to_string(max_smem);
  }
  return "";
}

// The layer (OneTokenLayer, its groups set by SetOneTokenGroups) and the launch's plan.
struct DecodeLayerArgs : OneTokenLayer {
  DecodeLayerPlan plan;                  // filled by LaunchDecodeLayer
  // Profiling only (JAX_MOEQ_DECODE_STOP_AFTER, DecodeStopAfter): end the kernel after phase
  // 1 (every weight byte landed), 2 (GEMM1) or 3 (the grid barrier), leaving the output unwritten;
  // 0 runs it all.
  int stop_after = 0;
};

// JAX_MOEQ_DECODE_STOP_AFTER=N (profiling: time the kernel's phases under ncu; results are then
// garbage); read once per process.
inline int DecodeStopAfter() {
  static const int stop = [] {
    const char* v = std::getenv("JAX_MOEQ_DECODE_STOP_AFTER");
    return v == nullptr ? 0 : std::atoi(v);
  }();
  return stop;
}

__device__ __forceinline__ bool ExpertInRange(int e, int experts) { return e >= 0 && e < experts; }

// Word g of a subtile's (scale | zero-point) group: words[e][group][sub][g], as offsets from the
// expert's block (32-bit: the plan's shapes keep a block under 2^31 words).
struct GroupWords {
  const uint32_t* base;  // words + e * groups * n_sub * 8
  int group_stride;      // n_sub * 8
  __device__ __forceinline__ uint32_t at(int group, int sub, int g) const {
    return __ldg(base + group * group_stride + sub * 8 + g);
  }
  __device__ __forceinline__ const uint32_t* address(int group, int sub, int g) const {
    return base + group * group_stride + sub * 8 + g;
  }
};

__device__ __forceinline__ GroupWords WordsOf(const uint32_t* words, int e, int groups,
                                              int n_sub) {
  return GroupWords{words + static_cast<int64_t>(e) * groups * n_sub * 8, n_sub * 8};
}

__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The B operand of one chunk at one token: lanes of row 0 (g == 0) hold the token's 16 inputs
// 16 t + [0, 16) of the chunk, the other lanes zeros (token columns 1-7 of the mma).
template <typename T>
__device__ __forceinline__ void TokenChunk(const T* base, int g, int t, uint4 (&x)[1][2]) {
  if (g == 0) {
    const uint32_t a = SharedAddress(base + 16 * t);
    x[0][0] = LdShared128(a);
    x[0][1] = LdShared128(a + 16);
  } else {
    x[0][0] = make_uint4(0, 0, 0, 0);
    x[0][1] = make_uint4(0, 0, 0, 0);
  }
}

// A warp's walk over its GEMM2 items (subtile j2, pair, chunk c), chunk fastest, without
// divisions in the loop (the kernel is bound by issued instructions as much as by bytes).
struct Items2Cursor {
  int j2, pair, c;
  __device__ __forceinline__ void Start(int item, int c2, int top_k) {
    const int key = item / c2;
    c = item - key * c2;
    j2 = key / top_k;
    pair = key - j2 * top_k;
  }
  __device__ __forceinline__ void Next(int c2, int top_k) {
    if (++c == c2) {
      c = 0;
      if (++pair == top_k) {
        pair = 0;
        ++j2;
      }
    }
  }
};

template <typename T, NibbleCode kCode>
__global__ void __launch_bounds__(kDecodeWarps * 32, 1)
    DecodeLayerKernel(const DecodeLayerArgs p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int pair_expert[kDecodeMaxTopK];
  __shared__ float pair_weight[kDecodeMaxTopK];
  const DecodeLayerPlan& plan = p.plan;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int K = p.top_k, H = p.hidden, I = p.inter;
  const int c1 = H / 64, c2 = I / 64;
  const int units_per_pair = I / 16;
  const int n13_sub = 2 * I / 16, n2_sub = H / 16;
  const int groups1 = H / p.group1, groups2 = I / p.group2;

  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + plan.bar_offset);  // GEMM1's units
  uint64_t* bar2 = bars + plan.max_units1;                                 // GEMM2's weights
  float* red1 = reinterpret_cast<float*>(smem + plan.red1_offset);  // [unit][gate 16, up 16]
  float* red2 = reinterpret_cast<float*>(smem + plan.red2_offset);  // [subtile][pair][16]
  T* xs = reinterpret_cast<T*>(smem + plan.x_offset);
  T* acts = reinterpret_cast<T*>(smem + plan.act_offset);
  unsigned char* slots1 = smem;                   // [unit][2][c1][512]
  unsigned char* slots2 = smem + plan.w2_offset;  // [subtile][pair][c2][512]

  const int cta = blockIdx.x;
  const int u1_begin = cta * plan.units1 / plan.ctas;
  const int n_units1 = (cta + 1) * plan.units1 / plan.ctas - u1_begin;
  const int pair1_begin = u1_begin / units_per_pair;
  const int u_begin = u1_begin - pair1_begin * units_per_pair;
  const int k1_begin = warp * c1 / kDecodeWarps;
  const int k1_count = (warp + 1) * c1 / kDecodeWarps - k1_begin;
  const int u2_begin = cta * plan.units2 / plan.ctas;
  const int n_units2 = (cta + 1) * plan.units2 / plan.ctas - u2_begin;
  const int cta_items2 = n_units2 * K * c2;
  const int i2_begin = warp * cta_items2 / kDecodeWarps;
  const int i2_count = (warp + 1) * cta_items2 / kDecodeWarps - i2_begin;

  if (threadIdx.x == 0) {  // one arrival per thread (CpAsyncArriveNoinc)
    for (int j = 0; j <= plan.max_units1; ++j) MbarrierInit(bars + j, blockDim.x);
  }
  for (int i = threadIdx.x; i < plan.max_units1 * 32 + plan.max_units2 * K * 16; i += blockDim.x) {
    red1[i] = 0.0f;  // red2 follows red1 directly (both f32, red1's size a multiple of 16 B)
  }

  // The token, its experts and weights come from earlier kernels (the routing launch, or XLA's).
  WaitForPriorGrids();
  if (threadIdx.x < K) {
    const int e = __ldg(p.pair_experts + threadIdx.x);
    pair_expert[threadIdx.x] = ExpertInRange(e, p.experts) ? e : -1;
    pair_weight[threadIdx.x] = __ldg(p.topk_weights + threadIdx.x);
  }
  __syncthreads();  // barriers initialized, sums zeroed, experts staged

  // Every weight byte of the CTA requested at once, 16 bytes per cp.async spread over all
  // threads; unit j's barrier (and GEMM2's) completes when every thread's copies up to it have
  // landed (cp.async.mbarrier.arrive.noinc, one per thread and barrier, also where a unit has
  // nothing to load).
  {
    const int subtile_pieces = c1 * 32;  // 16-byte pieces
    int pair = pair1_begin, u = u_begin;
    for (int j = 0; j < plan.max_units1; ++j) {
      const int e = j < n_units1 ? pair_expert[pair] : -1;
      if (e >= 0) {
        const uint4* gate = p.w13 + (static_cast<int64_t>(e) * n13_sub + u) * subtile_pieces;
        const uint4* up = gate + static_cast<int64_t>(units_per_pair) * subtile_pieces;
        uint4* dst = reinterpret_cast<uint4*>(slots1) + j * 2 * subtile_pieces;
        for (int q = threadIdx.x; q < 2 * subtile_pieces; q += blockDim.x) {
          CpAsyncStream16(dst + q, q < subtile_pieces ? gate + q : up + (q - subtile_pieces));
        }
      }
      CpAsyncArriveNoinc(bars + j);
      if (++u == units_per_pair) {
        u = 0;
        ++pair;
      }
    }
    const int run_pieces = c2 * 32;
    for (int j2 = 0; j2 < n_units2; ++j2) {
      for (int k = 0; k < K; ++k) {
        const int e = pair_expert[k];
        if (e < 0) continue;
        const uint4* src = p.w2 + (static_cast<int64_t>(e) * n2_sub + u2_begin + j2) * run_pieces;
        uint4* dst = reinterpret_cast<uint4*>(slots2) + (j2 * K + k) * run_pieces;
        for (int q = threadIdx.x; q < run_pieces; q += blockDim.x) CpAsyncStream16(dst + q, src + q);
      }
    }
    CpAsyncArriveNoinc(bar2);
    CpAsyncCommit();
  }

  // The token into shared memory (plain loads, after the weights' requests).
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) {
    reinterpret_cast<uint4*>(xs)[i] = __ldg(reinterpret_cast<const uint4*>(p.x) + i);
  }

  // GEMM1's scale (and zero-point) words of all this warp's units into L2 now, one lane each,
  // so that the loads before each unit's math find them there.
  {
    const int per_unit = 2 * k1_count * 4;  // (subtile, chunk, t)
    for (int i = lane; i < n_units1 * per_unit; i += 32) {
      const int j = i / per_unit, r = i - j * per_unit;
      const int unit = u1_begin + j, pair = unit / units_per_pair;
      const int e = pair_expert[pair];
      if (e < 0) continue;
      const int s = r / (4 * k1_count), c = (r >> 2) % k1_count, tt = r & 3;
      const int sub = unit - pair * units_per_pair + s * units_per_pair;
      const int grp = p.group1_div((k1_begin + c) * 64 + 16 * tt);
      PrefetchL2(WordsOf(p.s13, e, groups1, n13_sub).address(grp, sub, 0));
      if (p.z13) PrefetchL2(WordsOf(p.z13, e, groups1, n13_sub).address(grp, sub, 0));
    }
  }

  // GEMM2's scales (and zero points) into registers now: they do not depend on GEMM1.
  uint32_t scale2[kDecodeMaxItems2], zero2[kDecodeMaxItems2];
  {
    Items2Cursor it;
    if (i2_count > 0) it.Start(i2_begin, c2, K);
#pragma unroll
    for (int i = 0; i < kDecodeMaxItems2; ++i) {
      scale2[i] = 0;
      zero2[i] = HalfType<T>::kMagicPlus8;
      if (i < i2_count) {
        const int e = pair_expert[it.pair];
        if (e >= 0) {
          const int sub = u2_begin + it.j2, grp = p.group2_div(it.c * 64 + 16 * t);
          scale2[i] = WordsOf(p.s2, e, groups2, n2_sub).at(grp, sub, g);
          if (p.z2) zero2[i] = MagicPlusZero<T>(WordsOf(p.z2, e, groups2, n2_sub).at(grp, sub, g));
        }
        it.Next(c2, K);
      }
    }
  }

  __syncthreads();  // the token in shared memory
  if (p.stop_after == 1) {
    for (int j = 0; j <= plan.max_units1; ++j) MbarrierWait(bars + j, 0);  // (all arrive)
    if (scale2[0] == 0x7fffffffu) StoreHalf<T>(p.out, 0, 0.0f);  // keeps the loads
    return;
  }

  // GEMM1: this warp's slice of each unit, as its bytes land.
  {
    int pair = pair1_begin, u = u_begin;
    for (int j = 0; j < n_units1; ++j) {
      const int e = pair_expert[pair];
      if (e >= 0 && k1_count > 0) {
        const GroupWords sw = WordsOf(p.s13, e, groups1, n13_sub);
        const GroupWords zw = WordsOf(p.z13, e, groups1, n13_sub);
        uint32_t scale[2][kDecodeMaxSlice1], zero[2][kDecodeMaxSlice1];
#pragma unroll
        for (int c = 0; c < kDecodeMaxSlice1; ++c) {
          const int grp = p.group1_div((k1_begin + c) * 64 + 16 * t);
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            scale[s][c] = 0;
            zero[s][c] = HalfType<T>::kMagicPlus8;
            if (c < k1_count) {
              const int sub = u + s * units_per_pair;
              scale[s][c] = sw.at(grp, sub, g);
              if (p.z13) zero[s][c] = MagicPlusZero<T>(zw.at(grp, sub, g));
            }
          }
        }
        MbarrierWait(bars + j, 0);
        float acc[2][1][4] = {};
        const uint32_t base =
            SharedAddress(slots1 + (j * 2 * c1 + k1_begin) * kDecodeChunkBytes) + lane * 16;
#pragma unroll
        for (int c = 0; c < kDecodeMaxSlice1; ++c) {
          if (c < k1_count) {
            const uint4 w[2] = {LdShared128(base + c * kDecodeChunkBytes),
                                LdShared128(base + (c1 + c) * kDecodeChunkBytes)};
            uint4 xv[1][2];
            TokenChunk<T>(xs + (k1_begin + c) * 64, g, t, xv);
            const uint32_t sc[2] = {scale[0][c], scale[1][c]};
            const uint32_t zm[2] = {zero[0][c], zero[1][c]};
            MmaChunk<T, kCode, 2, 1>(w, xv, sc, zm, acc);
          }
        }
        if (t == 0) {  // token column 0: c[0] row g, c[2] row g + 8
          atomicAdd(red1 + j * 32 + g, acc[0][0][0]);
          atomicAdd(red1 + j * 32 + g + 8, acc[0][0][2]);
          atomicAdd(red1 + j * 32 + 16 + g, acc[1][0][0]);
          atomicAdd(red1 + j * 32 + 24 + g, acc[1][0][2]);
        }
      }
      if (++u == units_per_pair) {
        u = 0;
        ++pair;
      }
    }
  }
  __syncthreads();
  if (p.stop_after == 2) return;

  // Activation of the CTA's units -> act (global: other CTAs' GEMM2 reads it).
  for (int r = threadIdx.x; r < n_units1 * 16; r += blockDim.x) {
    const int j = r >> 4, row = r & 15;
    const int unit = u1_begin + j, pair = unit / units_per_pair;
    const int e = pair_expert[pair];
    if (e < 0) continue;
    const int n = (unit - pair * units_per_pair) * 16 + row;
    const float2 bias = GateUpBias(p.b13, e, I, n);
    const float a = RoundedActivation<T>(p.activation, red1[j * 32 + row] + bias.x,
                                         red1[j * 32 + 16 + row] + bias.y);
    StoreHalf<T>(p.act, static_cast<int64_t>(pair) * I + n, a);
  }

  cooperative_groups::this_grid().sync();  // every pair's activation is in act
  if (p.stop_after == 3) return;

  // act -> shared (from L2: written by other SMs in this kernel, never cached in this L1).
  for (int i = threadIdx.x; i < K * I / 8; i += blockDim.x) {
    CpAsyncStream16(acts + 8 * i, static_cast<const T*>(p.act) + 8 * i);
  }
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();

  // GEMM2: this warp's items; consecutive items of one (subtile, pair) share an accumulator.
  if (i2_count > 0) MbarrierWait(bar2, 0);
  {
    float acc[1][1][4] = {};
    Items2Cursor it;
    if (i2_count > 0) it.Start(i2_begin, c2, K);
    int current = -1;
#pragma unroll
    for (int i = 0; i < kDecodeMaxItems2; ++i) {
      if (i < i2_count) {
        const int key = it.j2 * K + it.pair;
        if (key != current) {
          if (current >= 0 && t == 0) {
            atomicAdd(red2 + current * 16 + g, acc[0][0][0]);
            atomicAdd(red2 + current * 16 + g + 8, acc[0][0][2]);
          }
          current = key;
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[0][0][q] = 0.0f;
        }
        if (pair_expert[it.pair] >= 0) {
          const uint4 w[1] = {
              LdShared128(SharedAddress(slots2 + (i2_begin + i) * kDecodeChunkBytes) + lane * 16)};
          uint4 xv[1][2];
          TokenChunk<T>(acts + it.pair * I + it.c * 64, g, t, xv);
          const uint32_t sc[1] = {scale2[i]};
          const uint32_t zm[1] = {zero2[i]};
          MmaChunk<T, kCode, 1, 1>(w, xv, sc, zm, acc);
        }
        it.Next(c2, K);
      }
    }
    if (current >= 0 && t == 0) {
      atomicAdd(red2 + current * 16 + g, acc[0][0][0]);
      atomicAdd(red2 + current * 16 + g + 8, acc[0][0][2]);
    }
  }
  __syncthreads();

  // out[h] = round(sum_k round((y_k + b2) * w_k)) over the pairs in range, in slot order.
  for (int r = threadIdx.x; r < n_units2 * 16; r += blockDim.x) {
    const int j2 = r >> 4, row = r & 15;
    const int h = (u2_begin + j2) * 16 + row;
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) {
      const int e = pair_expert[k];
      if (e < 0) continue;
      float v = red2[(j2 * K + k) * 16 + row];
      if (p.b2) v += __ldg(p.b2 + static_cast<int64_t>(e) * H + h);
      sum += RoundTo<T>(v * pair_weight[k]);
    }
    StoreHalf<T>(p.out, h, sum);
  }
}

// Per-device figures are queried once per device (device_cache.cuh: a handler runs on every
// call, often between the GPU's kernels, so a few us of host work per call would show at decode).
// Plans the call for the current device (one CTA per SM) and launches the fused decode kernel:
// cooperative (all CTAs resident for the grid barrier; the launch fails rather than deadlocks
// when they cannot be) and after the prior kernel with the dependent launch. args.plan is
// filled here. __launch_bounds__(512, 1) keeps the registers within one CTA per SM; the plan
// checks the shared memory.
template <typename T, NibbleCode kCode>
std::string LaunchDecodeLayer(const DecodeLayerArgs& args, cudaStream_t stream) {
  const int device = CurrentDevice();
  DeviceFigures info;
  if (device < 0 || DeviceFiguresOf(device, &info) != cudaSuccess) {
    return "fused decode: cannot query the current device";
  }
  DecodeLayerArgs launch_args = args;
  launch_args.plan = PlanDecodeLayer(info.sms, args.top_k, args.hidden, args.inter);
  if (std::string err = DecodeLayerPlanError(launch_args.plan, info.max_smem_optin);
      !err.empty()) {
    return err;
  }
  launch_args.stop_after = DecodeStopAfter();
  const auto kernel = DecodeLayerKernel<T, kCode>;
  const int smem = launch_args.plan.smem_bytes;
  // The shared-memory opt-in, raised per device as plans need more (once per shape in
  // practice), under a lock: two threads raising it at once cannot leave it at the smaller.
  static SmemOptInTable opted_in;
  if (const cudaError_t e = EnsureDynamicSmem(opted_in, kernel, smem); e != cudaSuccess) {
    return std::string("fused decode: shared memory attribute: ") + cudaGetErrorString(e);
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(launch_args.plan.ctas);
  config.blockDim = dim3(kDecodeWarps * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeCooperative;
  attributes[0].val.cooperative = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = DependentLaunchEnabled() ? 1 : 0;
  config.attrs = attributes;
  config.numAttrs = 2;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, launch_args);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("fused decode kernel: ") + cudaGetErrorString(err);
  }
  return "";
}

}  // namespace jax_moeq::cuda
