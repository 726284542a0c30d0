// GPU WNA16 fused MoE: alignment -> [act-order permute] -> GEMM1 (+activation)
// -> GEMM2 -> top-k weighting and reduction over k. Launchers only; the GEMM
// core lives in moe_int4_gemm.cuh.
#include <algorithm>

#include "cuda/moe_int4_decode.cuh"
#include "cuda/moe_int4_gemm.cuh"
#include "cuda/moe_int4_gemm_launch.cuh"
#include "cuda/moe_int4_one_token.cuh"
#include "cuda/wna16_moe.h"

namespace jax_moeq::cuda {
namespace {


// The finalize kernels put rows (or tokens) on grid.x, which takes 2^31 - 1 blocks; grid.y takes
// only 65535, fewer than the rows of a prefill (T = 16384, K = 8: 131072), and a launch past it
// fails.

// GEMM1 finalize after split-K: act[id][col] from ws13[id][0:2I].
template <typename T>
__global__ void Finalize13Kernel(const float* ws, const int32_t* row_expert_src,
                                 int row_expert_div, const int32_t* expert_num_tokens,
                                 int max_tokens, const float* bias, const int32_t* act_col,
                                 int inter, int rows, int experts, int activation, void* act) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int id = blockIdx.x;
  const int n = blockIdx.y * blockDim.x + threadIdx.x;
  if (id >= rows || n >= inter) return;
  const int e = row_expert_src ? row_expert_src[id] : id / row_expert_div;
  if (e < 0 || e >= experts) return;
  if (expert_num_tokens && id % max_tokens >= expert_num_tokens[e]) return;
  const float2 b = GateUpBias(bias, e, inter, n);
  const float gate = ws[static_cast<int64_t>(id) * 2 * inter + n] + b.x;
  const float up = ws[static_cast<int64_t>(id) * 2 * inter + inter + n] + b.y;
  const float a = RoundedActivation<T>(activation, gate, up);
  const int col = act_col ? act_col[static_cast<int64_t>(e) * inter + n] : n;
  StoreHalf<T>(act, static_cast<int64_t>(id) * inter + col, a);
}

// Standard: out[t][n] = round(sum_k round((ws2[t*K+k][n] + b2) * w[t][k])) (f32 sum),
// experts out of range contribute nothing.
template <typename T>
__global__ void FinalizeStandardKernel(const float* ws, const int32_t* topk_ids,
                                       const float* topk_weights, const float* bias, int top_k,
                                       int hidden, int tokens, int experts, void* out) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int t = blockIdx.x;
  const int n = 4 * (blockIdx.y * blockDim.x + threadIdx.x);  // hidden % 64 == 0 (GEMM1's K)
  if (t >= tokens || n >= hidden) return;
  FinalizeTokenColumn<T, 4>(ws, topk_ids, experts, topk_weights, bias, top_k, hidden, t, n, out);
}

// Batched: out[e][m][n] = round(ws2 + b2) for m < count[e], else 0. kRounded: ws2 holds T rows
// that the wgmma GEMM2 rounded with b2 added (kRoundedStore).
template <typename T, bool kRounded>
__global__ void FinalizeBatchedKernel(const void* ws, const int32_t* expert_num_tokens,
                                      const float* bias, int max_tokens, int hidden, void* out) {
  WaitForPriorGrids();
  AllowDependentGrids();
  const int id = blockIdx.x;  // e * M + m
  const int n = blockIdx.y * blockDim.x + threadIdx.x;
  if (n >= hidden) return;
  const int e = id / max_tokens, m = id % max_tokens;
  const int64_t at = static_cast<int64_t>(id) * hidden + n;
  float y = 0.0f;
  if (m < expert_num_tokens[e]) {
    if constexpr (kRounded) {
      y = HalfType<T>::to_float(static_cast<const T*>(ws)[at]);
    } else {
      y = static_cast<const float*>(ws)[at];
      if (bias) y += bias[static_cast<int64_t>(e) * hidden + n];
    }
  }
  StoreHalf<T>(out, at, y);
}

