// Grouped int4-weight GEMM over expert blocks of tokens (the core of the GPU
// fused MoE), plus the token-to-expert alignment it consumes. Templated on
// the activation type and the nibble code so WNA16 (uint4b8) and MxInt4
// (signed int4, bf16 scales per 32) share it. No XLA types.
//
// Work decomposition: blockIdx.x = expert block of block_m rows (of the
// sorted, per-expert padded row list), blockIdx.y = blockDim.x / 32 warps x "units" along
// N, blockIdx.z = split of K. A unit is two 16-row weight subtiles, sub0 =
// unit * unit_mult and sub1 = sub0 + sub_stride (GEMM1: gate row n and up
// row I + n, so the activation can be applied in registers).
#pragma once

#include <algorithm>
#include <type_traits>

#include "cuda/device_cache.cuh"
#include "cuda/int4_mma_core.cuh"
#include "cuda/workspace_zero.cuh"

namespace jax_moeq::cuda {

enum class EpilogueKind {
  kF32Store,     // acc -> ws[id][n] (atomicAdd when split > 1)
  kActivation,   // GEMM1, split == 1: bias, round, activation, round -> act[id][col]
  kRoundedStore  // round((acc + bias) * topk_weights[id]) -> rounded[id][n] as T (bias and
                 // weights optional): the wgmma GEMM2 (FinalizeRoundedRowsKernel finishes), and
                 // the dense linear on either GEMM (split == 1)
};

// How the GEMM's main loop feeds the tensor cores:
//  kRegisters: each warp loads a stage of ChunksPerStage<MT>() chunks into registers, then
//              computes it (no loads in flight while it computes).
//  kAsyncRing: each thread copies its own weight, activation and scale pieces AsyncDepth<MT>()
//              - 1 chunks ahead into private shared-memory slots with cp.async, so loads stay in
//              flight during the math and no registers hold them (block_m 8, 16 and 32).
//  kBulkCopy: lane 0 of each warp streams the warp's weights into a private ring of shared-memory
//              slots with bulk copies (kBulkSlots slots of two chunks per subtile, mbarrier per
//              slot); activations and scales come through L1 into registers (block_m 8 and 16).
// kWgmma: the wgmma GEMM (moe_int4_wgmma.cuh) with a token tile of block_m (32, 64 or 128).
// kWgmmaWs: the same GEMM as a persistent kernel whose producer warpgroup fills the stage ring
//           for two MMA warpgroups (moe_int4_wgmma_ws.cuh).
enum class GemmMainloop : int {
  kRegisters = 0, kAsyncRing = 1, kBulkCopy = 2, kWgmma = 3, kWgmmaWs = 4,
  // Not a GEMM main loop: a one-token call's two streaming kernels (moe_int4_one_token.cuh).
  kOneTokenStream = 5
};

struct MoeGemmArgs {
  const void* x = nullptr;       // rows of T, row stride ld_x (elements)
  int64_t ld_x = 0;
  int in_div = 1;                // input row = id / in_div
  const int32_t* sorted_ids = nullptr;
  const int32_t* expert_ids = nullptr;
  const int32_t* num_post_padded = nullptr;
  int num_rows = 0;              // ids >= num_rows are padding
  int block_m = 8;
  const uint4* w = nullptr;      // [E][N/16][K/64][32]
  const uint32_t* scales = nullptr;  // [E][G][N/16][8]
  const uint32_t* zeros = nullptr;   // same layout, or null: zero point 8
  int n = 0, k = 0, groups = 1;
  FastDiv per_group;             // element index -> group (divides by k / groups; the launcher sets it)
  int units = 0, unit_mult = 1, sub_stride = 1;
  int splits = 1, chunks_per_split = 0;
  EpilogueKind epilogue = EpilogueKind::kF32Store;
  float* ws = nullptr;           // [rows][n] f32
  void* rounded = nullptr;       // [rows][n] T (kRoundedStore)
  void* act = nullptr;           // [rows][n/2] T (kActivation)
  const int32_t* act_col = nullptr;  // [E][n/2]: output column of act (act-order), or null
  const float* bias = nullptr;   // [E][n] or null
  int activation = 0;
  GemmMainloop mainloop = GemmMainloop::kRegisters;

