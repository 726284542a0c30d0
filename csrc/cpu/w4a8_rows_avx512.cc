// AVX-512 row stages: w4a8_rows_simd.h over sixteen floats.
#include <immintrin.h>

#include "cpu/w4a8_rows_simd.h"

namespace jax_moeq::cpu {
namespace {

struct Avx512Vec {
  using Float = __m512;
  using Int = __m512i;
  using Flags = __mmask16;
  static constexpr int kLanes = 16;

  static Float Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, Float v) { _mm512_storeu_ps(p, v); }
  static Float Set(float v) { return _mm512_set1_ps(v); }
  static Float Add(Float a, Float b) { return _mm512_add_ps(a, b); }
  static Float Sub(Float a, Float b) { return _mm512_sub_ps(a, b); }
  static Float Mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float Div(Float a, Float b) { return _mm512_div_ps(a, b); }
  static Float Min(Float a, Float b) { return _mm512_min_ps(a, b); }
  static Float Max(Float a, Float b) { return _mm512_max_ps(a, b); }
  static Float Fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
  static Float Fnmadd(Float a, Float b, Float c) { return _mm512_fnmadd_ps(a, b, c); }
  static Float RoundNearest(Float v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static Float Scale2(Float p, Float n) { return _mm512_scalef_ps(p, n); }
  static Float RoundBf16(Float v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), high);
    // NaN stays NaN (quieted), as in the scalar conversion.
    const __m512i quiet =
        _mm512_and_si512(_mm512_or_si512(bits, _mm512_set1_epi32(0x400000)), high);
    return _mm512_castsi512_ps(
        _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, quiet));
  }
  static Float RoundF16(Float v) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Float LoadBf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Float LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void StoreBf16(uint16_t* p, Float v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
  }
  static void StoreF16(uint16_t* p, Float v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Flags NoFlags() { return 0; }
  static Flags OrNonFinite(Flags f, Float v) {
    return f | _mm512_fpclass_ps_mask(v, 0x99);  // QNaN | +Inf | -Inf | SNaN
  }
  static bool AnyFlag(Flags f) { return f != 0; }
  static float ReduceMin(Float v) { return _mm512_reduce_min_ps(v); }
  static float ReduceMax(Float v) { return _mm512_reduce_max_ps(v); }
  static Int ToInt(Float v) { return _mm512_cvtps_epi32(v); }
  static Int SetI(int32_t v) { return _mm512_set1_epi32(v); }
  static Int AddI(Int a, Int b) { return _mm512_add_epi32(a, b); }
  static Int MinI(Int a, Int b) { return _mm512_min_epi32(a, b); }
  static Int MaxI(Int a, Int b) { return _mm512_max_epi32(a, b); }
  static int32_t ReduceAddI(Int v) { return _mm512_reduce_add_epi32(v); }
  static void StoreInt8(int8_t* p, Int v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
};

}  // namespace

const RowOps& Avx512RowOps() { return SimdRowOps<Avx512Vec>(); }

}  // namespace jax_moeq::cpu
