#include "cpu/w4a8_moe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "cpu/w4a8_gemm.h"
#include "cpu/w4a8_layout.h"
#include "cpu/w4a8_rows.h"
#include "cpu/w4a8_work.h"

namespace jax_moeq::cpu {
namespace {

// --------------------------------------------------------------- scratch
// The most scratch bytes any one Scratch set has held (W4A8MoeScratchHighWater).
std::atomic<int64_t> scratch_high_water{0};

// Leased per call from ScratchPool, kept between calls (grown, never shrunk): bounded by the
// chunking below.
struct Scratch {
  std::vector<int32_t> counts, offsets, sorted_slot, slot_pos, rows1, rows2;
  std::vector<int8_t> q1, q2;
  std::vector<float> s1, s2, y13, y2;
  std::vector<int32_t> zp1, zp2, sum1, sum2;
};

// a = max(a, v) and a = min(a, v), lock-free.
void AtomicMax(std::atomic<int64_t>& a, int64_t v) {
  int64_t seen = a.load(std::memory_order_relaxed);
  while (v > seen && !a.compare_exchange_weak(seen, v, std::memory_order_relaxed)) {
  }
}
void AtomicMin(std::atomic<int64_t>& a, int64_t v) {
  int64_t seen = a.load(std::memory_order_relaxed);
  while (v < seen && !a.compare_exchange_weak(seen, v, std::memory_order_relaxed)) {
  }
}

void NoteScratchBytes(int64_t bytes) { AtomicMax(scratch_high_water, bytes); }

// ------------------------------------------------------------ stage times (off by default)
std::atomic<bool> profiling{false};
std::mutex profile_mutex;
W4A8MoeStageTimes profile_sums;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Each thread's first piece start and last piece end in one parallel stage (profiling only).
// Threads are told apart by a process-wide index given on their first piece.
class ThreadSpans {
 public:
  ThreadSpans() {
    for (auto& f : first_) f.store(INT64_MAX, std::memory_order_relaxed);
  }
  void Note(int64_t start, int64_t stop) {
    static std::atomic<int32_t> next_index{0};
    thread_local const int32_t index = next_index.fetch_add(1, std::memory_order_relaxed);
    const int32_t slot = index % kSlots;
    AtomicMin(first_[slot], start);
    AtomicMax(last_[slot], stop);
  }
  // Adds the latest first start (after `launch`) and the summed idle tails (before `end`).
  void AddTo(W4A8MoeStage stage, int64_t launch, int64_t end, W4A8MoeStageTimes* times) const {
    int64_t latest_start = launch;
    for (int i = 0; i < kSlots; ++i) {
      const int64_t first = first_[i].load(std::memory_order_relaxed);
      if (first == INT64_MAX) continue;
      latest_start = std::max(latest_start, first);
      times->idle_tail_ns[stage] += end - last_[i].load(std::memory_order_relaxed);
      times->threads[stage] += 1;
    }
    times->late_start_ns[stage] += latest_start - launch;
  }

