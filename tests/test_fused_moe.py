"""`jax_moeq.fused_moe` on float and W4A8 weights, the weight containers, and the W4A8 experts
classes (tests/test_dispatch.py runs the weight-only schemes and the dispatch itself).

Tolerances (SPEC §9): the CPU kernel vs the same-scheme jnp reference, relative Frobenius error
<= 1e-4 in float32 and <= 1e-2 in bfloat16/float16 (only rare int8 rounding flips differ).
The REFERENCE backend runs the very reference it is compared with, on identical values, so it
must agree exactly. The float path (float32 GEMMs, float32 rounding points) vs a float64 numpy
MoE: float32 rounding of sums of ~H products, relative error ~1e-6; bound 1e-5.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import _ffi, reference, routing
from jax_moeq.experts.cpu_int4 import CPUExpertsInt4
from jax_moeq.experts.reference import ReferenceExpertsW4A8
from jax_moeq.fused_moe import fused_moe
from jax_moeq.oracle import base
from jax_moeq.oracle.w4a8_int8 import make_w4a8_int8_moe_quant_config
from jax_moeq.weights import (
    FloatMoEWeights, Int4MoEWeights, W4A8PackedWeights, pack_w4a8, quantize_moe_weights,
    unpack_w4a8,
)

# These tests expect the CPU's backends and float32 GEMMs in float32; the GPU cases of the same
# route are in tests/test_dispatch.py. On a GPU machine run them with JAX_PLATFORMS=cpu.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="CPU backend expectations (run with JAX_PLATFORMS=cpu)")

needs_cpu_library = pytest.mark.skipif(not _ffi.cpu_library_available(),
                                       reason="jax_moeq CPU library not built")
E, K, H, I = 8, 2, 128, 128
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
ACTIVATION_KIND = {"silu": 2, "swiglu": 0, "swigluoai": 1}


@pytest.fixture(autouse=True)
def _fresh_log_once():
  base._LOGGED.clear()
  yield


def rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def float_weights(seed, *, bias=False, e=E, h=H, i=I) -> FloatMoEWeights:
  rng = np.random.default_rng(seed)
  w13 = rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)
  w2 = rng.standard_normal((e, h, i)) / np.sqrt(i)
  b13 = rng.standard_normal((e, 2 * i)) * 0.1 if bias else None
  b2 = rng.standard_normal((e, h)) * 0.1 if bias else None
  f32 = lambda v: None if v is None else jnp.asarray(v, jnp.float32)
  return FloatMoEWeights(f32(w13), f32(w2), f32(b13), f32(b2))


def inputs(seed, t, dtype, *, e=E, h=H):
  rng = np.random.default_rng(seed + 1000)
  x = jnp.asarray(rng.standard_normal((t, h)), dtype)
  logits = jnp.asarray(rng.standard_normal((t, e)) * 2, jnp.float32)
  return x, logits


def w4a8_reference(x, logits, q: Int4MoEWeights, *, top_k=K, activation="silu",
                   apply_router_weight_on_input=False, **route):
  route.setdefault("renormalize", True)
  topk_weights, topk_ids = routing.select_experts(logits, top_k, **route)
  return reference.fused_moe_w4a8(
      x, topk_ids, topk_weights, q.w13_q, q.w13_scale, q.w2_q, q.w2_scale, q.group_size,
      w13_bias=q.w13_bias, w2_bias=q.w2_bias,
      apply_router_weight_on_input=apply_router_weight_on_input,
      activation_kind=ACTIVATION_KIND[activation])


# ------------------------------------------------------------------ W4A8 through the kernel
@needs_cpu_library
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_int4_weights_auto_run_the_kernel(dtype, group_size, caplog):
  q = quantize_moe_weights(float_weights(1), group_size)
  x, logits = inputs(2, 7, dtype)
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    out = fused_moe(x, logits, q, top_k=K)
  assert "Using CPU_INT4 W4A8 Int8 MoE backend" in caplog.text
  assert out.shape == x.shape and out.dtype == dtype
  assert rel(out, w4a8_reference(x, logits, q)) <= TOLERANCE[dtype]


@needs_cpu_library
@pytest.mark.parametrize("activation", ["silu", "swiglu", "swigluoai"])
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("weights_kind", ["int4", "packed"])
def test_w4a8_options(activation, on_input, weights_kind):
  q = quantize_moe_weights(float_weights(3, bias=True), 64)
  x, logits = inputs(4, 9, jnp.bfloat16)
  w = q if weights_kind == "int4" else pack_w4a8(q)
  route = dict(renormalize=not on_input, routed_scaling_factor=1.5)
  out = fused_moe(x, logits, w, top_k=K, activation=activation,
                  apply_router_weight_on_input=on_input, **route)
  want = w4a8_reference(x, logits, q, activation=activation,
                        apply_router_weight_on_input=on_input, **route)
  assert rel(out, want) <= TOLERANCE[jnp.bfloat16]


@needs_cpu_library
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_weights_under_jit_with_leading_dims(dtype, caplog):
  q = quantize_moe_weights(float_weights(5), 32)
  packed = pack_w4a8(q)
  x, logits = inputs(6, 6, dtype)
  run = jax.jit(lambda x, l, w: fused_moe(x, l, w, top_k=K))
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    out = run(x.reshape(2, 3, H), logits.reshape(2, 3, E), packed)
    out_again = run(x.reshape(2, 3, H), logits.reshape(2, 3, E), packed)
  assert sum("Using CPU_INT4" in r.message for r in caplog.records) == 1  # traced once, logged once
  assert out.shape == (2, 3, H) and out.dtype == dtype
  want = w4a8_reference(x, logits, q)
  assert rel(out.reshape(6, H), want) <= TOLERANCE[dtype]
  np.testing.assert_array_equal(np.asarray(out_again, np.float32), np.asarray(out, np.float32))
  # One token, and a 1-D x (no leading dims).
  one = fused_moe(x[3], logits[3], packed, top_k=K)
  assert one.shape == (H,)
  assert rel(one, w4a8_reference(x[3:4], logits[3:4], q)[0]) <= TOLERANCE[dtype]


@needs_cpu_library
def test_experts_classes_agree():
  cfg = base.MoEConfig(E, K, H, I, in_dtype=jnp.float32, platform="cpu", has_bias=True)
  qc = make_w4a8_int8_moe_quant_config((1, 128))
  q = quantize_moe_weights(float_weights(7, bias=True), 128)
  x, logits = inputs(8, 5, jnp.float32)
  fast_experts, slow_experts = CPUExpertsInt4(cfg, qc), ReferenceExpertsW4A8(cfg, qc)
  packed = fast_experts.prepare(q)
  assert sorted(packed) == ["w13_packed", "w2_packed"]
  # Already packed weights pass through unchanged.
  np.testing.assert_array_equal(np.asarray(fast_experts.prepare(pack_w4a8(q))["w13_packed"]),
                                np.asarray(packed["w13_packed"]))
  fast = fast_experts.apply(x, logits, packed)
  slow = slow_experts.apply(x, logits, slow_experts.prepare(q))
  assert rel(fast, slow) <= TOLERANCE[jnp.float32]
  # The packed bytes unpack to the canonical weights.
  back = fast_experts.canonical(packed)
  for name in ("w13_q", "w2_q", "w13_scale", "w2_scale", "w13_bias", "w2_bias"):
    np.testing.assert_array_equal(np.asarray(getattr(back, name), np.float32),
                                  np.asarray(getattr(q, name), np.float32), err_msg=name)
  with pytest.raises(ValueError, match=r"needs the prepared arrays \['w13_packed'"):
    fast_experts.apply(x, logits, slow_experts.prepare(q))
  with pytest.raises(ValueError, match="needs the prepared arrays.*w13_q"):
    slow_experts.apply(x, logits, packed)
  with pytest.raises(ValueError, match="group_size=64, the experts were built for group_size=128"):
    fast_experts.prepare(quantize_moe_weights(float_weights(7, bias=True), 64))


# ------------------------------------------------------------------ W4A8 on the reference
@pytest.mark.parametrize("weights_kind", ["int4", "packed"])
@pytest.mark.parametrize("group_size", [32, -1])
def test_reference_backend_is_the_reference(weights_kind, group_size, caplog):
  q = quantize_moe_weights(float_weights(9, bias=True), group_size)
  w = q if weights_kind == "int4" else pack_w4a8(q)
  x, logits = inputs(10, 5, jnp.bfloat16)
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    out = fused_moe(x, logits, w, top_k=K, moe_backend="reference")
  assert "Using REFERENCE W4A8 Int8 MoE backend (moe_backend='reference' was requested)" in caplog.text
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(w4a8_reference(x, logits, q), np.float32))


def test_grouped_routing_falls_back_to_the_reference(caplog):
  # The CPU experts accept only Default / Renormalize / RenormalizeNaive routing (SPEC §5).
  q = quantize_moe_weights(float_weights(11, e=16), 64)
  x, logits = inputs(12, 4, jnp.float32, e=16)
  bias = jnp.asarray(np.random.default_rng(13).standard_normal(16) * 0.1, jnp.float32)
  route = dict(scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=4, topk_group=2,
               e_score_correction_bias=bias, routed_scaling_factor=2.5)
  with caplog.at_level(logging.WARNING, logger="jax_moeq.oracle"):
    out = fused_moe(x, logits, q, top_k=4, **route)
  assert "CPU_INT4" in caplog.text and "routing method DeepSeekV3" in caplog.text
  want = w4a8_reference(x, logits, q, top_k=4, **route)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  with pytest.raises(ValueError, match="CPU_INT4 does not support .* DeepSeekV3"):
    fused_moe(x, logits, q, top_k=4, moe_backend="cpu", **route)


# ------------------------------------------------------------------ float weights
def np_moe(x, logits, w: FloatMoEWeights, top_k, *, activation="silu", renormalize=True,
           on_input=False):
  """float64 numpy MoE (softmax top-k routing, gate rows first)."""
  x = np.asarray(x, np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
  wts = np.take_along_axis(p, ids, -1)
  if renormalize:
    wts /= wts.sum(-1, keepdims=True)
  w13, w2 = np.asarray(w.w13, np.float64), np.asarray(w.w2, np.float64)
  b13 = None if w.w13_bias is None else np.asarray(w.w13_bias, np.float64)
  b2 = None if w.w2_bias is None else np.asarray(w.w2_bias, np.float64)
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for k in range(top_k):
      e = ids[t, k]
      a = x[t] * wts[t, k] if on_input else x[t]
      y13 = w13[e] @ a + (0 if b13 is None else b13[e])
      g, u = y13[:I], y13[I:]
      if activation == "swigluoai":
        g, u = np.minimum(g, 7), np.clip(u, -7, 7)
        act = (u + 1) * g / (1 + np.exp(-1.702 * g))
      else:
        act = g / (1 + np.exp(-g)) * u
      y = w2[e] @ act + (0 if b2 is None else b2[e])
      out[t] += y if on_input else y * wts[t, k]
  return out


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("on_input", [False, True])
def test_float_weights_vs_numpy(activation, bias, on_input, caplog):
  w = float_weights(14, bias=bias)
  x, logits = inputs(15, 6, jnp.float32)
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    out = jax.jit(lambda x, l, w: fused_moe(
        x, l, w, top_k=K, activation=activation, renormalize=not on_input,
        apply_router_weight_on_input=on_input))(x.reshape(2, 3, H), logits.reshape(2, 3, E), w)
  assert "fused_moe runs unquantized weights on backend xla" in caplog.text
  want = np_moe(x, np.asarray(logits, np.float64), w, K, activation=activation,
                renormalize=not on_input, on_input=on_input)
  assert out.shape == (2, 3, H)
  assert rel(out.reshape(6, H), want) <= 1e-5


def test_quantized_is_close_to_float():
  # Sanity bound only (SPEC §9): int4 weights add ~10 % noise per GEMM.
  w = float_weights(16)
  x, logits = inputs(17, 8, jnp.float32)
  out = fused_moe(x, logits, quantize_moe_weights(w, 32), top_k=K)
  assert rel(out, fused_moe(x, logits, w, top_k=K)) <= 0.25


# ------------------------------------------------------------------ containers
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_pack_unpack_round_trip(group_size):
  q = quantize_moe_weights(float_weights(18, bias=True), group_size)
  assert q.w13_q.dtype == jnp.int8 and q.w13_scale.dtype == (
      jnp.float32 if group_size == -1 else jnp.bfloat16)
  packed = jax.jit(pack_w4a8)(q)
  assert isinstance(packed, W4A8PackedWeights) and packed.w13_packed.dtype == jnp.uint8
  assert (packed.hidden_size, packed.intermediate_size, packed.group_size) == (H, I, group_size)
  back = jax.jit(unpack_w4a8)(packed)
  for name in ("w13_q", "w2_q", "w13_scale", "w2_scale", "w13_bias", "w2_bias"):
    np.testing.assert_array_equal(np.asarray(getattr(back, name), np.float32),
                                  np.asarray(getattr(q, name), np.float32), err_msg=name)
  no_bias = dataclasses.replace(q, w13_bias=None, w2_bias=None)
  zeros = unpack_w4a8(pack_w4a8(no_bias))
  assert not np.asarray(zeros.w13_bias).any() and not np.asarray(zeros.w2_bias).any()


def test_containers_are_pytrees_with_static_ints():
  q = quantize_moe_weights(float_weights(19), 64)
  leaves, treedef = jax.tree.flatten(q)
  assert len(leaves) == 4  # q/scale x 2; None biases are empty subtrees
  assert jax.tree.unflatten(treedef, leaves).group_size == 64
  packed = pack_w4a8(q)
  assert len(jax.tree.leaves(packed)) == 2
  assert len(jax.tree.leaves(float_weights(19, bias=True))) == 4
  # group_size is part of the tree structure: different values are different structures.
  other = quantize_moe_weights(float_weights(19), 32)
  assert jax.tree.structure(q) != jax.tree.structure(other)


# ------------------------------------------------------------------ dispatch and errors
def test_weight_subclasses_dispatch_as_their_container():
  @dataclasses.dataclass(frozen=True)
  class Named(FloatMoEWeights):
    pass

  w = float_weights(20)
  x, logits = inputs(21, 4, jnp.float32)
  out = fused_moe(x.reshape(2, 2, H), logits.reshape(2, 2, E), Named(w.w13, w.w2), top_k=K,
                  activation="swigluoai")
  np.testing.assert_array_equal(
      np.asarray(out), np.asarray(fused_moe(x, logits, w, top_k=K, activation="swigluoai")
                                  ).reshape(2, 2, H))


def test_bad_inputs():
  w = float_weights(22)
  q = quantize_moe_weights(w, 32)
  x, logits = inputs(23, 3, jnp.float32)
  with pytest.raises(TypeError, match="weights must be one of .*FloatMoEWeights.*got dict"):
    fused_moe(x, logits, {"w13": w.w13}, top_k=K)
  with pytest.raises(ValueError, match="router_logits must be"):
    fused_moe(x, logits[:2], w, top_k=K)
  with pytest.raises(ValueError, match="activation='relu' is not one of"):
    fused_moe(x, logits, q, top_k=K, activation="relu")
  with pytest.raises(ValueError, match="moe_backend='cpu' is not supported for Unquantized MoE"):
    fused_moe(x, logits, w, top_k=K, moe_backend="cpu")
  with pytest.raises(ValueError, match="moe_backend='marlin' is not supported for W4A8 Int8"):
    fused_moe(x, logits, q, top_k=K, moe_backend="marlin")
  with pytest.raises(NotImplementedError, match="No W4A8 Int8 MoE backend .*GELU"):
    fused_moe(x, logits, q, top_k=K, activation="gelu")
  with pytest.raises(ValueError, match="w2_q must have shape"):
    fused_moe(x, logits, dataclasses.replace(q, w2_q=q.w2_q[:, :, :64]), top_k=K)
  with pytest.raises(ValueError, match="w13_scale must have shape"):
    fused_moe(x, logits, dataclasses.replace(q, w13_scale=q.w13_scale[..., :2]), top_k=K)
  with pytest.raises(TypeError, match="w13_q must be int8"):
    fused_moe(x, logits, dataclasses.replace(q, w13_q=q.w13_q.astype(jnp.int32)), top_k=K)
  packed = pack_w4a8(q)
  with pytest.raises(ValueError, match="w13_packed must be uint8"):
    fused_moe(x, logits, dataclasses.replace(packed, group_size=64), top_k=K)
  with pytest.raises(ValueError, match="top_k=9 exceeds"):
    fused_moe(x, logits, q, top_k=9)
