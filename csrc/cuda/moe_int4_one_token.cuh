// The one-token layer as two streaming kernels (mainloop "stream"; WNA16 and MxInt4 at T = 1):
// GEMM1 with the activation, then GEMM2 with the top-k reduction. No XLA types.
//
// Why: at one token the layer reads each of its K experts' weights once, and nothing else is
// large, so it is a race to keep enough bytes in flight. The general GEMMs hold one stage of four
// chunks per warp and wait on it before loading the next, and split K across CTAs whose partial
// sums meet in f32 atomics (ncu on the H200, WNA16 Qwen3-30B-A3B: GEMM1 moved 12.6 MB in 12.5 us,
// GEMM2 6.3 MB in 10.0 us; these kernels take 8.9 and 8.2 us, docs/gpu_notes.md). Here every
// warp keeps two stages (eight 16-byte loads per lane) in flight, a CTA holds every K slice of its
// outputs, and the slices meet in shared memory in a fixed order:
//   GEMM1: CTA (unit u, pair p) = gate subtile u and up subtile I/16 + u of p's expert over all of
//          H, kOneTokenWarps1 warps each on a contiguous range of chunks; the CTA applies bias and
//          activation (RoundedActivation) and writes act[p][16u .. 16u + 15].
//   GEMM2: CTA v = output subtile v (16 of H) for every pair: warps (pair, slice) over I; the CTA
//          finishes out[16v .. 16v + 15] as FinalizeTokenColumn does (bias, router weight and a
//          rounding per pair, f32 sum in slot order, one rounding).
// Results are deterministic: no atomics. The dequantization is MmaChunk's, at the reference's
// rounding point. GEMM2 reads the pairs' experts and issues its first weight loads before waiting
// for GEMM1, so they overlap GEMM1's last CTAs: the experts are an op input (WNA16) or were
// written by the routing kernel before GEMM1, which every GEMM1 CTA waits for (MxInt4).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/int4_mma_core.cuh"
#include "cuda/moe_int4_gemm.cuh"

