// The wgmma form of the grouped int4 GEMM: Hopper warpgroup MMAs with the dequantized weights as
// the register A operand and a token tile of block_m tokens as the shared-memory B operand: 128
// for prefill (block_m 128), 32 or 64 through GemmMainloop::kWgmma (batched decode). Same
// MoeGemmArgs, weights, scales and alignment as MoeInt4GemmKernel; no XLA types.
//
// Why this form: the weights' packed fragments (int4_mma_core.cuh) are already the A fragments of
// mma.m16n8k16, which is also the per-warp register layout of wgmma's A operand, so each warp
// dequantizes its own 16-row subtile straight into the MMA, and the tokens, reused by every row
// tile, sit once per CTA in shared memory where wgmma reads them without any register traffic.
//
// The one cost: wgmma reads B in the logical k order of its 16-deep steps, while a lane's packed
// weights cover the physical inputs 16t .. 16t+15 of a 64-deep chunk (see int4_mma_core.cuh).
// Logical position L = 16 s + c of a chunk (k-step s, column c of the step) holds physical input
//   P(L) = 16 ((c & 7) >> 1) + 4 s + 2 (c >> 3) + (c & 1)   (PhysicalOfLogical, moe_int4_gemm.cuh),
// so the inputs of GEMM1 are permuted into logical order once per call (PermuteRowsKernel in the
// launchers) and GEMM1's epilogue writes its activation columns in logical order for GEMM2.
//
// CTA: 256 threads = two warpgroups (one CTA per SM; two with the 32-token tile). Warpgroup w owns
// "unit" u = 2 n_tile + w:
// two 64-row tiles (four 16-row subtiles each, one per warp): sub0 = u * unit_mult + warp % 4 and
// sub0 + sub_stride (GEMM1: gate rows and the matching up rows; GEMM2: 128 consecutive rows).
// Per 64-deep chunk a stage of shared memory holds the B tile (block_m tokens x 64 inputs, 128-byte
// swizzle), every warp's two weight fragments and every lane's scales; all 256 threads fill it
// with cp.async kWgmmaAhead chunks ahead, one __syncthreads per chunk.
#pragma once

#include <string>

#include "cuda/moe_int4_gemm.cuh"
#include "cuda/wgmma_ops.cuh"

namespace jax_moeq::cuda {

constexpr int kWgmmaBlockM = 128;
constexpr int kWgmmaThreads = 256;
constexpr int kWgmmaStages = 5;
constexpr int kWgmmaAhead = kWgmmaStages - 2;  // the stage refilled was read two chunks ago
// MMA groups (one per k-step) a warpgroup leaves running; each k-step owns its A registers.
constexpr int kWgmmaInFlight = 3;  // H100, Mixtral T=4096: 6.52 ms with 1, 6.33 ms with 3
static_assert(kWgmmaInFlight >= 1 && kWgmmaInFlight <= 3, "4 k-steps of A registers per chunk");
constexpr int kWgStageWeights = (kWgmmaThreads / 32) * 2 * 512;
constexpr int kWgStageWords = 2 * kWgmmaThreads * 4;      // a scale (or zero) word per tile, lane

// The token tile: kN tokens (block_m), 128 at block_m 128 (prefill) and, through the kWgmma main
// loop, 64 or 32 (batched decode, where a 128-token tile would mostly be padding). A stage holds
// the kN x 64-input token tile, the weight fragments and the scale / zero words: 28 / 20 / 16 KB
// at 128 / 64 / 32.
template <int kN>
struct WgmmaTile {
  static_assert(kN == 32 || kN == 64 || kN == 128, "token tiles of 32, 64 or 128");
  static constexpr int kStageTokens = kN * 128;  // kN rows x 64 inputs x 2 bytes
  static constexpr int kStageBytes = kStageTokens + kWgStageWeights + 2 * kWgStageWords;
  static constexpr int kSmemBytes = kWgmmaStages * kStageBytes + 1024;  // + alignment slack
  // Two CTAs per SM cap registers at 128: the 32-token tile fits (no spills), 64 would spill.
  static constexpr int kCtasPerSm = kN == 32 ? 2 : 1;
  static_assert(kStageBytes % 1024 == 0, "token tiles must stay 1024-byte aligned");
};

// d (+)= A x B for a kN-token tile.
template <typename T, int kN>
__device__ __forceinline__ void WgmmaTileMma(float (&d)[kN / 2], const uint32_t (&a)[4],
                                             uint64_t desc_b) {
  if constexpr (kN == 128) {
    WgmmaM64N128K16<T>(d, a, desc_b);
  } else {
    WgmmaM64NxK16<T, kN>(d, a, desc_b);
  }
}

// x_perm[id][j] = x[id / in_div][perm[e][c(j)]], e the row's expert (act-order; without perm the
// column is c(j)), where c(j) = j, or the physical column of logical position j when
// logical_chunks (the wgmma GEMM's input order, moe_int4_wgmma.cuh).
template <typename T>
static __global__ void PermuteRowsKernel(const T* x, int in_div, const int32_t* row_expert_src,
                                  int row_expert_div, const int32_t* perm, bool logical_chunks,
                                  int hidden, int rows, int experts, T* x_perm) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int id = blockIdx.x;
  if (id >= rows) return;
  const int32_t* pe = nullptr;
  if (perm) {
    const int e = row_expert_src ? row_expert_src[id] : id / row_expert_div;
    if (e < 0 || e >= experts) return;
    pe = perm + static_cast<int64_t>(e) * hidden;
  }
  const T* src = x + static_cast<int64_t>(id / in_div) * hidden;
  T* dst = x_perm + static_cast<int64_t>(id) * hidden;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
    const int c = logical_chunks ? (j & ~63) | PhysicalOfLogical(j & 63) : j;
    dst[j] = src[pe ? pe[c] : c];
  }
}

