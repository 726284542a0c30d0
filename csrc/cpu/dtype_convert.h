// Scalar float32 <-> bfloat16 / float16 conversions (round to nearest even,
// as XLA converts) and the per-row int8 quantization parameters of SPEC §3.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/types.h"

namespace jax_moeq::cpu {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int shifts = -1;
      do {
        ++shifts;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - shifts) << 23 | (mant & 0x3FFu) << 13;
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
  if (abs > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (abs >= 0x477FF000u) return sign | 0x7C00u;  // rounds to infinity
  if (abs < 0x38800000u) {                         // float16 subnormal or zero
    if (abs <= 0x33000000u) return sign;           // at most half the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exp;
    uint32_t value = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (value & 1u))) ++value;
    return sign | static_cast<uint16_t>(value);
  }
  uint32_t value = abs - 0x38000000u;  // exponent bias 127 -> 15
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

// SPEC §3 (KleidiAI qai8dxp / XNNPACK): from the row's range (0 included),
// the scale, its inverse and the integer zero point, in float32 in the
// written order (built with -ffp-contract=off). False when the range is
// empty, or so small (below ~7.5e-37, a subnormal or flushed scale) that
// 1 / scale overflows: the row quantizes to zeros with scale 0 (x * inf
// would reach the float -> int32 conversion, undefined behaviour).
inline bool QuantizationParams(float rmin, float rmax, float* scale, float* inv, int32_t* zp) {
  const float s = rmax == rmin ? 0.0f : (rmax - rmin) / 255.0f;
  const float i = s == 0.0f ? 0.0f : 1.0f / s;
  if (s == 0.0f || !(i <= 3.40282347e38f)) {
    *scale = 0.0f;
    *inv = 0.0f;
    *zp = 0;
    return false;
  }
  const float min_term = -128.0f + rmin * i;
  const float max_term = 127.0f + rmax * i;
  float z = (min_term + max_term > 0.0f) ? (-128.0f - rmin * i) : (127.0f - rmax * i);
  z = std::min(127.0f, std::max(-128.0f, z));
  *scale = s;
  *inv = i;
  *zp = static_cast<int32_t>(std::nearbyint(z));
  return true;
}

}  // namespace jax_moeq::cpu
