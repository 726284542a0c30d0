// GPU W4A8 fused MoE (SPEC §3-4) on Hopper int8 tensor cores:
//   alignment (AlignStandardKernel, shared with WNA16) -> per-row int8 quantization of x
//   -> GEMM1 (wgmma s8 x s8 -> s32, per-group promotion to f32, bias, activation) -> per-row int8
//   quantization of the activation -> GEMM2 (same GEMM, rows + bias rounded to T) -> finalize
//   (rounded top-k weighting and sum in slot order, as reference.fused_moe_w4a8).
// No XLA types.
//
// GEMM design (W4a8WgmmaKernel). A CTA computes 128 weight rows x one expert block of the
// alignment (block_m = kBM tokens: 128, 64 or 32, chosen per call by jax_moeq/ops/_gpu_launch.py).
// At 128, four warpgroups: warpgroup w owns 64 rows (row tile w & 1: GEMM1 0 = the gate rows
// 64 nt.., 1 = the matching up rows I + 64 nt..; GEMM2 rows 128 nt + 64 (w & 1)..) x 64 tokens
// (half w >> 1), wgmma m64n64k32. At 64 and 32, two warpgroups (the two row tiles) x all kBM
// tokens, two CTAs per SM (W8Tile), so that a decode-sized expert block is not padded to 128.
// The weights are wgmma's A operand from registers, the int8 tokens the B operand from shared
// memory (kBM tokens x 128 inputs per stage, K-major, 128-byte swizzle), as in the WNA16 wgmma GEMM
// (moe_int4_wgmma.cuh), whose token-tile addressing this reuses byte for byte.
//  - Int4 -> int8 in registers, not in shared memory: the packed fragment of a lane is its A
//    registers' bytes with row g in the low and row g + 8 in the high nibble, so
//    (word << 4) & 0xF0F0F0F0 and word & 0xF0F0F0F0 are the two registers, as int8 values 16 q
//    (a two's-complement nibble in the high half of a byte): two logic ops per 8 weights, no
//    shared-memory round trip for widened weights (which would double their shared traffic).
//    The factor 16 is exact: int32 sums stay below 2^31 (|16 q qa| <= 2^14, K <= 2^16) and it is
//    folded into the packed scales (sw / 16).
//  - Group scales: each group's s32 sum is its own wgmma accumulation (the first k-step of a group
//    overwrites, scale-d = 0); at the group's end the warpgroup waits for its MMAs and adds
//    sw * float(sum) into f32 accumulators, in group order (float32 across groups, SPEC §3).
//    Channel-wise scales need no promotion: one s32 sum over K, converted once.
//    The register budget (an s32 and an f32 accumulator per output) is why a warpgroup owns at
//    most a 64 x 64 tile here (32 + 32 accumulators per thread, 128 registers at 512 threads).
//  - Epilogue: y = scale_t * (acc - zp_t * row_corr[n]) + bias[n] (row_corr precomputed at pack
//    time, as the CPU layout). The tile is staged in the drained stages as floats (GEMM1: gate and
//    up rounded to x's dtype); then every thread finishes 8 consecutive features of a token (GEMM1:
//    the activation) and stores them as one 16-byte piece of the token's act / ws row.
//  - Pipeline: cp.async multi-stage ring (W8Tile::kStages stages, kAhead chunks ahead), every
//    thread issues its token pieces (the first two warpgroups the weight fragments and scales),
//    one barrier per chunk; up to kW8InFlight wgmma groups stay in flight between group ends. A
//    warp-specialised TMA pipeline was not attempted: this form shares the proven WNA16 wgmma
//    structure and its ordering rules.
#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "cuda/moe_int4_gemm.cuh"
#include "cuda/w4a8_moe.h"
#include "cuda/wgmma_ops.cuh"

namespace jax_moeq::cuda {
namespace {

constexpr int kW8Chunk = 128;    // inputs per pipeline stage (4 k-steps of 32)
constexpr int kW8InFlight = 3;
constexpr int kW8StageWeights = 8 * 1024;  // 8 warps' subtiles: 16 rows x 128 inputs / 2 each
// Shared memory an SM gives its CTAs (228 KB less 1 KB reserved per CTA), for the stage counts.
constexpr int kW8SmemPerSm = 228 * 1024;
constexpr int kW8MaxStages = 8;

// The GEMM's shape per token tile kBM (tokens per expert block: 128, 64 or 32), group size
// (kGroupSteps 32-deep k-steps per group, 0 channel-wise) and CTAs per SM. At 128 four warpgroups
// share the weight rows (two token halves of 64), one CTA per SM; at 64 and 32 two warpgroups (the
// two row tiles) each take the whole token tile, two CTAs per SM (three for the 32-token tile at
// short K, W8CtasPerSm), so that a decode-sized expert block is not padded to 128 tokens. A stage
// holds the token tile, the weight fragments and each lane's scale pairs of the chunk's groups; as
// many stages as the CTA's share of the SM holds (at most kW8MaxStages).
template <int kBM, int kGroupSteps, int kCtas>
struct W8Tile {
  static_assert(kBM == 128 || kBM == 64 || kBM == 32, "token tiles of 128, 64 or 32");
  static_assert(kCtas == (kBM == 128 ? 1 : 2) || (kBM == 32 && kCtas == 3), "CTAs per SM");
  static constexpr int kThreads = kBM == 128 ? 512 : 256;
  static constexpr int kWgTokens = kBM == 128 ? 64 : kBM;  // wgmma N
  static constexpr int kAcc = kWgTokens / 2;              // s32 (and f32) accumulators a thread
  static constexpr int kGroupsPerChunk = kGroupSteps > 0 ? 4 / kGroupSteps : 0;
  static constexpr int kScaleSlot = 8 * kGroupsPerChunk;  // bytes of scale pairs per lane
  static constexpr int kStageTokens = kBM * kW8Chunk;
  static constexpr int kStageBytes = kStageTokens + kW8StageWeights + 256 * kScaleSlot;
  static constexpr int kStaticSmem = kBM * 12;  // tok_id, tok_param
  static constexpr int StagesAt(int ctas) {
    return std::min(kW8MaxStages, (kW8SmemPerSm / ctas - 1024 - kStaticSmem - 1024) / kStageBytes);
  }
  static constexpr int kCtasPerSm = kCtas;
  static constexpr int kStages = StagesAt(kCtas);
  static constexpr int kAhead = kStages - 2;  // the stage refilled was read two chunks ago
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;
  static constexpr int kTileStride = kBM + 4;  // floats per row of the epilogue's staged tile
  static constexpr int kRowsPerPass = kThreads / 8;  // token rows one pass of 16-byte pieces covers
  static constexpr int kPieces = kBM / kRowsPerPass;
  static_assert(kStageBytes % 1024 == 0, "token tiles must stay 1024-byte aligned");
  static_assert(kStages >= 4, "a ring of at least four stages");
  static_assert(128 * kTileStride * 4 <= kStages * kStageBytes, "the tile fits the stages");
};
// A third CTA of the 32-token tile per SM (5 stages instead of 7 at group 128) paid at K <= 2048
// and lost at K >= 4096 (H100, 2026-11-27: Qwen3-30B-A3B T=256 177 -> 167 us, DeepSeek-V2-Lite
// 166 -> 159; Mixtral-8x7B T=64 323 -> 340): a short K leaves each CTA's pipeline fill and
// epilogue exposed, which a third CTA covers; a long K wants the deeper ring.
constexpr int kW8ThirdCtaMaxChunks = 16;

// Whether the 32-token tile of a group size keeps four stages with three CTAs per SM.
template <int kBM, int kGroupSteps>
constexpr bool kW8ThirdCtaFits = kBM == 32 && W8Tile<32, kGroupSteps, 2>::StagesAt(3) >= 4;

// CTAs per SM of a launch: 1 at 128 tokens, 2 at 64, and at 32 three for K of at most
// kW8ThirdCtaMaxChunks chunks where four stages still fit, else 2.
template <int kBM, int kGroupSteps>
int W8CtasPerSm(int k) {
  if constexpr (kBM == 128) {
    return 1;
  } else if constexpr (kW8ThirdCtaFits<kBM, kGroupSteps>) {
    return k / kW8Chunk <= kW8ThirdCtaMaxChunks ? 3 : 2;
  } else {
    return 2;
  }
}

// Largest K: |sum of 16 q qa| <= K * 2^14 must stay below 2^31.
constexpr int64_t kW8MaxFeatures = 65536;

template <typename T>
__device__ __forceinline__ float ToFloat(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return HalfType<T>::to_float(v);
  }
}

template <typename T>
__device__ __forceinline__ float RoundOut(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return RoundTo<T>(v);
  }
}

