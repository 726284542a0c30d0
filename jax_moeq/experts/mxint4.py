"""MxInt4 experts (signed int4, bf16 scales per 32; routing inside the call, SPEC §8).

- `HopperMxInt4Experts` (backend HOPPER_MXINT4): `ops.mxint4_gpu.mxint4_moe` on a CUDA GPU of
  compute capability >= 9.0 with our CUDA library; weights in the
  `prepare_static_weights_for_mxint4_moe` layout.
- `ReferenceExpertsMxInt4` (backend REFERENCE): `reference.fused_moe_mxint4` on canonical
  int4-as-int8 weights, every platform.

The config's routing method is the kernel-side method (`routing.route`) the layer computes;
`RoutingMethodType.Unspecified` says the layer's `select_experts` options have none, which only
the reference runs (routing on the host, then the experts).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jax_moeq import reference
from jax_moeq import routing as routing_lib
from jax_moeq.experts.base import MoEExperts, add_residual, check_int4_weights, require_arrays
from jax_moeq.oracle.base import (
    MXINT4_WEIGHT_KEYS, MoEActivation, MoEConfig, MoEParallelConfig, QuantKey, RoutingMethodType,
    RoutingOptions,
)
from jax_moeq.ops import mxint4_gpu
from jax_moeq.weights import Int4MoEWeights

Array = jax.Array

# The kernel applies silu(gate) * up (SPEC §4 kinds 0 and 2) only.
MXINT4_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.SWIGLUSTEP)
MXINT4_GROUP_SIZE = 32
_ROUTER_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_GPU_ARRAYS = tuple(mxint4_gpu.WEIGHT_KEYS)
_REFERENCE_ARRAYS = ("w13_q", "w13_scale", "w2_q", "w2_scale")


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
  def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
    return router_logits_dtype is None or jnp.dtype(router_logits_dtype) in _ROUTER_DTYPES

  @classmethod
  def _common_reason(cls, moe_config: MoEConfig) -> str | None:
    if moe_config.has_bias:
      return "MxInt4 experts have no biases"
    if moe_config.apply_router_weight_on_input:
      return "MxInt4 applies the router weights to the expert outputs, not the inputs"
    return None

  def _check_int4(self, weights: Int4MoEWeights) -> Int4MoEWeights:
    w = check_int4_weights(weights)
    if w.group_size != MXINT4_GROUP_SIZE:
      raise ValueError(f"MxInt4 weights have group_size={MXINT4_GROUP_SIZE}, got "
                       f"group_size={w.group_size}")
    if w.has_act_order:
      raise ValueError("MxInt4 weights have no act-order (g_idx)")
    if w.has_bias:
      raise ValueError("MxInt4 experts have no biases")
    return w

  def _kernel_routing(self, routing: RoutingOptions | None) -> RoutingOptions:
    """`routing` (default from the config), checked to compute the config's kernel method."""
    routing = self.default_routing() if routing is None else routing
    method = self.moe_config.routing_method
    if routing.kernel_routing_method != method:
      raise ValueError(f"routing={routing} computes kernel routing method "
                       f"{routing.kernel_routing_method}, but the experts were built for "
                       f"{method.name}")
    return routing

  def _route_kwargs(self, routing: RoutingOptions, e_score_correction_bias) -> dict:
    return dict(top_k=routing.top_k, routing_method=self.moe_config.routing_method,
                e_score_correction_bias=e_score_correction_bias,
                **routing.kernel_routing_kwargs())

  def route(self, router_logits: Array, routing: RoutingOptions | None = None,
            e_score_correction_bias: Array | None = None) -> tuple[Array, Array]:
    """The (topk_weights f32, topk_ids int32 global) [T, K] that `apply` routes with."""
    routing = self._kernel_routing(routing)
    return routing_lib.route(router_logits, **self._route_kwargs(routing,
                                                                 e_score_correction_bias))


