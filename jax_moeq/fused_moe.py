"""`fused_moe`: the one call a user makes, whatever the weights' format and the platform.

    out = fused_moe(x, router_logits, weights, top_k=8)

The weights' type selects the scheme; the scheme's oracle picks the backend at
trace time from static facts (shapes, dtypes, options, platform) and logs the
choice once:

| weights | scheme | backends |
| --- | --- | --- |
| `FloatMoEWeights` | unquantized | `reference.fused_moe_float` |
| `Int4MoEWeights` | W4A8 Int8 | CPU_INT4 (packs, then the fused CPU op) or REFERENCE |
| `W4A8PackedWeights` | W4A8 Int8 | CPU_INT4, or REFERENCE on the unpacked weights |

Other schemes plug in with `register_weight_handler(WeightType, handler)`; a
handler has the signature of `_int4_w4a8_handler` below.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_moeq import reference
from jax_moeq import routing as routing_lib
from jax_moeq.oracle import base as oracle_base
from jax_moeq.oracle.base import MoEActivation, MoEConfig
from jax_moeq.weights import (
    FloatMoEWeights, Int4MoEWeights, W4A8PackedWeights, unpack_w4a8, validate_float_weights,
    validate_int4_weights, validate_w4a8_packed_weights,
)

Array = jax.Array

__all__ = ["FusedMoEOptions", "fused_moe", "register_weight_handler"]


@dataclasses.dataclass(frozen=True)
class FusedMoEOptions:
  """The static options of one `fused_moe` call, as handlers receive them.

  `platform` is the platform the computation runs on (see
  `oracle.base.detect_platform`). `routing_kwargs()` gives `select_experts`'s
  keyword arguments; `e_score_correction_bias` (an array) is passed apart.
  """
  top_k: int
  renormalize: bool
  activation: MoEActivation
  moe_backend: str
  scoring_func: str
  use_grouped_topk: bool
  num_expert_group: int | None
  topk_group: int | None
  routed_scaling_factor: float
  apply_router_weight_on_input: bool
  platform: str

  @property
  def routing_method(self) -> routing_lib.RoutingMethodType:
    return oracle_base.routing_method_for(renormalize=self.renormalize,
                                          scoring_func=self.scoring_func,
                                          use_grouped_topk=self.use_grouped_topk)

  def routing_kwargs(self) -> dict[str, Any]:
    return dict(top_k=self.top_k, renormalize=self.renormalize, scoring_func=self.scoring_func,
                use_grouped_topk=self.use_grouped_topk, num_expert_group=self.num_expert_group,
                topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)

  def moe_config(self, *, num_experts: int, hidden_size: int, intermediate_size: int,
                 has_bias: bool, in_dtype, router_logits_dtype) -> MoEConfig:
    """The oracle's view of this call."""
    return MoEConfig(
        num_experts=num_experts, top_k=self.top_k, hidden_size=hidden_size,
        intermediate_size=intermediate_size, activation=self.activation,
        apply_router_weight_on_input=self.apply_router_weight_on_input,
        routing_method=self.routing_method, router_logits_dtype=router_logits_dtype,
        has_bias=has_bias, in_dtype=in_dtype, platform=self.platform,
        moe_backend=self.moe_backend)


# handler(x [T, H], router_logits [T, E], weights, options, e_score_correction_bias) -> [T, H]
WeightHandler = Callable[[Array, Array, Any, FusedMoEOptions, Array | None], Array]
_WEIGHT_HANDLERS: dict[type, WeightHandler] = {}


def register_weight_handler(weight_type: type, handler: WeightHandler) -> None:
  """Makes `fused_moe` run weights of `weight_type` with `handler` (one handler per type)."""
  if not isinstance(weight_type, type):
    raise TypeError(f"weight_type must be a class, got {weight_type!r}")
  _WEIGHT_HANDLERS[weight_type] = handler


