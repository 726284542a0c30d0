// The persistent, warp-specialised form of the wgmma GEMM (GemmMainloop::kWgmmaWs): the same
// tiles, stage layout, dequantization and MMAs as MoeInt4WgmmaKernel (moe_int4_wgmma.cuh), fed by
// a producer warpgroup instead of by the MMA warps themselves. No XLA types.
//
// CTA: 384 threads; one CTA per SM (two with the 32-token tile), as many as fit at once (fewer when
// there are fewer tiles).
//  - Warpgroup 0, the producer (40 registers after setmaxnreg): for every (expert block, N tile)
//    of the CTA, for every 64-deep chunk, waits until a stage of the ring is empty, then copies the
//    token tile, every consumer warp's weight fragments and every consumer lane's scale / zero
//    words into it with cp.async; each producer thread's arrival on the stage's full barrier
//    lands once its copies have (cp.async.mbarrier.arrive.noinc).
//  - Warpgroups 1 and 2, the consumers (232 registers; 96 with two CTAs per SM): the two
//    warpgroups of MoeInt4WgmmaKernel.
//    Each waits on a stage's full barrier, runs the chunk (WgmmaChunk) and gives the stage of the
//    chunk before back (one arrival per warp on its empty barrier) once that chunk's MMAs are done.
//  - Tiles are dealt round-robin (tile = blockIdx.x + i * gridDim.x) over the expert blocks in use
//    (num_post_padded read once), in the order of MoeInt4WgmmaKernel's grid: expert blocks fastest
//    for GEMM1, N tiles fastest for GEMM2. The ring runs across tiles, so the producer loads the
//    next tile's first chunks while the consumers finish this tile and run its epilogue.
//  - The epilogue stages its output in an area of its own past the ring (the ring stays in use),
//    meeting at a named barrier of the 256 consumer threads; GEMM2's rounded store stages 64 tokens
//    per pass. The arithmetic and rounding points are those of MoeInt4WgmmaKernel: the results are
//    bit-identical to it.
#pragma once

#include "cuda/moe_int4_wgmma.cuh"

