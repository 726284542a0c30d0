// Plain launcher interface of the GPU W4A8 fused MoE (int4 weights, dynamic per-token int8
// activations on Hopper int8 tensor cores; SPEC §3-4). No XLA types.
//
// Packed weights of one GEMM of N outputs and K inputs (jax_moeq/ops/w4a8_gpu.py writes them):
//   w       uint32 [E][N/16][K/128][32 lanes][8 words]: lane (g, t) of a 16-row subtile, word
//           2s + j of 128-deep chunk c: byte b holds (low nibble) row g and (high nibble) row
//           g + 8, input 128c + 32s + 16j + 4t + b, as two's-complement nibbles.
//   scales  f32 [E][N/16][G][16]: entry 2i + h = sw[16 nt + i + 8h][group] / 16 (the kernel's
//           int8 weights are 16 q, see w4a8_moe.cu).
//   row_corr f32 [E][N]: sum_g sw[n][g] * sum_{k in g} q[n][k] (as the CPU layout).
//   bias    f32 [E][N] (has_bias).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jax_moeq::cuda {

enum class W4a8Dtype { kF32, kBF16, kF16 };

struct W4a8MoeProblem {
  W4a8Dtype dtype = W4a8Dtype::kBF16;
  int64_t tokens = 0;        // T
  int64_t top_k = 1;         // K
  int64_t experts = 0;       // E
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int64_t groups13 = 1;      // scale groups along H (1: channel-wise)
  int64_t groups2 = 1;       // scale groups along I
  int activation = 0;        // 0/2: silu(g)*u, 1: swigluoai
  bool has_bias = false;
  bool weight_on_input = false;  // apply_router_weight_on_input
  int64_t block_m = 128;     // tokens per expert block of the GEMMs: 128, 64 or 32

  // Inputs.
  const void* x = nullptr;               // [T, H]
  const int32_t* topk_ids = nullptr;     // [T, K]
  const float* topk_weights = nullptr;   // [T, K]
  const void* w13 = nullptr;             // see above, N = 2I, K = H
  const float* s13 = nullptr;
  const float* rc13 = nullptr;
  const float* b13 = nullptr;
  const void* w2 = nullptr;              // N = H, K = I
  const float* s2 = nullptr;
  const float* rc2 = nullptr;
  const float* b2 = nullptr;

  // Output and scratch (sizes: the functions below).
  void* out = nullptr;                   // [T, H]
  int32_t* sorted_ids = nullptr;         // [W4a8MoeMaxPadded]
  int32_t* expert_ids = nullptr;         // [W4a8MoeMaxBlocks]
  int32_t* num_post_padded = nullptr;    // [1]
  int8_t* qx = nullptr;                  // [W4a8MoeInputRows, H]
  float* x_params = nullptr;             // [W4a8MoeInputRows, 2]: (scale, zero point)
  void* act = nullptr;                   // [R, I] in x's dtype
  int8_t* qact = nullptr;                // [R, I]
  float* act_params = nullptr;           // [R, 2]
  void* ws2 = nullptr;                   // [R, H] in x's dtype (GEMM2's rows, rounded)
};

// R = T * K (token, slot) pairs.
int64_t W4a8MoeRows(const W4a8MoeProblem& p);
// Rows GEMM1 quantizes: T (per token), or T * K when the router weight is applied on the input.
int64_t W4a8MoeInputRows(const W4a8MoeProblem& p);
int64_t W4a8MoeMaxPadded(const W4a8MoeProblem& p);
int64_t W4a8MoeMaxBlocks(const W4a8MoeProblem& p);

// Shape rules the kernels need; empty string when fine.
std::string ValidateW4a8MoeProblem(const W4a8MoeProblem& p);

// Enqueues the whole op on `stream`; returns an error message or "".
std::string RunW4a8Moe(const W4a8MoeProblem& p, cudaStream_t stream);

// The op's activation quantizer alone (SPEC §3): rows of x [rows, cols] -> q int8 [rows, cols],
// params [rows, 2] = (scale, zero point as a float).
std::string RunW4a8QuantizeRows(W4a8Dtype dtype, const void* x, int64_t rows, int64_t cols,
                                int8_t* q, float* params, cudaStream_t stream);

}  // namespace jax_moeq::cuda
