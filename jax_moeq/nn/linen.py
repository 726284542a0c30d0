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

from jax_moeq.nn import _backends
from jax_moeq.nn.moe import MoESpec, SCHEMES

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

  def _tokens_and_routing(self, spec: MoESpec, x, router_logits):
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
    bias = None
    if spec.e_score_correction_bias:
      bias = self.param("e_score_correction_bias", nn.initializers.zeros, (spec.num_experts,),
                        jnp.float32)
    topk_weights, topk_ids = _backends.select_experts(
        logits, spec.top_k, renormalize=spec.renormalize, scoring_func=spec.scoring_func,
        use_grouped_topk=spec.use_grouped_topk, num_expert_group=spec.num_expert_group,
        topk_group=spec.topk_group, e_score_correction_bias=bias,
        routed_scaling_factor=spec.routed_scaling_factor)
    return tokens, logits, topk_weights, topk_ids, lead


class MoE(_LinenMoEBase):
  """Float MoE block (linen). See `jax_moeq.nn.MoE`."""

  @nn.compact
  def __call__(self, x, router_logits=None):
    spec = self.spec
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    tokens, logits, topk_weights, topk_ids, lead = self._tokens_and_routing(spec, x,
                                                                          router_logits)
    w13 = self.param("w13", _expert_init(), (e, 2 * i, h), self.param_dtype)
    w2 = self.param("w2", _expert_init(), (e, h, i), self.param_dtype)
    b13 = b2 = None
    if spec.use_bias:
      b13 = self.param("w13_bias", nn.initializers.zeros, (e, 2 * i), self.param_dtype)
      b2 = self.param("w2_bias", nn.initializers.zeros, (e, h), self.param_dtype)
    cast = lambda v: None if v is None else v.astype(self.dtype)
    y = _backends.float_moe(tokens, topk_ids, topk_weights, cast(w13), cast(w2), cast(b13),
                            cast(b2), activation=spec.activation,
                            apply_router_weight_on_input=spec.apply_router_weight_on_input)
    return y.reshape(*lead, h)


class QuantizedMoE(_LinenMoEBase):
  """Int4 MoE block (linen). See `jax_moeq.nn.QuantizedMoE` for scheme / backend arguments."""

  scheme: str = "w4a8_int8"
  group_size: int = 128
  moe_backend: str = "auto"
  allow_activation_quantization: bool = False

  def _choice(self, spec: MoESpec) -> _backends.BackendChoice:
    if self.scheme not in SCHEMES:
      raise ValueError(f"scheme={self.scheme!r} is not one of {SCHEMES}")
    return _backends.choose_backend(spec, self.scheme, self.group_size, self.dtype,
                                    self.moe_backend, self.allow_activation_quantization)

  def _random_arrays(self, spec: MoESpec, choice):
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    rng = self.make_rng("params")
    k13, k2 = jax.random.split(rng)
    w13 = _expert_init()(k13, (e, 2 * i, h), jnp.float32)
    w2 = _expert_init()(k2, (e, h, i), jnp.float32)
    zeros = (lambda *s: jnp.zeros(s, jnp.float32)) if spec.use_bias else (lambda *s: None)
    weights = _backends.quantize_experts(w13, w2, self.group_size, self.scheme, zeros(e, 2 * i),
                                         zeros(e, h))
    return _backends.prepare(choice, weights, spec)

  @nn.compact
  def __call__(self, x, router_logits=None):
    spec = self.spec
    choice = self._choice(spec)
    tokens, logits, topk_weights, topk_ids, lead = self._tokens_and_routing(spec, x,
                                                                          router_logits)
    arrays = self.variable(QUANTIZED_COLLECTION, "experts",
                           lambda: self._random_arrays(spec, choice)).value
    y = _backends.apply(choice.backend, arrays, tokens, topk_ids, topk_weights, spec,
                        self.scheme, self.group_size, logits=logits)
    return y.reshape(*lead, spec.hidden_size)

  def quantize_variables(self, float_variables) -> dict:
    """Variables of this block holding `float_variables` (of a linen `MoE` with the same
    shape) quantized: {"params": router and correction bias, "quantized": packed experts}."""
    params = dict(float_variables["params"])
    spec = self.spec
    choice = self._choice(spec)
    weights = _backends.quantize_experts(params.pop("w13"), params.pop("w2"), self.group_size,
                                         self.scheme, params.pop("w13_bias", None),
                                         params.pop("w2_bias", None))
    arrays = _backends.prepare(choice, weights, spec)
    return {"params": params, QUANTIZED_COLLECTION: {"experts": arrays}}
