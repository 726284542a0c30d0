// AMX-INT8 W4A8 GEMM (Sapphire Rapids and later). TDPBSUD multiplies a tile of
// signed activation bytes A [16 rows x 64 inputs] with a tile of unsigned weight
// bytes B [16 quads x (16 outputs x 4 inputs)] into int32 C [16 rows x 16 outputs].
//
// The packed layout needs no change: the low nibbles of one 64-byte block are
// exactly one B row (16 outputs x inputs k0..k0+3) and its high nibbles the next
// (k0+4..k0+7), so a group's blocks unpack into B rows in input order and A is the
// activations as stored. Each group's int32 sums are promoted to float32 in
// group order with the same fused multiply-adds as the VNNI path, so both paths
// give identical bits. Few rows per expert leave the tiles mostly empty: those
// GEMMs run on the VNNI code (kAmxMinRows).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/amx_tile_config.h"
#include "cpu/w4a8_gemm.h"

namespace jax_moeq::cpu {
namespace {

constexpr int64_t kTileM = 16;       // activation rows per tile
constexpr int64_t kChunkInputs = 64; // most inputs per TDPBSUD (16 B rows of 4)
constexpr int kRowTiles = 4;         // C tiles tmm0..3: up to 64 rows share one B tile load

// tmm0-3: C (int32 sums) of up to four 16-row blocks; tmm4: A; tmm6: B.
void ConfigureTiles(int64_t chunk_inputs) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < kRowTiles; ++t) {
    cfg.rows[t] = kTileM;
    cfg.colsb[t] = kTileRows * 4;
  }
  cfg.rows[4] = kTileM;
  cfg.colsb[4] = static_cast<uint16_t>(chunk_inputs);
  cfg.rows[6] = static_cast<uint8_t>(chunk_inputs / 4);
  cfg.colsb[6] = kTileRows * 4;
  _tile_loadconfig(&cfg);
}

struct Buffers {
  std::vector<int8_t> a;       // [m_pad][k]: the GEMM's rows, gathered, zero-padded to 16
  std::vector<uint8_t> b;      // one group's B rows: [group / 4][64]
  std::vector<float> acc;      // [m_pad][16]
  std::vector<int32_t> c;      // [kRowTiles][16][16]
};

// One row block's int32 sums for group `gi` into acc: acc += float(sum - sum8) * scale.
inline void PromoteGroup(const int32_t* c, const W4A8GemmArgs& a, int64_t row0, int64_t rows,
                         int64_t gi, __m512 scale, float* acc) {
  const int64_t groups = a.shape.groups();
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = a.rows[row0 + i];
    const __m512i sums = _mm512_loadu_si512(c + i * kTileRows);
    const __m512i centered = _mm512_sub_epi32(sums, _mm512_set1_epi32(a.act.sum8[row * groups + gi]));
    float* dst = acc + (row0 + i) * kTileRows;
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(centered), scale, _mm512_loadu_ps(dst)));
  }
}

// TDPBSUD of the A rows of kTiles 16-row blocks against the B tile in tmm6.
template <int kTiles>
inline void DotChunk(const int8_t* a_chunk, int64_t a_stride) {
  _tile_loadd(4, a_chunk, a_stride);
  _tile_dpbsud(0, 4, 6);
  if constexpr (kTiles > 1) {
    _tile_loadd(4, a_chunk + kTileM * a_stride, a_stride);
    _tile_dpbsud(1, 4, 6);
  }
  if constexpr (kTiles > 2) {
    _tile_loadd(4, a_chunk + 2 * kTileM * a_stride, a_stride);
    _tile_dpbsud(2, 4, 6);
  }
  if constexpr (kTiles > 3) {
    _tile_loadd(4, a_chunk + 3 * kTileM * a_stride, a_stride);
    _tile_dpbsud(3, 4, 6);
  }
}

template <int kTiles>
void GroupBlock(const W4A8GemmArgs& a, const Buffers& buf, int64_t row0, int64_t gi,
                int64_t chunk_inputs, int32_t* c) {
  const int64_t k = a.shape.k;
  _tile_zero(0);
  if constexpr (kTiles > 1) _tile_zero(1);
  if constexpr (kTiles > 2) _tile_zero(2);
  if constexpr (kTiles > 3) _tile_zero(3);
  const int64_t chunks = a.shape.group / chunk_inputs;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    _tile_loadd(6, buf.b.data() + ch * (chunk_inputs / 4) * 64, 64);
    DotChunk<kTiles>(buf.a.data() + row0 * k + gi * a.shape.group + ch * chunk_inputs, k);
  }
  constexpr int64_t kCBytes = kTileM * kTileRows;  // int32 elements of one C tile
  _tile_stored(0, c, 64);
  if constexpr (kTiles > 1) _tile_stored(1, c + kCBytes, 64);
  if constexpr (kTiles > 2) _tile_stored(2, c + 2 * kCBytes, 64);
  if constexpr (kTiles > 3) _tile_stored(3, c + 3 * kCBytes, 64);
}

