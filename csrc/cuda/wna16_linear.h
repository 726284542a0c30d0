// Plain launcher interface of the GPU WNA16 dense linear (no XLA types):
// out[M, N] = round(x[M, K] . dequant(W[N, K])^T + bias), dequant(w) = round((q - z) * s) in x's
// dtype, f32 accumulation (SPEC §12). It runs the fused MoE's GEMMs (moe_int4_gemm.cuh, the
// mma.sync GEMM; moe_int4_wgmma.cuh, the wgmma GEMM) on a dense problem: one "expert" holding
// every row in order (MoeGemmArgs::dense_rows), no alignment, no activation, no top-k weights.
// Layouts: those of one expert of wna16_moe.h's GEMM2 (int4_mma_core.cuh, docs/gpu_notes.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/wna16_moe.h"  // HalfKind

namespace jax_moeq::cuda {

struct Wna16LinearProblem {
  HalfKind dtype = HalfKind::kBF16;
  int64_t rows = 0;          // M
  int64_t in_features = 0;   // K
  int64_t out_features = 0;  // N
  int64_t groups = 1;        // scale groups along K (1: channel-wise)
  int block_m = 8;           // rows per block: 8, 16, 32 or 64 (mma.sync), or 128 (wgmma)
  int split = 1;             // split-K factor (mma.sync GEMM only; > 1 accumulates in ws)
  int mainloop = 0;          // GemmMainloop: 0 registers, 1 cp.async ring, 2 bulk copy, 3 wgmma
  bool has_zeros = false;
  bool has_bias = false;
  bool act_order = false;

  // Inputs.
  const void* x = nullptr;       // [M, K]
  const void* w = nullptr;       // uint4 [N/16][K/64][32]
  const void* scales = nullptr;  // uint32 [G][N/16][8]: (s[row g], s[row g+8]) halves
  const void* zeros = nullptr;   // same layout as scales, zero points as nibble values
  const float* bias = nullptr;   // [N] (has_bias)
  const int32_t* perm = nullptr;  // [K] sorted input channel -> channel (act_order)

  // Output and scratch (sizes: Wna16LinearPermutedRows, Wna16LinearWsFloats).
  void* out = nullptr;     // [M, N]
  void* x_perm = nullptr;  // [M, K]: act-order and/or the wgmma GEMM's chunk order
  float* ws = nullptr;     // split > 1: [M, N] f32 accumulators, then N / 32 arrival counters
};

// Whether the call runs the wgmma GEMM (block_m 128 or the wgmma main loop).
bool Wna16LinearUsesWgmma(const Wna16LinearProblem& p);
// Rows of x_perm the call writes: M under act-order or on the wgmma GEMM, else 0.
int64_t Wna16LinearPermutedRows(const Wna16LinearProblem& p);
// Floats of ws: M x N accumulators and N / 32 counters when split > 1, else 0.
int64_t Wna16LinearWsFloats(const Wna16LinearProblem& p);

// Shape and launch rules the kernels need; empty string when fine.
std::string ValidateWna16LinearProblem(const Wna16LinearProblem& p);

// Enqueues the whole op on `stream`; returns an error message or "".
std::string RunWna16Linear(const Wna16LinearProblem& p, cudaStream_t stream);

}  // namespace jax_moeq::cuda
