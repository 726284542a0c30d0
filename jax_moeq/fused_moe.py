"""`fused_moe`: the one call a user makes, whatever the weights' format and the platform.

    out = fused_moe(x, router_logits, weights, top_k=8)
    out = fused_moe(x, router_logits, int4_weights, top_k=8, scheme="wna16")

The weights' container (and `scheme=` for int4 weights) selects the scheme; the scheme's oracle
picks the experts class at trace time from static facts (shapes, dtypes, options, platform)
through `jax_moeq.dispatch.choose_experts`, the route the Flax blocks take too, and logs the
choice once:

| weights | scheme= | backends |
| --- | --- | --- |
| `FloatMoEWeights` | "unquantized" (default) | XLA, REFERENCE |
| `Int4MoEWeights` | "w4a8_int8" (default) | CPU_INT4 (packs, then the fused CPU op), REFERENCE |
| `Int4MoEWeights` | "wna16" | MARLIN (CUDA), REFERENCE; CPU_INT4 with activation quantization |
| `Int4MoEWeights` (group 32) | "mxint4" | HOPPER_MXINT4 (CUDA), REFERENCE; CPU_INT4 likewise |
| `W4A8PackedWeights` | "w4a8_int8" (default) | CPU_INT4, or REFERENCE on the unpacked weights |

The experts class prepares the weights into its backend's format on every call (under jit,
once per trace, inside the computation): to serve many calls from one conversion, hold the
weights in a `jax_moeq.nn.QuantizedMoE` block, or pack W4A8 weights once with
`weights.pack_w4a8`.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from jax_moeq import dispatch
from jax_moeq.oracle import base as oracle_base
from jax_moeq.oracle.base import MoEActivation, RoutingOptions
from jax_moeq.weights import (
    FloatMoEWeights, Int4MoEWeights, W4A8PackedWeights, validate_float_weights,
    validate_int4_weights, validate_w4a8_packed_weights,
)

Array = jax.Array

__all__ = ["fused_moe", "scheme_of"]

# Weight container -> (default scheme, schemes it can hold).
_CONTAINER_SCHEMES: dict[type, tuple[str, tuple[str, ...]]] = {
    FloatMoEWeights: ("unquantized", ("unquantized",)),
    Int4MoEWeights: ("w4a8_int8", dispatch.QUANTIZED_SCHEMES),
    W4A8PackedWeights: ("w4a8_int8", ("w4a8_int8",)),
}
_VALIDATORS = {FloatMoEWeights: validate_float_weights, Int4MoEWeights: validate_int4_weights,
               W4A8PackedWeights: validate_w4a8_packed_weights}


def scheme_of(weights: Any, scheme: str | None = None) -> str:
  """The scheme `fused_moe` runs `weights` as: `scheme`, checked against the (validated)
  container, or the container's default."""
  for container, (default, allowed) in _CONTAINER_SCHEMES.items():
    if isinstance(weights, container):
      _VALIDATORS[container](weights)  # shape and dtype errors before any backend choice
      if scheme is None:
        return default
      if scheme not in allowed:
        raise ValueError(f"scheme={scheme!r} does not apply to {container.__name__}; expected "
                         f"one of {allowed}")
      return scheme
  raise TypeError(f"weights must be one of {[t.__name__ for t in _CONTAINER_SCHEMES]}, got "
                  f"{type(weights).__name__}")


def _layer(x: Array, router_logits: Array, weights: Any, routing: RoutingOptions,
           activation: MoEActivation, apply_router_weight_on_input: bool) -> dispatch.LayerSpec:
  """The layer's static facts, from the weights' container and the call."""
  if isinstance(weights, W4A8PackedWeights):
    # The packed buffers always carry a bias slot (zeros when absent), which costs nothing.
    e, h, i, has_bias = (weights.num_experts, weights.hidden_size, weights.intermediate_size,
                         True)
  else:
    e, h, i, has_bias = (weights.num_experts, weights.hidden_size, weights.intermediate_size,
                         weights.has_bias)
  return dispatch.LayerSpec(
      num_experts=e, hidden_size=h, intermediate_size=i, routing=routing, activation=activation,
      apply_router_weight_on_input=apply_router_weight_on_input, has_bias=has_bias,
      in_dtype=x.dtype, router_logits_dtype=router_logits.dtype,
      platform=oracle_base.detect_platform(x, router_logits))


