// AVX2 row stages (see w4a8_rows.h), eight floats at a time. The float32 operations are those
// of the AVX-512 version, exp's polynomial included, so both give the same bits; they are the
// portable ones except exp (within ~2 ulp of std::exp).
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "cpu/dtype_convert.h"
#include "cpu/w4a8_rows.h"

namespace jax_moeq::cpu {
namespace {

inline __m256 RoundBf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  r = _mm256_and_si256(r, high);
  // NaN stays NaN (quieted), as in the scalar conversion.
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256i quiet =
      _mm256_and_si256(_mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), high);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan);
}

inline __m256 RoundF16(__m256 v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline __m256 RoundTo16(ElementType t, __m256 v) {
  switch (t) {
    case ElementType::kBF16: return RoundBf16(v);
    case ElementType::kF16: return RoundF16(v);
    default: return v;
  }
}

// 2^n for integer-valued n in [-126, 127], built in the exponent field.
inline __m256 Pow2(__m256 n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

// exp(x) as the AVX-512 version computes it: x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor for
// e^r, then p * 2^n. With x clamped to +-100, |n| <= 145, so 2^n is applied as two exact
// halves: p * 2^h is a normal float (p in [0.7, 1.42], |h| <= 73) and the second product
// rounds once, as scalef does.
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(100.0f)), _mm256_set1_ps(-100.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256 half = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)),
                                      _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  return _mm256_mul_ps(_mm256_mul_ps(p, Pow2(half)), Pow2(_mm256_sub_ps(n, half)));
}

inline __m256 Sigmoid(__m256 v) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}

inline float ReduceMin(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float ReduceMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t ReduceAdd(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

void Load(ElementType t, const void* base, int64_t row, int64_t n, float* dst) {
  if (t == ElementType::kF32) {
    const float* src = static_cast<const float*>(base) + row * n;
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(base) + row * n;
  for (int64_t i = 0; i < n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m256 v;
    if (t == ElementType::kBF16) {
      v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      v = _mm256_cvtph_ps(h);
    }
    _mm256_storeu_ps(dst + i, v);
  }
}

void Store(ElementType t, const float* src, int64_t n, void* base, int64_t row) {
  if (t == ElementType::kF32) {
    float* dst = static_cast<float*>(base) + row * n;
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(base) + row * n;
  for (int64_t i = 0; i < n; i += 8) {
    __m128i h;
    const __m256 v = _mm256_loadu_ps(src + i);
    if (t == ElementType::kBF16) {
      // Values are already bf16-representable: keep the high halves (each at most 0xFFFF,
      // so the unsigned pack keeps them whole).
      const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(RoundBf16(v)), 16);
      h = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    } else {
      h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
}

void ScaleRound(ElementType t, float scale, float* v, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(v + i, RoundTo16(t, _mm256_mul_ps(_mm256_loadu_ps(v + i), s)));
  }
}

void Activate(ElementType t, ActivationKind kind, float* gate, float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = RoundTo16(t, _mm256_loadu_ps(gate + i));
    const __m256 u = RoundTo16(t, _mm256_loadu_ps(up + i));
    __m256 a;
    if (kind == ActivationKind::kSwigluOai) {
      // min_ps / max_ps return the second operand when either is NaN: the value goes second,
      // so a NaN passes through as in the portable std::min(g, 7) / std::max(std::min(u, 7), -7).
      const __m256 gc = _mm256_min_ps(_mm256_set1_ps(7.0f), g);
      const __m256 uc =
          _mm256_max_ps(_mm256_set1_ps(-7.0f), _mm256_min_ps(_mm256_set1_ps(7.0f), u));
      const __m256 glu = _mm256_mul_ps(gc, Sigmoid(_mm256_mul_ps(_mm256_set1_ps(1.702f), gc)));
      a = _mm256_mul_ps(_mm256_add_ps(uc, _mm256_set1_ps(1.0f)), glu);
    } else {
      a = _mm256_mul_ps(_mm256_mul_ps(g, Sigmoid(g)), u);
    }
    _mm256_storeu_ps(out + i, RoundTo16(t, a));
  }
}

void Quantize(const float* x, int64_t k, int64_t group, int8_t* q, float* scale,
              int32_t* zero_point, int32_t* sum8) {
  __m256 vmin = _mm256_setzero_ps(), vmax = _mm256_setzero_ps();
  // A lane's exponent field all ones: NaN or +-Inf.
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  __m256i nonfinite = _mm256_setzero_si256();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vmin = _mm256_min_ps(vmin, v);
    vmax = _mm256_max_ps(vmax, v);
    nonfinite = _mm256_or_si256(
        nonfinite, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent),
                                      exponent));
  }
  const bool finite = _mm256_testz_si256(nonfinite, nonfinite);
  const float rmin = ReduceMin(vmin), rmax = ReduceMax(vmax);
  const int64_t groups = k / group;
  float inv;
  int32_t zp;
  if (!finite || !QuantizationParams(rmin, rmax, scale, &inv, &zp)) {
    // A row holding NaN or +-Inf gets scale NaN, so that every output of the row is NaN.
    if (!finite) *scale = std::numeric_limits<float>::quiet_NaN();
    for (int64_t i = 0; i < k; ++i) q[i] = 0;
    for (int64_t gi = 0; gi < groups; ++gi) sum8[gi] = 0;
    *zero_point = 0;
    return;
  }
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i vzp = _mm256_set1_epi32(zp);
  const __m256i lo = _mm256_set1_epi32(-128), hi = _mm256_set1_epi32(127);
  const auto quantize8 = [&](const float* src) {
    // cvtps_epi32 rounds to nearest even (MXCSR default), like nearbyint.
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src), vinv));
    return _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(v, vzp), lo), hi);
  };
  // Groups and rows are multiples of 16 (w4a8_rows.h): sixteen values per step.
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = gi * group; i < (gi + 1) * group; i += 16) {
      const __m256i a = quantize8(x + i), b = quantize8(x + i + 8);
      // Values lie in [-128, 127], so the saturating packs are exact; the permute undoes the
      // packs' lane interleave.
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b),
                                                     _MM_SHUFFLE(3, 1, 2, 0));
      const __m128i bytes =
          _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), bytes);
      sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
    }
    sum8[gi] = 8 * ReduceAdd(sum);
  }
  *zero_point = zp;
}

void Accumulate(ElementType t, const float* y, float w, bool weighted, float* acc, int64_t n) {
  const __m256 vw = _mm256_set1_ps(w);
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = RoundTo16(t, _mm256_loadu_ps(y + i));
    if (weighted) v = RoundTo16(t, _mm256_mul_ps(v, vw));
    _mm256_storeu_ps(acc + i, RoundTo16(t, _mm256_add_ps(_mm256_loadu_ps(acc + i), v)));
  }
}

}  // namespace

const RowOps& Avx2RowOps() {
  static const RowOps ops{Load, Store, ScaleRound, Activate, Quantize, Accumulate};
  return ops;
}

}  // namespace jax_moeq::cpu
