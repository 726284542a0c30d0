// Plain launcher interface of the GPU WNA16 fused MoE (no XLA types).
// Layouts: see int4_mma_core.cuh (weights) and docs/gpu_notes.md.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jax_moeq::cuda {

enum class HalfKind { kBF16, kF16 };

struct Wna16MoeProblem {
  HalfKind dtype = HalfKind::kBF16;
  bool batched = false;  // x [E, M, H] with expert_num_tokens, else x [T, H] with top-k
  int64_t tokens = 0;    // T (standard) or M = max tokens per expert (batched)
  int64_t top_k = 1;     // K (standard); 1 when batched
  int64_t experts = 0;   // E
  int64_t hidden = 0;    // H
  int64_t intermediate = 0;  // I
  int64_t groups13 = 1;  // scale groups along H (1: channel-wise)
  int64_t groups2 = 1;   // scale groups along I
  int block_m = 8;       // tokens per expert block: 8, 16, 32 or 64
  int split13 = 1;       // split-K factor of GEMM1 (>1 accumulates in ws13)
  int split2 = 1;        // split-K factor of GEMM2
  int activation = 0;    // 0/2: silu(g)*u, 1: swigluoai
  bool has_zeros = false;
  bool has_bias = false;
  bool act_order = false;
  int mainloop = 0;      // GemmMainloop: 0 registers, 1 cp.async ring (block_m <= 32), 3 wgmma
  bool one_token = false;  // the decode path without alignment (DecodesWithoutAlignment holds)
  bool fused_decode = false;  // one_token as one kernel (moe_int4_decode.cuh); needs one_token

  // Inputs.
  const void* x = nullptr;
  const int32_t* topk_ids = nullptr;        // [T, K] (standard)
  const float* topk_weights = nullptr;      // [T, K] (standard)
  const int32_t* expert_num_tokens = nullptr;  // [E] (batched)
  const void* w13 = nullptr;     // uint4 [E][2I/16][H/64][32]
  const void* s13 = nullptr;     // uint32 [E][G13][2I/16][8]: (s[row g], s[row g+8]) halves
  const void* z13 = nullptr;     // same layout as s13, zero points as values (has_zeros)
  const float* b13 = nullptr;    // [E, 2I] (has_bias)
  const void* w2 = nullptr;      // uint4 [E][H/16][I/64][32]
  const void* s2 = nullptr;      // uint32 [E][G2][H/16][8]
  const void* z2 = nullptr;
  const float* b2 = nullptr;     // [E, H]
  const int32_t* perm13 = nullptr;      // [E, H] sorted input channel -> channel (act_order)
  const int32_t* inv_perm2 = nullptr;   // [E, I] channel -> sorted position (act_order)

  // Outputs and scratch (sizes: Wna16MoeScratchSizes).
  void* out = nullptr;           // [T, H] or [E, M, H]
  int32_t* sorted_ids = nullptr;
  int32_t* expert_ids = nullptr;
  int32_t* num_post_padded = nullptr;  // [1]
  void* x_perm = nullptr;        // [R, H] (act_order)
  void* act = nullptr;           // [R, I]
  float* ws13 = nullptr;         // [R, 2I] (split13 > 1), then counters (Wna16MoeWs13Floats)
  float* ws2 = nullptr;          // [R, H], then H / 32 int32 counters (Wna16MoeWs2Floats)
};

// Rows R of the per-pair buffers (T*K or E*M), padded sorted length and blocks.
int64_t Wna16MoeRows(const Wna16MoeProblem& p);
int64_t Wna16MoeMaxPadded(const Wna16MoeProblem& p);
int64_t Wna16MoeMaxBlocks(const Wna16MoeProblem& p);
// Rows of x_perm the op writes: act-order gathers every row's inputs in its expert's order
// (rows); the wgmma GEMM (block_m 128) alone permutes each token's inputs once (T, or rows when
// batched); otherwise none.
int64_t Wna16MoePermutedRows(const Wna16MoeProblem& p);
// Floats of ws13 (0 when GEMM1 is unsplit): GEMM1's split-K f32 rows (R x 2I), then, on the
// one-token decode path, the fused activation's arrival counters (R x I / 16).
int64_t Wna16MoeWs13Floats(const Wna16MoeProblem& p);
// Floats of ws2: GEMM2's f32 rows (R x H), then the fused finalize's arrival counters (H / 32)
// of the one-token decode path.
int64_t Wna16MoeWs2Floats(const Wna16MoeProblem& p);

// Shape rules the kernels need; empty string when fine.
std::string ValidateWna16MoeProblem(const Wna16MoeProblem& p);

// Enqueues the whole op on `stream`; returns an error message or "".
std::string RunWna16Moe(const Wna16MoeProblem& p, cudaStream_t stream);

}  // namespace jax_moeq::cuda
