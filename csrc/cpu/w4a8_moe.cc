#include "cpu/w4a8_moe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <limits>
#include <vector>

#include "cpu/w4a8_gemm.h"
#include "cpu/w4a8_layout.h"
#include "cpu/w4a8_rows.h"

namespace jax_moeq::cpu {
namespace {

// --------------------------------------------------------------- scratch
// The most scratch bytes any one thread's Scratch has held (W4A8MoeScratchHighWater).
std::atomic<int64_t> scratch_high_water{0};

// At least n elements (contents not kept); a new allocation is exactly n, not the doubling of
// resize, so the scratch stays within the chunk's budget. Adds the capacity to *bytes.
template <typename T>
T* Grow(std::vector<T>& v, int64_t n, int64_t* bytes) {
  if (static_cast<int64_t>(v.size()) < n) std::vector<T>(static_cast<size_t>(n)).swap(v);
  *bytes += static_cast<int64_t>(v.capacity() * sizeof(T));
  return v.data();
}

// Per calling thread, kept between calls (grown, never shrunk): bounded by the chunking below.
struct Scratch {
  std::vector<int32_t> counts, offsets, sorted_slot, slot_pos, rows1, rows2;
  std::vector<int8_t> q1, q2;
  std::vector<float> s1, s2, y13, y2;
  std::vector<int32_t> zp1, zp2, sum1, sum2;
};

void NoteScratchBytes(int64_t bytes) {
  int64_t seen = scratch_high_water.load(std::memory_order_relaxed);
  while (bytes > seen &&
         !scratch_high_water.compare_exchange_weak(seen, bytes, std::memory_order_relaxed)) {
  }
}

size_t ElementBytes(ElementType t) { return t == ElementType::kF32 ? 4 : 2; }

// ------------------------------------------------------------ stage times (off by default)
std::atomic<bool> profiling{false};
std::mutex profile_mutex;
W4A8MoeStageTimes profile_sums;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One chunk's times, added to the process sums when the chunk ends.
class ChunkClock {
 public:
  ChunkClock() : on_(profiling.load(std::memory_order_relaxed)), start_(on_ ? NowNs() : 0) {}
  bool on() const { return on_; }
  void SerialDone() {
    if (on_) times_.serial_ns = NowNs() - start_;
  }
  void Launched() {
    if (on_) launch_ = NowNs();
  }
  void Returned() {
    if (!on_) return;
    times_.parallel_ns = NowNs() - launch_;
    const int64_t first = first_start_.load();
    times_.dispatch_ns = first == INT64_MAX ? 0 : first - launch_;
  }
  // One item of `stage`: waited `wait` ns for its inputs, then ran `busy` ns from `start`.
  void Item(W4A8MoeStage stage, int64_t start, int64_t wait, int64_t busy) {
    int64_t seen = first_start_.load(std::memory_order_relaxed);
    while (start < seen &&
           !first_start_.compare_exchange_weak(seen, start, std::memory_order_relaxed)) {
    }
    busy_[stage].fetch_add(busy, std::memory_order_relaxed);
    wait_[stage].fetch_add(wait, std::memory_order_relaxed);
    pieces_[stage].fetch_add(1, std::memory_order_relaxed);
  }
  ~ChunkClock() {
    if (!on_) return;
    std::lock_guard<std::mutex> lock(profile_mutex);
    profile_sums.chunks += 1;
    profile_sums.serial_ns += times_.serial_ns;
    profile_sums.dispatch_ns += times_.dispatch_ns;
    profile_sums.parallel_ns += times_.parallel_ns;
    for (int st = 0; st < kNumStages; ++st) {
      profile_sums.busy_ns[st] += busy_[st].load();
      profile_sums.wait_ns[st] += wait_[st].load();
      profile_sums.pieces[st] += pieces_[st].load();
    }
  }