  // Decode without alignment (DecodesWithoutAlignment): block b computes pair b alone, its
  // expert pair_experts[b] (out of [0, experts): the block computes nothing). sorted_ids,
  // expert_ids and num_post_padded are then unused; the grid has one block per pair.
  const int32_t* pair_experts = nullptr;
  int experts = 0;
  // GEMM1 of such a call clears GEMM2's accumulators and arrival counters (clear_count floats).
  float* clear = nullptr;
  int64_t clear_count = 0;
  // GEMM2 of such a call finalizes in its epilogue: the warp that completes a unit's 32 columns
  // last (every block and split has added into ws) writes out[t][n] = round(sum_k
  // round((ws[t*K+k][n] + out_bias[e][n]) * topk_weights[t*K+k])) for them.
  int32_t* arrivals = nullptr;   // [units], zero at launch
  const float* topk_weights = nullptr;  // [rows] (also kRoundedStore's weights, or null)
  const float* out_bias = nullptr;  // [E][n] or null
  void* out = nullptr;           // [rows / top_k][n] T
  int top_k = 1;
  // GEMM1 of such a call when split (kF32Store, atomics into ws): the warp that completes a
  // pair's unit last (every split has added) applies bias and activation to its 16 columns and
  // stores them to act, as the GEMM1 finalize kernel does. No finalize launch.
  int32_t* act_arrivals = nullptr;  // [rows][units], zero at launch (as ws)
  // Launch after the previous kernel with the dependent launch (LaunchAfterPrior); false after a
  // memset, where the programmatic edge would have no kernel to follow.
  bool dependent_launch = true;
  // Dense problem (a linear layer, wna16_linear.cu): every row belongs to expert 0 and expert
  // block b holds rows b * block_m + slot, so no alignment runs; sorted_ids, expert_ids and
  // num_post_padded are unused. With arrivals, the last warp of a unit writes out[t][n] =
  // round(ws[t][n] + out_bias[n]) for every row t.
  bool dense_rows = false;
};

// Whether a call takes the decode path without alignment: one token (its K pairs have distinct
// experts from a top-k, so a block per pair reads each expert's weights once), standard format,
// no act-order (its permuted rows come from the alignment's order) and block_m 8. Saves the
// alignment launch, the finalize launch (GEMM2 finalizes) and, when GEMM1 splits K, the GEMM1
// finalize launch (GEMM1's last split per unit applies the activation). GEMM1 clears GEMM2's
// workspace; a split GEMM1's own (accumulators and counters) is zeroed by a memset before it.
inline bool DecodesWithoutAlignment(bool standard, bool act_order, int64_t tokens, int block_m) {
  return standard && !act_order && tokens == 1 && block_m == 8;
}
// Largest hidden or intermediate size the launchers take: checked before any product of sizes
// (the row limit, MoeRowsFitInt32, then bounds rows x size).
constexpr int64_t kMaxMoeFeatures = int64_t{1} << 24;
// Largest split-K factor (grid.z of the GEMM holds at most 65535).
constexpr int kMaxSplitK = 1024;
// Whether a call's per-pair rows, each of `width` elements (max(H, 2I)), are addressable with
// 32-bit row ids and 32-bit element offsets within a row block: rows * width < 2^31.
inline bool MoeRowsFitInt32(int64_t rows, int64_t width) {
  return rows < (int64_t{1} << 31) / std::max<int64_t>(1, width);
}
// Whether one expert's scale (or zero-point) words, groups x n / 2 for a GEMM of n outputs, are
// addressable with the kernels' 32-bit offsets within an expert (group * n_sub * 8 + ...).
inline bool ScaleWordsFitInt32(int64_t groups, int64_t n) {
  return groups * (n / 2) < (int64_t{1} << 31);
}
// Floats of GEMM2's workspace: rows x n accumulators, then one arrival counter per 32 columns.
inline int64_t Gemm2WorkspaceFloats(int64_t rows, int64_t n) { return rows * n + n / 32; }
// Floats of GEMM1's split-K workspace (n = 2I columns): rows x n accumulators, then, on the
// one-token path, one arrival counter per pair and unit of 16 activation columns; 0 unsplit.
inline int64_t Gemm1WorkspaceFloats(int64_t rows, int64_t n, int split13, bool one_token) {
  if (split13 <= 1) return 0;
  return rows * n + (one_token ? rows * (n / 32) : 0);
}

// GEMM2's arguments from GEMM1's (same rows, alignment, block_m, main loop, one-token pairs):
// input GEMM1's act [rows][k], f32 rows [rows][n] into ws; GEMM1's epilogue fields cleared.
inline MoeGemmArgs Gemm2ArgsAfter(const MoeGemmArgs& g1, const uint4* w, const uint32_t* scales,
                                  const uint32_t* zeros, int n, int k, int groups, int splits,
                                  float* ws) {
  MoeGemmArgs g2 = g1;
  g2.x = g1.act;
  g2.ld_x = k;
  g2.in_div = 1;
  g2.w = w;
  g2.scales = scales;
  g2.zeros = zeros;
  g2.n = n;
  g2.k = k;
  g2.groups = groups;
  g2.units = n / 32;
  g2.unit_mult = 2;
  g2.sub_stride = 1;
  g2.splits = splits;
  g2.chunks_per_split = (k / 64 + splits - 1) / splits;
  g2.epilogue = EpilogueKind::kF32Store;
  g2.ws = ws;
  g2.act_col = nullptr;
  g2.bias = nullptr;
  g2.clear = nullptr;
  g2.clear_count = 0;
  g2.act_arrivals = nullptr;
  g2.dependent_launch = true;
  return g2;
}

// GEMM2 on the wgmma GEMM (no split-K): rows of T into `rows` (the f32 workspace, half used),
// with `bias` ([E][n] or null) and `topk_weights` ([rows] or null) applied and rounded as the
// finalize would (kRoundedStore); FinalizeRoundedRowsKernel or a batched copy finishes.
inline void SetRoundedGemm2(MoeGemmArgs& g2, float* rows, const float* bias,
                            const float* topk_weights) {
  g2.epilogue = EpilogueKind::kRoundedStore;
  g2.ws = nullptr;
  g2.rounded = rows;
  g2.bias = bias;
  g2.topk_weights = topk_weights;
}

// The one-token path's part of GEMM1's arguments: block b computes pair b of `pair_experts` and
// the kernel clears GEMM2's workspace `ws2` (rows x n2 accumulators and the counters after them).
// When GEMM1 splits K (g1.ws and g1.n set), it counts arrivals after ws's rows x n accumulators;
// that workspace must be zero when it starts: `zeroed_by_prior_kernel` says the call's previous
// kernel zeroes it (MxInt4's routing), else ClearOneTokenGemm1Workspace's memset does.
inline void SetOneTokenGemm1(MoeGemmArgs& g1, const int32_t* pair_experts, int experts,
                             float* ws2, int64_t rows, int64_t n2, bool zeroed_by_prior_kernel) {
  g1.pair_experts = pair_experts;
  g1.experts = experts;
  g1.clear = ws2;
  g1.clear_count = Gemm2WorkspaceFloats(rows, n2);
  if (g1.splits > 1) {
    g1.act_arrivals = reinterpret_cast<int32_t*>(g1.ws + rows * g1.n);
    // After a memset the programmatic edge would have no kernel to follow.
    g1.dependent_launch = zeroed_by_prior_kernel;
  }
}
// Zeroes a split one-token GEMM1's workspace with a memset before it runs (where no earlier
// kernel of the call does).
inline cudaError_t ClearOneTokenGemm1Workspace(const MoeGemmArgs& g1, int64_t rows,
                                               cudaStream_t stream) {
  if (!g1.act_arrivals) return cudaSuccess;
  const int64_t floats = Gemm1WorkspaceFloats(rows, g1.n, g1.splits, true);
  return cudaMemsetAsync(g1.ws, 0, static_cast<size_t>(floats) * sizeof(float), stream);
}
// ... and of GEMM2's (g2.ws, g2.n and g2.pair_experts set): it finalizes into `out`, counting
// arrivals in the counters after ws's rows x n accumulators.
inline void SetOneTokenGemm2(MoeGemmArgs& g2, int64_t rows, const float* topk_weights,
                             const float* out_bias, void* out, int top_k) {
  g2.arrivals = reinterpret_cast<int32_t*>(g2.ws + rows * g2.n);
  g2.topk_weights = topk_weights;
  g2.out_bias = out_bias;
  g2.out = out;
  g2.top_k = top_k;
}

// e^x and 1/x from the hardware's approximate exp2 and reciprocal (flushing subnormals): within a
// few f32 ulps of expf and IEEE division, far below the rounding to T that follows, at a fifth
// of the instructions (the IEEE forms made the wgmma GEMM1 epilogue ~60 instructions per
// element, with the tensor cores idle). 1/inf = 0 keeps g * sigmoid(g) -> 0 for g -> -inf.
__device__ __forceinline__ float FastExp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
__device__ __forceinline__ float FastRcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float ApplyActivation(int kind, float gate, float up) {
  if (kind == 1) {  // swigluoai (GPT-OSS)
    const float g = fminf(gate, 7.0f);
    const float u = fminf(fmaxf(up, -7.0f), 7.0f);
    return (u + 1.0f) * g * FastRcp(1.0f + FastExp(-1.702f * g));
  }
  return gate * FastRcp(1.0f + FastExp(-gate)) * up;  // silu(g) * u (kinds 0 and 2)
}

// An activation output as the reference rounds it: gate and up (bias included) rounded to T,
// the activation, rounded again.
template <typename T>
__device__ __forceinline__ float RoundedActivation(int kind, float gate, float up) {
  return RoundTo<T>(ApplyActivation(kind, RoundTo<T>(gate), RoundTo<T>(up)));
}

// Bias of gate row n and of its up row I + n, for biases laid out [E][2I] (0 without a bias).
__device__ __forceinline__ float2 GateUpBias(const float* bias, int expert, int inter, int n) {
  if (!bias) return make_float2(0.0f, 0.0f);
  const float* b = bias + static_cast<int64_t>(expert) * 2 * inter;
  return make_float2(b[n], b[inter + n]);
}

template <typename T>
__device__ __forceinline__ void StoreHalf(void* base, int64_t index, float v) {
  reinterpret_cast<T*>(base)[index] = HalfType<T>::from_float(v);
}

// Physical input of logical position l (0..63) of a chunk, and its inverse: the order in which
// the wgmma GEMM (moe_int4_wgmma.cuh) reads its inputs.
__host__ __device__ constexpr int PhysicalOfLogical(int l) {
  return 16 * ((l >> 1) & 3) + 4 * (l >> 4) + 2 * ((l >> 3) & 1) + (l & 1);
}
__host__ __device__ constexpr int LogicalOfPhysical(int p) {
  return 16 * ((p >> 2) & 3) + 2 * (p >> 4) + 8 * ((p >> 1) & 1) + (p & 1);
}
static_assert(LogicalOfPhysical(PhysicalOfLogical(37)) == 37 &&
                  LogicalOfPhysical(PhysicalOfLogical(10)) == 10,
              "chunk permutation and its inverse");
// Column of the logical-order layout that holds physical column `col` (any chunk).
__host__ __device__ constexpr int LogicalColumn(int col) {
  return (col & ~63) | LogicalOfPhysical(col & 63);
}

// GEMM1's activation epilogue (kActivation) for gate row n of `expert` and pair row `id`: bias,
// the activation at the reference's rounding points, stored at act[id][column], the column being
// act_col[e][n] under act-order, else n; in logical chunk order when the next GEMM is the wgmma
// one (kLogicalColumns).
template <typename T, bool kLogicalColumns>
__device__ __forceinline__ void StoreActivation(const MoeGemmArgs& p, int expert, int n, int id,
                                                float gate, float up) {
  const int half_n = p.n / 2;
  const float2 bias = GateUpBias(p.bias, expert, half_n, n);
  const float a = RoundedActivation<T>(p.activation, gate + bias.x, up + bias.y);
  int col = p.act_col ? __ldg(p.act_col + static_cast<int64_t>(expert) * half_n + n) : n;
  if constexpr (kLogicalColumns) col = LogicalColumn(col);
  StoreHalf<T>(p.act, static_cast<int64_t>(id) * half_n + col, a);
}

constexpr int kMaxGemmThreads = 256;

// Chunks per pipeline stage: more in flight when few token tiles.
template <int MT>
__host__ __device__ constexpr int ChunksPerStage() {
  return MT == 1 ? 4 : (MT == 2 ? 2 : 1);  // MT 4 and 8: one chunk, registers are full
}

// kAsyncRing: chunks in flight per thread and the shared memory that takes.
template <int MT>
__host__ __device__ constexpr int AsyncDepth() {
  return MT == 1 ? 5 : (MT == 2 ? 4 : 2);  // block_m 32: double buffering, one chunk ahead
}
template <int MT>
__host__ __device__ constexpr int AsyncVecsPerChunk() {
  return 2 + 2 * MT;  // two weight subtiles, then two 16-byte activation halves per token tile
}
constexpr int kAsyncWordsPerChunk = 4;  // scale of each subtile, then zero point of each
template <int MT>
__host__ __device__ constexpr int AsyncSmemBytes(int threads) {
  // block_m 8: 100 KB, 16: 112 KB, 32: 88 KB per 256-thread CTA; two CTAs fit an SM (228 KB).
  return threads * AsyncDepth<MT>() * (AsyncVecsPerChunk<MT>() * 16 + kAsyncWordsPerChunk * 4);
}

// kBulkCopy: slots per warp and chunks per slot; per 256-thread CTA 8 * 6 * 2 KB = 96 KB, so two
// CTAs share an SM with up to 10 KB in flight per warp.
constexpr int kBulkSlots = 6;
constexpr int kBulkSlotChunks = 2;
__host__ __device__ constexpr int BulkSmemBytes(int threads) {
  return (threads / 32) * kBulkSlots * 2 * kBulkSlotChunks * 512;
}

// magic + zero point of one subtile's group, both halves (rows g and g + 8), from the group's
// zero-point pair; without zero points the kernels use HalfType<T>::kMagicPlus8 (uint4b8, and
// signed nibbles after their XOR).
template <typename T>
__device__ __forceinline__ uint32_t MagicPlusZero(uint32_t zero_pair) {
  using T2 = typename HalfType<T>::T2;
  return AsBits(__hadd2(AsHalf2<T2>(zero_pair), AsHalf2<T2>(HalfType<T>::kMagic)));
}

// Expert of expert block `blk`, or -1 when the block has no work: past the padded end, all
// padding, or (decode without alignment) a pair whose expert is out of range.
__device__ __forceinline__ int BlockExpert(const MoeGemmArgs& p, int blk, int block_m) {
  if (p.dense_rows) return blk * block_m < p.num_rows ? 0 : -1;
  if (p.pair_experts) {
    if (blk >= p.num_rows) return -1;
    const int e = __ldg(p.pair_experts + blk);
    return e >= 0 && e < p.experts ? e : -1;
  }
  // Three independent loads, in bounds for every block of the grid (sorted_ids holds max_blocks *
  // block_m ids, expert_ids max_blocks): issued together they cost one latency instead of three
  // in a row, at the head of every CTA's critical path (before its first weight load).
  const int padded = __ldg(p.num_post_padded);
  const int first = __ldg(p.sorted_ids + blk * block_m);
  const int expert = __ldg(p.expert_ids + blk);
  if (blk * block_m >= padded || first >= p.num_rows) return -1;
  return expert;
}

// Pair row of slot `slot` of expert block `blk` (>= num_rows: padding).
__device__ __forceinline__ int BlockRow(const MoeGemmArgs& p, int blk, int block_m, int slot) {
  if (p.dense_rows) return blk * block_m + slot;
  if (p.pair_experts) return slot == 0 ? blk : p.num_rows;
  return __ldg(p.sorted_ids + blk * block_m + slot);
}

// Zeroes dst[0, count) with every thread of the grid.
__device__ __forceinline__ void ClearWithGrid(float* dst, int64_t count) {
  const int64_t ctas = static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z;
  const int64_t cta = blockIdx.x + static_cast<int64_t>(gridDim.x) *
                                       (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
  for (int64_t i = cta * blockDim.x + threadIdx.x; i < count; i += ctas * blockDim.x) {
    dst[i] = 0.0f;
  }
}

// The standard format's last step for token t and column `col` of n: out[t][col] =
// round(sum_k round((ws[t*K+k][col] + bias[e][col]) * topk_weights[t*K+k])) over the token's
// pairs whose expert e is in [0, experts) (f32 sum in slot order, bias optional; 0 without any),
// rounding as the reference does. Used by the finalize kernels and GEMM2's fused finalize; ws is
// read from L2 (in the fused case other CTAs of the same kernel added into it).
template <typename T, int kCols = 1>
__device__ __forceinline__ void FinalizeTokenColumn(const float* ws, const int32_t* pair_experts,
                                                    int experts, const float* topk_weights,
                                                    const float* bias, int top_k, int n, int t,
                                                    int col, void* out) {
  // Eight pairs' loads are issued before any is used: two memory latencies per eight pairs (ids,
  // then weights and ws rows), not one per pair (a loop of dependent loads made this reduction
  // ~7 us at Qwen3 T=16). A pair whose expert is outside [0, experts) has no ws row written (no
  // GEMM ran for it), so its row is not read. The sum keeps the order of k. kCols = 4: columns
  // col..col + 3 with 16-byte loads (col % 4 == 0, n % 4 == 0), the bytes in flight that a token
  // of few pairs needs to stream ws at large T.
  static_assert(kCols == 1 || kCols == 4, "one or four columns");
  constexpr int kBatch = 8;
  float sum[kCols] = {};
  for (int k0 = 0; k0 < top_k; k0 += kBatch) {
    int e[kBatch];
    float y[kBatch][kCols], w[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      e[j] = k0 + j < top_k ? __ldg(pair_experts + t * top_k + k0 + j) : -1;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int pair = t * top_k + k0 + j;
      const bool in = e[j] >= 0 && e[j] < experts;
      w[j] = in ? __ldg(topk_weights + pair) : 0.0f;
      const float* row = ws + static_cast<int64_t>(pair) * n + col;
      if constexpr (kCols == 4) {
        const float4 v = in ? __ldcg(reinterpret_cast<const float4*>(row)) : float4{};
        y[j][0] = v.x;
        y[j][1] = v.y;
        y[j][2] = v.z;
        y[j][3] = v.w;
      } else {
        y[j][0] = in ? __ldcg(row) : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (e[j] < 0 || e[j] >= experts) continue;
      float b[kCols] = {};
      if (bias) {
        const float* brow = bias + static_cast<int64_t>(e[j]) * n + col;
        if constexpr (kCols == 4) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(brow));
          b[0] = v.x;
          b[1] = v.y;
          b[2] = v.z;
          b[3] = v.w;
        } else {
          b[0] = __ldg(brow);
        }
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        float v = y[j][c];
        if (bias) v += b[c];
        sum[c] += RoundTo<T>(v * w[j]);
      }
    }
  }
  const int64_t at = static_cast<int64_t>(t) * n + col;
  if constexpr (kCols == 4) {
    alignas(8) T h[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) h[c] = HalfType<T>::from_float(sum[c]);
    *reinterpret_cast<uint2*>(reinterpret_cast<T*>(out) + at) = *reinterpret_cast<const uint2*>(h);
  } else {
    StoreHalf<T>(out, at, sum[0]);
  }
}

// Pairs k0 .. k0 + 7 of token t (those past top_k are out): whether each pair's expert lies in
// [0, experts) and, for those, columns col .. col + 7 of its row of T (bf16, fp16 or f32) widened
// to f32. One 16-byte load a pair (two for f32), all eight pairs' issued before any is used, so a
// token of few pairs still has bytes in flight. Shared by the finalize kernels that read rows of
// T (here and W4A8's).
template <typename T>
__device__ __forceinline__ void LoadPairRows8(const T* rows, const int32_t* pair_experts,
                                              int experts, int top_k, int n, int t, int k0,
                                              int col, bool (&in)[8], float (&y)[8][8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int e = k0 + j < top_k ? __ldg(pair_experts + t * top_k + k0 + j) : -1;
    in[j] = e >= 0 && e < experts;
  }
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t at = static_cast<int64_t>(t * top_k + k0 + j) * n + col;
      const float4* src = reinterpret_cast<const float4*>(rows + at);
      const float4 lo = in[j] ? __ldcg(src) : float4{};
      const float4 hi = in[j] ? __ldcg(src + 1) : float4{};
      const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int c = 0; c < 8; ++c) y[j][c] = v[c];
    }
  } else {
    uint4 raw[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t at = static_cast<int64_t>(t * top_k + k0 + j) * n + col;
      raw[j] = in[j] ? __ldcg(reinterpret_cast<const uint4*>(rows + at)) : uint4{};
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const T* h = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
      for (int c = 0; c < 8; ++c) y[j][c] = HalfType<T>::to_float(h[c]);
    }
  }
}