# ------------------------------------------------------------------ handlers
def _float_handler(x, router_logits, weights: FloatMoEWeights, options: FusedMoEOptions,
                   e_score_correction_bias):
  validate_float_weights(weights)
  if options.moe_backend not in (oracle_base.AUTO, "reference", "jnp"):
    raise ValueError(f"moe_backend={options.moe_backend!r} is not supported for unquantized "
                     "MoE weights (FloatMoEWeights). Expected one of ['auto', 'reference'].")
  act = options.activation
  act.kernel_kind  # raises for activations without a kernel kind (GELU, RELU2_NO_MUL)
  oracle_base.log_once(logging.INFO, "Using the REFERENCE (jax.numpy, float32 GEMMs) backend "
                       "for unquantized MoE weights.")
  topk_weights, topk_ids = routing_lib.select_experts(
      router_logits, e_score_correction_bias=e_score_correction_bias, **options.routing_kwargs())
  return reference.fused_moe_float(
      x, topk_ids, topk_weights, weights.w13, weights.w2, w13_bias=weights.w13_bias,
      w2_bias=weights.w2_bias, apply_router_weight_on_input=options.apply_router_weight_on_input,
      activation_kind=act.kernel_kind)


def _select_w4a8(x, router_logits, num_experts: int, hidden_size: int, intermediate_size: int,
                 group_size: int, has_bias: bool, options: FusedMoEOptions):
  from jax_moeq.oracle import w4a8_int8
  config = options.moe_config(num_experts=num_experts, hidden_size=hidden_size,
                              intermediate_size=intermediate_size, has_bias=has_bias,
                              in_dtype=x.dtype, router_logits_dtype=router_logits.dtype)
  weight_key = oracle_base.w4a8_weight_key(group_size)
  backend, experts_cls = w4a8_int8.select_w4a8_int8_moe_backend(config, weight_key, None)
  block_shape = (-1, 1) if group_size == -1 else (1, group_size)
  experts = experts_cls(config, w4a8_int8.make_w4a8_int8_moe_quant_config(block_shape))
  return backend, experts


def _apply_w4a8(backend, experts, x, router_logits, int4_weights: Int4MoEWeights | None,
                packed: W4A8PackedWeights | None, options: FusedMoEOptions,
                e_score_correction_bias):
  from jax_moeq.oracle.w4a8_int8 import W4A8Int8MoeBackend
  route = dict(options.routing_kwargs(), e_score_correction_bias=e_score_correction_bias)
  common = dict(activation=options.activation,
                apply_router_weight_on_input=options.apply_router_weight_on_input, **route)
  if backend == W4A8Int8MoeBackend.CPU_INT4:
    if packed is None:
      from jax_moeq.weights import pack_w4a8
      packed = pack_w4a8(int4_weights)
    return experts.apply(x, packed.w13_packed, packed.w2_packed, router_logits, **common)
  if int4_weights is None:
    int4_weights = unpack_w4a8(packed)
  w = int4_weights
  return experts.apply(x, w.w13_q, w.w2_q, router_logits, w1_scale=w.w13_scale,
                       w2_scale=w.w2_scale, w1_bias=w.w13_bias, w2_bias=w.w2_bias, **common)


def _int4_w4a8_handler(x, router_logits, weights: Int4MoEWeights, options: FusedMoEOptions,
                       e_score_correction_bias):
  validate_int4_weights(weights)
  backend, experts = _select_w4a8(x, router_logits, weights.num_experts, weights.hidden_size,
                                  weights.intermediate_size, weights.group_size,
                                  weights.has_bias, options)
  return _apply_w4a8(backend, experts, x, router_logits, weights, None, options,
                     e_score_correction_bias)


