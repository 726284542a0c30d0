"""MxInt4 experts (signed int4, bf16 scales per 32; routing inside the call, SPEC §8).

- `HopperMxInt4Experts` (backend HOPPER_MXINT4): `ops.mxint4_gpu.mxint4_moe` on a CUDA GPU of
  compute capability >= 9.0 with our CUDA library; weights in the
  `prepare_static_weights_for_mxint4_moe` layout.
- `ReferenceExpertsMxInt4` (backend REFERENCE): `reference.fused_moe_mxint4` on canonical
  int4-as-int8 weights, every platform.

Both run the whole layer from router logits (`apply`): the routing method is one of
`routing.RoutingMethodType`, computed as `routing.route` does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_moeq.experts.base import MoEExperts
from jax_moeq.oracle.base import (
    MXINT4_WEIGHT_KEYS, MoEActivation, MoEParallelConfig, QuantKey, RoutingMethodType,
)

Array = jax.Array

# The kernel applies silu(gate) * up (SPEC §4 kinds 0 and 2) only.
MXINT4_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.SWIGLUSTEP)
_ROUTER_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class _MxInt4ExpertsBase(MoEExperts):

  @staticmethod
  def _supports_activation(activation: MoEActivation) -> bool:
    return activation in MXINT4_ACTIVATIONS

  @staticmethod
  def _supports_parallel_config(parallel_config: MoEParallelConfig) -> bool:
    # Expert parallelism is the op's ep_rank / local_num_experts (sharding sits around the op).
    return parallel_config.tp_size == 1

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    return weight_key in MXINT4_WEIGHT_KEYS and activation_key is None

  @staticmethod
  def _supports_routing_method(routing_method: RoutingMethodType, weight_key, activation_key
                               ) -> bool:
    return routing_method != RoutingMethodType.Unspecified

  @staticmethod
  def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
    return router_logits_dtype is None or jnp.dtype(router_logits_dtype) in _ROUTER_DTYPES

  @classmethod
  def _common_reason(cls, moe_config) -> str | None:
    if moe_config.has_bias:
      return "MxInt4 experts have no biases"
    if moe_config.apply_router_weight_on_input:
      return "MxInt4 applies the router weights to the expert outputs, not the inputs"
    return None

  def _reject_unknown(self, unused, activation):
    act = self.moe_config.activation if activation is None else MoEActivation.from_str(activation)
    if act not in MXINT4_ACTIVATIONS:
      raise ValueError(f"MxInt4 experts apply silu(gate)*up only, not {act.name}")
    if unused:
      raise TypeError(f"unexpected arguments for MxInt4 experts: {sorted(unused)}")

  def _op_kwargs(self, top_k, num_expert_group, topk_group, e_score_correction_bias,
                 routed_scaling_factor, routing_method) -> dict[str, Any]:
    cfg = self.moe_config
    return dict(top_k=cfg.top_k if top_k is None else top_k,
                routing_method=cfg.routing_method if routing_method is None else routing_method,
                num_expert_group=num_expert_group, topk_group=topk_group,
                e_score_correction_bias=e_score_correction_bias,
                routed_scaling_factor=routed_scaling_factor)


class HopperMxInt4Experts(_MxInt4ExpertsBase):
  """The fused GPU kernel. `apply(x, w1=w13_packed, w2=w2_packed, router_logits,
  w1_scale=w13_scale, w2_scale=w2_scale, num_experts=E, ep_rank=0, ...)`."""

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return platform == "cuda"

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    reason = cls._common_reason(moe_config)
    if reason:
      return reason
    if moe_config.in_dtype != jnp.dtype(jnp.bfloat16):
      return f"the kernel takes bfloat16 activations, not {moe_config.in_dtype}"
    h, i = moe_config.hidden_size, moe_config.intermediate_size
    if h % 64 or i % 64:
      return f"the kernel needs H and I multiples of 64, got H={h}, I={i}"
    if moe_config.num_experts > 1024 or moe_config.top_k > 32:
      return "the routing kernel supports at most 1024 experts and top_k <= 32"
    from jax_moeq.ops import mxint4_gpu
    if not mxint4_gpu.is_mxint4_moe_available():
      return ("no CUDA GPU of compute capability >= 9.0 with jax_moeq's CUDA library "
              "(libjax_moeq_cuda.so) is available")
    return None

  def apply_routed(self, hidden_states, topk_ids, topk_weights, w1, w2, activation=None, *,
                   apply_router_weight_on_input=None, **weights):
    raise NotImplementedError("HopperMxInt4Experts routes inside the kernel: call apply() with "
                              "router logits")

  def apply(self, hidden_states: Array, w1: Any, w2: Any, router_logits: Array,
            activation=None, *, top_k: int | None = None, num_expert_group: int | None = None,
            topk_group: int | None = None, e_score_correction_bias: Array | None = None,
            routed_scaling_factor: float | None = None,
            routing_method: RoutingMethodType | None = None, w1_scale: Array = None,
            w2_scale: Array = None, num_experts: int | None = None, ep_rank: int = 0,
            **unused: Any) -> Array:
    """`mxint4_moe` on this rank's prepared experts (w1/w2 and scales from
    `prepare_static_weights_for_mxint4_moe`); `num_experts` defaults to the logits' width."""
    from jax_moeq.ops import mxint4_gpu
    self._reject_unknown(unused, activation)
    if w1_scale is None or w2_scale is None:
      raise ValueError("HopperMxInt4Experts needs w1_scale and w2_scale (prepared layout)")
    kw = self._op_kwargs(top_k, num_expert_group, topk_group, e_score_correction_bias,
                         routed_scaling_factor, routing_method)
    return mxint4_gpu.mxint4_moe(
        hidden_states, router_logits, w1, w1_scale, w2, w2_scale,
        num_experts=router_logits.shape[-1] if num_experts is None else num_experts,
        intermediate_size=self.moe_config.intermediate_size, local_num_experts=w1.shape[0],
        ep_rank=ep_rank, **kw)