// GEMM1's activation epilogue without act-order: the CTA's 128 tokens x 128 activation columns
// (gate rows 128 n_tile .. + 127, in the logical chunk order GEMM2 reads) are staged in the
// drained pipeline stages, then written as 16-byte row pieces: 8 coalesced stores a thread
// instead of 64 scattered 2-byte ones. Every thread of the CTA must call it (two barriers);
// warps of an idle warpgroup (odd unit count) pass tile_ok = false and store nothing.
constexpr int kWgOutRowBytes = 128 * 2 + 16;  // + 16 bytes: row starts spread over the banks

template <typename T, int kActivationKind, int kN, typename Sync>
__device__ __forceinline__ void StoreActivationTile(const MoeGemmArgs& p, uint32_t smem, int blk,
                                                    int expert, int n_tile,
                                                    const float (&acc)[2][kN / 2], bool tile_ok,
                                                    int tid, Sync sync) {
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int half_n = p.n / 2;
  sync();  // every thread is done with the staging memory (the last stage, or the last tile)
  if (tile_ok) {
    // Gate row (= activation column) n of this warp: sub0 * 16 + row; its local logical column.
    const int n0 = 128 * n_tile + 64 * (warp >> 2) + 16 * (warp & 3);
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const float2 bias = GateUpBias(p.bias, expert, half_n, n0 + g + 8 * rh);
      const int col = 64 * (warp >> 2) + LogicalOfPhysical(16 * (warp & 3) + g + 8 * rh);
      const uint32_t dst = smem + 2 * t * kWgOutRowBytes + 2 * col;
#pragma unroll
      for (int nb = 0; nb < kN / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 4 * nb + 2 * rh + e;
          const float a = RoundedActivation<T>(kActivationKind, acc[0][i] + bias.x,
                                               acc[1][i] + bias.y);
          const T h = HalfType<T>::from_float(a);
          StShared16(dst + (8 * nb + e) * kWgOutRowBytes, *reinterpret_cast<const uint16_t*>(&h));
        }
      }
    }
  }
  sync();
  // Column pieces of 8 past the last unit's columns belong to an idle warpgroup.
  const int cols = min(128, 64 * (p.units - 2 * n_tile));
#pragma unroll
  for (int i = 0; i < kN * 16 / kWgmmaThreads; ++i) {
    const int v = tid + kWgmmaThreads * i;
    const int r = v >> 4, q = v & 15;
    const int id = BlockRow(p, blk, kN, r);
    if (id >= p.num_rows || 8 * q >= cols) continue;
    const uint4 piece = LdShared128(smem + r * kWgOutRowBytes + 16 * q);
    *reinterpret_cast<uint4*>(reinterpret_cast<T*>(p.act) + static_cast<int64_t>(id) * half_n +
                              128 * n_tile + 8 * q) = piece;
  }
}

