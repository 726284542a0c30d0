// GPU WNA16 dense linear: [split-K workspace memset] -> [input permute: act-order and/or the
// wgmma GEMM's chunk order] -> one GEMM of the fused MoE's core with dense rows, whose epilogue
// adds the bias and rounds (unsplit), or whose last warp per 32 columns does (split-K).
// Launchers only; the GEMMs live in moe_int4_gemm.cuh and moe_int4_wgmma.cuh.
#include <algorithm>

#include "cuda/moe_int4_gemm.cuh"
#include "cuda/moe_int4_gemm_launch.cuh"
#include "cuda/wna16_linear.h"

namespace jax_moeq::cuda {
namespace {

std::string CudaError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return "";
  return std::string(what) + ": " + cudaGetErrorString(err);
}

template <typename T>
std::string RunTyped(const Wna16LinearProblem& p, cudaStream_t stream) {
  const int M = static_cast<int>(p.rows), K = static_cast<int>(p.in_features);
  const int N = static_cast<int>(p.out_features);
  const bool wgmma = Wna16LinearUsesWgmma(p);
  // Whether a kernel of this call ran before the next launch: only then does the next one take
  // the dependent launch (after a memset or XLA's kernels it would have no kernel of ours to
  // follow).
  bool after_kernel = false;

  // 1. Split-K: the f32 accumulators and the arrival counters start at zero.
  if (p.split > 1) {
    const size_t bytes = static_cast<size_t>(Wna16LinearWsFloats(p)) * sizeof(float);
    if (const cudaError_t e = cudaMemsetAsync(p.ws, 0, bytes, stream); e != cudaSuccess) {
      return std::string("split-K workspace memset: ") + cudaGetErrorString(e);
    }
  }

  // 2. x in the order the GEMM reads it: act-order's sorted channels, and the wgmma GEMM's
  // logical chunk order. All rows belong to "expert" 0 (row / M == 0).
  const void* x = p.x;
  if (Wna16LinearPermutedRows(p) > 0) {
    const int32_t* perm = p.act_order ? p.perm : nullptr;
    PermuteRowsKernel<T><<<M, 256, 0, stream>>>(static_cast<const T*>(p.x), 1, nullptr, M, perm,
                                                 wgmma, K, M, 1, static_cast<T*>(p.x_perm));
    std::string err = CudaError("input permute kernel");
    if (!err.empty()) return err;
    x = p.x_perm;
    after_kernel = true;
  }

  // 3. The GEMM, in the fused MoE's GEMM2 geometry (warp units of 32 consecutive output rows).
  MoeGemmArgs g;
  g.x = x;
  g.ld_x = K;
  g.in_div = 1;
  g.dense_rows = true;
  g.num_rows = M;
  g.block_m = p.block_m;
  g.w = static_cast<const uint4*>(p.w);
  g.scales = static_cast<const uint32_t*>(p.scales);
  g.zeros = p.has_zeros ? static_cast<const uint32_t*>(p.zeros) : nullptr;
  g.n = N;
  g.k = K;
  g.groups = static_cast<int>(p.groups);
  g.units = N / 32;
  g.unit_mult = 2;
  g.sub_stride = 1;
  g.splits = p.split;
  g.chunks_per_split = (K / 64 + p.split - 1) / p.split;
  g.mainloop = static_cast<GemmMainloop>(p.mainloop);
  g.dependent_launch = after_kernel;
  const float* bias = p.has_bias ? p.bias : nullptr;
  if (p.split > 1) {  // f32 atomics into ws; the unit's last warp adds the bias and rounds
    g.epilogue = EpilogueKind::kF32Store;
    g.ws = p.ws;
    g.arrivals = reinterpret_cast<int32_t*>(p.ws + static_cast<int64_t>(M) * N);
    g.out_bias = bias;
    g.out = p.out;
  } else {
    g.epilogue = EpilogueKind::kRoundedStore;
    g.rounded = p.out;
    g.bias = bias;
  }
  const int blocks = (M + p.block_m - 1) / p.block_m;
  LaunchMoeInt4GemmOrWgmma<T, NibbleCode::kUint4b8>(g, blocks, stream);
  return CudaError("GEMM kernel");
}

}  // namespace

bool Wna16LinearUsesWgmma(const Wna16LinearProblem& p) { return UsesWgmma(p.block_m, p.mainloop); }

int64_t Wna16LinearPermutedRows(const Wna16LinearProblem& p) {
  return p.act_order || Wna16LinearUsesWgmma(p) ? p.rows : 0;
}

int64_t Wna16LinearWsFloats(const Wna16LinearProblem& p) {
  return p.split > 1 ? Gemm2WorkspaceFloats(p.rows, p.out_features) : 0;
}

std::string ValidateWna16LinearProblem(const Wna16LinearProblem& p) {
  if (std::string err = ValidateMoeGemmLaunch(p.block_m, p.split, 1, p.mainloop); !err.empty()) {
    return err;
  }
  if (p.in_features <= 0 || p.in_features % 64 != 0) {
    return "in_features must be a positive multiple of 64, got " + std::to_string(p.in_features);
  }
  if (p.out_features <= 0 || p.out_features % 64 != 0) {
    return "out_features must be a positive multiple of 64, got " +
           std::to_string(p.out_features);
  }
  if (p.in_features > kMaxMoeFeatures || p.out_features > kMaxMoeFeatures) {
    return "in_features and out_features must be at most " + std::to_string(kMaxMoeFeatures);
  }
  // The mma.sync GEMM's grid.y counts CTAs of 8 warps x 32 outputs (at most 65535).
  if ((p.out_features / 32 + kGemmWarps - 1) / kGemmWarps > 65535) {
    return "out_features must be below " + std::to_string(int64_t{65535} * kGemmWarps * 32);
  }
  if (p.rows < 0) return "rows must be >= 0";
  if (p.groups <= 0 || p.in_features % p.groups != 0 || (p.in_features / p.groups) % 16 != 0) {
    return "scale groups (" + std::to_string(p.groups) +
           ") must divide in_features into groups of a multiple of 16";
  }
  if (!ScaleWordsFitInt32(p.groups, p.out_features)) {
    return "scale groups x out_features must stay below 2^32 (32-bit offsets)";
  }
  if (!MoeRowsFitInt32(p.rows, std::max(p.in_features, p.out_features))) {
    return "problem too large for 32-bit row indexing: rows (" + std::to_string(p.rows) +
           ") x max(in_features, out_features) must be below 2^31";
  }
  return "";
}

std::string RunWna16Linear(const Wna16LinearProblem& p, cudaStream_t stream) {
  std::string err = ValidateWna16LinearProblem(p);
  if (!err.empty()) return err;
  if (p.rows == 0) return "";
  return p.dtype == HalfKind::kBF16 ? RunTyped<__nv_bfloat16>(p, stream)
                                    : RunTyped<__half>(p, stream);
}

}  // namespace jax_moeq::cuda
