// The SIMD row stages (w4a8_rows.h) written once over a vector of floats. Each ISA's file
// (w4a8_rows_avx2.cc, w4a8_rows_avx512.cc) defines its vector ops V and instantiates
// SimdRowOps<V>(); the float operations are the portable ones in the same order, except exp,
// a polynomial within ~2 ulp of std::exp, so that every SIMD width gives the same bits.
//
// Included only by those files, each compiled for its own ISA: everything here has internal
// linkage, so no instantiation is shared across translation units built for other ISAs.
//
// V provides, for V::Float (V::kLanes floats) and V::Int (as many int32):
//   Load, Store, Set, Add, Sub, Mul, Div, Min, Max (the second operand when either is NaN),
//   Fmadd(a, b, c) = a * b + c and Fnmadd(a, b, c) = c - a * b (fused), RoundNearest,
//   Scale2(p, n) = p * 2^n rounded once (n integer-valued, |n| <= 150), RoundBf16, RoundF16,
//   LoadBf16 / LoadF16 (kLanes halves to floats), StoreBf16 / StoreF16 (floats already of the
//   type to kLanes halves), NonFinite (an accumulator: Flags, NoFlags, OrNonFinite, AnyFlag),
//   ReduceMin, ReduceMax, ToInt (round to nearest even, as MXCSR's default),
//   AddI, MinI, MaxI, SetI, ReduceAddI, StoreInt8 (kLanes values already in [-128, 127]).
#pragma once

#include <cstdint>
#include <limits>

#include "cpu/dtype_convert.h"
#include "cpu/w4a8_rows.h"

namespace jax_moeq::cpu {
namespace {  // internal linkage: one copy per ISA's translation unit

template <class V>
struct SimdRows {
  using F = typename V::Float;
  static constexpr int kLanes = V::kLanes;

  static F RoundTo16(ElementType t, F v) {
    switch (t) {
      case ElementType::kBF16: return V::RoundBf16(v);
      case ElementType::kF16: return V::RoundF16(v);
      default: return v;
    }
  }

  // exp(x): x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor for e^r, then p * 2^n.
  static F Exp(F x) {
    x = V::Max(V::Min(x, V::Set(100.0f)), V::Set(-100.0f));
    const F n = V::RoundNearest(V::Mul(x, V::Set(1.44269504088896341f)));
    F r = V::Fnmadd(n, V::Set(0.693145751953125f), x);
    r = V::Fnmadd(n, V::Set(1.428606765330187045e-06f), r);
    F p = V::Set(1.0f / 5040);
    p = V::Fmadd(p, r, V::Set(1.0f / 720));
    p = V::Fmadd(p, r, V::Set(1.0f / 120));
    p = V::Fmadd(p, r, V::Set(1.0f / 24));
    p = V::Fmadd(p, r, V::Set(1.0f / 6));
    p = V::Fmadd(p, r, V::Set(0.5f));
    p = V::Fmadd(p, r, V::Set(1.0f));
    p = V::Fmadd(p, r, V::Set(1.0f));
    return V::Scale2(p, n);
  }

  static F Sigmoid(F v) {
    const F one = V::Set(1.0f);
    return V::Div(one, V::Add(one, Exp(V::Sub(V::Set(0.0f), v))));
  }

  static void Load(ElementType t, const void* base, int64_t row, int64_t n, float* dst) {
    if (t == ElementType::kF32) {
      const float* src = static_cast<const float*>(base) + row * n;
      for (int64_t i = 0; i < n; i += kLanes) V::Store(dst + i, V::Load(src + i));
      return;
    }
    const uint16_t* src = static_cast<const uint16_t*>(base) + row * n;
    for (int64_t i = 0; i < n; i += kLanes) {
      V::Store(dst + i, t == ElementType::kBF16 ? V::LoadBf16(src + i) : V::LoadF16(src + i));
    }
  }

  static void Store(ElementType t, const float* src, int64_t n, void* base, int64_t row) {
    if (t == ElementType::kF32) {
      float* dst = static_cast<float*>(base) + row * n;
      for (int64_t i = 0; i < n; i += kLanes) V::Store(dst + i, V::Load(src + i));
      return;
    }
    uint16_t* dst = static_cast<uint16_t*>(base) + row * n;
    for (int64_t i = 0; i < n; i += kLanes) {
      const F v = V::Load(src + i);
      if (t == ElementType::kBF16) {
        V::StoreBf16(dst + i, V::RoundBf16(v));
      } else {
        V::StoreF16(dst + i, v);
      }
    }
  }

