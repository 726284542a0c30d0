// AMX-INT8 W4A8 GEMM (Sapphire Rapids and later). TDPBSUD multiplies a tile of
// signed activation bytes A [16 rows x 64 inputs] with a tile of unsigned weight
// bytes B [16 quads x (16 outputs x 4 inputs)] into int32 C [16 rows x 16 outputs].
//
// The packed layout needs no change: the low nibbles of one 64-byte block are
// exactly one B row (16 outputs x inputs k0..k0+3) and its high nibbles the next
// (k0+4..k0+7), so a group's blocks unpack into B rows in input order. Each group's
// int32 sums are promoted to float32 in group order with the same fused
// multiply-adds as the VNNI path, so both paths give identical bits. Few rows per
// expert leave the tiles mostly empty: those GEMMs run on the VNNI code (kAmxMinRows).
//
// Loop order, for the caches: up to four output tiles (64 outputs) share each A tile
// load, A is gathered chunk-major ([chunk][row][chunk inputs], one contiguous 1 KB
// tile), and rows go in panels of 64 whose float accumulators (16 KB) stay in L1
// across the groups. A 16-output-only loop re-read A from L2 for every TDPBSUD and
// ran its tile products at under half the unit's rate (benchmarks/amx_gemm_probe.cc).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/w4a8_gemm.h"

namespace jax_moeq::cpu {
namespace {

constexpr int64_t kTileM = 16;        // activation rows per tile
constexpr int64_t kChunkInputs = 64;  // most inputs per TDPBSUD (16 B rows of 4)
constexpr int kMaxNTiles = 4;         // output tiles per pass: C tiles tmm0..3
constexpr int64_t kPanelRows = 64;    // rows whose accumulators stay in L1 across the groups

// tmm0-3: C (int32 sums) of one 16-row block against up to four output tiles;
// tmm4: A; tmm5-7: B, in rotation so that a load need not wait for the previous product.
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
  for (int t = 0; t < kMaxNTiles; ++t) {
    cfg.rows[t] = kTileM;
    cfg.colsb[t] = kTileRows * 4;
  }
  cfg.rows[4] = kTileM;
  cfg.colsb[4] = static_cast<uint16_t>(chunk_inputs);
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(chunk_inputs / 4);
    cfg.colsb[t] = kTileRows * 4;
  }
  _tile_loadconfig(&cfg);
}

struct Buffers {
  std::vector<int8_t> a;    // [k / chunk][m_pad][chunk]: the GEMM's rows, gathered, zero-padded
  std::vector<uint8_t> b;   // [kMaxNTiles][group / 4][64]: one group's B rows per output tile
  std::vector<float> acc;   // [m_pad][kMaxNTiles][16]
  std::vector<int32_t> c;   // [kMaxNTiles][16][16]
};

// B tile `tb` from `b`, then C tile `tc` += A (tmm4) . B. A macro: the tile intrinsics take the
// register numbers as literals.
#define JAX_MOEQ_AMX_LOAD_DOT(tc, tb, b) \
  do {                                   \
    _tile_loadd(tb, (b), 64);            \
    _tile_dpbsud(tc, 4, tb);             \
  } while (0)

// One 16-row block's int32 sums over one group against kNTiles output tiles, into c.
template <int kNTiles>
void BlockProducts(const int8_t* a, int64_t a_chunk_stride, int64_t chunk_inputs, int64_t chunks,
                   const uint8_t* b, int64_t b_tile_stride, int32_t* c) {
  _tile_zero(0);
  if constexpr (kNTiles > 1) _tile_zero(1);
  if constexpr (kNTiles > 2) _tile_zero(2);
  if constexpr (kNTiles > 3) _tile_zero(3);
  const int64_t b_chunk_bytes = chunk_inputs / 4 * 64;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    _tile_loadd(4, a + ch * a_chunk_stride, chunk_inputs);
    const uint8_t* bc = b + ch * b_chunk_bytes;
    JAX_MOEQ_AMX_LOAD_DOT(0, 5, bc);
    if constexpr (kNTiles > 1) JAX_MOEQ_AMX_LOAD_DOT(1, 6, bc + b_tile_stride);
    if constexpr (kNTiles > 2) JAX_MOEQ_AMX_LOAD_DOT(2, 7, bc + 2 * b_tile_stride);
    if constexpr (kNTiles > 3) JAX_MOEQ_AMX_LOAD_DOT(3, 5, bc + 3 * b_tile_stride);
  }
  constexpr int64_t kC = kTileM * kTileRows;  // int32 elements of one C tile
  _tile_stored(0, c, 64);
  if constexpr (kNTiles > 1) _tile_stored(1, c + kC, 64);
  if constexpr (kNTiles > 2) _tile_stored(2, c + 2 * kC, 64);
  if constexpr (kNTiles > 3) _tile_stored(3, c + 3 * kC, 64);
}

