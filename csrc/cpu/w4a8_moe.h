// Fused W4A8 Mixture-of-Experts on the CPU (SPEC §3-4): bucket (token, slot)
// pairs by expert, quantize activations to int8 per row, GEMM1, gated
// activation, GEMM2, weighted top-k reduction. No JAX types here.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "cpu/cpu_isa.h"
#include "cpu/types.h"

namespace jax_moeq::cpu {

struct W4A8MoeProblem {
  ElementType dtype;
  const void* x;               // [tokens][hidden]
  void* out;                   // [tokens][hidden]
  const int32_t* topk_ids;     // [tokens][top_k]
  const float* topk_weights;   // [tokens][top_k]
  const uint8_t* w13_packed;   // [experts][W4A8PackedBytes(2I, H, g)]
  const uint8_t* w2_packed;    // [experts][W4A8PackedBytes(H, I, g)]
  int64_t tokens;
  int64_t top_k;
  int64_t experts;
  int64_t hidden;              // H
  int64_t intermediate;        // I
  int64_t group_size;          // 32, 64, 128, or -1 for channel-wise
  bool apply_router_weight_on_input;
  ActivationKind activation;
};

// Runs body(begin, end) over [0, n) split into pieces, possibly in parallel,
// and returns when every piece is done.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& body)>;

// Bytes of one expert's packed weights for a GEMM with n outputs, k inputs.
int64_t W4A8PackedBytes(int64_t n, int64_t k, int64_t group_size);

// Checks sizes and attributes (not data); returns "" when valid.
std::string ValidateW4A8MoeShapes(const W4A8MoeProblem& problem,
                                  int64_t w13_bytes_per_expert,
                                  int64_t w2_bytes_per_expert);

// Runs the op; returns "" on success or a message (e.g. an expert id out of
// range, checked before any work).
std::string RunW4A8Moe(const W4A8MoeProblem& problem, Isa isa, const ParallelFor& parallel_for);

}  // namespace jax_moeq::cpu