// GEMM2's epilogue (kRoundedStore): v = round((acc + bias[e][n]) * topk_weights[id]) as T (bias
// and weights optional), the rounding the finalize would apply to f32 rows, so GEMM2 writes and the
// finalize reads half the bytes. The CTA's tokens x 256 f32 outputs (two warpgroups of 128 rows)
// are staged kPass tokens at a time (kN in the pipeline stages of MoeInt4WgmmaKernel; 64 in the
// persistent kernel's own, smaller staging area); then each thread finishes 8 outputs of a token
// at a time (always the same 8: bias loaded once) and stores them as one 16-byte piece. Every
// consumer thread (tid 0 .. 255) must call it: two sync() per pass.
constexpr int kWgRoundedRowBytes = 256 * 4 + 16;  // + 16 bytes: row starts spread over the banks

template <typename T, int kN, int kPass, typename Sync>
__device__ __forceinline__ void StoreRoundedTile(const MoeGemmArgs& p, uint32_t smem, int blk,
                                                 int expert, int n_tile,
                                                 const float (&acc)[2][kN / 2],
                                                 const bool (&tile_ok)[2], int tid, Sync sync) {
  static_assert(kN % kPass == 0 && kPass % 8 == 0, "passes of whole 8-token column blocks");
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  // Thread: outputs 8 lane .. 8 lane + 7 of tokens warp + 8 i. Pieces past N (an idle warpgroup,
  // or N % 128 == 64) are not stored.
  const int n0 = 256 * n_tile + 8 * lane;
  const bool n_ok = n0 < p.n;
  float bias[8] = {};
  if (p.bias && n_ok) {
    const float4* b =
        reinterpret_cast<const float4*>(p.bias + static_cast<int64_t>(expert) * p.n + n0);
    const float4 lo = __ldg(b), hi = __ldg(b + 1);
    bias[0] = lo.x; bias[1] = lo.y; bias[2] = lo.z; bias[3] = lo.w;
    bias[4] = hi.x; bias[5] = hi.y; bias[6] = hi.z; bias[7] = hi.w;
  }
  constexpr int kPieces = kPass * 32 / kWgmmaThreads;
#pragma unroll
  for (int pass = 0; pass < kN / kPass; ++pass) {
    sync();  // every thread is done with the staging memory (last stage, pass or tile)
    if (tile_ok[0]) {
      // Output rows of this warp: subtiles 8 wg + w % 4 (+ 4 for j = 1) of the CTA's 16.
      const uint32_t dst = smem + 2 * t * kWgRoundedRowBytes +
                           4 * (128 * (warp >> 2) + 16 * (warp & 3) + g);
#pragma unroll
      for (int pb = 0; pb < kPass / 8; ++pb) {
        const int nb = pass * (kPass / 8) + pb;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int rh = 0; rh < 2; ++rh) {
              // acc[j][4 nb + 2 rh + e]: token 8 nb + 2 t + e, output row 64 j + 8 rh + g.
              StShared32(dst + (8 * pb + e) * kWgRoundedRowBytes + 4 * (64 * j + 8 * rh),
                         __float_as_uint(acc[j][4 * nb + 2 * rh + e]));
            }
          }
        }
      }
    }
    sync();
    if (!n_ok) continue;
    int ids[kPieces];
    float w[kPieces];
#pragma unroll
    for (int i = 0; i < kPieces; ++i) ids[i] = BlockRow(p, blk, kN, pass * kPass + warp + 8 * i);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      w[i] = p.topk_weights && ids[i] < p.num_rows ? __ldg(p.topk_weights + ids[i]) : 1.0f;
    }
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int r = warp + 8 * i;
      if (ids[i] >= p.num_rows) continue;
      const uint32_t src = smem + r * kWgRoundedRowBytes + 32 * lane;
      const uint4 lo = LdShared128(src), hi = LdShared128(src + 16);
      const uint32_t bits[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      alignas(16) T h[8];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        float v = __uint_as_float(bits[c]);
        if (p.bias) v += bias[c];
        if (p.topk_weights) v *= w[i];
        h[c] = HalfType<T>::from_float(v);
      }
      *reinterpret_cast<uint4*>(reinterpret_cast<T*>(p.rounded) +
                                static_cast<int64_t>(ids[i]) * p.n + n0) =
          *reinterpret_cast<const uint4*>(h);
    }
  }
}