def _packed_w4a8_handler(x, router_logits, weights: W4A8PackedWeights, options: FusedMoEOptions,
                         e_score_correction_bias):
  validate_w4a8_packed_weights(weights)
  # The packed buffers always carry a bias slot (zeros when absent), which costs nothing.
  backend, experts = _select_w4a8(x, router_logits, weights.num_experts, weights.hidden_size,
                                  weights.intermediate_size, weights.group_size, True, options)
  return _apply_w4a8(backend, experts, x, router_logits, None, weights, options,
                     e_score_correction_bias)


register_weight_handler(FloatMoEWeights, _float_handler)
register_weight_handler(Int4MoEWeights, _int4_w4a8_handler)
register_weight_handler(W4A8PackedWeights, _packed_w4a8_handler)


# ------------------------------------------------------------------ entry point
def fused_moe(
    x: Array,
    router_logits: Array,
    weights: Any,
    *,
    top_k: int,
    renormalize: bool = True,
    activation: str | MoEActivation = "silu",
    moe_backend: str = "auto",
    scoring_func: str = "softmax",
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: Array | None = None,
    routed_scaling_factor: float = 1.0,
    apply_router_weight_on_input: bool = False,
) -> Array:
  """A Mixture-of-Experts layer: routing (SPEC §5), expert MLPs, weighted top-k sum.

  Args:
    x: [..., H] hidden states (float32, bfloat16 or float16); leading dims are
      flattened into tokens and restored.
    router_logits: [..., E] with the same leading dims as x.
    weights: `FloatMoEWeights`, `Int4MoEWeights` or `W4A8PackedWeights` (or a
      type added with `register_weight_handler`).
    top_k: experts per token.
    renormalize: divide the chosen weights by their sum.
    activation: "silu" (default), "swiglu"/"swiglustep", "swigluoai", or a MoEActivation.
    moe_backend: "auto" (the oracle's choice), or a backend of the weights'
      scheme: "cpu"/"cpu_int4", "reference"/"jnp" for W4A8.
    scoring_func, use_grouped_topk, num_expert_group, topk_group,
    e_score_correction_bias, routed_scaling_factor: routing, as
      `routing.select_experts`.
    apply_router_weight_on_input: scale the GEMM1 input by the router weight
      instead of the expert output.

  Returns:
    [..., H] in x's dtype.

  The backend is chosen at trace time and logged once (logger "jax_moeq.oracle").
  `Int4MoEWeights` on CPU_INT4 are packed on every call: pack once with
  `weights.pack_w4a8` to serve many calls.
  """
  x = jnp.asarray(x)
  router_logits = jnp.asarray(router_logits)
  if x.ndim < 1:
    raise ValueError("x must be [..., H], got a scalar")
  if router_logits.ndim < 1 or router_logits.shape[:-1] != x.shape[:-1]:
    raise ValueError(f"router_logits must be [..., E] with the leading dims of x "
                     f"{x.shape[:-1]}, got shape {router_logits.shape}")
  handler = None
  for cls in type(weights).__mro__:
    handler = _WEIGHT_HANDLERS.get(cls)
    if handler is not None:
      break
  if handler is None:
    raise TypeError(f"weights must be one of {[t.__name__ for t in _WEIGHT_HANDLERS]}, got "
                    f"{type(weights).__name__}")
  if not isinstance(top_k, int) or isinstance(top_k, bool):
    raise TypeError(f"top_k must be an int, got {top_k!r}")
  options = FusedMoEOptions(
      top_k=top_k, renormalize=bool(renormalize), activation=MoEActivation.from_str(activation),
      moe_backend=str(moe_backend).strip().lower(), scoring_func=scoring_func,
      use_grouped_topk=bool(use_grouped_topk), num_expert_group=num_expert_group,
      topk_group=topk_group, routed_scaling_factor=float(routed_scaling_factor),
      apply_router_weight_on_input=bool(apply_router_weight_on_input),
      platform=oracle_base.detect_platform(x, router_logits))
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  logits2 = router_logits.reshape(-1, router_logits.shape[-1])
  out = handler(x2, logits2, weights, options, e_score_correction_bias)
  return out.reshape(*lead, out.shape[-1])