namespace jax_moeq::cuda {

// A one-token layer's operands, as both one-token launch forms take them: the streaming kernels
// here and the fused decode kernel (DecodeLayerArgs, moe_int4_decode.cuh).
struct OneTokenLayer {
  const void* x = nullptr;               // [H] T: the token
  const int32_t* pair_experts = nullptr;  // [K]: expert of pair k; out of [0, experts): nothing
  int experts = 0;
  const float* topk_weights = nullptr;   // [K]
  int top_k = 1, hidden = 0, inter = 0;
  int group1 = 0, group2 = 0;            // scale group sizes (elements) along H and along I
  FastDiv group1_div, group2_div;        // element index -> group (SetOneTokenGroups)
  const uint4* w13 = nullptr;            // [E][2I/16][H/64][32]
  const uint32_t* s13 = nullptr;         // [E][H/group1][2I/16][8]
  const uint32_t* z13 = nullptr;         // same, zero points, or null (zero point 8)
  const float* b13 = nullptr;            // [E][2I] or null
  const uint4* w2 = nullptr;             // [E][H/16][I/64][32]
  const uint32_t* s2 = nullptr;          // [E][I/group2][H/16][8]
  const uint32_t* z2 = nullptr;
  const float* b2 = nullptr;             // [E][H] or null
  int activation = 0;
  void* act = nullptr;                   // [K][I] T scratch
  void* out = nullptr;                   // [H] T
};

inline void SetOneTokenGroups(OneTokenLayer& a, int group1, int group2) {
  a.group1 = group1;
  a.group2 = group2;
  a.group1_div = MakeFastDiv(static_cast<uint32_t>(group1));
  a.group2_div = MakeFastDiv(static_cast<uint32_t>(group2));
}

struct OneTokenArgs : OneTokenLayer {
  int slices2 = 1;                      // GEMM2 warps per pair (LaunchOneTokenLayer sets)
  // The pairs' experts come from an earlier kernel of the op (MxInt4's routing): GEMM1 follows it
  // with the dependent launch and reads them after its wait. Else (WNA16's topk_ids, an op input)
  // GEMM1 is the op's first launch. GEMM2 reads them, and issues its first weight loads, before
  // its wait in both cases (OneTokenGemm2Kernel says why that is safe).
  bool experts_from_prior_kernel = false;
};

constexpr int kOneTokenWarps1 = 8;        // GEMM1 warps per CTA (256 threads, 3 CTAs per SM)
constexpr int kOneTokenMaxWarps2 = 24;    // GEMM2 warps per CTA: top_k x slices2 (80 registers)
constexpr int kOneTokenMaxTopK = 16;
constexpr int kOneTokenStageLoads = 4;    // 16-byte weight loads per lane per stage (2 in flight)
// GEMM2 stages every pair's activation row in shared memory.
constexpr int64_t kOneTokenMaxSmemBytes = 200 * 1024;

template <typename T>
inline int64_t OneTokenGemm1SmemBytes(int64_t hidden) {
  return (hidden * static_cast<int64_t>(sizeof(T)) + 15) / 16 * 16 + kOneTokenWarps1 * 2 * 16 * 4;
}
// GEMM2's: every pair's activation row, the warps' sums, then each pair's expert and weight.
template <typename T>
inline int64_t OneTokenGemm2SmemBytes(int64_t top_k, int64_t inter) {
  return (top_k * inter * static_cast<int64_t>(sizeof(T)) + 15) / 16 * 16 +
         kOneTokenMaxWarps2 * 16 * 4 + kOneTokenMaxTopK * 8;
}

// Why the streaming kernels cannot take a one-token call ("" when they can). The general
// requirements (H % 64, I % 64, groups) are checked by the op's validation.
inline std::string OneTokenLayerError(int64_t top_k, int64_t hidden, int64_t inter,
                                      int64_t elem_bytes) {
  if (top_k < 1 || top_k > kOneTokenMaxTopK) {
    return "the stream main loop takes top_k in [1, " + std::to_string(kOneTokenMaxTopK) +
           "], got " + std::to_string(top_k);
  }
  const int64_t smem =
      (top_k * inter * elem_bytes + 15) / 16 * 16 + kOneTokenMaxWarps2 * 64 + kOneTokenMaxTopK * 8;
  if (smem > kOneTokenMaxSmemBytes || hidden * elem_bytes > kOneTokenMaxSmemBytes) {
    return "the stream main loop stages top_k x I and H activations in shared memory: top_k " +
           std::to_string(top_k) + " x I " + std::to_string(inter) + " is too large";
  }
  return "";
}

// The checks both ops run on a call with the stream main loop: not beside the fused decode kernel,
// and shapes OneTokenLayerError takes (the op's own validation has checked the rest).
inline std::string ValidateOneTokenStream(bool fused_decode, int64_t top_k, int64_t hidden,
                                          int64_t inter) {
  if (fused_decode) {
    return "fused_decode and the stream main loop are two different one-token paths";
  }
  return OneTokenLayerError(top_k, hidden, inter, 2);
}

// The warp's dot products of kNsub weight subtiles (rows {g, g + 8} per lane) with the token over
// chunks [kc_begin, kc_end): acc[j][0][0] (row g) and acc[j][0][2] (row g + 8), the same in every
// lane of a row (every B column holds the token). `ready` runs once in every thread after both
// stages' loads are issued and before any activation is read from `xs` (shared memory).
template <typename T, NibbleCode kCode, bool kZeros, int kNsub, typename Ready>
__device__ __forceinline__ void OneTokenStream(const uint4* const (&wp)[kNsub],
                                               const uint32_t* sp, const uint32_t* zp, int n_sub,
                                               const int (&sub)[kNsub], const FastDiv& per_group,
                                               const T* xs, int kc_begin, int kc_end, int lane,
                                               Ready&& ready, float (&acc)[kNsub][1][4]) {
  constexpr int kChunks = kOneTokenStageLoads / kNsub;  // chunks per stage
  const int t = lane & 3;
  struct Stage {
    uint4 w[kChunks][kNsub];
    uint32_t scale[kChunks][kNsub];
    uint32_t zero_magic[kChunks][kNsub];
  };
  auto load = [&](int kc0, Stage& st) {
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const int kc = kc0 + u;
      if (kc >= kc_end) break;
      const int group = per_group(kc * 64 + 16 * t);
#pragma unroll
      for (int j = 0; j < kNsub; ++j) {
        st.w[u][j] = LoadStreaming(wp[j] + kc * 32);
        const int64_t off = (static_cast<int64_t>(group) * n_sub + sub[j]) * 8;
        st.scale[u][j] = __ldg(sp + off);
        st.zero_magic[u][j] =
            kZeros ? MagicPlusZero<T>(__ldg(zp + off)) : HalfType<T>::kMagicPlus8;
      }
    }
  };
  auto compute = [&](int kc0, const Stage& st) {
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const int kc = kc0 + u;
      if (kc >= kc_end) break;
      uint4 xv[1][2];
      const uint4* xp = reinterpret_cast<const uint4*>(xs + kc * 64 + 16 * t);
      xv[0][0] = xp[0];
      xv[0][1] = xp[1];
      MmaChunk<T, kCode, kNsub, 1>(st.w[u], xv, st.scale[u], st.zero_magic[u], acc);
    }
  };
