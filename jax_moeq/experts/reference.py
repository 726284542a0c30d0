"""Pure jax.numpy W4A8 experts (the REFERENCE backend of the W4A8 Int8 scheme).

They run `reference.fused_moe_w4a8` on the canonical unpacked weights, with the same rounding
points as the fused CPU kernel, so they are also the fallback when the kernel does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jax_moeq import reference
from jax_moeq.experts.base import MoEExperts, check_int4_weights, require_arrays
from jax_moeq.experts.cpu_int4 import w4a8_scales
from jax_moeq.oracle.base import W4A8_WEIGHT_KEYS, QuantKey, kInt8DynamicTokenAsym
from jax_moeq.weights import Int4MoEWeights, W4A8PackedWeights, fold_w2_act_order

Array = jax.Array

_NAMES = ("w13_q", "w13_scale", "w2_q", "w2_scale")
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class ReferenceExpertsW4A8(MoEExperts):
  """`reference.fused_moe_w4a8` behind the experts interface; any routing, any platform.

  Prepared arrays: {"w13_q", "w13_scale", "w2_q", "w2_scale"} (+ "w13_bias", "w2_bias"): the
  `Int4MoEWeights` fields, scales in the W4A8 dtypes (`cpu_int4.w4a8_scales`).
  """

  backend_name = "reference"

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    return weight_key in W4A8_WEIGHT_KEYS and activation_key in (None, kInt8DynamicTokenAsym)

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    if moe_config.in_dtype not in _KERNEL_DTYPES:
      return f"the reference does not support {moe_config.in_dtype} input/output dtype"
    h, i, g = moe_config.hidden_size, moe_config.intermediate_size, weight_key.group_size
    if g != -1 and (h % g or i % g):
      return f"group_size={g} does not divide H={h} and I={i}"
    return None

  def _group_size(self) -> int:
    if self.quant_config is None:
      raise ValueError("ReferenceExpertsW4A8 needs a quant_config to know the group size")
    return self.quant_config.group_size

  def prepare(self, weights: Int4MoEWeights | W4A8PackedWeights) -> dict[str, Array]:
    """The kernel's values: packed weights unpacked as stored (f32 scales), int4 weights with
    their scales in the W4A8 dtypes (`w4a8_scales`, as `CPUExpertsInt4.prepare` packs them)."""
    w = check_int4_weights(weights)
    if w.group_size != self._group_size():
      raise ValueError(f"weights have group_size={w.group_size}, the experts were built for "
                       f"group_size={self._group_size()}")
    if w.w13_g_idx is not None:
      raise ValueError("W4A8 weights with act-order on w13 (w13_g_idx) are not supported")
    w = fold_w2_act_order(w)
    if not isinstance(weights, W4A8PackedWeights):
      w = w4a8_scales(w)
    arrays = {"w13_q": w.w13_q, "w13_scale": w.w13_scale, "w2_q": w.w2_q,
              "w2_scale": w.w2_scale}
    for name in ("w13_bias", "w2_bias"):
      if getattr(w, name) is not None:
        arrays[name] = getattr(w, name)
    return arrays

  def canonical(self, arrays: Mapping[str, Array]) -> Int4MoEWeights:
    require_arrays(type(self).__name__, arrays, _NAMES)
    return Int4MoEWeights(arrays["w13_q"], arrays["w13_scale"], arrays["w2_q"],
                          arrays["w2_scale"], self._group_size(), arrays.get("w13_bias"),
                          arrays.get("w2_bias"))

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    """`reference.fused_moe_w4a8` on routed tokens."""
    require_arrays(type(self).__name__, weights, _NAMES)
    return reference.fused_moe_w4a8(
        hidden_states, topk_ids, topk_weights, weights["w13_q"], weights["w13_scale"],
        weights["w2_q"], weights["w2_scale"], self._group_size(),
        w13_bias=weights.get("w13_bias"), w2_bias=weights.get("w2_bias"),
        apply_router_weight_on_input=self.apply_router_weight_on_input,
        activation_kind=self.activation.kernel_kind)