// One 64-deep chunk of a warpgroup's two 64-row tiles from the stage at `st`: this thread's
// weight words at st + weight_off (+ 512 for tile 1), its scale and zero-point words at st +
// word_off (+ 1024 q: scale tile 0, scale tile 1, zero tile 0, zero tile 1), the token tile at st.
// k-step s: dequantize into a[s] (step s of the previous chunk, its last reader, is done: see the
// wait), issue both tiles' MMAs, and go on while up to kWgmmaInFlight groups run, so the chunk
// boundary overlaps queued MMAs instead of draining them. On return at most kWgmmaInFlight groups
// of this chunk are running and every group of the chunk before is done.
template <typename T, NibbleCode kCode, int kN>
__device__ __forceinline__ void WgmmaChunk(uint32_t st, uint32_t weight_off, uint32_t word_off,
                                           bool has_zeros, float (&acc)[2][kN / 2],
                                           uint32_t (&a)[4][2][4]) {
  uint32_t words[2][4], s_lo[2], s_hi[2], z_lo[2], z_hi[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint4 wv = LdShared128(st + weight_off + 512 * j);
    words[j][0] = wv.x;
    words[j][1] = wv.y;
    words[j][2] = wv.z;
    words[j][3] = wv.w;
    const uint32_t scale = LdShared32(st + word_off + 1024 * j);
    const uint32_t zm = has_zeros ? MagicPlusZero<T>(LdShared32(st + word_off + 1024 * (2 + j)))
                                  : HalfType<T>::kMagicPlus8;
    s_lo[j] = BroadcastHalf(scale, false);
    s_hi[j] = BroadcastHalf(scale, true);
    z_lo[j] = BroadcastHalf(zm, false);
    z_hi[j] = BroadcastHalf(zm, true);
  }
  const uint64_t desc = SmemDescSwizzle128(st);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      DequantWord<T, kCode>(words[j][s], s_lo[j], s_hi[j], z_lo[j], z_hi[j], a[s][j]);
    }
    WgmmaFence();
    const uint64_t desc_s = desc + 2 * s;  // + 32 bytes (16 inputs) per k-step
    WgmmaTileMma<T, kN>(acc[0], a[s][0], desc_s);
    WgmmaTileMma<T, kN>(acc[1], a[s][1], desc_s);
    WgmmaCommit();
    WgmmaWait<kWgmmaInFlight>();
  }
}

// The epilogue of both wgmma kernels for consumer thread tid (0 .. 255) of a tile: the staged
// activation store (GEMM1 without act-order) or rounded store (GEMM2, kPass tokens per pass) in
// the shared memory at `staging`, meeting at sync(); else unstaged stores from the registers.
// Accumulator d[4 nb + c] = row g + 8 (c >> 1) of each subtile, token column 8 nb + 2t + (c & 1).
template <typename T, int kN, int kPass, typename Sync>
__device__ __forceinline__ void StoreWgmmaTile(const MoeGemmArgs& p, uint32_t staging, int blk,
                                               int expert, int n_tile,
                                               const float (&acc)[2][kN / 2],
                                               const bool (&tile_ok)[2], const int (&sub)[2],
                                               int tid, Sync sync) {
  const int lane = tid & 31, g = lane >> 2, t = lane & 3;
  if (p.epilogue == EpilogueKind::kActivation && p.act_col == nullptr) {
    // The activation kind is uniform: one specialized loop each, no branch per element.
    if (p.activation == 1) {
      StoreActivationTile<T, 1, kN>(p, staging, blk, expert, n_tile, acc, tile_ok[0], tid, sync);
    } else {
      StoreActivationTile<T, 0, kN>(p, staging, blk, expert, n_tile, acc, tile_ok[0], tid, sync);
    }
    return;
  }
  if (p.epilogue == EpilogueKind::kRoundedStore) {
    StoreRoundedTile<T, kN, kPass>(p, staging, blk, expert, n_tile, acc, tile_ok, tid, sync);
    return;
  }
  if (!tile_ok[0]) return;
#pragma unroll
  for (int nb = 0; nb < kN / 8; ++nb) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int id = BlockRow(p, blk, kN, 8 * nb + 2 * t + e);
      if (id >= p.num_rows) continue;
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const int row = g + 8 * rh;
        const int i = 4 * nb + 2 * rh + e;
        if (p.epilogue == EpilogueKind::kActivation) {  // act-order: columns through act_col
          StoreActivation<T, true>(p, expert, sub[0] * 16 + row, id, acc[0][i], acc[1][i]);
        } else {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            if (!tile_ok[j]) continue;
            p.ws[static_cast<int64_t>(id) * p.n + sub[j] * 16 + row] = acc[j][i];
          }
        }
      }
    }
  }
}

