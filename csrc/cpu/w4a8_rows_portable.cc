// Portable row stages; also the statement of what the SIMD versions compute.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/dtype_convert.h"
#include "cpu/w4a8_rows.h"

namespace jax_moeq::cpu {
namespace {

void Load(ElementType t, const void* base, int64_t row, int64_t n, float* dst) {
  if (t == ElementType::kF32) {
    std::memcpy(dst, static_cast<const float*>(base) + row * n, n * 4);
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(base) + row * n;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = t == ElementType::kBF16 ? Bf16ToFloat(src[i]) : F16ToFloat(src[i]);
  }
}

void Store(ElementType t, const float* src, int64_t n, void* base, int64_t row) {
  if (t == ElementType::kF32) {
    std::memcpy(static_cast<float*>(base) + row * n, src, n * 4);
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(base) + row * n;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = t == ElementType::kBF16 ? FloatToBf16(src[i]) : FloatToF16(src[i]);
  }
}

void ScaleRound(ElementType t, float scale, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = RoundTo(t, v[i] * scale);
}

inline float Sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

void Activate(ElementType t, ActivationKind kind, float* gate, float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = RoundTo(t, gate[i]);
    const float u = RoundTo(t, up[i]);
    float a;
    if (kind == ActivationKind::kSwigluOai) {
      // Clamps written so that a NaN passes through (as jnp.minimum / jnp.clip do).
      const float gc = std::min(g, 7.0f);
      const float uc = std::max(std::min(u, 7.0f), -7.0f);
      a = (uc + 1.0f) * (gc * Sigmoid(1.702f * gc));
    } else {  // SwiGLU; vLLM maps SILU to silu-and-mul as well
      a = g * Sigmoid(g) * u;
    }
    out[i] = RoundTo(t, a);
  }
}

void Quantize(const float* x, int64_t k, int64_t group, int8_t* q, float* scale,
              int32_t* zero_point, int32_t* sum8) {
  float rmin = 0.0f, rmax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    rmin = std::min(rmin, x[i]);
    rmax = std::max(rmax, x[i]);
    finite &= std::isfinite(x[i]);
  }
  const int64_t groups = k / group;
  float inv;
  int32_t zp;
  if (!finite || !QuantizationParams(rmin, rmax, scale, &inv, &zp)) {
    // A row holding NaN or +-Inf gets scale NaN, so that every output of the row is NaN.
    if (!finite) *scale = std::numeric_limits<float>::quiet_NaN();
    std::memset(q, 0, k);
    *zero_point = 0;
    std::fill(sum8, sum8 + groups, 0);
    return;
  }
  for (int64_t gi = 0; gi < groups; ++gi) {
    int32_t sum = 0;
    for (int64_t i = gi * group; i < (gi + 1) * group; ++i) {
      int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inv)) + zp;
      v = std::min(127, std::max(-128, v));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    sum8[gi] = 8 * sum;
  }
  *zero_point = zp;
}

void Accumulate(ElementType t, const float* y, float w, bool weighted, float* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float v = RoundTo(t, y[i]);
    if (weighted) v = RoundTo(t, v * w);
    acc[i] = RoundTo(t, acc[i] + v);
  }
}

}  // namespace

const RowOps& PortableRowOps() {
  static const RowOps ops{Load, Store, ScaleRound, Activate, Quantize, Accumulate};
  return ops;
}

}  // namespace jax_moeq::cpu
