// Compares every CPU W4A8 path this machine can run (cpu_isa.h AvailableIsas) with the portable
// one, without JAX: the GEMM (w4a8_gemm.h) over random packed weights and activations, then the
// whole MoE (w4a8_moe.h). NEON paths must equal portable bit for bit; the x86 paths contract
// their float epilogue into FMAs, so they are held to a bound instead (AgreesWithin).
// Prints "ok <isa>: <N> cases" per path; exits 1 on any mismatch. tests/test_portability.py
// builds it natively and for AArch64 (run under qemu).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_isa.h"
#include "cpu/dtype_convert.h"
#include "cpu/w4a8_gemm.h"
#include "cpu/w4a8_layout.h"
#include "cpu/w4a8_moe.h"
#include "cpu/w4a8_rows.h"

using namespace jax_moeq::cpu;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Paths whose float steps are the portable ones, operation for operation.
bool BitExact(Isa isa) {
  return isa == Isa::kPortable || isa == Isa::kNeonDotprod || isa == Isa::kNeonI8mm;
}

// x86 paths: acc = fma(centered, scale, acc) per group and fma(fnmadd(zp, corr, acc), xs, bias)
// at the end. Each fused step skips one rounding of a product whose size is at most `bound`
// (the sum of the terms' magnitudes), so the results differ by a few 2^-24 * bound per group;
// 1e-5 * bound (~170 such roundings) covers the 16 groups of these shapes with room (the
// largest difference seen was 2.4e-7 * bound).
bool AgreesWithin(float got, float want, double bound) {
  if (std::isnan(got) || std::isnan(want)) return std::isnan(got) && std::isnan(want);
  return std::fabs(static_cast<double>(got) - want) <= 1e-5 * bound;
}

// What a path's outputs were compared with, for its summary line.
const char* Comparison(Isa isa) {
  if (isa == Isa::kPortable) return "GEMM against float64";
  return BitExact(isa) ? "bit-exact" : "within the FMA bound";
}

struct Tally {
  int64_t gemm_cases = 0;
  int64_t moe_cases = 0;
  int64_t failures = 0;
};

class Random {
 public:
  explicit Random(uint32_t seed) : gen_(seed) {}
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen_); }
  float Uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  float Normal() { return std::normal_distribution<float>()(gen_); }

 private:
  std::mt19937 gen_;
};

// ------------------------------------------------------------------ row stages

// The SIMD row ops (w4a8_rows.h) against the portable ones on rows of mixed magnitudes (with
// quiet and signaling NaN, infinities, subnormals and values past exp's clamp): load, store,
// scale_round, quantize and accumulate bit-exact; activate within 8 float32 ulp (exp is a
// polynomial, within ~2 ulp, and one division and two products follow it), or, in bf16 / f16,
// within one step of the type, since a few float32 ulp can move the rounding to it; AVX2 and
// AVX-512 bit-exact with each other where both run. Returns the failures.
struct RowOpsResult {
  std::vector<uint8_t> stored;
  std::vector<float> loaded, scaled, activated, accumulated, scales;
  std::vector<int8_t> q;
  std::vector<int32_t> zero_points, sum8;
};

std::vector<float> RandomRow(int64_t n, int variant, Random& rng) {
  std::vector<float> v(n);
  const float magnitude = variant % 3 == 0 ? 1.0f : variant % 3 == 1 ? 30.0f : 1e-3f;
  for (auto& x : v) x = magnitude * rng.Normal();
  if (variant % 4 == 1) {
    v[rng.Int(0, n - 1)] = 120.0f;    // exp(-120) and exp(120) past the +-100 clamp
    v[rng.Int(0, n - 1)] = -95.0f;
    v[rng.Int(0, n - 1)] = 1e-40f;    // subnormal
    v[rng.Int(0, n - 1)] = -0.0f;
  }
  if (variant % 8 == 5) v[rng.Int(0, n - 1)] = kNaN;
  if (variant % 8 == 6) v[rng.Int(0, n - 1)] = -std::numeric_limits<float>::infinity();
  if (variant % 8 == 7) v[rng.Int(0, n - 1)] = std::numeric_limits<float>::signaling_NaN();
  return v;
}