// Grid order: blockIdx.x = expert block and blockIdx.y = N tile (kExpertBlockFastest), or the
// reverse. GEMM1 runs expert blocks fastest: a wave then covers every token block of one or two
// N tiles, whose weights it reads once while the (small) permuted inputs stay in L2. GEMM2's
// input (T*K rows of I) does not fit in L2, so it runs N tiles fastest: the CTAs of one token
// block run together and read its rows once (Mixtral T=4096: ~2 GB of re-reads otherwise).
template <typename T, NibbleCode kCode, bool kExpertBlockFastest, int kN>
__global__ void __launch_bounds__(kWgmmaThreads, WgmmaTile<kN>::kCtasPerSm)
    MoeInt4WgmmaKernel(MoeGemmArgs p) {
  using Tile = WgmmaTile<kN>;
  WaitForPriorGrids();
  AllowDependentGrids();
  const int blk = kExpertBlockFastest ? blockIdx.x : blockIdx.y;
  const int n_tile = kExpertBlockFastest ? blockIdx.y : blockIdx.x;
  // Whole-CTA exits only (every thread takes part in the barriers below): past the padded end,
  // an empty block, or no expert.
  const int expert = BlockExpert(p, blk, kN);
  if (expert < 0) return;

  // Shared memory is addressed in the 32-bit shared window throughout: generic pointers into it
  // cost a window lookup and a generic load per access (ncu: the per-chunk address arithmetic
  // and generic loads were most of the ~320 instructions a warp issued per chunk, and the MMAs
  // waited on them).
  extern __shared__ __align__(1024) uint8_t wgmma_smem_raw[];
  const uint32_t smem = (SharedAddress(wgmma_smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int unit = n_tile * 2 + (warp >> 2);
  const int n_sub = p.n / 16;
  const int sub0 = unit * p.unit_mult + (warp & 3);
  const int sub[2] = {sub0, sub0 + p.sub_stride};
  // A unit past the end (odd unit count) or a second tile past N (GEMM2 with N % 128 == 64)
  // computes on subtile 0's weights and stores nothing: branching around the MMAs would make
  // ptxas serialize every wgmma of the kernel.
  const bool tile_ok[2] = {unit < p.units, unit < p.units && sub[1] - (warp & 3) + 3 < n_sub};
  const int chunks = p.k / 64;

  // This thread's pieces of the token tile: rows (tid / 8) + 32 i, 16-byte piece tid % 8, at
  // tile_off + 4096 i in a stage. Padding rows read nothing (source size 0) from row 0.
  const int piece = tid & 7;
  const int row_in_atom = (tid >> 3) & 7;
  const uint32_t tile_off = (tid >> 6) * 1024 + row_in_atom * 128 + ((piece ^ row_in_atom) << 4);
  constexpr int kPieces = kN / 32;
  const T* xcur[kPieces];
  uint32_t xbytes[kPieces];
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    const int id = BlockRow(p, blk, kN, (tid >> 3) + 32 * i);
    const bool ok = id < p.num_rows;
    xbytes[i] = ok ? 16 : 0;
    xcur[i] = reinterpret_cast<const T*>(p.x) +
              (ok ? static_cast<int64_t>(id / p.in_div) * p.ld_x : 0) + 8 * piece;
  }
  const uint4* wcur[2];
  const uint32_t* scale_base[2];
  const uint32_t* zero_base[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int s = tile_ok[j] ? sub[j] : 0;
    wcur[j] = p.w + (static_cast<int64_t>(expert) * n_sub + s) * chunks * 32 + lane;
    const int64_t row = static_cast<int64_t>(expert) * p.groups * n_sub * 8 + s * 8 + g;
    scale_base[j] = p.scales + row;
    zero_base[j] = p.zeros ? p.zeros + row : nullptr;
  }
  const uint32_t group_stride = static_cast<uint32_t>(n_sub) * 8;
  const uint32_t weight_off = Tile::kStageTokens + (warp * 2 * 32 + lane) * 16;  // tile j: + 512 j
  const uint32_t word_off = Tile::kStageTokens + kWgStageWeights + tid * 4;  // word q: + 1024 q
  // Chunks are issued in order, each from the cursors, which then move one chunk on.
  auto issue = [&](int kc, uint32_t st) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      CpAsyncSharedOrZero(st + tile_off + 4096 * i, xcur[i], xbytes[i]);
      xcur[i] += 64;
    }
    const uint32_t goff = static_cast<uint32_t>(p.per_group(kc * 64 + 16 * t)) * group_stride;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      CpAsyncSharedStream(st + weight_off + 512 * j, wcur[j]);
      wcur[j] += 32;
      CpAsyncShared4(st + word_off + 1024 * j, scale_base[j] + goff);
      if (zero_base[j]) CpAsyncShared4(st + word_off + 1024 * (2 + j), zero_base[j] + goff);
    }
  };

  uint32_t write_stage = smem;