// The standard format's last step after the wgmma GEMM2 (kRoundedStore), whose rows already hold
// round((acc + bias[e]) * topk_weights[t*K+k]) as T: out[t][col..col+7] = round(sum_k rows[t*K+k])
// (f32 sum in slot order) over the pairs whose expert is in [0, experts). The same result as
// FinalizeTokenColumn over f32 rows, from half the bytes. 8 columns a thread as one 16-byte load
// per pair (n % 8 == 0); grid (tokens, n / 8 / blockDim.x rounded up).
template <typename T>
__global__ void FinalizeRoundedRowsKernel(const T* rows, const int32_t* pair_experts, int experts,
                                          int top_k, int n, int tokens, void* out) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int t = blockIdx.x;
  const int col = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
  if (t >= tokens || col >= n) return;
  float sum[8] = {};
  for (int k0 = 0; k0 < top_k; k0 += 8) {
    bool in[8];
    float y[8][8];
    LoadPairRows8<T>(rows, pair_experts, experts, top_k, n, t, k0, col, in, y);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (!in[j]) continue;
#pragma unroll
      for (int c = 0; c < 8; ++c) sum[c] += y[j][c];
    }
  }
  alignas(16) T h[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) h[c] = HalfType<T>::from_float(sum[c]);
  *reinterpret_cast<uint4*>(reinterpret_cast<T*>(out) + static_cast<int64_t>(t) * n + col) =
      *reinterpret_cast<const uint4*>(h);
}

// The standard format's finalize after SetRoundedGemm2's GEMM2 (n % 8 == 0).
template <typename T>
void LaunchRoundedFinalize(const float* rows, const int32_t* pair_experts, int experts, int top_k,
                           int n, int tokens, void* out, cudaStream_t stream) {
  constexpr int kThreads = 128;
  const dim3 grid(tokens, (n / 8 + kThreads - 1) / kThreads);
  LaunchAfterPrior(FinalizeRoundedRowsKernel<T>, grid, dim3(kThreads), 0, stream,
                   reinterpret_cast<const T*>(rows), pair_experts, experts, top_k, n, tokens, out);
}

// GEMM1's fused activation on the one-token path when split (MoeGemmArgs::act_arrivals): this
// warp has added its split of pair `pair`'s unit `unit` (gate rows 16 unit + [0, 16) and their up
// rows) into ws; the warp that arrives last for them finishes the 16 activation columns.
template <typename T>
__device__ __forceinline__ void ArriveAndActivate(const MoeGemmArgs& p, int pair, int unit,
                                                  int lane, int expert) {
  __threadfence();  // this lane's adds are visible before its warp's arrival
  __syncwarp();
  int ticket = 0;
  if (lane == 0) ticket = atomicAdd(p.act_arrivals + static_cast<int64_t>(pair) * p.units + unit, 1);
  ticket = __shfl_sync(0xffffffffu, ticket, 0);
  if (ticket != static_cast<int>(gridDim.z) - 1) return;
  __threadfence();  // and the other splits' adds before the reads (from L2)
  if (lane >= 16) return;
  const int n = unit * 16 + lane;
  const float* row = p.ws + static_cast<int64_t>(pair) * p.n;
  StoreActivation<T, false>(p, expert, n, pair, __ldcg(row + n), __ldcg(row + p.n / 2 + n));
}

// GEMM2's fused finalize (MoeGemmArgs::arrivals): this warp has added its part of unit `unit`
// into ws; the warp that arrives last for the unit (one arrival per block and split) reduces its
// 32 columns over each token's pairs, as FinalizeStandardKernel does.
template <typename T>
__device__ __forceinline__ void ArriveAndFinalize(const MoeGemmArgs& p, int unit, int lane) {
  __threadfence();  // this lane's adds are visible before its warp's arrival
  __syncwarp();
  int ticket = 0;
  if (lane == 0) ticket = atomicAdd(p.arrivals + unit, 1);
  ticket = __shfl_sync(0xffffffffu, ticket, 0);
  if (ticket != static_cast<int>(gridDim.x * gridDim.z) - 1) return;
  __threadfence();  // and the others' adds before the reads (from L2)
  if (p.dense_rows) {
    const int col = unit * 32 + lane;
    const float bias = p.out_bias ? __ldg(p.out_bias + col) : 0.0f;
    for (int t = 0; t < p.num_rows; ++t) {
      const int64_t at = static_cast<int64_t>(t) * p.n + col;
      StoreHalf<T>(p.out, at, __ldcg(p.ws + at) + bias);
    }
    return;
  }
  const int tokens = p.num_rows / p.top_k;
  for (int t = 0; t < tokens; ++t) {
    FinalizeTokenColumn<T>(p.ws, p.pair_experts, p.experts, p.topk_weights, p.out_bias, p.top_k,
                           p.n, t, unit * 32 + lane, p.out);
  }
}

// The scale-word offset of a lane's group for consecutive chunks, without a division a chunk:
// groups of whole chunks count chunks within the group; groups that divide a chunk step by their
// count a chunk; any other size (a multiple of 16 that neither divides nor is divided by 64)
// divides as before. Offsets are 32-bit (ScaleWordsFitInt32).
struct GroupCursor {
  int kc, t;
  int per_chunk;   // > 0: groups a chunk (the group size divides 64); 0: whole chunks; -1: divide
  int in_group = 0, chunks_per_group = 1;
  uint32_t group_words;  // n_sub x 8: one group's scale words
  uint32_t offset;  // the current chunk's group x n_sub x 8
  __device__ __forceinline__ GroupCursor(const MoeGemmArgs& p, int kc_begin, int lane_t)
      : kc(kc_begin), t(lane_t), group_words(static_cast<uint32_t>(p.n / 16) * 8) {
    const int size = p.k / p.groups;
    if (size % 64 == 0) {
      per_chunk = 0;
      chunks_per_group = size / 64;
      const int group = kc / chunks_per_group;
      in_group = kc - group * chunks_per_group;
      offset = static_cast<uint32_t>(group) * group_words;
    } else {
      per_chunk = 64 % size == 0 ? 64 / size : -1;
      offset = static_cast<uint32_t>(p.per_group(kc * 64 + 16 * t)) * group_words;
    }
  }
  // Whether the current chunk is its group's last (groups of whole chunks).
  __device__ __forceinline__ bool Ends() const { return in_group == chunks_per_group - 1; }
  __device__ __forceinline__ void Next(const MoeGemmArgs& p) {
    ++kc;
    if (per_chunk == 0) {
      if (++in_group == chunks_per_group) {
        in_group = 0;
        offset += group_words;
      }
    } else if (per_chunk > 0) {
      offset += static_cast<uint32_t>(per_chunk) * group_words;
    } else {
      offset = static_cast<uint32_t>(p.per_group(kc * 64 + 16 * t)) * group_words;
    }
  }
};

