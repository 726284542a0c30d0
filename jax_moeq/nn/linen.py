"""Flax linen versions of `jax_moeq.nn.MoE` and `QuantizedMoE`, for linen codebases.

Same arguments and call as the NNX blocks. Float weights live in the "params" collection
(`w13`, `w2`, optional `w13_bias`, `w2_bias`, `e_score_correction_bias`, and `router/kernel`);
the quantized block keeps its pre-packed backend arrays in the "quantized" collection (not
"params", so optimizers over params skip them), created once at `init`.
`QuantizedMoE.quantize_variables(float_variables, ...)` converts a float block's variables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_moeq import dispatch
from jax_moeq.experts.unquantized import FLOAT_IMPLS
from jax_moeq.nn.moe import MoESpec, _check_scheme_group
from jax_moeq.weights import FloatMoEWeights, quantize_moe_weights

QUANTIZED_COLLECTION = "quantized"


def _expert_init(in_axis=-1, out_axis=-2):
  return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis,
                                          out_axis=out_axis, batch_axis=(0,))


class _LinenMoEBase(nn.Module):
  num_experts: int
  top_k: int
  hidden_size: int
  intermediate_size: int
  activation: str = "silu"
  renormalize: bool = True
  scoring_func: str = "softmax"
  use_grouped_topk: bool = False
  num_expert_group: int | None = None
  topk_group: int | None = None
  e_score_correction_bias: bool = False
  routed_scaling_factor: float = 1.0
  apply_router_weight_on_input: bool = False
  use_bias: bool = False
  router: bool = True
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32

  @property
  def spec(self) -> MoESpec:
    # The attributes above are MoESpec's fields, under the same names.
    return MoESpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MoESpec)})

  def _tokens_and_logits(self, spec: MoESpec, x, router_logits):
    if x.shape[-1] != spec.hidden_size:
      raise ValueError(f"x must end in hidden_size={spec.hidden_size}, got shape {x.shape}")
    lead = x.shape[:-1]
    tokens = x.reshape(-1, spec.hidden_size).astype(self.dtype)
    if router_logits is None:
      if not spec.router:
        raise ValueError("this block has no router (router=False): pass router_logits")
      logits = nn.Dense(spec.num_experts, use_bias=False, dtype=self.dtype,
                        param_dtype=self.param_dtype, name="router")(tokens)
    else:
      if router_logits.shape != lead + (spec.num_experts,):
        raise ValueError(f"router_logits must have shape {lead + (spec.num_experts,)}, got "
                         f"{router_logits.shape}")
      logits = router_logits.reshape(-1, spec.num_experts)
    return tokens, logits, lead

  def _correction_bias(self, spec: MoESpec):
    if not spec.e_score_correction_bias:
      return None
    return self.param("e_score_correction_bias", nn.initializers.zeros, (spec.num_experts,),
                      jnp.float32)

  def _run(self, choice: dispatch.ExpertsChoice, x, router_logits, arrays_fn):
    """Routing and the chosen experts on the arrays `arrays_fn()` gives (after the router's
    params, so the variables keep their order)."""
    spec = self.spec
    tokens, logits, lead = self._tokens_and_logits(spec, x, router_logits)
    bias = self._correction_bias(spec)
    y = choice.experts.apply(tokens, logits, arrays_fn(), spec.routing, bias)
    return y.reshape(*lead, spec.hidden_size)


class MoE(_LinenMoEBase):
  """Float MoE block (linen). See `jax_moeq.nn.MoE`; `float_impl` as there."""

  float_impl: str = "auto"

  @nn.compact
  def __call__(self, x, router_logits=None):
    spec = self.spec
    if self.float_impl not in FLOAT_IMPLS:
      raise ValueError(f"float_impl={self.float_impl!r} is not one of {FLOAT_IMPLS}")
    choice = dispatch.choose_experts("unquantized", spec.layer(self.dtype),
                                     float_impl=self.float_impl)
    return self._run(choice, x, router_logits, lambda: choice.experts.prepare(
        self._float_weights(spec)))

  def _float_weights(self, spec: MoESpec) -> FloatMoEWeights:
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    w13 = self.param("w13", _expert_init(), (e, 2 * i, h), self.param_dtype)
    w2 = self.param("w2", _expert_init(), (e, h, i), self.param_dtype)
    b13 = b2 = None
    if spec.use_bias:
      b13 = self.param("w13_bias", nn.initializers.zeros, (e, 2 * i), self.param_dtype)
      b2 = self.param("w2_bias", nn.initializers.zeros, (e, h), self.param_dtype)
    cast = lambda v: None if v is None else v.astype(self.dtype)
    return FloatMoEWeights(cast(w13), cast(w2), cast(b13), cast(b2))


class QuantizedMoE(_LinenMoEBase):
  """Int4 MoE block (linen). See `jax_moeq.nn.QuantizedMoE` for scheme / backend arguments."""

  scheme: str = "w4a8_int8"
  group_size: int = 128
  moe_backend: str = "auto"
  allow_activation_quantization: bool = False

  def _choice(self, spec: MoESpec) -> dispatch.ExpertsChoice:
    _check_scheme_group(self.scheme, self.group_size, spec.hidden_size, spec.intermediate_size)
    return dispatch.choose_experts(
        self.scheme, spec.layer(self.dtype), group_size=self.group_size,
        moe_backend=self.moe_backend,
        allow_activation_quantization=self.allow_activation_quantization)

  def _random_arrays(self, spec: MoESpec, choice: dispatch.ExpertsChoice):
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    rng = self.make_rng("params")
    k13, k2 = jax.random.split(rng)
    w13 = _expert_init()(k13, (e, 2 * i, h), jnp.float32)
    w2 = _expert_init()(k2, (e, h, i), jnp.float32)
    zeros = (lambda *s: jnp.zeros(s, jnp.float32)) if spec.use_bias else (lambda *s: None)
    float_weights = FloatMoEWeights(w13, w2, zeros(e, 2 * i), zeros(e, h))
    return choice.experts.prepare(quantize_moe_weights(float_weights, self.group_size))

  @nn.compact
  def __call__(self, x, router_logits=None):
    spec = self.spec
    choice = self._choice(spec)
    return self._run(choice, x, router_logits, lambda: self.variable(
        QUANTIZED_COLLECTION, "experts", lambda: self._random_arrays(spec, choice)).value)

  def quantize_variables(self, float_variables) -> dict:
    """Variables of this block holding `float_variables` (of a linen `MoE` with the same
    shape) quantized: {"params": router and correction bias, "quantized": packed experts}."""
    params = dict(float_variables["params"])
    choice = self._choice(self.spec)
    float_weights = FloatMoEWeights(params.pop("w13"), params.pop("w2"),
                                    params.pop("w13_bias", None), params.pop("w2_bias", None))
    arrays = choice.experts.prepare(quantize_moe_weights(float_weights, self.group_size))
    return {"params": params, QUANTIZED_COLLECTION: {"experts": arrays}}
