"""One route from weights to kernel: scheme -> oracle -> experts class -> prepare -> apply.

    choice = choose_experts("wna16", layer, group_size=128)
    arrays = choice.experts.prepare(int4_weights)        # once: the backend's format
    y = choice.experts.apply(x, router_logits, arrays, layer.routing, correction_bias)

`jax_moeq.fused_moe` and the Flax blocks (`jax_moeq.nn`) both choose through `choose_experts`,
so a layer runs on the same backend whichever way it is called. Schemes and their oracles:

| scheme | canonical weights | oracle | backends, fastest first |
| --- | --- | --- | --- |
| "unquantized" | `FloatMoEWeights` | `oracle.unquantized` | XLA, REFERENCE |
| "w4a8_int8" | `Int4MoEWeights`, `W4A8PackedWeights` | `oracle.w4a8_int8` | CPU_INT4, REFERENCE |
| "wna16" | `Int4MoEWeights` | `oracle.wna16` | MARLIN, REFERENCE |
| "mxint4" | `Int4MoEWeights` (group 32) | `oracle.mxint4` | HOPPER_MXINT4, REFERENCE |

Weight-only schemes ("wna16", "mxint4") may also run on the CPU W4A8 kernel, which quantizes
activations to int8 per token, when `allow_activation_quantization` is set: under "auto" on a
platform where the scheme has no kernel of its own, and explicitly with moe_backend "cpu_int4".
The choice's `scheme` is then "w4a8_int8" (the format the weights are prepared in).

The oracles see the layer's routing as a `RoutingOptions.routing_method` (experts fed routed
tokens), except MxInt4's, which routes inside its kernel: it sees the kernel-side method that
computes the layer's routing, or `Unspecified` when none does (then only its reference fits).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from jax_moeq.experts.base import MoEExperts
from jax_moeq.experts.cpu_int4 import CPUExpertsInt4
from jax_moeq.experts.unquantized import FLOAT_IMPLS, XlaFloatExperts
from jax_moeq.oracle import base, mxint4, unquantized, w4a8_int8, wna16
from jax_moeq.oracle.base import (
    AUTO, REFERENCE_BACKEND_NAME, MoEActivation, MoEConfig, MoEQuantConfig, QuantKey,
    RoutingMethodType, RoutingOptions,
)

__all__ = ["ExpertsChoice", "LayerSpec", "QUANTIZED_SCHEMES", "SCHEMES", "choose_experts"]

SCHEMES = ("unquantized", "w4a8_int8", "wna16", "mxint4")
QUANTIZED_SCHEMES = SCHEMES[1:]
WEIGHT_ONLY_SCHEMES = ("wna16", "mxint4")
# Explicit moe_backend names of the CPU W4A8 kernel that weight-only schemes may ask for.
_W4A8_KERNEL_NAMES = ("cpu", "cpu_int4")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """The static facts of one MoE layer that the oracles decide on.

  Attributes:
    num_experts, hidden_size, intermediate_size: E, H, I of the weights.
    routing: the layer's `select_experts` options (top_k included).
    activation: "silu", "swiglu"/"swiglustep", "swigluoai", or a MoEActivation.
    apply_router_weight_on_input: scale the GEMM1 input instead of the expert output.
    has_bias: expert biases present.
    in_dtype: dtype of the hidden states (and the output).
    router_logits_dtype: dtype of the router logits, None when not known.
    platform: "cpu", "cuda", ...; None: JAX's default backend.
  """
  num_experts: int
  hidden_size: int
  intermediate_size: int
  routing: RoutingOptions
  activation: MoEActivation | str = MoEActivation.SILU
  apply_router_weight_on_input: bool = False
  has_bias: bool = False
  in_dtype: Any = jnp.bfloat16
  router_logits_dtype: Any = None
  platform: str | None = None

  def __post_init__(self):
    if not isinstance(self.routing, RoutingOptions):
      raise TypeError(f"routing must be RoutingOptions, got {type(self.routing).__name__}")
    object.__setattr__(self, "activation", MoEActivation.from_str(self.activation))

  @property
  def resolved_platform(self) -> str:
    return base.current_platform() if self.platform is None else base.normalize_platform(
        self.platform)

  def moe_config(self, routing_method: RoutingMethodType, moe_backend: str) -> MoEConfig:
    return MoEConfig(
        num_experts=self.num_experts, top_k=self.routing.top_k, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size, activation=self.activation,
        apply_router_weight_on_input=self.apply_router_weight_on_input,
        routing_method=routing_method, router_logits_dtype=self.router_logits_dtype,
        has_bias=self.has_bias, in_dtype=self.in_dtype, platform=self.platform,
        moe_backend=moe_backend)


@dataclasses.dataclass(frozen=True)
class ExpertsChoice:
  """A built experts instance and why it was chosen.

  Attributes:
    experts: the instance (`prepare` the weights, then `apply` per call).
    backend: the oracle's backend enum member.
    scheme: the scheme the experts run, i.e. the format `prepare` produces ("w4a8_int8" when
      weight-only weights run on the W4A8 kernel).
    reason: why this backend, for logs ("the WNA16 oracle chose MARLIN (MarlinExperts)").
  """
  experts: MoEExperts
  backend: enum.Enum
  scheme: str
  reason: str

  @property
  def name(self) -> str:
    """The backend's short name ("cpu_int4", "reference", "marlin", "mxint4_gpu", "xla")."""
    return self.experts.backend_name


