"""Expert routing (SPEC §5): router logits [T, E] -> (topk_weights f32 [T, K], topk_ids int32 [T, K]).

Two entry points:

- `select_experts`: vLLM's host-side selection (softmax / sigmoid top-k, optionally grouped
  DeepSeek-V3 style), as the fused CPU op's callers run it.
- `route`: the kernel-side methods of FlashInfer's `RoutingMethodType` (used by MxInt4 kernels,
  which take logits and route inside).

Everything is computed in float32 (logits are upcast first). Top-k uses `jax.lax.top_k`, which
breaks ties towards the lower index. All functions are jittable with `top_k` and the other
non-array arguments static.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

Array = jax.Array

SCORING_FUNCS = ("softmax", "sigmoid")


class RoutingMethodType(enum.IntEnum):
  """FlashInfer's routing methods, with their integer values (newer release numbering)."""
  Default = 0  # softmax over all experts -> top-k
  Renormalize = 1  # top-k of logits -> softmax over the k
  DeepSeekV3 = 2  # sigmoid -> + bias -> top-2 sum per group -> best groups -> top-k
  Llama4 = 3  # top-1 -> sigmoid of the chosen logit
  RenormalizeNaive = 4  # softmax -> top-k -> divide by the sum of the k
  TopK = 5  # top-k of logits, no softmax
  SigmoidRenorm = 6  # sigmoid -> top-k -> divide by the sum of the k
  MiniMax2 = 7  # sigmoid -> + bias -> top-k -> weights: sigmoid at the ids over their sum
  Sigmoid = 8  # sigmoid -> top-k
  Unspecified = 9


def _check_logits(router_logits: Array) -> Array:
  router_logits = jnp.asarray(router_logits)
  if router_logits.ndim != 2:
    raise ValueError(f"router_logits must be 2-D [T, E], got shape {router_logits.shape}")
  if not jnp.issubdtype(router_logits.dtype, jnp.floating):
    raise TypeError(f"router_logits must be floating point, got {router_logits.dtype}")
  return router_logits.astype(jnp.float32)


def _check_top_k(top_k: int, num_experts: int) -> None:
  if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
    raise ValueError(f"top_k must be a positive int, got {top_k!r}")
  if top_k > num_experts:
    raise ValueError(f"top_k={top_k} exceeds the number of experts {num_experts}")


def _score(logits: Array, scoring_func: str) -> Array:
  if scoring_func == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if scoring_func == "sigmoid":
    return jax.nn.sigmoid(logits)
  raise ValueError(f"scoring_func={scoring_func!r} is not one of {SCORING_FUNCS}")


def _renormalize(weights: Array) -> Array:
  return weights / jnp.sum(weights, axis=-1, keepdims=True)


def _check_groups(num_experts: int, top_k: int, num_expert_group, topk_group,
                  has_bias: bool) -> None:
  if num_expert_group is None or topk_group is None:
    raise ValueError("grouped top-k needs num_expert_group and topk_group, got "
                     f"num_expert_group={num_expert_group}, topk_group={topk_group}")
  if num_expert_group < 1 or num_experts % num_expert_group:
    raise ValueError(f"num_expert_group={num_expert_group} must be positive and divide the "
                     f"number of experts {num_experts}")
  if not 1 <= topk_group <= num_expert_group:
    raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group="
                     f"{num_expert_group}]")
  per_group = num_experts // num_expert_group
  if top_k > topk_group * per_group:
    raise ValueError(f"top_k={top_k} exceeds the {topk_group * per_group} experts of the "
                     f"topk_group={topk_group} kept groups")
  if has_bias and per_group < 2:
    raise ValueError(f"with e_score_correction_bias the group score sums the top 2 experts of "
                     f"a group; groups of {per_group} expert are too small")