 private:
  static constexpr int kSlots = 256;
  std::atomic<int64_t> first_[kSlots] = {};
  std::atomic<int64_t> last_[kSlots] = {};
};

// One chunk's stage times, added to the process sums when the chunk ends.
class StageClock {
 public:
  explicit StageClock(const ParallelFor& parallel_for)
      : on_(profiling.load(std::memory_order_relaxed)), inner_(parallel_for) {
    last_ = on_ ? NowNs() : 0;
  }
  // Ends the current stage: its wall time since the previous mark.
  void Mark(W4A8MoeStage stage) {
    if (!on_) return;
    const int64_t now = NowNs();
    times_.wall_ns[stage] += now - last_;
    last_ = now;
  }
  // A row stage of at most kInlineStageElements elements runs on the calling thread: waking
  // the pool and joining it costs more than such a stage's work (Xeon, 16 threads, T=1: the
  // activation's barrier took 22 us for 2 us of work, 2026-11-25).
  void ForRows(W4A8MoeStage stage, int64_t rows, int64_t row_elements,
               const std::function<void(int64_t, int64_t)>& body) {
    if (rows > 0 && rows * row_elements <= kInlineStageElements) {
      const int64_t start = on_ ? NowNs() : 0;
      body(0, rows);
      if (on_) {
        times_.busy_ns[stage] += NowNs() - start;
        times_.pieces[stage] += 1;
      }
      return;
    }
    For(stage, rows, body);
  }
  // parallel_for, timed as `stage` when profiling: dispatch, busy and join (see the header), and
  // per thread that ran pieces its first start and last end (the header's late start and idle
  // tail).
  void For(W4A8MoeStage stage, int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    if (!on_) return inner_(n, body);
    std::atomic<int64_t> first_start{INT64_MAX}, last_end{0}, busy{0}, pieces{0};
    ThreadSpans spans;
    const int64_t launch = NowNs();
    inner_(n, [&](int64_t begin, int64_t end) {
      const int64_t start = NowNs();
      AtomicMin(first_start, start);
      body(begin, end);
      const int64_t stop = NowNs();
      AtomicMax(last_end, stop);
      busy.fetch_add(stop - start, std::memory_order_relaxed);
      pieces.fetch_add(1, std::memory_order_relaxed);
      spans.Note(start, stop);
    });
    const int64_t returned = NowNs();
    if (pieces.load() == 0) return;
    times_.dispatch_ns[stage] += first_start.load() - launch;
    times_.busy_ns[stage] += busy.load();
    times_.join_ns[stage] += returned - last_end.load();
    times_.pieces[stage] += pieces.load();
    spans.AddTo(stage, launch, last_end.load(), &times_);
  }
  ~StageClock() {
    if (!on_) return;
    std::lock_guard<std::mutex> lock(profile_mutex);
    profile_sums.chunks += 1;
    for (int s = 0; s < kNumStages; ++s) {
      profile_sums.wall_ns[s] += times_.wall_ns[s];
      profile_sums.dispatch_ns[s] += times_.dispatch_ns[s];
      profile_sums.busy_ns[s] += times_.busy_ns[s];
      profile_sums.join_ns[s] += times_.join_ns[s];
      profile_sums.pieces[s] += times_.pieces[s];
      profile_sums.threads[s] += times_.threads[s];
      profile_sums.late_start_ns[s] += times_.late_start_ns[s];
      profile_sums.idle_tail_ns[s] += times_.idle_tail_ns[s];
    }
  }

 private:
  bool on_;
  const ParallelFor& inner_;
  int64_t last_;
  W4A8MoeStageTimes times_;
};

struct GemmItem {
  int64_t expert;
  int64_t tile_begin;
  int64_t tile_end;
};

// Work items of (expert, range of 16-row tiles), TilesPerGemmItem tiles each. `passes`: how
// many GEMM passes share one ParallelFor (2 in the decode region).
std::vector<GemmItem> MakeGemmItems(const std::vector<int32_t>& counts, int64_t n,
                                    int64_t threads, int64_t passes) {
  const int64_t tiles = n / kTileRows;
  int64_t active = 0;
  for (int32_t c : counts) active += c > 0;
  std::vector<GemmItem> items;
  if (active == 0) return items;
  const int64_t chunk = TilesPerGemmItem(tiles, active * passes, threads);
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] == 0) continue;
    for (int64_t t0 = 0; t0 < tiles; t0 += chunk) {
      items.push_back({e, t0, std::min(tiles, t0 + chunk)});
    }
  }
  return items;
}

// One GEMM of the layer (GEMM1 or GEMM2) over every expert's rows.
struct GemmPass {
  const uint8_t* weights;
  int64_t expert_bytes;
  PackedGemmShape shape;
  QuantizedActivations act;
  const int32_t* rows;
  float* out;
};

