"""`jax_moeq.nn.QuantizedLinear` and the canonical int4 linear weights against the jnp references
of SPEC §12 (`reference.linear_w4a8`, `reference.linear_wna16`): every backend reachable here, f32
and bf16, jit, nnx.split / merge, fused q/k/v equal to the separate projections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _helpers import np_w4a8_linear, rel_err
from jax_moeq import _ffi, reference
from jax_moeq.linears import (
    Int4LinearWeights, concat_linears, dequantize_linear, quantize_linear)
from jax_moeq.nn import QuantizedLinear, QuantizedWeight

needs_cpu_kernel = pytest.mark.skipif(not _ffi.cpu_library_available(),
                                      reason="the CPU library jax_moeq._cpu_ffi is not built")
DTYPES = [jnp.float32, jnp.bfloat16]


def _weights(rng, n, k, group, *, bias=False, act_order=False, zeros=False):
  """Random int4 weights with scales giving O(1) outputs for unit-normal inputs."""
  g = k if group == -1 else group
  scale = rng.uniform(0.5, 1.5, (n, k // g)) / (8 * np.sqrt(k))
  scale = jnp.asarray(scale, jnp.float32 if group == -1 else jnp.bfloat16)
  lo, hi = (0, 16) if zeros else (-8, 8)
  q = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
  g_idx = jnp.asarray(rng.permutation(np.arange(k) // g), jnp.int32) if act_order else None
  z = jnp.asarray(rng.integers(6, 10, (n, k // g)), jnp.int8) if zeros else None
  b = jnp.asarray(rng.standard_normal(n) * 0.5, jnp.float32) if bias else None
  return Int4LinearWeights(q, scale, group, g_idx=g_idx, zeros=z, bias=b)


def _x(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _assert_kernel_close(got, want, dtype):
  """The CPU kernel against the W4A8 reference: the same int8 activations and exact integer
  group sums, but the kernel folds the zero point in through a per-row correction term
  (docs/design.md), so float32 results differ in the last bits; in bf16 only rare one-ulp
  flips of the final rounding remain (SPEC §9)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if dtype == jnp.float32:
    assert rel_err(got, want) < 1e-6
    return
  assert rel_err(got, want) < 1e-2
  ulp = np.abs(want) * 2.0**-7 + 1e-30
  assert np.all(np.abs(got - want) <= ulp)
  assert np.mean(got != want) < 0.05


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group, bias", [(32, True), (128, False), (-1, True)])
def test_cpu_kernel_matches_the_w4a8_reference(dtype, group, bias):
  rng = np.random.default_rng(group + 3 * bias)
  w = _weights(rng, 96, 256, group, bias=bias)
  layer = QuantizedLinear(256, 96, scheme="w4a8_int8", weights=w, dtype=dtype)
  assert (layer.scheme, layer.backend) == ("w4a8_int8", "cpu_w4a8")
  x = _x(rng, (2, 5, 256), dtype)
  got = layer(x)
  want = reference.linear_w4a8(x, w.q, w.scale, group, w.bias)
  assert got.dtype == jnp.dtype(dtype) and got.shape == (2, 5, 96)
  _assert_kernel_close(got, want, dtype)
  # And SPEC §3 written independently (float64 across groups).
  ind = np_w4a8_linear(np.asarray(x, np.float32).reshape(-1, 256), w.q, w.scale, group, w.bias)
  assert rel_err(np.asarray(got, np.float32).reshape(-1, 96), ind) < (
      1e-6 if dtype == jnp.float32 else 4e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_backends_equal_the_references(dtype):
  rng = np.random.default_rng(11)
  x = _x(rng, (7, 128), dtype)
  w = _weights(rng, 48, 128, 64, bias=True)
  layer = QuantizedLinear(128, 48, scheme="w4a8_int8", weights=w, backend="reference",
                          dtype=dtype)
  assert layer.backend == "reference"
  np.testing.assert_array_equal(np.asarray(layer(x), np.float32), np.asarray(
      reference.linear_w4a8(x, w.q, w.scale, 64, w.bias), np.float32))
  w = _weights(rng, 48, 128, 32, bias=True, act_order=True, zeros=True)
  layer = QuantizedLinear(128, 48, scheme="wna16", weights=w, dtype=dtype)
  assert layer.backend == "reference"
  got = layer(x)
  want = reference.linear_wna16(x, w.q, w.scale, 32, g_idx=w.g_idx, zeros=w.zeros, bias=w.bias)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # Against the float layer of the same weights: one rounding of the output (and of the
  # dequantized weights in bf16) apart.
  dense = np.asarray(x, np.float32) @ np.asarray(dequantize_linear(w)).T + np.asarray(w.bias)
  assert rel_err(np.asarray(got, np.float32), dense) < (1e-6 if dtype == jnp.float32 else 1e-2)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_order_on_the_w4a8_kernel(dtype):
  """GPTQ act-order weights on the W4A8 kernel: inputs sorted by group once, exact."""
  rng = np.random.default_rng(5)
  w = _weights(rng, 64, 256, 64, act_order=True)
  x = _x(rng, (6, 256), dtype)
  fast = QuantizedLinear(256, 64, scheme="wna16", weights=w, dtype=dtype,
                         allow_activation_quantization=True)
  ref = QuantizedLinear(256, 64, scheme="w4a8_int8", weights=w, backend="reference", dtype=dtype)
  assert (fast.backend, ref.backend) == ("cpu_w4a8", "reference")
  got = np.asarray(fast(x), np.float32)
  _assert_kernel_close(got, ref(x), dtype)
  # SPEC §3 with each channel's own group (numpy, channels permuted into group order).
  perm = np.argsort(np.asarray(w.g_idx), kind="stable")
  ind = np_w4a8_linear(np.asarray(x, np.float32)[:, perm], np.asarray(w.q)[:, perm], w.scale, 64)
  assert rel_err(got, ind) < (1e-6 if dtype == jnp.float32 else 4e-3)
  # Within int8-activation noise of the weight-only result (per-row int8: ~0.5 % per GEMM).
  wna16 = QuantizedLinear(256, 64, scheme="wna16", weights=w, dtype=jnp.float32)
  assert rel_err(got, np.asarray(wna16(x.astype(jnp.float32)))) < 2e-2


@pytest.mark.parametrize("scheme, allow", [("w4a8_int8", None), ("wna16", False),
                                           ("wna16", True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qkv_equals_separate_projections(scheme, allow, dtype):
  rng = np.random.default_rng(3)
  parts = [_weights(rng, n, 128, 32, bias=i != 1) for i, n in enumerate((64, 32, 32))]
  fused_w = concat_linears(parts)
  assert fused_w.q.shape == (128, 128) and fused_w.bias.shape == (128,)
  kw = dict(scheme=scheme, dtype=dtype, allow_activation_quantization=allow)
  fused = QuantizedLinear(128, 128, weights=fused_w, **kw)
  separate = [QuantizedLinear(128, p.out_features, weights=p, **kw) for p in parts]
  x = _x(rng, (3, 4, 128), dtype)
  got = np.asarray(fused(x), np.float32)
  want = np.concatenate([np.asarray(s(x), np.float32) for s in separate], axis=-1)
  if fused.backend == "cpu_w4a8":
    # Output rows are independent (per-row activation quantization is shared): bitwise.
    np.testing.assert_array_equal(got, want)
  else:
    # XLA's float32 dot blocks its sums by the output width: last-bit differences only.
    assert fused.backend == "reference"
    assert rel_err(got, want) < (1e-6 if dtype == jnp.float32 else 1e-2)


def test_concat_refuses_incompatible_parts():
  rng = np.random.default_rng(0)
  a, b = _weights(rng, 32, 128, 32), _weights(rng, 32, 128, 64)
  with pytest.raises(ValueError, match="parts\\[1\\] has group_size=64, parts\\[0\\] "
                                       "group_size=32"):
    concat_linears([a, b])
  c, d = (_weights(rng, 32, 128, 32, act_order=True) for _ in range(2))
  with pytest.raises(ValueError, match="different act-order g_idx"):
    concat_linears([c, d])
  with pytest.raises(ValueError, match="parts\\[1\\] has 64 inputs"):
    concat_linears([a, _weights(rng, 32, 64, 32)])
  with pytest.raises(ValueError, match="at least one"):
    concat_linears([])


@pytest.mark.parametrize("scheme", ["w4a8_int8", "wna16"])
def test_jit_and_split_merge_round_trip(scheme):
  rng = np.random.default_rng(8)
  w = np.asarray(rng.standard_normal((64, 128)) * 0.05, np.float32)
  b = np.asarray(rng.standard_normal(64) * 0.1, np.float32)
  layer = QuantizedLinear.from_float(w, b, scheme=scheme, group_size=64, dtype=jnp.bfloat16)
  x = _x(rng, (5, 128), jnp.bfloat16)
  eager = np.asarray(layer(x), np.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda m, v: m(v))(layer, x), np.float32),
                                eager)
  graphdef, state = nnx.split(layer)
  leaves = jax.tree_util.tree_leaves(state)
  assert leaves and not nnx.state(layer, nnx.Param)  # quantized arrays are not trainable params
  assert nnx.state(layer, QuantizedWeight)
  merged = nnx.merge(graphdef, jax.tree.map(lambda a: jnp.array(a), state))
  np.testing.assert_array_equal(np.asarray(merged(x), np.float32), eager)
  # from_float == quantize_linear + the constructor, and within int4 noise of the float layer.
  q = quantize_linear(w, 64, b)
  again = QuantizedLinear(128, 64, scheme=scheme, weights=q, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(again(x), np.float32), eager)
  dense = np.asarray(x, np.float32) @ w.T + b
  # RTN int4 (scale absmax/7.5): ~10 % relative weight noise per GEMM, outputs ~5-10 %.
  assert rel_err(eager, dense) < 0.15


def test_bad_input_is_refused_with_names():
  rng = np.random.default_rng(1)
  w = _weights(rng, 32, 128, 32)
  with pytest.raises(ValueError, match=r"weights are \[32, 128\] \[out, in\]; the layer needs "
                                       r"\[32, 64\]"):
    QuantizedLinear(64, 32, weights=w)
  with pytest.raises(ValueError, match="scheme='int8' is not one of"):
    QuantizedLinear(128, 32, scheme="int8", weights=w)
  layer = QuantizedLinear(128, 32, weights=w, dtype=jnp.float32, backend="reference")
  with pytest.raises(ValueError, match="x must end in in_features=128"):
    layer(jnp.ones((2, 64), jnp.float32))
  with pytest.raises(ValueError, match=r"scale must have shape \(32, 4\)"):
    QuantizedLinear(128, 32, weights=Int4LinearWeights(w.q, w.scale[:, :2], 32))
  with pytest.raises(TypeError, match="q must be int8"):
    QuantizedLinear(128, 32, weights=Int4LinearWeights(w.q.astype(jnp.int32), w.scale, 32))
  with pytest.raises(ValueError, match="group_size=48 is not one of"):
    quantize_linear(np.ones((16, 96), np.float32), 48)
  with pytest.raises(ValueError, match="W4A8 Int8 linear backend CPU_W4A8 does not support"):
    QuantizedLinear(128, 32, weights=w, backend="cpu_w4a8", platform="cuda")


def _gpu_skip_reason() -> str | None:
  from _helpers import cuda_skip_reason
  try:
    from jax_moeq.ops import wna16_linear_gpu
  except ImportError:
    return "the GPU WNA16 linear op is not available"
  return cuda_skip_reason(wna16_linear_gpu.wna16_linear_gpu_available)


@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=_gpu_skip_reason() or "")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("group, bias, act_order, zeros", [(128, True, False, False),
                                                           (64, False, True, False),
                                                           (32, True, False, True),
                                                           (-1, False, False, False)])
def test_marlin_linear_matches_the_wna16_reference(dtype, group, bias, act_order, zeros):
  rng = np.random.default_rng(abs(group) + 2 * act_order + 4 * zeros)
  w = _weights(rng, 192, 256, group, bias=bias, act_order=act_order, zeros=zeros)
  layer = QuantizedLinear(256, 192, scheme="wna16", weights=w, dtype=dtype)
  assert layer.backend == "marlin"
  for rows in (1, 37):
    x = _x(rng, (rows, 256), dtype)
    got = layer(x)
    want = reference.linear_wna16(x, w.q, w.scale, group, g_idx=w.g_idx, zeros=w.zeros,
                                  bias=w.bias)
    assert got.dtype == jnp.dtype(dtype)
    # SPEC §9: 1e-2 in bf16/fp16 (the kernel may fold a group's scale after its sums).
    assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 1e-2
  # Fused q/k/v rows on the GPU: each output row is its own GEMM row.
  parts = [_weights(rng, n, 256, group, bias=bias) for n in (128, 64, 64)]
  fused = QuantizedLinear(256, 256, scheme="wna16", weights=concat_linears(parts), dtype=dtype)
  x = _x(rng, (9, 256), dtype)
  separate = np.concatenate([np.asarray(QuantizedLinear(256, p.out_features, scheme="wna16",
                                                        weights=p, dtype=dtype)(x), np.float32)
                             for p in parts], axis=-1)
  assert rel_err(np.asarray(fused(x), np.float32), separate) < 1e-2
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda m, v: m(v))(layer, x), np.float32),
                                np.asarray(layer(x), np.float32))