// acc[i][t] += float(c[t][i] - sum8[row i][gi]) * scale[t], rows row0..row0+rows-1.
template <int kNTiles>
void PromoteBlock(const int32_t* c, const W4A8GemmArgs& a, int64_t row0, int64_t rows,
                  int64_t gi, const __m512* scale, float* acc) {
  const int64_t groups = a.shape.groups();
  constexpr int64_t kC = kTileM * kTileRows;
  for (int64_t i = 0; i < rows; ++i) {
    const __m512i sum8 = _mm512_set1_epi32(a.act.sum8[a.rows[row0 + i] * groups + gi]);
    float* dst = acc + (row0 + i) * kMaxNTiles * kTileRows;
    for (int t = 0; t < kNTiles; ++t) {
      const __m512i centered =
          _mm512_sub_epi32(_mm512_loadu_si512(c + t * kC + i * kTileRows), sum8);
      _mm512_storeu_ps(dst + t * kTileRows,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(centered), scale[t],
                                       _mm512_loadu_ps(dst + t * kTileRows)));
    }
  }
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

// Output tiles nt0..nt0+kNTiles-1 for every row.
template <int kNTiles>
void TilePass(const W4A8GemmArgs& a, Buffers& buf, int64_t nt0, int64_t m_pad,
              int64_t chunk_inputs) {
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups();
  const int64_t blocks_per_group = s.group / kBlockInputs;
  const int64_t chunks = s.group / chunk_inputs;
  const int64_t b_tile_stride = s.group / 4 * 64;
  const int64_t a_chunk_stride = m_pad * chunk_inputs;
  const uint8_t* tiles[kNTiles];
  for (int t = 0; t < kNTiles; ++t) tiles[t] = a.weights + (nt0 + t) * s.tile_bytes();
  std::memset(buf.acc.data(), 0, m_pad * kMaxNTiles * kTileRows * sizeof(float));
  for (int64_t p0 = 0; p0 < m_pad; p0 += kPanelRows) {
    const int64_t p1 = std::min(m_pad, p0 + kPanelRows);
    for (int64_t gi = 0; gi < groups; ++gi) {
      __m512 scale[kNTiles];
      for (int t = 0; t < kNTiles; ++t) {
        const uint8_t* chunk = tiles[t] + gi * s.chunk_bytes();
        if (p0 == 0) {  // the first panel streams the weights; later ones find them in L2
          for (int64_t ahead = 0; ahead < s.chunk_bytes(); ahead += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchL2Bytes + ahead),
                         _MM_HINT_T1);
          }
        }
        UnpackGroup(chunk, blocks_per_group, buf.b.data() + t * b_tile_stride);
        scale[t] = _mm512_loadu_ps(chunk + blocks_per_group * kBlockBytes);
      }
      const int8_t* a_group = buf.a.data() + gi * chunks * a_chunk_stride;
      for (int64_t row0 = p0; row0 < p1; row0 += kTileM) {
        BlockProducts<kNTiles>(a_group + row0 * chunk_inputs, a_chunk_stride, chunk_inputs, chunks,
                               buf.b.data(), b_tile_stride, buf.c.data());
        const int64_t rows = std::min<int64_t>(kTileM, a.m - row0);
        if (rows > 0) PromoteBlock<kNTiles>(buf.c.data(), a, row0, rows, gi, scale, buf.acc.data());
      }
    }
  }
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  for (int t = 0; t < kNTiles; ++t) {
    const int64_t nt = nt0 + t;
    const __m512 corr = _mm512_loadu_ps(row_corr + nt * kTileRows);
    const __m512 b = _mm512_loadu_ps(bias + nt * kTileRows);
    for (int64_t i = 0; i < a.m; ++i) {
      const int64_t row = a.rows[i];
      const __m512 zp = _mm512_set1_ps(static_cast<float>(a.act.zero_point[row]));
      const __m512 xs = _mm512_set1_ps(a.act.scale[row]);
      const __m512 acc = _mm512_loadu_ps(buf.acc.data() + (i * kMaxNTiles + t) * kTileRows);
      const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(zp, corr, acc), xs, b);
      _mm512_storeu_ps(a.out + i * s.n + nt * kTileRows, y);
    }
  }
}