 private:
  bool on_;
  int64_t start_, launch_ = 0;
  std::atomic<int64_t> first_start_{INT64_MAX};
  std::atomic<int64_t> busy_[kNumStages] = {}, wait_[kNumStages] = {}, pieces_[kNumStages] = {};
  W4A8MoeStageTimes times_;
};

// Spins (then yields) until `counter` reaches `target`; returns the ns waited when timing.
int64_t WaitFor(const std::atomic<int32_t>& counter, int32_t target, bool timed) {
  if (counter.load(std::memory_order_acquire) >= target) return 0;
  const int64_t start = timed ? NowNs() : 0;
  for (int spins = 0; counter.load(std::memory_order_acquire) < target; ++spins) {
    if (spins < 2048) {
#if defined(__x86_64__) || defined(_M_X64)
      __builtin_ia32_pause();
#elif defined(__aarch64__)
      __asm__ __volatile__("yield");
#endif
    } else {
      std::this_thread::yield();
    }
  }
  return timed ? NowNs() - start : 0;
}

struct GemmItem {
  int64_t expert;
  int64_t tile_begin;
  int64_t tile_end;
};

// Work items of (expert, range of 16-row tiles): about 8 per thread, so that threads taking
// them one by one finish within a small item of each other, and no smaller, so that each item is
// a long sequential read of weights (with 256 items of 4 tiles, the two threads of a 2-core
// machine alternated items and decode slowed by 15 %; with 64 items, 16 threads idled for a
// quarter of a decode's GEMM1, 2026-11-25).
std::vector<GemmItem> MakeGemmItems(const std::vector<int32_t>& counts, int64_t n,
                                    int64_t threads) {
  const int64_t tiles = n / kTileRows;
  int64_t active = 0;
  for (int32_t c : counts) active += c > 0;
  std::vector<GemmItem> items;
  if (active == 0) return items;
  const int64_t target = 8 * std::max<int64_t>(1, threads);
  const int64_t per_expert = std::max<int64_t>(1, target / active);
  const int64_t chunk = std::max<int64_t>(2, (tiles + per_expert - 1) / per_expert);
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] == 0) continue;
    for (int64_t t0 = 0; t0 < tiles; t0 += chunk) {
      items.push_back({e, t0, std::min(tiles, t0 + chunk)});
    }
  }
  return items;
}

void RunGemmItem(Isa isa, const GemmItem& item, const uint8_t* weights, int64_t expert_bytes,
                 const PackedGemmShape& shape, const QuantizedActivations& act,
                 const int32_t* rows, const std::vector<int32_t>& counts,
                 const std::vector<int32_t>& offsets, float* out) {
  const int64_t off = offsets[item.expert];
  W4A8GemmArgs args;
  args.weights = weights + item.expert * expert_bytes;
  args.shape = shape;
  args.act = act;
  args.rows = rows + off;
  args.m = counts[item.expert];
  args.out = out + off * shape.n;
  args.tile_begin = item.tile_begin;
  args.tile_end = item.tile_end;
  W4A8Gemm(isa, args);
}

// Rows per quantize / activate piece and tokens per combine piece.
constexpr int64_t kRowsPerPiece = 16;

struct RowPiece {
  int64_t expert;  // activate pieces: the expert whose rows these are
  int64_t begin, end;
};

// The chunk's work, in an order that every dependency respects: quantize pieces, GEMM1 items,
// then per expert its activate pieces (after that expert's GEMM1 items), GEMM2 items (after its
// activate pieces), then combine pieces (after every GEMM2 item). One launch runs it all: each
// thread takes the next item from one counter and waits, if it must, only for items taken
// before it, so whatever number of threads joins, the chunk finishes; and no stage waits for
// the whole of the one before it, as five launches with a barrier after each did (on 16 cores a
// launch took ~12 us before its first piece started, and threads idled at every barrier).
struct Plan {
  std::vector<RowPiece> quantize, activate, combine;
  std::vector<GemmItem> gemm1, gemm2;
  std::vector<int32_t> gemm1_per_expert, activate_per_expert;
  int64_t total() const {
    return static_cast<int64_t>(quantize.size() + gemm1.size() + activate.size() + gemm2.size() +
                                combine.size());
  }
};

std::vector<RowPiece> Pieces(int64_t n, int64_t expert, int64_t offset) {
  std::vector<RowPiece> pieces;
  for (int64_t b = 0; b < n; b += kRowsPerPiece) {
    pieces.push_back({expert, offset + b, offset + std::min(n, b + kRowsPerPiece)});
  }
  return pieces;
}

