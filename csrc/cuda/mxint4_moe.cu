// GPU MxInt4 fused MoE launchers: routing (mxint4_routing.cu) -> alignment of
// this rank's (token, slot) pairs to expert blocks -> GEMM1 + SwiGLU -> GEMM2
// -> top-k weighting and reduction over k. The GEMMs are the shared int4 core
// (moe_int4_gemm.cuh) with signed nibbles and bf16 scales per 32 inputs.
#include <algorithm>

#include "cuda/moe_int4_decode.cuh"
#include "cuda/moe_int4_gemm.cuh"
#include "cuda/moe_int4_gemm_launch.cuh"
#include "cuda/moe_int4_one_token.cuh"
#include "cuda/mxint4_moe.h"

namespace jax_moeq::cuda {
namespace {

using Bf16 = __nv_bfloat16;
constexpr int kGroupSize = 32;

// GEMM1 finalize after split-K: act[id][n] = round(silu(round(g)) * round(u)).
__global__ void MxInt4Finalize13Kernel(const float* ws, const int32_t* local_ids, int inter,
                                       int rows, void* act) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int id = blockIdx.x;
  const int n = blockIdx.y * blockDim.x + threadIdx.x;
  if (id >= rows || n >= inter || local_ids[id] < 0) return;
  const float gate = ws[static_cast<int64_t>(id) * 2 * inter + n];
  const float up = ws[static_cast<int64_t>(id) * 2 * inter + inter + n];
  const float a = RoundedActivation<Bf16>(0, gate, up);
  StoreHalf<Bf16>(act, static_cast<int64_t>(id) * inter + n, a);
}

// out[t][n] = round(sum_k round(ws2[t*K+k][n] * w[t][k])) over this rank's
// pairs (f32 sum in slot order); a token with none gets 0.
__global__ void MxInt4FinalizeKernel(const float* ws, const int32_t* local_ids,
                                     int local_experts, const float* topk_weights, int top_k,
                                     int hidden, int tokens, void* out) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int t = blockIdx.x;
  const int n = 4 * (blockIdx.y * blockDim.x + threadIdx.x);  // hidden % 64 == 0 (GEMM1's K)
  if (t >= tokens || n >= hidden) return;
  FinalizeTokenColumn<Bf16, 4>(ws, local_ids, local_experts, topk_weights, nullptr, top_k, hidden,
                               t, n, out);
}

std::string CudaError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return "";
  return std::string(what) + ": " + cudaGetErrorString(err);
}

bool IsSupportedRouting(int method) {
  switch (static_cast<MxInt4Routing>(method)) {
    case MxInt4Routing::kDefault:
    case MxInt4Routing::kRenormalize:
    case MxInt4Routing::kDeepSeekV3:
    case MxInt4Routing::kLlama4:
    case MxInt4Routing::kRenormalizeNaive:
    case MxInt4Routing::kTopK:
    case MxInt4Routing::kSigmoidRenorm:
    case MxInt4Routing::kMiniMax2:
    case MxInt4Routing::kSigmoid: return true;
  }
  return false;
}

}  // namespace

int64_t MxInt4MoeMaxPadded(const MxInt4MoeProblem& p) {
  const int64_t bm = p.block_m;
  const int64_t pairs = p.tokens * p.top_k;
  const int64_t padded = pairs + std::min(pairs, p.local_experts) * (bm - 1);
  return std::max<int64_t>(bm, (padded + bm - 1) / bm * bm);
}

int64_t MxInt4MoeMaxBlocks(const MxInt4MoeProblem& p) { return MxInt4MoeMaxPadded(p) / p.block_m; }

int64_t MxInt4MoePermutedRows(const MxInt4MoeProblem& p) {
  return UsesWgmma(p.block_m, p.mainloop) ? p.tokens : 0;
}

int64_t MxInt4MoeWs13Floats(const MxInt4MoeProblem& p) {
  return Gemm1WorkspaceFloats(p.tokens * p.top_k, 2 * p.intermediate, p.split13, p.one_token);
}

int64_t MxInt4MoeWs2Floats(const MxInt4MoeProblem& p) {
  return Gemm2WorkspaceFloats(p.tokens * p.top_k, p.hidden);
}