RowOpsResult RunRowOps(const RowOps& ops, ElementType t, ActivationKind kind,
                       const std::vector<float>& a, const std::vector<float>& b, int64_t group,
                       float w) {
  const int64_t n = static_cast<int64_t>(a.size());
  const int64_t esize = t == ElementType::kF32 ? 4 : 2;
  RowOpsResult r;
  r.stored.assign(n * esize, 0xA5);
  std::vector<float> rounded = a;
  ops.scale_round(t, 1.0f, rounded.data(), n);
  ops.store(t, rounded.data(), n, r.stored.data(), 0);
  r.loaded.assign(n, kNaN);
  ops.load(t, r.stored.data(), 0, n, r.loaded.data());
  r.scaled = a;
  ops.scale_round(t, 0.37f, r.scaled.data(), n);
  std::vector<float> gate = a, up = b;
  r.activated.assign(n, kNaN);
  ops.activate(t, kind, gate.data(), up.data(), n, r.activated.data());
  r.accumulated = b;
  ops.accumulate(t, a.data(), w, true, r.accumulated.data(), n);
  ops.accumulate(t, b.data(), 1.0f, false, r.accumulated.data(), n);
  const int64_t groups = n / group;
  r.q.assign(n, 99);
  r.sum8.assign(groups, -7);
  r.scales.assign(1, -1.0f);
  r.zero_points.assign(1, -999);
  ops.quantize(a.data(), n, group, r.q.data(), r.scales.data(), r.zero_points.data(),
               r.sum8.data());
  return r;
}

// Bit for bit, except that a NaN matches any NaN: the payload is not part of the contract
// (F16C keeps a signaling NaN's payload when it quiets it, the portable conversion does not).
bool SameBits(const std::vector<float>& x, const std::vector<float>& y) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) && std::isnan(y[i])) continue;
    if (std::memcmp(&x[i], &y[i], 4) != 0) return false;
  }
  return true;
}

// The bytes of a [n] array of `dtype` as floats.
std::vector<float> AsFloats(const std::vector<uint8_t>& bytes, ElementType dtype) {
  std::vector<float> v;
  if (dtype == ElementType::kF32) {
    v.resize(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  }
  for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
    uint16_t h;
    std::memcpy(&h, &bytes[i], 2);
    v.push_back(dtype == ElementType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h));
  }
  return v;
}

// |got - want| <= 8 float32 steps of want, or <= `step` (relative) * |want| + `floor`.
bool ActivationsAgree(const std::vector<float>& got, const std::vector<float>& want,
                      ElementType t) {
  const double step = t == ElementType::kBF16 ? 0x1p-8 : t == ElementType::kF16 ? 0x1p-11 : 0.0;
  const double floor = t == ElementType::kF16 ? 0x1p-24 : 0.0;  // f16's subnormal step
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) {
      if (std::isnan(got[i]) != std::isnan(want[i])) return false;
      continue;
    }
    const double g = got[i], w = want[i];
    const double ulp = std::fabs(std::nextafter(want[i], INFINITY) - want[i]);
    if (std::fabs(g - w) > std::max(8 * ulp, step * std::fabs(w) + floor)) return false;
  }
  return true;
}

