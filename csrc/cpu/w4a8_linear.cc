#include "cpu/w4a8_linear.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cpu/w4a8_gemm.h"
#include "cpu/w4a8_layout.h"
#include "cpu/w4a8_rows.h"
#include "cpu/w4a8_work.h"

namespace jax_moeq::cpu {
namespace {

// Leased per call from ScratchPool, kept between calls (grown, never shrunk): bounded by the
// chunking.
struct LinearScratch {
  std::vector<int32_t> rows;
  std::vector<int8_t> q;
  std::vector<float> scale, y;
  std::vector<int32_t> zero_point, sum8;
};

// Runs body over [0, n) on the calling thread when the stage is small (see
// kInlineStageElements), else through parallel_for.
void ForRows(const ParallelFor& parallel_for, int64_t n, int64_t row_elements,
             const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  if (n * row_elements <= kInlineStageElements) return body(0, n);
  parallel_for(n, body);
}

// One chunk of rows (indexed in int32: W4A8LinearChunkRows).
void RunChunk(const W4A8LinearProblem& p, Isa isa, const ParallelFor& parallel_for) {
  ScratchPool<LinearScratch>::Lease lease(ScratchPool<LinearScratch>::Get());
  LinearScratch& sc = *lease;
  const int64_t M = p.rows, K = p.in_features, N = p.out_features;
  const PackedGemmShape shape{N, K, p.group_size == -1 ? K : p.group_size};
  const int64_t groups = shape.groups();
  const RowOps& ops = RowOpsFor(isa);
  int64_t bytes = 0;

  // Quantize each row once.
  int8_t* q = Grow(sc.q, M * K, &bytes);
  float* scale = Grow(sc.scale, M, &bytes);
  int32_t* zero_point = Grow(sc.zero_point, M, &bytes);
  int32_t* sum8 = Grow(sc.sum8, M * groups, &bytes);
  int32_t* rows = Grow(sc.rows, M, &bytes);
  for (int64_t r = 0; r < M; ++r) rows[r] = static_cast<int32_t>(r);
  ForRows(parallel_for, M, K, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t r = begin; r < end; ++r) {
      ops.load(p.dtype, p.x, r, K, row.data());
      ops.quantize(row.data(), K, shape.group, q + r * K, scale + r, zero_point + r,
                   sum8 + r * groups);
    }
  });

  // GEMM over ranges of 16-row output tiles, every row of the chunk per item (as the MoE's
  // GEMMs, so the AMX path sees all rows). float32 output goes straight to `out`; otherwise
  // to scratch, and each item rounds and stores its own columns while they are in cache.
  const bool direct = p.dtype == ElementType::kF32;
  float* y = direct ? static_cast<float*>(p.out) : Grow(sc.y, M * N, &bytes);
  const size_t out_bytes = ElementBytes(p.dtype);
  const int64_t tiles = N / kTileRows;
  const int64_t per_item = TilesPerGemmItem(tiles, 1, parallel_for.threads);
  const int64_t items = (tiles + per_item - 1) / per_item;
  const QuantizedActivations act{q, scale, zero_point, sum8};
  parallel_for(items, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      W4A8GemmArgs args;
      args.weights = p.w_packed;
      args.shape = shape;
      args.act = act;
      args.rows = rows;
      args.m = M;
      args.out = y;
      args.tile_begin = it * per_item;
      args.tile_end = std::min(tiles, args.tile_begin + per_item);
      W4A8Gemm(isa, args);
      if (direct) continue;
      const int64_t col = args.tile_begin * kTileRows;
      const int64_t width = (args.tile_end - args.tile_begin) * kTileRows;
      for (int64_t r = 0; r < M; ++r) {
        float* v = y + r * N + col;
        ops.scale_round(p.dtype, 1.0f, v, width);
        // Row 0 of a [1][width] view that starts at (r, col) of the output.
        void* dst = static_cast<char*>(p.out) + (static_cast<size_t>(r * N + col)) * out_bytes;
        ops.store(p.dtype, v, width, dst, 0);
      }
    }
  });
}

}  // namespace