# ------------------------------------------------------------------ the schemes' oracles
@dataclasses.dataclass(frozen=True)
class _Oracle:
  """One scheme's oracle, with the calls the dispatch makes uniform."""
  name: str
  select: Callable[[MoEConfig, QuantKey | None], tuple[enum.Enum, type]]
  priority: Callable[[MoEConfig], Sequence[enum.Enum]]
  kernel_classes: Callable[[enum.Enum], Sequence[type]]
  weight_key: Callable[[int | None], QuantKey | None]
  quant_config: Callable[[int | None], MoEQuantConfig | None]


def _block_shape(group_size: int) -> tuple[int, int]:
  return (-1, 1) if group_size == -1 else (1, group_size)


_ORACLES = {
    "unquantized": _Oracle(
        unquantized.SCHEME_NAME, lambda c, k: unquantized.select_unquantized_moe_backend(c),
        unquantized._get_priority_backends, unquantized.backend_to_kernel_cls,
        lambda g: None, lambda g: None),
    "w4a8_int8": _Oracle(
        w4a8_int8.SCHEME_NAME, w4a8_int8.select_w4a8_int8_moe_backend,
        w4a8_int8._get_priority_backends, w4a8_int8.backend_to_kernel_cls,
        base.w4a8_weight_key,
        lambda g: w4a8_int8.make_w4a8_int8_moe_quant_config(_block_shape(g))),
    "wna16": _Oracle(
        wna16.SCHEME_NAME, wna16.select_wna16_moe_backend, wna16._get_priority_backends,
        wna16.backend_to_kernel_cls, base.wna16_weight_key, wna16.make_wna16_moe_quant_config),
    "mxint4": _Oracle(
        mxint4.SCHEME_NAME, mxint4.select_mxint4_moe_backend, mxint4._get_priority_backends,
        mxint4.backend_to_kernel_cls, lambda g: base.kMxInt4StaticGroup32,
        lambda g: mxint4.make_mxint4_moe_quant_config()),
}


def _routing_method(scheme: str, routing: RoutingOptions) -> RoutingMethodType:
  """The routing the scheme's experts are asked to support (module docstring)."""
  if scheme == "mxint4":
    method = routing.kernel_routing_method
    return RoutingMethodType.Unspecified if method is None else method
  return routing.routing_method


def _check_group_size(scheme: str, group_size: int | None) -> None:
  if scheme == "unquantized":
    if group_size is not None:
      raise ValueError(f"group_size={group_size} does not apply to unquantized weights")
    return
  if group_size is None:
    raise ValueError(f"scheme={scheme!r} needs a group_size")
  if scheme == "mxint4" and group_size != 32:
    raise ValueError(f"scheme='mxint4' uses group_size=32, got group_size={group_size}")


# ------------------------------------------------------------------ one oracle's answer
def _build(experts_cls: type, config: MoEConfig, quant_config: MoEQuantConfig | None,
           float_impl: str) -> MoEExperts:
  if issubclass(experts_cls, XlaFloatExperts):
    return experts_cls(config, quant_config, float_impl=float_impl)
  if float_impl != "auto":
    raise ValueError(f"float_impl={float_impl!r} applies to the XLA float backend, not "
                     f"{experts_cls.__name__}")
  return experts_cls(config, quant_config)


def _why_not(oracle: _Oracle, backend: enum.Enum, config: MoEConfig,
             weight_key: QuantKey | None) -> str:
  _, reason = base.first_fit(oracle.kernel_classes(backend), config, weight_key, None)
  return f"{backend.name} does not fit since {reason}"


def _auto_reason(oracle: _Oracle, backend: enum.Enum, experts_cls: type, config: MoEConfig,
                 weight_key: QuantKey | None) -> str:
  if backend.name != REFERENCE_BACKEND_NAME:
    return f"the {oracle.name} oracle chose {backend.name} ({experts_cls.__name__})"
  faster = [b for b in oracle.priority(config) if b != backend]
  if not faster:
    return (f"the {oracle.name} oracle chose {backend.name}: no {oracle.name} kernel exists "
            f"for platform {config.platform!r}")
  why = "; ".join(_why_not(oracle, b, config, weight_key) for b in faster)
  return f"the {oracle.name} oracle chose {backend.name}: {why}"


