#include "cpu/w4a8_moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/w4a8_gemm.h"
#include "cpu/w4a8_layout.h"

namespace jax_moeq::cpu {
namespace {

// ------------------------------------------------------------ element types
// Round-to-nearest-even conversions, bit-compatible with XLA's converts.

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3FFu) << 13;
    }
  } else {
    bits = sign | (exp + 112) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00u;          // NaN
  if (abs >= 0x477FF000u) return sign | 0x7C00u;         // rounds to inf
  if (abs < 0x38800000u) {                                // subnormal or zero in f16
    if (abs < 0x33000000u) return sign;                   // below half the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exp;                     // 14 - (exp - 127) + 13 - 1 + 1
    uint32_t value = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (value & 1u))) ++value;
    return sign | static_cast<uint16_t>(value);
  }
  uint32_t value = abs - 0x38000000u;                     // rebias exponent 127 -> 15
  value += 0xFFFu + ((value >> 13) & 1u);
  return sign | static_cast<uint16_t>(value >> 13);
}

inline float RoundTo(ElementType t, float v) {
  switch (t) {
    case ElementType::kBF16: return Bf16ToFloat(FloatToBf16(v));
    case ElementType::kF16: return F16ToFloat(FloatToF16(v));
    default: return v;
  }
}

void LoadRow(ElementType t, const void* base, int64_t row, int64_t n, float* dst) {
  if (t == ElementType::kF32) {
    std::memcpy(dst, static_cast<const float*>(base) + row * n, n * 4);
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(base) + row * n;
  if (t == ElementType::kBF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = F16ToFloat(src[i]);
  }
}

void StoreRow(ElementType t, const float* src, int64_t n, void* base, int64_t row) {
  if (t == ElementType::kF32) {
    std::memcpy(static_cast<float*>(base) + row * n, src, n * 4);
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(base) + row * n;
  if (t == ElementType::kBF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = FloatToF16(src[i]);
  }
}

// --------------------------------------------------- activation quantization
// SPEC §3 (KleidiAI qai8dxp): asymmetric int8 per row, float32 arithmetic in
// the written order (this file is built with -ffp-contract=off).
void QuantizeRow(const float* x, int64_t k, int64_t group, int8_t* q, float* scale,
                 int32_t* zero_point, int32_t* sum8) {
  float rmin = 0.0f, rmax = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    rmin = std::min(rmin, x[i]);
    rmax = std::max(rmax, x[i]);
  }
  const int64_t groups = k / group;
  if (rmax == rmin) {
    std::memset(q, 0, k);
    *scale = 0.0f;
    *zero_point = 0;
    std::fill(sum8, sum8 + groups, 0);
    return;
  }
  const float s = (rmax - rmin) / 255.0f;
  const float inv = 1.0f / s;
  const float min_term = -128.0f + rmin * inv;
  const float max_term = 127.0f + rmax * inv;
  float zp = (min_term + max_term > 0.0f) ? (-128.0f - rmin * inv) : (127.0f - rmax * inv);
  zp = std::min(127.0f, std::max(-128.0f, zp));
  const int32_t zpi = static_cast<int32_t>(std::nearbyint(zp));
  for (int64_t gi = 0; gi < groups; ++gi) {
    int32_t sum = 0;
    for (int64_t i = gi * group; i < (gi + 1) * group; ++i) {
      int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inv)) + zpi;
      v = std::min(127, std::max(-128, v));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    sum8[gi] = 8 * sum;
  }
  *scale = s;
  *zero_point = zpi;
}

// ------------------------------------------------------------- activations
inline float Sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

void GatedActivation(ActivationKind kind, const float* gate, const float* up, int64_t n,
                     float* out) {
  if (kind == ActivationKind::kSwigluOai) {
    for (int64_t i = 0; i < n; ++i) {
      const float g = std::min(gate[i], 7.0f);
      const float u = std::min(7.0f, std::max(-7.0f, up[i]));
      out[i] = (u + 1.0f) * (g * Sigmoid(1.702f * g));
    }
  } else {  // SwiGLU; vLLM maps SILU to silu-and-mul as well
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * Sigmoid(gate[i]) * up[i];
  }
}

// --------------------------------------------------------------- scratch
template <typename T>
T* Grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

struct Scratch {
  std::vector<int32_t> counts, offsets, sorted_slot, slot_pos, rows1, rows2;
  std::vector<int8_t> q1, q2;
  std::vector<float> s1, s2, y13, y2;
  std::vector<int32_t> zp1, zp2, sum1, sum2;
};

struct GemmItem {
  int64_t expert;
  int64_t tile_begin;
  int64_t tile_end;
};