Plan MakePlan(const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets,
              int64_t rows1, int64_t tokens, int64_t n1, int64_t n2, int64_t threads) {
  Plan plan;
  const int64_t experts = static_cast<int64_t>(counts.size());
  plan.quantize = Pieces(rows1, -1, 0);
  plan.gemm1 = MakeGemmItems(counts, n1, threads);
  plan.gemm2 = MakeGemmItems(counts, n2, threads);
  plan.gemm1_per_expert.assign(experts, 0);
  for (const GemmItem& item : plan.gemm1) ++plan.gemm1_per_expert[item.expert];
  plan.activate_per_expert.assign(experts, 0);
  for (int64_t e = 0; e < experts; ++e) {
    for (const RowPiece& piece : Pieces(counts[e], e, offsets[e])) {
      plan.activate.push_back(piece);
      ++plan.activate_per_expert[e];
    }
  }
  plan.combine = Pieces(tokens, -1, 0);
  return plan;
}

// One chunk of tokens (its slots fit int32: W4A8MoeChunkTokens).
void RunChunk(const W4A8MoeProblem& p, Isa isa, const ParallelFor& parallel_for,
              int64_t threads) {
  const int64_t T = p.tokens, K = p.top_k, E = p.experts, H = p.hidden, I = p.intermediate;
  const int64_t slots = T * K;
  static thread_local Scratch sc;
  ChunkClock clock;
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

  // GEMM1 inputs are quantized once per token, or per slot when the router weight scales the
  // input first. Every buffer is sized before the launch.
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
  float* y13 = Grow(sc.y13, routed * 2 * I, &bytes);  // GEMM1 out, slots in expert order
  int8_t* q2 = Grow(sc.q2, routed * I, &bytes);
  float* s2 = Grow(sc.s2, routed, &bytes);
  int32_t* zp2 = Grow(sc.zp2, routed, &bytes);
  int32_t* sum2 = Grow(sc.sum2, routed * g2, &bytes);
  int32_t* rows2 = Grow(sc.rows2, routed, &bytes);
  for (int64_t pos = 0; pos < routed; ++pos) rows2[pos] = static_cast<int32_t>(pos);
  float* y2 = Grow(sc.y2, routed * H, &bytes);  // GEMM2 out
  const Plan plan = MakePlan(sc.counts, sc.offsets, rows1_count, T, 2 * I, H, threads);
  const QuantizedActivations act1{q1, s1, zp1, sum1}, act2{q2, s2, zp2, sum2};
  const RowOps& ops = RowOpsFor(isa);
  // The calling thread's scratch, named here: inside the items, `sc` would be each worker
  // thread's own (thread_local).
  const std::vector<int32_t>& counts = sc.counts;
  const std::vector<int32_t>& offsets = sc.offsets;

  // Completion counters: quantize pieces; per expert, its GEMM1 items, activate pieces;
  // GEMM2 items.
  std::atomic<int32_t> quantized{0}, gemm2_done{0};
  std::unique_ptr<std::atomic<int32_t>[]> gemm1_done(new std::atomic<int32_t>[E]);
  std::unique_ptr<std::atomic<int32_t>[]> activated(new std::atomic<int32_t>[E]);
  for (int64_t e = 0; e < E; ++e) {
    gemm1_done[e].store(0, std::memory_order_relaxed);
    activated[e].store(0, std::memory_order_relaxed);
  }
  const int64_t n_q = static_cast<int64_t>(plan.quantize.size());
  const int64_t n_g1 = static_cast<int64_t>(plan.gemm1.size());
  const int64_t n_a = static_cast<int64_t>(plan.activate.size());
  const int64_t n_g2 = static_cast<int64_t>(plan.gemm2.size());
  const int64_t total = plan.total();
  const bool timed = clock.on();

  auto run_item = [&](int64_t j, std::vector<float>& row) {
    int64_t wait = 0;
    W4A8MoeStage stage;
    int64_t start = 0;
    if (j < n_q) {
      stage = kStageQuantize;
      start = timed ? NowNs() : 0;
      const RowPiece& piece = plan.quantize[j];
      for (int64_t r = piece.begin; r < piece.end; ++r) {
        const int64_t slot = per_slot ? sorted_slot[r] : -1;
        ops.load(p.dtype, p.x, per_slot ? slot / K : r, H, row.data());
        if (per_slot) ops.scale_round(p.dtype, p.topk_weights[slot], row.data(), H);
        ops.quantize(row.data(), H, shape13.group, q1 + r * H, s1 + r, zp1 + r, sum1 + r * g1);
      }
      if (timed) clock.Item(stage, start, 0, NowNs() - start);
      quantized.fetch_add(1, std::memory_order_release);
      return;
    }
    j -= n_q;
    if (j < n_g1) {
      stage = kStageGemm1;
      wait = WaitFor(quantized, static_cast<int32_t>(n_q), timed);
      start = timed ? NowNs() : 0;
      const GemmItem& item = plan.gemm1[j];
      RunGemmItem(isa, item, p.w13_packed, shape13.total_bytes(), shape13, act1, rows1, counts,
                  offsets, y13);
      if (timed) clock.Item(stage, start, wait, NowNs() - start);
      gemm1_done[item.expert].fetch_add(1, std::memory_order_release);
      return;
    }
    j -= n_g1;
    if (j < n_a) {
      // Round, gated activation, round, quantize for GEMM2.
      stage = kStageActivate;
      const RowPiece& piece = plan.activate[j];
      wait = WaitFor(gemm1_done[piece.expert], plan.gemm1_per_expert[piece.expert], timed);
      start = timed ? NowNs() : 0;
      for (int64_t r = piece.begin; r < piece.end; ++r) {
        float* y = y13 + r * 2 * I;
        ops.activate(p.dtype, p.activation, y, y + I, I, row.data());
        ops.quantize(row.data(), I, shape2.group, q2 + r * I, s2 + r, zp2 + r, sum2 + r * g2);
      }
      if (timed) clock.Item(stage, start, wait, NowNs() - start);
      activated[piece.expert].fetch_add(1, std::memory_order_release);
      return;
    }
    j -= n_a;
    if (j < n_g2) {
      stage = kStageGemm2;
      const GemmItem& item = plan.gemm2[j];
      wait = WaitFor(activated[item.expert], plan.activate_per_expert[item.expert], timed);
      start = timed ? NowNs() : 0;
      RunGemmItem(isa, item, p.w2_packed, shape2.total_bytes(), shape2, act2, rows2, counts,
                  offsets, y2);
      if (timed) clock.Item(stage, start, wait, NowNs() - start);
      gemm2_done.fetch_add(1, std::memory_order_release);
      return;
    }
    j -= n_g2;
    // Weighted sum over slots, in slot order, in the output dtype.
    stage = kStageCombine;
    wait = WaitFor(gemm2_done, static_cast<int32_t>(n_g2), timed);
    start = timed ? NowNs() : 0;
    const RowPiece& piece = plan.combine[j];
    for (int64_t t = piece.begin; t < piece.end; ++t) {
      std::fill(row.begin(), row.begin() + H, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t slot = t * K + k;
        if (slot_pos[slot] < 0) continue;  // expert id out of range
        ops.accumulate(p.dtype, y2 + static_cast<int64_t>(slot_pos[slot]) * H,
                       p.topk_weights[slot], !per_slot, row.data(), H);
      }
      ops.store(p.dtype, row.data(), H, p.out, t);
    }
    if (timed) clock.Item(stage, start, wait, NowNs() - start);
  };

  clock.SerialDone();
  // parallel_for's pieces are places to run items from the shared counter: a piece that
  // starts after every item is taken returns at once.
  std::atomic<int64_t> next{0};
  clock.Launched();
  parallel_for(total, [&](int64_t, int64_t) {
    if (next.load(std::memory_order_relaxed) >= total) return;
    static thread_local std::vector<float> row;
    if (row.size() < static_cast<size_t>(std::max(H, I))) row.resize(std::max(H, I));
    for (int64_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < total;) run_item(j, row);
  });
  clock.Returned();
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

std::string RunW4A8Moe(const W4A8MoeProblem& p, Isa isa, const ParallelFor& parallel_for,
                       int64_t threads) {
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
    c.topk_ids = p.topk_ids + t0 * K;
    c.topk_weights = p.topk_weights + t0 * K;
    RunChunk(c, isa, parallel_for, threads);
  }
  return "";
}

int64_t W4A8MoeScratchHighWater() { return scratch_high_water.load(); }

const char* W4A8MoeStageName(int stage) {
  static const char* names[kNumStages] = {"quantize", "gemm1", "activate", "gemm2", "combine"};
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