#pragma unroll
  for (int j = 0; j < kNsub; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][0][c] = 0.0f;
  // Both stages are requested before `ready` (whose shared-memory copy and barrier then overlap
  // them); each stage is refilled as soon as it has been computed.
  Stage a, b;
  load(kc_begin, a);
  load(kc_begin + kChunks, b);
  ready();
  for (int kc = kc_begin; kc < kc_end; kc += 2 * kChunks) {
    compute(kc, a);
    load(kc + 2 * kChunks, a);
    compute(kc + kChunks, b);
    load(kc + 3 * kChunks, b);
  }
}

// Copies `bytes` (a multiple of 16) from global `src` to shared `dst` with every thread.
__device__ __forceinline__ void CopyToShared(void* dst, const void* src, int bytes) {
  const uint4* s = static_cast<const uint4*>(src);
  uint4* d = static_cast<uint4*>(dst);
  for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) d[i] = __ldg(s + i);
}

// grid (I / 16, K), kOneTokenWarps1 warps.
template <typename T, NibbleCode kCode, bool kZeros>
__global__ void __launch_bounds__(kOneTokenWarps1 * 32, 3) OneTokenGemm1Kernel(OneTokenArgs p) {
  extern __shared__ __align__(16) unsigned char one_token_smem[];
  T* xs = reinterpret_cast<T*>(one_token_smem);
  float* part = reinterpret_cast<float*>(
      one_token_smem + (p.hidden * static_cast<int>(sizeof(T)) + 15) / 16 * 16);  // [warp][2][16]
  WaitForPriorGrids();
  AllowDependentGrids();
  const int unit = blockIdx.x, pair = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int expert = __ldg(p.pair_experts + pair);
  if (expert < 0 || expert >= p.experts) return;  // the whole CTA: GEMM2 skips the pair too
  const int chunks = p.hidden / 64, n_sub = 2 * p.inter / 16;
  const int per_warp = (chunks + kOneTokenWarps1 - 1) / kOneTokenWarps1;
  const int kc_begin = min(chunks, warp * per_warp), kc_end = min(chunks, kc_begin + per_warp);
  const int sub[2] = {unit, p.inter / 16 + unit};
  const int g = lane >> 2;
  const uint4* wp[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    wp[j] = p.w13 + (static_cast<int64_t>(expert) * n_sub + sub[j]) * chunks * 32 + lane;
  }
  const int64_t scale_base = static_cast<int64_t>(expert) * (p.hidden / p.group1) * n_sub * 8 + g;
  const uint32_t* sp = p.s13 + scale_base;
  const uint32_t* zp = kZeros ? p.z13 + scale_base : nullptr;
  float acc[2][1][4];
  OneTokenStream<T, kCode, kZeros, 2>(
      wp, sp, zp, n_sub, sub, p.group1_div, xs, kc_begin, kc_end, lane,
      [&] {
        CopyToShared(xs, p.x, p.hidden * static_cast<int>(sizeof(T)));
        __syncthreads();
      },
      acc);
  if ((lane & 3) == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      part[(warp * 2 + j) * 16 + g] = acc[j][0][0];
      part[(warp * 2 + j) * 16 + g + 8] = acc[j][0][2];
    }
  }
  __syncthreads();
  if (threadIdx.x >= 16) return;
  const int r = threadIdx.x;
  float gate = 0.0f, up = 0.0f;
  for (int w = 0; w < kOneTokenWarps1; ++w) {  // fixed order: run-to-run identical
    gate += part[(w * 2) * 16 + r];
    up += part[(w * 2 + 1) * 16 + r];
  }
  const int n = unit * 16 + r;
  const float2 bias = GateUpBias(p.b13, expert, p.inter, n);
  const float a = RoundedActivation<T>(p.activation, gate + bias.x, up + bias.y);
  StoreHalf<T>(p.act, static_cast<int64_t>(pair) * p.inter + n, a);
}

