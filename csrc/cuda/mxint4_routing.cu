// Routing of the MxInt4 MoE on the GPU: router logits [T, E] -> top-k expert
// ids and weights (FlashInfer RoutingMethodType semantics, SPEC §5), plus the
// ids local to this expert-parallel rank (-1 elsewhere) for the alignment.
//
// One warp per token. Lane l owns experts l + 32 j (j < 32, so E <= 1024);
// the token's scores live in shared memory, and a per-lane bit mask marks the
// experts already chosen or outside the kept groups. Each top-k round is a
// warp argmax with ties going to the lower index, as jax.lax.top_k.
#include <cuda_bf16.h>

#include <algorithm>
#include <cfloat>
#include <climits>

#include "cuda/dependent_launch.cuh"
#include "cuda/mxint4_moe.h"
#include "cuda/workspace_zero.cuh"

namespace jax_moeq::cuda {
namespace {

constexpr int kWarpsPerCta = 4;

__device__ __forceinline__ float Sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// (value, index) of the best candidate over the warp; index INT_MAX if none.
__device__ __forceinline__ void WarpBest(float& value, int& index) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, value, offset);
    const int oi = __shfl_xor_sync(0xffffffffu, index, offset);
    const bool better =
        oi != INT_MAX && (index == INT_MAX || ov > value || (ov == value && oi < index));
    if (better) {
      value = ov;
      index = oi;
    }
  }
}