  static void ScaleRound(ElementType t, float scale, float* v, int64_t n) {
    const F s = V::Set(scale);
    for (int64_t i = 0; i < n; i += kLanes) {
      V::Store(v + i, RoundTo16(t, V::Mul(V::Load(v + i), s)));
    }
  }

  static void Activate(ElementType t, ActivationKind kind, float* gate, float* up, int64_t n,
                       float* out) {
    for (int64_t i = 0; i < n; i += kLanes) {
      const F g = RoundTo16(t, V::Load(gate + i));
      const F u = RoundTo16(t, V::Load(up + i));
      F a;
      if (kind == ActivationKind::kSwigluOai) {
        // Min / Max return the second operand when either is NaN: the value goes second, so a
        // NaN passes through as in the portable std::min(g, 7) / std::max(std::min(u, 7), -7).
        const F gc = V::Min(V::Set(7.0f), g);
        const F uc = V::Max(V::Set(-7.0f), V::Min(V::Set(7.0f), u));
        const F glu = V::Mul(gc, Sigmoid(V::Mul(V::Set(1.702f), gc)));
        a = V::Mul(V::Add(uc, V::Set(1.0f)), glu);
      } else {
        a = V::Mul(V::Mul(g, Sigmoid(g)), u);
      }
      V::Store(out + i, RoundTo16(t, a));
    }
  }

  static void Quantize(const float* x, int64_t k, int64_t group, int8_t* q, float* scale,
                       int32_t* zero_point, int32_t* sum8) {
    F vmin = V::Set(0.0f), vmax = V::Set(0.0f);
    typename V::Flags nonfinite = V::NoFlags();
    for (int64_t i = 0; i < k; i += kLanes) {
      const F v = V::Load(x + i);
      vmin = V::Min(vmin, v);
      vmax = V::Max(vmax, v);
      nonfinite = V::OrNonFinite(nonfinite, v);
    }
    const bool finite = !V::AnyFlag(nonfinite);
    const float rmin = V::ReduceMin(vmin), rmax = V::ReduceMax(vmax);
    const int64_t groups = k / group;
    float inv;
    int32_t zp;
    if (!finite || !QuantizationParams(rmin, rmax, scale, &inv, &zp)) {
      // A row holding NaN or +-Inf gets scale NaN, so that every output of the row is NaN.
      if (!finite) *scale = std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = 0; i < k; ++i) q[i] = 0;
      for (int64_t gi = 0; gi < groups; ++gi) sum8[gi] = 0;
      *zero_point = 0;
      return;
    }
    const F vinv = V::Set(inv);
    const auto vzp = V::SetI(zp), lo = V::SetI(-128), hi = V::SetI(127);
    for (int64_t gi = 0; gi < groups; ++gi) {
      auto sum = V::SetI(0);
      for (int64_t i = gi * group; i < (gi + 1) * group; i += kLanes) {
        const auto v = V::MinI(V::MaxI(V::AddI(V::ToInt(V::Mul(V::Load(x + i), vinv)), vzp), lo),
                               hi);
        V::StoreInt8(q + i, v);
        sum = V::AddI(sum, v);
      }
      sum8[gi] = 8 * V::ReduceAddI(sum);
    }
    *zero_point = zp;
  }

  static void Accumulate(ElementType t, const float* y, float w, bool weighted, float* acc,
                         int64_t n) {
    const F vw = V::Set(w);
    for (int64_t i = 0; i < n; i += kLanes) {
      F v = RoundTo16(t, V::Load(y + i));
      if (weighted) v = RoundTo16(t, V::Mul(v, vw));
      V::Store(acc + i, RoundTo16(t, V::Add(V::Load(acc + i), v)));
    }
  }
};

template <class V>
const RowOps& SimdRowOps() {
  using R = SimdRows<V>;
  static const RowOps ops{R::Load, R::Store, R::ScaleRound, R::Activate, R::Quantize,
                          R::Accumulate};
  return ops;
}

}  // namespace
}  // namespace jax_moeq::cpu