// Eight values rounded to T at base[index..index + 8) with 16-byte stores (index % 8 == 0, base
// 16-byte aligned).
template <typename T>
__device__ __forceinline__ void StoreOut8(void* base, int64_t index, const float (&v)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    float4* dst = reinterpret_cast<float4*>(reinterpret_cast<float*>(base) + index);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T lo = HalfType<T>::from_float(v[2 * i]);
      const T hi = HalfType<T>::from_float(v[2 * i + 1]);
      w[i] = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lo)) |
             (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
    }
    *reinterpret_cast<uint4*>(reinterpret_cast<T*>(base) + index) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The activation in float32. f32 activations use expf and IEEE division (the reference's
// formula, to a few ulps); bf16/fp16 the fast forms of the WNA16 epilogue (their error is far
// below the rounding to the dtype that follows).
template <typename T>
__device__ __forceinline__ float W4a8Activation(int kind, float gate, float up) {
  if constexpr (std::is_same_v<T, float>) {
    if (kind == 1) {
      const float g = fminf(gate, 7.0f);
      const float u = fminf(fmaxf(up, -7.0f), 7.0f);
      const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(__fmul_rn(-1.702f, g))));
      return __fmul_rn(__fadd_rn(u, 1.0f), __fmul_rn(g, sig));
    }
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate)));
    return __fmul_rn(__fmul_rn(gate, sig), up);
  } else {
    return ApplyActivation(kind, gate, up);
  }
}

// float(v) for |v| < 2^22 with an integer and a float add (full-rate units) instead of I2F.
__device__ __forceinline__ float SmallIntToFloat(int32_t v) {
  return __int_as_float(v + 0x4B400000) - 12582912.0f;
}

__device__ __forceinline__ void CpAsyncShared8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ float2 LdShared64f(uint32_t a) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(a) : "memory");
  return v;
}

// ------------------------------------------------------------------ activation quantization
// One CTA per row: a = x[row / in_div] (times row_weights[row], rounded to T, when given), then
// SPEC §3's rule in float32 with every operation rounded as written (no contraction):
// rmin/rmax with 0, scale = (rmax - rmin) / 255, inv = 1 / scale, the zero point from the two
// terms, round half to even, clamp. Rows whose expert (row_experts) is outside [0, experts) are
// skipped (nothing reads them). Non-finite rows: q = 0, zero point 0, scale NaN (as the reference).
constexpr int kQuantThreads = 256;

// One row's quantization parameters from its range (mn <= 0 <= mx) and whether it holds a
// non-finite value; `live` is false for rows quantized to zeros (constant or non-finite).
struct RowQuant {
  float scale, inv;
  int zp;
  bool live;
};

__device__ __forceinline__ RowQuant RowQuantFromRange(float mn, float mx, bool bad) {
  RowQuant r;
  r.scale = __fdiv_rn(__fsub_rn(mx, mn), 255.0f);
  r.inv = __fdiv_rn(1.0f, r.scale);
  const bool empty = (mx == mn) || !(r.inv <= FLT_MAX);
  if (empty) {
    r.scale = 0.0f;
    r.inv = 0.0f;
  }
  const float min_term = __fadd_rn(-128.0f, __fmul_rn(mn, r.inv));
  const float max_term = __fadd_rn(127.0f, __fmul_rn(mx, r.inv));
  float zpf = __fadd_rn(min_term, max_term) > 0.0f ? __fsub_rn(-128.0f, __fmul_rn(mn, r.inv))
                                                   : __fsub_rn(127.0f, __fmul_rn(mx, r.inv));
  zpf = fminf(fmaxf(zpf, -128.0f), 127.0f);
  r.zp = empty ? 0 : __float2int_rn(zpf);
  if (bad) {
    r.zp = 0;
    r.scale = __int_as_float(0x7fc00000);
  }
  r.live = !empty && !bad;
  return r;
}

// The int8 value of a (one float32 multiply, round half to even, the zero point, clamp).
__device__ __forceinline__ int QuantizeValue(float a, const RowQuant& rq) {
  return min(127, max(-128, __float2int_rn(__fmul_rn(a, rq.inv)) + rq.zp));
}