std::string ValidateMxInt4Routing(const MxInt4MoeProblem& p) {
  if (p.tokens < 0) return "tokens must be >= 0";
  if (p.num_experts < 1 || p.num_experts > kMxInt4MaxExperts) {
    return "num_experts must be in [1, " + std::to_string(kMxInt4MaxExperts) + "]";
  }
  if (p.top_k < 1 || p.top_k > std::min<int64_t>(kMxInt4MaxTopK, p.num_experts)) {
    return "top_k must be in [1, min(32, num_experts)]";
  }
  // (offset > E - L, not offset + L > E: an int64 offset near 2^63 would overflow the sum)
  if (p.local_experts < 1 || p.local_experts > p.num_experts || p.local_offset < 0 ||
      p.local_offset > p.num_experts - p.local_experts) {
    return "local experts [offset, offset + local_num_experts) must lie in [0, num_experts)";
  }
  if (!IsSupportedRouting(p.routing_method)) {
    return "routing_method " + std::to_string(p.routing_method) +
           " is not supported (0-8 are)";
  }
  const auto method = static_cast<MxInt4Routing>(p.routing_method);
  if (method == MxInt4Routing::kLlama4 && p.top_k != 1) return "Llama4 routing needs top_k == 1";
  if ((method == MxInt4Routing::kDeepSeekV3 || method == MxInt4Routing::kMiniMax2) &&
      p.bias == nullptr) {
    return "DeepSeekV3 and MiniMax2 routing need e_score_correction_bias";
  }
  if (method == MxInt4Routing::kDeepSeekV3) {
    const int64_t g = p.num_expert_group;
    if (g < 1 || g > kMxInt4MaxGroups || p.num_experts % g != 0) {
      return "num_expert_group must be in [1, 32] and divide num_experts";
    }
    if (p.topk_group < 1 || p.topk_group > g) return "topk_group must be in [1, num_expert_group]";
    if (g > 1 && p.num_experts / g < 2) return "groups need at least 2 experts (top-2 sum)";
    if (p.top_k > p.topk_group * (p.num_experts / g)) {
      return "top_k exceeds the experts of the kept groups";
    }
  }
  if (!MoeRowsFitInt32(p.tokens * p.top_k, 1)) return "tokens * top_k must be below 2^31";
  return "";
}

std::string ValidateMxInt4MoeProblem(const MxInt4MoeProblem& p) {
  if (std::string err = ValidateMxInt4Routing(p); !err.empty()) return err;
  if (p.hidden <= 0 || p.hidden % 64 != 0) return "hidden size must be a positive multiple of 64";
  if (p.intermediate <= 0 || p.intermediate % 64 != 0) {
    return "intermediate size must be a positive multiple of 64";
  }
  if (p.hidden > kMaxMoeFeatures || p.intermediate > kMaxMoeFeatures) {
    return "hidden and intermediate sizes must be at most " + std::to_string(kMaxMoeFeatures);
  }
  if (!ScaleWordsFitInt32(p.hidden / kGroupSize, 2 * p.intermediate) ||
      !ScaleWordsFitInt32(p.intermediate / kGroupSize, p.hidden)) {
    return "scale groups x outputs of one expert must stay below 2^32 (32-bit offsets)";
  }
  if (std::string err =
          ValidateMoeGemmLaunch(p.block_m, p.split13, p.split2, p.mainloop, p.one_token);
      !err.empty()) {
    return err;
  }
  if (p.one_token && !DecodesWithoutAlignment(true, false, p.tokens, p.block_m)) {
    return "one_token (the decode path without alignment) needs one token and block_m 8";
  }
  if (p.fused_decode && !p.one_token) return "fused_decode needs the one_token path";
  if (p.mainloop == static_cast<int>(GemmMainloop::kOneTokenStream)) {
    if (std::string err =
            ValidateOneTokenStream(p.fused_decode, p.top_k, p.hidden, p.intermediate);
        !err.empty()) {
      return err;
    }
  }
  if (!MoeRowsFitInt32(p.tokens * p.top_k, std::max<int64_t>(p.hidden, 2 * p.intermediate))) {
    return "problem too large for 32-bit row indexing: rows (T * K = " +
           std::to_string(p.tokens * p.top_k) +
           ") x max(hidden, 2 * intermediate) must be below 2^31";
  }
  return "";
}