std::string CudaError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return "";
  return std::string(what) + ": " + cudaGetErrorString(err);
}

template <typename T>
std::string RunTyped(const Wna16MoeProblem& p, cudaStream_t stream) {
  const int64_t rows = Wna16MoeRows(p);
  const int64_t max_padded = Wna16MoeMaxPadded(p);
  const int64_t max_blocks = Wna16MoeMaxBlocks(p);
  const int H = static_cast<int>(p.hidden), I = static_cast<int>(p.intermediate);
  const int E = static_cast<int>(p.experts);

  // One token: the two streaming kernels (the stream main loop), or the fused decode kernel
  // where the pairs' weights fit the GPU's shared memory.
  const bool stream_kernels = p.mainloop == static_cast<int>(GemmMainloop::kOneTokenStream);
  if (stream_kernels || p.fused_decode) {
    OneTokenLayer layer;
    layer.x = p.x;
    layer.pair_experts = p.topk_ids;
    layer.experts = E;
    layer.topk_weights = p.topk_weights;
    layer.top_k = static_cast<int>(p.top_k);
    layer.hidden = H;
    layer.inter = I;
    SetOneTokenGroups(layer, static_cast<int>(H / p.groups13), static_cast<int>(I / p.groups2));
    layer.w13 = static_cast<const uint4*>(p.w13);
    layer.s13 = static_cast<const uint32_t*>(p.s13);
    layer.z13 = p.has_zeros ? static_cast<const uint32_t*>(p.z13) : nullptr;
    layer.b13 = p.has_bias ? p.b13 : nullptr;
    layer.w2 = static_cast<const uint4*>(p.w2);
    layer.s2 = static_cast<const uint32_t*>(p.s2);
    layer.z2 = p.has_zeros ? static_cast<const uint32_t*>(p.z2) : nullptr;
    layer.b2 = p.has_bias ? p.b2 : nullptr;
    layer.activation = p.activation;
    layer.act = p.act;
    layer.out = p.out;
    if (stream_kernels) {
      return LaunchOneTokenLayer<T, NibbleCode::kUint4b8>(
          layer, /*experts_from_prior_kernel=*/false, stream);
    }
    DecodeLayerArgs a;
    static_cast<OneTokenLayer&>(a) = layer;
    return LaunchDecodeLayer<T, NibbleCode::kUint4b8>(a, stream);
  }

  // 1. Token-to-expert alignment; the same launch zeroes the split-K workspaces. At one token
  // (DecodesWithoutAlignment) neither: each pair is its own block, GEMM1 clears ws2 and a memset
  // clears a split GEMM1's ws13.
  // The wgmma GEMM (UsesWgmma) reads its inputs in logical chunk order; without act-order the
  // standard format's alignment launch writes x in that order (LogicalOrderRows).
  const bool direct = p.one_token;
  const bool wgmma = UsesWgmma(p.block_m, p.mainloop);
  const bool order_in_align = wgmma && !p.batched && !p.act_order;
  if (!direct) {  // (the batched format never takes the one-token path)
    const int64_t zero13 = p.split13 > 1 ? rows * 2 * I : 0;
    const int64_t zero2 = p.split2 > 1 ? rows * H : 0;
    const int zero_blocks = (zero13 + zero2) > 0 ? kZeroBlocks : 0;
    if (p.batched) {
      const int threads = 256;
      const int blocks = std::max(1, static_cast<int>((max_padded + threads - 1) / threads));
      AlignBatchedKernel<<<blocks + zero_blocks, threads, 0, stream>>>(
          p.expert_num_tokens, E, static_cast<int>(p.tokens), p.block_m, p.sorted_ids,
          p.expert_ids, p.num_post_padded, blocks, p.ws13, zero13, p.ws2, zero2);
    } else {
      StandardAlignment a =
          MakeStandardAlignment(p.topk_ids, rows, E, p.block_m, max_padded, max_blocks,
                                p.sorted_ids, p.expert_ids, p.num_post_padded);
      a.ws_a = p.ws13;
      a.count_a = zero13;
      a.ws_b = p.ws2;
      a.count_b = zero2;
      a.order = order_in_align ? MakeLogicalOrderRows(p.x, p.x_perm, H, p.tokens)
                               : LogicalOrderRows{};
      a.scratch = p.ws2;  // GEMM2's rows, written only after the alignment
      a.scratch_bytes = Wna16MoeWs2Floats(p) * static_cast<int64_t>(sizeof(float));
      LaunchStandardAlignment(a, /*first_kernel=*/true, stream);
    }
  }
  std::string err = CudaError("alignment kernel");
  if (!err.empty()) return err;

  // Expert of a row: from topk_ids (standard) or row / M (batched).
  const int32_t* row_expert_src = p.batched ? nullptr : p.topk_ids;
  const int row_expert_div = p.batched ? static_cast<int>(p.tokens) : 1;

  // 2. act-order: gather each row's inputs in its expert's sorted K order. The wgmma GEMM's
  // logical chunk order where the alignment launch did not write it (act-order, batched).
  const void* x13 = order_in_align ? p.x_perm : p.x;
  int in_div = p.batched ? 1 : static_cast<int>(p.top_k);
  if (p.act_order || (wgmma && !order_in_align)) {
    const int perm_rows = static_cast<int>(Wna16MoePermutedRows(p));
    LaunchAfterPrior(PermuteRowsKernel<T>, dim3(perm_rows), dim3(256), 0, stream,
                     static_cast<const T*>(p.x), p.act_order ? in_div : 1, row_expert_src,
                     row_expert_div, p.act_order ? p.perm13 : nullptr, wgmma, H, perm_rows, E,
                     static_cast<T*>(p.x_perm));
    err = CudaError("input permute kernel");
    if (!err.empty()) return err;
    x13 = p.x_perm;
    if (p.act_order) in_div = 1;
  }

  // 3. GEMM1 (+ activation).
  MoeGemmArgs g1;
  g1.x = x13;
  g1.ld_x = H;
  g1.in_div = in_div;
  g1.sorted_ids = p.sorted_ids;
  g1.expert_ids = p.expert_ids;
  g1.num_post_padded = p.num_post_padded;
  g1.num_rows = static_cast<int>(rows);
  g1.block_m = p.block_m;
  g1.w = static_cast<const uint4*>(p.w13);
  g1.scales = static_cast<const uint32_t*>(p.s13);
  g1.zeros = p.has_zeros ? static_cast<const uint32_t*>(p.z13) : nullptr;
  g1.n = 2 * I;
  g1.k = H;
  g1.groups = static_cast<int>(p.groups13);
  g1.units = I / 16;
  g1.unit_mult = 1;
  g1.sub_stride = I / 16;
  g1.splits = p.split13;
  g1.chunks_per_split = (H / 64 + p.split13 - 1) / p.split13;
  g1.bias = p.has_bias ? p.b13 : nullptr;
  g1.activation = p.activation;
  g1.act = p.act;
  g1.act_col = p.act_order ? p.inv_perm2 : nullptr;
  g1.mainloop = static_cast<GemmMainloop>(p.mainloop);
  if (p.split13 > 1) {
    g1.epilogue = EpilogueKind::kF32Store;
    g1.ws = p.ws13;  // zeroed by the alignment launch (one token: by the memset below)
  } else {
    g1.epilogue = EpilogueKind::kActivation;
  }
  if (direct) {
    SetOneTokenGemm1(g1, p.topk_ids, E, p.ws2, rows, H, /*zeroed_by_prior_kernel=*/false);
    if (const cudaError_t e = ClearOneTokenGemm1Workspace(g1, rows, stream); e != cudaSuccess) {
      return std::string("GEMM1 workspace memset: ") + cudaGetErrorString(e);
    }
  }
  const int gemm_blocks = static_cast<int>(direct ? rows : max_blocks);
  LaunchMoeInt4GemmOrWgmma<T, NibbleCode::kUint4b8>(g1, gemm_blocks, stream);
  err = CudaError("GEMM1 kernel");
  if (!err.empty()) return err;
  if (p.split13 > 1 && !direct) {  // (on the one-token path GEMM1 applied the activation)
    const dim3 grid(static_cast<int>(rows), (I + 255) / 256);
    LaunchAfterPrior(Finalize13Kernel<T>, grid, dim3(256), 0, stream, p.ws13, row_expert_src,
                     row_expert_div, p.batched ? p.expert_num_tokens : nullptr,
                     static_cast<int>(p.tokens), g1.bias, g1.act_col, I, static_cast<int>(rows),
                     E, p.activation, p.act);
    err = CudaError("GEMM1 finalize kernel");
    if (!err.empty()) return err;
  }

  // 4. GEMM2 into f32 rows; the wgmma GEMM2 into rows of T with b2 and the top-k weights
  // applied and rounded (kRoundedStore), half the bytes for it to write and 5. to read.
  MoeGemmArgs g2 = Gemm2ArgsAfter(
      g1, static_cast<const uint4*>(p.w2), static_cast<const uint32_t*>(p.s2),
      p.has_zeros ? static_cast<const uint32_t*>(p.z2) : nullptr, H, I,
      static_cast<int>(p.groups2), p.split2, p.ws2);
  const float* b2 = p.has_bias ? p.b2 : nullptr;
  if (direct) {  // GEMM2 finalizes (5. below)
    SetOneTokenGemm2(g2, rows, p.topk_weights, b2, p.out, static_cast<int>(p.top_k));
  } else if (wgmma) {
    SetRoundedGemm2(g2, p.ws2, b2, p.batched ? nullptr : p.topk_weights);
  }
  LaunchMoeInt4GemmOrWgmma<T, NibbleCode::kUint4b8>(g2, gemm_blocks, stream);
  err = CudaError("GEMM2 kernel");
  if (!err.empty()) return err;

  // 5. Bias, top-k weights, reduction over k.
  if (direct) {
    return "";
  } else if (p.batched) {
    const dim3 grid(static_cast<int>(rows), (H + 255) / 256);
    LaunchAfterPrior(wgmma ? FinalizeBatchedKernel<T, true> : FinalizeBatchedKernel<T, false>,
                     grid, dim3(256), 0, stream, static_cast<const void*>(p.ws2),
                     p.expert_num_tokens, b2, static_cast<int>(p.tokens), H, p.out);
  } else if (wgmma) {
    LaunchRoundedFinalize<T>(p.ws2, p.topk_ids, E, static_cast<int>(p.top_k), H,
                             static_cast<int>(p.tokens), p.out, stream);
  } else {
    const dim3 grid(static_cast<int>(p.tokens), (H / 4 + 255) / 256);
    LaunchAfterPrior(FinalizeStandardKernel<T>, grid, dim3(256), 0, stream, p.ws2, p.topk_ids,
                     p.topk_weights, b2, static_cast<int>(p.top_k), H,
                     static_cast<int>(p.tokens), E, p.out);
  }
  return CudaError("finalize kernel");
}

}  // namespace