#undef JAX_MOEQ_AMX_LOAD_DOT

// The GEMM's rows chunk-major: chunk kc of row i at (kc * m_pad + i) * chunk_inputs, rows from
// a.m to m_pad zero. Every work item gathers its own copy, so the 64-input case (every group
// size from 64 up) moves whole registers rather than calling memcpy per chunk.
void GatherChunkMajor(const W4A8GemmArgs& a, int64_t m_pad, int64_t chunk_inputs, int8_t* out) {
  const int64_t k = a.shape.k;
  const int64_t k_chunks = k / chunk_inputs;
  for (int64_t i = 0; i < m_pad; ++i) {
    int8_t* dst = out + i * chunk_inputs;
    const int64_t dst_stride = m_pad * chunk_inputs;
    if (i >= a.m) {
      for (int64_t kc = 0; kc < k_chunks; ++kc) std::memset(dst + kc * dst_stride, 0, chunk_inputs);
      continue;
    }
    const int8_t* src = a.act.values + a.rows[i] * k;
    if (chunk_inputs == 64) {
      for (int64_t kc = 0; kc < k_chunks; ++kc) {
        _mm512_storeu_si512(dst + kc * dst_stride, _mm512_loadu_si512(src + kc * 64));
      }
    } else {
      for (int64_t kc = 0; kc < k_chunks; ++kc) {
        std::memcpy(dst + kc * dst_stride, src + kc * chunk_inputs, chunk_inputs);
      }
    }
  }
}

}  // namespace

void W4A8GemmAmx(const W4A8GemmArgs& a) {
  if (a.m < kAmxMinRows) return W4A8GemmAvx512Vnni(a);
  const PackedGemmShape& s = a.shape;
  // TDPBSUD takes at most 64 inputs: the largest of 64, 32, 16 dividing the group (a
  // channel-wise group is K, a multiple of 16).
  const int64_t chunk_inputs = s.group % kChunkInputs == 0 ? kChunkInputs
                               : s.group % 32 == 0         ? 32
                                                           : 16;
  const int64_t m_pad = (a.m + kTileM - 1) / kTileM * kTileM;

  static thread_local Buffers buf;
  if (static_cast<int64_t>(buf.a.size()) < m_pad * s.k) buf.a.resize(m_pad * s.k);
  if (static_cast<int64_t>(buf.b.size()) < kMaxNTiles * s.group * kTileRows) {
    buf.b.resize(kMaxNTiles * s.group * kTileRows);
  }
  if (static_cast<int64_t>(buf.acc.size()) < m_pad * kMaxNTiles * kTileRows) {
    buf.acc.resize(m_pad * kMaxNTiles * kTileRows);
  }
  if (static_cast<int64_t>(buf.c.size()) < kMaxNTiles * kTileM * kTileRows) {
    buf.c.resize(kMaxNTiles * kTileM * kTileRows);
  }
  GatherChunkMajor(a, m_pad, chunk_inputs, buf.a.data());

  ConfigureTiles(chunk_inputs);
  int64_t nt = a.tile_begin;
  for (; nt + kMaxNTiles <= a.tile_end; nt += kMaxNTiles) TilePass<4>(a, buf, nt, m_pad, chunk_inputs);
  switch (a.tile_end - nt) {
    case 3: TilePass<3>(a, buf, nt, m_pad, chunk_inputs); break;
    case 2: TilePass<2>(a, buf, nt, m_pad, chunk_inputs); break;
    case 1: TilePass<1>(a, buf, nt, m_pad, chunk_inputs); break;
    default: break;
  }
  _tile_release();
}

}  // namespace jax_moeq::cpu