void RunGemmItem(Isa isa, const GemmPass& pass, const GemmItem& item,
                 const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets) {
  const int64_t off = offsets[item.expert];
  W4A8GemmArgs args;
  args.weights = pass.weights + item.expert * pass.expert_bytes;
  args.shape = pass.shape;
  args.act = pass.act;
  args.rows = pass.rows + off;
  args.m = counts[item.expert];
  args.out = pass.out + off * pass.shape.n;
  args.tile_begin = item.tile_begin;
  args.tile_end = item.tile_end;
  W4A8Gemm(isa, args);
}

void RunGemmPass(Isa isa, const std::vector<GemmItem>& items, const GemmPass& pass,
                 const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets,
                 StageClock& clock, W4A8MoeStage stage) {
  clock.For(stage, static_cast<int64_t>(items.size()), [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) RunGemmItem(isa, pass, items[it], counts, offsets);
  });
}

// Decode-sized calls (at most this many routed pairs) run GEMM1, the activation and GEMM2 as
// one region (RunExperts): 16-thread Xeon, OLMoE, T = 1 / 8: 0.304, 0.289 -> 0.284, 0.258 ms and
// 1.30, 1.27 -> 1.25, 1.24 ms; at T = 128 it measured slower (4.25-5.44 -> 5.57-6.57 ms), so
// larger calls keep three stages.
constexpr int64_t kFusedExpertsMaxPairs = 64;

// GEMM1, the activation, GEMM2 and the combine as one parallel region, so that no thread waits
// at the end of GEMM1 for the slowest one and the row stages overlap the weight stream: items
// run in the order GEMM1 (every expert), then GEMM2; the thread that finishes an expert's last
// GEMM1 item runs that expert's activation rows, a GEMM2 item waits for its expert's
// activation, and the thread that finishes the last GEMM2 item of a column range (every expert's
// items share the ranges) combines every token's slots over those columns. The ParallelFor hands
// out pieces in index order (its contract), so an item waits only for items already taken by
// running threads: no deadlock, whatever the thread count.
void RunExperts(Isa isa, const std::vector<GemmItem>& items13,
                const std::vector<GemmItem>& items2, const GemmPass& pass13,
                const GemmPass& pass2, const std::vector<int32_t>& counts,
                const std::vector<int32_t>& offsets,
                const std::function<void(int64_t, int64_t)>& activate,
                const std::function<void(int64_t, int64_t)>& combine_columns,
                StageClock& clock) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  std::unique_ptr<std::atomic<int32_t>[]> gemm1_left(new std::atomic<int32_t>[experts]);
  std::unique_ptr<std::atomic<int32_t>[]> activated(new std::atomic<int32_t>[experts]);
  for (int64_t e = 0; e < experts; ++e) {
    gemm1_left[e].store(0, std::memory_order_relaxed);
    activated[e].store(0, std::memory_order_relaxed);
  }
  for (const GemmItem& item : items13) {
    gemm1_left[item.expert].fetch_add(1, std::memory_order_relaxed);
  }
  // GEMM2 items left per column range, indexed by the range's first tile.
  const int64_t tiles2 = pass2.shape.n / kTileRows;
  std::unique_ptr<std::atomic<int32_t>[]> gemm2_left(new std::atomic<int32_t>[tiles2]);
  for (int64_t t = 0; t < tiles2; ++t) gemm2_left[t].store(0, std::memory_order_relaxed);
  for (const GemmItem& item : items2) {
    gemm2_left[item.tile_begin].fetch_add(1, std::memory_order_relaxed);
  }
  const int64_t n13 = static_cast<int64_t>(items13.size());
  const int64_t n = n13 + static_cast<int64_t>(items2.size());
  clock.For(kStageExperts, n, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      if (it < n13) {
        const GemmItem& item = items13[it];
        RunGemmItem(isa, pass13, item, counts, offsets);
        if (gemm1_left[item.expert].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          const int64_t off = offsets[item.expert];
          activate(off, off + counts[item.expert]);
          activated[item.expert].store(1, std::memory_order_release);
        }
      } else {
        const GemmItem& item = items2[it - n13];
        while (activated[item.expert].load(std::memory_order_acquire) == 0) {
          std::this_thread::yield();
        }
        RunGemmItem(isa, pass2, item, counts, offsets);
        if (gemm2_left[item.tile_begin].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          combine_columns(item.tile_begin * kTileRows, item.tile_end * kTileRows);
        }
      }
    }
  });
}