namespace jax_moeq::cuda {

constexpr int kWsThreads = 384;
constexpr int kWsProducerThreads = 128;
constexpr int kWsConsumerThreads = 256;
constexpr int kWsConsumerWarps = kWsConsumerThreads / 32;
constexpr int kWsProducerRegisters = 40;
constexpr int kWsConsumerRegisters = 232;
static_assert(kWsProducerThreads * kWsProducerRegisters +
                      kWsConsumerThreads * kWsConsumerRegisters <= 65536,
              "the register file holds both roles");
// Named barriers (0 is __syncthreads): the consumers' epilogue, the producer warpgroup, and each
// consumer warpgroup.
constexpr int kWsEpilogueBarrier = 1;
constexpr int kWsProducerBarrier = 2;
constexpr int kWsConsumerGroupBarrier = 3;  // + the consumer warpgroup (0, 1)

template <int kN>
struct WgmmaWsTile {
  using Tile = WgmmaTile<kN>;
  // Two CTAs per SM for the 32-token tile (four MMA warpgroups, as MoeInt4WgmmaKernel has there):
  // WNA16 Qwen3-30B-A3B T=256 ran at 1.06x MoeInt4WgmmaKernel's time with two CTAs of 4 stages
  // (H200), 1.12x with one of 8 (H100; 2026-11-27, docs/performance.md).
  static constexpr int kCtasPerSm = kN == 32 ? 2 : 1;
  // Stages: as many as fit beside the epilogue's staging area in 227 KB.
  static constexpr int kStages = kN == 128 ? 5 : kN == 64 ? 7 : 4;
  static constexpr int kPassTokens = kN < 64 ? kN : 64;
  static constexpr int kActivationBytes = kN * kWgOutRowBytes;
  static constexpr int kRoundedBytes = kPassTokens * kWgRoundedRowBytes;
  static constexpr int kEpilogueBytes =
      kActivationBytes > kRoundedBytes ? kActivationBytes : kRoundedBytes;
  static constexpr int kEpilogueOffset = kStages * Tile::kStageBytes;
  static constexpr int kBarrierOffset = kEpilogueOffset + kEpilogueBytes;
  static constexpr int kSmemBytes = kBarrierOffset + 2 * kStages * 8 + 1024;  // + alignment slack
  static_assert(kEpilogueBytes % 16 == 0, "16-byte aligned barriers");
  static_assert(kSmemBytes * kCtasPerSm <= 227 * 1024, "within the shared memory of sm_90");
  // Two CTAs: 80 registers a thread at launch; the producer's 40 given up make 96 (no spills).
  static constexpr int kConsumerRegisters = kCtasPerSm == 2 ? 96 : kWsConsumerRegisters;
};

template <int kRegisters>
__device__ __forceinline__ void SetMaxRegistersIncrease() {
#if JAX_MOEQ_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void SetMaxRegistersDecrease() {
#if JAX_MOEQ_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
#endif
}

__device__ __forceinline__ void ConsumerBarrier() {
  asm volatile("bar.sync %0, %1;" ::"n"(kWsEpilogueBarrier), "n"(kWsConsumerThreads) : "memory");
}

// Waits for `bar`'s phase `parity` with one polling thread (the group's first) while the group's
// other warps wait at a named barrier of `threads` threads, so that waiting warps do not poll.
// Every warp polling measured the same (H200, 2026-11-27: within 1 % at T = 256-4096).
__device__ __forceinline__ void WaitAsGroup(uint64_t* bar, uint32_t parity, bool poller,
                                            int barrier_id, int threads) {
  if (poller) MbarrierWait(bar, parity);
  asm volatile("bar.sync %0, %1;" ::"r"(barrier_id), "r"(threads) : "memory");
}

// Expert blocks in use: those below the padded end (the sorted format), or every row block.
__device__ __forceinline__ int WsBlocksInUse(const MoeGemmArgs& p, int block_m, int max_blocks) {
  const int rows = p.dense_rows ? p.num_rows : __ldg(p.num_post_padded);
  return min(max_blocks, (rows + block_m - 1) / block_m);
}

template <bool kExpertBlockFastest>
__device__ __forceinline__ void WsTileCoordinates(int tile, int blocks, int n_tiles, int* blk,
                                                  int* n_tile) {
  if (kExpertBlockFastest) {
    *blk = tile % blocks;
    *n_tile = tile / blocks;
  } else {
    *blk = tile / n_tiles;
    *n_tile = tile % n_tiles;
  }
}

// Subtile of a consumer warp's tile j (0: sub0, 1: sub0 + sub_stride) in N tile n_tile; a tile
// that stores nothing (odd unit count, or past N) reads subtile 0. Producer and consumers agree
// through this one function. It repeats the placement written out in MoeInt4WgmmaKernel, which
// keeps its own form until a GPU run checks a change there.
__device__ __forceinline__ int WsSubtile(const MoeGemmArgs& p, int n_tile, int consumer_warp,
                                         int j, bool* ok) {
  const int n_sub = p.n / 16;
  const int unit = n_tile * 2 + (consumer_warp >> 2);
  const int sub0 = unit * p.unit_mult + (consumer_warp & 3);
  const bool tile_ok =
      unit < p.units && (j == 0 || sub0 + p.sub_stride - (consumer_warp & 3) + 3 < n_sub);
  if (ok) *ok = tile_ok;
  return tile_ok ? sub0 + j * p.sub_stride : 0;
}

template <typename T, bool kExpertBlockFastest, int kN>
__device__ __forceinline__ void WsProduce(const MoeGemmArgs& p, uint32_t smem, uint64_t* full,
                                          uint64_t* empty, int blocks, int n_tiles) {
  using Tile = WgmmaTile<kN>;
  using Ws = WgmmaWsTile<kN>;
  const int ptid = threadIdx.x;  // 0 .. 127
  const int n_sub = p.n / 16;
  const int chunks = p.k / 64;
  const int tiles = blocks * n_tiles;
  // Token pieces: rows (ptid / 8) + 16 i, 16-byte piece ptid % 8, swizzled as in the stage.
  const int piece = ptid & 7;
  const int row_in_atom = (ptid >> 3) & 7;
  const uint32_t tile_off = (ptid >> 6) * 1024 + row_in_atom * 128 + ((piece ^ row_in_atom) << 4);
  constexpr int kTokenPieces = kN / 16;
  // Scale / zero words: consumer threads ptid and ptid + 128 (h), tiles j; word t of the lane.
  const uint32_t group_stride = static_cast<uint32_t>(n_sub) * 8;
  int stage = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int blk, n_tile;
    WsTileCoordinates<kExpertBlockFastest>(tile, blocks, n_tiles, &blk, &n_tile);
    const int expert = BlockExpert(p, blk, kN);
    if (expert < 0) continue;
    uint32_t x_off[kTokenPieces];  // element offsets into x; ~0u: a padding row (zero-filled)
#pragma unroll
    for (int i = 0; i < kTokenPieces; ++i) {
      const int id = BlockRow(p, blk, kN, (ptid >> 3) + 16 * i);
      const int64_t row = static_cast<int64_t>(id / p.in_div) * p.ld_x;
      x_off[i] = id < p.num_rows ? static_cast<uint32_t>(row) + 8 * piece : ~0u;
    }
    // Weight fragments: pieces q = ptid + 128 m of the stage's 512 (consumer warp q / 64, tile
    // (q / 32) % 2, lane q % 32), each 16 bytes of a 512-byte chunk of its subtile. (Bulk copies
    // of the 16 whole 512-byte chunks from one warp ran 1.4-1.6x slower, H200, 2026-11-27.)
    const uint4* w_expert = p.w + static_cast<int64_t>(expert) * n_sub * chunks * 32;
    uint32_t w_off[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int q = ptid + 128 * m;
      const int s = WsSubtile(p, n_tile, q >> 6, (q >> 5) & 1, nullptr);
      w_off[m] = static_cast<uint32_t>(s) * chunks * 32 + (q & 31);
    }
    const int64_t words_expert = static_cast<int64_t>(expert) * p.groups * n_sub * 8;
    uint32_t word_row[2][2];  // [h][j]
    int word_t[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ctid = ptid + 128 * h, cw = ctid >> 5, lane = ctid & 31;
      word_t[h] = lane & 3;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int s = WsSubtile(p, n_tile, cw, j, nullptr);
        word_row[h][j] = static_cast<uint32_t>(s) * 8 + (lane >> 2);
      }
    }
    for (int kc = 0; kc < chunks; ++kc) {
      // The consumers gave the stage back.
      WaitAsGroup(&empty[stage], phase ^ 1, ptid == 0, kWsProducerBarrier, kWsProducerThreads);
      const uint32_t st = smem + stage * Tile::kStageBytes;
      const T* x = reinterpret_cast<const T*>(p.x) + kc * 64;
#pragma unroll
      for (int i = 0; i < kTokenPieces; ++i) {
        const bool ok = x_off[i] != ~0u;
        CpAsyncSharedOrZero(st + tile_off + 2048 * i, ok ? x + x_off[i] : p.x, ok ? 16 : 0);
      }
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        CpAsyncSharedStream(st + Tile::kStageTokens + 16 * (ptid + 128 * m),
                            w_expert + w_off[m] + kc * 32);
      }
      const uint32_t words = st + Tile::kStageTokens + kWgStageWeights;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t goff =
            static_cast<uint32_t>(p.per_group(kc * 64 + 16 * word_t[h])) * group_stride;
        const uint32_t dst = words + 4 * (ptid + 128 * h);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          CpAsyncShared4(dst + 1024 * j, p.scales + words_expert + word_row[h][j] + goff);
          if (p.zeros) {
            CpAsyncShared4(dst + 1024 * (2 + j), p.zeros + words_expert + word_row[h][j] + goff);
          }
        }
      }
      CpAsyncArriveNoinc(&full[stage]);
      if (++stage == Ws::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
  CpAsyncWait<0>();  // no copy outlives its thread
}