class HopperMxInt4Experts(_MxInt4ExpertsBase):
  """The fused GPU kernel, routing inside. Prepared arrays: {"gemm1_weights", "gemm1_scales",
  "gemm2_weights", "gemm2_scales"} (`prepare_static_weights_for_mxint4_moe`) of this rank's
  experts (global ids from `parallel_config.ep_rank` times their count)."""

  backend_name = "mxint4_gpu"
  routes_inside = True

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return platform == "cuda"

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    reason = cls._common_reason(moe_config)
    if reason:
      return reason
    if moe_config.routing_method == RoutingMethodType.Unspecified:
      return "the layer's routing has no kernel-side routing method (SPEC §5)"
    if moe_config.in_dtype != jnp.dtype(jnp.bfloat16):
      return f"the kernel takes bfloat16 activations, not {moe_config.in_dtype}"
    h, i = moe_config.hidden_size, moe_config.intermediate_size
    if h % 64 or i % 64:
      return f"the kernel needs H and I multiples of 64, got H={h}, I={i}"
    if moe_config.num_experts > 1024 or moe_config.top_k > 32:
      return "the routing kernel supports at most 1024 experts and top_k <= 32"
    if not mxint4_gpu.is_mxint4_moe_available():
      return ("no CUDA GPU of compute capability >= 9.0 with jax_moeq's CUDA library "
              "(libjax_moeq_cuda.so) is available")
    return None

  def prepare(self, weights: Int4MoEWeights) -> dict[str, Array]:
    w = self._check_int4(weights)
    return mxint4_gpu.prepare_static_weights_for_mxint4_moe(
        mxint4_gpu.int8_to_signed_nibbles(jnp.asarray(w.w13_q)),
        jnp.asarray(w.w13_scale, jnp.bfloat16),
        mxint4_gpu.int8_to_signed_nibbles(jnp.asarray(w.w2_q)),
        jnp.asarray(w.w2_scale, jnp.bfloat16))

  def route(self, router_logits: Array, routing: RoutingOptions | None = None,
            e_score_correction_bias: Array | None = None) -> tuple[Array, Array]:
    """The kernel's own routing step (`mxint4_routing`): the bits `apply` routes with."""
    routing = self._kernel_routing(routing)
    return mxint4_gpu.mxint4_routing(router_logits,
                                     **self._route_kwargs(routing, e_score_correction_bias))

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    """One slot per token (topk_ids / topk_weights [T, 1], local ids; outside [0, L): nothing),
    as expert parallelism's exchanged pairs run. The kernel routes TopK over logits that hold
    the pair's weight at its expert, so each row's output is round(y2 · w), the fused op's
    arithmetic for that pair. More slots per token have no such logits (TopK would reorder
    them): NotImplementedError."""
    require_arrays(type(self).__name__, weights, _GPU_ARRAYS)
    if topk_ids.ndim != 2 or topk_ids.shape != topk_weights.shape or (
        topk_ids.shape[0] != hidden_states.shape[0]):
      raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must "
                       f"both be [tokens={hidden_states.shape[0]}, K]")
    if topk_ids.shape[1] != 1:
      raise NotImplementedError("HopperMxInt4Experts routes inside the kernel: routed pairs run "
                                "one slot per row (K=1); call apply() with router logits")
    w13 = weights["gemm1_weights"]
    local = w13.shape[0]
    ids = topk_ids[:, 0].astype(jnp.int32)
    valid = (ids >= 0) & (ids < local)
    # A row without a local pair routes to expert 0 with weight 0 and zero input: output +0.
    rows = jnp.where(valid[:, None], hidden_states, jnp.zeros((), hidden_states.dtype))
    weight = jnp.where(valid, topk_weights[:, 0].astype(jnp.float32), 0.0)
    target = jnp.where(valid, ids, 0)
    logits = jnp.where(jnp.arange(local)[None, :] == target[:, None], weight[:, None],
                       -jnp.inf).astype(jnp.float32)
    return mxint4_gpu.mxint4_moe(
        rows, logits, w13, weights["gemm1_scales"], weights["gemm2_weights"],
        weights["gemm2_scales"], num_experts=local, top_k=1,
        intermediate_size=self.moe_config.intermediate_size, local_num_experts=local,
        ep_rank=0, routing_method=RoutingMethodType.TopK)

  def apply(self, hidden_states: Array, router_logits: Array, weights: Mapping[str, Array],
            routing: RoutingOptions | None = None,
            e_score_correction_bias: Array | None = None,
            residual: Array | None = None) -> Array:
    """`mxint4_moe` on this rank's prepared experts; logits over all (global) experts."""
    require_arrays(type(self).__name__, weights, _GPU_ARRAYS)
    routing = self._kernel_routing(routing)
    w13 = weights["gemm1_weights"]
    return add_residual(mxint4_gpu.mxint4_moe(
        hidden_states, router_logits, w13, weights["gemm1_scales"], weights["gemm2_weights"],
        weights["gemm2_scales"], num_experts=router_logits.shape[-1],
        intermediate_size=self.moe_config.intermediate_size, local_num_experts=w13.shape[0],
        ep_rank=self.moe_config.parallel_config.ep_rank,
        **self._route_kwargs(routing, e_score_correction_bias)), residual)


