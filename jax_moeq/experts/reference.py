"""Pure jax.numpy experts (the REFERENCE backend): exact, every platform, slow.

They run `jax_moeq.reference` on the canonical unpacked weights, with the same
rounding points as the fused kernels, so they are also the fallback when no
kernel fits a deployment.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_moeq.experts.base import MoEExperts
from jax_moeq.oracle.base import (
    W4A8_WEIGHT_KEYS, MoEActivation, QuantKey, kInt8DynamicTokenAsym,
)

Array = jax.Array


class ReferenceExpertsW4A8(MoEExperts):
  """`reference.fused_moe_w4a8` behind the experts interface.

  `apply(hidden_states, w1=w13_q, w2=w2_q, router_logits, ..., w1_scale=...,
  w2_scale=..., w1_bias=None, w2_bias=None)`: int4-as-int8 weights and their
  scales (`weights.Int4MoEWeights` fields). Any routing method (routing runs in
  jnp before the experts), any platform.
  """

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    return weight_key in W4A8_WEIGHT_KEYS and activation_key in (None, kInt8DynamicTokenAsym)

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    import jax.numpy as jnp
    if moe_config.in_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                   jnp.dtype(jnp.float16)):
      return f"the reference does not support {moe_config.in_dtype} input/output dtype"
    h, i, g = moe_config.hidden_size, moe_config.intermediate_size, weight_key.group_size
    if g != -1 and (h % g or i % g):
      return f"group_size={g} does not divide H={h} and I={i}"
    return None

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array, w1: Any,
                   w2: Any, activation: MoEActivation | str | None = None, *,
                   apply_router_weight_on_input: bool | None = None, w1_scale: Array = None,
                   w2_scale: Array = None, w1_bias: Array | None = None,
                   w2_bias: Array | None = None) -> Array:
    """`reference.fused_moe_w4a8` on routed tokens."""
    from jax_moeq import reference
    if w1_scale is None or w2_scale is None:
      raise ValueError("ReferenceExpertsW4A8 needs w1_scale and w2_scale (unpacked int4 weights)")
    act, on_input = self._resolve(activation, apply_router_weight_on_input)
    group_size = self.quant_config.group_size if self.quant_config is not None else None
    if group_size is None:
      raise ValueError("ReferenceExpertsW4A8 needs a quant_config to know the group size")
    return reference.fused_moe_w4a8(
        hidden_states, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, group_size,
        w13_bias=w1_bias, w2_bias=w2_bias, apply_router_weight_on_input=on_input,
        activation_kind=act.kernel_kind)