class ReferenceExpertsMxInt4(_MxInt4ExpertsBase):
  """`reference.fused_moe_mxint4` (jnp, every platform) on canonical weights: `apply(x,
  w1=w13_q int8 [L, 2I, H], w2=w2_q int8 [L, H, I], router_logits, w1_scale=[L, 2I, H/32],
  w2_scale=[L, H, I/32], ep_rank=0, ...)`."""

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    reason = cls._common_reason(moe_config)
    if reason:
      return reason
    h, i = moe_config.hidden_size, moe_config.intermediate_size
    if h % 32 or i % 32:
      return f"MxInt4 groups of 32 must divide H={h} and I={i}"
    return None

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array, w1: Any,
                   w2: Any, activation=None, *, apply_router_weight_on_input=None,
                   w1_scale: Array = None, w2_scale: Array = None, **unused: Any) -> Array:
    """Already-routed tokens (local ids): the WNA16 reference with group 32 is the same
    arithmetic."""
    from jax_moeq import reference
    self._reject_unknown(unused, activation)
    return reference.fused_moe_wna16(hidden_states, topk_ids, topk_weights, w1, w1_scale, w2,
                                     w2_scale, 32)

  def apply(self, hidden_states: Array, w1: Any, w2: Any, router_logits: Array,
            activation=None, *, top_k: int | None = None, num_expert_group: int | None = None,
            topk_group: int | None = None, e_score_correction_bias: Array | None = None,
            routed_scaling_factor: float | None = None,
            routing_method: RoutingMethodType | None = None, w1_scale: Array = None,
            w2_scale: Array = None, num_experts: int | None = None, ep_rank: int = 0,
            **unused: Any) -> Array:
    from jax_moeq import reference
    self._reject_unknown(unused, activation)
    if w1_scale is None or w2_scale is None:
      raise ValueError("ReferenceExpertsMxInt4 needs w1_scale and w2_scale")
    if num_experts is not None and num_experts != router_logits.shape[-1]:
      raise ValueError(f"num_experts={num_experts} but router_logits has "
                       f"{router_logits.shape[-1]} columns")
    kw = self._op_kwargs(top_k, num_expert_group, topk_group, e_score_correction_bias,
                         routed_scaling_factor, routing_method)
    local = w1.shape[0]
    return reference.fused_moe_mxint4(
        hidden_states, router_logits, w1, w1_scale, w2, w2_scale,
        local_expert_offset=ep_rank * local, local_num_experts=local, **kw)