#pragma unroll
  for (int s = 0; s < kWgmmaAhead; ++s) {
    if (s < chunks) issue(s, write_stage);
    CpAsyncCommit();
    write_stage += Tile::kStageBytes;
  }
  const uint32_t last_stage = smem + (kWgmmaStages - 1) * Tile::kStageBytes;
  uint32_t read_stage = smem;

  float acc[2][kN / 2];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[j][i] = 0.0f;
  uint32_t a[4][2][4];  // [k-step][tile][register]

  for (int c = 0; c < chunks; ++c) {
    CpAsyncWait<kWgmmaAhead - 1>();  // this thread's pieces of chunk c have landed
    FenceProxyAsync();               // ... and are visible to the tensor cores
    __syncthreads();  // every thread's pieces landed; chunk c - 2's MMAs are done everywhere
    if (c + kWgmmaAhead < chunks) issue(c + kWgmmaAhead, write_stage);
    CpAsyncCommit();
    write_stage = write_stage == last_stage ? smem : write_stage + Tile::kStageBytes;
    const uint32_t st = read_stage;
    read_stage = read_stage == last_stage ? smem : read_stage + Tile::kStageBytes;
    // At most kWgmmaInFlight <= 3 groups of chunk c - 1 are still running at chunk c's barrier,
    // so chunk c - 2's stage is free to refill.
    WgmmaChunk<T, kCode, kN>(st, weight_off, word_off, p.zeros != nullptr, acc, a);
  }
  WgmmaWait<0>();
  FenceAccumulators(acc[0]);
  FenceAccumulators(acc[1]);

  // Epilogue, staged in the drained pipeline stages. The tensor cores idle until the CTA exits,
  // so its instructions count.
  static_assert(kN * kWgOutRowBytes <= kWgmmaStages * Tile::kStageBytes &&
                    kN * kWgRoundedRowBytes <= kWgmmaStages * Tile::kStageBytes,
                "the output tile fits in the pipeline stages");
  const auto sync = [] {
    CpAsyncWait<0>();  // the last groups are empty, but no copy may land in the reused stages
    __syncthreads();   // every warp has read its last stage
  };
  StoreWgmmaTile<T, kN, kN>(p, smem, blk, expert, n_tile, acc, tile_ok, sub, tid, sync);
}

template <typename T, NibbleCode kCode, bool kExpertBlockFastest, int kN>
void LaunchWgmmaKernel(const MoeGemmArgs& args, dim3 grid, cudaStream_t stream) {
  // Once per instantiation and device (device_cache.cuh); a failure shows as the launch's.
  static SmemOptInTable opted_in;
  (void)EnsureDynamicSmem(opted_in, MoeInt4WgmmaKernel<T, kCode, kExpertBlockFastest, kN>,
                          WgmmaTile<kN>::kSmemBytes);
  LaunchAfterPrior(MoeInt4WgmmaKernel<T, kCode, kExpertBlockFastest, kN>, grid,
                   dim3(kWgmmaThreads), WgmmaTile<kN>::kSmemBytes, stream, args);
}

template <typename T, NibbleCode kCode, int kN>
void LaunchWgmmaTile(const MoeGemmArgs& args, int max_blocks, int n_tiles, cudaStream_t stream) {
  // GEMM2 (rows out) runs N tiles fastest; grid.y holds at most 65535 expert blocks.
  if (args.epilogue != EpilogueKind::kActivation && max_blocks <= 65535) {
    LaunchWgmmaKernel<T, kCode, false, kN>(args, dim3(n_tiles, max_blocks), stream);
  } else {
    LaunchWgmmaKernel<T, kCode, true, kN>(args, dim3(max_blocks, n_tiles), stream);
  }
}

}  // namespace jax_moeq::cuda