// The value quantized for input v: v times the row's router weight w rounded to T when the row
// is weighted, else v.
template <typename T>
__device__ __forceinline__ float WeightedInput(float v, bool weighted, float w) {
  return weighted ? RoundOut<T>(__fmul_rn(v, w)) : v;
}

template <typename T>
__device__ __forceinline__ float QuantInput(const T* src, int j, bool weighted, float w) {
  return WeightedInput<T>(ToFloat(src[j]), weighted, w);
}

// A row's range with 0 and whether it holds a non-finite value, gathered by the threads that
// read the row.
struct RowRange {
  float mn = 0.0f, mx = 0.0f;
  int bad = 0;

  __device__ __forceinline__ void Add(float v) {
    mn = fminf(mn, v);
    mx = fmaxf(mx, v);
    bad |= !isfinite(v);
  }

  // The range of the warp's 32 lanes, in every lane.
  __device__ __forceinline__ void ReduceWarp() {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, d));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
      bad |= __shfl_xor_sync(0xffffffffu, bad, d);
    }
  }
};

// Where the quantizers wait for the op's previous kernel (dependent_launch.cuh). kBeforeWork: the
// rule's place, first. kAfterWork: x's quantizer, which reads only the op's inputs and writes rows
// no earlier kernel of the op touches, runs beside the alignment and waits for it last, in every
// thread, so that its completion still implies the alignment's (GEMM1 waits only for it).
enum class QuantWait { kBeforeWork, kAfterWork };

template <typename T>
__device__ __forceinline__ void QuantizeRowCta(const T* x, int in_div, const float* row_weights,
                                               const int32_t* row_experts, int experts, int cols,
                                               int rows, int8_t* q, float2* params) {
  const int r = blockIdx.x;
  if (r >= rows) return;
  if (row_experts) {
    const int e = row_experts[r];
    if (e < 0 || e >= experts) return;
  }
  const T* src = x + static_cast<int64_t>(r / in_div) * cols;
  const bool weighted = row_weights != nullptr;
  const float w = weighted ? row_weights[r] : 1.0f;
  RowRange range;
  for (int j = threadIdx.x; j < cols; j += kQuantThreads) {
    range.Add(QuantInput(src, j, weighted, w));
  }
  __shared__ float s_mn[kQuantThreads / 32], s_mx[kQuantThreads / 32];
  __shared__ int s_bad[kQuantThreads / 32];
  range.ReduceWarp();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    s_mn[warp] = range.mn;
    s_mx[warp] = range.mx;
    s_bad[warp] = range.bad;
  }
  __syncthreads();
  float mn = s_mn[0], mx = s_mx[0];
  int bad = s_bad[0];
#pragma unroll
  for (int i = 1; i < kQuantThreads / 32; ++i) {
    mn = fminf(mn, s_mn[i]);
    mx = fmaxf(mx, s_mx[i]);
    bad |= s_bad[i];
  }
  const RowQuant rq = RowQuantFromRange(mn, mx, bad != 0);
  int8_t* dst = q + static_cast<int64_t>(r) * cols;
  for (int j = threadIdx.x; j < cols; j += kQuantThreads) {
    const int qa = rq.live ? QuantizeValue(QuantInput(src, j, weighted, w), rq) : 0;
    dst[j] = static_cast<int8_t>(qa);
  }
  if (threadIdx.x == 0) params[r] = make_float2(rq.scale, static_cast<float>(rq.zp));
}

template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    W4a8QuantizeRowsKernel(const T* x, int in_div, const float* row_weights,
                           const int32_t* row_experts, int experts, int cols, int rows, int8_t* q,
                           float2* params, QuantWait wait) {
  if (wait == QuantWait::kBeforeWork) WaitForPriorGrids();
  AllowDependentGrids();
  QuantizeRowCta<T>(x, in_div, row_weights, row_experts, experts, cols, rows, q, params);
  if (wait == QuantWait::kAfterWork) WaitForPriorGrids();
}

// The same quantizer with one warp per row and 16-byte loads (rows of at most
// kQuantWarpMaxCols elements, a multiple of 16 / sizeof(T); row starts 16-byte aligned): the
// CTA-per-row form spent most of its time in the block reduction and launch at I = 768.
constexpr int kQuantWarpMaxCols = 4096;
constexpr int kQuantWarpsPerCta = 8;

template <typename T>
__device__ __forceinline__ void UnpackVec(const uint4& raw, float (&v)[16 / sizeof(T)]) {
  if constexpr (std::is_same_v<T, float>) {
    v[0] = __uint_as_float(raw.x);
    v[1] = __uint_as_float(raw.y);
    v[2] = __uint_as_float(raw.z);
    v[3] = __uint_as_float(raw.w);
  } else {
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ToFloat(h[i]);
  }
}

// The int8 values of one 16-byte piece of a row (v: its values, weighted), packed four to a word in
// input order, stored at piece j of dst.
template <int kVec>
__device__ __forceinline__ void StoreQuantizedPiece(const float (&v)[kVec], const RowQuant& rq,
                                                    int8_t* dst, int j) {
  uint32_t packed[kVec / 4];
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const int qa = rq.live ? QuantizeValue(v[i], rq) : 0;
    if (i % 4 == 0) packed[i / 4] = 0;
    packed[i / 4] |= (static_cast<uint32_t>(qa) & 0xFFu) << (8 * (i % 4));
  }
  if constexpr (kVec == 8) {
    reinterpret_cast<uint2*>(dst)[j] = make_uint2(packed[0], packed[1]);
  } else {
    reinterpret_cast<uint32_t*>(dst)[j] = packed[0];
  }
}

template <typename T>
__device__ __forceinline__ void WeightedPiece(const uint4& raw, bool weighted, float w,
                                              float (&v)[16 / sizeof(T)]) {
  constexpr int kVec = 16 / sizeof(T);
  UnpackVec<T>(raw, v);
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = WeightedInput<T>(v[i], weighted, w);
}

// SPEC §3's two passes over a warp's row: its range, then its int8 values and parameters.
// for_each_piece(f) calls f(piece, j) for each of the lane's 16-byte pieces j, in the same order
// both times, so that the row may come from registers or from memory.
template <typename T, typename ForEachPiece>
__device__ __forceinline__ void QuantizeWarpPieces(ForEachPiece for_each_piece, bool weighted,
                                                   float w, int8_t* dst, float2* param) {
  constexpr int kVec = 16 / sizeof(T);
  float v[kVec];
  RowRange range;
  for_each_piece([&](const uint4& raw, int) {
    WeightedPiece<T>(raw, weighted, w, v);
#pragma unroll
    for (int i = 0; i < kVec; ++i) range.Add(v[i]);
  });
  range.ReduceWarp();
  const RowQuant rq = RowQuantFromRange(range.mn, range.mx, range.bad != 0);
  for_each_piece([&](const uint4& raw, int j) {
    WeightedPiece<T>(raw, weighted, w, v);
    StoreQuantizedPiece<kVec>(v, rq, dst, j);
  });
  if ((threadIdx.x & 31) == 0) *param = make_float2(rq.scale, static_cast<float>(rq.zp));
}

