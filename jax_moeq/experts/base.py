"""Base class of the experts implementations the oracles choose between.

An experts class runs a whole MoE layer for one backend. The oracle asks the class, before
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

An instance then converts weights once and runs per call:

  arrays = experts.prepare(weights)        # canonical weights -> the backend's named arrays
  y = experts.apply(x, router_logits, arrays, routing, e_score_correction_bias)
  y = experts.apply_routed(x, topk_ids, topk_weights, arrays)   # already-routed tokens

`prepare` takes the canonical containers of `jax_moeq.weights` (`Int4MoEWeights`, or
`FloatMoEWeights` for unquantized experts) and returns a dict of arrays whose names are stable
(the Flax blocks store them as variables under these names); `canonical(arrays)` inverts it
where the format allows. `apply` routes on the host with `routing.select_experts` and calls
`apply_routed`, unless the backend routes inside its kernel (`routes_inside`). Activation and
where the router weight is applied come from the experts' `MoEConfig`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jax_moeq.oracle.base import (
    FusedMoEActivationFormat, MoEActivation, MoEConfig, MoEParallelConfig, QuantKey,
    RoutingMethodType, RoutingOptions,
)
from jax_moeq.weights import (
    Int4MoEWeights, W4A8PackedWeights, unpack_w4a8, validate_int4_weights,
)

Array = jax.Array

GATED_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUSTEP)


def add_residual(y: Array, residual: Array | None) -> Array:
  """residual + y in residual's dtype (a decoder layer's x + mlp(x)); y when there is none."""
  return y if residual is None else residual + y.astype(residual.dtype)


class MoEExperts(abc.ABC):
  """A backend's experts: `is_supported_config` (class level), `prepare` and `apply`."""

  # The backend's short name, as `jax_moeq.nn.QuantizedMoE.backend` reports it.
  backend_name: ClassVar[str] = ""
  # Whether the kernel routes from router logits itself (`apply` only, no `apply_routed`).
  routes_inside: ClassVar[bool] = False

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

  # ---------------------------------------------------------------- weights and compute
  def prepare(self, weights: Any) -> dict[str, Array]:
    """Canonical weights -> this backend's named arrays (run once per set of weights)."""
    raise NotImplementedError(f"{type(self).__name__} does not prepare weights")

  def canonical(self, arrays: Mapping[str, Array]) -> Any:
    """Inverse of `prepare`: the canonical weights held in `arrays`."""
    raise NotImplementedError(f"exporting weights from {type(self).__name__} is not supported; "
                              "run the layer on the reference backend to export")

  @abc.abstractmethod
  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    """The experts on already-routed tokens: [T, H] -> [T, H]; `weights` from `prepare`."""

  def apply_routed_residual(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                            weights: Mapping[str, Array], residual: Array) -> Array:
    """residual + apply_routed(...) in residual's dtype (a decoder layer's x + mlp(x)); backends
    whose kernel adds the residual itself override this, with the same result bit for bit."""
    return add_residual(self.apply_routed(hidden_states, topk_ids, topk_weights, weights),
                        residual)

  def apply(self, hidden_states: Array, router_logits: Array, weights: Mapping[str, Array],
            routing: RoutingOptions | None = None,
            e_score_correction_bias: Array | None = None,
            residual: Array | None = None) -> Array:
    """The whole layer from router logits [T, E]: routing (`routing`, default from the
    config's top-k and routing method), then the experts. [T, H] -> [T, H], plus `residual`
    [T, H] when given (`apply_routed_residual`)."""
    if routing is None:
      routing = self.default_routing()
    topk_weights, topk_ids = routing.select(router_logits, e_score_correction_bias)
    if residual is not None:
      return self.apply_routed_residual(hidden_states, topk_ids, topk_weights, weights, residual)
    return self.apply_routed(hidden_states, topk_ids, topk_weights, weights)

  def default_routing(self) -> RoutingOptions:
    """The `select_experts` options of the config's top_k and plain routing method."""
    cfg = self.moe_config
    if cfg.routing_method not in _PLAIN_ROUTINGS:
      raise ValueError(f"routing method {cfg.routing_method.name} has no default options: pass "
                       "routing=RoutingOptions(...)")
    renormalize, scoring_func = _PLAIN_ROUTINGS[cfg.routing_method]
    return RoutingOptions(top_k=cfg.top_k, renormalize=renormalize, scoring_func=scoring_func)

  @property
  def activation(self) -> MoEActivation:
    return self.moe_config.activation

  @property
  def apply_router_weight_on_input(self) -> bool:
    return self.moe_config.apply_router_weight_on_input

  # Equal configs give equal experts: blocks holding them hash alike under jit (static data).
  def _key(self) -> tuple:
    return (type(self), self.moe_config, self.quant_config)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, MoEExperts) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.moe_config!r})"


# Routing methods -> (renormalize, scoring_func) of the `select_experts` options computing them
# (Renormalize equals RenormalizeNaive up to rounding: softmax is monotone).
_PLAIN_ROUTINGS = {
    RoutingMethodType.Default: (False, "softmax"),
    RoutingMethodType.Renormalize: (True, "softmax"),
    RoutingMethodType.RenormalizeNaive: (True, "softmax"),
    RoutingMethodType.Sigmoid: (False, "sigmoid"),
    RoutingMethodType.SigmoidRenorm: (True, "sigmoid"),
}


def require_arrays(owner: str, weights: Mapping[str, Array], names: tuple[str, ...]) -> None:
  """ValueError naming what is missing or unexpected in a prepared-weights dict."""
  missing = [n for n in names if n not in weights]
  if missing:
    raise ValueError(f"{owner} needs the prepared arrays {list(names)}; missing {missing} "
                     f"(got {sorted(weights)}); build them with {owner}.prepare")


def check_int4_weights(weights: Any) -> Int4MoEWeights:
  """`Int4MoEWeights` (validated), or the unpacked form of `W4A8PackedWeights`."""
  if isinstance(weights, W4A8PackedWeights):
    return unpack_w4a8(weights)
  if not isinstance(weights, Int4MoEWeights):
    raise TypeError(f"weights must be Int4MoEWeights, got {type(weights).__name__}")
  validate_int4_weights(weights)
  return weights
