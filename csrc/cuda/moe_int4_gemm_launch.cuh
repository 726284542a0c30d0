// The one GEMM launch of the int4 ops (WNA16, MxInt4, the WNA16 linear): the launch attributes
// checks, and the choice between the mma.sync GEMM (moe_int4_gemm.cuh), the wgmma GEMM
// (moe_int4_wgmma.cuh) and its persistent warp-specialised form (moe_int4_wgmma_ws.cuh). No XLA
// types.
#pragma once

#include <string>
#include <type_traits>

#include "cuda/moe_int4_gemm.cuh"
#include "cuda/moe_int4_wgmma.cuh"
#include "cuda/moe_int4_wgmma_ws.cuh"

namespace jax_moeq::cuda {

// f(std::integral_constant<int, kN>) for the token tile kN = block_m (128, 64, else 32).
template <typename F>
void WithTokenTile(int block_m, F&& f) {
  if (block_m == 128) {
    f(std::integral_constant<int, 128>{});
  } else if (block_m == 64) {
    f(std::integral_constant<int, 64>{});
  } else {
    f(std::integral_constant<int, 32>{});
  }
}

// Host: one launch of the wgmma GEMM (token tile block_m: 32, 64 or 128). `args` carries the
// per-warp unit geometry of the mma.sync kernel (GEMM1: unit_mult 1, sub_stride N/32; GEMM2:
// unit_mult 2, sub_stride 1); it becomes the per-warpgroup geometry here. Split-K does not apply
// (splits must be 1).
template <typename T, NibbleCode kCode>
void LaunchMoeInt4Wgmma(const MoeGemmArgs& group_args, int max_blocks, cudaStream_t stream) {
  MoeGemmArgs args = group_args;
  args.per_group = MakeFastDiv(static_cast<uint32_t>(args.k / args.groups));
  const int n_sub = args.n / 16;
  if (args.unit_mult == 1) {  // GEMM1: gate subtiles 4u..4u+3 and the up subtiles N/32 later
    args.units = n_sub / 2 / 4;
    args.unit_mult = 4;
  } else {  // GEMM2: subtiles 8u..8u+7
    args.units = (n_sub + 7) / 8;
    args.unit_mult = 8;
    args.sub_stride = 4;
  }
  const int n_tiles = (args.units + 1) / 2;
  const bool persistent = args.mainloop == GemmMainloop::kWgmmaWs;
  WithTokenTile(args.block_m, [&](auto tile) {
    constexpr int kN = decltype(tile)::value;
    if (persistent) {
      LaunchWgmmaWsTile<T, kCode, kN>(args, max_blocks, n_tiles, stream);
    } else {
      LaunchWgmmaTile<T, kCode, kN>(args, max_blocks, n_tiles, stream);
    }
  });
}

// Whether a GemmMainloop code names a wgmma main loop (kWgmma, kWgmmaWs).
inline bool IsWgmmaMainloop(int mainloop) {
  return mainloop == static_cast<int>(GemmMainloop::kWgmma) ||
         mainloop == static_cast<int>(GemmMainloop::kWgmmaWs);
}

// Whether a launch runs a wgmma GEMM: always at block_m 128, and at 32 / 64 with a wgmma main
// loop. Its inputs are then in logical chunk order (PermuteRowsKernel) for both GEMMs.
inline bool UsesWgmma(int block_m, int mainloop) {
  return block_m == kWgmmaBlockM || IsWgmmaMainloop(mainloop);
}

// The launch attributes both ops accept: block_m 8..64 (mma.sync) or 128 (wgmma, no split-K),
// split factors >= 1, a GemmMainloop code (a wgmma one: block_m 32, 64 or 128, no split-K; the
// one-token streaming kernels: only on the one-token path). Empty string when fine.
inline std::string ValidateMoeGemmLaunch(int block_m, int split13, int split2, int mainloop,
                                         bool one_token = false) {
  if (block_m != 8 && block_m != 16 && block_m != 32 && block_m != 64 && block_m != kWgmmaBlockM) {
    return "block_m must be 8, 16, 32, 64 or 128";
  }
  if (mainloop < 0 || mainloop > 5) {
    return "mainloop must be 0 (registers), 1 (async ring), 2 (bulk copy), 3 (wgmma), 4 "
           "(wgmma_ws) or 5 (stream)";
  }
  if (mainloop == static_cast<int>(GemmMainloop::kOneTokenStream) && !one_token) {
    return "the stream main loop (mainloop 5) runs only on the one-token decode path";
  }
  if (IsWgmmaMainloop(mainloop) && block_m < 32) {
    return "the wgmma main loops take block_m 32, 64 or 128";
  }
  if (UsesWgmma(block_m, mainloop) && (split13 != 1 || split2 != 1)) {
    return "the wgmma GEMM (block_m 128 or the wgmma main loop) does not split K: split factors "
           "must be 1";
  }
  if (split13 < 1 || split2 < 1 || split13 > kMaxSplitK || split2 > kMaxSplitK) {
    return "split factors must be in [1, " + std::to_string(kMaxSplitK) + "]";
  }
  return "";
}

// The one GEMM launch of both ops: the wgmma GEMM at block_m 128 or with the kWgmma main loop,
// its persistent warp-specialised form with kWgmmaWs, else the mma.sync GEMM.
template <typename T, NibbleCode kCode>
void LaunchMoeInt4GemmOrWgmma(const MoeGemmArgs& args, int max_blocks, cudaStream_t stream) {
  if (UsesWgmma(args.block_m, static_cast<int>(args.mainloop))) {
    LaunchMoeInt4Wgmma<T, kCode>(args, max_blocks, stream);
  } else {
    LaunchMoeInt4Gemm<T, kCode>(args, max_blocks, stream);
  }
}

}  // namespace jax_moeq::cuda