// The GEMM of one expert block (of `expert`) for one warp's unit along N and the CTA's split of K:
// the main loop and the epilogue. kFolded: either main loop with MmaChunkFolded / FoldGroup
// (groups of whole chunks, block_m 8 and 16: where dequantization instructions, not bytes, bound
// the decode GEMMs).
template <typename T, NibbleCode kCode, int MT, GemmMainloop kMainloop, bool kFolded,
          int kGroupChunks = 0, bool kZeros = true>
__device__ __forceinline__ void MoeInt4GemmExpertBlock(const MoeGemmArgs& p, int blk, int unit,
                                                       int warp, int lane, int expert) {
  constexpr int kNsub = 2;
  constexpr int kStage = ChunksPerStage<MT>();
  const int chunks = p.k / 64;
  const int kc_begin = blockIdx.z * p.chunks_per_split;
  const int kc_end = min(chunks, kc_begin + p.chunks_per_split);
  const int n_sub = p.n / 16;
  const int sub[kNsub] = {unit * p.unit_mult, unit * p.unit_mult + p.sub_stride};
  const int block_m = MT * 8;
  const int g = lane >> 2, t = lane & 3;

  // Activation rows of this lane (token g of each 8-token tile).
  const T* xrow[MT];
  bool xvalid[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int id = BlockRow(p, blk, block_m, m * 8 + g);
    xvalid[m] = id < p.num_rows;
    xrow[m] = reinterpret_cast<const T*>(p.x) +
              (xvalid[m] ? static_cast<int64_t>(id / p.in_div) * p.ld_x : 0) + 16 * t;
  }

  const uint4* wp[kNsub];
#pragma unroll
  for (int j = 0; j < kNsub; ++j) {
    wp[j] = p.w + (static_cast<int64_t>(expert) * n_sub + sub[j]) * chunks * 32 + lane;
  }
  const uint32_t* sp = p.scales + static_cast<int64_t>(expert) * p.groups * n_sub * 8 + g;
  // Signed nibbles (MxInt4) have no zero points (its launcher passes none): null at compile time,
  // so its loops carry no zero-point loads or selects.
  const uint32_t* zp = kCode != NibbleCode::kSignedInt4 && p.zeros
                           ? p.zeros + static_cast<int64_t>(expert) * p.groups * n_sub * 8 + g
                           : nullptr;

  float acc[kNsub][MT][4];
#pragma unroll
  for (int j = 0; j < kNsub; ++j)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[j][m][c] = 0.0f;

  // kFolded: this group's raw sums (zeroed again by each FoldGroup).
  float gacc[kFolded ? kNsub : 1][MT][4];
  float xsum[MT][4];
  if constexpr (kFolded) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        xsum[m][c] = 0.0f;
#pragma unroll
        for (int j = 0; j < kNsub; ++j) gacc[j][m][c] = 0.0f;
      }
  }
  // Registers for chunk kc (kBulkCopy and kRegisters): this lane's activations of every token
  // tile, and the scale and magic + zero point of its group for every subtile.
  auto load_chunk_inputs = [&](int kc, uint4 (&xv)[MT][2], uint32_t (&scale)[kNsub],
                               uint32_t (&zero_magic)[kNsub]) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        xv[m][h] = __ldg(reinterpret_cast<const uint4*>(xrow[m] + kc * 64 + 8 * h));
      }
    }
    const int group = p.per_group(kc * 64 + 16 * t);
#pragma unroll
    for (int j = 0; j < kNsub; ++j) {
      const int64_t off = (static_cast<int64_t>(group) * n_sub + sub[j]) * 8;
      scale[j] = __ldg(sp + off);
      zero_magic[j] = zp ? MagicPlusZero<T>(__ldg(zp + off)) : HalfType<T>::kMagicPlus8;
    }
  };
  // The chunk after kc starts a new group, or kc ends this CTA's split: fold the group.
  auto group_ends = [&](int kc) {
    return kc + 1 == kc_end || p.per_group(kc * 64 + 64) != p.per_group(kc * 64);
  };

  if constexpr (kMainloop == GemmMainloop::kBulkCopy) {
    constexpr int kSlotChunks = kBulkSlotChunks;
    __shared__ __align__(8) uint64_t slot_full[kMaxGemmThreads / 32][kBulkSlots];
    extern __shared__ __align__(128) uint4 bulk_smem[];
    uint64_t* full = slot_full[warp];
    // This warp's slots: [slot][subtile][chunk of the slot][lane].
    uint4* slots = bulk_smem + warp * kBulkSlots * kNsub * kSlotChunks * 32;
    if (lane == 0) {
      for (int s = 0; s < kBulkSlots; ++s) MbarrierInit(full + s);
    }
    __syncwarp();
    const int n_chunks = kc_end - kc_begin;
    const int n_fills = (n_chunks + kSlotChunks - 1) / kSlotChunks;
    auto fill = [&](int f) {  // lane 0: slot f % kBulkSlots <- chunks of fill f, every subtile
      const int slot = f % kBulkSlots;
      const int c0 = kc_begin + f * kSlotChunks;
      const uint32_t bytes = min(kSlotChunks, kc_end - c0) * 512;
      MbarrierExpectBytes(full + slot, kNsub * bytes);
#pragma unroll
      for (int j = 0; j < kNsub; ++j) {
        BulkCopyToShared(slots + (slot * kNsub + j) * kSlotChunks * 32, wp[j] - lane + c0 * 32,
                         bytes, full + slot);
      }
    };
    if (lane == 0) {
      for (int f = 0; f < kBulkSlots - 1 && f < n_fills; ++f) fill(f);
    }
    for (int f = 0; f < n_fills; ++f) {
      // The slot refilled here was read by every lane in iteration f - 1 (its values are in
      // registers and consumed): order those reads before the copy engine's writes.
      if (f + kBulkSlots - 1 < n_fills) {
        __syncwarp();
        if (lane == 0) {
          FenceProxyAsync();
          fill(f + kBulkSlots - 1);
        }
      }
      const int c0 = kc_begin + f * kSlotChunks;
      uint4 xv[kSlotChunks][MT][2];
      uint32_t scale[kSlotChunks][kNsub], zero_magic[kSlotChunks][kNsub];
#pragma unroll
      for (int u = 0; u < kSlotChunks; ++u) {
        const int kc = min(c0 + u, kc_end - 1);  // a short last fill re-reads its last chunk
        load_chunk_inputs(kc, xv[u], scale[u], zero_magic[u]);
      }
      const int slot = f % kBulkSlots;
      MbarrierWait(full + slot, (f / kBulkSlots) & 1);
#pragma unroll
      for (int u = 0; u < kSlotChunks; ++u) {
        if (c0 + u >= kc_end) break;
        uint4 wv[kNsub];
#pragma unroll
        for (int j = 0; j < kNsub; ++j) wv[j] = slots[((slot * kNsub + j) * kSlotChunks + u) * 32 + lane];
        if constexpr (kFolded) {
          MmaChunkFolded<T, kCode, kNsub, MT>(wv, xv[u], gacc, xsum);
          if (group_ends(c0 + u)) FoldGroup<T, kNsub, MT>(scale[u], zero_magic[u], gacc, xsum, acc);
        } else {
          MmaChunk<T, kCode, kNsub, MT>(wv, xv[u], scale[u], zero_magic[u], acc);
        }
      }
    }
  } else if constexpr (kMainloop == GemmMainloop::kAsyncRing) {
    // Thread-private slots, interleaved by thread so a warp's 16-byte accesses are conflict-free:
    // vec (stage s, item q) at vecs[(s * kVecs + q) * threads + tid], words likewise. The loop is
    // unrolled by the ring's depth, so every slot address is a fixed offset from this thread's
    // base, and the global addresses run: each chunk's sources are the previous chunk's plus one
    // chunk (GroupCursor for the scale words). The copies and the arithmetic are those of a loop
    // that computed every address from the chunk index, so the results are the same bits.
    constexpr int kDepth = AsyncDepth<MT>();
    constexpr int kVecs = AsyncVecsPerChunk<MT>();
    extern __shared__ __align__(16) uint4 ring_smem[];
    // The CTA's size as a constant (every launch has kMaxGemmThreads threads), so that each slot
    // is a fixed offset from this thread's first: as a pointer for the reads, as a shared-window
    // address for the copies (a generic pointer there is converted again at every copy).
    constexpr int threads = kMaxGemmThreads;
    const int tid = threadIdx.x;
    uint4* vecs = ring_smem + tid;
    uint32_t* words = reinterpret_cast<uint32_t*>(ring_smem + kDepth * kVecs * threads) + tid;
    auto vec = [&](int stage, int q) -> uint4* { return vecs + (stage * kVecs + q) * threads; };
    auto word = [&](int stage, int q) -> uint32_t* {
      return words + (stage * kAsyncWordsPerChunk + q) * threads;
    };
    const uint32_t vec_at = SharedAddress(vecs), word_at = SharedAddress(words);
    auto vec_address = [&](int stage, int q) -> uint32_t {
      return vec_at + (stage * kVecs + q) * threads * 16;
    };
    auto word_address = [&](int stage, int q) -> uint32_t {
      return word_at + (stage * kAsyncWordsPerChunk + q) * threads * 4;
    };
    const uint4* w_next[kNsub];
    const uint32_t* s_sub[kNsub];  // this subtile's scale (and zero-point) words of group 0
    const uint32_t* z_sub[kNsub];
#pragma unroll
    for (int j = 0; j < kNsub; ++j) {
      w_next[j] = wp[j] + kc_begin * 32;
      s_sub[j] = sp + sub[j] * 8;
      z_sub[j] = zp ? zp + sub[j] * 8 : sp;
    }
    const T* x_next[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) x_next[m] = xrow[m] + kc_begin * 64;
    GroupCursor issue_group(p, kc_begin, t);
    GroupCursor use_group(p, kc_begin, t);  // kFolded: where the computed chunks' groups end
    auto issue = [&](int stage) {  // the next chunk in order
#pragma unroll
      for (int j = 0; j < kNsub; ++j) {
        CpAsyncSharedStream(vec_address(stage, j), w_next[j]);
        w_next[j] += 32;
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // a padding row's source is row 0's, not read
          CpAsyncShared16OrZero(vec_address(stage, kNsub + 2 * m + h), x_next[m] + 8 * h,
                                xvalid[m]);
        }
        x_next[m] += 64;
      }
      const uint32_t gw = issue_group.offset;
#pragma unroll
      for (int j = 0; j < kNsub; ++j) {
        CpAsyncShared4(word_address(stage, j), s_sub[j] + gw);
        if (zp) CpAsyncShared4(word_address(stage, kNsub + j), z_sub[j] + gw);
      }
      if constexpr (kCode == NibbleCode::kSignedInt4) {
        // MxInt4's groups are always 32 inputs (its launcher's groups = K / 32): two a chunk, a
        // constant step instead of the cursor's switch on the group kind.
        issue_group.offset += 2 * issue_group.group_words;
      } else {
        issue_group.Next(p);
      }
    };
    const int n_chunks = kc_end - kc_begin;
