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
  // [tokens][hidden] in x's dtype, or nullptr: out = round(residual + round(moe(x))), the
  // rounding of the model's residual add done apart (a decoder layer's x + mlp(x)).
  const void* residual;
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

// Pieces per thread a ParallelFor cuts its range into (at most).
inline constexpr int64_t kPiecesPerThread = 16;

// run(n, body) runs body(begin, end) over [0, n) split into pieces, possibly in parallel, and
// returns when every piece is done. Pieces start in index order (a piece may wait for work of
// earlier pieces: RunW4A8Moe's GEMM2 items do). `threads`: the most threads it runs pieces on
// at once (the ops size their work items by it, kPiecesPerThread a thread).
struct ParallelFor {
  std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& body)> run;
  int64_t threads = 1;
  void operator()(int64_t n, const std::function<void(int64_t, int64_t)>& body) const {
    run(n, body);
  }
};

// Largest hidden / intermediate size: a GEMM's int32 dot products over a
// channel-wise group of K <= 2^20 inputs stay below 2^31 (1920 K).
inline constexpr int64_t kW4A8MaxFeatures = int64_t{1} << 20;
// Largest top_k: (token, slot) pairs of a chunk of kW4A8MoeMinChunkTokens are
// indexed in int32.
inline constexpr int64_t kW4A8MaxTopK = int64_t{1} << 24;
// The op runs its tokens in chunks whose scratch (one set per concurrent call, kept
// between calls) fits this budget, with at least kW4A8MoeMinChunkTokens tokens
// per chunk: the scratch is bounded whatever the token count. Each chunk reads
// the weights of the experts it hits again, so the budget is large enough that
// prefills of a few thousand tokens stay one chunk (Qwen3-30B-A3B shapes:
// ~120 KB a token, ~2100 tokens a chunk).
inline constexpr int64_t kW4A8MoeScratchBudgetBytes = int64_t{256} << 20;
inline constexpr int64_t kW4A8MoeMinChunkTokens = 64;

// Bytes of one expert's packed weights for a GEMM with n outputs, k inputs.
int64_t W4A8PackedBytes(int64_t n, int64_t k, int64_t group_size);

// Checks sizes and attributes (not data); returns "" when valid.
std::string ValidateW4A8MoeShapes(const W4A8MoeProblem& problem,
                                  int64_t w13_bytes_per_expert,
                                  int64_t w2_bytes_per_expert);

// Runs the op; returns "" on success or a message. A (token, slot) pair whose
// expert id is outside [0, experts) contributes nothing to its token. A row of
// x holding a NaN or an infinity gives NaN in every element of that token's
// output and changes no other token's output (row_ops' quantize marks it).
std::string RunW4A8Moe(const W4A8MoeProblem& problem, Isa isa, const ParallelFor& parallel_for);

// Scratch bytes one token of `problem` takes, and the tokens a chunk takes.
int64_t W4A8MoeScratchBytesPerToken(const W4A8MoeProblem& problem);
int64_t W4A8MoeChunkTokens(const W4A8MoeProblem& problem);
// The largest scratch (bytes) one call's chunk has held so far in this process.
int64_t W4A8MoeScratchHighWater();
// The scratch sets the op has made in this process: the most calls that ran at once (not the
// threads that ever called it).
int64_t W4A8MoeScratchSets();

// Where a call's time goes (benchmarks/cpu_moe_bench.py --time-split): while enabled, every
// chunk adds its stages' wall times, and each parallel stage the time from its launch to the
// first piece starting on any thread (dispatch), the pieces' summed run time (busy), and the
// time from the last piece ending to the launch returning (join). Off by default; a few clock
// reads per stage when on.
// Per thread that ran pieces (summed over chunks): threads, the latest first start after the
// launch (late_start: how long the last thread to join took to start), and each thread's idle
// time from its last piece's end to the stage's last end (idle_tail).
// "experts": GEMM1, the gated activation, GEMM2 and the combine as one parallel region (decode-sized
// calls); larger calls time them as gemm1, activate and gemm2.
enum W4A8MoeStage { kStageRoute, kStageQuantize, kStageGemm1, kStageActivate, kStageGemm2,
                    kStageExperts, kStageCombine, kNumStages };
struct W4A8MoeStageTimes {
  int64_t chunks = 0;
  int64_t wall_ns[kNumStages] = {};
  int64_t dispatch_ns[kNumStages] = {};
  int64_t busy_ns[kNumStages] = {};
  int64_t join_ns[kNumStages] = {};
  int64_t pieces[kNumStages] = {};
  int64_t threads[kNumStages] = {};
  int64_t late_start_ns[kNumStages] = {};
  int64_t idle_tail_ns[kNumStages] = {};
};
const char* W4A8MoeStageName(int stage);
void W4A8MoeProfileEnable(bool on);
// The sums since the last read, then zeroes them.
W4A8MoeStageTimes W4A8MoeProfileTake();

}  // namespace jax_moeq::cpu