// Work items of (expert, range of 16-row tiles); ranges shrink when few
// experts are hit so that every thread gets work in decode.
std::vector<GemmItem> MakeGemmItems(const std::vector<int32_t>& counts, int64_t n) {
  const int64_t tiles = n / kTileRows;
  int64_t active = 0;
  for (int32_t c : counts) active += c > 0;
  std::vector<GemmItem> items;
  if (active == 0) return items;
  // About 64 items in all, at least 2 tiles each.
  const int64_t per_expert = std::max<int64_t>(1, 64 / active);
  const int64_t chunk = std::max<int64_t>(2, (tiles + per_expert - 1) / per_expert);
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] == 0) continue;
    for (int64_t t0 = 0; t0 < tiles; t0 += chunk) {
      items.push_back({e, t0, std::min(tiles, t0 + chunk)});
    }
  }
  return items;
}

void RunGemm(Isa isa, const std::vector<GemmItem>& items, const uint8_t* weights,
             int64_t expert_bytes, const PackedGemmShape& shape,
             const QuantizedActivations& act, const int32_t* rows,
             const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets, float* out,
             const ParallelFor& parallel_for) {
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const GemmItem& item = items[it];
      const int64_t off = offsets[item.expert];
      W4A8GemmArgs args;
      args.weights = weights + item.expert * expert_bytes;
      args.shape = shape;
      args.act = act;
      args.rows = rows + off;
      args.m = counts[item.expert];
      args.out = out + off * shape.n;
      args.tile_begin = item.tile_begin;
      args.tile_end = item.tile_end;
      W4A8Gemm(isa, args);
    }
  });
}

}  // namespace

int64_t W4A8PackedBytes(int64_t n, int64_t k, int64_t group_size) {
  PackedGemmShape s{n, k, group_size == -1 ? k : group_size};
  return s.total_bytes();
}

std::string ValidateW4A8MoeShapes(const W4A8MoeProblem& p, int64_t w13_bytes, int64_t w2_bytes) {
  const int64_t h = p.hidden, i = p.intermediate, g = p.group_size;
  if (h <= 0 || i <= 0) return "hidden and intermediate sizes must be positive";
  if (h % 16 != 0) return "hidden size " + std::to_string(h) + " is not a multiple of 16";
  if (i % 16 != 0) return "intermediate size " + std::to_string(i) + " is not a multiple of 16";
  if (g != 32 && g != 64 && g != 128 && g != -1) {
    return "group_size " + std::to_string(g) + " is not one of 32, 64, 128, -1";
  }
  if (g != -1 && (h % g != 0 || i % g != 0)) {
    return "group_size " + std::to_string(g) + " does not divide hidden size " +
           std::to_string(h) + " and intermediate size " + std::to_string(i);
  }
  const int64_t kind = static_cast<int64_t>(p.activation);
  if (kind < 0 || kind > 2) return "activation_kind " + std::to_string(kind) + " is not 0, 1 or 2";
  if (w13_bytes != W4A8PackedBytes(2 * i, h, g)) {
    return "w13_packed has " + std::to_string(w13_bytes) + " bytes per expert, expected " +
           std::to_string(W4A8PackedBytes(2 * i, h, g)) + " for hidden " + std::to_string(h) +
           ", intermediate " + std::to_string(i) + ", group_size " + std::to_string(g);
  }
  if (w2_bytes != W4A8PackedBytes(h, i, g)) {
    return "w2_packed has " + std::to_string(w2_bytes) + " bytes per expert, expected " +
           std::to_string(W4A8PackedBytes(h, i, g));
  }
  return "";
}