int64_t Wna16MoeRows(const Wna16MoeProblem& p) {
  return p.batched ? p.experts * p.tokens : p.tokens * p.top_k;
}

int64_t Wna16MoeMaxPadded(const Wna16MoeProblem& p) {
  const int64_t bm = p.block_m;
  if (p.batched) return p.experts * ((p.tokens + bm - 1) / bm) * bm;
  const int64_t pairs = p.tokens * p.top_k;
  const int64_t padded = pairs + std::min(pairs, p.experts) * (bm - 1);
  return (padded + bm - 1) / bm * bm;
}

int64_t Wna16MoeMaxBlocks(const Wna16MoeProblem& p) { return Wna16MoeMaxPadded(p) / p.block_m; }

int64_t Wna16MoePermutedRows(const Wna16MoeProblem& p) {
  const bool wgmma = UsesWgmma(p.block_m, p.mainloop);
  if (p.act_order || (p.batched && wgmma)) return Wna16MoeRows(p);
  return wgmma ? p.tokens : 0;
}

int64_t Wna16MoeWs13Floats(const Wna16MoeProblem& p) {
  return Gemm1WorkspaceFloats(Wna16MoeRows(p), 2 * p.intermediate, p.split13, p.one_token);
}

int64_t Wna16MoeWs2Floats(const Wna16MoeProblem& p) {
  return Gemm2WorkspaceFloats(Wna16MoeRows(p), p.hidden);
}