// One chunk of tokens (its slots fit int32: W4A8MoeChunkTokens).
void RunChunk(const W4A8MoeProblem& p, Isa isa, const ParallelFor& parallel_for) {
  const int64_t T = p.tokens, K = p.top_k, E = p.experts, H = p.hidden, I = p.intermediate;
  const int64_t slots = T * K;
  ScratchPool<Scratch>::Lease lease(ScratchPool<Scratch>::Get());
  Scratch& sc = *lease;
  StageClock clock(parallel_for);
  int64_t bytes = 0;  // this call's scratch, for W4A8MoeScratchHighWater
  const PackedGemmShape shape13{2 * I, H, p.group_size == -1 ? H : p.group_size};
  const PackedGemmShape shape2{H, I, p.group_size == -1 ? I : p.group_size};
  const int64_t g1 = shape13.groups(), g2 = shape2.groups();

  // Bucket slots by expert (stable counting sort). A slot whose expert id is outside [0, E)
  // is left out: it contributes nothing to its token (ids are data under jit; the Python
  // wrapper rejects concrete ones), as in the jnp reference and the GPU kernels.
  auto in_range = [&](int32_t e) { return e >= 0 && e < E; };
  sc.counts.assign(E, 0);
  for (int64_t s = 0; s < slots; ++s) {
    if (in_range(p.topk_ids[s])) ++sc.counts[p.topk_ids[s]];
  }
  sc.offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) sc.offsets[e + 1] = sc.offsets[e] + sc.counts[e];
  const int64_t routed = sc.offsets[E];  // slots with an expert in range
  bytes += static_cast<int64_t>((sc.counts.capacity() + sc.offsets.capacity()) * 4);
  int32_t* sorted_slot = Grow(sc.sorted_slot, slots, &bytes);
  int32_t* slot_pos = Grow(sc.slot_pos, slots, &bytes);
  {
    std::vector<int32_t> fill(sc.offsets.begin(), sc.offsets.end() - 1);
    for (int64_t s = 0; s < slots; ++s) {
      if (!in_range(p.topk_ids[s])) {
        slot_pos[s] = -1;
        continue;
      }
      const int32_t pos = fill[p.topk_ids[s]]++;
      sorted_slot[pos] = static_cast<int32_t>(s);
      slot_pos[s] = pos;
    }
  }

  clock.Mark(kStageRoute);

  // Stage 1: quantize GEMM1 inputs: once per token, or per slot when the
  // router weight scales the input first.
  const bool per_slot = p.apply_router_weight_on_input;
  const int64_t rows1_count = per_slot ? routed : T;
  int8_t* q1 = Grow(sc.q1, rows1_count * H, &bytes);
  float* s1 = Grow(sc.s1, rows1_count, &bytes);
  int32_t* zp1 = Grow(sc.zp1, rows1_count, &bytes);
  int32_t* sum1 = Grow(sc.sum1, rows1_count * g1, &bytes);
  int32_t* rows1 = Grow(sc.rows1, routed, &bytes);
  for (int64_t pos = 0; pos < routed; ++pos) {
    rows1[pos] = per_slot ? static_cast<int32_t>(pos) : sorted_slot[pos] / static_cast<int32_t>(K);
  }
  const RowOps& ops = RowOpsFor(isa);
  clock.ForRows(kStageQuantize, rows1_count, H, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = per_slot ? sorted_slot[r] : -1;
      ops.load(p.dtype, p.x, per_slot ? slot / K : r, H, row.data());
      if (per_slot) ops.scale_round(p.dtype, p.topk_weights[slot], row.data(), H);
      ops.quantize(row.data(), H, shape13.group, q1 + r * H, s1 + r, zp1 + r, sum1 + r * g1);
    }
  });

  clock.Mark(kStageQuantize);

  // Stages 2-4 (decode-sized calls: one "experts" region): GEMM1 -> y13 [routed][2I] in
  // float32 (slots in expert order); round, gated activation, round, quantize for GEMM2;
  // GEMM2 -> y2 [routed][H].
  float* y13 = Grow(sc.y13, routed * 2 * I, &bytes);
  int8_t* q2 = Grow(sc.q2, routed * I, &bytes);
  float* s2 = Grow(sc.s2, routed, &bytes);
  int32_t* zp2 = Grow(sc.zp2, routed, &bytes);
  int32_t* sum2 = Grow(sc.sum2, routed * g2, &bytes);
  int32_t* rows2 = Grow(sc.rows2, routed, &bytes);
  for (int64_t pos = 0; pos < routed; ++pos) rows2[pos] = static_cast<int32_t>(pos);
  float* y2 = Grow(sc.y2, routed * H, &bytes);
  auto activate = [&](int64_t begin, int64_t end) {
    std::vector<float> act(I);
    for (int64_t r = begin; r < end; ++r) {
      float* y = y13 + r * 2 * I;
      ops.activate(p.dtype, p.activation, y, y + I, I, act.data());
      ops.quantize(act.data(), I, shape2.group, q2 + r * I, s2 + r, zp2 + r, sum2 + r * g2);
    }
  };
  // Decode-sized calls run both GEMMs in one region (RunExperts), whose ParallelFor takes both
  // passes' items: sized together, a piece is one item.
  const bool one_region = routed <= kFusedExpertsMaxPairs && routed > 0;
  const int64_t passes = one_region ? 2 : 1;
  const std::vector<GemmItem> items13 =
      MakeGemmItems(sc.counts, 2 * I, parallel_for.threads, passes);
  const std::vector<GemmItem> items2 = MakeGemmItems(sc.counts, H, parallel_for.threads, passes);
  const GemmPass pass13{p.w13_packed, shape13.total_bytes(), shape13,
                        QuantizedActivations{q1, s1, zp1, sum1}, rows1, y13};
  const GemmPass pass2{p.w2_packed, shape2.total_bytes(), shape2,
                       QuantizedActivations{q2, s2, zp2, sum2}, rows2, y2};
  // Stage 5: weighted sum over slots, in slot order, in the output dtype, then the residual (its
  // own rounded add, as the model's); over a range of columns, so that the decode region can run
  // it per GEMM2 column range (the same arithmetic, element by element).
  const size_t out_bytes = ElementBytes(p.dtype);
  auto combine_tokens = [&](int64_t t_begin, int64_t t_end, int64_t col_begin, int64_t col_end) {
    const int64_t cols = col_end - col_begin;
    std::vector<float> acc(cols), residual(p.residual ? cols : 0);
    for (int64_t t = t_begin; t < t_end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t slot = t * K + k;
        if (slot_pos[slot] < 0) continue;  // expert id out of range
        ops.accumulate(p.dtype, y2 + static_cast<int64_t>(slot_pos[slot]) * H + col_begin,
                       p.topk_weights[slot], !per_slot, acc.data(), cols);
      }
      if (p.residual) {
        ops.load(p.dtype, static_cast<const char*>(p.residual) + (t * H + col_begin) * out_bytes,
                 0, cols, residual.data());
        ops.accumulate(p.dtype, residual.data(), 1.0f, false, acc.data(), cols);
      }
      ops.store(p.dtype, acc.data(), cols,
                static_cast<char*>(p.out) + (t * H + col_begin) * out_bytes, 0);
    }
  };
  // (With no routed pair there is no GEMM2 item to run the combine: the stages write zeros.)
  if (one_region) {
    RunExperts(isa, items13, items2, pass13, pass2, sc.counts, sc.offsets, activate,
               [&](int64_t col_begin, int64_t col_end) {
                 combine_tokens(0, T, col_begin, col_end);
               },
               clock);
    clock.Mark(kStageExperts);
  } else {
    RunGemmPass(isa, items13, pass13, sc.counts, sc.offsets, clock, kStageGemm1);
    clock.Mark(kStageGemm1);
    clock.ForRows(kStageActivate, routed, 2 * I, activate);
    clock.Mark(kStageActivate);
    RunGemmPass(isa, items2, pass2, sc.counts, sc.offsets, clock, kStageGemm2);
    clock.Mark(kStageGemm2);
    clock.ForRows(kStageCombine, T, K * H, [&](int64_t begin, int64_t end) {
      combine_tokens(begin, end, 0, H);
    });
  }
  clock.Mark(kStageCombine);
  NoteScratchBytes(bytes);
}

}  // namespace