int64_t CheckRowOps(const std::vector<Isa>& isas) {
  std::vector<std::pair<const char*, const RowOps*>> simd;
#if defined(JAX_MOEQ_X86)
  const auto has = [&](Isa isa) { return std::find(isas.begin(), isas.end(), isa) != isas.end(); };
  if (has(Isa::kAvx2)) simd.push_back({"avx2", &Avx2RowOps()});
  if (has(Isa::kAvx512Vnni)) simd.push_back({"avx512", &Avx512RowOps()});
#else
  (void)isas;
#endif
  if (simd.empty()) return 0;
  Random rng(41);
  const ElementType dtypes[] = {ElementType::kF32, ElementType::kBF16, ElementType::kF16};
  const ActivationKind kinds[] = {ActivationKind::kSwigluStep, ActivationKind::kSwigluOai,
                                  ActivationKind::kSilu};
  int64_t cases = 0, failures = 0, cross = 0;
  for (int variant = 0; variant < 48; ++variant) {
    const int64_t n = 16 * rng.Int(1, 24);
    const int64_t group = n % 64 == 0 ? 32 : 16;
    const ElementType t = dtypes[variant % 3];
    const ActivationKind kind = kinds[(variant / 3) % 3];
    const std::vector<float> a = RandomRow(n, variant, rng), b = RandomRow(n, variant + 1, rng);
    const float w = rng.Uniform(0.05f, 1.0f);
    const RowOpsResult want = RunRowOps(PortableRowOps(), t, kind, a, b, group, w);
    std::vector<RowOpsResult> got;
    for (const auto& [name, ops] : simd) {
      got.push_back(RunRowOps(*ops, t, kind, a, b, group, w));
      const RowOpsResult& g = got.back();
      const char* bad = !SameBits(AsFloats(g.stored, t), AsFloats(want.stored, t))
                            ? "store"
                        : !SameBits(g.loaded, want.loaded)       ? "load"
                        : !SameBits(g.scaled, want.scaled)       ? "scale_round"
                        : !SameBits(g.accumulated, want.accumulated) ? "accumulate"
                        : g.q != want.q || g.sum8 != want.sum8 || g.zero_points != want.zero_points ||
                                  !SameBits(g.scales, want.scales)
                            ? "quantize"
                        : !ActivationsAgree(g.activated, want.activated, t) ? "activate"
                                                                      : nullptr;
      ++cases;
      if (bad) {
        ++failures;
        std::printf("FAIL row ops %s: %s (n=%lld variant %d)\n", name, bad,
                    static_cast<long long>(n), variant);
      }
    }
    if (got.size() == 2) {
      ++cross;
      if (!SameBits(got[0].activated, got[1].activated)) {
        ++failures;
        std::printf("FAIL row ops avx2 vs avx512: activate (n=%lld variant %d)\n",
                    static_cast<long long>(n), variant);
      }
    }
  }
  std::printf("%s row ops: %lld cases against portable, %lld avx2 against avx512 (bit-exact)\n",
              failures ? "FAIL" : "ok", static_cast<long long>(cases),
              static_cast<long long>(cross));
  return failures;
}

// ------------------------------------------------------------------ packed weights

// One expert: int4 values q [n][k] in [-8, 7], positive scales sw [n][groups], bias [n], and
// their packed bytes in the layout of w4a8_layout.h.
struct Expert {
  PackedGemmShape shape;
  std::vector<int8_t> q;
  std::vector<float> sw, bias, row_corr;
  std::vector<uint8_t> packed;
};

// Weight bytes and scales of tile nt, group gi (layout comment: byte[4r + j]).
void PackChunk(const Expert& e, int64_t nt, int64_t gi, uint8_t* chunk) {
  const PackedGemmShape& s = e.shape;
  for (int64_t kb = 0; kb < s.group / kBlockInputs; ++kb) {
    const int64_t k0 = gi * s.group + kBlockInputs * kb;
    uint8_t* block = chunk + kb * kBlockBytes;
    for (int64_t r = 0; r < kTileRows; ++r) {
      const int8_t* qrow = e.q.data() + (nt * kTileRows + r) * s.k;
      for (int j = 0; j < 4; ++j) {
        block[4 * r + j] = static_cast<uint8_t>((qrow[k0 + j] + 8) | (qrow[k0 + 4 + j] + 8) << 4);
      }
    }
  }
  float* scales = reinterpret_cast<float*>(chunk + s.group / kBlockInputs * kBlockBytes);
  for (int64_t r = 0; r < kTileRows; ++r) scales[r] = e.sw[(nt * kTileRows + r) * s.groups() + gi];
}

