// AVX-512 row stages (see w4a8_rows.h). Same float32 operations as the
// portable ones, except exp, which is a polynomial here (within ~2 ulp).
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "cpu/dtype_convert.h"
#include "cpu/w4a8_rows.h"

namespace jax_moeq::cpu {
namespace {

inline __m512 RoundBf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  // NaN stays NaN (quieted), as in the scalar conversion.
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_and_si512(_mm512_or_si512(bits, _mm512_set1_epi32(0x400000)),
                                         _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, quiet));
}

inline __m512 RoundF16(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline __m512 RoundTo16(ElementType t, __m512 v) {
  switch (t) {
    case ElementType::kBF16: return RoundBf16(v);
    case ElementType::kF16: return RoundF16(v);
    default: return v;
  }
}

// exp(x): x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor for e^r, 2^n by scalef.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(100.0f)), _mm512_set1_ps(-100.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 Sigmoid(__m512 v) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, Exp(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

void Load(ElementType t, const void* base, int64_t row, int64_t n, float* dst) {
  if (t == ElementType::kF32) {
    const float* src = static_cast<const float*>(base) + row * n;
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(src + i));
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(base) + row * n;
  for (int64_t i = 0; i < n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m512 v;
    if (t == ElementType::kBF16) {
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      v = _mm512_cvtph_ps(h);
    }
    _mm512_storeu_ps(dst + i, v);
  }
}

void Store(ElementType t, const float* src, int64_t n, void* base, int64_t row) {
  if (t == ElementType::kF32) {
    float* dst = static_cast<float*>(base) + row * n;
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(src + i));
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(base) + row * n;
  for (int64_t i = 0; i < n; i += 16) {
    __m256i h;
    const __m512 v = _mm512_loadu_ps(src + i);
    if (t == ElementType::kBF16) {
      // Values are already bf16-representable: keep the high halves.
      h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(RoundBf16(v)), 16));
    } else {
      h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
}

void ScaleRound(ElementType t, float scale, float* v, int64_t n) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    _mm512_storeu_ps(v + i, RoundTo16(t, _mm512_mul_ps(_mm512_loadu_ps(v + i), s)));
  }
}

void Activate(ElementType t, ActivationKind kind, float* gate, float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = RoundTo16(t, _mm512_loadu_ps(gate + i));
    const __m512 u = RoundTo16(t, _mm512_loadu_ps(up + i));
    __m512 a;
    if (kind == ActivationKind::kSwigluOai) {
      // min_ps / max_ps return the second operand when either is NaN: the value goes second,
      // so a NaN passes through as in the portable std::min(g, 7) / std::max(std::min(u, 7), -7).
      const __m512 gc = _mm512_min_ps(_mm512_set1_ps(7.0f), g);
      const __m512 uc = _mm512_max_ps(_mm512_set1_ps(-7.0f), _mm512_min_ps(_mm512_set1_ps(7.0f), u));
      const __m512 glu = _mm512_mul_ps(gc, Sigmoid(_mm512_mul_ps(_mm512_set1_ps(1.702f), gc)));
      a = _mm512_mul_ps(_mm512_add_ps(uc, _mm512_set1_ps(1.0f)), glu);
    } else {
      a = _mm512_mul_ps(_mm512_mul_ps(g, Sigmoid(g)), u);
    }
    _mm512_storeu_ps(out + i, RoundTo16(t, a));
  }
}

void Quantize(const float* x, int64_t k, int64_t group, int8_t* q, float* scale,
              int32_t* zero_point, int32_t* sum8) {
  __m512 vmin = _mm512_setzero_ps(), vmax = _mm512_setzero_ps();
  __mmask16 nonfinite = 0;
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    vmin = _mm512_min_ps(vmin, v);
    vmax = _mm512_max_ps(vmax, v);
    nonfinite |= _mm512_fpclass_ps_mask(v, 0x99);  // QNaN | +Inf | -Inf | SNaN
  }
  const float rmin = _mm512_reduce_min_ps(vmin), rmax = _mm512_reduce_max_ps(vmax);
  const int64_t groups = k / group;
  float inv;
  int32_t zp;
  if (nonfinite || !QuantizationParams(rmin, rmax, scale, &inv, &zp)) {
    // A row holding NaN or +-Inf gets scale NaN, so that every output of the row is NaN.
    if (nonfinite) *scale = std::numeric_limits<float>::quiet_NaN();
    for (int64_t i = 0; i < k; ++i) q[i] = 0;
    for (int64_t gi = 0; gi < groups; ++gi) sum8[gi] = 0;
    *zero_point = 0;
    return;
  }
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i vzp = _mm512_set1_epi32(zp);
  const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = gi * group; i < (gi + 1) * group; i += 16) {
      // cvtps_epi32 rounds to nearest even (MXCSR default), like nearbyint.
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv));
      v = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(v, vzp), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
      sum = _mm512_add_epi32(sum, v);
    }
    sum8[gi] = 8 * _mm512_reduce_add_epi32(sum);
  }
  *zero_point = zp;
}

void Accumulate(ElementType t, const float* y, float w, bool weighted, float* acc, int64_t n) {
  const __m512 vw = _mm512_set1_ps(w);
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = RoundTo16(t, _mm512_loadu_ps(y + i));
    if (weighted) v = RoundTo16(t, _mm512_mul_ps(v, vw));
    _mm512_storeu_ps(acc + i, RoundTo16(t, _mm512_add_ps(_mm512_loadu_ps(acc + i), v)));
  }
}

}  // namespace

const RowOps& Avx512RowOps() {
  static const RowOps ops{Load, Store, ScaleRound, Activate, Quantize, Accumulate};
  return ops;
}

}  // namespace jax_moeq::cpu
