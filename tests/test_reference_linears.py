"""The dense-linear references of SPEC §12 (`reference.linear_w4a8`, `reference.linear_wna16`)
against numpy written independently (tests/_helpers.py), and against the MoE references they
must agree with."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _helpers as h
from jax_moeq import reference

F32 = np.float32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("group_size", [32, -1])
def test_linear_w4a8_is_the_w4a8_gemm_rounded_once(dtype, group_size):
  rng = np.random.default_rng(1)
  n, k = 48, 256
  p = h.random_int4_experts(rng, 1, n // 2, k, group_size, bias=True)
  q, s, bias = p["w13_q"][0], p["w13_scale"][0], p["w13_bias"][0]
  x = jnp.asarray(rng.standard_normal((2, 3, k)), dtype)
  got = jax.jit(reference.linear_w4a8, static_argnums=3)(x, q, s, group_size, bias)
  assert got.shape == (2, 3, n) and got.dtype == dtype
  want = h.np_w4a8_linear(np.asarray(x, F32).reshape(6, k), q, np.asarray(s, F32), group_size,
                          bias).reshape(2, 3, n)
  # float64 numpy vs float32 across groups, then one rounding to dtype: half an ulp of dtype.
  tol = {jnp.float32: 1e-6, jnp.bfloat16: 2**-8, jnp.float16: 2**-11}[dtype]
  assert h.rel_err(np.asarray(got, F32), want) < tol


def _np_linear_wna16(x, q, s, group, *, g_idx=None, zeros=None, bias=None, dtype):
  """numpy: dequant (q - z)·s per element rounded to dtype, float64 GEMM, bias, one rounding."""
  n, k = q.shape
  groups_of_k = np.arange(k) // group if g_idx is None else np.asarray(g_idx)
  v = np.asarray(q, F32)
  if zeros is not None:
    v = v - np.asarray(zeros, F32)[:, groups_of_k]
  w = h.np_round(v * np.asarray(s, F32)[:, groups_of_k], dtype)
  y = np.asarray(x, F32).reshape(-1, k).astype(np.float64) @ w.astype(np.float64).T
  if bias is not None:
    y = y + np.asarray(bias, np.float64)
  return h.np_round(y.astype(F32), dtype).reshape(*np.shape(x)[:-1], n)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("variant", ["symmetric", "zeros", "act_order", "channel"])
def test_linear_wna16_matches_numpy(dtype, variant):
  rng = np.random.default_rng(2)
  n, k = 64, 256
  group = -1 if variant == "channel" else 64
  g = k if group == -1 else group
  zeros = g_idx = None
  if variant == "zeros":
    q = rng.integers(0, 16, (n, k))
    zeros = jnp.asarray(rng.integers(6, 10, (n, k // g)), jnp.int8)
  else:
    q = rng.integers(-8, 8, (n, k))
  if variant == "act_order":
    g_idx = jnp.asarray(rng.permutation(np.arange(k) // g), jnp.int32)
  s = jnp.asarray(rng.uniform(0.5, 1.5, (n, k // g)) / (8 * np.sqrt(k)), dtype)
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  x = jnp.asarray(rng.standard_normal((3, 5, k)), dtype)
  q = jnp.asarray(q, jnp.int8)
  got = reference.linear_wna16(x, q, s, group, g_idx=g_idx, zeros=zeros, bias=bias)
  assert got.shape == (3, 5, n) and got.dtype == dtype
  want = _np_linear_wna16(x, q, s, g, g_idx=g_idx, zeros=zeros, bias=bias, dtype=dtype)
  # Same dequantized weights; float32 vs float64 accumulation, then one rounding to dtype.
  tol = {jnp.float32: 1e-6, jnp.bfloat16: 2**-8, jnp.float16: 2**-11}[dtype]
  assert h.rel_err(np.asarray(got, F32), want) < tol


def test_linear_wna16_is_the_moe_gemm_of_one_expert():
  """E=1, top-1 with weight 1 and gate rows biased high (sigmoid(gate) = 1 exactly): the WNA16
  MoE is linear_wna16(round(gate · up)) after linear_wna16(x), up to float32 summation order."""
  rng = np.random.default_rng(3)
  T, H, I, g, dtype = 9, 128, 64, 32, jnp.bfloat16

  def weights(n, k):
    return (jnp.asarray(rng.integers(-8, 8, (n, k)), jnp.int8),
            jnp.asarray(rng.uniform(0.5, 1.5, (n, k // g)) / (8 * np.sqrt(k)), dtype))

  q13, s13 = weights(2 * I, H)
  q2, s2 = weights(H, I)
  b13 = jnp.asarray(rng.standard_normal(2 * I), jnp.float32).at[:I].add(40.0)
  x = jnp.asarray(rng.standard_normal((T, H)), dtype)
  moe = reference.fused_moe_wna16(x, jnp.zeros((T, 1), jnp.int32), jnp.ones((T, 1)), q13[None],
                                  s13[None], q2[None], s2[None], g, w13_bias=b13[None])
  y13 = reference.linear_wna16(x, q13, s13, g, bias=b13).astype(jnp.float32)
  assert float(y13[:, :I].min()) >= 17.0
  act = reference.round_to_dtype(y13[:, :I] * y13[:, I:], dtype).astype(dtype)
  chained = reference.linear_wna16(act, q2, s2, g)
  assert h.rel_err(np.asarray(chained, F32), np.asarray(moe, F32)) < 2**-8


def test_linear_references_reject_bad_input():
  q = jnp.ones((16, 64), jnp.int8)
  s = jnp.ones((16, 2), jnp.bfloat16)
  x = jnp.ones((2, 64), jnp.bfloat16)
  with pytest.raises(TypeError, match="x must be float32"):
    reference.linear_w4a8(x.astype(jnp.int32), q, s, 32)
  with pytest.raises(TypeError, match="x must be float32"):
    reference.linear_wna16(x.astype(jnp.int32), q, s, 32)
  with pytest.raises(ValueError, match="x must be"):
    reference.linear_wna16(x[:, :32], q, s, 32)
  with pytest.raises(ValueError, match="zeros must have shape"):
    reference.linear_wna16(x, q, s, 32, zeros=jnp.ones((16, 1), jnp.int8))
  with pytest.raises(ValueError, match="g_idx must have shape"):
    reference.linear_wna16(x, q, s, 32, g_idx=jnp.zeros(32, jnp.int32))
  with pytest.raises(TypeError, match="g_idx must be integer"):
    reference.linear_wna16(x, q, s, 32, g_idx=jnp.zeros(64, jnp.float32))
  with pytest.raises(ValueError, match="w_scale must have shape"):
    reference.linear_wna16(x, q, s[:, :1], 32)
  with pytest.raises(ValueError, match="group_size=48"):
    reference.linear_wna16(x, q, s, 48)
