"""MxInt4 on CPU: weight preparation (layout round trips, seed formats, errors), the op's
argument validation, the routing semantics the GPU kernel implements (vs an independent numpy
version), expert-parallel semantics through the reference, and the oracle's selection."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moeq import reference, routing
from jax_moeq.loaders import int4_format
from jax_moeq.ops import mxint4_gpu
from jax_moeq.quant import int4
from jax_moeq.routing import RoutingMethodType as RM


def _canonical(seed, e, h, i):
  rng = np.random.default_rng(seed)
  q13 = rng.integers(-8, 8, (e, 2 * i, h)).astype(np.int8)
  q2 = rng.integers(-8, 8, (e, h, i)).astype(np.int8)
  s13 = jnp.asarray(rng.uniform(0.5, 1.5, (e, 2 * i, h // 32)) / 100, jnp.bfloat16)
  s2 = jnp.asarray(rng.uniform(0.5, 1.5, (e, h, i // 32)) / 100, jnp.bfloat16)
  return q13, s13, q2, s2


# ------------------------------------------------------------------ preparation
@pytest.mark.parametrize("packing", ["uint8", "int32"])
def test_prepare_round_trip(packing):
  e, h, i = 3, 128, 64
  q13, s13, q2, s2 = _canonical(0, e, h, i)
  if packing == "uint8":
    g1, g2 = int4_format.pack_signed_nibbles(q13), int4_format.pack_signed_nibbles(q2)
  else:
    g1, g2 = int4.pack_uint4b8_ct(jnp.asarray(q13)), int4.pack_uint4b8_ct(jnp.asarray(q2))
  prepared = jax.jit(mxint4_gpu.prepare_static_weights_for_mxint4_moe)(g1, s13, g2, s2)
  assert prepared["gemm1_weights"].shape == (e, 2 * i // 16, h // 64, 32, 4)
  assert prepared["gemm1_weights"].dtype == jnp.uint32
  assert prepared["gemm1_scales"].shape == (e, h // 32, 2 * i // 16, 16)
  assert prepared["gemm2_weights"].shape == (e, h // 16, i // 64, 32, 4)
  assert prepared["gemm2_scales"].shape == (e, i // 32, h // 16, 16)
  r13, rs13, r2, rs2 = mxint4_gpu.unpack_mxint4_moe_weights(prepared)
  np.testing.assert_array_equal(np.asarray(r13), q13)
  np.testing.assert_array_equal(np.asarray(r2), q2)
  np.testing.assert_array_equal(np.asarray(rs13, np.float32), np.asarray(s13, np.float32))
  np.testing.assert_array_equal(np.asarray(rs2, np.float32), np.asarray(s2, np.float32))


def test_uint4b8_conversion_matches_signed_bytes():
  q = np.random.default_rng(1).integers(-8, 8, (4, 6, 64)).astype(np.int8)
  words = int4.pack_uint4b8_ct(jnp.asarray(q))
  got = mxint4_gpu.convert_packed_uint4b8_to_signed_int4(words)
  np.testing.assert_array_equal(np.asarray(got), int4_format.pack_signed_nibbles(q))
  np.testing.assert_array_equal(np.asarray(mxint4_gpu.int8_to_signed_nibbles(jnp.asarray(q))),
                                int4_format.pack_signed_nibbles(q))


def test_tile_layout_is_the_fragment_order():
  """Word (nt, kc, lane=4g+t, s), nibble b*4 + p*2 + hh = two's complement of
  q[16nt + 8hh + g, 64kc + 16t + 4s + 2p + b] (int4_mma_core.cuh)."""
  rng = np.random.default_rng(2)
  q = rng.integers(-8, 8, (1, 32, 128)).astype(np.int8)
  words = np.asarray(mxint4_gpu.shuffle_weights_for_mma_tiles(jnp.asarray(q)))
  for _ in range(200):
    nt, kc, g, t, s, p, b, hh = (rng.integers(0, m) for m in (2, 2, 8, 4, 4, 2, 2, 2))
    nib = (int(words[0, nt, kc, 4 * g + t, s]) >> (4 * (b * 4 + p * 2 + hh))) & 0xF
    want = int(q[0, 16 * nt + 8 * hh + g, 64 * kc + 16 * t + 4 * s + 2 * p + b]) & 0xF
    assert nib == want


def test_up_gate_input_order_is_swapped_back():
  e, h, i = 2, 64, 64
  q13, s13, q2, s2 = _canonical(3, e, h, i)
  swapped = np.concatenate([q13[:, i:], q13[:, :i]], axis=1)
  s_swapped = jnp.concatenate([s13[:, i:], s13[:, :i]], axis=1)
  prepared = mxint4_gpu.prepare_static_weights_for_mxint4_moe(
      int4_format.pack_signed_nibbles(swapped), s_swapped, int4_format.pack_signed_nibbles(q2),
      s2, w13_order="up_gate")
  r13, rs13, _, _ = mxint4_gpu.unpack_mxint4_moe_weights(prepared)
  np.testing.assert_array_equal(np.asarray(r13), q13)
  np.testing.assert_array_equal(np.asarray(rs13, np.float32), np.asarray(s13, np.float32))


def test_prepare_errors():
  e, h, i = 2, 128, 64
  q13, s13, q2, s2 = _canonical(4, e, h, i)
  g1, g2 = int4_format.pack_signed_nibbles(q13), int4_format.pack_signed_nibbles(q2)
  prep = mxint4_gpu.prepare_static_weights_for_mxint4_moe
  with pytest.raises(TypeError, match="gemm1_scales must be bfloat16"):
    prep(g1, s13.astype(jnp.float32), g2, s2)
  with pytest.raises(TypeError, match="gemm2_weights must be uint8"):
    prep(g1, s13, g2.astype(np.int16), s2)
  with pytest.raises(ValueError, match="gemm2_weights must unpack"):
    prep(g1, s13, g2[:, :64], s2)
  with pytest.raises(ValueError, match="gemm1_scales must have shape"):
    prep(g1, s13[:, :, :2], g2, s2)
  with pytest.raises(ValueError, match="gemm1_weights must be 3-D"):
    prep(g1[0], s13, g2, s2)
  with pytest.raises(ValueError, match="H % 64 == 0"):
    q = np.zeros((1, 64, 96), np.int8) + 1
    prep(int4_format.pack_signed_nibbles(q), jnp.ones((1, 64, 3), jnp.bfloat16),
         int4_format.pack_signed_nibbles(np.ones((1, 96, 32), np.int8)),
         jnp.ones((1, 96, 1), jnp.bfloat16))


# ------------------------------------------------------------------ op validation (no GPU needed)
def _op_args(e=8, h=128, i=64, t=3, local=None):
  local = e if local is None else local
  q13, s13, q2, s2 = _canonical(5, local, h, i)
  p = mxint4_gpu.prepare_static_weights_for_mxint4_moe(
      int4_format.pack_signed_nibbles(q13), s13, int4_format.pack_signed_nibbles(q2), s2)
  x = jnp.ones((t, h), jnp.bfloat16)
  logits = jnp.asarray(np.random.default_rng(6).standard_normal((t, e)), jnp.float32)
  return x, logits, [p[n] for n in mxint4_gpu.WEIGHT_KEYS]


def test_op_validation():
  x, logits, w = _op_args()
  base = dict(num_experts=8, top_k=2, intermediate_size=64, local_num_experts=8)
  op = mxint4_gpu.mxint4_moe
  with pytest.raises(TypeError, match="x must be bfloat16"):
    op(x.astype(jnp.float32), logits, *w, **base)
  with pytest.raises(ValueError, match="router_logits must be"):
    op(x, logits[:, :4], *w, **base)
  with pytest.raises(ValueError, match="intermediate_size"):
    op(x, logits, *w, **{**base, "intermediate_size": 0})
  with pytest.raises(ValueError, match="w13_packed must have shape"):
    op(x, logits, *w, **{**base, "intermediate_size": 128})
  with pytest.raises(ValueError, match="outside the 8 experts"):
    op(x, logits, *w, **{**base, "ep_rank": 1})
  with pytest.raises(ValueError, match="Llama4 routing picks one expert"):
    op(x, logits, *w, **base, routing_method=RM.Llama4)
  with pytest.raises(ValueError, match="needs e_score_correction_bias"):
    op(x, logits, *w, **base, routing_method=RM.DeepSeekV3)
  with pytest.raises(ValueError, match="only used by"):
    op(x, logits, *w, **base, num_expert_group=2, topk_group=1)
  with pytest.raises(ValueError, match="not a RoutingMethodType"):
    op(x, logits, *w, **base, routing_method=42)
  with pytest.raises(NotImplementedError, match="Unspecified"):
    op(x, logits, *w, **base, routing_method=RM.Unspecified)
  with pytest.raises(TypeError, match="w2_scale must be bfloat16"):
    op(x, logits, w[0], w[1], w[2], w[3].astype(jnp.float32), **base)


def test_empty_tokens_give_empty_output():
  x, logits, w = _op_args(t=0)
  out = mxint4_gpu.mxint4_moe(x, logits, *w, num_experts=8, top_k=2, intermediate_size=64,
                              local_num_experts=8)
  assert out.shape == (0, 128) and out.dtype == jnp.bfloat16


def test_availability_is_false_without_gpu():
  if jax.default_backend() == "cpu":
    assert not mxint4_gpu.is_mxint4_moe_available()


# ------------------------------------------------------------------ routing semantics (numpy)
def _np_topk(v, k, allowed=None):
  """Descending, ties to the lower index (the kernel's warp argmax; jax.lax.top_k)."""
  v = np.where(allowed, v, -np.inf) if allowed is not None else v
  order = np.lexsort((np.arange(v.shape[-1]), -v))
  return order[:k]


def _np_route(logits, k, method, groups=None, kept=None, bias=None, scale=None):
  logits = logits.astype(np.float64)
  t, e = logits.shape
  ids = np.zeros((t, k), np.int64)
  w = np.zeros((t, k))
  sig = lambda v: 1 / (1 + np.exp(-v))
  for r in range(t):
    l = logits[r]
    soft = np.exp(l - l.max()) / np.exp(l - l.max()).sum()
    if method in (RM.Default, RM.RenormalizeNaive):
      idx = _np_topk(soft, k)
      ww = soft[idx] / (soft[idx].sum() if method == RM.RenormalizeNaive else 1.0)
    elif method == RM.Renormalize:
      idx = _np_topk(l, k)
      ww = np.exp(l[idx] - l[idx].max()) / np.exp(l[idx] - l[idx].max()).sum()
    elif method in (RM.TopK, RM.Llama4):
      idx = _np_topk(l, k)
      ww = l[idx] if method == RM.TopK else sig(l[idx])
    elif method in (RM.Sigmoid, RM.SigmoidRenorm):
      s = sig(l)
      idx = _np_topk(s, k)
      ww = s[idx] / (s[idx].sum() if method == RM.SigmoidRenorm else 1.0)
    elif method == RM.MiniMax2:
      s = sig(l)
      idx = _np_topk(s + bias, k)
      ww = s[idx] / (s[idx].sum() + 1e-20) * (scale or 1.0)
    elif method == RM.DeepSeekV3:
      s = sig(l)
      c = s + bias
      per = e // groups
      gscore = np.sort(c.reshape(groups, per), axis=-1)[:, -2:].sum(-1)
      keep = _np_topk(gscore, kept)
      allowed = np.isin(np.arange(e) // per, keep)
      idx = _np_topk(c, k, allowed)
      ww = s[idx] / s[idx].sum() * (scale or 1.0)
    ids[r], w[r] = idx, ww
  return w, ids


@pytest.mark.parametrize("method", [RM.Default, RM.Renormalize, RM.DeepSeekV3, RM.Llama4,
                                    RM.RenormalizeNaive, RM.TopK, RM.SigmoidRenorm,
                                    RM.MiniMax2, RM.Sigmoid])
def test_routing_semantics_vs_numpy(method):
  rng = np.random.default_rng(int(method))
  t, e = 37, 64
  k = 1 if method == RM.Llama4 else 6
  logits = rng.standard_normal((t, e)).astype(np.float32) * 2
  bias = rng.uniform(-0.2, 0.2, e).astype(np.float32)
  kw, np_kw = {}, {}
  if method == RM.DeepSeekV3:
    kw = dict(num_expert_group=8, topk_group=2, e_score_correction_bias=bias,
              routed_scaling_factor=2.5)
    np_kw = dict(groups=8, kept=2, bias=bias, scale=2.5)
  elif method == RM.MiniMax2:
    kw = dict(e_score_correction_bias=bias, routed_scaling_factor=1.5)
    np_kw = dict(bias=bias, scale=1.5)
  w, ids = routing.route(jnp.asarray(logits), k, method, **kw)
  want_w, want_ids = _np_route(logits, k, method, **np_kw)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ EP semantics (reference)
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_reference_ranks_sum_to_full(ranks):
  """Routing is over all E experts on every rank; each rank computes only its experts."""
  e, k, h, i, t = 16, 4, 64, 64, 9
  q13, s13, q2, s2 = _canonical(7, e, h, i)
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
  run = lambda sl, off, loc: reference.fused_moe_mxint4(
      x, logits, jnp.asarray(q13[sl]), s13[sl], jnp.asarray(q2[sl]), s2[sl], top_k=k,
      routing_method=RM.Renormalize, local_expert_offset=off, local_num_experts=loc)
  full = run(slice(None), 0, e)
  local = e // ranks
  parts = [run(slice(r * local, (r + 1) * local), r * local, local) for r in range(ranks)]
  total = sum(p.astype(jnp.float32) for p in parts)
  rel = np.linalg.norm(np.asarray(total) - np.asarray(full, np.float32)) / np.linalg.norm(
      np.asarray(full, np.float32))
  assert rel <= 1e-2  # each rank's partial sum is rounded to bf16 once


# ------------------------------------------------------------------ oracle
def test_oracle_selection_on_cpu_and_explicit_gpu_backend():
  from jax_moeq.oracle import base, mxint4 as oracle
  from jax_moeq.experts.mxint4 import ReferenceExpertsMxInt4
  cfg = base.MoEConfig(num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1408,
                       routing_method=RM.DeepSeekV3, platform="cpu")
  backend, cls = oracle.select_mxint4_moe_backend(cfg)
  assert backend == oracle.MxInt4MoeBackend.REFERENCE and cls is ReferenceExpertsMxInt4
  explicit = base.MoEConfig(num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1408,
                            platform="cpu", moe_backend="hopper_mxint4")
  with pytest.raises(ValueError, match="HOPPER_MXINT4 does not support .* platform 'cpu'"):
    oracle.select_mxint4_moe_backend(explicit)
  with pytest.raises(ValueError, match="is not supported for MxInt4"):
    oracle.map_mxint4_backend("marlin")
  gpu_cfg = base.MoEConfig(num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1408,
                           platform="cuda")
  if not mxint4_gpu.is_mxint4_moe_available():
    # On a machine without our CUDA library the reference is chosen, with the reason logged.
    backend, _ = oracle.select_mxint4_moe_backend(gpu_cfg)
    assert backend == oracle.MxInt4MoeBackend.REFERENCE
  with pytest.raises(NotImplementedError):
    oracle.select_mxint4_moe_backend(base.MoEConfig(
        num_experts=8, top_k=2, hidden_size=64, intermediate_size=64, platform="cpu",
        activation="swigluoai"))


def test_reference_experts_apply_matches_reference():
  from jax_moeq.oracle import base, mxint4 as oracle
  e, k, h, i, t = 8, 2, 64, 64, 5
  q13, s13, q2, s2 = _canonical(9, e, h, i)
  w = oracle.convert_to_mxint4_moe_kernel_format(
      "reference", int4_format.pack_signed_nibbles(q13), s13, int4_format.pack_signed_nibbles(q2),
      s2)
  np.testing.assert_array_equal(np.asarray(w["w13_q"]), q13)
  cfg = base.MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i,
                       routing_method=RM.Renormalize, platform="cpu")
  _, cls = oracle.select_mxint4_moe_backend(cfg)
  experts = cls(cfg, oracle.make_mxint4_moe_quant_config())
  rng = np.random.default_rng(10)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
  # The converter's reference dict is the experts' prepared form; the default routing is the
  # config's kernel-side method (Renormalize: softmax top-k, renormalized).
  got = experts.apply(x, logits, w)
  want = reference.fused_moe_mxint4(x, logits, jnp.asarray(q13), s13, jnp.asarray(q2), s2,
                                    top_k=k, routing_method=RM.Renormalize)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  routing = base.RoutingOptions(top_k=k, renormalize=True)
  np.testing.assert_array_equal(np.asarray(experts.apply(x, logits, w, routing), np.float32),
                                np.asarray(want, np.float32))
  with pytest.raises(ValueError, match="built for Renormalize"):
    experts.apply(x, logits, w, base.RoutingOptions(top_k=k, renormalize=False))
