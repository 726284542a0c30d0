"""Bridges between checkpoint layers (`jax_moeq.loaders.MoELayerTensors`) and the Flax blocks."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moeq.nn.moe import MoE, MoESpec, QuantizedMoE
from jax_moeq.weights import FloatMoEWeights, Int4MoEWeights

_ROUTING_KEYS = ("activation", "renormalize", "scoring_func", "use_grouped_topk",
                 "num_expert_group", "topk_group", "routed_scaling_factor",
                 "apply_router_weight_on_input")


def _routing_from(model_config, overrides: dict[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  if model_config is not None:
    out.update(activation=model_config.activation, renormalize=model_config.renormalize,
               scoring_func=model_config.scoring_func,
               routed_scaling_factor=model_config.routed_scaling_factor)
    if model_config.num_expert_group is not None:
      out.update(use_grouped_topk=True, num_expert_group=model_config.num_expert_group,
                 topk_group=model_config.topk_group)
  unknown = set(overrides) - set(_ROUTING_KEYS) - {"dtype", "param_dtype"}
  if unknown:
    raise TypeError(f"unexpected arguments {sorted(unknown)}")
  out.update(overrides)
  return out


def moe_from_checkpoint_layer(layer, top_k: int, *, model_config=None, scheme: str | None = None,
                              moe_backend: str = "auto",
                              allow_activation_quantization: bool = False,
                              float_impl: str = "auto", rngs: nnx.Rngs | None = None,
                              **kwargs) -> MoE | QuantizedMoE:
  """A block holding a loaded layer's weights: `QuantizedMoE` for int4 layers, `MoE` for float.

  Args:
    layer: a `MoELayerTensors` from `jax_moeq.loaders.load_moe_checkpoint`.
    top_k: experts per token (`model_config.top_k` of the checkpoint).
    model_config: the checkpoint's `MoEModelConfig`, for routing options (overridable by kwargs).
    scheme: for int4 layers, the block's scheme (default: the checkpoint's,
      `MoECheckpoint.quant_config.scheme`, else "wna16").
    float_impl: for float layers, `MoE`'s expert computation ("auto", "gather", "dense",
      "ragged_dot").
    kwargs: routing / dtype overrides as in `MoE` (activation, renormalize, dtype, ...).
  """
  opts = _routing_from(model_config, kwargs)
  e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
  use_bias = layer.w13_bias is not None
  has_router = layer.router_weight is not None
  corr = layer.e_score_correction_bias
  if corr is not None:
    opts["e_score_correction_bias"] = True
  if not layer.quantized:
    bias = lambda b: None if b is None else jnp.asarray(b)
    weights = FloatMoEWeights(jnp.asarray(layer.w13), jnp.asarray(layer.w2),
                              bias(layer.w13_bias), bias(layer.w2_bias))
    return MoE(e, top_k, h, i, use_bias=use_bias, router=has_router, float_impl=float_impl,
               rngs=rngs, weights=weights, router_weight=layer.router_weight,
               correction_bias=corr, **opts)
  if float_impl != "auto":
    raise ValueError(f"float_impl={float_impl!r} applies to float layers; this layer is int4")
  scheme = scheme or "wna16"
  return QuantizedMoE(e, top_k, h, i, use_bias=use_bias, router=has_router, scheme=scheme,
                      group_size=layer.group_size, moe_backend=moe_backend,
                      allow_activation_quantization=allow_activation_quantization,
                      weights=Int4MoEWeights.from_layer(layer), router_weight=layer.router_weight,
                      correction_bias=corr, rngs=rngs, **opts)


def layer_from_module(module: MoE | QuantizedMoE):
  """The block's weights as a host-side `MoELayerTensors` (for `save_moe_checkpoint`)."""
  from jax_moeq.loaders import MoELayerTensors
  spec: MoESpec = module.spec
  router = None if module.router is None else np.asarray(module.router.kernel[...]).T
  corr = (None if module.e_score_correction_bias is None
          else np.asarray(module.e_score_correction_bias[...]))
  if isinstance(module, MoE):
    arr = lambda v: None if v is None else np.asarray(v[...])
    return MoELayerTensors(w13=arr(module.w13), w2=arr(module.w2), w13_bias=arr(module.w13_bias),
                           w2_bias=arr(module.w2_bias), router_weight=router,
                           e_score_correction_bias=corr)
  if not isinstance(module, QuantizedMoE):
    raise TypeError(f"expected MoE or QuantizedMoE, got {type(module).__name__}")
  layer = module.canonical_int4().to_layer()
  layer.router_weight = router
  layer.e_score_correction_bias = corr
  return layer