#pragma unroll
    for (int s = 0; s < kDepth - 1; ++s) {
      if (s < n_chunks) issue(s);
      CpAsyncCommit();
    }
    auto step = [&](int c, int stage, int ahead_stage) {
      // The slot refilled here was read (into registers) by this thread in iteration c - 1.
      if (c + kDepth - 1 < n_chunks) issue(ahead_stage);
      CpAsyncCommit();
      CpAsyncWait<kDepth - 1>();  // groups 0..c are complete: chunk c has landed
      uint4 wv[kNsub];
      uint4 xv[MT][2];
      uint32_t scale[kNsub], zero_magic[kNsub];
#pragma unroll
      for (int j = 0; j < kNsub; ++j) {
        wv[j] = *vec(stage, j);
        scale[j] = *word(stage, j);
        zero_magic[j] =
            zp ? MagicPlusZero<T>(*word(stage, kNsub + j)) : HalfType<T>::kMagicPlus8;
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        xv[m][0] = *vec(stage, kNsub + 2 * m);
        xv[m][1] = *vec(stage, kNsub + 2 * m + 1);
      }
      if constexpr (kFolded) {
        MmaChunkFolded<T, kCode, kNsub, MT>(wv, xv, gacc, xsum);
        if (use_group.Ends() || c + 1 == n_chunks) {
          FoldGroup<T, kNsub, MT>(scale, zero_magic, gacc, xsum, acc);
        }
        use_group.Next(p);
      } else {
        MmaChunk<T, kCode, kNsub, MT>(wv, xv, scale, zero_magic, acc);
      }
    };
    for (int c0 = 0; c0 < n_chunks; c0 += kDepth) {
#pragma unroll
      for (int s = 0; s < kDepth; ++s) {
        if (c0 + s >= n_chunks) break;
        step(c0 + s, s, (s + kDepth - 1) % kDepth);
      }
    }
  } else if constexpr (kMainloop == GemmMainloop::kRegisters && kFolded && MT == 1) {
    // The folded register loop at block_m 8 (the decode GEMMs of WNA16) with its addresses kept
    // running: the weights and activations of a full stage are read at fixed offsets from
    // pointers that advance a stage a step. The arithmetic is the loop below's, so the results
    // are the same bits; what it saves is the address and group arithmetic that every chunk
    // repeated (ncu, H200, Qwen3-30B-A3B T = 16: ~200 of the 705 instructions a warp issued per
    // 4-chunk stage). At block_m 16 this form spilled; the loop below stays there.
    // Two forms: where the groups sit at fixed chunks of a stage (kGroupChunks != 0, its own
    // kernel), a stage's scales are read once a group and its folds are placed at compile time
    // (sm_90a SASS, groups of 128 without zero points: a 4-chunk stage of 363 instructions, where
    // the counted form's has 546 and branches around two of its four folds); elsewhere each
    // chunk's group is counted.
    const int chunks_per_group = p.k / p.groups / 64;
    const uint32_t group_words = static_cast<uint32_t>(n_sub) * 8;
    const uint32_t* s_sub[kNsub];
    const uint32_t* z_sub[kNsub];
    const uint4* w_at[kNsub];
#pragma unroll
    for (int j = 0; j < kNsub; ++j) {
      s_sub[j] = sp + sub[j] * 8;
      z_sub[j] = zp ? zp + sub[j] * 8 : sp;
      w_at[j] = wp[j] + kc_begin * 32;
    }
    const T* x_at = xrow[0] + kc_begin * 64;
    int kc = kc_begin;
    if constexpr (kGroupChunks != 0) {
      // Full stages whose groups start and end at fixed chunks of the stage: groups of 1 or 2
      // chunks from a group's first chunk (kCpg: each stage holds kStage / kCpg whole groups),
      // or groups of a multiple of kStage chunks from a stage-aligned chunk (kCpg == kStage: a
      // stage is part of one group, folded at its last chunk where the group or the slice
      // ends). Each group's scale and zero-point words are read once, at fixed offsets from
      // pointers that advance a group a step, and where a group ends is known at compile time:
      // no count, no selects, no branch around the fold (GPTQ's groups of 128 are kCpg 2).
      auto fixed_group_stages = [&](auto cpg_tag) {
        constexpr int kCpg = decltype(cpg_tag)::value;
        constexpr int kGroups = kStage / kCpg;
        const int first_group = kc / chunks_per_group;
        const uint32_t* s_at[kNsub];
        const uint32_t* z_at[kNsub];
#pragma unroll
        for (int j = 0; j < kNsub; ++j) {
          s_at[j] = s_sub[j] + first_group * group_words;
          z_at[j] = z_sub[j] + first_group * group_words;
        }
        const int stages_per_group = chunks_per_group / kStage;  // kCpg == kStage
        int stage_in_group = (kc - first_group * chunks_per_group) / kStage;
        for (; kc + kStage <= kc_end; kc += kStage) {
          uint4 wv[kStage][kNsub];
          uint4 xv[kStage][MT][2];
          uint32_t scale[kGroups][kNsub], zero_magic[kGroups][kNsub];
#pragma unroll
          for (int u = 0; u < kStage; ++u) {
#pragma unroll
            for (int j = 0; j < kNsub; ++j) wv[u][j] = LoadStreaming(w_at[j] + u * 32);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              xv[u][0][h] = __ldg(reinterpret_cast<const uint4*>(x_at + u * 64 + 8 * h));
            }
          }
#pragma unroll
          for (int q = 0; q < kGroups; ++q) {
#pragma unroll
            for (int j = 0; j < kNsub; ++j) {
              scale[q][j] = __ldg(s_at[j] + q * group_words);
              zero_magic[q][j] = kZeros ? MagicPlusZero<T>(__ldg(z_at[j] + q * group_words))
                                        : HalfType<T>::kMagicPlus8;
            }
          }
          bool fold_last = true;  // whether the stage's last chunk ends its group (or the slice)
          if constexpr (kCpg == kStage) {
            fold_last = ++stage_in_group == stages_per_group || kc + kStage == kc_end;
          }
#pragma unroll
          for (int u = 0; u < kStage; ++u) {
            MmaChunkFolded<T, kCode, kNsub, MT>(wv[u], xv[u], gacc, xsum);
            if ((u + 1) % kCpg == 0 && (u + 1 < kStage || fold_last)) {
              FoldGroup<T, kNsub, MT>(scale[u / kCpg], zero_magic[u / kCpg], gacc, xsum, acc);
            }
          }
#pragma unroll
          for (int j = 0; j < kNsub; ++j) w_at[j] += kStage * 32;
          x_at += kStage * 64;
          if (kCpg < kStage || stage_in_group == stages_per_group) {
            stage_in_group = 0;
#pragma unroll
            for (int j = 0; j < kNsub; ++j) {
              s_at[j] += kGroups * group_words;
              z_at[j] += kGroups * group_words;
            }
          }
        }
      };
      // The host takes these kernels only where the plan holds (FixedGroupChunks); should it not,
      // the counted loop below computes every stage.
      static_assert(kGroupChunks == 1 || kGroupChunks == 2 || kGroupChunks == kStage);
      const bool fixed = kZeros == (zp != nullptr) &&
                         (kGroupChunks == kStage ? chunks_per_group % kStage == 0
                                                 : chunks_per_group == kGroupChunks) &&
                         kc_begin % kGroupChunks == 0;
      if (fixed) fixed_group_stages(std::integral_constant<int, kGroupChunks>{});
      // The last, partial stage (or, should the plan not hold, every chunk) a chunk at a time:
      // few registers, and the same arithmetic in the same order.
      for (; kc < kc_end; ++kc) {
        const uint32_t word = static_cast<uint32_t>(p.per_group(kc * 64)) * group_words;
        uint4 wv[kNsub];
        uint4 xv[MT][2];
        uint32_t scale[kNsub], zero_magic[kNsub];
#pragma unroll
        for (int j = 0; j < kNsub; ++j) {
          wv[j] = LoadStreaming(w_at[j]);
          scale[j] = __ldg(s_sub[j] + word);
          zero_magic[j] = zp ? MagicPlusZero<T>(__ldg(z_sub[j] + word)) : HalfType<T>::kMagicPlus8;
          w_at[j] += 32;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) xv[0][h] = __ldg(reinterpret_cast<const uint4*>(x_at + 8 * h));
        x_at += 64;
        MmaChunkFolded<T, kCode, kNsub, MT>(wv, xv, gacc, xsum);
        if ((kc + 1) % chunks_per_group == 0 || kc + 1 == kc_end) {
          FoldGroup<T, kNsub, MT>(scale, zero_magic, gacc, xsum, acc);
        }
      }
    } else {
      // The counted loop (every stage of a launch whose groups do not sit at fixed chunks): each
      // chunk's group a count within the group (kept here rather than in a GroupCursor, which
      // held more registers than this loop has at two CTAs an SM: 134 against 128 in one build).
      const int first_group = kc / chunks_per_group;
      int in_group = kc - first_group * chunks_per_group;
      uint32_t word = static_cast<uint32_t>(first_group) * group_words;  // this group's scale words
      // One stage: kTail clamps reads to the slice (chunks past its end re-read its last chunk and
      // are not computed); full stages read at fixed offsets.
      auto stage = [&](auto tail, int kc) {
        constexpr bool kTail = decltype(tail)::value;
        uint4 wv[kStage][kNsub];
        uint4 xv[kStage][MT][2];
        uint32_t scale[kStage][kNsub], zero_magic[kStage][kNsub];
        bool ends[kStage];
#pragma unroll
        for (int u = 0; u < kStage; ++u) {
          const int ul = kTail ? min(u, kc_end - 1 - kc) : u;
#pragma unroll
          for (int j = 0; j < kNsub; ++j) wv[u][j] = LoadStreaming(w_at[j] + ul * 32);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            xv[u][0][h] = __ldg(reinterpret_cast<const uint4*>(x_at + ul * 64 + 8 * h));
          }
          const bool real = !kTail || kc + u < kc_end;  // a past-the-end group may not exist
#pragma unroll
          for (int j = 0; j < kNsub; ++j) {
            scale[u][j] = real ? __ldg(s_sub[j] + word) : 0u;
            zero_magic[u][j] = zp && real ? MagicPlusZero<T>(__ldg(z_sub[j] + word))
                                          : HalfType<T>::kMagicPlus8;
          }
          ends[u] = in_group == chunks_per_group - 1 || kc + u + 1 == kc_end;
          if (++in_group == chunks_per_group) {
            in_group = 0;
            word += group_words;
          }
        }
#pragma unroll
        for (int u = 0; u < kStage; ++u) {
          if (kTail && kc + u >= kc_end) break;
          MmaChunkFolded<T, kCode, kNsub, MT>(wv[u], xv[u], gacc, xsum);
          if (ends[u]) FoldGroup<T, kNsub, MT>(scale[u], zero_magic[u], gacc, xsum, acc);
        }
#pragma unroll
        for (int j = 0; j < kNsub; ++j) w_at[j] += kStage * 32;
        x_at += kStage * 64;
      };
      for (; kc + kStage <= kc_end; kc += kStage) stage(std::false_type{}, kc);
      if (kc < kc_end) stage(std::true_type{}, kc);
    }
  } else {
    for (int kc = kc_begin; kc < kc_end; kc += kStage) {
      uint4 wv[kStage][kNsub];
      uint4 xv[kStage][MT][2];
      uint32_t scale[kStage][kNsub], zero_magic[kStage][kNsub];
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
        // Chunks past the end are neither loaded nor used (the compute loop stops first); the
        // rows of padding tokens read row 0 and feed only their own, discarded, MMA columns.
        const int kl = min(kc + u, kc_end - 1);
#pragma unroll
        for (int j = 0; j < kNsub; ++j) wv[u][j] = LoadStreaming(wp[j] + kl * 32);
        // Scales with the stage's loads, so their latency hides behind the weights'.
        load_chunk_inputs(kl, xv[u], scale[u], zero_magic[u]);
      }
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
        if (kc + u >= kc_end) break;
        if constexpr (kFolded) {
          MmaChunkFolded<T, kCode, kNsub, MT>(wv[u], xv[u], gacc, xsum);
          if (group_ends(kc + u)) FoldGroup<T, kNsub, MT>(scale[u], zero_magic[u], gacc, xsum, acc);
        } else {
          MmaChunk<T, kCode, kNsub, MT>(wv[u], xv[u], scale[u], zero_magic[u], acc);
        }
      }
    }
  }

  // Epilogue. Thread (g, t) holds rows g (c = 0, 1) and g + 8 (c = 2, 3) of
  // each subtile, for tokens 2t (c even) and 2t + 1 (c odd) of each tile.
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = g + 8 * (c >> 1);
      const int id = BlockRow(p, blk, block_m, m * 8 + 2 * t + (c & 1));
      if (id >= p.num_rows) continue;
      if (p.epilogue == EpilogueKind::kActivation) {
        StoreActivation<T, false>(p, expert, sub[0] * 16 + row, id, acc[0][m][c], acc[1][m][c]);
      } else if (p.epilogue == EpilogueKind::kRoundedStore) {  // split == 1
        const float w = p.topk_weights ? __ldg(p.topk_weights + id) : 1.0f;
#pragma unroll
        for (int j = 0; j < kNsub; ++j) {
          const int col = sub[j] * 16 + row;
          float v = acc[j][m][c];
          if (p.bias) v += __ldg(p.bias + static_cast<int64_t>(expert) * p.n + col);
          StoreHalf<T>(p.rounded, static_cast<int64_t>(id) * p.n + col, v * w);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kNsub; ++j) {
          float* dst = p.ws + static_cast<int64_t>(id) * p.n + sub[j] * 16 + row;
          if (p.splits > 1) {
            atomicAdd(dst, acc[j][m][c]);
          } else {
            *dst = acc[j][m][c];
          }
        }
      }
    }
  }
}