void Pack(Expert& e) {
  const PackedGemmShape& s = e.shape;
  e.packed.assign(s.total_bytes(), 0);
  for (int64_t nt = 0; nt < s.n / kTileRows; ++nt) {
    for (int64_t gi = 0; gi < s.groups(); ++gi) {
      PackChunk(e, nt, gi, e.packed.data() + nt * s.tile_bytes() + gi * s.chunk_bytes());
    }
  }
  // row_corr[n] = sum_gi sw[n][gi] * sum_{k in gi} q[n][k].
  e.row_corr.assign(s.n, 0.0f);
  for (int64_t n = 0; n < s.n; ++n) {
    for (int64_t gi = 0; gi < s.groups(); ++gi) {
      int32_t sum = 0;
      for (int64_t k = gi * s.group; k < (gi + 1) * s.group; ++k) sum += e.q[n * s.k + k];
      e.row_corr[n] += e.sw[n * s.groups() + gi] * static_cast<float>(sum);
    }
  }
  std::memcpy(e.packed.data() + s.row_corr_offset(), e.row_corr.data(), s.n * 4);
  std::memcpy(e.packed.data() + s.bias_offset(), e.bias.data(), s.n * 4);
}

Expert RandomExpert(const PackedGemmShape& s, float scale_max, Random& rng) {
  Expert e;
  e.shape = s;
  e.q.resize(s.n * s.k);
  for (auto& v : e.q) v = static_cast<int8_t>(rng.Int(-8, 7));
  e.sw.resize(s.n * s.groups());
  for (auto& v : e.sw) v = rng.Uniform(scale_max / 16, scale_max);
  e.bias.resize(s.n);
  for (auto& v : e.bias) v = rng.Uniform(-1.0f, 1.0f);
  Pack(e);
  return e;
}

// ------------------------------------------------------------------ quantized activations

struct Activations {
  int64_t k, group;
  std::vector<int8_t> values;
  std::vector<float> scale;
  std::vector<int32_t> zero_point, sum8;

  QuantizedActivations View() const {
    return {values.data(), scale.data(), zero_point.data(), sum8.data()};
  }
};

// Random int8 rows (the full range, -128 and 127 included) with consistent sum8. Row `nan_row`
// (if >= 0) is what the quantizer makes of a row holding a NaN: zeros, zero point 0, scale NaN.
Activations RandomActivations(int64_t rows, int64_t k, int64_t group, int64_t nan_row,
                              Random& rng) {
  Activations a{k, group, std::vector<int8_t>(rows * k), std::vector<float>(rows),
                std::vector<int32_t>(rows), std::vector<int32_t>(rows * (k / group))};
  for (int64_t r = 0; r < rows; ++r) {
    const bool nan = r == nan_row;
    for (int64_t i = 0; i < k; ++i) a.values[r * k + i] = nan ? 0 : rng.Int(-128, 127);
    a.scale[r] = nan ? kNaN : rng.Uniform(1e-3f, 0.1f);
    a.zero_point[r] = nan ? 0 : rng.Int(-128, 127);
    for (int64_t gi = 0; gi < k / group; ++gi) {
      int32_t sum = 0;
      for (int64_t i = gi * group; i < (gi + 1) * group; ++i) sum += a.values[r * k + i];
      a.sum8[r * (k / group) + gi] = 8 * sum;
    }
  }
  return a;
}

// ------------------------------------------------------------------ GEMM cases

struct GemmCase {
  PackedGemmShape shape;
  std::vector<int32_t> rows;
  int64_t tile_begin, tile_end;
};

std::string Describe(const GemmCase& c) {
  char text[160];
  std::snprintf(text, sizeof(text), "gemm n=%lld k=%lld group=%lld m=%zu tiles=[%lld,%lld)",
                static_cast<long long>(c.shape.n), static_cast<long long>(c.shape.k),
                static_cast<long long>(c.shape.group), c.rows.size(),
                static_cast<long long>(c.tile_begin), static_cast<long long>(c.tile_end));
  return text;
}

std::vector<float> RunGemm(Isa isa, const GemmCase& c, const Expert& e, const Activations& act) {
  const int64_t m = static_cast<int64_t>(c.rows.size());
  std::vector<float> out(m * c.shape.n, kNaN);  // poison: tiles outside the range stay NaN
  W4A8GemmArgs args;
  args.weights = e.packed.data();
  args.shape = c.shape;
  args.act = act.View();
  args.rows = c.rows.data();
  args.m = m;
  args.out = out.data();
  args.tile_begin = c.tile_begin;
  args.tile_end = c.tile_end;
  W4A8Gemm(isa, args);
  return out;
}