int64_t W4A8PackedBytes(int64_t n, int64_t k, int64_t group_size) {
  PackedGemmShape s{n, k, group_size == -1 ? k : group_size};
  return s.total_bytes();
}

std::string ValidateW4A8MoeShapes(const W4A8MoeProblem& p, int64_t w13_bytes, int64_t w2_bytes) {
  const int64_t h = p.hidden, i = p.intermediate, g = p.group_size;
  if (h <= 0 || i <= 0) return "hidden and intermediate sizes must be positive";
  // Before any product of sizes: the packed sizes below stay far inside int64, and a GEMM's
  // int32 dot products over a channel-wise group of K inputs cannot overflow (|sum| <= 1920 K).
  if (h > kW4A8MaxFeatures || i > kW4A8MaxFeatures) {
    return "hidden size " + std::to_string(h) + " and intermediate size " + std::to_string(i) +
           " must be at most " + std::to_string(kW4A8MaxFeatures) +
           " (int32 dot products over a channel-wise group)";
  }
  if (p.tokens < 0 || p.top_k < 0 || p.experts < 0) return "negative dimension";
  if (p.top_k > kW4A8MaxTopK) {
    return "top_k " + std::to_string(p.top_k) + " exceeds " + std::to_string(kW4A8MaxTopK) +
           " (a chunk's (token, slot) pairs are indexed in int32)";
  }
  if (h % 16 != 0) return "hidden size " + std::to_string(h) + " is not a multiple of 16";
  if (i % 16 != 0) return "intermediate size " + std::to_string(i) + " is not a multiple of 16";
  if (g != 32 && g != 64 && g != 128 && g != -1) {
    return "group_size " + std::to_string(g) + " is not one of 32, 64, 128, -1";
  }
  if (g != -1 && (h % g != 0 || i % g != 0)) {
    return "group_size " + std::to_string(g) + " does not divide hidden size " +
           std::to_string(h) + " and intermediate size " + std::to_string(i);
  }
  const int64_t kind = static_cast<int64_t>(p.activation);
  if (kind < 0 || kind > 2) return "activation_kind " + std::to_string(kind) + " is not 0, 1 or 2";
  if (w13_bytes != W4A8PackedBytes(2 * i, h, g)) {
    return "w13_packed has " + std::to_string(w13_bytes) + " bytes per expert, expected " +
           std::to_string(W4A8PackedBytes(2 * i, h, g)) + " for hidden " + std::to_string(h) +
           ", intermediate " + std::to_string(i) + ", group_size " + std::to_string(g);
  }
  if (w2_bytes != W4A8PackedBytes(h, i, g)) {
    return "w2_packed has " + std::to_string(w2_bytes) + " bytes per expert, expected " +
           std::to_string(W4A8PackedBytes(h, i, g));
  }
  return "";
}