// 16-byte pieces a lane keeps in registers: a row of up to 32 * kQuantLanePieces pieces (4096
// bf16 / fp16 values, 2048 f32) is read once, all its loads in flight together, instead of twice
// in a loop of dependent steps (the decode rows, one or a few per call, waited on each).
constexpr int kQuantLanePieces = 16;

template <typename T>
__device__ __forceinline__ void QuantizeRowWarp(const T* x, int in_div, const float* row_weights,
                                                const int32_t* row_experts, int experts, int cols,
                                                int rows, int8_t* q, float2* params) {
  constexpr int kVec = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kQuantWarpsPerCta + (threadIdx.x >> 5);
  if (r >= rows) return;
  if (row_experts) {
    const int e = row_experts[r];
    if (e < 0 || e >= experts) return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r / in_div) * cols);
  const bool weighted = row_weights != nullptr;
  const float w = weighted ? row_weights[r] : 1.0f;
  const int vecs = cols / kVec;
  int8_t* dst = q + static_cast<int64_t>(r) * cols;
  if (vecs <= 32 * kQuantLanePieces) {
    uint4 held[kQuantLanePieces];
#pragma unroll
    for (int u = 0; u < kQuantLanePieces; ++u) {
      if (lane + 32 * u < vecs) held[u] = __ldg(src + lane + 32 * u);
    }
    QuantizeWarpPieces<T>(
        [&](auto&& f) {
#pragma unroll
          for (int u = 0; u < kQuantLanePieces; ++u) {
            if (lane + 32 * u < vecs) f(held[u], lane + 32 * u);
          }
        },
        weighted, w, dst, params + r);
  } else {
    QuantizeWarpPieces<T>(
        [&](auto&& f) {
          for (int j = lane; j < vecs; j += 32) f(__ldg(src + j), j);
        },
        weighted, w, dst, params + r);
  }
}

template <typename T>
__global__ void __launch_bounds__(kQuantWarpsPerCta * 32)
    W4a8QuantizeRowsWarpKernel(const T* x, int in_div, const float* row_weights,
                               const int32_t* row_experts, int experts, int cols, int rows,
                               int8_t* q, float2* params, QuantWait wait) {
  if (wait == QuantWait::kBeforeWork) WaitForPriorGrids();
  AllowDependentGrids();
  QuantizeRowWarp<T>(x, in_div, row_weights, row_experts, experts, cols, rows, q, params);
  if (wait == QuantWait::kAfterWork) WaitForPriorGrids();
}

// Launches the warp-per-row form where it applies, else the CTA-per-row one.
template <typename T>
void LaunchQuantizeRows(const T* x, int in_div, const float* row_weights,
                        const int32_t* row_experts, int experts, int cols, int rows, int8_t* q,
                        float2* params, cudaStream_t stream,
                        QuantWait wait = QuantWait::kBeforeWork) {
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec == 0 && cols <= kQuantWarpMaxCols &&
      reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0) {
    const unsigned ctas = static_cast<unsigned>((rows + kQuantWarpsPerCta - 1) / kQuantWarpsPerCta);
    LaunchAfterPrior(W4a8QuantizeRowsWarpKernel<T>, dim3(ctas), dim3(kQuantWarpsPerCta * 32), 0,
                     stream, x, in_div, row_weights, row_experts, experts, cols, rows, q, params,
                     wait);
  } else {
    LaunchAfterPrior(W4a8QuantizeRowsKernel<T>, dim3(static_cast<unsigned>(rows)),
                     dim3(kQuantThreads), 0, stream, x, in_div, row_weights, row_experts, experts,
                     cols, rows, q, params, wait);
  }
}

// ------------------------------------------------------------------ the GEMM
struct W4a8GemmArgs {
  const int8_t* xq = nullptr;      // quantized input rows, row stride k
  int in_div = 1;                  // quantized row = pair id / in_div
  const float2* xparams = nullptr; // per quantized row: (scale, zero point)
  const int32_t* sorted_ids = nullptr;
  const int32_t* expert_ids = nullptr;
  const int32_t* num_post_padded = nullptr;
  int num_rows = 0;                // ids >= num_rows are padding
  bool blk_on_x = true;            // blockIdx.x = expert block (else blockIdx.y)
  const uint4* w = nullptr;
  const float* scales = nullptr;
  const float* row_corr = nullptr;
  const float* bias = nullptr;     // [E][n] or null
  int n = 0, k = 0, groups = 1;
  int activation = 0;
  void* act = nullptr;             // GEMM1: [rows][n / 2] in T
  void* ws = nullptr;              // GEMM2: [rows][n] in T, rounded (the reference rounds y2)
};

