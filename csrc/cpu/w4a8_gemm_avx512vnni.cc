// AVX-512 VNNI W4A8 GEMM. One zmm holds 16 output rows; vpdpbusd multiplies
// the unsigned nibbles (q + 8) of 16 rows x 4 inputs with 4 broadcast signed
// activation bytes and accumulates into int32 lanes. Up to kRowBlock token
// rows share each weight load, so prefill is compute-bound, decode streams.
#include <immintrin.h>

#include <cstring>

#include "cpu/w4a8_gemm.h"

namespace jax_moeq::cpu {
namespace {

constexpr int kRowBlock = 8;

inline __m512i Broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// kPrefetch: the CPU's StreamPrefetch (a template argument: no test in the loop).
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
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* p = tile;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512i dot[M];
    for (int i = 0; i < M; ++i) dot[i] = _mm512_setzero_si512();
    const int64_t k_group = gi * s.group;
    for (int64_t kb = 0; kb < blocks_per_group; ++kb, p += kBlockBytes) {
      PrefetchWeightBlock<kPrefetch>(p);
      const __m512i packed = _mm512_loadu_si512(p);
      const __m512i lo = _mm512_and_si512(packed, low_mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask);
      const int64_t k0 = k_group + kb * kBlockInputs;
      for (int i = 0; i < M; ++i) {
        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, Broadcast4(x[i] + k0));
        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, Broadcast4(x[i] + k0 + 4));
      }
    }
    const __m512 scale = _mm512_loadu_ps(p);
    p += kTileRows * 4;
    for (int i = 0; i < M; ++i) {
      const __m512i centered = _mm512_sub_epi32(dot[i], _mm512_set1_epi32(sum8[i][gi]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centered), scale, acc[i]);
    }
  }
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  const __m512 corr = _mm512_loadu_ps(row_corr + nt * kTileRows);
  const __m512 b = _mm512_loadu_ps(bias + nt * kTileRows);
  for (int i = 0; i < M; ++i) {
    const int64_t row = a.rows[i0 + i];
    const __m512 zp = _mm512_set1_ps(static_cast<float>(a.act.zero_point[row]));
    const __m512 xs = _mm512_set1_ps(a.act.scale[row]);
    const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(zp, corr, acc[i]), xs, b);
    _mm512_storeu_ps(a.out + (i0 + i) * s.n + nt * kTileRows, y);
  }
}

template <const StreamPrefetch& kPrefetch>
void Gemm(const W4A8GemmArgs& a) {
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    const uint8_t* tile = a.weights + nt * a.shape.tile_bytes();
    int64_t i = 0;
    for (; i + kRowBlock <= a.m; i += kRowBlock) TileRows<kRowBlock, kPrefetch>(a, tile, nt, i);
    switch (a.m - i) {
      case 7: TileRows<7, kPrefetch>(a, tile, nt, i); break;
      case 6: TileRows<6, kPrefetch>(a, tile, nt, i); break;
      case 5: TileRows<5, kPrefetch>(a, tile, nt, i); break;
      case 4: TileRows<4, kPrefetch>(a, tile, nt, i); break;
      case 3: TileRows<3, kPrefetch>(a, tile, nt, i); break;
      case 2: TileRows<2, kPrefetch>(a, tile, nt, i); break;
      case 1: TileRows<1, kPrefetch>(a, tile, nt, i); break;
      default: break;
    }
  }
}

}  // namespace

void W4A8GemmAvx512Vnni(const W4A8GemmArgs& a) {
  if (DetectedCpuVendor() == CpuVendor::kAmd) return Gemm<kAmdStreamPrefetch>(a);
  Gemm<kIntelStreamPrefetch>(a);
}

}  // namespace jax_moeq::cpu
