// Plain launcher interface of the GPU MxInt4 fused MoE (no XLA types):
// routing of router logits on the GPU, then the int4 GEMM core of
// moe_int4_gemm.cuh with signed int4 weights and bf16 scales per 32 inputs.
// Weight layout: int4_mma_core.cuh (nibbles are two's complement here).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jax_moeq::cuda {

// FlashInfer's RoutingMethodType values (SPEC §5).
enum class MxInt4Routing : int {
  kDefault = 0,           // softmax over all experts -> top-k
  kRenormalize = 1,       // top-k of logits -> softmax over the k
  kDeepSeekV3 = 2,        // sigmoid, + bias, top-2 sum per group, best groups, top-k
  kLlama4 = 3,            // top-1 of logits, sigmoid of it
  kRenormalizeNaive = 4,  // softmax -> top-k -> divide by the sum of the k
  kTopK = 5,              // top-k of logits, raw logits as weights
  kSigmoidRenorm = 6,     // sigmoid -> top-k -> divide by the sum of the k
  kMiniMax2 = 7,          // sigmoid, top-k of (+ bias), sigmoid over (sum + 1e-20)
  kSigmoid = 8,           // sigmoid -> top-k
};

constexpr int kMxInt4MaxExperts = 1024;  // 32 experts per lane of a routing warp
constexpr int kMxInt4MaxTopK = 32;
constexpr int kMxInt4MaxGroups = 32;

struct MxInt4MoeProblem {
  int64_t tokens = 0;         // T
  int64_t num_experts = 0;    // E routed over (router_logits columns)
  int64_t local_experts = 0;  // experts held here (weights' leading axis)
  int64_t local_offset = 0;   // global id of local expert 0
  int64_t top_k = 1;
  int64_t hidden = 0;         // H
  int64_t intermediate = 0;   // I
  int routing_method = 1;
  int num_expert_group = 1;   // DeepSeekV3 groups (1: no grouping)
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;
  bool logits_bf16 = false;   // router logits bf16 (else f32)
  int block_m = 8;            // 8, 16, 32 or 64
  int split13 = 1;
  int split2 = 1;
  int mainloop = 0;           // GemmMainloop: 0 registers, 1 cp.async ring (block_m <= 32), 3 wgmma
  bool one_token = false;     // the decode path without alignment (DecodesWithoutAlignment holds)
  bool fused_decode = false;  // after routing, the layer as one kernel (moe_int4_decode.cuh)

  // Inputs.
  const void* x = nullptr;           // bf16 [T, H]
  const void* logits = nullptr;      // f32 | bf16 [T, E]
  const float* bias = nullptr;       // [E] (DeepSeekV3 correction bias) or null
  const void* w13 = nullptr;         // uint4 [L][2I/16][H/64][32]
  const void* s13 = nullptr;         // uint32 [L][H/32][2I/16][8]
  const void* w2 = nullptr;          // uint4 [L][H/16][I/64][32]
  const void* s2 = nullptr;          // uint32 [L][I/32][H/16][8]

  // Outputs and scratch.
  void* out = nullptr;               // bf16 [T, H]
  int32_t* topk_ids = nullptr;       // [T, K] global ids
  float* topk_weights = nullptr;     // [T, K]
  int32_t* local_ids = nullptr;      // [T, K] id - offset, or -1 outside this rank
  int32_t* sorted_ids = nullptr;     // [MxInt4MoeMaxPadded]
  int32_t* expert_ids = nullptr;     // [MxInt4MoeMaxBlocks]
  int32_t* num_post_padded = nullptr;  // [1]
  void* act = nullptr;               // bf16 [T*K, I]
  float* ws13 = nullptr;             // [T*K, 2I] (split13 > 1), then counters (MxInt4MoeWs13Floats)
  float* ws2 = nullptr;              // [T*K, H], then H / 32 int32 counters (MxInt4MoeWs2Floats)
  void* x_perm = nullptr;            // bf16 [T, H]: x in logical chunk order (block_m 128)
};

int64_t MxInt4MoeMaxPadded(const MxInt4MoeProblem& p);
int64_t MxInt4MoeMaxBlocks(const MxInt4MoeProblem& p);
// Rows of x_perm the call writes: every token for the wgmma GEMM (block_m 128), else none.
int64_t MxInt4MoePermutedRows(const MxInt4MoeProblem& p);
// Floats of ws13 (0 when GEMM1 is unsplit): GEMM1's split-K f32 rows (T*K x 2I), then, on the
// one-token decode path, the fused activation's arrival counters (T*K x I / 16).
int64_t MxInt4MoeWs13Floats(const MxInt4MoeProblem& p);
// Floats of ws2: GEMM2's f32 rows (T*K x H), then the fused finalize's arrival counters (H / 32)
// of the one-token decode path.
int64_t MxInt4MoeWs2Floats(const MxInt4MoeProblem& p);

// Shape and routing-argument rules; empty string when fine.
std::string ValidateMxInt4MoeProblem(const MxInt4MoeProblem& p);

// The routing half of those rules (tokens, experts, top_k, local range, method and its
// arguments): all that RunMxInt4Routing needs.
std::string ValidateMxInt4Routing(const MxInt4MoeProblem& p);

// Routing only: logits -> topk_ids, topk_weights, local_ids. Extra CTAs of the same launch
// zero zero[0, zero_count) (a workspace of the next kernel), when given.
std::string RunMxInt4Routing(const MxInt4MoeProblem& p, cudaStream_t stream,
                             float* zero = nullptr, int64_t zero_count = 0);

// Routing, alignment, GEMM1 + SwiGLU, GEMM2, weighting and reduction over k.
std::string RunMxInt4Moe(const MxInt4MoeProblem& p, cudaStream_t stream);

}  // namespace jax_moeq::cuda
