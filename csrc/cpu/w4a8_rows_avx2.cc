// AVX2 row stages: w4a8_rows_simd.h over eight floats. AVX2 has no scalef, so 2^n is applied as
// two exact halves; the results are the AVX-512 version's bits (checked by the ISA harness).
#include <immintrin.h>

#include "cpu/w4a8_rows_simd.h"

namespace jax_moeq::cpu {
namespace {

struct Avx2Vec {
  using Float = __m256;
  using Int = __m256i;
  using Flags = __m256i;
  static constexpr int kLanes = 8;

  static Float Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, Float v) { _mm256_storeu_ps(p, v); }
  static Float Set(float v) { return _mm256_set1_ps(v); }
  static Float Add(Float a, Float b) { return _mm256_add_ps(a, b); }
  static Float Sub(Float a, Float b) { return _mm256_sub_ps(a, b); }
  static Float Mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float Div(Float a, Float b) { return _mm256_div_ps(a, b); }
  static Float Min(Float a, Float b) { return _mm256_min_ps(a, b); }
  static Float Max(Float a, Float b) { return _mm256_max_ps(a, b); }
  static Float Fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static Float Fnmadd(Float a, Float b, Float c) { return _mm256_fnmadd_ps(a, b, c); }
  static Float RoundNearest(Float v) {
    return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // 2^m for integer-valued m in [-126, 127], built in the exponent field.
  static Float Pow2(Float m) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(m), _mm256_set1_epi32(127)), 23));
  }
  // p * 2^h is exact (p near 1, |h| <= 75: a normal float); the second product rounds once, as
  // AVX-512's scalef does.
  static Float Scale2(Float p, Float n) {
    const Float h = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)),
                                    _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    return _mm256_mul_ps(_mm256_mul_ps(p, Pow2(h)), Pow2(_mm256_sub_ps(n, h)));
  }
  static Float RoundBf16(Float v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    const __m256i r = _mm256_and_si256(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), high);
    // NaN stays NaN (quieted), as in the scalar conversion.
    const __m256i quiet =
        _mm256_and_si256(_mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), high);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  static Float RoundF16(Float v) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Float LoadBf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Float LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreBf16(uint16_t* p, Float v) {
    // The high halves, each at most 0xFFFF, so the unsigned pack keeps them whole.
    const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(high),
                                      _mm256_extracti128_si256(high, 1)));
  }
  static void StoreF16(uint16_t* p, Float v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // A lane whose exponent field is all ones: NaN or +-Inf.
  static Flags NoFlags() { return _mm256_setzero_si256(); }
  static Flags OrNonFinite(Flags f, Float v) {
    const __m256i exponent = _mm256_set1_epi32(0x7F800000);
    return _mm256_or_si256(
        f, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent));
  }
  static bool AnyFlag(Flags f) { return !_mm256_testz_si256(f, f); }
  static float ReduceMin(Float v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
  }
  static float ReduceMax(Float v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static Int ToInt(Float v) { return _mm256_cvtps_epi32(v); }
  static Int SetI(int32_t v) { return _mm256_set1_epi32(v); }
  static Int AddI(Int a, Int b) { return _mm256_add_epi32(a, b); }
  static Int MinI(Int a, Int b) { return _mm256_min_epi32(a, b); }
  static Int MaxI(Int a, Int b) { return _mm256_max_epi32(a, b); }
  static int32_t ReduceAddI(Int v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
  }
  static void StoreInt8(int8_t* p, Int v) {
    // Values in [-128, 127]: the saturating packs are exact.
    const __m128i words =
        _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
  }
};

}  // namespace

const RowOps& Avx2RowOps() { return SimdRowOps<Avx2Vec>(); }

}  // namespace jax_moeq::cpu