template <typename T, NibbleCode kCode, bool kExpertBlockFastest, int kN>
__global__ void __launch_bounds__(kWsThreads, WgmmaWsTile<kN>::kCtasPerSm)
    MoeInt4WgmmaWsKernel(MoeGemmArgs p, int max_blocks, int n_tiles) {
  using Tile = WgmmaTile<kN>;
  using Ws = WgmmaWsTile<kN>;
  WaitForPriorGrids();
  AllowDependentGrids();
  extern __shared__ __align__(1024) uint8_t ws_smem_raw[];
  const uint32_t raw = SharedAddress(ws_smem_raw);
  const uint32_t smem = (raw + 1023u) & ~1023u;
  uint64_t* full = reinterpret_cast<uint64_t*>(ws_smem_raw + (smem - raw) + Ws::kBarrierOffset);
  uint64_t* empty = full + Ws::kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Ws::kStages; ++s) {
      MbarrierInit(&full[s], kWsProducerThreads);
      MbarrierInit(&empty[s], kWsConsumerWarps);
    }
  }
  __syncthreads();
  const int blocks = WsBlocksInUse(p, kN, max_blocks);
  const int tiles = blocks * n_tiles;

  if (threadIdx.x < kWsProducerThreads) {
    SetMaxRegistersDecrease<kWsProducerRegisters>();
    WsProduce<T, kExpertBlockFastest, kN>(p, smem, full, empty, blocks, n_tiles);
    return;
  }
  SetMaxRegistersIncrease<Ws::kConsumerRegisters>();
  const int tid = threadIdx.x - kWsProducerThreads, warp = tid >> 5, lane = tid & 31;
  const int chunks = p.k / 64;
  const uint32_t weight_off = Tile::kStageTokens + (warp * 2 * 32 + lane) * 16;
  const uint32_t word_off = Tile::kStageTokens + kWgStageWeights + tid * 4;
  const uint32_t epilogue = smem + Ws::kEpilogueOffset;
  const auto sync = [] { ConsumerBarrier(); };
  int stage = 0;
  uint32_t phase = 0;
  float acc[2][kN / 2];
  uint32_t a[4][2][4];  // [k-step][tile][register]
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int blk, n_tile;
    WsTileCoordinates<kExpertBlockFastest>(tile, blocks, n_tiles, &blk, &n_tile);
    const int expert = BlockExpert(p, blk, kN);
    if (expert < 0) continue;
    bool tile_ok[2];
    const int sub[2] = {WsSubtile(p, n_tile, warp, 0, &tile_ok[0]),
                        WsSubtile(p, n_tile, warp, 1, &tile_ok[1])};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[j][i] = 0.0f;
    int prev = -1;
    for (int kc = 0; kc < chunks; ++kc) {
      // Every producer thread's copies have landed.
      WaitAsGroup(&full[stage], phase, (tid & 127) == 0, kWsConsumerGroupBarrier + (warp >> 2),
                  128);
      FenceProxyAsync();                  // ... and are visible to the tensor cores
      WgmmaChunk<T, kCode, kN>(smem + stage * Tile::kStageBytes, weight_off, word_off,
                               p.zeros != nullptr, acc, a);
      // The chunk before's MMAs are done (WgmmaChunk's waits) and its words were read.
      if (prev >= 0) {
        __syncwarp();
        if (lane == 0) MbarrierArrive(&empty[prev]);
      }
      prev = stage;
      if (++stage == Ws::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    WgmmaWait<0>();
    FenceAccumulators(acc[0]);
    FenceAccumulators(acc[1]);
    if (prev >= 0) {
      __syncwarp();
      if (lane == 0) MbarrierArrive(&empty[prev]);
    }

    // Epilogue, staged in the epilogue area.
    StoreWgmmaTile<T, kN, Ws::kPassTokens>(p, epilogue, blk, expert, n_tile, acc, tile_ok, sub,
                                           tid, sync);
  }
}