std::string ValidateW4A8LinearShapes(const W4A8LinearProblem& p, int64_t packed_bytes) {
  const int64_t k = p.in_features, n = p.out_features, g = p.group_size;
  if (p.rows < 0) return "negative row count " + std::to_string(p.rows);
  if (k <= 0 || n <= 0) {
    return "in_features " + std::to_string(k) + " and out_features " + std::to_string(n) +
           " must be positive";
  }
  // Before any product of sizes: the packed size below stays far inside int64, and the int32
  // dot products over a channel-wise group of K inputs cannot overflow (|sum| <= 1920 K).
  if (k > kW4A8MaxFeatures) {
    return "in_features " + std::to_string(k) + " must be at most " +
           std::to_string(kW4A8MaxFeatures) + " (int32 dot products over a channel-wise group)";
  }
  if (n > kW4A8LinearMaxOutFeatures) {
    return "out_features " + std::to_string(n) + " must be at most " +
           std::to_string(kW4A8LinearMaxOutFeatures);
  }
  if (n % 16 != 0) return "out_features " + std::to_string(n) + " is not a multiple of 16";
  if (k % 16 != 0) return "in_features " + std::to_string(k) + " is not a multiple of 16";
  if (g != 32 && g != 64 && g != 128 && g != -1) {
    return "group_size " + std::to_string(g) + " is not one of 32, 64, 128, -1";
  }
  if (g != -1 && k % g != 0) {
    return "group_size " + std::to_string(g) + " does not divide in_features " +
           std::to_string(k);
  }
  const int64_t want = W4A8PackedBytes(n, k, g);
  if (packed_bytes != want) {
    return "w_packed has " + std::to_string(packed_bytes) + " bytes, expected " +
           std::to_string(want) + " for out_features " + std::to_string(n) + ", in_features " +
           std::to_string(k) + ", group_size " + std::to_string(g);
  }
  return "";
}

int64_t W4A8LinearScratchBytesPerRow(const W4A8LinearProblem& p) {
  const int64_t k = p.in_features, n = p.out_features;
  const int64_t groups = p.group_size > 0 ? k / p.group_size : 1;  // -1: channel-wise
  // q, scale, zero point, sum8, row index; the float32 GEMM output unless x is float32 (the
  // GEMM then writes the output itself).
  const int64_t y = p.dtype == ElementType::kF32 ? 0 : 4 * n;
  return std::max<int64_t>(1, k + 4 + 4 + 4 * groups + 4 + y);
}

int64_t W4A8LinearChunkRows(const W4A8LinearProblem& p) {
  int64_t chunk = std::max(kW4A8LinearMinChunkRows,
                           kW4A8LinearScratchBudgetBytes / W4A8LinearScratchBytesPerRow(p));
  chunk = std::min<int64_t>(chunk, std::numeric_limits<int32_t>::max());  // rows are int32
  if (p.rows <= chunk) return std::max<int64_t>(1, p.rows);
  // Chunks of equal size (the last one not a sliver).
  const int64_t chunks = (p.rows + chunk - 1) / chunk;
  return (p.rows + chunks - 1) / chunks;
}

std::string RunW4A8Linear(const W4A8LinearProblem& p, Isa isa, const ParallelFor& parallel_for) {
  const int64_t M = p.rows;
  if (M == 0) return "";
  // Rows are independent: chunks of them are exact, and bound the scratch whatever M is.
  const int64_t chunk = W4A8LinearChunkRows(p);
  const size_t x_row_bytes = ElementBytes(p.dtype) * static_cast<size_t>(p.in_features);
  const size_t out_row_bytes = ElementBytes(p.dtype) * static_cast<size_t>(p.out_features);
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    W4A8LinearProblem c = p;
    c.rows = std::min(chunk, M - r0);
    c.x = static_cast<const char*>(p.x) + static_cast<size_t>(r0) * x_row_bytes;
    c.out = static_cast<char*>(p.out) + static_cast<size_t>(r0) * out_row_bytes;
    RunChunk(c, isa, parallel_for);
  }
  return "";
}

}  // namespace jax_moeq::cpu
