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
//
// The promotion (store the C tiles, then per row: subtract 8 * sum, convert,
// fused multiply-add) costs more instructions than the tile products it follows.
// Two sets of C tiles alternate between groups, so that group g's products run
// in the tile unit while group g - 1's sums are stored and promoted.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/w4a8_gemm.h"

namespace jax_moeq::cpu {
namespace {

constexpr int64_t kTileM = 16;        // activation rows per tile
constexpr int64_t kChunkInputs = 64;  // most inputs per TDPBSUD (16 B rows of 4)
constexpr int64_t kBlockRows = 32;    // rows per pass: two C tiles per set

// tmm0-1: C of group set 0 (rows 0-15, 16-31 of the pass), tmm2-3: set 1; tmm4-5: A of the two
// row tiles; tmm6-7: B, alternating between chunks.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void ConfigureTiles(int64_t chunk_inputs) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = kTileM;
    cfg.colsb[t] = kTileRows * 4;
  }
  for (int t = 4; t < 6; ++t) {
    cfg.rows[t] = kTileM;
    cfg.colsb[t] = static_cast<uint16_t>(chunk_inputs);
  }
  for (int t = 6; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(chunk_inputs / 4);
    cfg.colsb[t] = kTileRows * 4;
  }
  _tile_loadconfig(&cfg);
}

struct Buffers {
  std::vector<int8_t> a;       // [m_pad][k]: the GEMM's rows, gathered, zero-padded to 16
  std::vector<uint8_t> b;      // one tile's B rows: [k / 4][64]
  std::vector<float> scales;   // one tile's scales: [groups][16]
  std::vector<int32_t> sum8;   // [m_pad][groups], gathered
  alignas(64) float acc[kBlockRows * kTileRows];
  alignas(64) int32_t c[2][kBlockRows * kTileRows];
};

// The tile's blocks as B rows (block kb's low nibbles are row 2 kb, its high nibbles 2 kb + 1),
// in input order across groups, and its scales.
void UnpackTile(const uint8_t* p, const PackedGemmShape& s, uint8_t* b, float* scales) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const int64_t blocks = s.group / kBlockInputs;
  for (int64_t gi = 0; gi < s.groups(); ++gi, p += s.chunk_bytes()) {
    for (int64_t kb = 0; kb < blocks; ++kb, b += 2 * 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kb * kBlockBytes) + kPrefetchL2Bytes,
                   _MM_HINT_T1);
      const __m512i packed = _mm512_loadu_si512(p + kb * kBlockBytes);
      _mm512_storeu_si512(b, _mm512_and_si512(packed, low_mask));
      _mm512_storeu_si512(b + 64, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask));
    }
    std::memcpy(scales + gi * kTileRows, p + blocks * kBlockBytes, kTileRows * sizeof(float));
  }
}

// GCC's tile intrinsics paste their tile numbers into the instruction text, so the numbers
// must be literals: one function per set of C tiles, written out by these macros.
#define JAX_MOEQ_CHUNK_PRODUCTS(C0, C1, B)                   \
  do {                                                       \
    _tile_loadd(B, b + ch * b_chunk, 64);                    \
    _tile_loadd(4, a + ch * chunk_inputs, s.k);              \
    _tile_dpbsud(C0, 4, B);                                  \
    if constexpr (kTiles == 2) {                             \
      _tile_loadd(5, a + kTileM * s.k + ch * chunk_inputs, s.k); \
      _tile_dpbsud(C1, 5, B);                                \
    }                                                        \
  } while (0)

// Issues group gi's products for the pass's rows into C tiles C0 (rows 0-15) and C1 (16-31);
// B alternates between tmm6 and tmm7 so that a chunk's load need not wait for the last one's
// products.
#define JAX_MOEQ_GROUP_PRODUCTS(NAME, C0, C1)                                              \
  template <int kTiles>                                                                    \
  void NAME(const Buffers& buf, const PackedGemmShape& s, int64_t row0, int64_t gi,        \
            int64_t chunk_inputs) {                                                        \
    _tile_zero(C0);                                                                        \
    if constexpr (kTiles == 2) _tile_zero(C1);                                             \
    const int64_t chunks = s.group / chunk_inputs;                                         \
    const int64_t b_chunk = chunk_inputs / 4 * 64; /* bytes of one chunk's B rows */       \
    const uint8_t* b = buf.b.data() + gi * (s.group / 4) * 64;                             \
    const int8_t* a = buf.a.data() + row0 * s.k + gi * s.group;                            \
    for (int64_t ch = 0; ch < chunks; ++ch) {                                              \
      if (ch & 1) {                                                                        \
        JAX_MOEQ_CHUNK_PRODUCTS(C0, C1, 7);                                                \
      } else {                                                                             \
        JAX_MOEQ_CHUNK_PRODUCTS(C0, C1, 6);                                                \
      }                                                                                    \
    }                                                                                      \
  }

#define JAX_MOEQ_STORE_SUMS(NAME, C0, C1)                                 \
  template <int kTiles>                                                   \
  inline void NAME(int32_t* c) {                                          \
    _tile_stored(C0, c, 64);                                              \
    if constexpr (kTiles == 2) _tile_stored(C1, c + kTileM * kTileRows, 64); \
  }