// Output i, column n in float64, and the sum of its terms' magnitudes (the error scale).
void ReferenceOutput(const GemmCase& c, const Expert& e, const Activations& act, int64_t i,
                     int64_t n, double* value, double* bound) {
  const PackedGemmShape& s = c.shape;
  const int64_t row = c.rows[i];
  double acc = 0.0, size = 0.0;
  for (int64_t gi = 0; gi < s.groups(); ++gi) {
    int64_t dot = 0;
    for (int64_t k = gi * s.group; k < (gi + 1) * s.group; ++k) {
      dot += (e.q[n * s.k + k] + 8) * static_cast<int64_t>(act.values[row * s.k + k]);
    }
    const double term = static_cast<double>(dot - act.sum8[row * s.groups() + gi]) *
                        e.sw[n * s.groups() + gi];
    acc += term;
    size += std::fabs(term);
  }
  const double corr = static_cast<double>(act.zero_point[row]) * e.row_corr[n];
  const double xs = act.scale[row];
  *value = (acc - corr) * xs + e.bias[n];
  *bound = (size + std::fabs(corr)) * std::fabs(xs) + std::fabs(e.bias[n]);
}

bool InTiles(const GemmCase& c, int64_t n) {
  return n >= c.tile_begin * kTileRows && n < c.tile_end * kTileRows;
}

// Portable against float64: checks the harness's packing as much as the kernel.
bool PortableMatchesReference(const GemmCase& c, const Expert& e, const Activations& act,
                              const std::vector<float>& out) {
  for (int64_t i = 0; i < static_cast<int64_t>(c.rows.size()); ++i) {
    for (int64_t n = 0; n < c.shape.n; ++n) {
      const float got = out[i * c.shape.n + n];
      if (!InTiles(c, n)) {
        if (!std::isnan(got)) return false;
        continue;
      }
      double value, bound;
      ReferenceOutput(c, e, act, i, n, &value, &bound);
      if (!AgreesWithin(got, static_cast<float>(value), bound)) {
        std::printf("  portable (%lld, %lld): %.9g, float64 %.9g\n", static_cast<long long>(i),
                    static_cast<long long>(n), got, value);
        return false;
      }
    }
  }
  return true;
}

bool GemmAgrees(Isa isa, const GemmCase& c, const Expert& e, const Activations& act,
                const std::vector<float>& got, const std::vector<float>& want) {
  if (BitExact(isa)) return std::memcmp(got.data(), want.data(), got.size() * 4) == 0;
  for (int64_t i = 0; i < static_cast<int64_t>(c.rows.size()); ++i) {
    for (int64_t n = 0; n < c.shape.n; ++n) {
      const int64_t at = i * c.shape.n + n;
      double value, bound;
      if (!InTiles(c, n)) {
        if (std::memcmp(&got[at], &want[at], 4) != 0) return false;
        continue;
      }
      ReferenceOutput(c, e, act, i, n, &value, &bound);
      if (!AgreesWithin(got[at], want[at], bound)) return false;
    }
  }
  return true;
}

// Row indices into `act_rows` activation rows: random, so with gaps, and a repeat when m > 1.
std::vector<int32_t> RandomRows(int64_t m, int64_t act_rows, Random& rng) {
  std::vector<int32_t> rows(m);
  for (auto& r : rows) r = rng.Int(0, static_cast<int>(act_rows) - 1);
  if (m > 1) rows[m - 1] = rows[0];
  return rows;
}

// The whole tile range and, where there are 2 or more tiles, an inner part of it.
std::vector<std::pair<int64_t, int64_t>> TileRanges(int64_t tiles) {
  std::vector<std::pair<int64_t, int64_t>> ranges{{0, tiles}};
  if (tiles == 2) ranges.push_back({1, 2});
  if (tiles > 2) ranges.push_back({1, tiles - 1});
  return ranges;
}

std::vector<int64_t> GroupSizes(int64_t k) {
  std::vector<int64_t> groups{32};
  if (k % 128 == 0 && k != 128) groups.push_back(128);
  if (k != 32) groups.push_back(k);  // channel-wise
  return groups;
}