int64_t W4A8MoeScratchBytesPerToken(const W4A8MoeProblem& p) {
  const int64_t K = p.top_k, H = p.hidden, I = p.intermediate;
  const int64_t g1 = p.group_size > 0 ? H / p.group_size : 1;  // -1: channel-wise
  const int64_t g2 = p.group_size > 0 ? I / p.group_size : 1;
  // GEMM1 inputs (q1, s1, zp1, sum1): one row per token, or per slot when the router weight
  // scales the input.
  const int64_t rows1 = p.apply_router_weight_on_input ? K : 1;
  const int64_t per_row1 = H + 4 + 4 + 4 * g1;
  // Per slot: sorted_slot, slot_pos, rows1, rows2; y13 (f32 2I), q2, s2, zp2, sum2; y2 (f32 H).
  const int64_t per_slot = 16 + 8 * I + I + 8 + 4 * g2 + 4 * H;
  return std::max<int64_t>(1, rows1 * per_row1 + K * per_slot);
}

int64_t W4A8MoeChunkTokens(const W4A8MoeProblem& p) {
  const int64_t K = std::max<int64_t>(1, p.top_k);
  int64_t chunk = std::max(kW4A8MoeMinChunkTokens,
                           kW4A8MoeScratchBudgetBytes / W4A8MoeScratchBytesPerToken(p));
  // Slots of a chunk are indexed in int32 (ValidateW4A8MoeShapes bounds top_k for that).
  chunk = std::max<int64_t>(1, std::min(chunk, std::numeric_limits<int32_t>::max() / K));
  if (p.tokens <= chunk) return std::max<int64_t>(1, p.tokens);
  // Chunks of equal size (the last one not a sliver).
  const int64_t chunks = (p.tokens + chunk - 1) / chunk;
  return (p.tokens + chunks - 1) / chunks;
}

