"""jax_moeq.routing vs independent numpy versions (SPEC §5).

Ids must agree exactly (random float logits have no ties; ties are tested on their own);
weights to 1e-6 relative: float32 softmax / sigmoid / sums whose rounding order may differ
(a few ulps), compared with float64 numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import routing
from jax_moeq.routing import RoutingMethodType as R


def np_softmax(v):
  v = np.asarray(v, np.float64)
  e = np.exp(v - v.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def np_sigmoid(v):
  return 1 / (1 + np.exp(-np.asarray(v, np.float64)))


def np_topk(v, k):
  """Indices of the k largest per row, ties to the lower index, and the values."""
  ids = np.argsort(-np.asarray(v), axis=-1, kind="stable")[..., :k]
  return np.take_along_axis(np.asarray(v), ids, -1), ids


def np_grouped(scores, k, n_group, topk_group, bias):
  t, e = scores.shape
  choice = scores if bias is None else scores + bias
  ids = np.zeros((t, k), np.int64)
  for r in range(t):
    groups = choice[r].reshape(n_group, -1)
    if bias is None:
      gscore = groups.max(-1)
    else:
      gscore = np.sort(groups, -1)[:, -2:].sum(-1)
    kept = np.argsort(-gscore, kind="stable")[:topk_group]
    allowed = np.zeros(e, bool)
    for g in kept:
      allowed[g * (e // n_group):(g + 1) * (e // n_group)] = True
    masked = np.where(allowed, choice[r], -np.inf)
    ids[r] = np.argsort(-masked, kind="stable")[:k]
  return np.take_along_axis(scores, ids, -1), ids


def logits(seed, t=24, e=16, scale=2.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((t, e)) * scale, jnp.float32)


def check(got, want_w, want_ids):
  w, ids = got
  assert w.dtype == jnp.float32 and ids.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ select_experts
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts_plain(scoring_func, renormalize):
  x = logits(1)
  s = np_softmax(x) if scoring_func == "softmax" else np_sigmoid(x)
  w, ids = np_topk(s, 4)
  if renormalize:
    w = w / w.sum(-1, keepdims=True)
  f = jax.jit(routing.select_experts, static_argnums=1,
              static_argnames=("renormalize", "scoring_func"))
  check(f(x, 4, renormalize=renormalize, scoring_func=scoring_func), w, ids)


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts_grouped(scoring_func, with_bias, renormalize):
  x = logits(2, t=32, e=32)
  bias = jnp.asarray(np.random.default_rng(3).standard_normal(32) * 0.3, jnp.float32)
  s = np_softmax(x) if scoring_func == "softmax" else np_sigmoid(x)
  w, ids = np_grouped(s, 6, 8, 3, np.asarray(bias, np.float64) if with_bias else None)
  if renormalize:
    w = w / w.sum(-1, keepdims=True)
  w = w * 2.5
  got = routing.select_experts(x, 6, renormalize=renormalize, scoring_func=scoring_func,
                               use_grouped_topk=True, num_expert_group=8, topk_group=3,
                               e_score_correction_bias=bias if with_bias else None,
                               routed_scaling_factor=2.5)
  check(got, w, ids)
  # Only experts of kept groups are chosen: at most topk_group distinct groups.
  assert max(len(set(row // 4)) for row in np.asarray(got[1])) <= 3


def test_select_experts_bf16_logits_upcast_and_ties():
  x = jnp.zeros((3, 8), jnp.bfloat16).at[:, 5].set(1.0)
  w, ids = routing.select_experts(x, 3, renormalize=False)
  # Ties (all the zeros) go to the lower index.
  np.testing.assert_array_equal(np.asarray(ids), [[5, 0, 1]] * 3)
  p = np_softmax(np.asarray(x, np.float32)[0])
  np.testing.assert_allclose(np.asarray(w)[0], p[[5, 0, 1]], rtol=1e-6)
  g_w, g_ids = routing.select_experts(jnp.zeros((2, 8)), 2, renormalize=True,
                                      use_grouped_topk=True, num_expert_group=4, topk_group=2)
  np.testing.assert_array_equal(np.asarray(g_ids), [[0, 1]] * 2)
  np.testing.assert_allclose(np.asarray(g_w), 0.5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(top_k=17), ValueError, "top_k=17 exceeds the number of experts 16"),
    (dict(top_k=0), ValueError, "top_k must be a positive int"),
    (dict(scoring_func="relu"), ValueError, "scoring_func='relu'"),
    (dict(use_grouped_topk=True), ValueError, "needs num_expert_group and topk_group"),
    (dict(use_grouped_topk=True, num_expert_group=3, topk_group=1), ValueError,
     "num_expert_group=3 must be positive and divide"),
    (dict(use_grouped_topk=True, num_expert_group=4, topk_group=5), ValueError,
     "topk_group=5 must be in"),
    (dict(top_k=9, use_grouped_topk=True, num_expert_group=4, topk_group=2), ValueError,
     "top_k=9 exceeds the 8 experts"),
    (dict(e_score_correction_bias=jnp.zeros(16)), ValueError, "only used with use_grouped_topk"),
    (dict(use_grouped_topk=True, num_expert_group=4, topk_group=2,
          e_score_correction_bias=jnp.zeros(8)), ValueError, r"must have shape \(16,\)"),
])
def test_select_experts_rejects(kwargs, error, match):
  args = dict(top_k=2, renormalize=True)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    routing.select_experts(logits(0), **args)


def test_select_experts_rejects_bad_logits():
  with pytest.raises(ValueError, match="2-D"):
    routing.select_experts(jnp.zeros(8), 2, renormalize=True)
  with pytest.raises(TypeError, match="floating point"):
    routing.select_experts(jnp.zeros((2, 8), jnp.int32), 2, renormalize=True)


# ------------------------------------------------------------------ route
def np_route(method, x, k, bias=None, n_group=None, topk_group=None, scale=None):
  x = np.asarray(x, np.float64)
  if method == R.Default:
    return np_topk(np_softmax(x), k)
  if method == R.Renormalize:
    chosen, ids = np_topk(x, k)
    return np_softmax(chosen), ids
  if method == R.DeepSeekV3:
    s = np_sigmoid(x)
    w, ids = np_grouped(s, k, n_group or 1, topk_group or 1, np.asarray(bias, np.float64))
    return w / w.sum(-1, keepdims=True) * (1.0 if scale is None else scale), ids
  if method == R.Llama4:
    chosen, ids = np_topk(x, 1)
    return np_sigmoid(chosen), ids
  if method == R.RenormalizeNaive:
    w, ids = np_topk(np_softmax(x), k)
    return w / w.sum(-1, keepdims=True), ids
  if method == R.TopK:
    return np_topk(x, k)
  if method in (R.SigmoidRenorm, R.Sigmoid):
    w, ids = np_topk(np_sigmoid(x), k)
    return (w / w.sum(-1, keepdims=True) if method == R.SigmoidRenorm else w), ids
  if method == R.MiniMax2:
    s = np_sigmoid(x)
    _, ids = np_topk(s + np.asarray(bias, np.float64), k)
    w = np.take_along_axis(s, ids, -1)
    return w / (w.sum(-1, keepdims=True) + 1e-20) * (1.0 if scale is None else scale), ids
  raise AssertionError(method)


@pytest.mark.parametrize("method", [R.Default, R.Renormalize, R.DeepSeekV3, R.Llama4,
                                    R.RenormalizeNaive, R.TopK, R.SigmoidRenorm, R.MiniMax2,
                                    R.Sigmoid])
def test_route_methods(method):
  x = logits(10 + int(method), t=20, e=32)
  k = 1 if method == R.Llama4 else 4
  kw = {}
  if method in (R.DeepSeekV3, R.MiniMax2):
    kw = dict(e_score_correction_bias=jnp.asarray(
        np.random.default_rng(5).standard_normal(32) * 0.2, jnp.float32),
              routed_scaling_factor=1.5)
  if method == R.DeepSeekV3:
    kw.update(num_expert_group=4, topk_group=2)
  f = jax.jit(routing.route, static_argnums=(1, 2),
              static_argnames=("num_expert_group", "topk_group", "routed_scaling_factor"))
  got = f(x, k, int(method), **kw)
  want_w, want_ids = np_route(method, x, k, bias=kw.get("e_score_correction_bias"),
                              n_group=kw.get("num_expert_group"), topk_group=kw.get("topk_group"),
                              scale=kw.get("routed_scaling_factor"))
  check(got, want_w, want_ids)


def test_route_deepseek_without_groups_and_renormalize_equivalence():
  x = logits(20, e=16)
  bias = jnp.asarray(np.random.default_rng(6).standard_normal(16) * 0.2, jnp.float32)
  got = routing.route(x, 3, R.DeepSeekV3, e_score_correction_bias=bias)
  check(got, *np_route(R.DeepSeekV3, x, 3, bias=bias))
  a_w, a_ids = routing.route(x, 4, R.Renormalize)
  b_w, b_ids = routing.route(x, 4, R.RenormalizeNaive)
  np.testing.assert_array_equal(np.asarray(a_ids), np.asarray(b_ids))
  np.testing.assert_allclose(np.asarray(a_w), np.asarray(b_w), rtol=1e-5)
  # Default equals select_experts' plain softmax path.
  d_w, d_ids = routing.route(x, 4, R.Default)
  s_w, s_ids = routing.select_experts(x, 4, renormalize=False)
  np.testing.assert_array_equal(np.asarray(d_ids), np.asarray(s_ids))
  np.testing.assert_array_equal(np.asarray(d_w), np.asarray(s_w))


@pytest.mark.parametrize("method,kwargs,error,match", [
    (R.Unspecified, {}, NotImplementedError, "Unspecified"),
    (42, {}, ValueError, "routing_method=42"),
    (R.Llama4, {}, ValueError, "top_k=2"),
    (R.Default, dict(num_expert_group=2), ValueError, "num_expert_group is only used"),
    (R.TopK, dict(e_score_correction_bias=jnp.zeros(16)), ValueError,
     "e_score_correction_bias is only used"),
    (R.Renormalize, dict(routed_scaling_factor=2.0), ValueError, "routed_scaling_factor=2.0"),
    (R.DeepSeekV3, {}, ValueError, "needs e_score_correction_bias"),
    (R.MiniMax2, dict(e_score_correction_bias=jnp.zeros(4)), ValueError, r"shape \(16,\)"),
    (R.DeepSeekV3, dict(e_score_correction_bias=jnp.zeros(16), num_expert_group=4), ValueError,
     "both num_expert_group and topk_group"),
])
def test_route_rejects(method, kwargs, error, match):
  with pytest.raises(error, match=match):
    routing.route(logits(0), 2, method, **kwargs)


def test_routing_method_values():
  assert [int(m) for m in R] == list(range(10))
  assert R.Sigmoid == 8 and R.Unspecified == 9 and R.TopK == 5
