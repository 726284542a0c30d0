"""jax_moeq.reference vs slow numpy loops written independently (SPEC §3, §4, §7-9).

Tolerances:
- Bit-exact where both sides do the same float32 operations in the same order
  (int8 activation quantization, rounding to bf16/fp16, a single-group integer GEMM).
- Same-scheme MoE vs numpy (SPEC §9): relative Frobenius error <= 1e-4 in float32, <= 1e-2 in
  bf16/fp16. The numpy loop sums groups / products in another order (float64), which moves
  float32 results by ulps and, rarely, flips an int8 or bf16 rounding of an intermediate.
- Unquantized float MoE vs float64 numpy: 1e-5 in float32 (GEMM sums of <= 256 products).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _helpers as h
from jax_moeq import reference, routing
from jax_moeq.quant import int4

F32 = np.float32
SAME_SCHEME_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
FLOAT_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


# ------------------------------------------------------------------ numpy loops
def np_moe(x, ids, weights, expert, *, on_input, final="slot_rounded"):
  """Slow per-(token, slot) MoE. expert(e, a_f32) -> y2 float (not rounded)."""
  dtype = x.dtype
  x = np.asarray(x, F32)
  ids, weights = np.asarray(ids), np.asarray(weights, F32)
  t_count, k_count = ids.shape
  out = np.zeros(x.shape, F32)
  for t in range(t_count):
    acc = np.zeros(x.shape[1], F32)
    for k in range(k_count):
      a = x[t][None]
      if on_input:
        a = h.np_round(a * weights[t, k], dtype)
      y2 = np.asarray(expert(int(ids[t, k]), a, weights[t, k]), F32)[0]
      if final == "slot_rounded":  # SPEC §4: v = round(y2 * w), acc = round(acc + v)
        v = h.np_round(y2, dtype)
        if not on_input:
          v = h.np_round(v * weights[t, k], dtype)
        acc = h.np_round(acc + v, dtype)
      else:  # WNA16: y2 already weighted and rounded; sum in f32, round once
        acc = acc + y2
    out[t] = acc if final == "slot_rounded" else h.np_round(acc, dtype)
  return out


def np_w4a8_expert(p, group_size, kind, dtype):
  def expert(e, a, _):
    b13 = None if p["w13_bias"] is None else np.asarray(p["w13_bias"])[e]
    b2 = None if p["w2_bias"] is None else np.asarray(p["w2_bias"])[e]
    y13 = h.np_round(h.np_w4a8_linear(a, np.asarray(p["w13_q"])[e],
                                      np.asarray(p["w13_scale"], F32)[e], group_size, b13), dtype)
    act = h.np_round(h.np_activation(y13, kind), dtype)
    return h.np_w4a8_linear(act, np.asarray(p["w2_q"])[e], np.asarray(p["w2_scale"], F32)[e],
                            group_size, b2)
  return expert


def np_float_expert(w13, w2, b13, b2, kind, dtype):
  w13, w2 = np.asarray(w13, np.float64), np.asarray(w2, np.float64)

  def expert(e, a, _):
    y13 = a.astype(np.float64) @ w13[e].T
    if b13 is not None:
      y13 = y13 + np.asarray(b13, np.float64)[e]
    act = h.np_round(h.np_activation(h.np_round(y13, dtype), kind), dtype)
    y2 = act.astype(np.float64) @ w2[e].T
    return y2 if b2 is None else y2 + np.asarray(b2, np.float64)[e]
  return expert


def np_dequant(q, scale, zeros, g_idx, group, dtype):
  """[N, K] -> round_dtype((q - z) * s) with s = scale[n, g_idx[k]]."""
  k = q.shape[1]
  gi = np.arange(k) // group if g_idx is None else np.asarray(g_idx)
  s = np.asarray(scale, F32)[:, gi]
  v = np.asarray(q, F32)
  if zeros is not None:
    v = v - np.asarray(zeros, F32)[:, gi]
  return h.np_round(v * s, dtype)


def np_wna16_expert(p, group, kind, dtype, on_input):
  def expert(e, a, w):
    pick = lambda name: None if p.get(name) is None else np.asarray(p[name])[e]
    w13 = np_dequant(np.asarray(p["w13_q"])[e], np.asarray(p["w13_scale"], F32)[e],
                     pick("w13_zeros"), pick("w13_g_idx"), group, dtype)
    y13 = a.astype(np.float64) @ w13.T.astype(np.float64)
    if p.get("w13_bias") is not None:
      y13 = y13 + np.asarray(p["w13_bias"], np.float64)[e]
    act = h.np_round(h.np_activation(h.np_round(y13, dtype), kind), dtype)
    w2 = np_dequant(np.asarray(p["w2_q"])[e], np.asarray(p["w2_scale"], F32)[e],
                    pick("w2_zeros"), pick("w2_g_idx"), group, dtype)
    y2 = act.astype(np.float64) @ w2.T.astype(np.float64)
    if p.get("w2_bias") is not None:
      y2 = y2 + np.asarray(p["w2_bias"], np.float64)[e]
    if not on_input:
      y2 = F32(y2) * F32(w)
    return h.np_round(y2, dtype)
  return expert


def jit_w4a8(*args, **kwargs):
  f = jax.jit(reference.fused_moe_w4a8, static_argnums=7,
              static_argnames=("apply_router_weight_on_input", "activation_kind"))
  return f(*args, **kwargs)


# ------------------------------------------------------------------ rounding, activation
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_round_to_dtype_matches_casts(dtype):
  rng = np.random.default_rng(0)
  v = (rng.standard_normal(20000) * np.exp(rng.uniform(-22, 10, 20000))).astype(F32)
  v = np.concatenate([v, F32([0.0, -0.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 6.1e-5, 65504.0])])
  got = np.asarray(jax.jit(reference.round_to_dtype, static_argnums=1)(v, dtype))
  np.testing.assert_array_equal(got, h.np_round(v, dtype))


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_apply_activation(kind):
  y13 = np.random.default_rng(1).standard_normal((4, 64)).astype(F32) * 6
  got = np.asarray(reference.apply_activation(jnp.asarray(y13), kind))
  np.testing.assert_allclose(got, h.np_activation(y13, kind), rtol=2e-6, atol=1e-6)
  with pytest.raises(ValueError, match="activation_kind=3"):
    reference.apply_activation(jnp.asarray(y13), 3)


# ------------------------------------------------------------------ int8 activations
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantize_activations_bit_exact(dtype):
  rng = np.random.default_rng(2)
  rows = [rng.standard_normal(256) * 10.0**rng.uniform(-3, 3) for _ in range(40)]
  rows += [np.abs(rng.standard_normal(256)), -np.abs(rng.standard_normal(256)),
           np.zeros(256), np.eye(1, 256, 7)[0] * 3.0, np.full(256, -2.5)]
  x = jnp.asarray(np.stack(rows), dtype)
  qa, scale, zp = jax.jit(reference.quantize_activations_int8)(x)
  want = h.np_quantize_act_int8(np.asarray(x, F32))
  assert qa.dtype == jnp.int8 and scale.dtype == jnp.float32 and zp.dtype == jnp.int32
  assert qa.shape == x.shape and scale.shape == zp.shape == (x.shape[0],)
  for got, w in zip((qa, scale, zp), want):
    np.testing.assert_array_equal(np.asarray(got), w)
  np.testing.assert_array_equal(np.asarray(qa[-3]), 0)  # empty range: zeros, scale 0, zp 0
  assert float(scale[-3]) == 0 and int(zp[-3]) == 0


def test_quantize_activations_rounds_half_to_even():
  # rmin = 0, rmax = 255: scale 1, inv 1, zp = -128; ties at .5 go to the even integer.
  x = jnp.asarray([[255.0, 2.5, 3.5, 0.5, 1.5, 0.0]], jnp.float32)
  qa, scale, zp = reference.quantize_activations_int8(x)
  assert float(scale[0]) == 1.0 and int(zp[0]) == -128
  np.testing.assert_array_equal(np.asarray(qa[0]), np.array([255, 2, 4, 0, 2, 0]) - 128)


# ------------------------------------------------------------------ W4A8 GEMM
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_w4a8_linear_matches_integer_numpy(group_size):
  rng = np.random.default_rng(3)
  n, k = 48, 256
  p = h.random_int4_experts(rng, 1, n // 2, k, group_size, bias=True)
  q, s, bias = p["w13_q"][0], p["w13_scale"][0], p["w13_bias"][0]
  x = jnp.asarray(rng.standard_normal((2, 5, k)), jnp.float32)
  got = jax.jit(reference.w4a8_linear, static_argnums=3)(x, q, s, group_size, bias)
  assert got.shape == (2, 5, n) and got.dtype == jnp.float32
  want = h.np_w4a8_linear(np.asarray(x).reshape(10, k), q, np.asarray(s, F32), group_size,
                          bias).reshape(2, 5, n)
  # Integer group sums are exact; float32 across <= 8 groups and the scale products: ~1e-7.
  assert h.rel_err(got, want) < 1e-6


def test_w4a8_linear_exact_beyond_float32_integers():
  """Channel-wise K = 16384 with sums ~3e7 > 2**24: partial sums must stay exact integers."""
  k = 16384
  a = np.where(np.arange(k) % 2 == 0, 255.0, 253.0).astype(F32)  # qa - zp = 255 / 253
  q = np.where((np.arange(k) % 3 == 0) | (np.arange(k) == 1), -7, -8).astype(np.int8)[None]
  got = reference.w4a8_linear(jnp.asarray(a[None]), jnp.asarray(q), jnp.ones((1, 1)), -1)
  qa, s, zp = h.np_quantize_act_int8(a[None])
  assert int(zp[0]) == -128 and float(s[0]) == 1.0
  exact = int(((qa.astype(np.int64) - zp[0]) * q.astype(np.int64)).sum())
  assert abs(exact) > 2**24 and exact % 2  # not a float32 integer beyond 2**24 by accident
  assert float(got[0, 0]) == float(F32(exact))


def test_w4a8_linear_rejects_bad_input():
  q = jnp.ones((8, 64), jnp.int8)
  with pytest.raises(TypeError, match="q_w must be int8"):
    reference.w4a8_linear(jnp.ones((2, 64)), q.astype(jnp.int32), jnp.ones((8, 2)), 32)
  with pytest.raises(ValueError, match="w_scale must have shape"):
    reference.w4a8_linear(jnp.ones((2, 64)), q, jnp.ones((8, 1)), 32)
  with pytest.raises(ValueError, match="q_w has K=64"):
    reference.w4a8_linear(jnp.ones((2, 32)), q, jnp.ones((8, 2)), 32)
  with pytest.raises(ValueError, match="group_size=48"):
    reference.w4a8_linear(jnp.ones((2, 64)), q, jnp.ones((8, 2)), 48)
  with pytest.raises(TypeError, match="floating point"):
    reference.quantize_activations_int8(jnp.ones((2, 64), jnp.int32))


# ------------------------------------------------------------------ fused W4A8 MoE
_W4A8_CASES = [
    # dtype, group_size, kind, on_input, bias, T, E, K
    (jnp.float32, 32, 0, False, True, 5, 4, 2),
    (jnp.bfloat16, 64, 1, False, False, 7, 8, 3),
    (jnp.float16, 128, 2, True, True, 4, 4, 4),
    (jnp.float32, -1, 1, True, False, 6, 8, 2),
    (jnp.bfloat16, -1, 0, False, True, 3, 2, 1),
    (jnp.float16, 32, 0, False, False, 9, 6, 2),
]


@pytest.mark.parametrize("case", _W4A8_CASES)
def test_fused_moe_w4a8_matches_numpy_loop(case):
  dtype, group_size, kind, on_input, bias, T, E, K = case
  H, I = 128, 128
  rng = np.random.default_rng(hash(case) % 2**32)
  p = h.random_int4_experts(rng, E, I, H, group_size, bias=bias)
  ids, weights = h.random_routing(rng, T, E, K)
  x = jnp.asarray(rng.standard_normal((T, H)), dtype)
  got = jit_w4a8(x, ids, weights, p["w13_q"], p["w13_scale"], p["w2_q"], p["w2_scale"],
                 group_size, w13_bias=p["w13_bias"], w2_bias=p["w2_bias"],
                 apply_router_weight_on_input=on_input, activation_kind=kind)
  assert got.dtype == dtype and got.shape == (T, H)
  want = np_moe(x, ids, weights, np_w4a8_expert(p, group_size, kind, dtype), on_input=on_input)
  assert np.linalg.norm(want) > 0
  assert h.rel_err(got, want) <= SAME_SCHEME_TOL[dtype]


def test_fused_moe_w4a8_jit_equals_eager_and_int64_ids():
  rng = np.random.default_rng(4)
  p = h.random_int4_experts(rng, 4, 64, 128, 64)
  ids, weights = h.random_routing(rng, 6, 4, 2)
  x = jnp.asarray(rng.standard_normal((6, 128)), jnp.bfloat16)
  args = (p["w13_q"], p["w13_scale"], p["w2_q"], p["w2_scale"], 64)
  eager = reference.fused_moe_w4a8(x, np.asarray(ids, np.int64), weights, *args)
  jitted = jit_w4a8(x, ids, weights, *args)
  np.testing.assert_array_equal(np.asarray(eager, F32), np.asarray(jitted, F32))


def test_fused_moe_w4a8_vs_dequantized_float_moe():
  """Same dequantized weights, float activations: only the two int8 activation quantizations
  differ. Per-token int8 over a Gaussian row's range (~±3.5σ) has a step ~7σ/255 and rms error
  ~0.8 % of σ per GEMM input, ~1-2 % in all; 5 % would be a visible bug (a wrong zero point or
  scale gives O(1)). Against the original float weights int4 adds ~10 % per GEMM (SPEC §9)."""
  rng = np.random.default_rng(5)
  E, K, T, H, I = 8, 2, 32, 256, 128
  w13 = jnp.asarray(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(I), jnp.float32)
  q13, s13 = int4.quantize_int4(w13, 64)
  q2, s2 = int4.quantize_int4(w2, 64)
  ids, weights = h.random_routing(rng, T, E, K)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  got = reference.fused_moe_w4a8(x, ids, weights, q13, s13, q2, s2, 64)
  deq = reference.fused_moe_float(x, ids, weights, int4.dequantize_int4(q13, s13, 64),
                                  int4.dequantize_int4(q2, s2, 64))
  assert h.rel_err(got, deq) < 0.05
  assert h.rel_err(got, reference.fused_moe_float(x, ids, weights, w13, w2)) < 0.25


def test_fused_moe_w4a8_many_blocks_and_skewed_routing():
  """T·K > 64 spreads experts over several blocks; all pairs on one expert fills 3 blocks."""
  rng = np.random.default_rng(6)
  T, E, K, H, I = 70, 4, 2, 64, 64
  p = h.random_int4_experts(rng, E, I, H, 32)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  _, weights = h.random_routing(rng, T, E, K)
  for ids in (h.random_routing(rng, T, E, K)[0], jnp.full((T, K), 2, jnp.int32)):
    got = jit_w4a8(x, ids, weights, p["w13_q"], p["w13_scale"], p["w2_q"], p["w2_scale"], 32)
    want = np_moe(x, ids, weights, np_w4a8_expert(p, 32, 0, jnp.float32), on_input=False)
    assert h.rel_err(got, want) <= SAME_SCHEME_TOL[jnp.float32]


def test_fused_moe_w4a8_zero_tokens():
  p = h.random_int4_experts(np.random.default_rng(7), 2, 32, 64, 32)
  out = reference.fused_moe_w4a8(jnp.ones((0, 64), jnp.bfloat16), jnp.zeros((0, 2), jnp.int32),
                                 jnp.zeros((0, 2)), p["w13_q"], p["w13_scale"], p["w2_q"],
                                 p["w2_scale"], 32)
  assert out.shape == (0, 64) and out.dtype == jnp.bfloat16


@pytest.fixture(scope="module")
def small():
  rng = np.random.default_rng(8)
  p = h.random_int4_experts(rng, 4, 32, 64, 32)
  ids, weights = h.random_routing(rng, 3, 4, 2)
  return dict(x=jnp.asarray(rng.standard_normal((3, 64)), jnp.float32), topk_ids=ids,
              topk_weights=weights, w13_q=p["w13_q"], w13_scale=p["w13_scale"], w2_q=p["w2_q"],
              w2_scale=p["w2_scale"], group_size=32)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: {**a, "x": a["x"][0]}, ValueError, "x must be 2-D"),
    (lambda a: {**a, "x": a["x"].astype(jnp.int32)}, TypeError, "x must be float32"),
    (lambda a: {**a, "topk_ids": a["topk_ids"][:2]}, ValueError, "topk_ids must be"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].astype(jnp.float32)}, TypeError, "int32"),
    (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, ValueError, "topk_weights shape"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].at[1, 1].set(4)}, ValueError,
     r"expert id out of range: topk_ids\[1, 1\] = 4"),
    (lambda a: {**a, "w13_q": a["w13_q"].astype(jnp.int32)}, TypeError, "w13_q must be int8"),
    (lambda a: {**a, "w2_q": a["w2_q"][:3]}, ValueError, "w2_q must have shape"),
    (lambda a: {**a, "w13_scale": a["w13_scale"][..., :1]}, ValueError, "w13_scale must have"),
    (lambda a: {**a, "group_size": 48}, ValueError, "group_size=48"),
    (lambda a: {**a, "group_size": 64}, ValueError, "does not divide the input size 32"),
    (lambda a: {**a, "activation_kind": 3}, ValueError, "activation_kind=3"),
    (lambda a: {**a, "w2_bias": jnp.zeros((4, 32))}, ValueError, "w2_bias must have shape"),
    (lambda a: {**a, "x": a["x"][:, :32]}, ValueError, "hidden size 32"),
])
def test_fused_moe_w4a8_rejects(small, change, error, match):
  with pytest.raises(error, match=match):
    reference.fused_moe_w4a8(**change(small))


def test_out_of_range_ids_under_jit_contribute_nothing(small):
  ids = small["topk_ids"].at[1, 0].set(17)
  f = jax.jit(reference.fused_moe_w4a8, static_argnums=7)
  got = f(small["x"], ids, small["topk_weights"], small["w13_q"], small["w13_scale"],
          small["w2_q"], small["w2_scale"], 32)
  # Same as dropping the pair: a zero router weight on an in-range expert. The pair sits in
  # another block row, so XLA's float32 GEMMs may differ by an ulp: 1e-6.
  weights = small["topk_weights"].at[1, 0].set(0.0)
  want = f(small["x"], small["topk_ids"], weights, small["w13_q"], small["w13_scale"],
           small["w2_q"], small["w2_scale"], 32)
  assert h.rel_err(got, want) < 1e-6


# ------------------------------------------------------------------ float and ragged_dot
@pytest.mark.parametrize("dtype,on_input,kind,bias", [
    (jnp.float32, False, 0, True), (jnp.bfloat16, True, 1, False), (jnp.float16, False, 2, True)])
def test_fused_moe_float_and_ragged_dot(dtype, on_input, kind, bias):
  rng = np.random.default_rng(9)
  T, E, K, H, I = 40, 6, 3, 64, 96
  w13 = jnp.asarray(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H), dtype)
  w2 = jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(I), dtype)
  b13 = jnp.asarray(rng.standard_normal((E, 2 * I)) * 0.1, jnp.float32) if bias else None
  b2 = jnp.asarray(rng.standard_normal((E, H)) * 0.1, jnp.float32) if bias else None
  ids, weights = h.random_routing(rng, T, E, K)
  x = jnp.asarray(rng.standard_normal((T, H)), dtype)
  kw = dict(w13_bias=b13, w2_bias=b2, apply_router_weight_on_input=on_input,
            activation_kind=kind)
  static = ("apply_router_weight_on_input", "activation_kind")
  got = jax.jit(reference.fused_moe_float, static_argnames=static)(x, ids, weights, w13, w2, **kw)
  ragged = jax.jit(reference.fused_moe_ragged_dot, static_argnames=static)(
      x, ids, weights, w13, w2, **kw)
  want = np_moe(x, ids, weights, np_float_expert(w13, w2, b13, b2, kind, dtype),
                on_input=on_input)
  assert got.dtype == ragged.dtype == dtype
  assert h.rel_err(got, want) <= FLOAT_TOL[dtype]
  assert h.rel_err(ragged, want) <= FLOAT_TOL[dtype]


# ------------------------------------------------------------------ WNA16
@pytest.mark.parametrize("dtype,group_size,zeros,act_order,bias,on_input", [
    (jnp.bfloat16, 32, False, False, False, False),
    (jnp.float16, 64, True, False, True, False),
    (jnp.bfloat16, 128, False, True, True, True),
    (jnp.float16, -1, True, False, False, True),
    (jnp.float32, 32, True, True, False, False),
])
def test_fused_moe_wna16_matches_numpy_loop(dtype, group_size, zeros, act_order, bias, on_input):
  rng = np.random.default_rng(10)
  T, E, K, H, I = 6, 4, 2, 128, 128
  p = {}
  for name, (n, k) in (("w13", (2 * I, H)), ("w2", (H, I))):
    g = k if group_size == -1 else group_size
    if zeros:
      p[f"{name}_q"] = jnp.asarray(rng.integers(0, 16, (E, n, k)), jnp.int8)
      p[f"{name}_zeros"] = jnp.asarray(rng.integers(4, 12, (E, n, k // g)), jnp.int8)
    else:
      p[f"{name}_q"] = jnp.asarray(rng.integers(-8, 8, (E, n, k)), jnp.int8)
    scale_dtype = jnp.float16 if dtype == jnp.float16 else jnp.bfloat16
    p[f"{name}_scale"] = jnp.asarray(rng.uniform(0.5, 1.5, (E, n, k // g)) / (4 * np.sqrt(k)),
                                     scale_dtype)
    if act_order:  # each input channel in a random group, every group used g times
      p[f"{name}_g_idx"] = jnp.asarray(
          np.stack([rng.permutation(np.arange(k) // g) for _ in range(E)]), jnp.int32)
    if bias:
      p[f"{name}_bias"] = jnp.asarray(rng.standard_normal((E, n)) * 0.1, jnp.float32)
  ids, weights = h.random_routing(rng, T, E, K)
  x = jnp.asarray(rng.standard_normal((T, H)), dtype)
  got = reference.fused_moe_wna16(x, ids, weights, group_size=group_size,
                                  apply_router_weight_on_input=on_input, **p)
  want = np_moe(x, ids, weights, np_wna16_expert(p, 128 if group_size == -1 else group_size, 0,
                                                 dtype, on_input), on_input=on_input, final="sum")
  assert got.dtype == dtype
  assert h.rel_err(got, want) <= SAME_SCHEME_TOL[dtype]


def test_fused_moe_wna16_trivial_g_idx_and_float_agreement():
  rng = np.random.default_rng(11)
  T, E, K, H, I, g = 5, 4, 2, 128, 64, 32
  p = h.random_int4_experts(rng, E, I, H, g)
  ids, weights = h.random_routing(rng, T, E, K)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  args = (x, ids, weights, p["w13_q"], p["w13_scale"], p["w2_q"], p["w2_scale"], g)
  base = reference.fused_moe_wna16(*args)
  g_idx13 = jnp.tile(jnp.arange(H) // g, (E, 1))
  g_idx2 = jnp.tile(jnp.arange(I) // g, (E, 1))
  np.testing.assert_array_equal(
      np.asarray(base), np.asarray(reference.fused_moe_wna16(*args, w13_g_idx=g_idx13,
                                                             w2_g_idx=g_idx2)))
  # In float32 the roundings are exact: the float MoE on the dequantized weights.
  float_moe = reference.fused_moe_float(x, ids, weights,
                                        int4.dequantize_int4(p["w13_q"], p["w13_scale"], g),
                                        int4.dequantize_int4(p["w2_q"], p["w2_scale"], g))
  assert h.rel_err(base, float_moe) < 1e-5


def test_fused_moe_wna16_rejects():
  q = jnp.ones((2, 64, 64), jnp.int8)
  s = jnp.ones((2, 64, 2), jnp.bfloat16)
  q2, s2 = jnp.ones((2, 64, 32), jnp.int8), jnp.ones((2, 64, 1), jnp.bfloat16)
  x, ids, w = jnp.ones((3, 64)), jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1))
  with pytest.raises(ValueError, match="w13_zeros must have shape"):
    reference.fused_moe_wna16(x, ids, w, q, s, q2, s2, 32, w13_zeros=jnp.ones((2, 64, 1)))
  with pytest.raises(ValueError, match="w2_g_idx must have shape"):
    reference.fused_moe_wna16(x, ids, w, q, s, q2, s2, 32, w2_g_idx=jnp.zeros((2, 64), jnp.int32))
  with pytest.raises(ValueError, match="w2_scale must have shape"):
    reference.fused_moe_wna16(x, ids, w, q, s, q2, s, 32)


# ------------------------------------------------------------------ MxInt4
def test_fused_moe_mxint4_routes_and_shards():
  rng = np.random.default_rng(12)
  T, E, K, H, I = 9, 8, 2, 64, 64
  p = h.random_int4_experts(rng, E, I, H, 32)
  logits = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  weights = (p["w13_q"], p["w13_scale"], p["w2_q"], p["w2_scale"])
  method = routing.RoutingMethodType.Renormalize
  f = jax.jit(reference.fused_moe_mxint4, static_argnames=(
      "top_k", "routing_method", "local_expert_offset", "local_num_experts"))
  full = f(x, logits, *weights, top_k=K, routing_method=method)
  rw, ids = routing.route(logits, K, method)
  np.testing.assert_array_equal(
      np.asarray(full), np.asarray(reference.fused_moe_wna16(x, ids, rw, *weights, 32)))
  # Expert parallelism: each shard computes only its experts; the shards sum to the whole
  # (float32: the per-slot terms are the same numbers, summed in another grouping, ~1 ulp).
  shards = [f(x, logits, *(w[4 * r:4 * r + 4] for w in weights), top_k=K, routing_method=method,
              local_expert_offset=4 * r, local_num_experts=4) for r in range(2)]
  assert h.rel_err(shards[0] + shards[1], full) < 1e-6
  assert h.rel_err(shards[0], full) > 0.1  # each shard misses real work
  bf16 = f(x.astype(jnp.bfloat16), logits, *weights, top_k=K, routing_method=method)
  assert bf16.dtype == jnp.bfloat16 and h.rel_err(bf16, full) < 1e-2
  with pytest.raises(ValueError, match="not inside the 8 routed experts"):
    reference.fused_moe_mxint4(x, logits, *(w[:4] for w in weights), top_k=K,
                               routing_method=method, local_expert_offset=6)
  with pytest.raises(ValueError, match="local_num_experts=3"):
    reference.fused_moe_mxint4(x, logits, *weights, top_k=K, routing_method=method,
                               local_num_experts=3)
