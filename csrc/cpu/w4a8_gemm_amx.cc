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
// A group of 128 inputs is only two TDPBSUD per C tile before its sums must leave
// the tile for the float promotion. Storing a C tile waits for its last product,
// so with one set of C tiles the tile unit drained at every group. Here the work
// items (a group x up to 32 rows) alternate between two sets of C tiles: an
// item's products are issued first, then the previous item's set is stored and
// promoted while they run.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/w4a8_gemm.h"

namespace jax_moeq::cpu {
namespace {

constexpr int64_t kTileM = 16;       // activation rows per tile
constexpr int64_t kChunkInputs = 64; // most inputs per TDPBSUD (16 B rows of 4)
constexpr int kSetTiles = 2;         // row tiles of one C set: an item covers up to 32 rows
constexpr int64_t kCTile = kTileM * kTileRows;  // int32 elements of one C tile

// tmm0-1: C set 0, tmm2-3: C set 1 (int32 sums of up to two 16-row tiles); tmm4-5: A of the set's
// two row tiles; tmm6-7: B of two chunks.
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
  std::vector<uint8_t> b;      // one group's B rows: [group / 4][64]
  std::vector<float> acc;      // [m_pad][16]
  std::vector<int32_t> c;      // [2 sets][kSetTiles][16][16]
};

// GCC's tile intrinsics paste their tile numbers into the assembly text, so the numbers must be
// literals: these spell out the few combinations used. C tile kC (0-3) takes A tile 4 + kC % 2.
template <int kC>
inline void ZeroC() {
  if constexpr (kC == 0) _tile_zero(0);
  else if constexpr (kC == 1) _tile_zero(1);
  else if constexpr (kC == 2) _tile_zero(2);
  else _tile_zero(3);
}

template <int kC>
inline void StoreC(int32_t* c) {
  if constexpr (kC == 0) _tile_stored(0, c, 64);
  else if constexpr (kC == 1) _tile_stored(1, c, 64);
  else if constexpr (kC == 2) _tile_stored(2, c, 64);
  else _tile_stored(3, c, 64);
}

template <int kC, int kB>
inline void LoadAndDot(const int8_t* a, int64_t stride) {
  if constexpr (kC % 2 == 0) {
    _tile_loadd(4, a, stride);
  } else {
    _tile_loadd(5, a, stride);
  }
  if constexpr (kC == 0 && kB == 6) _tile_dpbsud(0, 4, 6);
  else if constexpr (kC == 0) _tile_dpbsud(0, 4, 7);
  else if constexpr (kC == 1 && kB == 6) _tile_dpbsud(1, 5, 6);
  else if constexpr (kC == 1) _tile_dpbsud(1, 5, 7);
  else if constexpr (kC == 2 && kB == 6) _tile_dpbsud(2, 4, 6);
  else if constexpr (kC == 2) _tile_dpbsud(2, 4, 7);
  else if constexpr (kB == 6) _tile_dpbsud(3, 5, 6);
  else _tile_dpbsud(3, 5, 7);
}

// One item's int32 sums (rows of c) for group `gi` into acc: acc += float(sum - sum8) * scale.
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

// TDPBSUD of the A rows of kTiles 16-row tiles (one chunk) against B tile kB into C set kSet.
template <int kSet, int kTiles, int kB>
inline void DotChunk(const int8_t* a_chunk, int64_t a_stride) {
  LoadAndDot<2 * kSet, kB>(a_chunk, a_stride);
  if constexpr (kTiles > 1) LoadAndDot<2 * kSet + 1, kB>(a_chunk + kTileM * a_stride, a_stride);
}

// An item's products: group `gi` of the rows from row0 into C set kSet. With at most two chunks a
// group, the group's B tiles were loaded into tmm6-7 once for all its items (b_resident).
template <int kSet, int kTiles>
void ItemProducts(const Buffers& buf, int64_t k, int64_t a_offset, int64_t chunks,
                  int64_t chunk_inputs, bool b_resident) {
  ZeroC<2 * kSet>();
  if constexpr (kTiles > 1) ZeroC<2 * kSet + 1>();
  const int8_t* a_rows = buf.a.data() + a_offset;
  if (b_resident) {
    DotChunk<kSet, kTiles, 6>(a_rows, k);
    if (chunks > 1) DotChunk<kSet, kTiles, 7>(a_rows + chunk_inputs, k);
    return;
  }
  const int64_t b_chunk = chunk_inputs / 4 * 64;
  for (int64_t ch = 0; ch < chunks; ch += 2) {
    _tile_loadd(6, buf.b.data() + ch * b_chunk, 64);
    DotChunk<kSet, kTiles, 6>(a_rows + ch * chunk_inputs, k);
    if (ch + 1 < chunks) {
      _tile_loadd(7, buf.b.data() + (ch + 1) * b_chunk, 64);
      DotChunk<kSet, kTiles, 7>(a_rows + (ch + 1) * chunk_inputs, k);
    }
  }
}

template <int kSet, int kTiles>
inline void StoreSet(int32_t* c) {
  StoreC<2 * kSet>(c);
  if constexpr (kTiles > 1) StoreC<2 * kSet + 1>(c + kCTile);
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

// An item whose products were issued and whose sums still sit in its C set.
struct PendingItem {
  bool valid = false;
  int set = 0, tiles = 1;
  int64_t gi = 0, row0 = 0, rows = 0;
  __m512 scale;
};

// Stores a pending item's C set and promotes its sums.
inline void Retire(PendingItem& item, const W4A8GemmArgs& a, Buffers& buf) {
  if (!item.valid) return;
  int32_t* c = buf.c.data() + item.set * kSetTiles * kCTile;
  if (item.set == 0) {
    item.tiles > 1 ? StoreSet<0, 2>(c) : StoreSet<0, 1>(c);
  } else {
    item.tiles > 1 ? StoreSet<1, 2>(c) : StoreSet<1, 1>(c);
  }
  PromoteGroup(c, a, item.row0, item.rows, item.gi, item.scale, buf.acc.data());
  item.valid = false;
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
  const int64_t chunks = s.group / chunk_inputs;
  const bool b_resident = chunks <= 2;
  const int64_t m_pad = (a.m + kTileM - 1) / kTileM * kTileM;

  static thread_local Buffers buf;
  if (static_cast<int64_t>(buf.a.size()) < m_pad * s.k) buf.a.resize(m_pad * s.k);
  if (static_cast<int64_t>(buf.b.size()) < s.group * kTileRows) buf.b.resize(s.group * kTileRows);
  if (static_cast<int64_t>(buf.acc.size()) < m_pad * kTileRows) buf.acc.resize(m_pad * kTileRows);
  if (static_cast<int64_t>(buf.c.size()) < 2 * kSetTiles * kCTile) {
    buf.c.resize(2 * kSetTiles * kCTile);
  }
  for (int64_t i = 0; i < a.m; ++i) {
    std::memcpy(buf.a.data() + i * s.k, a.act.values + a.rows[i] * s.k, s.k);
  }
  std::memset(buf.a.data() + a.m * s.k, 0, (m_pad - a.m) * s.k);

  ConfigureTiles(chunk_inputs);
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  int set = 0;
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    const uint8_t* p = a.weights + nt * s.tile_bytes();
    std::memset(buf.acc.data(), 0, m_pad * kTileRows * sizeof(float));
    PendingItem pending;
    for (int64_t gi = 0; gi < groups; ++gi, p += s.chunk_bytes()) {
      for (int64_t ahead = 0; ahead < s.chunk_bytes(); ahead += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchL2Bytes + ahead), _MM_HINT_T1);
      }
      UnpackGroup(p, blocks_per_group, buf.b.data());
      if (b_resident) {
        _tile_loadd(6, buf.b.data(), 64);
        if (chunks > 1) _tile_loadd(7, buf.b.data() + chunk_inputs / 4 * 64, 64);
      }
      const __m512 scale = _mm512_loadu_ps(p + blocks_per_group * kBlockBytes);
      for (int64_t row0 = 0; row0 < m_pad; row0 += kSetTiles * kTileM) {
        const int tiles = static_cast<int>(std::min<int64_t>(kSetTiles, (m_pad - row0) / kTileM));
        const int64_t a_offset = row0 * s.k + gi * s.group;
        if (set == 0) {
          tiles > 1 ? ItemProducts<0, 2>(buf, s.k, a_offset, chunks, chunk_inputs, b_resident)
                    : ItemProducts<0, 1>(buf, s.k, a_offset, chunks, chunk_inputs, b_resident);
        } else {
          tiles > 1 ? ItemProducts<1, 2>(buf, s.k, a_offset, chunks, chunk_inputs, b_resident)
                    : ItemProducts<1, 1>(buf, s.k, a_offset, chunks, chunk_inputs, b_resident);
        }
        Retire(pending, a, buf);  // the previous item, while this one's products run
        pending.valid = true;
        pending.set = set;
        pending.tiles = tiles;
        pending.gi = gi;
        pending.row0 = row0;
        pending.rows = std::min<int64_t>(tiles * kTileM, a.m - row0);
        pending.scale = scale;
        set ^= 1;
      }
    }
    Retire(pending, a, buf);
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