void CheckGemms(const std::vector<Isa>& isas, std::vector<Tally>& tallies) {
  Random rng(1234);
  for (int64_t n : {16, 48, 256}) {
    for (int64_t k : {32, 64, 256, 512}) {
      for (int64_t group : GroupSizes(k)) {
        const PackedGemmShape shape{n, k, group};
        const Expert e = RandomExpert(shape, 0.05f, rng);
        // m = 7 takes every branch of the i8mm token loop: 2 pairs, 1 pair, the odd token.
        for (int64_t m : {1, 2, 3, 5, 7, 8}) {
          const int64_t act_rows = m + 3;
          // A NaN-scale row (a quantized row that held a NaN) in the larger blocks.
          const int64_t nan_row = m >= 3 ? act_rows - 1 : -1;
          const Activations act = RandomActivations(act_rows, k, group, nan_row, rng);
          for (auto [begin, end] : TileRanges(n / kTileRows)) {
            GemmCase c{shape, RandomRows(m, act_rows, rng), begin, end};
            if (m >= 3) c.rows[1] = static_cast<int32_t>(nan_row);
            const std::vector<float> want = RunGemm(Isa::kPortable, c, e, act);
            for (size_t t = 0; t < isas.size(); ++t) {
              const std::vector<float> got = RunGemm(isas[t], c, e, act);
              const bool ok = isas[t] == Isa::kPortable
                                  ? PortableMatchesReference(c, e, act, got)
                                  : GemmAgrees(isas[t], c, e, act, got, want);
              ++tallies[t].gemm_cases;
              if (!ok) {
                ++tallies[t].failures;
                std::printf("FAIL %s %s\n", IsaName(isas[t]), Describe(c).c_str());
              }
            }
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------ MoE cases

struct MoeCase {
  int64_t tokens, hidden, intermediate, group_size;
  ElementType dtype;
  ActivationKind activation;
  bool weight_on_input;
};

std::string Describe(const MoeCase& c) {
  static const char* dtypes[] = {"f32", "bf16", "f16"};
  char text[160];
  std::snprintf(text, sizeof(text), "moe tokens=%lld H=%lld I=%lld group=%lld %s act=%d%s",
                static_cast<long long>(c.tokens), static_cast<long long>(c.hidden),
                static_cast<long long>(c.intermediate), static_cast<long long>(c.group_size),
                dtypes[static_cast<int>(c.dtype)], static_cast<int>(c.activation),
                c.weight_on_input ? " weight-on-input" : "");
  return text;
}

struct MoeInputs {
  int64_t experts = 4, top_k = 2;
  std::vector<uint8_t> w13, w2;
  std::vector<uint16_t> x16;  // bf16 / f16 inputs
  std::vector<float> x32, weights;
  std::vector<int32_t> ids;
};

std::vector<uint8_t> StackedExperts(int64_t experts, const PackedGemmShape& s, Random& rng) {
  std::vector<uint8_t> all;
  for (int64_t e = 0; e < experts; ++e) {
    const Expert ex = RandomExpert(s, 1.0f / 32, rng);
    all.insert(all.end(), ex.packed.begin(), ex.packed.end());
  }
  return all;
}

// Normal inputs (token 1's row holds a NaN when there are 3 or more tokens); expert ids that
// include -1 and `experts` (out of range: they contribute nothing).
MoeInputs RandomMoeInputs(const MoeCase& c, Random& rng) {
  MoeInputs in;
  const int64_t g = c.group_size;
  in.w13 = StackedExperts(in.experts, {2 * c.intermediate, c.hidden, g == -1 ? c.hidden : g}, rng);
  in.w2 = StackedExperts(in.experts, {c.hidden, c.intermediate, g == -1 ? c.intermediate : g},
                         rng);
  for (int64_t i = 0; i < c.tokens * c.hidden; ++i) in.x32.push_back(rng.Normal());
  if (c.tokens >= 3) in.x32[c.hidden + 5] = kNaN;
  for (float v : in.x32) {
    in.x16.push_back(c.dtype == ElementType::kBF16 ? FloatToBf16(v) : FloatToF16(v));
  }
  for (int64_t i = 0; i < c.tokens * in.top_k; ++i) {
    in.ids.push_back(rng.Int(-1, static_cast<int>(in.experts)));
    in.weights.push_back(rng.Uniform(0.1f, 1.0f));
  }
  return in;
}

// Output bytes of the op on `isa` ("" in *error on success).
std::vector<uint8_t> RunMoe(Isa isa, const MoeCase& c, const MoeInputs& in, std::string* error) {
  const size_t element = c.dtype == ElementType::kF32 ? 4 : 2;
  std::vector<uint8_t> out(c.tokens * c.hidden * element, 0xFF);  // NaN in every dtype
  W4A8MoeProblem p{};
  p.dtype = c.dtype;
  p.x = c.dtype == ElementType::kF32 ? static_cast<const void*>(in.x32.data()) : in.x16.data();
  p.out = out.data();
  p.topk_ids = in.ids.data();
  p.topk_weights = in.weights.data();
  p.w13_packed = in.w13.data();
  p.w2_packed = in.w2.data();
  p.tokens = c.tokens;
  p.top_k = in.top_k;
  p.experts = in.experts;
  p.hidden = c.hidden;
  p.intermediate = c.intermediate;
  p.group_size = c.group_size;
  p.apply_router_weight_on_input = c.weight_on_input;
  p.activation = c.activation;
  *error = ValidateW4A8MoeShapes(p, in.w13.size() / in.experts, in.w2.size() / in.experts);
  const ParallelFor serial{[](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
                             body(0, n);
                           },
                           1};
  if (error->empty()) *error = RunW4A8Moe(p, isa, serial);
  return out;
}

// x86 paths: GEMM1's FMA epilogue can move an activation across an int8 rounding boundary
// before GEMM2, or an output across a bf16 / f16 rounding boundary; either changes an output
// by a small fraction of the largest one (2^-7 for a bf16 step). Bound: 2% of the largest |y|
// (the largest difference seen on AVX2 and AVX-512 VNNI was 2.2e-7 of it).
bool MoeAgrees(Isa isa, const MoeCase& c, const std::vector<uint8_t>& got,
               const std::vector<uint8_t>& want) {
  if (BitExact(isa)) return got == want;
  const std::vector<float> g = AsFloats(got, c.dtype), w = AsFloats(want, c.dtype);
  double largest = 0.0;
  for (float v : w) {
    if (std::isfinite(v)) largest = std::max(largest, std::fabs(static_cast<double>(v)));
  }
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) != std::isnan(w[i])) return false;
    if (!std::isnan(w[i]) && std::fabs(static_cast<double>(g[i]) - w[i]) > 0.02 * largest) {
      return false;
    }
  }
  return true;
}

std::vector<MoeCase> MoeCases() {
  std::vector<MoeCase> cases;
  const ElementType dtypes[] = {ElementType::kF32, ElementType::kBF16, ElementType::kF16};
  const ActivationKind kinds[] = {ActivationKind::kSwigluStep, ActivationKind::kSwigluOai,
                                  ActivationKind::kSilu};
  int variant = 0;
  for (int64_t tokens : {1, 3, 8}) {
    for (auto [hidden, intermediate] : {std::pair<int64_t, int64_t>{64, 32}, {128, 64}}) {
      for (int64_t group : {32, 64, -1}) {
        if (group != -1 && intermediate % group != 0) continue;
        for (bool on_input : {false, true}) {
          // dtype and activation rotate through the cases rather than multiply them.
          cases.push_back({tokens, hidden, intermediate, group, dtypes[variant % 3],
                           kinds[(variant / 3) % 3], on_input});
          ++variant;
        }
      }
    }
  }
  return cases;
}

void CheckMoe(const std::vector<Isa>& isas, std::vector<Tally>& tallies) {
  Random rng(99);
  for (const MoeCase& c : MoeCases()) {
    const MoeInputs in = RandomMoeInputs(c, rng);
    std::string error;
    const std::vector<uint8_t> want = RunMoe(Isa::kPortable, c, in, &error);
    for (size_t t = 0; t < isas.size(); ++t) {
      std::string isa_error;
      const std::vector<uint8_t> got = RunMoe(isas[t], c, in, &isa_error);
      ++tallies[t].moe_cases;
      if (!error.empty() || !isa_error.empty() || !MoeAgrees(isas[t], c, got, want)) {
        ++tallies[t].failures;
        std::printf("FAIL %s %s %s%s\n", IsaName(isas[t]), Describe(c).c_str(), error.c_str(),
                    isa_error.c_str());
      }
    }
  }
}

#if defined(JAX_MOEQ_X86)
// AMX-INT8 against AVX-512 VNNI, bit for bit (both promote each group's exact int32 sums with
// the same FMAs), at row counts that fill its 16-row tiles: one block, a partial one, four at
// once and more (m >= kAmxMinRows; fewer rows run the VNNI code itself). Group sizes take each
// TDPBSUD width: 32, 64, 128, and channel-wise K = 48 (16-input chunks), 80, 96 (32), 512 (64).
// The NaN-scale row stays NaN on both.
int64_t CheckAmxAgainstVnni() {
  Random rng(4321);
  int64_t cases = 0, failures = 0;
  const PackedGemmShape shapes[] = {{32, 128, 32},  {48, 256, 64}, {64, 512, 128},
                                    {16, 48, 48},   {32, 80, 80},  {16, 96, 96},
                                    {32, 512, 512}, {256, 256, 128}};
  for (const PackedGemmShape& shape : shapes) {
    const Expert e = RandomExpert(shape, 0.05f, rng);
    for (int64_t m : {16, 17, 31, 33, 64, 70, 129, 200}) {
      const int64_t act_rows = m + 5;
      const Activations act = RandomActivations(act_rows, shape.k, shape.group, act_rows - 1, rng);
      for (auto [begin, end] : TileRanges(shape.n / kTileRows)) {
        GemmCase c{shape, RandomRows(m, act_rows, rng), begin, end};
        c.rows[2] = static_cast<int32_t>(act_rows - 1);
        const std::vector<float> want = RunGemm(Isa::kAvx512Vnni, c, e, act);
        const std::vector<float> got = RunGemm(Isa::kAmxInt8, c, e, act);
        ++cases;
        if (std::memcmp(got.data(), want.data(), got.size() * 4) != 0) {
          ++failures;
          std::printf("FAIL amx_int8 vs avx512_vnni %s\n", Describe(c).c_str());
        }
      }
    }
  }
  std::printf("%s amx_int8 against avx512_vnni: %lld GEMM cases (bit-exact)\n",
              failures ? "FAIL" : "ok", static_cast<long long>(cases));
  return failures;
}
#endif

}  // namespace

int main() {
  const std::vector<Isa>& isas = AvailableIsas();
  // The VNNI loop's prefetch plan follows the maker (w4a8_gemm.h): the test checks this line
  // against /proc/cpuinfo.
  const CpuVendor vendor = DetectedCpuVendor();
  std::printf("cpu vendor: %s\n", vendor == CpuVendor::kAmd     ? "amd"
                                   : vendor == CpuVendor::kIntel ? "intel"
                                                                 : "other");
  std::printf("cpu family: %d\n", DetectedCpuFamily());  // the AVX2 loop's plan on AMD
  std::vector<Tally> tallies(isas.size());
  CheckGemms(isas, tallies);
  CheckMoe(isas, tallies);
  int64_t failures = CheckRowOps(isas);
#if defined(JAX_MOEQ_AMX_EMULATED)
  // The AMX loops on tests/native/amx_emulation.h's scalar tiles, where the CPU has none.
  failures += CheckAmxAgainstVnni();
#elif defined(JAX_MOEQ_X86)
  if (std::find(isas.begin(), isas.end(), Isa::kAmxInt8) != isas.end()) {
    failures += CheckAmxAgainstVnni();
  }
#endif
  for (size_t t = 0; t < isas.size(); ++t) {
    const Tally& tally = tallies[t];
    failures += tally.failures;
    std::printf("%s %s: %lld cases (%lld GEMM, %lld MoE; %s)\n", tally.failures ? "FAIL" : "ok",
                IsaName(isas[t]), static_cast<long long>(tally.gemm_cases + tally.moe_cases),
                static_cast<long long>(tally.gemm_cases), static_cast<long long>(tally.moe_cases),
                Comparison(isas[t]));
  }
  return failures == 0 ? 0 : 1;
}