// kGroupSteps: 32-deep k-steps per scale group (1, 2, 4), 0 for channel-wise scales. kBM: tokens
// per expert block; kCtas: CTAs per SM (W8Tile, W8CtasPerSm).
template <typename T, int kGroupSteps, bool kGemm1, int kBM, int kCtas>
__global__ void __launch_bounds__(W8Tile<kBM, kGroupSteps, kCtas>::kThreads, kCtas)
    W4a8WgmmaKernel(W4a8GemmArgs p) {
  using Tile = W8Tile<kBM, kGroupSteps, kCtas>;
  WaitForPriorGrids();
  AllowDependentGrids();
  const int blk = p.blk_on_x ? blockIdx.x : blockIdx.y;
  const int n_tile = p.blk_on_x ? blockIdx.y : blockIdx.x;
  // Whole-CTA exits only (every thread takes part in the barriers below).
  if (blk * kBM >= __ldg(p.num_post_padded)) return;
  if (__ldg(p.sorted_ids + blk * kBM) >= p.num_rows) return;  // empty block
  const int expert = __ldg(p.expert_ids + blk);
  if (expert < 0) return;

  extern __shared__ __align__(1024) uint8_t w8_smem_raw[];
  __shared__ int tok_id[kBM];
  __shared__ float2 tok_param[kBM];
  const uint32_t smem = (SharedAddress(w8_smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  // Warpgroup wg: row tile rt = wg & 1 (GEMM1: gate / up), token half = wg >> 1 (always 0 below
  // 128 tokens).
  const int wg = warp >> 2, rt = wg & 1, half = wg >> 1;
  const int n_sub = p.n / 16;
  int sub;
  bool tile_ok = true;
  if constexpr (kGemm1) {
    sub = (rt ? n_sub / 2 : 0) + 4 * n_tile + (warp & 3);
  } else {
    // A second tile past N (N % 128 == 64) computes on subtile 0's weights and stores nothing:
    // branching around the MMAs would serialize them.
    tile_ok = 8 * n_tile + 4 * rt < n_sub;
    sub = tile_ok ? 8 * n_tile + 4 * rt + (warp & 3) : (warp & 3);
  }
  if (tid < kBM) {
    const int id = __ldg(p.sorted_ids + blk * kBM + tid);
    tok_id[tid] = id;
    tok_param[tid] = id < p.num_rows ? p.xparams[id / p.in_div] : make_float2(0.0f, 0.0f);
  }
  const int chunks = p.k / kW8Chunk;

  // Token pieces: rows (tid / 8) + kRowsPerPass i, 16-byte piece tid % 8 (16 inputs), swizzled.
  constexpr int kPieces = Tile::kPieces;
  const int piece = tid & 7;
  const int row_in_atom = (tid >> 3) & 7;
  const uint32_t tile_off = (tid >> 6) * 1024 + row_in_atom * 128 + ((piece ^ row_in_atom) << 4);
  const int8_t* xcur[kPieces];
  uint32_t xbytes[kPieces];
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    const int id = __ldg(p.sorted_ids + blk * kBM + (tid >> 3) + Tile::kRowsPerPass * i);
    const bool ok = id < p.num_rows;
    xbytes[i] = ok ? 16 : 0;
    xcur[i] = p.xq + (ok ? static_cast<int64_t>(id / p.in_div) * p.k : 0) + 16 * piece;
  }
  const uint4* wcur = p.w + (static_cast<int64_t>(expert) * n_sub + sub) * chunks * 64 + lane * 2;
  const float* sbase =
      p.scales + (static_cast<int64_t>(expert) * n_sub + sub) * p.groups * 16 + 2 * g;
  // Both token halves of a row tile read the same weight fragments and scales: the warps of
  // half 0 copy them, into slots indexed by (row tile, warp in the warpgroup, lane).
  const int slot = (rt * 4 + (warp & 3)) * 32 + lane;
  const uint32_t weight_off = Tile::kStageTokens + slot * 32;
  const uint32_t scale_off = Tile::kStageTokens + kW8StageWeights + slot * Tile::kScaleSlot;
  const bool copies_weights = half == 0;
  constexpr int kGroupsPerChunk = Tile::kGroupsPerChunk;
  auto issue = [&](int kc, uint32_t st) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      CpAsyncSharedOrZero(st + tile_off + Tile::kRowsPerPass * 128 * i, xcur[i], xbytes[i]);
      xcur[i] += kW8Chunk;
    }
    if (copies_weights) {
      CpAsyncSharedStream(st + weight_off, wcur);
      CpAsyncSharedStream(st + weight_off + 16, wcur + 1);
#pragma unroll
      for (int q = 0; q < kGroupsPerChunk; ++q) {
        CpAsyncShared8(st + scale_off + 8 * q, sbase + (kc * kGroupsPerChunk + q) * 16);
      }
    }
    wcur += 64;
  };

  uint32_t write_stage = smem;
#pragma unroll
  for (int s = 0; s < Tile::kAhead; ++s) {
    if (s < chunks) issue(s, write_stage);
    CpAsyncCommit();
    write_stage += Tile::kStageBytes;
  }
  const uint32_t last_stage = smem + (Tile::kStages - 1) * Tile::kStageBytes;
  uint32_t read_stage = smem;

  constexpr int kAcc = Tile::kAcc;
  float accf[kAcc];
  int32_t acci[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    accf[i] = 0.0f;
    acci[i] = 0;
  }
  uint32_t a[4][4];  // [k-step][register]

  for (int c = 0; c < chunks; ++c) {
    CpAsyncWait<Tile::kAhead - 1>();  // this thread's pieces of chunk c have landed
    FenceProxyAsync();                 // ... and are visible to the tensor cores
    __syncthreads();  // every thread's pieces landed; chunk c - 2's MMAs are done everywhere
    if (c + Tile::kAhead < chunks) issue(c + Tile::kAhead, write_stage);
    CpAsyncCommit();
    write_stage = write_stage == last_stage ? smem : write_stage + Tile::kStageBytes;
    const uint32_t st = read_stage;
    read_stage = read_stage == last_stage ? smem : read_stage + Tile::kStageBytes;
    const uint4 w0 = LdShared128(st + weight_off);
    const uint4 w1 = LdShared128(st + weight_off + 16);
    const uint32_t words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    float2 sc[kGroupsPerChunk > 0 ? kGroupsPerChunk : 1];
#pragma unroll
    for (int q = 0; q < kGroupsPerChunk; ++q) sc[q] = LdShared64f(st + scale_off + 8 * q);
    // This warpgroup's tokens (rows of 128 bytes).
    const uint64_t desc = SmemDescSwizzle128(st + Tile::kWgTokens * 128 * half);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      a[s][0] = (words[2 * s] << 4) & 0xF0F0F0F0u;
      a[s][1] = words[2 * s] & 0xF0F0F0F0u;
      a[s][2] = (words[2 * s + 1] << 4) & 0xF0F0F0F0u;
      a[s][3] = words[2 * s + 1] & 0xF0F0F0F0u;
      WgmmaFence();
      const bool accumulate = kGroupSteps > 0 ? (s % kGroupSteps) != 0 : (c > 0 || s > 0);
      WgmmaS8M64NxK32<Tile::kWgTokens>(acci, a[s], desc + 2 * s, accumulate);  // + 32 B a k-step
      WgmmaCommit();
      if constexpr (kGroupSteps > 0) {
        if ((s + 1) % kGroupSteps == 0) {
          WgmmaWait<0>();
          FenceAccumulators(acci);
          const float2 sp = sc[s / kGroupSteps];
#pragma unroll
          for (int i = 0; i < kAcc; ++i) {
            accf[i] = fmaf((i & 2) ? sp.y : sp.x, SmallIntToFloat(acci[i]), accf[i]);
          }
          FenceAccumulators(acci);
        } else {
          WgmmaWait<kW8InFlight>();
        }
      } else {
        WgmmaWait<kW8InFlight>();
      }
    }
  }
  WgmmaWait<0>();
  FenceAccumulators(acci);
  if constexpr (kGroupSteps == 0) {
    const float2 sp = *reinterpret_cast<const float2*>(sbase);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) accf[i] = ((i & 2) ? sp.y : sp.x) * __int2float_rn(acci[i]);
  }

  // Epilogue. Accumulator i = 4 j + c: row g + 8 (c >> 1) of the warp's subtile, token column
  // kWgTokens half + 8 j + 2 t + (c & 1) of the block.
  CpAsyncWait<0>();  // the last groups are empty, but no copy may land in the reused stages
  __syncthreads();   // every warp has read its last stage (and tok_* are written)
  const int64_t row_base = static_cast<int64_t>(expert) * p.n;
  float rc[2], bias[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = sub * 16 + g + 8 * h;
    rc[h] = __ldg(p.row_corr + row_base + n);
    bias[h] = p.bias ? __ldg(p.bias + row_base + n) : 0.0f;
  }
  auto output = [&](int i) {
    const int h = (i >> 1) & 1;
    const float2 tp = tok_param[Tile::kWgTokens * half + 8 * (i >> 2) + 2 * t + (i & 1)];
    return (accf[i] - tp.y * rc[h]) * tp.x + bias[h];
  };
  // The tile goes through shared memory (the drained stages) as floats, [row][token], so that
  // each thread then finishes 8 consecutive features of one token and stores them as one 16-byte
  // piece (32 for f32) of the token's row: a token's features are contiguous in act and ws.
  float* tile = reinterpret_cast<float*>(w8_smem_raw + (smem - SharedAddress(w8_smem_raw)));
  const int tile_row = 64 * rt + 16 * (warp & 3) + g;  // + 8 h
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int col = Tile::kWgTokens * half + 8 * (i >> 2) + 2 * t + (i & 1);
    const float y = output(i);
    // GEMM1 rounds gate and up to T before the activation, as the reference.
    tile[(tile_row + 8 * ((i >> 1) & 1)) * Tile::kTileStride + col] =
        kGemm1 ? RoundOut<T>(y) : y;
  }
  __syncthreads();
  // GEMM1: rows 0..63 are the gate rows of act features 64 nt.., rows 64..127 the matching up
  // rows. GEMM2: rows 0..127 are features 128 nt.. of ws (those past N are not stored).
  constexpr int kOutRows = kGemm1 ? 64 : 128;
  constexpr int kItems = kOutRows / 8 * kBM;  // (8-feature piece, token) pairs
  const int out_ld = kGemm1 ? p.n / 2 : p.n;
  const int feature0 = kOutRows * n_tile;