// CTAs an SM a kernel's registers must allow (the launch bound's minimum): two for the register
// loop with fixed groups, whose stages ptxas would otherwise hold in more than 128 registers; else
// none asked (the others take 128 or fewer, or one CTA an SM, as they are).
template <int kGroupChunks>
__host__ __device__ constexpr int GemmMinBlocksPerSm() {
  return kGroupChunks != 0 ? 2 : 0;
}

template <typename T, NibbleCode kCode, int MT, GemmMainloop kMainloop = GemmMainloop::kRegisters,
          bool kFolded = false, int kGroupChunks = 0, bool kZeros = true>
__global__ void __launch_bounds__(kMaxGemmThreads, GemmMinBlocksPerSm<kGroupChunks>())
    MoeInt4GemmKernel(MoeGemmArgs p) {
  static_assert(kMainloop == GemmMainloop::kRegisters || MT <= 4,
                "the cp.async ring holds block_m 8, 16 and 32");
  static_assert(!kFolded || MT <= 2, "the folded main loops are for block_m 8 and 16");
  static_assert(kGroupChunks == 0 || (kMainloop == GemmMainloop::kRegisters && kFolded && MT == 1),
                "fixed groups are a form of the folded register loop at block_m 8");
  static_assert(kMainloop != GemmMainloop::kBulkCopy || MT <= 2,
                "the bulk-copy main loop is for block_m 8 and 16");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int unit = blockIdx.y * (blockDim.x >> 5) + warp;
  WaitForPriorGrids();
  AllowDependentGrids();
  if (p.clear) ClearWithGrid(p.clear, p.clear_count);
  if (unit >= p.units) return;
  const int expert = BlockExpert(p, blockIdx.x, MT * 8);
  if (expert >= 0) {
    MoeInt4GemmExpertBlock<T, kCode, MT, kMainloop, kFolded, kGroupChunks, kZeros>(
        p, blockIdx.x, unit, warp, lane, expert);
    // One-token path (block_m 8 only, so only MT 1 compiles it). A pair without an expert here
    // needs no activation: GEMM2 skips it too.
    if constexpr (MT == 1) {
      if (p.act_arrivals) ArriveAndActivate<T>(p, blockIdx.x, unit, lane, expert);
    }
  }
  // A block without work still arrives: the unit's count includes every block and split.
  if (p.arrivals) ArriveAndFinalize<T>(p, unit, lane);
}

// The wgmma GEMM's input order written by the alignment launch's extra CTAs (no act-order): row r
// of x_perm = row r of x with each 64-column chunk in logical order. A logical pair of columns
// (2j, 2j + 1) is a physical pair, so rows move as 32-bit words. blocks: how many CTAs do it.
struct LogicalOrderRows {
  const uint32_t* x = nullptr;  // [rows][words]
  uint32_t* x_perm = nullptr;   // [rows][words]
  int words = 0;                // hidden / 2
  int rows = 0;
  int blocks = 0;
};

// Enough CTAs to stream a prefill's rows beside the one aligning CTA.
constexpr int kLogicalOrderBlocks = 256;

inline LogicalOrderRows MakeLogicalOrderRows(const void* x, void* x_perm, int64_t hidden,
                                             int64_t rows) {
  LogicalOrderRows r;
  r.x = static_cast<const uint32_t*>(x);
  r.x_perm = static_cast<uint32_t*>(x_perm);
  r.words = static_cast<int>(hidden / 2);
  r.rows = static_cast<int>(rows);
  r.blocks = static_cast<int>(std::min<int64_t>(rows, kLogicalOrderBlocks));
  return r;
}

__device__ __forceinline__ void WriteLogicalOrderRows(const LogicalOrderRows& r, int block) {
  constexpr int kRowsInFlight = 4;  // loads of 4 rows before their stores
  for (int row0 = block; row0 < r.rows; row0 += kRowsInFlight * r.blocks) {
    for (int j = threadIdx.x; j < r.words; j += blockDim.x) {
      const int src_word = (j & ~31) | (PhysicalOfLogical(2 * (j & 31)) >> 1);
      uint32_t v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const int row = row0 + u * r.blocks;
        v[u] = row < r.rows ? __ldg(r.x + static_cast<int64_t>(row) * r.words + src_word) : 0u;
      }
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const int row = row0 + u * r.blocks;
        if (row < r.rows) r.x_perm[static_cast<int64_t>(row) * r.words + j] = v[u];
      }
    }
  }
}

// cursor[e] = sum over e' < e of counts[e'] rounded up to block_m, block-wide; returns the total
// (every thread). Thread i owns experts [i*per, (i+1)*per). Every thread of the CTA must call it;
// counts and cursor are in shared memory.
__device__ __forceinline__ int PaddedExpertOffsets(const int32_t* counts, int experts, int block_m,
                                                   int32_t* cursor) {
  __shared__ int32_t warp_sums[32];
  const int per = (experts + blockDim.x - 1) / blockDim.x;
  const int own_begin = min(experts, static_cast<int>(threadIdx.x) * per);
  const int own_end = min(experts, own_begin + per);
  int own = 0;
  for (int e = own_begin; e < own_end; ++e) own += (counts[e] + block_m - 1) / block_m * block_m;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  int inclusive = own;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    if (lane < warps) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  int offset = inclusive - own + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int e = own_begin; e < own_end; ++e) {
    cursor[e] = offset;
    offset += (counts[e] + block_m - 1) / block_m * block_m;
  }
  return warp_sums[warps - 1];
}