std::string ValidateWna16MoeProblem(const Wna16MoeProblem& p) {
  if (std::string err =
          ValidateMoeGemmLaunch(p.block_m, p.split13, p.split2, p.mainloop, p.one_token);
      !err.empty()) {
    return err;
  }
  if (p.one_token && !DecodesWithoutAlignment(!p.batched, p.act_order, p.tokens, p.block_m)) {
    return "one_token (the decode path without alignment) needs one token, the standard format, "
           "no act-order and block_m 8";
  }
  if (p.fused_decode && !p.one_token) return "fused_decode needs the one_token path";
  if (p.hidden <= 0 || p.hidden % 64 != 0) return "hidden size must be a positive multiple of 64";
  if (p.intermediate <= 0 || p.intermediate % 64 != 0) {
    return "intermediate size must be a positive multiple of 64";
  }
  if (p.hidden > kMaxMoeFeatures || p.intermediate > kMaxMoeFeatures) {
    return "hidden and intermediate sizes must be at most " + std::to_string(kMaxMoeFeatures);
  }
  if (p.experts <= 0 || p.experts > 4096) return "number of experts must be in [1, 4096]";
  if (p.tokens < 0) return "tokens must be >= 0";
  if (p.groups13 <= 0 || p.hidden % p.groups13 != 0 || (p.hidden / p.groups13) % 16 != 0) {
    return "w13 scale groups must divide the hidden size into groups of a multiple of 16";
  }
  if (p.groups2 <= 0 || p.intermediate % p.groups2 != 0 ||
      (p.intermediate / p.groups2) % 16 != 0) {
    return "w2 scale groups must divide the intermediate size into groups of a multiple of 16";
  }
  if (!ScaleWordsFitInt32(p.groups13, 2 * p.intermediate) ||
      !ScaleWordsFitInt32(p.groups2, p.hidden)) {
    return "scale groups x outputs of one expert must stay below 2^32 (32-bit offsets)";
  }
  if (p.activation < 0 || p.activation > 2) return "activation_kind must be 0, 1 or 2";
  if (p.top_k < 1) return "top_k must be >= 1";
  if (p.mainloop == static_cast<int>(GemmMainloop::kOneTokenStream)) {
    if (std::string err =
            ValidateOneTokenStream(p.fused_decode, p.top_k, p.hidden, p.intermediate);
        !err.empty()) {
      return err;
    }
  }
  if (!MoeRowsFitInt32(Wna16MoeRows(p), std::max<int64_t>(p.hidden, 2 * p.intermediate))) {
    return "problem too large for 32-bit row indexing: rows (" +
           std::string(p.batched ? "E * M" : "T * K") + " = " + std::to_string(Wna16MoeRows(p)) +
           ") x max(hidden, 2 * intermediate) must be below 2^31";
  }
  return "";
}

std::string RunWna16Moe(const Wna16MoeProblem& p, cudaStream_t stream) {
  std::string err = ValidateWna16MoeProblem(p);
  if (!err.empty()) return err;
  if (Wna16MoeRows(p) == 0) return "";
  return p.dtype == HalfKind::kBF16 ? RunTyped<__nv_bfloat16>(p, stream)
                                    : RunTyped<__half>(p, stream);
}

}  // namespace jax_moeq::cuda