#pragma unroll
  for (int item = tid; item < kItems; item += Tile::kThreads) {
    const int col = item % kBM;  // a warp takes 32 tokens of one piece: no bank conflicts
    const int row0 = 8 * (item / kBM);
    const int id = tok_id[col];
    if (id >= p.num_rows || feature0 + row0 >= out_ld) continue;
    float v[8];
#pragma unroll
    for (int f = 0; f < 8; ++f) {
      const float y = tile[(row0 + f) * Tile::kTileStride + col];
      if constexpr (kGemm1) {
        const float up = tile[(64 + row0 + f) * Tile::kTileStride + col];
        v[f] = W4a8Activation<T>(p.activation, y, up);
      } else {
        v[f] = y;
      }
    }
    StoreOut8<T>(kGemm1 ? p.act : p.ws, static_cast<int64_t>(id) * out_ld + feature0 + row0, v);
  }
}

template <typename T, int kGroupSteps, bool kGemm1, int kBM, int kCtas>
void LaunchW4a8Kernel(const W4a8GemmArgs& args, dim3 grid, cudaStream_t stream) {
  using Tile = W8Tile<kBM, kGroupSteps, kCtas>;
  // Once per instantiation and device (device_cache.cuh); a failure shows as the launch's. The
  // table is a static of this function template, so each kernel instantiation has its own.
  static SmemOptInTable opted_in;
  (void)EnsureDynamicSmem(opted_in, W4a8WgmmaKernel<T, kGroupSteps, kGemm1, kBM, kCtas>,
                          Tile::kSmemBytes);
  LaunchAfterPrior(W4a8WgmmaKernel<T, kGroupSteps, kGemm1, kBM, kCtas>, grid,
                   dim3(Tile::kThreads), Tile::kSmemBytes, stream, args);
}

template <typename T, int kGroupSteps, bool kGemm1, int kBM>
void LaunchW4a8GemmFor(const W4a8GemmArgs& args, dim3 grid, cudaStream_t stream) {
  switch (W8CtasPerSm<kBM, kGroupSteps>(args.k)) {
    case 1:
      if constexpr (kBM == 128) {
        LaunchW4a8Kernel<T, kGroupSteps, kGemm1, kBM, 1>(args, grid, stream);
      }
      break;
    case 3:
      if constexpr (kW8ThirdCtaFits<kBM, kGroupSteps>) {
        LaunchW4a8Kernel<T, kGroupSteps, kGemm1, kBM, 3>(args, grid, stream);
      }
      break;
    default:
      if constexpr (kBM != 128) {
        LaunchW4a8Kernel<T, kGroupSteps, kGemm1, kBM, 2>(args, grid, stream);
      }
  }
}

template <typename T, bool kGemm1, int kBM>
std::string LaunchW4a8GemmTile(const W4a8GemmArgs& args, dim3 grid, cudaStream_t stream) {
  const int steps = args.groups == 1 ? 0 : (args.k / args.groups) / 32;
  switch (steps) {
    case 0: LaunchW4a8GemmFor<T, 0, kGemm1, kBM>(args, grid, stream); break;
    case 1: LaunchW4a8GemmFor<T, 1, kGemm1, kBM>(args, grid, stream); break;
    case 2: LaunchW4a8GemmFor<T, 2, kGemm1, kBM>(args, grid, stream); break;
    case 4: LaunchW4a8GemmFor<T, 4, kGemm1, kBM>(args, grid, stream); break;
    default: return "unsupported group size " + std::to_string(args.k / args.groups);
  }
  return "";
}

