// AVX2 W4A8 GEMM. A 64-byte block is two ymm halves (rows 0-7, rows 8-15).
// vpmaddubsw multiplies unsigned nibbles by broadcast signed activation bytes
// into int16 pairs, each within 2 * 15 * 128 = 3840. Up to eight such pairs
// (four blocks: low and high nibbles) are summed in int16 (8 * 3840 = 30720 <
// 2^15, exact) before one vpmaddwd with ones widens them to int32: the widening
// multiply, which shares the multiply ports with vpmaddubsw, runs once per four
// blocks instead of twice per block.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu/w4a8_gemm.h"

namespace jax_moeq::cpu {
namespace {

constexpr int kRowBlock = 2;
constexpr int64_t kInt16Blocks = 4;  // blocks summed in int16 before widening (see above)

inline __m256i Broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}


// kPrefetch: the CPU's plan (w4a8_gemm.h; a template argument: no test in the loop).
template <int M, const StreamPrefetch& kPrefetch>
void TileRows(const W4A8GemmArgs& a, const uint8_t* tile, int64_t nt, int64_t i0) {
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups();
  const int64_t blocks_per_group = s.group / kBlockInputs;
  const int8_t* x[M];
  const int32_t* sum8[M];
  for (int i = 0; i < M; ++i) {
    const int64_t row = a.rows[i0 + i];
    x[i] = a.act.values + row * s.k;
    sum8[i] = a.act.sum8 + row * groups;
  }
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const uint8_t* p = tile;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256i dot[M][2];
    for (int i = 0; i < M; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
    const int64_t k_group = gi * s.group;
    for (int64_t kb = 0; kb < blocks_per_group; kb += kInt16Blocks) {
      const int64_t chain = std::min(kInt16Blocks, blocks_per_group - kb);
      __m256i sum16[M][2];
      for (int i = 0; i < M; ++i) sum16[i][0] = sum16[i][1] = _mm256_setzero_si256();
      for (int64_t b = 0; b < chain; ++b, p += kBlockBytes) {
        PrefetchWeightBlock<kPrefetch>(p);
        const int64_t k0 = k_group + (kb + b) * kBlockInputs;
        for (int h = 0; h < 2; ++h) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
          const __m256i lo = _mm256_and_si256(packed, low_mask);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
          for (int i = 0; i < M; ++i) {
            const __m256i lo_pairs = _mm256_maddubs_epi16(lo, Broadcast4(x[i] + k0));
            const __m256i hi_pairs = _mm256_maddubs_epi16(hi, Broadcast4(x[i] + k0 + 4));
            sum16[i][h] = _mm256_add_epi16(sum16[i][h], _mm256_add_epi16(lo_pairs, hi_pairs));
          }
        }
      }
      for (int i = 0; i < M; ++i) {
        for (int h = 0; h < 2; ++h) {
          dot[i][h] = _mm256_add_epi32(dot[i][h], _mm256_madd_epi16(sum16[i][h], ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * h);
      for (int i = 0; i < M; ++i) {
        const __m256i centered = _mm256_sub_epi32(dot[i][h], _mm256_set1_epi32(sum8[i][gi]));
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centered), scale, acc[i][h]);
      }
    }
    p += kTileRows * 4;
  }
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  for (int h = 0; h < 2; ++h) {
    const int64_t n0 = nt * kTileRows + 8 * h;
    const __m256 corr = _mm256_loadu_ps(row_corr + n0);
    const __m256 b = _mm256_loadu_ps(bias + n0);
    for (int i = 0; i < M; ++i) {
      const int64_t row = a.rows[i0 + i];
      const __m256 zp = _mm256_set1_ps(static_cast<float>(a.act.zero_point[row]));
      const __m256 xs = _mm256_set1_ps(a.act.scale[row]);
      const __m256 y = _mm256_fmadd_ps(_mm256_fnmadd_ps(zp, corr, acc[i][h]), xs, b);
      _mm256_storeu_ps(a.out + (i0 + i) * s.n + n0, y);
    }
  }
}

template <const StreamPrefetch& kPrefetch>
void Gemm(const W4A8GemmArgs& a) {
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    const uint8_t* tile = a.weights + nt * a.shape.tile_bytes();
    int64_t i = 0;
    for (; i + kRowBlock <= a.m; i += kRowBlock) TileRows<kRowBlock, kPrefetch>(a, tile, nt, i);
    if (i < a.m) TileRows<1, kPrefetch>(a, tile, nt, i);
  }
}

}  // namespace

void W4A8GemmAvx2(const W4A8GemmArgs& a) {
  if (DetectedCpuVendor() == CpuVendor::kAmd) {
    if (DetectedCpuFamily() >= 0x19) return Gemm<kAmdStreamPrefetch>(a);
    return Gemm<kIntelStreamPrefetch>(a);
  }
  Gemm<kAvx2StreamPrefetch>(a);
}

}  // namespace jax_moeq::cpu
