"""Base class of the experts implementations the oracles choose between.

An experts class runs a whole MoE layer (routing included, vLLM's
"monolithic" experts) for one backend. The oracle asks the class, before
building it, whether it fits a deployment:

  supported, reason = cls.is_supported_config(config, weight_key, activation_key,
                                              activation_format)

`is_supported_config` checks, in this order, and returns the first failure's
reason (phrased to follow "... does not support the deployment configuration
since <reason>."): device, act-and-mul, activation, activation format,
parallel config, quantization scheme, routing method, router-logits dtype,
expert map, then `_unsupported_reason` for anything backend-specific (native
library present, dtypes, shape alignment). Subclasses override the
`_supports_*` hooks; the defaults are permissive where that is safe.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp

from jax_moeq.oracle.base import (
    FusedMoEActivationFormat, MoEActivation, MoEConfig, MoEParallelConfig, QuantKey,
    RoutingMethodType,
)
from jax_moeq import routing as routing_lib

Array = jax.Array

GATED_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUSTEP)


class MoEExperts(abc.ABC):
  """A backend's experts: `is_supported_config` (class level) and `apply` (instance)."""

  def __init__(self, moe_config: MoEConfig, quant_config: Any = None):
    self.moe_config = moe_config
    self.quant_config = quant_config

  # ---------------------------------------------------------------- support checks
  @classmethod
  def is_supported_config(cls, moe_config: MoEConfig, weight_key: QuantKey | None,
                          activation_key: QuantKey | None,
                          activation_format: FusedMoEActivationFormat | None = None,
                          ) -> tuple[bool, str | None]:
    """(True, None) if this class can run `moe_config`, else (False, reason)."""
    if activation_format is None:
      activation_format = moe_config.activation_format
    platform = moe_config.resolved_platform
    if not cls._supports_current_device(platform):
      return False, f"the kernel does not run on platform {platform!r}"
    act = moe_config.activation
    if not act.is_act_and_mul and not cls._supports_no_act_and_mul():
      return False, f"the kernel needs a gated (act-and-mul) activation, not {act.name}"
    if not cls._supports_activation(act):
      return False, f"the kernel does not support the {act.name} activation"
    if activation_format != cls.activation_format():
      return False, (f"the kernel takes the {cls.activation_format().name} activation format, "
                     f"not {activation_format.name}")
    pc = moe_config.parallel_config
    if not cls._supports_parallel_config(pc):
      return False, (f"the kernel does not support the parallel config tp_size={pc.tp_size}, "
                     f"ep_size={pc.ep_size} inside the op (shard outside it with shard_map)")
    if not cls._supports_quant_scheme(weight_key, activation_key):
      return False, (f"the kernel does not support the quantization scheme weight="
                     f"{weight_key}, activation={activation_key}")
    rm = moe_config.routing_method
    if not cls._supports_routing_method(rm, weight_key, activation_key):
      return False, f"the kernel does not support the routing method {rm.name}"
    if not cls._supports_router_logits_dtype(moe_config.router_logits_dtype, rm):
      return False, f"the kernel does not support router logits of dtype {moe_config.router_logits_dtype}"
    if moe_config.has_expert_map and not cls._supports_expert_map():
      return False, "the kernel does not support an expert map (expert parallelism inside the op)"
    reason = cls._unsupported_reason(moe_config, weight_key, activation_key)
    if reason is not None:
      return False, reason
    return True, None

  @staticmethod
  def activation_format() -> FusedMoEActivationFormat:
    return FusedMoEActivationFormat.Standard

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return True

  @staticmethod
  def _supports_no_act_and_mul() -> bool:
    return False

  @staticmethod
  def _supports_activation(activation: MoEActivation) -> bool:
    return activation in GATED_ACTIVATIONS

  @staticmethod
  def _supports_parallel_config(parallel_config: MoEParallelConfig) -> bool:
    return parallel_config.tp_size == 1 and parallel_config.ep_size == 1

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    return False

  @staticmethod
  def _supports_routing_method(routing_method: RoutingMethodType, weight_key: QuantKey | None,
                               activation_key: QuantKey | None) -> bool:
    return True

  @staticmethod
  def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
    return router_logits_dtype is None or jnp.issubdtype(router_logits_dtype, jnp.floating)

  @staticmethod
  def _supports_expert_map() -> bool:
    return False

  @classmethod
  def _unsupported_reason(cls, moe_config: MoEConfig, weight_key: QuantKey | None,
                          activation_key: QuantKey | None) -> str | None:
    """Backend-specific checks (libraries, dtypes, shapes): a reason, or None if fine."""
    return None

  # ---------------------------------------------------------------- compute
  def route(self, router_logits: Array, *, top_k: int | None = None,
            renormalize: bool | None = None, scoring_func: str = "softmax",
            use_grouped_topk: bool | None = None, num_expert_group: int | None = None,
            topk_group: int | None = None, e_score_correction_bias: Array | None = None,
            routed_scaling_factor: float | None = None) -> tuple[Array, Array]:
    """Host-side expert selection (`routing.select_experts`), defaults from the config.

    Returns (topk_weights f32 [T, K], topk_ids int32 [T, K]).
    """
    cfg = self.moe_config
    if top_k is None:
      top_k = cfg.top_k
    if renormalize is None:
      renormalize = cfg.routing_method in (RoutingMethodType.Renormalize,
                                           RoutingMethodType.RenormalizeNaive,
                                           RoutingMethodType.SigmoidRenorm)
    if use_grouped_topk is None:
      use_grouped_topk = num_expert_group is not None
    return routing_lib.select_experts(
        router_logits, top_k, renormalize=renormalize, scoring_func=scoring_func,
        use_grouped_topk=use_grouped_topk, num_expert_group=num_expert_group,
        topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=1.0 if routed_scaling_factor is None else routed_scaling_factor)

  @abc.abstractmethod
  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array, w1: Any,
                   w2: Any, activation: MoEActivation | str | None = None, *,
                   apply_router_weight_on_input: bool | None = None, **weights: Any) -> Array:
    """The experts on already-routed tokens: [T, H] -> [T, H]."""

  def apply(self, hidden_states: Array, w1: Any, w2: Any, router_logits: Array,
            activation: MoEActivation | str | None = None, *, top_k: int | None = None,
            renormalize: bool | None = None, scoring_func: str = "softmax",
            use_grouped_topk: bool | None = None, num_expert_group: int | None = None,
            topk_group: int | None = None, e_score_correction_bias: Array | None = None,
            routed_scaling_factor: float | None = None,
            apply_router_weight_on_input: bool | None = None, **weights: Any) -> Array:
    """Routes `router_logits` with `select_experts`, then runs the experts.

    `w1` / `w2` (and the keyword `weights`, e.g. scales) are in the backend's
    format; see each subclass. Unset options default to the config's.
    """
    topk_weights, topk_ids = self.route(
        router_logits, top_k=top_k, renormalize=renormalize, scoring_func=scoring_func,
        use_grouped_topk=use_grouped_topk, num_expert_group=num_expert_group,
        topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)
    return self.apply_routed(hidden_states, topk_ids, topk_weights, w1, w2, activation,
                             apply_router_weight_on_input=apply_router_weight_on_input,
                             **weights)

  def _resolve(self, activation, apply_router_weight_on_input) -> tuple[MoEActivation, bool]:
    act = self.moe_config.activation if activation is None else MoEActivation.from_str(activation)
    if apply_router_weight_on_input is None:
      apply_router_weight_on_input = self.moe_config.apply_router_weight_on_input
    return act, bool(apply_router_weight_on_input)