template <typename T, bool kGemm1>
std::string LaunchW4a8Gemm(const W4a8GemmArgs& args, int block_m, dim3 grid,
                           cudaStream_t stream) {
  switch (block_m) {
    case 128: return LaunchW4a8GemmTile<T, kGemm1, 128>(args, grid, stream);
    case 64: return LaunchW4a8GemmTile<T, kGemm1, 64>(args, grid, stream);
    case 32: return LaunchW4a8GemmTile<T, kGemm1, 32>(args, grid, stream);
    default: return "unsupported block_m " + std::to_string(block_m);
  }
}

// ------------------------------------------------------------------ finalize
// out[t][n] = sum over slots k in order, from 0, each step rounded to T, of v = round(ws2 row)
// (bias included), times topk_weights[t][k] and rounded again unless the weight was applied on
// the input; pairs whose expert is outside [0, experts) contribute nothing. This is the W4A8
// reference's rounding (reference._combine_rounded), which differs from FinalizeTokenColumn's
// (WNA16: one f32 sum, one rounding), so the WNA16 finalize is not reused here.
constexpr int kFinalizeThreads = 128;

template <typename T>
__global__ void W4a8FinalizeKernel(const void* ws, const int32_t* topk_ids,
                                   const float* topk_weights, int top_k, int hidden, int tokens,
                                   int experts, bool weight_on_input, void* out) {
  WaitForPriorGrids();
  AllowDependentGrids();
  // Each thread finishes 8 consecutive features of one token (hidden % 8 == 0): its pairs' rows
  // are read as 16-byte pieces (32 for f32), the bytes in flight a token of few pairs needs.
  const int t = blockIdx.x;
  const int n = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
  if (t >= tokens || n >= hidden) return;
  // Eight pairs' rows are loaded before any is used (LoadPairRows8); the sum keeps the order of k,
  // rounding after every add (SPEC §4), unlike FinalizeRoundedRowsKernel.
  constexpr int kBatch = 8;
  float sum[8] = {};
  for (int k0 = 0; k0 < top_k; k0 += kBatch) {
    bool in[kBatch];
    float y[kBatch][8];
    LoadPairRows8<T>(static_cast<const T*>(ws), topk_ids, experts, top_k, hidden, t, k0, n, in,
                     y);
    float w[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      w[j] = in[j] && !weight_on_input ? __ldg(topk_weights + t * top_k + k0 + j) : 1.0f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (!in[j]) continue;
#pragma unroll
      for (int f = 0; f < 8; ++f) {
        float v = y[j][f];  // rounded to T by GEMM2
        if (!weight_on_input) v = RoundOut<T>(__fmul_rn(v, w[j]));
        sum[f] = RoundOut<T>(__fadd_rn(sum[f], v));
      }
    }
  }
  StoreOut8<T>(out, static_cast<int64_t>(t) * hidden + n, sum);
}

std::string CudaError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return "";
  return std::string(what) + ": " + cudaGetErrorString(err);
}

template <typename T>
std::string RunTyped(const W4a8MoeProblem& p, cudaStream_t stream) {
  const int64_t rows = W4a8MoeRows(p);
  const int64_t in_rows = W4a8MoeInputRows(p);
  const int64_t max_padded = W4a8MoeMaxPadded(p);
  const int64_t max_blocks = W4a8MoeMaxBlocks(p);
  const int H = static_cast<int>(p.hidden), I = static_cast<int>(p.intermediate);
  const int E = static_cast<int>(p.experts), K = static_cast<int>(p.top_k);
  const int bm = static_cast<int>(p.block_m);

  // 1. Token-to-expert alignment in blocks of block_m (the WNA16 launcher's; no workspace to zero:
  // nothing here splits K).
  StandardAlignment a =
      MakeStandardAlignment(p.topk_ids, rows, E, bm, max_padded, max_blocks, p.sorted_ids,
                            p.expert_ids, p.num_post_padded);
  a.scratch = p.ws2;  // GEMM2's rows, written only after the alignment
  a.scratch_bytes = rows * H * static_cast<int64_t>(p.dtype == W4a8Dtype::kF32 ? 4 : 2);
  LaunchStandardAlignment(a, /*first_kernel=*/true, stream);
  std::string err = CudaError("alignment kernel");
  if (!err.empty()) return err;

  // 2. GEMM1's input rows in int8: per token, or per pair (x[t] * w[t][k] rounded) when the
  // router weight goes on the input. Only the op's inputs are read, so it runs beside the
  // alignment (QuantWait::kAfterWork).
  LaunchQuantizeRows<T>(static_cast<const T*>(p.x), p.weight_on_input ? K : 1,
                        p.weight_on_input ? p.topk_weights : nullptr,
                        p.weight_on_input ? p.topk_ids : nullptr, E, H,
                        static_cast<int>(in_rows), p.qx, reinterpret_cast<float2*>(p.x_params),
                        stream, QuantWait::kAfterWork);
  err = CudaError("input quantization kernel");
  if (!err.empty()) return err;

  // 3. GEMM1 + activation; expert blocks fastest (a wave covers every token block of an N tile,
  // whose weights it reads once).
  W4a8GemmArgs g1;
  g1.xq = p.qx;
  g1.in_div = p.weight_on_input ? 1 : K;
  g1.xparams = reinterpret_cast<const float2*>(p.x_params);
  g1.sorted_ids = p.sorted_ids;
  g1.expert_ids = p.expert_ids;
  g1.num_post_padded = p.num_post_padded;
  g1.num_rows = static_cast<int>(rows);
  g1.blk_on_x = true;
  g1.w = static_cast<const uint4*>(p.w13);
  g1.scales = p.s13;
  g1.row_corr = p.rc13;
  g1.bias = p.has_bias ? p.b13 : nullptr;
  g1.n = 2 * I;
  g1.k = H;
  g1.groups = static_cast<int>(p.groups13);
  g1.activation = p.activation;
  g1.act = p.act;
  err = LaunchW4a8Gemm<T, true>(g1, bm, dim3(static_cast<unsigned>(max_blocks), I / 64), stream);
  if (!err.empty()) return err;
  err = CudaError("GEMM1 kernel");
  if (!err.empty()) return err;

  // 4. The activation rows in int8 (pairs without a valid expert are skipped).
  LaunchQuantizeRows<T>(static_cast<const T*>(p.act), 1, nullptr, p.topk_ids, E, I,
                        static_cast<int>(rows), p.qact, reinterpret_cast<float2*>(p.act_params),
                        stream);
  err = CudaError("activation quantization kernel");
  if (!err.empty()) return err;

  // 5. GEMM2 into rows of T (bias included, rounded as the reference rounds y2); N tiles fastest so the CTAs of one token block run
  // together and read its rows once.
  W4a8GemmArgs g2 = g1;
  g2.xq = p.qact;
  g2.in_div = 1;
  g2.xparams = reinterpret_cast<const float2*>(p.act_params);
  g2.w = static_cast<const uint4*>(p.w2);
  g2.scales = p.s2;
  g2.row_corr = p.rc2;
  g2.bias = p.has_bias ? p.b2 : nullptr;
  g2.n = H;
  g2.k = I;
  g2.groups = static_cast<int>(p.groups2);
  g2.act = nullptr;
  g2.ws = p.ws2;
  const unsigned n_tiles2 = static_cast<unsigned>((H + 127) / 128);
  if (max_blocks <= 65535) {
    g2.blk_on_x = false;
    err = LaunchW4a8Gemm<T, false>(g2, bm, dim3(n_tiles2, static_cast<unsigned>(max_blocks)),
                                   stream);
  } else {
    g2.blk_on_x = true;
    err = LaunchW4a8Gemm<T, false>(g2, bm, dim3(static_cast<unsigned>(max_blocks), n_tiles2),
                                   stream);
  }
  if (!err.empty()) return err;
  err = CudaError("GEMM2 kernel");
  if (!err.empty()) return err;

  // 6. Rounded top-k weighting and the sum over slots.
  LaunchAfterPrior(W4a8FinalizeKernel<T>,
                   dim3(static_cast<unsigned>(p.tokens),
                        (H / 8 + kFinalizeThreads - 1) / kFinalizeThreads),
                   dim3(kFinalizeThreads), 0, stream, static_cast<const void*>(p.ws2), p.topk_ids,
                   p.topk_weights, K, H, static_cast<int>(p.tokens), E, p.weight_on_input,
                   p.out);
  return CudaError("finalize kernel");
}

}  // namespace

