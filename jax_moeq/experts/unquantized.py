"""Unquantized (float) experts: w13 [E, 2I, H], w2 [E, H, I] (+ biases), any float dtype.

- `XlaFloatExperts` (backend XLA): plain XLA ops on every platform, with the SPEC §4 rounding
  points (y13, the activation and y2 rounded to x's dtype). `float_impl` picks the computation:
  "gather" (each (token, slot) pair gathers its expert's weights), "dense" (every expert on every
  token, the routed outputs kept), "ragged_dot" (pairs sorted by expert, `lax.ragged_dot`), or
  "auto" (from the shapes, see `XlaFloatExperts.resolve_impl`).
- `ReferenceExpertsFloat` (backend REFERENCE): `reference.fused_moe_float` (float32 GEMMs).

Weights are used in the dtype they come in (the blocks cast them to their compute dtype first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jax_moeq import reference
from jax_moeq.experts.base import MoEExperts, require_arrays
from jax_moeq.oracle.base import MoEActivation, MoEConfig, QuantKey
from jax_moeq.weights import FloatMoEWeights, validate_float_weights

Array = jax.Array

FLOAT_IMPLS = ("auto", "gather", "dense", "ragged_dot")
_NAMES = ("w13", "w2")


class _FloatExpertsBase(MoEExperts):

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    return weight_key is None and activation_key is None

  @classmethod
  def _unsupported_reason(cls, moe_config: MoEConfig, weight_key, activation_key) -> str | None:
    if not jnp.issubdtype(moe_config.in_dtype, jnp.floating):
      return f"the experts compute in a float dtype, not {moe_config.in_dtype}"
    return None

  def prepare(self, weights: FloatMoEWeights) -> dict[str, Array]:
    """`FloatMoEWeights` -> {"w13", "w2"} (+ "w13_bias", "w2_bias" when present)."""
    if not isinstance(weights, FloatMoEWeights):
      raise TypeError(f"weights must be FloatMoEWeights, got {type(weights).__name__}")
    validate_float_weights(weights)
    arrays = {"w13": weights.w13, "w2": weights.w2}
    for name in ("w13_bias", "w2_bias"):
      if getattr(weights, name) is not None:
        arrays[name] = getattr(weights, name)
    return arrays

  def canonical(self, arrays: Mapping[str, Array]) -> FloatMoEWeights:
    return FloatMoEWeights(arrays["w13"], arrays["w2"], arrays.get("w13_bias"),
                           arrays.get("w2_bias"))


class ReferenceExpertsFloat(_FloatExpertsBase):
  """`reference.fused_moe_float` (float32 GEMMs, exact rounding points) on prepared arrays."""

  backend_name = "reference"

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    require_arrays(type(self).__name__, weights, _NAMES)
    return reference.fused_moe_float(
        hidden_states, topk_ids, topk_weights, weights["w13"], weights["w2"],
        w13_bias=weights.get("w13_bias"), w2_bias=weights.get("w2_bias"),
        apply_router_weight_on_input=self.apply_router_weight_on_input,
        activation_kind=self.activation.kernel_kind)


class XlaFloatExperts(_FloatExpertsBase):
  """Float experts in plain XLA ops; `float_impl` in `FLOAT_IMPLS` picks the computation."""

  backend_name = "xla"

  def __init__(self, moe_config: MoEConfig, quant_config: Any = None, *,
               float_impl: str = "auto"):
    super().__init__(moe_config, quant_config)
    if float_impl not in FLOAT_IMPLS:
      raise ValueError(f"float_impl={float_impl!r} is not one of {FLOAT_IMPLS}")
    if float_impl == "dense" and moe_config.apply_router_weight_on_input:
      raise ValueError("float_impl='dense' runs every expert on the unscaled tokens, so it cannot "
                       "apply the router weight on the input; use 'gather' or 'ragged_dot'")
    self.float_impl = float_impl

  def _key(self) -> tuple:
    return super()._key() + (self.float_impl,)

  def resolve_impl(self, num_tokens: int) -> str:
    """The computation a call on `num_tokens` tokens runs.

    XLA has no fused MoE, so "auto" follows the shape (measured on CPU, bf16): with few (token,
    slot) pairs (decode) gather the routed experts' weights per pair; with many pairs and not
    too many experts per pair (E/K <= 16) run every expert densely and keep the routed outputs
    (XLA's CPU ragged_dot measured ~2x slower than that at E/K = 8); otherwise sort the pairs
    by expert and use `lax.ragged_dot`.
    """
    if self.float_impl != "auto":
      return self.float_impl
    cfg = self.moe_config
    if num_tokens * cfg.top_k <= cfg.num_experts:
      return "gather"
    if cfg.num_experts <= 16 * cfg.top_k and not cfg.apply_router_weight_on_input:
      return "dense"
    return "ragged_dot"

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    require_arrays(type(self).__name__, weights, _NAMES)
    if topk_ids.size == 0:  # nothing routed: zeros, as the references give
      return jnp.zeros((hidden_states.shape[0], weights["w2"].shape[1]), hidden_states.dtype)
    impl = self.resolve_impl(topk_ids.shape[0])
    args = (hidden_states, topk_ids, topk_weights, weights["w13"], weights["w2"],
            weights.get("w13_bias"), weights.get("w2_bias"), self.activation)
    if impl == "gather":
      return _float_moe_gather(*args, self.apply_router_weight_on_input)
    if impl == "dense":
      return _float_moe_dense(*args)
    return _float_moe_ragged(*args, self.apply_router_weight_on_input)


# ------------------------------------------------------------------ the three computations
def apply_activation(y13: Array, activation: MoEActivation) -> Array:
  """Gated activation of [.., 2I] (gate half first) in float32 (SPEC §4 step 3)."""
  i = y13.shape[-1] // 2
  g, u = y13[..., :i].astype(jnp.float32), y13[..., i:].astype(jnp.float32)
  if activation != MoEActivation.SWIGLUOAI:
    return jax.nn.silu(g) * u
  g = jnp.minimum(g, 7.0)
  u = jnp.clip(u, -7.0, 7.0)
  return (u + 1.0) * g * jax.nn.sigmoid(1.702 * g)


def _gemm(a: Array, w: Array, spec: str, bias: Array | None, dtype) -> Array:
  y = jnp.einsum(spec, a, w, preferred_element_type=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(dtype)


def _combine_slots(y: Array, topk_weights: Array, weighted: bool) -> Array:
  """[T, K, H] expert outputs -> [T, H]: router weight (unless applied on input), slot-order sum."""
  dtype = y.dtype
  if not weighted:
    y = (y.astype(jnp.float32) * topk_weights[..., None].astype(jnp.float32)).astype(dtype)
  out = jnp.zeros(y.shape[::2], dtype)
  for slot in range(y.shape[1]):
    out = out + y[:, slot]
  return out


def _float_moe_gather(x, topk_ids, topk_weights, w13, w2, b13, b2, activation, on_input):
  t, k = topk_ids.shape
  dtype = x.dtype
  ids = topk_ids.reshape(-1)
  a = jnp.repeat(x, k, axis=0)
  if on_input:
    a = (a.astype(jnp.float32) * topk_weights.reshape(-1, 1)).astype(dtype)
  y13 = _gemm(a, w13[ids], "ph,pih->pi", None if b13 is None else b13[ids], dtype)
  act = apply_activation(y13, activation).astype(dtype)
  y = _gemm(act, w2[ids], "pi,phi->ph", None if b2 is None else b2[ids], dtype)
  return _combine_slots(y.reshape(t, k, y.shape[-1]), topk_weights, on_input)


def _float_moe_dense(x, topk_ids, topk_weights, w13, w2, b13, b2, activation):
  dtype = x.dtype
  y13 = _gemm(x, w13, "th,eih->tei", b13, dtype)
  act = apply_activation(y13, activation).astype(dtype)
  y = _gemm(act, w2, "tei,ehi->teh", b2, dtype)  # [T, E, H]
  picked = jnp.take_along_axis(y, topk_ids[..., None].astype(jnp.int32), axis=1)  # [T, K, H]
  return _combine_slots(picked, topk_weights, False)


def _ragged_dot(a: Array, w: Array, sizes: Array) -> Array:
  """a [P, K] sorted by expert, w [E, N, K] -> float32 [P, N].

  ragged_dot takes one operand dtype: both are promoted as einsum would (exact widening), so a
  bf16 block (weights cast to bf16) stays bf16 and float32 weights see exact float32 inputs.
  """
  dtype = jnp.promote_types(a.dtype, w.dtype)
  return jax.lax.ragged_dot(a.astype(dtype), w.transpose(0, 2, 1).astype(dtype), sizes,
                            preferred_element_type=jnp.float32)


def _float_moe_ragged(x, topk_ids, topk_weights, w13, w2, b13, b2, activation, on_input):
  t, k = topk_ids.shape
  e = w13.shape[0]
  dtype = x.dtype
  flat_ids = topk_ids.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat_ids, stable=True)
  sorted_ids = flat_ids[order]
  a = x[order // k]
  if on_input:
    w_sorted = topk_weights.reshape(-1)[order].astype(jnp.float32)
    a = (a.astype(jnp.float32) * w_sorted[:, None]).astype(dtype)
  sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
  y13 = _ragged_dot(a, w13, sizes)
  if b13 is not None:
    y13 = y13 + b13[sorted_ids].astype(jnp.float32)
  act = apply_activation(y13.astype(dtype), activation).astype(dtype)
  y = _ragged_dot(act, w2, sizes)
  if b2 is not None:
    y = y + b2[sorted_ids].astype(jnp.float32)
  y = y.astype(dtype)
  per_pair = jnp.zeros((t * k, y.shape[-1]), dtype).at[order].set(y).reshape(t, k, y.shape[-1])
  return _combine_slots(per_pair, topk_weights, on_input)