def _grouped_topk(scores: Array, top_k: int, num_expert_group: int, topk_group: int,
                  bias: Array | None) -> tuple[Array, Array]:
  """DeepSeek-V3 grouped selection on scores s: returns (s at the ids, ids)."""
  t, e = scores.shape
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  grouped = choice.reshape(t, num_expert_group, e // num_expert_group)
  if bias is None:
    group_scores = jnp.max(grouped, axis=-1)
  else:
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  _, kept_groups = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
  group_mask = jnp.zeros((t, num_expert_group), bool).at[
      jnp.arange(t)[:, None], kept_groups].set(True)
  expert_mask = jnp.repeat(group_mask, e // num_expert_group, axis=-1)
  masked = jnp.where(expert_mask, choice, -jnp.inf)
  _, ids = jax.lax.top_k(masked, top_k)
  return jnp.take_along_axis(scores, ids, axis=-1), ids


def select_experts(router_logits: Array, top_k: int, *, renormalize: bool,
                   scoring_func: str = "softmax", use_grouped_topk: bool = False,
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   e_score_correction_bias: Array | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[Array, Array]:
  """vLLM-style expert selection (SPEC §5).

  Plain path: `s = score(logits)` (softmax or sigmoid over experts), top-k of `s`, divided by the
  sum of the k if `renormalize`. Grouped path (`use_grouped_topk`, DeepSeek-V3): see SPEC §5;
  `e_score_correction_bias [E]` only steers the choice, the weights are the scores.

  `routed_scaling_factor` multiplies the final weights on both paths (vLLM applies it inside
  grouped top-k only; other models scale the MoE output instead; here a value != 1 is never
  silently dropped).

  Returns:
    (topk_weights float32 [T, K], topk_ids int32 [T, K]).
  """
  logits = _check_logits(router_logits)
  num_experts = logits.shape[-1]
  _check_top_k(top_k, num_experts)
  if scoring_func not in SCORING_FUNCS:
    raise ValueError(f"scoring_func={scoring_func!r} is not one of {SCORING_FUNCS}")
  if e_score_correction_bias is not None:
    if not use_grouped_topk:
      raise ValueError("e_score_correction_bias is only used with use_grouped_topk=True")
    if jnp.shape(e_score_correction_bias) != (num_experts,):
      raise ValueError(f"e_score_correction_bias must have shape ({num_experts},), got "
                       f"{jnp.shape(e_score_correction_bias)}")
  scores = _score(logits, scoring_func)
  if use_grouped_topk:
    _check_groups(num_experts, top_k, num_expert_group, topk_group,
                  e_score_correction_bias is not None)
    weights, ids = _grouped_topk(scores, top_k, num_expert_group, topk_group,
                                 e_score_correction_bias)
  else:
    weights, ids = jax.lax.top_k(scores, top_k)
  if renormalize:
    weights = _renormalize(weights)
  if routed_scaling_factor != 1.0:
    weights = weights * jnp.float32(routed_scaling_factor)
  return weights.astype(jnp.float32), ids.astype(jnp.int32)


def route(router_logits: Array, top_k: int, routing_method: int | RoutingMethodType, *,
          num_expert_group: int | None = None, topk_group: int | None = None,
          e_score_correction_bias: Array | None = None,
          routed_scaling_factor: float | None = None) -> tuple[Array, Array]:
  """Kernel-side routing (FlashInfer `RoutingMethodType`, SPEC §5).

  - Default: softmax over all experts, top-k; the weights are the (not renormalized) probabilities.
  - Renormalize: top-k of the logits, then softmax over the k chosen logits.
  - DeepSeekV3: sigmoid scores, + `e_score_correction_bias` for the choice, groups scored by the
    sum of their top 2 (without groups, `num_expert_group=None`: one group), top-k among the
    kept groups; weights are the sigmoid scores at the ids divided by their sum, times
    `routed_scaling_factor` (default 1).
  - Llama4: top-1 of the logits (`top_k` must be 1); the weight is sigmoid(chosen logit).
  - RenormalizeNaive: softmax, top-k, divided by the sum of the k (Qwen3). Equal to Renormalize
    up to float rounding.
  - TopK: top-k of the logits, no softmax; the weights are the chosen raw logits (float32).
  - SigmoidRenorm: sigmoid, top-k, divided by the sum of the k.
  - Sigmoid: sigmoid, top-k; the weights are the sigmoid scores.
  - MiniMax2: sigmoid scores, top-k of scores + `e_score_correction_bias`; the weights are the
    scores at the ids over (their sum + 1e-20), times `routed_scaling_factor` (default 1).

  Unspecified raises NotImplementedError.

  Returns:
    (topk_weights float32 [T, K], topk_ids int32 [T, K]).
  """
  logits = _check_logits(router_logits)
  num_experts = logits.shape[-1]
  _check_top_k(top_k, num_experts)
  try:
    method = RoutingMethodType(int(routing_method))
  except ValueError:
    raise ValueError(f"routing_method={routing_method!r} is not a RoutingMethodType "
                     f"(0..{len(RoutingMethodType) - 1})") from None
  biased = (RoutingMethodType.DeepSeekV3, RoutingMethodType.MiniMax2)
  if method != RoutingMethodType.DeepSeekV3:
    for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
      if value is not None:
        raise ValueError(f"{name} is only used by RoutingMethodType.DeepSeekV3, not {method.name}")
  if method not in biased:
    if e_score_correction_bias is not None:
      raise ValueError("e_score_correction_bias is only used by DeepSeekV3 and MiniMax2 routing, "
                       f"not {method.name}")
    if routed_scaling_factor not in (None, 1.0):
      raise ValueError(f"routed_scaling_factor={routed_scaling_factor} is only used by "
                       f"DeepSeekV3 and MiniMax2 routing, not {method.name}")
  else:
    if e_score_correction_bias is None:
      raise ValueError(f"{method.name} routing needs e_score_correction_bias")
    if jnp.shape(e_score_correction_bias) != (num_experts,):
      raise ValueError(f"e_score_correction_bias must have shape ({num_experts},), got "
                       f"{jnp.shape(e_score_correction_bias)}")

  if method == RoutingMethodType.Default:
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
  elif method == RoutingMethodType.Renormalize:
    chosen, ids = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(chosen, axis=-1)
  elif method == RoutingMethodType.DeepSeekV3:
    groups = 1 if num_expert_group is None else num_expert_group
    kept = 1 if topk_group is None else topk_group
    if (num_expert_group is None) != (topk_group is None):
      raise ValueError("DeepSeekV3 routing needs both num_expert_group and topk_group, or "
                       f"neither; got num_expert_group={num_expert_group}, topk_group={topk_group}")
    _check_groups(num_experts, top_k, groups, kept, True)
    weights, ids = _grouped_topk(jax.nn.sigmoid(logits), top_k, groups, kept,
                                 e_score_correction_bias)
    weights = _renormalize(weights)
    if routed_scaling_factor is not None:
      weights = weights * jnp.float32(routed_scaling_factor)
  elif method == RoutingMethodType.Llama4:
    if top_k != 1:
      raise ValueError(f"Llama4 routing picks one expert; top_k={top_k}")
    chosen, ids = jax.lax.top_k(logits, 1)
    weights = jax.nn.sigmoid(chosen)
  elif method == RoutingMethodType.RenormalizeNaive:
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    weights = _renormalize(weights)
  elif method == RoutingMethodType.TopK:
    weights, ids = jax.lax.top_k(logits, top_k)
  elif method == RoutingMethodType.SigmoidRenorm:
    weights, ids = jax.lax.top_k(jax.nn.sigmoid(logits), top_k)
    weights = _renormalize(weights)
  elif method == RoutingMethodType.Sigmoid:
    weights, ids = jax.lax.top_k(jax.nn.sigmoid(logits), top_k)
  elif method == RoutingMethodType.MiniMax2:
    scores = jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(scores + e_score_correction_bias.astype(jnp.float32), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.float32(1e-20))
    if routed_scaling_factor is not None:
      weights = weights * jnp.float32(routed_scaling_factor)
  else:
    raise NotImplementedError(f"routing method {method.name} ({int(method)}) is not implemented")
  return weights.astype(jnp.float32), ids.astype(jnp.int32)