def _ask_oracle(scheme: str, layer: LayerSpec, group_size: int | None, moe_backend: str,
                float_impl: str = "auto") -> ExpertsChoice:
  """The scheme's oracle on the layer (explicit `moe_backend`, or "auto")."""
  oracle = _ORACLES[scheme]
  config = layer.moe_config(_routing_method(scheme, layer.routing), moe_backend)
  weight_key = oracle.weight_key(group_size)
  backend, experts_cls = oracle.select(config, weight_key)
  if moe_backend == AUTO:
    reason = _auto_reason(oracle, backend, experts_cls, config, weight_key)
  else:
    reason = f"moe_backend={moe_backend!r} was requested"
  experts = _build(experts_cls, config, oracle.quant_config(group_size), float_impl)
  return ExpertsChoice(experts, backend, scheme, reason)


def _has_kernel(scheme: str, layer: LayerSpec) -> bool:
  """Whether the scheme has a backend faster than its reference on the layer's platform."""
  oracle = _ORACLES[scheme]
  config = layer.moe_config(_routing_method(scheme, layer.routing), AUTO)
  return any(b.name != REFERENCE_BACKEND_NAME for b in oracle.priority(config))


def _w4a8_kernel_misfit(layer: LayerSpec, group_size: int) -> str | None:
  """Why the CPU W4A8 kernel cannot run the layer, or None if it can."""
  config = layer.moe_config(layer.routing.routing_method, AUTO)
  _, reason = base.first_fit([CPUExpertsInt4], config, base.w4a8_weight_key(group_size), None)
  return reason


# ------------------------------------------------------------------ entry point
def choose_experts(scheme: str, layer: LayerSpec, *, group_size: int | None = None,
                   moe_backend: str = AUTO, allow_activation_quantization: bool = False,
                   float_impl: str = "auto") -> ExpertsChoice:
  """The experts that run `layer` with weights of `scheme` (module docstring).

  Args:
    scheme: one of `SCHEMES`.
    layer: the layer's static facts.
    group_size: the int4 weights' group size (32, 64, 128, -1; 32 for "mxint4"); None for
      "unquantized".
    moe_backend: "auto" (the oracle's choice), or a backend name of the scheme's oracle;
      "cpu"/"cpu_int4" also for weight-only schemes with `allow_activation_quantization`.
    allow_activation_quantization: let "wna16" / "mxint4" weights run on the CPU W4A8 kernel.
    float_impl: the XLA float backend's computation (`experts.unquantized.FLOAT_IMPLS`).

  Raises:
    ValueError: an unknown scheme, group size or float_impl; an explicit backend that is
      unknown or does not fit (naming the backend and the reason).
    NotImplementedError: no backend fits.
  """
  if scheme not in SCHEMES:
    raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES}")
  if float_impl not in FLOAT_IMPLS:
    raise ValueError(f"float_impl={float_impl!r} is not one of {FLOAT_IMPLS}")
  if scheme != "unquantized" and float_impl != "auto":
    raise ValueError(f"float_impl={float_impl!r} applies to unquantized weights, not "
                     f"scheme={scheme!r}")
  _check_group_size(scheme, group_size)
  if not isinstance(moe_backend, str):
    raise TypeError(f"moe_backend must be a str, got {type(moe_backend).__name__}")
  moe_backend = moe_backend.strip().lower()
  if scheme not in WEIGHT_ONLY_SCHEMES:
    return _ask_oracle(scheme, layer, group_size, moe_backend, float_impl)
  return _choose_weight_only(scheme, layer, group_size, moe_backend,
                             bool(allow_activation_quantization))


def _choose_weight_only(scheme: str, layer: LayerSpec, group_size: int, moe_backend: str,
                        allow_activation_quantization: bool) -> ExpertsChoice:
  via = (f"{scheme} weights run on the W4A8 kernel since activation quantization was "
         "allowed; ")
  if moe_backend in _W4A8_KERNEL_NAMES:
    if not allow_activation_quantization:
      raise ValueError(f"moe_backend={moe_backend!r} (the CPU W4A8 kernel) quantizes "
                       f"activations to int8, which {scheme} weights do not allow unless "
                       "allow_activation_quantization=True")
    choice = _ask_oracle("w4a8_int8", layer, group_size, moe_backend)
    return dataclasses.replace(choice, reason=via + choice.reason)
  note = ""
  if moe_backend == AUTO and not _has_kernel(scheme, layer):
    if allow_activation_quantization:
      misfit = _w4a8_kernel_misfit(layer, group_size)
      if misfit is None:
        choice = _ask_oracle("w4a8_int8", layer, group_size, AUTO)
        return dataclasses.replace(choice, reason=via + choice.reason)
      note = f"; the W4A8 kernel does not fit since {misfit}"
    elif layer.resolved_platform == "cpu":
      note = ("; the CPU W4A8 kernel would quantize activations to int8 "
              "(allow_activation_quantization=True allows it)")
  choice = _ask_oracle(scheme, layer, group_size, moe_backend)
  return dataclasses.replace(choice, reason=choice.reason + note)