// grid (H / 16), top_k x slices2 warps; launched after GEMM1 (LaunchAfterPrior).
template <typename T, NibbleCode kCode, bool kZeros>
__global__ void __launch_bounds__(kOneTokenMaxWarps2 * 32, 1) OneTokenGemm2Kernel(OneTokenArgs p) {
  extern __shared__ __align__(16) unsigned char one_token_smem[];
  T* acts = reinterpret_cast<T*>(one_token_smem);  // [K][I]
  float* part = reinterpret_cast<float*>(
      one_token_smem + (p.top_k * p.inter * static_cast<int>(sizeof(T)) + 15) / 16 * 16);
  int* pair_expert = reinterpret_cast<int*>(part + kOneTokenMaxWarps2 * 16);  // [K]
  float* pair_weight = reinterpret_cast<float*>(pair_expert + kOneTokenMaxTopK);  // [K]
  const int v = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pair = warp / p.slices2, slice = warp % p.slices2;
  // Before the wait: the pairs' experts and weights, and then the first weight loads. They are
  // the op's constant inputs, or (experts_from_prior_kernel) the routing kernel's outputs: that
  // kernel is the one before GEMM1, and every GEMM1 CTA waits for it before it lets this kernel
  // start, so they are in global memory by now; read through the L2 (ld.cg), never a stale L1
  // line. The finalize reads them from shared memory (published by the barrier in `ready`): a
  // loop of global loads there would be K dependent memory latencies.
  const bool routed = p.experts_from_prior_kernel;
  auto load_pair = [&](const auto* at) { return routed ? __ldcg(at) : __ldg(at); };
  if (threadIdx.x < p.top_k) {
    pair_expert[threadIdx.x] = load_pair(p.pair_experts + threadIdx.x);
    pair_weight[threadIdx.x] = load_pair(p.topk_weights + threadIdx.x);
  }
  const int expert = load_pair(p.pair_experts + pair);
  const bool in = expert >= 0 && expert < p.experts;
  const int chunks = p.inter / 64, n_sub = p.hidden / 16;
  const int per_slice = (chunks + p.slices2 - 1) / p.slices2;
  const int kc_begin = in ? min(chunks, slice * per_slice) : 0;
  const int kc_end = in ? min(chunks, kc_begin + per_slice) : 0;
  const int sub[1] = {v};
  const int g = lane >> 2;
  const int e = in ? expert : 0;
  const uint4* wp[1] = {p.w2 + (static_cast<int64_t>(e) * n_sub + v) * chunks * 32 + lane};
  const int64_t scale_base = static_cast<int64_t>(e) * (p.inter / p.group2) * n_sub * 8 + g;
  const uint32_t* sp = p.s2 + scale_base;
  const uint32_t* zp = kZeros ? p.z2 + scale_base : nullptr;
  const T* xs = acts + pair * p.inter;
  float acc[1][1][4];
  OneTokenStream<T, kCode, kZeros, 1>(
      wp, sp, zp, n_sub, sub, p.group2_div, xs, kc_begin, kc_end, lane,
      [&] {
        // pair_expert published before the wait (the warps would only wait there anyway), so
        // that after it the copy needs no global read but the act rows themselves.
        __syncthreads();
        WaitForPriorGrids();  // GEMM1's act rows
        AllowDependentGrids();
        // Every row's 16-byte pieces at once, two a thread before either is stored (a row at a
        // time took K dependent L2 latencies while the other warps waited at the barrier).
        // Rows of pairs without an expert were never written: not read.
        const int row_vecs = p.inter * static_cast<int>(sizeof(T)) / 16;
        const int vecs = p.top_k * row_vecs, stride = blockDim.x;
        const uint4* src = static_cast<const uint4*>(p.act);
        uint4* dst = reinterpret_cast<uint4*>(acts);
        auto row_in = [&](int i) {
          if (i >= vecs) return false;
          const int eq = pair_expert[i / row_vecs];
          return eq >= 0 && eq < p.experts;
        };
        for (int i = threadIdx.x; i < vecs; i += 2 * stride) {
          const bool in0 = row_in(i), in1 = row_in(i + stride);
          uint4 v0, v1;
          if (in0) v0 = __ldg(src + i);
          if (in1) v1 = __ldg(src + i + stride);
          if (in0) dst[i] = v0;
          if (in1) dst[i + stride] = v1;
        }
        __syncthreads();
      },
      acc);
  if ((lane & 3) == 0) {
    part[warp * 16 + g] = acc[0][0][0];
    part[warp * 16 + g + 8] = acc[0][0][2];
  }
  __syncthreads();
  if (threadIdx.x >= 16) return;
  const int r = threadIdx.x, col = v * 16 + r;
  float sum = 0.0f;
  for (int k = 0; k < p.top_k; ++k) {  // slot order, as FinalizeTokenColumn
    const int ek = pair_expert[k];
    if (ek < 0 || ek >= p.experts) continue;
    float y = 0.0f;
    for (int s = 0; s < p.slices2; ++s) y += part[(k * p.slices2 + s) * 16 + r];
    if (p.b2) y += __ldg(p.b2 + static_cast<int64_t>(ek) * p.hidden + col);
    sum += RoundTo<T>(y * pair_weight[k]);
  }
  StoreHalf<T>(p.out, col, sum);
}

