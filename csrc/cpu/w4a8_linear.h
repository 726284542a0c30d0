// Dense W4A8 linear on the CPU (SPEC §12): y = x W^T (+ b) with the int4 weights of one packed
// GEMM (w4a8_layout.h) and int8 activations quantized per row (SPEC §3), output rounded to
// x's dtype. The same GEMMs and row ops as the MoE's GEMM1. No JAX types here.
#pragma once

#include <cstdint>
#include <string>

#include "cpu/cpu_isa.h"
#include "cpu/types.h"
#include "cpu/w4a8_moe.h"

namespace jax_moeq::cpu {

struct W4A8LinearProblem {
  ElementType dtype;
  const void* x;             // [rows][in_features]
  void* out;                 // [rows][out_features]
  const uint8_t* w_packed;   // W4A8PackedBytes(out_features, in_features, group_size)
  int64_t rows;              // M
  int64_t in_features;       // K
  int64_t out_features;      // N
  int64_t group_size;        // 32, 64, 128, or -1 for channel-wise
};

// Largest out_features: a row's float32 GEMM output (4 N bytes) stays far inside the budget.
inline constexpr int64_t kW4A8LinearMaxOutFeatures = int64_t{1} << 24;
// Rows run in chunks whose scratch (one set per concurrent call, kept) fits this budget,
// with at least kW4A8LinearMinChunkRows rows per chunk. Each chunk streams the weights again;
// the smallest chunk (64 rows) does ~8 multiply-adds per weight byte read, compute-bound on
// the GEMM paths, so the extra passes cost little. Qwen3-30B-A3B LM head (N=151936, bf16):
// ~600 KB a row, ~110 rows a chunk.
inline constexpr int64_t kW4A8LinearScratchBudgetBytes = int64_t{64} << 20;
inline constexpr int64_t kW4A8LinearMinChunkRows = 64;

// Checks sizes and attributes (not data); returns "" when valid.
std::string ValidateW4A8LinearShapes(const W4A8LinearProblem& problem, int64_t packed_bytes);

// Scratch bytes one row of `problem` takes, and the rows a chunk takes.
int64_t W4A8LinearScratchBytesPerRow(const W4A8LinearProblem& problem);
int64_t W4A8LinearChunkRows(const W4A8LinearProblem& problem);

// Runs the op; returns "" on success or a message. A row of x holding a NaN or an infinity
// gives NaN in every element of its output row and changes no other row (quantize marks it).
std::string RunW4A8Linear(const W4A8LinearProblem& problem, Isa isa,
                          const ParallelFor& parallel_for);

}  // namespace jax_moeq::cpu