class ReferenceExpertsMxInt4(_MxInt4ExpertsBase):
  """`reference.fused_moe_mxint4` (jnp, every platform). Prepared arrays: {"w13_q",
  "w13_scale", "w2_q", "w2_scale"}: int8 [L, 2I, H] / [L, H, I] and bf16 scales per 32."""

  backend_name = "reference"

  @staticmethod
  def _supports_routing_method(routing_method: RoutingMethodType, weight_key, activation_key
                               ) -> bool:
    return True  # Unspecified: routed on the host (select_experts), then the experts

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    reason = cls._common_reason(moe_config)
    if reason:
      return reason
    h, i = moe_config.hidden_size, moe_config.intermediate_size
    if h % MXINT4_GROUP_SIZE or i % MXINT4_GROUP_SIZE:
      return f"MxInt4 groups of {MXINT4_GROUP_SIZE} must divide H={h} and I={i}"
    return None

  def prepare(self, weights: Int4MoEWeights) -> dict[str, Array]:
    w = self._check_int4(weights)
    return {"w13_q": jnp.asarray(w.w13_q), "w13_scale": jnp.asarray(w.w13_scale, jnp.bfloat16),
            "w2_q": jnp.asarray(w.w2_q), "w2_scale": jnp.asarray(w.w2_scale, jnp.bfloat16)}

  def canonical(self, arrays: Mapping[str, Array]) -> Int4MoEWeights:
    require_arrays(type(self).__name__, arrays, _REFERENCE_ARRAYS)
    return Int4MoEWeights(arrays["w13_q"], arrays["w13_scale"], arrays["w2_q"],
                          arrays["w2_scale"], MXINT4_GROUP_SIZE)

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    """Already-routed tokens (local ids): the WNA16 reference with group 32 is the same
    arithmetic."""
    require_arrays(type(self).__name__, weights, _REFERENCE_ARRAYS)
    return reference.fused_moe_wna16(hidden_states, topk_ids, topk_weights, weights["w13_q"],
                                     weights["w13_scale"], weights["w2_q"], weights["w2_scale"],
                                     MXINT4_GROUP_SIZE)

  def apply(self, hidden_states: Array, router_logits: Array, weights: Mapping[str, Array],
            routing: RoutingOptions | None = None,
            e_score_correction_bias: Array | None = None,
            residual: Array | None = None) -> Array:
    """Kernel-side routing as the GPU kernel computes it (`reference.fused_moe_mxint4`, this
    rank's experts only); host routing when the config's method is Unspecified."""
    require_arrays(type(self).__name__, weights, _REFERENCE_ARRAYS)
    local = weights["w13_q"].shape[0]
    if self.moe_config.routing_method == RoutingMethodType.Unspecified:
      if local != router_logits.shape[-1]:
        raise ValueError(f"host routing needs every expert local: the weights hold {local} of "
                         f"{router_logits.shape[-1]} experts")
      return super().apply(hidden_states, router_logits, weights, routing,
                           e_score_correction_bias, residual)
    routing = self._kernel_routing(routing)
    return add_residual(reference.fused_moe_mxint4(
        hidden_states, router_logits, weights["w13_q"], weights["w13_scale"], weights["w2_q"],
        weights["w2_scale"], local_expert_offset=self.moe_config.parallel_config.ep_rank * local,
        local_num_experts=local, **self._route_kwargs(routing, e_score_correction_bias)),
        residual)