def fused_moe(
    x: Array,
    router_logits: Array,
    weights: FloatMoEWeights | Int4MoEWeights | W4A8PackedWeights,
    *,
    top_k: int,
    scheme: str | None = None,
    renormalize: bool = True,
    activation: str | MoEActivation = "silu",
    moe_backend: str = "auto",
    allow_activation_quantization: bool = False,
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
    weights: `FloatMoEWeights`, `Int4MoEWeights` or `W4A8PackedWeights`.
    top_k: experts per token.
    scheme: how int4 weights run: "w4a8_int8" (default: int8 dynamic activations), "wna16"
      (weight-only, GPTQ-style symmetric int4) or "mxint4" (weight-only, group 32, routing
      inside the GPU kernel). Float and packed weights have one scheme each (None or it).
    renormalize: divide the chosen weights by their sum.
    activation: "silu" (default), "swiglu"/"swiglustep", "swigluoai", or a MoEActivation.
    moe_backend: "auto" (the oracle's choice), or a backend of the scheme: "xla",
      "reference"/"jnp" (unquantized); "cpu"/"cpu_int4", "reference" (W4A8); "marlin",
      "reference" (WNA16); "hopper_mxint4"/"mxint4_gpu", "reference" (MxInt4); and
      "cpu"/"cpu_int4" for WNA16 / MxInt4 with `allow_activation_quantization`.
    allow_activation_quantization: let "wna16" / "mxint4" weights run on the CPU W4A8 kernel
      (activations quantized to int8 per token), as `jax_moeq.nn.QuantizedMoE` does.
    scoring_func, use_grouped_topk, num_expert_group, topk_group,
    e_score_correction_bias, routed_scaling_factor: routing, as
      `routing.select_experts`.
    apply_router_weight_on_input: scale the GEMM1 input by the router weight
      instead of the expert output.

  Returns:
    [..., H] in x's dtype.

  The backend is chosen at trace time (`dispatch.choose_experts`) and logged once (logger
  "jax_moeq.oracle"). Explicit backends that do not fit raise ValueError with the reason.
  """
  scheme = scheme_of(weights, scheme)
  x = jnp.asarray(x)
  router_logits = jnp.asarray(router_logits)
  if x.ndim < 1:
    raise ValueError("x must be [..., H], got a scalar")
  if router_logits.ndim < 1 or router_logits.shape[:-1] != x.shape[:-1]:
    raise ValueError(f"router_logits must be [..., E] with the leading dims of x "
                     f"{x.shape[:-1]}, got shape {router_logits.shape}")
  routing = RoutingOptions(
      top_k=top_k, renormalize=renormalize, scoring_func=scoring_func,
      use_grouped_topk=use_grouped_topk, num_expert_group=num_expert_group,
      topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
      has_correction_bias=e_score_correction_bias is not None)
  layer = _layer(x, router_logits, weights, routing, MoEActivation.from_str(activation),
                 bool(apply_router_weight_on_input))
  group_size = None if scheme == "unquantized" else weights.group_size
  choice = dispatch.choose_experts(scheme, layer, group_size=group_size, moe_backend=moe_backend,
                                   allow_activation_quantization=allow_activation_quantization)
  oracle_base.log_once(logging.INFO, f"fused_moe runs {scheme} weights on backend "
                       f"{choice.name}: {choice.reason}.")
  arrays = choice.experts.prepare(weights)
  lead = x.shape[:-1]
  out = choice.experts.apply(x.reshape(-1, x.shape[-1]),
                             router_logits.reshape(-1, router_logits.shape[-1]), arrays, routing,
                             e_score_correction_bias)
  return out.reshape(*lead, out.shape[-1])