// Host: the persistent kernel over max_blocks x n_tiles tiles, kCtasPerSm CTAs per SM at most.
template <typename T, NibbleCode kCode, bool kExpertBlockFastest, int kN>
void LaunchWgmmaWsKernel(const MoeGemmArgs& args, int max_blocks, int n_tiles,
                         cudaStream_t stream) {
  static SmemOptInTable opted_in;
  const auto kernel = MoeInt4WgmmaWsKernel<T, kCode, kExpertBlockFastest, kN>;
  (void)EnsureDynamicSmem(opted_in, kernel, WgmmaWsTile<kN>::kSmemBytes);
  DeviceFigures figures;
  const int sms = DeviceFiguresOf(CurrentDevice(), &figures) == cudaSuccess && figures.sms > 0
                      ? figures.sms
                      : 1;
  const int64_t tiles = static_cast<int64_t>(max_blocks) * n_tiles;
  const int ctas = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(int64_t{sms} * WgmmaWsTile<kN>::kCtasPerSm, tiles)));
  LaunchAfterPrior(kernel, dim3(ctas), dim3(kWsThreads), WgmmaWsTile<kN>::kSmemBytes, stream, args,
                   max_blocks, n_tiles);
}

template <typename T, NibbleCode kCode, int kN>
void LaunchWgmmaWsTile(const MoeGemmArgs& args, int max_blocks, int n_tiles,
                       cudaStream_t stream) {
  // GEMM1 (activation out) runs expert blocks fastest, GEMM2 N tiles fastest (MoeInt4WgmmaKernel).
  if (args.epilogue == EpilogueKind::kActivation) {
    LaunchWgmmaWsKernel<T, kCode, true, kN>(args, max_blocks, n_tiles, stream);
  } else {
    LaunchWgmmaWsKernel<T, kCode, false, kN>(args, max_blocks, n_tiles, stream);
  }
}

}  // namespace jax_moeq::cuda