// Standard format: sorted_ids lists pair ids p = t*K + k grouped by expert,
// each expert's run padded to block_m with `num_rows`; expert_ids per block
// (-1 past the end). Ids out of [0, E) are dropped (they contribute nothing).
// Block 0 of 1024 threads (shared memory 2 * E ints) aligns; the next `order.blocks` write the
// wgmma GEMM's input order (LogicalOrderRows, one launch fewer); the rest zero the split-K
// workspaces (ZeroWorkspaces; counts may be 0).
static __global__ void __launch_bounds__(1024)
    AlignStandardKernel(const int32_t* topk_ids, int num_pairs, int experts, int block_m,
                        int max_padded, int max_blocks, int32_t* sorted_ids, int32_t* expert_ids,
                        int32_t* num_post_padded, float* ws_a = nullptr, int64_t count_a = 0,
                        float* ws_b = nullptr, int64_t count_b = 0,
                        LogicalOrderRows order = LogicalOrderRows{}) {
  WaitForPriorGrids();
  AllowDependentGrids();
  if (blockIdx.x > 0) {
    if (static_cast<int>(blockIdx.x) <= order.blocks) {
      WriteLogicalOrderRows(order, blockIdx.x - 1);
    } else {
      ZeroWorkspaces(ws_a, count_a, ws_b, count_b, 1 + order.blocks);
    }
    return;
  }
  // This thread's first pair id, loaded before the initialization so that its memory latency
  // overlaps it rather than following it (at decode the whole kernel is a few latencies long).
  const int first_id = static_cast<int>(threadIdx.x) < num_pairs ? topk_ids[threadIdx.x] : -1;
  auto pair_id = [&](int i) { return i == static_cast<int>(threadIdx.x) ? first_id : topk_ids[i]; };
  extern __shared__ int32_t shared[];
  int32_t* counts = shared;
  int32_t* cursor = shared + experts;
  for (int i = threadIdx.x; i < experts; i += blockDim.x) counts[i] = 0;
  for (int i = threadIdx.x; i < max_padded; i += blockDim.x) sorted_ids[i] = num_pairs;
  for (int i = threadIdx.x; i < max_blocks; i += blockDim.x) expert_ids[i] = -1;
  __syncthreads();
  // The pair ids are read kIdBatch at a time, all loads before any atomic, so a thread waits one
  // memory latency per batch rather than per pair (one CTA streams T*K ids: ~50 us at 32768
  // pairs when each pair waited for its load).
  constexpr int kIdBatch = 8;
  const int stride = static_cast<int>(blockDim.x);
  auto load_batch = [&](int i0, int (&e)[kIdBatch]) {
#pragma unroll
    for (int j = 0; j < kIdBatch; ++j) {
      const int i = i0 + j * stride;
      e[j] = i < num_pairs ? pair_id(i) : -1;
    }
  };
  for (int i0 = threadIdx.x; i0 < num_pairs; i0 += kIdBatch * stride) {
    int e[kIdBatch];
    load_batch(i0, e);
#pragma unroll
    for (int j = 0; j < kIdBatch; ++j) {
      if (e[j] >= 0 && e[j] < experts) atomicAdd(&counts[e[j]], 1);
    }
  }
  __syncthreads();
  // Exclusive prefix sum of the padded counts, block-wide (a serial loop over E in one thread
  // took ~8 us of a 13 us launch at E=128).
  const int total = PaddedExpertOffsets(counts, experts, block_m, cursor);
  if (threadIdx.x == 0) *num_post_padded = total;
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    const int first = cursor[e] / block_m;
    const int last = first + (counts[e] + block_m - 1) / block_m;
    for (int b = first; b < last; ++b) expert_ids[b] = e;
  }
  __syncthreads();  // expert_ids written before any later reader (next kernel) anyway
  for (int i0 = threadIdx.x; i0 < num_pairs; i0 += kIdBatch * stride) {
    int e[kIdBatch];
    load_batch(i0, e);
#pragma unroll
    for (int j = 0; j < kIdBatch; ++j) {
      if (e[j] >= 0 && e[j] < experts) sorted_ids[atomicAdd(&cursor[e[j]], 1)] = i0 + j * stride;
    }
  }
}

// The standard format's alignment over several CTAs, for prefills (one CTA took 53 us at 32768
// pairs, E = 128, on an H200: its shared-memory atomics). Two launches with the outputs of
// AlignStandardKernel (the order of pairs within an expert aside: rows are independent):
// AlignCountKernel counts each CTA's slice of kAlignPairsPerCta pairs per expert into
// cta_counts[e][c]; the first C CTAs of AlignScatterKernel each derive every expert's offset and
// their slice's share before it from all counts, then place their slice. No split-K zeroing.
constexpr int kAlignPairsPerCta = 2048;
constexpr int kAlignThreads = 1024;
constexpr int kAlignIdsPerThread = kAlignPairsPerCta / kAlignThreads;

// The expert ids of CTA c's slice that this thread owns (-1 past the end).
__device__ __forceinline__ void LoadSliceIds(const int32_t* topk_ids, int num_pairs, int c,
                                             int (&ids)[kAlignIdsPerThread]) {
  const int end = min(num_pairs, (c + 1) * kAlignPairsPerCta);
#pragma unroll
  for (int j = 0; j < kAlignIdsPerThread; ++j) {
    const int i = c * kAlignPairsPerCta + j * kAlignThreads + threadIdx.x;
    ids[j] = i < end ? __ldg(topk_ids + i) : -1;
  }
}

// Blocks [0, C) count; the next order.blocks write the wgmma GEMM's input order.
static __global__ void __launch_bounds__(kAlignThreads)
    AlignCountKernel(const int32_t* topk_ids, int num_pairs, int experts, int count_ctas,
                     int32_t* cta_counts, LogicalOrderRows order) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int c = blockIdx.x;
  if (c >= count_ctas) {
    WriteLogicalOrderRows(order, c - count_ctas);
    return;
  }
  extern __shared__ int32_t counts[];  // [experts]
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  int ids[kAlignIdsPerThread];
  LoadSliceIds(topk_ids, num_pairs, c, ids);
#pragma unroll
  for (int j = 0; j < kAlignIdsPerThread; ++j) {
    if (ids[j] >= 0 && ids[j] < experts) atomicAdd(&counts[ids[j]], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    cta_counts[static_cast<int64_t>(e) * count_ctas + c] = counts[e];
  }
}

// Shared memory 3 * E ints: per-expert totals, this slice's cursors, the expert offsets.
static __global__ void __launch_bounds__(kAlignThreads)
    AlignScatterKernel(const int32_t* topk_ids, int num_pairs, int experts, int block_m,
                       int max_padded, int max_blocks, int count_ctas, const int32_t* cta_counts,
                       int32_t* sorted_ids, int32_t* expert_ids, int32_t* num_post_padded) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int c = blockIdx.x;
  extern __shared__ int32_t shared[];
  int32_t* totals = shared;
  int32_t* cursor = shared + experts;
  int32_t* offsets = shared + 2 * experts;
  // This slice's ids, loaded before the counts are summed (their latency overlaps).
  int ids[kAlignIdsPerThread];
  LoadSliceIds(topk_ids, num_pairs, c, ids);
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    const int32_t* row = cta_counts + static_cast<int64_t>(e) * count_ctas;
    int total = 0, before = 0;
#pragma unroll 8
    for (int k = 0; k < count_ctas; ++k) {
      const int v = __ldcg(row + k);
      total += v;
      before += k < c ? v : 0;
    }
    totals[e] = total;
    cursor[e] = before;
  }
  __syncthreads();
  const int padded_total = PaddedExpertOffsets(totals, experts, block_m, offsets);
  __syncthreads();
  // Every CTA: its experts' blocks (e % C == c) and pad slots; a strided share of the tail.
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    cursor[e] += offsets[e];
    if (e % count_ctas != c) continue;
    const int blocks = (totals[e] + block_m - 1) / block_m;
    for (int b = 0; b < blocks; ++b) expert_ids[offsets[e] / block_m + b] = e;
    for (int i = offsets[e] + totals[e]; i < offsets[e] + blocks * block_m; ++i) {
      sorted_ids[i] = num_pairs;
    }
  }
  const int stride = count_ctas * kAlignThreads;
  for (int i = padded_total + c * kAlignThreads + threadIdx.x; i < max_padded; i += stride) {
    sorted_ids[i] = num_pairs;
  }
  for (int b = padded_total / block_m + c * kAlignThreads + threadIdx.x; b < max_blocks;
       b += stride) {
    expert_ids[b] = -1;
  }
  if (c == 0 && threadIdx.x == 0) *num_post_padded = padded_total;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kAlignIdsPerThread; ++j) {
    if (ids[j] >= 0 && ids[j] < experts) {
      sorted_ids[atomicAdd(&cursor[ids[j]], 1)] = c * kAlignPairsPerCta + j * kAlignThreads +
                                                   static_cast<int>(threadIdx.x);
    }
  }
}

// The standard format's alignment launch(es): AlignStandardKernel (one aligning CTA, plus the
// input-order and zeroing CTAs), or for many pairs with nothing to zero AlignCountKernel +
// AlignScatterKernel, their per-CTA counts in `scratch` (a workspace that no kernel of the op has
// used yet) when they fit. first_kernel: the op's first launch (no dependent launch).
struct StandardAlignment {
  const int32_t* topk_ids = nullptr;
  int num_pairs = 0, experts = 0, block_m = 8, max_padded = 0, max_blocks = 0;
  int32_t* sorted_ids = nullptr;
  int32_t* expert_ids = nullptr;
  int32_t* num_post_padded = nullptr;
  float* ws_a = nullptr;
  int64_t count_a = 0;
  float* ws_b = nullptr;
  int64_t count_b = 0;
  LogicalOrderRows order;
  void* scratch = nullptr;
  int64_t scratch_bytes = 0;
};

// The fields every caller sets: pairs, their experts and the alignment outputs.
inline StandardAlignment MakeStandardAlignment(const int32_t* topk_ids, int64_t num_pairs,
                                               int experts, int block_m, int64_t max_padded,
                                               int64_t max_blocks, int32_t* sorted_ids,
                                               int32_t* expert_ids, int32_t* num_post_padded) {
  StandardAlignment a;
  a.topk_ids = topk_ids;
  a.num_pairs = static_cast<int>(num_pairs);
  a.experts = experts;
  a.block_m = block_m;
  a.max_padded = static_cast<int>(max_padded);
  a.max_blocks = static_cast<int>(max_blocks);
  a.sorted_ids = sorted_ids;
  a.expert_ids = expert_ids;
  a.num_post_padded = num_post_padded;
  return a;
}

// Pairs from which the alignment runs over several CTAs, and the most counts it gathers.
constexpr int kAlignMultiCtaMinPairs = 8192;
constexpr int64_t kAlignMaxCounts = 1 << 16;
constexpr int kAlignMultiCtaMaxExperts = 2048;  // AlignScatterKernel's 3 * E ints within 48 KB