// The group's blocks as B rows: block kb's low nibbles are row 2 kb, its high nibbles 2 kb + 1.
inline void UnpackGroup(const uint8_t* p, int64_t blocks, uint8_t* b) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const __m512i packed = _mm512_loadu_si512(p + kb * kBlockBytes);
    _mm512_storeu_si512(b + 2 * kb * 64, _mm512_and_si512(packed, low_mask));
    _mm512_storeu_si512(b + (2 * kb + 1) * 64,
                        _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask));
  }
}

}  // namespace

void W4A8GemmAmx(const W4A8GemmArgs& a) {
  if (a.m < kAmxMinRows) return W4A8GemmAvx512Vnni(a);
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups();
  const int64_t blocks_per_group = s.group / kBlockInputs;
  // TDPBSUD takes at most 64 inputs: the largest of 64, 32, 16 dividing the group (a
  // channel-wise group is K, a multiple of 16).
  const int64_t chunk_inputs = s.group % kChunkInputs == 0 ? kChunkInputs
                               : s.group % 32 == 0         ? 32
                                                           : 16;
  const int64_t m_pad = (a.m + kTileM - 1) / kTileM * kTileM;

  static thread_local Buffers buf;
  if (static_cast<int64_t>(buf.a.size()) < m_pad * s.k) buf.a.resize(m_pad * s.k);
  if (static_cast<int64_t>(buf.b.size()) < s.group * kTileRows) buf.b.resize(s.group * kTileRows);
  if (static_cast<int64_t>(buf.acc.size()) < m_pad * kTileRows) buf.acc.resize(m_pad * kTileRows);
  if (static_cast<int64_t>(buf.c.size()) < kRowTiles * kTileM * kTileRows) {
    buf.c.resize(kRowTiles * kTileM * kTileRows);
  }
  for (int64_t i = 0; i < a.m; ++i) {
    std::memcpy(buf.a.data() + i * s.k, a.act.values + a.rows[i] * s.k, s.k);
  }
  std::memset(buf.a.data() + a.m * s.k, 0, (m_pad - a.m) * s.k);

  ConfigureTiles(chunk_inputs);
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    const uint8_t* p = a.weights + nt * s.tile_bytes();
    std::memset(buf.acc.data(), 0, m_pad * kTileRows * sizeof(float));
    for (int64_t gi = 0; gi < groups; ++gi, p += s.chunk_bytes()) {
      for (int64_t ahead = 0; ahead < s.chunk_bytes(); ahead += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p + kIntelStreamPrefetch.l2_bytes + ahead),
                     _MM_HINT_T1);
      }
      UnpackGroup(p, blocks_per_group, buf.b.data());
      const __m512 scale = _mm512_loadu_ps(p + blocks_per_group * kBlockBytes);
      for (int64_t row0 = 0; row0 < m_pad; row0 += kRowTiles * kTileM) {
        const int64_t tiles = std::min<int64_t>(kRowTiles, (m_pad - row0) / kTileM);
        switch (tiles) {
          case 4: GroupBlock<4>(a, buf, row0, gi, chunk_inputs, buf.c.data()); break;
          case 3: GroupBlock<3>(a, buf, row0, gi, chunk_inputs, buf.c.data()); break;
          case 2: GroupBlock<2>(a, buf, row0, gi, chunk_inputs, buf.c.data()); break;
          default: GroupBlock<1>(a, buf, row0, gi, chunk_inputs, buf.c.data()); break;
        }
        const int64_t rows = std::min<int64_t>(tiles * kTileM, a.m - row0);
        PromoteGroup(buf.c.data(), a, row0, rows, gi, scale, buf.acc.data());
      }
    }
    const __m512 corr = _mm512_loadu_ps(row_corr + nt * kTileRows);
    const __m512 b = _mm512_loadu_ps(bias + nt * kTileRows);
    for (int64_t i = 0; i < a.m; ++i) {
      const int64_t row = a.rows[i];
      const __m512 zp = _mm512_set1_ps(static_cast<float>(a.act.zero_point[row]));
      const __m512 xs = _mm512_set1_ps(a.act.scale[row]);
      const __m512 acc = _mm512_loadu_ps(buf.acc.data() + i * kTileRows);
      const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(zp, corr, acc), xs, b);
      _mm512_storeu_ps(a.out + i * s.n + nt * kTileRows, y);
    }
  }
  _tile_release();
}

}  // namespace jax_moeq::cpu
