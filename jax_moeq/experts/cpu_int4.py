"""CPU W4A8 experts: int4 weights, dynamic per-token int8 activations, one fused FFI call.

The experts route on the host side (`routing.select_experts`) and call
`ops.w4a8_cpu.dynamic_4bit_int_moe` on weights packed by
`convert_to_w4a8_int8_moe_format` (or `weights.pack_w4a8`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_moeq.experts.base import MoEExperts
from jax_moeq.oracle.base import (
    W4A8_WEIGHT_KEYS, MoEActivation, MoEConfig, QuantKey, RoutingMethodType,
    kInt8DynamicTokenAsym,
)

Array = jax.Array

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ALIGNMENT = 16  # H and I: the packed layout's 16-row tiles


class CPUExpertsInt4(MoEExperts):
  """The fused CPU W4A8 MoE (`dynamic_4bit_int_moe`, SPEC §4).

  `apply(hidden_states, w1=w13_packed, w2=w2_packed, router_logits, ...)`:
  w1 / w2 are the uint8 [E, bytes] buffers (scales and biases inside).
  """

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return platform == "cpu"

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    # Activations arrive unquantized (activation_key None) and are quantized inside the kernel.
    return weight_key in W4A8_WEIGHT_KEYS and activation_key in (None, kInt8DynamicTokenAsym)

  @staticmethod
  def _supports_routing_method(routing_method: RoutingMethodType, weight_key, activation_key
                               ) -> bool:
    return routing_method in (RoutingMethodType.Default, RoutingMethodType.Renormalize,
                              RoutingMethodType.RenormalizeNaive)

  @staticmethod
  def _supports_expert_map() -> bool:
    return False

  @classmethod
  def _unsupported_reason(cls, moe_config: MoEConfig, weight_key: QuantKey | None,
                          activation_key: QuantKey | None) -> str | None:
    if moe_config.in_dtype not in KERNEL_DTYPES:
      return f"the kernel does not support {moe_config.in_dtype} input/output dtype"
    h, i = moe_config.hidden_size, moe_config.intermediate_size
    if h % ALIGNMENT or i % ALIGNMENT:
      return f"H={h} and I={i} must be multiples of {ALIGNMENT}"
    g = weight_key.group_size
    if g != -1 and (h % g or i % g):
      return f"group_size={g} does not divide H={h} and I={i}"
    from jax_moeq import _ffi
    if not _ffi.cpu_library_available():
      return "the CPU library jax_moeq._cpu_ffi is not built (pip install . or scripts/dev_build.sh)"
    return None

  def _group_size(self) -> int:
    if self.quant_config is not None:
      return self.quant_config.group_size
    raise ValueError("CPUExpertsInt4 needs a quant_config (make_w4a8_int8_moe_quant_config) "
                     "to know the group size")

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array, w1: Any,
                   w2: Any, activation: MoEActivation | str | None = None, *,
                   apply_router_weight_on_input: bool | None = None, **weights: Any) -> Array:
    """`dynamic_4bit_int_moe` on routed tokens; w1 / w2 are the packed buffers."""
    if weights:
      raise ValueError(f"CPUExpertsInt4 takes packed w1/w2 only (scales and biases are inside "
                       f"them); got extra arguments {sorted(weights)}")
    from jax_moeq.ops.w4a8_cpu import dynamic_4bit_int_moe
    act, on_input = self._resolve(activation, apply_router_weight_on_input)
    h, i = self.moe_config.hidden_size, self.moe_config.intermediate_size
    return dynamic_4bit_int_moe(hidden_states, topk_ids, topk_weights, w1, w2, h, i, 2 * i,
                                self._group_size(), apply_router_weight_on_input=on_input,
                                activation_kind=act.kernel_kind)