std::string RunW4A8Moe(const W4A8MoeProblem& p, Isa isa, const ParallelFor& parallel_for) {
  const int64_t T = p.tokens, K = p.top_k, E = p.experts, H = p.hidden, I = p.intermediate;
  const int64_t slots = T * K;
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = p.topk_ids[s];
    if (e < 0 || e >= E) {
      return "expert id out of range: topk_ids[" + std::to_string(s / K) + ", " +
             std::to_string(s % K) + "] = " + std::to_string(e) + ", expected [0, " +
             std::to_string(E) + ")";
    }
  }
  if (T == 0) return "";

  static thread_local Scratch sc;
  const PackedGemmShape shape13{2 * I, H, p.group_size == -1 ? H : p.group_size};
  const PackedGemmShape shape2{H, I, p.group_size == -1 ? I : p.group_size};
  const int64_t g1 = shape13.groups(), g2 = shape2.groups();

  // Bucket slots by expert (stable counting sort).
  sc.counts.assign(E, 0);
  for (int64_t s = 0; s < slots; ++s) ++sc.counts[p.topk_ids[s]];
  sc.offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) sc.offsets[e + 1] = sc.offsets[e] + sc.counts[e];
  int32_t* sorted_slot = Grow(sc.sorted_slot, slots);
  int32_t* slot_pos = Grow(sc.slot_pos, slots);
  {
    std::vector<int32_t> fill(sc.offsets.begin(), sc.offsets.end() - 1);
    for (int64_t s = 0; s < slots; ++s) {
      const int32_t pos = fill[p.topk_ids[s]]++;
      sorted_slot[pos] = static_cast<int32_t>(s);
      slot_pos[s] = pos;
    }
  }

  // Stage 1: quantize GEMM1 inputs: once per token, or per slot when the
  // router weight scales the input first.
  const bool per_slot = p.apply_router_weight_on_input;
  const int64_t rows1_count = per_slot ? slots : T;
  int8_t* q1 = Grow(sc.q1, rows1_count * H);
  float* s1 = Grow(sc.s1, rows1_count);
  int32_t* zp1 = Grow(sc.zp1, rows1_count);
  int32_t* sum1 = Grow(sc.sum1, rows1_count * g1);
  int32_t* rows1 = Grow(sc.rows1, slots);
  for (int64_t pos = 0; pos < slots; ++pos) {
    rows1[pos] = per_slot ? static_cast<int32_t>(pos) : sorted_slot[pos] / static_cast<int32_t>(K);
  }
  parallel_for(rows1_count, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = per_slot ? sorted_slot[r] : -1;
      LoadRow(p.dtype, p.x, per_slot ? slot / K : r, H, row.data());
      if (per_slot) {
        const float w = p.topk_weights[slot];
        for (int64_t j = 0; j < H; ++j) row[j] = RoundTo(p.dtype, row[j] * w);
      }
      QuantizeRow(row.data(), H, shape13.group, q1 + r * H, s1 + r, zp1 + r, sum1 + r * g1);
    }
  });

  // Stage 2: GEMM1 -> y13 [slots][2I] in float32, slots in expert order.
  float* y13 = Grow(sc.y13, slots * 2 * I);
  const std::vector<GemmItem> items13 = MakeGemmItems(sc.counts, 2 * I);
  RunGemm(isa, items13, p.w13_packed, shape13.total_bytes(), shape13,
          QuantizedActivations{q1, s1, zp1, sum1}, rows1, sc.counts, sc.offsets, y13,
          parallel_for);

  // Stage 3: round, gated activation, round, quantize for GEMM2.
  int8_t* q2 = Grow(sc.q2, slots * I);
  float* s2 = Grow(sc.s2, slots);
  int32_t* zp2 = Grow(sc.zp2, slots);
  int32_t* sum2 = Grow(sc.sum2, slots * g2);
  int32_t* rows2 = Grow(sc.rows2, slots);
  for (int64_t pos = 0; pos < slots; ++pos) rows2[pos] = static_cast<int32_t>(pos);
  parallel_for(slots, [&](int64_t begin, int64_t end) {
    std::vector<float> act(I);
    for (int64_t r = begin; r < end; ++r) {
      float* y = y13 + r * 2 * I;
      for (int64_t j = 0; j < 2 * I; ++j) y[j] = RoundTo(p.dtype, y[j]);
      GatedActivation(p.activation, y, y + I, I, act.data());
      for (int64_t j = 0; j < I; ++j) act[j] = RoundTo(p.dtype, act[j]);
      QuantizeRow(act.data(), I, shape2.group, q2 + r * I, s2 + r, zp2 + r, sum2 + r * g2);
    }
  });

  // Stage 4: GEMM2 -> y2 [slots][H].
  float* y2 = Grow(sc.y2, slots * H);
  const std::vector<GemmItem> items2 = MakeGemmItems(sc.counts, H);
  RunGemm(isa, items2, p.w2_packed, shape2.total_bytes(), shape2,
          QuantizedActivations{q2, s2, zp2, sum2}, rows2, sc.counts, sc.offsets, y2,
          parallel_for);

  // Stage 5: weighted sum over slots, in slot order, in the output dtype.
  parallel_for(T, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t slot = t * K + k;
        const float* y = y2 + static_cast<int64_t>(slot_pos[slot]) * H;
        const float w = p.topk_weights[slot];
        for (int64_t j = 0; j < H; ++j) {
          float v = RoundTo(p.dtype, y[j]);
          if (!per_slot) v = RoundTo(p.dtype, v * w);
          acc[j] = RoundTo(p.dtype, acc[j] + v);
        }
      }
      StoreRow(p.dtype, acc.data(), H, p.out, t);
    }
  });
  return "";
}

}  // namespace jax_moeq::cpu