JAX_MOEQ_GROUP_PRODUCTS(GroupProducts0, 0, 1)
JAX_MOEQ_GROUP_PRODUCTS(GroupProducts1, 2, 3)
JAX_MOEQ_STORE_SUMS(StoreSums0, 0, 1)
JAX_MOEQ_STORE_SUMS(StoreSums1, 2, 3)
#undef JAX_MOEQ_GROUP_PRODUCTS
#undef JAX_MOEQ_CHUNK_PRODUCTS
#undef JAX_MOEQ_STORE_SUMS

template <int kTiles>
void Products(int set, const Buffers& buf, const PackedGemmShape& s, int64_t row0, int64_t gi,
              int64_t chunk_inputs) {
  if (set == 0) {
    GroupProducts0<kTiles>(buf, s, row0, gi, chunk_inputs);
  } else {
    GroupProducts1<kTiles>(buf, s, row0, gi, chunk_inputs);
  }
}

template <int kTiles>
void Store(int set, int32_t* c) {
  if (set == 0) {
    StoreSums0<kTiles>(c);
  } else {
    StoreSums1<kTiles>(c);
  }
}

// acc[i] += float(c[i] - sum8[row i][gi]) * scale for the pass's `rows` rows.
inline void Promote(const int32_t* c, const int32_t* sum8, int64_t groups, int64_t rows,
                    int64_t gi, const float* scales, float* acc) {
  const __m512 scale = _mm512_loadu_ps(scales + gi * kTileRows);
  for (int64_t i = 0; i < rows; ++i) {
    const __m512i centered = _mm512_sub_epi32(_mm512_loadu_si512(c + i * kTileRows),
                                              _mm512_set1_epi32(sum8[i * groups + gi]));
    float* dst = acc + i * kTileRows;
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(centered), scale, _mm512_loadu_ps(dst)));
  }
}

// One pass of up to 32 rows over every group of one tile: group gi's products are issued
// before group gi - 1's sums are stored and promoted.
template <int kTiles>
void Pass(Buffers& buf, const PackedGemmShape& s, int64_t row0, int64_t rows,
          int64_t chunk_inputs) {
  const int64_t groups = s.groups();
  const int32_t* sum8 = buf.sum8.data() + row0 * groups;
  std::memset(buf.acc, 0, sizeof(buf.acc));
  for (int64_t gi = 0; gi < groups; ++gi) {
    Products<kTiles>(gi & 1, buf, s, row0, gi, chunk_inputs);
    if (gi > 0) {
      const int prev = (gi - 1) & 1;
      Store<kTiles>(prev, buf.c[prev]);
      Promote(buf.c[prev], sum8, groups, rows, gi - 1, buf.scales.data(), buf.acc);
    }
  }
  const int last = (groups - 1) & 1;
  Store<kTiles>(last, buf.c[last]);
  Promote(buf.c[last], sum8, groups, rows, groups - 1, buf.scales.data(), buf.acc);
}

}  // namespace

void W4A8GemmAmx(const W4A8GemmArgs& a) {
  if (a.m < kAmxMinRows) return W4A8GemmAvx512Vnni(a);
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups();
  // TDPBSUD takes at most 64 inputs: the largest of 64, 32, 16 dividing the group (a
  // channel-wise group is K, a multiple of 16).
  const int64_t chunk_inputs = s.group % kChunkInputs == 0 ? kChunkInputs
                               : s.group % 32 == 0         ? 32
                                                           : 16;
  const int64_t m_pad = (a.m + kTileM - 1) / kTileM * kTileM;

  static thread_local Buffers buf;
  auto at_least = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  at_least(buf.a, m_pad * s.k);
  at_least(buf.b, s.k / 4 * 64);
  at_least(buf.scales, groups * kTileRows);
  at_least(buf.sum8, m_pad * groups);
  for (int64_t i = 0; i < a.m; ++i) {
    std::memcpy(buf.a.data() + i * s.k, a.act.values + a.rows[i] * s.k, s.k);
    std::memcpy(buf.sum8.data() + i * groups, a.act.sum8 + a.rows[i] * groups, groups * 4);
  }
  std::memset(buf.a.data() + a.m * s.k, 0, (m_pad - a.m) * s.k);

  ConfigureTiles(chunk_inputs);
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    UnpackTile(a.weights + nt * s.tile_bytes(), s, buf.b.data(), buf.scales.data());
    const __m512 corr = _mm512_loadu_ps(row_corr + nt * kTileRows);
    const __m512 b = _mm512_loadu_ps(bias + nt * kTileRows);
    for (int64_t row0 = 0; row0 < a.m; row0 += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, a.m - row0);
      if (rows > kTileM) {
        Pass<2>(buf, s, row0, rows, chunk_inputs);
      } else {
        Pass<1>(buf, s, row0, rows, chunk_inputs);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = a.rows[row0 + i];
        const __m512 zp = _mm512_set1_ps(static_cast<float>(a.act.zero_point[row]));
        const __m512 xs = _mm512_set1_ps(a.act.scale[row]);
        const __m512 acc = _mm512_loadu_ps(buf.acc + i * kTileRows);
        const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(zp, corr, acc), xs, b);
        _mm512_storeu_ps(a.out + (row0 + i) * s.n + nt * kTileRows, y);
      }
    }
  }
  _tile_release();
}

}  // namespace jax_moeq::cpu
