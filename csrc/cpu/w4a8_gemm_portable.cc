// Portable (scalar) W4A8 GEMM: the fallback on every CPU, and the readable
// statement of what the SIMD paths compute.
#include "cpu/w4a8_gemm.h"

namespace jax_moeq::cpu {

void W4A8GemmPortable(const W4A8GemmArgs& a) {
  const PackedGemmShape& s = a.shape;
  const int64_t groups = s.groups();
  const int64_t blocks_per_group = s.group / kBlockInputs;
  const float* row_corr = reinterpret_cast<const float*>(a.weights + s.row_corr_offset());
  const float* bias = reinterpret_cast<const float*>(a.weights + s.bias_offset());
  for (int64_t nt = a.tile_begin; nt < a.tile_end; ++nt) {
    const uint8_t* tile = a.weights + nt * s.tile_bytes();
    for (int64_t i = 0; i < a.m; ++i) {
      const int64_t row = a.rows[i];
      const int8_t* x = a.act.values + row * s.k;
      const int32_t* sum8 = a.act.sum8 + row * groups;
      float acc[kTileRows] = {};
      const uint8_t* p = tile;
      for (int64_t gi = 0; gi < groups; ++gi) {
        int32_t dot[kTileRows] = {};
        for (int64_t kb = 0; kb < blocks_per_group; ++kb, p += kBlockBytes) {
          const int8_t* xk = x + gi * s.group + kb * kBlockInputs;
          for (int r = 0; r < kTileRows; ++r) {
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = p[4 * r + j];
              dot[r] += static_cast<int32_t>(byte & 0x0F) * xk[j] +
                        static_cast<int32_t>(byte >> 4) * xk[4 + j];
            }
          }
        }
        const float* scale = reinterpret_cast<const float*>(p);
        p += kTileRows * 4;
        for (int r = 0; r < kTileRows; ++r) {
          acc[r] += static_cast<float>(dot[r] - sum8[gi]) * scale[r];
        }
      }
      float* out = a.out + i * s.n + nt * kTileRows;
      const float xs = a.act.scale[row];
      const float zp = static_cast<float>(a.act.zero_point[row]);
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t n = nt * kTileRows + r;
        out[r] = (acc[r] - zp * row_corr[n]) * xs + bias[n];
      }
    }
  }
}

}  // namespace jax_moeq::cpu