int64_t W4a8MoeRows(const W4a8MoeProblem& p) { return p.tokens * p.top_k; }

int64_t W4a8MoeInputRows(const W4a8MoeProblem& p) {
  return p.weight_on_input ? p.tokens * p.top_k : p.tokens;
}

int64_t W4a8MoeMaxPadded(const W4a8MoeProblem& p) {
  const int64_t bm = p.block_m;
  const int64_t pairs = W4a8MoeRows(p);
  const int64_t padded = pairs + std::min(pairs, p.experts) * (bm - 1);
  return std::max<int64_t>(bm, (padded + bm - 1) / bm * bm);
}

int64_t W4a8MoeMaxBlocks(const W4a8MoeProblem& p) { return W4a8MoeMaxPadded(p) / p.block_m; }

namespace {
std::string ValidateGroups(const char* name, int64_t groups, int64_t k) {
  if (groups <= 0 || k % groups != 0) {
    return std::string(name) + " scale groups must divide the input size " + std::to_string(k);
  }
  const int64_t size = k / groups;
  if (groups != 1 && size != 32 && size != 64 && size != 128) {
    return std::string(name) + " group size " + std::to_string(size) +
           " is not supported: 32, 64, 128 or channel-wise";
  }
  return "";
}
}  // namespace

std::string ValidateW4a8MoeProblem(const W4a8MoeProblem& p) {
  if (p.hidden <= 0 || p.hidden % 128 != 0) return "hidden size must be a positive multiple of 128";
  if (p.intermediate <= 0 || p.intermediate % 128 != 0) {
    return "intermediate size must be a positive multiple of 128";
  }
  if (p.hidden > kW8MaxFeatures || p.intermediate > kW8MaxFeatures) {
    return "hidden and intermediate sizes must be at most " + std::to_string(kW8MaxFeatures) +
           " (int32 sums of the int8 products)";
  }
  if (p.experts <= 0 || p.experts > 4096) return "number of experts must be in [1, 4096]";
  if (p.block_m != 32 && p.block_m != 64 && p.block_m != 128) {
    return "block_m must be 32, 64 or 128, got " + std::to_string(p.block_m);
  }
  if (p.tokens < 0) return "tokens must be >= 0";
  if (p.top_k < 1) return "top_k must be >= 1";
  if (std::string err = ValidateGroups("w13", p.groups13, p.hidden); !err.empty()) return err;
  if (std::string err = ValidateGroups("w2", p.groups2, p.intermediate); !err.empty()) return err;
  if (p.activation < 0 || p.activation > 2) return "activation_kind must be 0, 1 or 2";
  if (!MoeRowsFitInt32(W4a8MoeRows(p), std::max<int64_t>(p.hidden, 2 * p.intermediate))) {
    return "problem too large for 32-bit row indexing: rows (T * K = " +
           std::to_string(W4a8MoeRows(p)) + ") x max(hidden, 2 * intermediate) must be below 2^31";
  }
  return "";
}

std::string RunW4a8Moe(const W4a8MoeProblem& p, cudaStream_t stream) {
  std::string err = ValidateW4a8MoeProblem(p);
  if (!err.empty()) return err;
  if (W4a8MoeRows(p) == 0) return "";
  switch (p.dtype) {
    case W4a8Dtype::kF32: return RunTyped<float>(p, stream);
    case W4a8Dtype::kBF16: return RunTyped<__nv_bfloat16>(p, stream);
    default: return RunTyped<__half>(p, stream);
  }
}

std::string RunW4a8QuantizeRows(W4a8Dtype dtype, const void* x, int64_t rows, int64_t cols,
                                int8_t* q, float* params, cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || rows >= (int64_t{1} << 31) || cols > (int64_t{1} << 30) ||
      !MoeRowsFitInt32(rows, cols)) {
    return "rows x cols out of range (rows * cols must be below 2^31)";
  }
  if (rows == 0) return "";
  const int r = static_cast<int>(rows), c = static_cast<int>(cols);
  auto* pr = reinterpret_cast<float2*>(params);
  switch (dtype) {
    case W4a8Dtype::kF32:
      LaunchQuantizeRows<float>(static_cast<const float*>(x), 1, nullptr, nullptr, 0, c, r, q, pr,
                                stream);
      break;
    case W4a8Dtype::kBF16:
      LaunchQuantizeRows<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(x), 1, nullptr,
                                        nullptr, 0, c, r, q, pr, stream);
      break;
    default:
      LaunchQuantizeRows<__half>(static_cast<const __half*>(x), 1, nullptr, nullptr, 0, c, r, q,
                                 pr, stream);
  }
  return CudaError("quantization kernel");
}

}  // namespace jax_moeq::cuda