std::string RunW4A8Moe(const W4A8MoeProblem& p, Isa isa, const ParallelFor& parallel_for) {
  const int64_t T = p.tokens, K = p.top_k;
  if (T == 0) return "";
  // Tokens are independent: chunks of them are exact, and bound the scratch whatever T is
  // (before, it grew with T: ~T * K * (9I + 5H) bytes, kept per calling thread).
  const int64_t chunk = W4A8MoeChunkTokens(p);
  const size_t row_bytes = ElementBytes(p.dtype) * static_cast<size_t>(p.hidden);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    W4A8MoeProblem c = p;
    c.tokens = std::min(chunk, T - t0);
    c.x = static_cast<const char*>(p.x) + static_cast<size_t>(t0) * row_bytes;
    c.out = static_cast<char*>(p.out) + static_cast<size_t>(t0) * row_bytes;
    if (p.residual) {
      c.residual = static_cast<const char*>(p.residual) + static_cast<size_t>(t0) * row_bytes;
    }
    c.topk_ids = p.topk_ids + t0 * K;
    c.topk_weights = p.topk_weights + t0 * K;
    RunChunk(c, isa, parallel_for);
  }
  return "";
}

int64_t W4A8MoeScratchHighWater() { return scratch_high_water.load(); }

int64_t W4A8MoeScratchSets() { return ScratchPool<Scratch>::Get().Sets(); }

const char* W4A8MoeStageName(int stage) {
  static const char* names[kNumStages] = {"route", "quantize", "gemm1", "activate", "gemm2",
                                          "experts", "combine"};
  return stage >= 0 && stage < kNumStages ? names[stage] : "unknown";
}

void W4A8MoeProfileEnable(bool on) { profiling.store(on); }

W4A8MoeStageTimes W4A8MoeProfileTake() {
  std::lock_guard<std::mutex> lock(profile_mutex);
  W4A8MoeStageTimes taken = profile_sums;
  profile_sums = W4A8MoeStageTimes();
  return taken;
}

}  // namespace jax_moeq::cpu