// Unsigned key with the order of the floats (-0 as +0, so equal floats have equal keys).
__device__ __forceinline__ uint32_t OrderedKey(float v) {
  const uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// This lane's best not-excluded expert of vals[0, E) (ties: the lower index), as (key, index);
// (0, INT_MAX) when it has none.
__device__ __forceinline__ void LaneBest(const float* vals, int experts, uint32_t excluded,
                                         int lane, uint32_t& key, int& index) {
  float best = -FLT_MAX;
  index = INT_MAX;
  for (int j = 0; lane + 32 * j < experts; ++j) {
    if ((excluded >> j) & 1u) continue;
    const int i = lane + 32 * j;
    const float v = vals[i];
    if (index == INT_MAX || v > best) {  // increasing i: ties keep the lower index
      best = v;
      index = i;
    }
  }
  key = index == INT_MAX ? 0u : OrderedKey(best);
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

struct RoutingArgs {
  const void* logits;
  bool logits_bf16;
  const float* bias;
  int tokens, experts, top_k, method, groups, topk_group;
  float scale;
  int local_offset, local_experts;
  int32_t* topk_ids;
  float* topk_weights;
  int32_t* local_ids;
  int routing_blocks;  // CTAs that route; those after them zero `zero`
  float* zero;
  int64_t zero_count;
};

__global__ void __launch_bounds__(kWarpsPerCta * 32) MxInt4RoutingKernel(RoutingArgs a) {
  WaitForPriorGrids();
  AllowDependentGrids();
  if (static_cast<int>(blockIdx.x) >= a.routing_blocks) {
    ZeroWorkspaces(a.zero, a.zero_count, nullptr, 0, a.routing_blocks);
    return;
  }
  extern __shared__ float shared[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kWarpsPerCta + warp;
  if (t >= a.tokens) return;  // whole warps exit together
  const int E = a.experts;
  float* score = shared + static_cast<size_t>(warp) * (2 * E + kMxInt4MaxTopK);
  float* choice = score + E;  // the values top-k is taken over
  int* chosen = reinterpret_cast<int*>(choice + E);

  // 1. Logits (f32) -> score (the weights' source) and choice.
  for (int i = lane; i < E; i += 32) {
    const int64_t at = static_cast<int64_t>(t) * E + i;
    score[i] = a.logits_bf16
                   ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(a.logits)[at])
                   : reinterpret_cast<const float*>(a.logits)[at];
  }
  __syncwarp();
  const auto method = static_cast<MxInt4Routing>(a.method);
  if (method == MxInt4Routing::kDefault || method == MxInt4Routing::kRenormalizeNaive) {
    float m = -FLT_MAX;
    for (int i = lane; i < E; i += 32) m = fmaxf(m, score[i]);
    m = WarpMax(m);
    float s = 0.0f;
    for (int i = lane; i < E; i += 32) {
      const float e = expf(score[i] - m);
      score[i] = e;
      s += e;
    }
    s = WarpSum(s);
    for (int i = lane; i < E; i += 32) score[i] = score[i] / s;
  } else if (method == MxInt4Routing::kDeepSeekV3 || method == MxInt4Routing::kSigmoidRenorm ||
             method == MxInt4Routing::kSigmoid || method == MxInt4Routing::kMiniMax2) {
    for (int i = lane; i < E; i += 32) score[i] = Sigmoid(score[i]);
  }
  const bool biased = method == MxInt4Routing::kDeepSeekV3 || method == MxInt4Routing::kMiniMax2;
  for (int i = lane; i < E; i += 32) choice[i] = score[i] + (biased ? a.bias[i] : 0.0f);
  __syncwarp();

  // 2. Groups (DeepSeekV3): keep the topk_group groups with the best top-2 sums.
  uint32_t excluded = 0;
  if (method == MxInt4Routing::kDeepSeekV3 && a.groups > 1) {
    const int per_group = E / a.groups;
    float group_score = -FLT_MAX;
    int group_index = INT_MAX;
    if (lane < a.groups) {
      float b1 = -FLT_MAX, b2 = -FLT_MAX;
      for (int i = lane * per_group; i < (lane + 1) * per_group; ++i) {
        const float v = choice[i];
        if (v > b1) {
          b2 = b1;
          b1 = v;
        } else if (v > b2) {
          b2 = v;
        }
      }
      group_score = b1 + b2;
      group_index = lane;
    }
    uint32_t kept = 0;
    for (int r = 0; r < a.topk_group; ++r) {
      float v = group_score;
      int gi = ((kept >> lane) & 1u) ? INT_MAX : group_index;
      WarpBest(v, gi);
      kept |= 1u << gi;
    }
    for (int j = 0; lane + 32 * j < E; ++j) {
      if (!((kept >> ((lane + 32 * j) / per_group)) & 1u)) excluded |= 1u << j;
    }
  }

  // 3. Top-k rounds: each lane keeps its best candidate; a round takes the warp's largest key, and
  // among equal keys the lowest expert, with two warp reductions (redux.sync: a shuffle tree
  // was ~40 dependent instructions a round); only the winning lane looks for its next best.
  uint32_t key;
  int index;
  LaneBest(choice, E, excluded, lane, key, index);
  for (int r = 0; r < a.top_k; ++r) {
    const uint32_t best_key = __reduce_max_sync(0xffffffffu, key);
    const int best = static_cast<int>(__reduce_min_sync(
        0xffffffffu, key == best_key ? static_cast<uint32_t>(index) : 0xffffffffu));
    if ((best & 31) == lane) {
      excluded |= 1u << (best >> 5);
      LaneBest(choice, E, excluded, lane, key, index);
    }
    if (lane == 0) chosen[r] = best;
  }
  __syncwarp();

  // 4. Weights: lane k < K takes pair k (K <= 32); the normalizer is a warp sum. (Lane 0 alone,
  // one pair after another, made this tail a chain of ~K x 40 dependent instructions.)
  const int K = a.top_k;
  const bool active = lane < K;
  const int id = active ? chosen[lane] : 0;
  const float s = score[id];
  float norm = 1.0f, top = 0.0f;
  if (method == MxInt4Routing::kRenormalize) {
    top = score[chosen[0]];  // the largest chosen logit
    norm = WarpSum(active ? expf(s - top) : 0.0f);
  } else if (method == MxInt4Routing::kDeepSeekV3 || method == MxInt4Routing::kRenormalizeNaive ||
             method == MxInt4Routing::kSigmoidRenorm || method == MxInt4Routing::kMiniMax2) {
    norm = WarpSum(active ? s : 0.0f);
    if (method == MxInt4Routing::kMiniMax2) norm += 1e-20f;
  }
  if (!active) return;
  float w;
  switch (method) {
    case MxInt4Routing::kRenormalize: w = expf(s - top) / norm; break;
    case MxInt4Routing::kDeepSeekV3:
    case MxInt4Routing::kMiniMax2: w = s / norm * a.scale; break;
    case MxInt4Routing::kLlama4: w = Sigmoid(s); break;
    case MxInt4Routing::kRenormalizeNaive:
    case MxInt4Routing::kSigmoidRenorm: w = s / norm; break;
    default: w = s; break;  // Default (softmax prob.), TopK (logit), Sigmoid
  }
  const int64_t at = static_cast<int64_t>(t) * K + lane;
  a.topk_ids[at] = id;
  a.topk_weights[at] = w;
  const int local = id - a.local_offset;
  a.local_ids[at] = (local >= 0 && local < a.local_experts) ? local : -1;
}

}  // namespace

std::string RunMxInt4Routing(const MxInt4MoeProblem& p, cudaStream_t stream, float* zero,
                             int64_t zero_count) {
  if (p.tokens == 0) return "";
  RoutingArgs a;
  a.logits = p.logits;
  a.logits_bf16 = p.logits_bf16;
  a.bias = p.bias;
  a.tokens = static_cast<int>(p.tokens);
  a.experts = static_cast<int>(p.num_experts);
  a.top_k = static_cast<int>(p.top_k);
  a.method = p.routing_method;
  a.groups = p.num_expert_group;
  a.topk_group = p.topk_group;
  a.scale = p.routed_scaling_factor;
  a.local_offset = static_cast<int>(p.local_offset);
  a.local_experts = static_cast<int>(p.local_experts);
  a.topk_ids = p.topk_ids;
  a.topk_weights = p.topk_weights;
  a.local_ids = p.local_ids;
  const size_t smem = kWarpsPerCta * (2 * p.num_experts + kMxInt4MaxTopK) * sizeof(float);
  const int blocks = static_cast<int>((p.tokens + kWarpsPerCta - 1) / kWarpsPerCta);
  a.routing_blocks = blocks;
  a.zero = zero;
  a.zero_count = zero ? zero_count : 0;
  // Zeroing CTAs: ~8 floats a thread, at most kZeroBlocks (they run beside the routing warps).
  const int64_t per_block = int64_t{kWarpsPerCta} * 32 * 8;
  const int zero_blocks = static_cast<int>(
      std::min<int64_t>(kZeroBlocks, (a.zero_count + per_block - 1) / per_block));
  MxInt4RoutingKernel<<<blocks + zero_blocks, kWarpsPerCta * 32, smem, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("routing kernel: ") + cudaGetErrorString(err);
  return "";
}

}  // namespace jax_moeq::cuda