std::string RunMxInt4Moe(const MxInt4MoeProblem& p, cudaStream_t stream) {
  std::string err = ValidateMxInt4MoeProblem(p);
  if (!err.empty()) return err;
  if (p.tokens == 0) return "";
  const int rows = static_cast<int>(p.tokens * p.top_k);
  const int max_padded = static_cast<int>(MxInt4MoeMaxPadded(p));
  const int max_blocks = static_cast<int>(MxInt4MoeMaxBlocks(p));
  const int H = static_cast<int>(p.hidden), I = static_cast<int>(p.intermediate);
  const int L = static_cast<int>(p.local_experts);

  // 1. Routing. At one token with the general GEMM1 split, its launch also zeroes GEMM1's
  // workspace, so that GEMM1 follows it with the dependent launch instead of after a memset. The
  // streaming kernels and the fused decode kernel use no split-K workspace: nothing to zero.
  const bool direct = p.one_token;
  const bool stream_kernels = p.mainloop == static_cast<int>(GemmMainloop::kOneTokenStream);
  const bool zero13_in_routing = direct && !p.fused_decode && !stream_kernels && p.split13 > 1;
  err = RunMxInt4Routing(p, stream, zero13_in_routing ? p.ws13 : nullptr,
                         zero13_in_routing ? MxInt4MoeWs13Floats(p) : 0);
  if (!err.empty()) return err;

  // One token: the two streaming kernels (the stream main loop), or the fused decode kernel
  // where the pairs' weights fit the GPU's shared memory; both after the routing launch.
  if (stream_kernels || p.fused_decode) {
    OneTokenLayer layer;
    layer.x = p.x;
    layer.pair_experts = p.local_ids;
    layer.experts = L;
    layer.topk_weights = p.topk_weights;
    layer.top_k = static_cast<int>(p.top_k);
    layer.hidden = H;
    layer.inter = I;
    SetOneTokenGroups(layer, kGroupSize, kGroupSize);
    layer.w13 = static_cast<const uint4*>(p.w13);
    layer.s13 = static_cast<const uint32_t*>(p.s13);
    layer.w2 = static_cast<const uint4*>(p.w2);
    layer.s2 = static_cast<const uint32_t*>(p.s2);
    layer.activation = 0;
    layer.act = p.act;
    layer.out = p.out;
    if (stream_kernels) {
      return LaunchOneTokenLayer<Bf16, NibbleCode::kSignedInt4>(
          layer, /*experts_from_prior_kernel=*/true, stream);
    }
    DecodeLayerArgs a;
    static_cast<OneTokenLayer&>(a) = layer;
    return LaunchDecodeLayer<Bf16, NibbleCode::kSignedInt4>(a, stream);
  }

  // 2. This rank's pairs to expert blocks (local id -1: dropped); the same launch zeroes the
  // split-K workspaces. At one token (DecodesWithoutAlignment) neither: each pair is its own
  // block, GEMM1 clears ws2 and the routing launch a split GEMM1's ws13.
  // The wgmma GEMM (UsesWgmma) reads its inputs in logical chunk order: the alignment launch's
  // extra CTAs write x's rows in that order (LogicalOrderRows).
  const bool wgmma = UsesWgmma(p.block_m, p.mainloop);
  if (!direct) {
    const int64_t zero13 = p.split13 > 1 ? static_cast<int64_t>(rows) * 2 * I : 0;
    const int64_t zero2 = p.split2 > 1 ? static_cast<int64_t>(rows) * H : 0;
    StandardAlignment a =
        MakeStandardAlignment(p.local_ids, rows, L, p.block_m, max_padded, max_blocks,
                              p.sorted_ids, p.expert_ids, p.num_post_padded);
    a.ws_a = p.ws13;
    a.count_a = zero13;
    a.ws_b = p.ws2;
    a.count_b = zero2;
    a.order = wgmma ? MakeLogicalOrderRows(p.x, p.x_perm, H, MxInt4MoePermutedRows(p))
                    : LogicalOrderRows{};
    a.scratch = p.ws2;  // GEMM2's rows, written only after the alignment
    a.scratch_bytes = MxInt4MoeWs2Floats(p) * static_cast<int64_t>(sizeof(float));
    LaunchStandardAlignment(a, /*first_kernel=*/false, stream);
    err = CudaError("alignment kernel");
    if (!err.empty()) return err;
  }

  // 3. GEMM1 (+ SwiGLU in the epilogue unless split).
  MoeGemmArgs g1;
  g1.x = wgmma ? p.x_perm : p.x;
  g1.ld_x = H;
  g1.in_div = static_cast<int>(p.top_k);
  g1.sorted_ids = p.sorted_ids;
  g1.expert_ids = p.expert_ids;
  g1.num_post_padded = p.num_post_padded;
  g1.num_rows = rows;
  g1.block_m = p.block_m;
  g1.w = static_cast<const uint4*>(p.w13);
  g1.scales = static_cast<const uint32_t*>(p.s13);
  g1.zeros = nullptr;
  g1.n = 2 * I;
  g1.k = H;
  g1.groups = H / kGroupSize;
  g1.units = I / 16;
  g1.unit_mult = 1;
  g1.sub_stride = I / 16;
  g1.splits = p.split13;
  g1.chunks_per_split = (H / 64 + p.split13 - 1) / p.split13;
  g1.bias = nullptr;
  g1.activation = 0;
  g1.act = p.act;
  g1.mainloop = static_cast<GemmMainloop>(p.mainloop);
  g1.act_col = nullptr;
  if (p.split13 > 1) {
    g1.epilogue = EpilogueKind::kF32Store;
    g1.ws = p.ws13;  // zeroed by the alignment launch (one token: by the routing launch)
  } else {
    g1.epilogue = EpilogueKind::kActivation;
  }
  if (direct) {
    SetOneTokenGemm1(g1, p.local_ids, L, p.ws2, rows, H, zero13_in_routing);
  }
  const int gemm_blocks = direct ? rows : max_blocks;
  LaunchMoeInt4GemmOrWgmma<Bf16, NibbleCode::kSignedInt4>(g1, gemm_blocks, stream);
  err = CudaError("GEMM1 kernel");
  if (!err.empty()) return err;
  if (p.split13 > 1 && !direct) {  // (on the one-token path GEMM1 applied the activation)
    const dim3 grid(rows, (I + 255) / 256);
    LaunchAfterPrior(MxInt4Finalize13Kernel, grid, dim3(256), 0, stream, p.ws13, p.local_ids, I,
                     rows, p.act);
    err = CudaError("GEMM1 finalize kernel");
    if (!err.empty()) return err;
  }

  // 4. GEMM2 into f32 rows (the wgmma GEMM2: bf16 rows, SetRoundedGemm2).
  // ws2 is zeroed by the alignment launch when split, or by GEMM1 (direct).
  MoeGemmArgs g2 = Gemm2ArgsAfter(g1, static_cast<const uint4*>(p.w2),
                                  static_cast<const uint32_t*>(p.s2), nullptr, H, I,
                                  I / kGroupSize, p.split2, p.ws2);
  if (direct) {  // GEMM2 finalizes (5. below)
    SetOneTokenGemm2(g2, rows, p.topk_weights, nullptr, p.out, static_cast<int>(p.top_k));
  } else if (wgmma) {  // rows of bf16, weighted and rounded: half the bytes for 5. to read
    SetRoundedGemm2(g2, p.ws2, nullptr, p.topk_weights);
  }
  LaunchMoeInt4GemmOrWgmma<Bf16, NibbleCode::kSignedInt4>(g2, gemm_blocks, stream);
  err = CudaError("GEMM2 kernel");
  if (!err.empty()) return err;
  if (direct) return "";

  // 5. Top-k weights and reduction over k.
  if (wgmma) {
    LaunchRoundedFinalize<Bf16>(p.ws2, p.local_ids, L, static_cast<int>(p.top_k), H,
                                static_cast<int>(p.tokens), p.out, stream);
    return CudaError("finalize kernel");
  }
  const dim3 grid(static_cast<int>(p.tokens), (H / 4 + 255) / 256);
  LaunchAfterPrior(MxInt4FinalizeKernel, grid, dim3(256), 0, stream, p.ws2, p.local_ids, L,
                   p.topk_weights, static_cast<int>(p.top_k), H, static_cast<int>(p.tokens),
                   p.out);
  return CudaError("finalize kernel");
}

}  // namespace jax_moeq::cuda