inline int AlignCountCtas(const StandardAlignment& a) {
  if (a.count_a > 0 || a.count_b > 0 || a.num_pairs < kAlignMultiCtaMinPairs ||
      a.experts > kAlignMultiCtaMaxExperts) {
    return 0;
  }
  const int64_t ctas = (a.num_pairs + kAlignPairsPerCta - 1) / kAlignPairsPerCta;
  const int64_t counts = ctas * a.experts;
  if (counts > kAlignMaxCounts || counts * 4 > a.scratch_bytes) return 0;
  return static_cast<int>(ctas);
}

template <typename Kernel, typename... Args>
void LaunchAlignmentKernel(bool first_kernel, Kernel kernel, dim3 grid, size_t smem,
                           cudaStream_t stream, Args... args) {
  if (first_kernel) {
    kernel<<<grid, kAlignThreads, smem, stream>>>(args...);
  } else {
    LaunchAfterPrior(kernel, grid, dim3(kAlignThreads), smem, stream, args...);
  }
}

inline void LaunchStandardAlignment(const StandardAlignment& a, bool first_kernel,
                                    cudaStream_t stream) {
  const size_t experts = static_cast<size_t>(a.experts);
  if (const int ctas = AlignCountCtas(a); ctas > 0) {
    int32_t* cta_counts = static_cast<int32_t*>(a.scratch);
    LaunchAlignmentKernel(first_kernel, AlignCountKernel, dim3(ctas + a.order.blocks),
                          experts * sizeof(int32_t), stream, a.topk_ids, a.num_pairs, a.experts,
                          ctas, cta_counts, a.order);
    LaunchAfterPrior(AlignScatterKernel, dim3(ctas), dim3(kAlignThreads),
                     3 * experts * sizeof(int32_t), stream, a.topk_ids, a.num_pairs, a.experts,
                     a.block_m, a.max_padded, a.max_blocks, ctas,
                     static_cast<const int32_t*>(cta_counts), a.sorted_ids, a.expert_ids,
                     a.num_post_padded);
    return;
  }
  const int zero_blocks = (a.count_a + a.count_b) > 0 ? kZeroBlocks : 0;
  LaunchAlignmentKernel(first_kernel, AlignStandardKernel, dim3(1 + a.order.blocks + zero_blocks),
                        2 * experts * sizeof(int32_t), stream, a.topk_ids, a.num_pairs,
                        a.experts, a.block_m, a.max_padded, a.max_blocks, a.sorted_ids,
                        a.expert_ids, a.num_post_padded, a.ws_a, a.count_a, a.ws_b, a.count_b,
                        a.order);
}

// Batched format: expert e owns blocks [e * bpe, (e + 1) * bpe) of rows
// e * M + m, m < expert_num_tokens[e] (clamped to M); padding is E * M.
// Blocks [0, align_blocks) align; the others zero the workspaces.
static __global__ void AlignBatchedKernel(const int32_t* expert_num_tokens, int experts,
                                          int max_tokens, int block_m, int32_t* sorted_ids,
                                          int32_t* expert_ids, int32_t* num_post_padded,
                                          int align_blocks, float* ws_a, int64_t count_a,
                                          float* ws_b, int64_t count_b) {
  WaitForPriorGrids();
  AllowDependentGrids();
  if (static_cast<int>(blockIdx.x) >= align_blocks) {
    ZeroWorkspaces(ws_a, count_a, ws_b, count_b, align_blocks);
    return;
  }
  const int blocks_per_expert = (max_tokens + block_m - 1) / block_m;
  const int total = experts * blocks_per_expert * block_m;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i == 0) *num_post_padded = total;
  if (i >= total) return;
  const int b = i / block_m;
  const int e = b / blocks_per_expert;
  const int m = (b % blocks_per_expert) * block_m + i % block_m;
  const int count = min(max(expert_num_tokens[e], 0), max_tokens);
  sorted_ids[i] = m < count ? e * max_tokens + m : experts * max_tokens;
  if (i % block_m == 0) expert_ids[b] = e;
}

// Host side: one launch of the GEMM for args.block_m and args.mainloop, CTAs of kGemmWarps
// warps. kAsyncRing applies to block_m 8, 16 and 32 (64 uses kRegisters).
constexpr int kGemmWarps = 8;
static_assert(kGemmWarps * 32 == kMaxGemmThreads, "the async ring lays its slots out for this size");

template <typename T, NibbleCode kCode, int MT, GemmMainloop kMainloop, bool kFolded = false,
          int kGroupChunks = 0, bool kZeros = true>
void LaunchMoeInt4GemmFor(const MoeGemmArgs& args, int max_blocks, cudaStream_t stream) {
  const auto kernel = MoeInt4GemmKernel<T, kCode, MT, kMainloop, kFolded, kGroupChunks, kZeros>;
  const dim3 grid(max_blocks, (args.units + kGemmWarps - 1) / kGemmWarps, args.splits);
  const int threads = kGemmWarps * 32;
  int smem = 0;
  if constexpr (kMainloop != GemmMainloop::kRegisters) {
    smem = kMainloop == GemmMainloop::kBulkCopy ? BulkSmemBytes(threads) : AsyncSmemBytes<MT>(threads);
    // Above 48 KB needs an opt-in, once per instantiation and device (not a stream operation,
    // so it is also fine while XLA captures a command buffer). Should it fail, the launch below
    // fails too and the caller's cudaGetLastError reports it.
    static SmemOptInTable opted_in;
    (void)EnsureDynamicSmem(opted_in, kernel, smem, /*max_carveout=*/true);
  }
  if (args.dependent_launch) {
    LaunchAfterPrior(kernel, grid, dim3(threads), smem, stream, args);
  } else {
    kernel<<<grid, threads, smem, stream>>>(args);
  }
}

// The folded register loop's fixed-group form at block_m 8 (kGroupChunks of
// MoeInt4GemmExpertBlock) that a launch's groups allow: 1 or 2 for groups of that many chunks, 4
// (a stage) for groups of a multiple of 4 chunks, when every split starts where a group (or a
// stage) does; 0 for none (the counted loop).
inline int FixedGroupChunks(const MoeGemmArgs& args) {
  constexpr int kStage = ChunksPerStage<1>();
  const int chunks_per_group = args.k / args.groups / 64;
  const int step = args.splits > 1 ? args.chunks_per_split : 0;  // where splits start: multiples
  if (chunks_per_group == 1) return 1;
  if (chunks_per_group == 2 && step % 2 == 0) return 2;
  if (chunks_per_group % kStage == 0 && step % kStage == 0) return kStage;
  return 0;
}

template <typename T, NibbleCode kCode, int kGroupChunks>
void LaunchMoeInt4GemmFixedGroups(const MoeGemmArgs& args, int max_blocks, cudaStream_t stream) {
  if (args.zeros) {
    LaunchMoeInt4GemmFor<T, kCode, 1, GemmMainloop::kRegisters, true, kGroupChunks, true>(
        args, max_blocks, stream);
  } else {
    LaunchMoeInt4GemmFor<T, kCode, 1, GemmMainloop::kRegisters, true, kGroupChunks, false>(
        args, max_blocks, stream);
  }
}

template <typename T, NibbleCode kCode, int MT, GemmMainloop kMainloop>
void LaunchMoeInt4GemmFolding(const MoeGemmArgs& args, int max_blocks, cudaStream_t stream) {
  // Groups of whole 64-deep chunks (64, 128, ..., channel-wise) take the folded form; MxInt4's
  // groups of 32 never do, so its code is not instantiated.
  if constexpr (MT <= 2 && kCode == NibbleCode::kUint4b8) {
    if ((args.k / args.groups) % 64 == 0) {
      if constexpr (MT == 1 && kMainloop == GemmMainloop::kRegisters) {
        switch (FixedGroupChunks(args)) {
          case 1: return LaunchMoeInt4GemmFixedGroups<T, kCode, 1>(args, max_blocks, stream);
          case 2: return LaunchMoeInt4GemmFixedGroups<T, kCode, 2>(args, max_blocks, stream);
          case ChunksPerStage<1>():
            return LaunchMoeInt4GemmFixedGroups<T, kCode, ChunksPerStage<1>()>(args, max_blocks,
                                                                               stream);
          default: break;
        }
      }
      LaunchMoeInt4GemmFor<T, kCode, MT, kMainloop, true>(args, max_blocks, stream);
      return;
    }
  }
  LaunchMoeInt4GemmFor<T, kCode, MT, kMainloop>(args, max_blocks, stream);
}

template <typename T, NibbleCode kCode, int MT>
void LaunchMoeInt4GemmMainloop(const MoeGemmArgs& args, int max_blocks, cudaStream_t stream) {
  static_assert(MT <= 4, "block_m 64 has the register main loop only");
  if (args.mainloop == GemmMainloop::kAsyncRing) {
    LaunchMoeInt4GemmFolding<T, kCode, MT, GemmMainloop::kAsyncRing>(args, max_blocks, stream);
  } else if (args.mainloop == GemmMainloop::kBulkCopy) {
    if constexpr (MT <= 2) {
      LaunchMoeInt4GemmFolding<T, kCode, MT, GemmMainloop::kBulkCopy>(args, max_blocks, stream);
    } else {  // block_m 32 has no bulk-copy loop: the ring is its nearest
      LaunchMoeInt4GemmFolding<T, kCode, MT, GemmMainloop::kAsyncRing>(args, max_blocks, stream);
    }
  } else {
    LaunchMoeInt4GemmFolding<T, kCode, MT, GemmMainloop::kRegisters>(args, max_blocks, stream);
  }
}

template <typename T, NibbleCode kCode>
void LaunchMoeInt4Gemm(const MoeGemmArgs& group_args, int max_blocks, cudaStream_t stream) {
  MoeGemmArgs args = group_args;
  args.per_group = MakeFastDiv(static_cast<uint32_t>(args.k / args.groups));
  switch (args.block_m) {
    case 8: LaunchMoeInt4GemmMainloop<T, kCode, 1>(args, max_blocks, stream); break;
    case 16: LaunchMoeInt4GemmMainloop<T, kCode, 2>(args, max_blocks, stream); break;
    case 32: LaunchMoeInt4GemmMainloop<T, kCode, 4>(args, max_blocks, stream); break;
    default: LaunchMoeInt4GemmFor<T, kCode, 8, GemmMainloop::kRegisters>(args, max_blocks, stream);
  }
}

}  // namespace jax_moeq::cuda