// Host: both kernels on `stream` (GEMM1 the op's first launch, or after the op's routing kernel
// with experts_from_prior_kernel). `layer`'s groups set (SetOneTokenGroups). Call only where
// OneTokenLayerError is empty.
template <typename T, NibbleCode kCode>
std::string LaunchOneTokenLayer(const OneTokenLayer& layer, bool experts_from_prior_kernel,
                                cudaStream_t stream) {
  OneTokenArgs a;
  static_cast<OneTokenLayer&>(a) = layer;
  a.experts_from_prior_kernel = experts_from_prior_kernel;
  // Slices of I per pair: at most eight chunks a warp (its two stages), warps permitting.
  a.slices2 = std::max(1, std::min(kOneTokenMaxWarps2 / a.top_k, (a.inter / 64 + 7) / 8));
  const size_t smem1 = static_cast<size_t>(OneTokenGemm1SmemBytes<T>(a.hidden));
  const size_t smem2 = static_cast<size_t>(OneTokenGemm2SmemBytes<T>(a.top_k, a.inter));
  const bool zeros = a.z13 != nullptr;
  auto gemm1 = zeros ? OneTokenGemm1Kernel<T, kCode, true> : OneTokenGemm1Kernel<T, kCode, false>;
  auto gemm2 = zeros ? OneTokenGemm2Kernel<T, kCode, true> : OneTokenGemm2Kernel<T, kCode, false>;
  for (auto kernel_smem : {std::make_pair(reinterpret_cast<const void*>(gemm1), smem1),
                           std::make_pair(reinterpret_cast<const void*>(gemm2), smem2)}) {
    if (kernel_smem.second > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(
          kernel_smem.first, cudaFuncAttributeMaxDynamicSharedMemorySize,
          static_cast<int>(kernel_smem.second));
      if (e != cudaSuccess) {
        return std::string("stream kernels' shared memory: ") + cudaGetErrorString(e);
      }
    }
  }
  const dim3 grid1(a.inter / 16, a.top_k), block1(kOneTokenWarps1 * 32);
  if (a.experts_from_prior_kernel) {
    LaunchAfterPrior(gemm1, grid1, block1, smem1, stream, a);
  } else {
    gemm1<<<grid1, block1, smem1, stream>>>(a);
  }
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return std::string("stream GEMM1 kernel: ") + cudaGetErrorString(e);
  }
  LaunchAfterPrior(gemm2, dim3(a.hidden / 16), dim3(a.top_k * a.slices2 * 32), smem2, stream, a);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return std::string("stream GEMM2 kernel: ") + cudaGetErrorString(e);
  }
  return "";
}

}  // namespace jax_moeq::cuda
