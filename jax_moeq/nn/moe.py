"""Flax NNX Mixture-of-Experts blocks: float `MoE` and the drop-in `QuantizedMoE`.

Both take the same constructor arguments and are called as `(x[..., H], router_logits=None) ->
y[..., H]`: leading dims are flattened to tokens and restored; the router is an `nnx.Linear(H, E)`
(`router=True`) or logits are passed in. Weights follow SPEC §1: `w13 [E, 2I, H]` (gate rows, then
up rows), `w2 [E, H, I]`, optional biases `[E, 2I]`, `[E, H]`.

Both run their experts through `jax_moeq.dispatch.choose_experts`, as `jax_moeq.fused_moe` does:
the scheme's oracle (SPEC §6) picks an experts class at construction, whose `prepare` converts the
weights to its backend's format and whose `apply` runs each call. `QuantizedMoE` holds the
prepared int4 weights as `QuantizedWeight` variables (an `nnx.Variable`, not an `nnx.Param`, so
optimizers that train `nnx.Param` leave them alone), so nothing is repacked per call and
`jax.jit`, `nnx.split` / `nnx.state` and checkpointing see plain arrays. The choice and the
reason are logged on the "jax_moeq" logger.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moeq import dispatch
from jax_moeq.experts.base import MoEExperts
from jax_moeq.experts.unquantized import FLOAT_IMPLS
from jax_moeq.oracle.base import RoutingOptions
from jax_moeq.weights import FloatMoEWeights, Int4MoEWeights, quantize_moe_weights

logger = logging.getLogger("jax_moeq")

Array = jax.Array
ACTIVATIONS = ("silu", "swigluoai")
SCORING_FUNCS = ("softmax", "sigmoid")
SCHEMES = dispatch.QUANTIZED_SCHEMES


class QuantizedWeight(nnx.Variable):
  """Quantized / pre-packed expert weights: module state that is not a trainable parameter."""


@dataclasses.dataclass(frozen=True)
class MoESpec:
  """Static description of an MoE block (shared by `MoE` and `QuantizedMoE`)."""

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

  def __post_init__(self):
    for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if self.top_k > self.num_experts:
      raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation={self.activation!r} is not one of {ACTIVATIONS}")
    if self.scoring_func not in SCORING_FUNCS:
      raise ValueError(f"scoring_func={self.scoring_func!r} is not one of {SCORING_FUNCS}")
    if self.use_grouped_topk:
      if self.num_expert_group is None or self.topk_group is None:
        raise ValueError("use_grouped_topk=True needs num_expert_group and topk_group")
      if self.num_experts % self.num_expert_group:
        raise ValueError(f"num_expert_group={self.num_expert_group} does not divide num_experts="
                         f"{self.num_experts}")
    elif self.e_score_correction_bias:
      raise ValueError("e_score_correction_bias needs use_grouped_topk=True (the DeepSeek-V3 "
                       "routing path)")

  @property
  def routing(self) -> RoutingOptions:
    """The block's `select_experts` options."""
    return RoutingOptions(
        top_k=self.top_k, renormalize=self.renormalize, scoring_func=self.scoring_func,
        use_grouped_topk=self.use_grouped_topk, num_expert_group=self.num_expert_group,
        topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
        has_correction_bias=self.e_score_correction_bias)

  def layer(self, dtype) -> dispatch.LayerSpec:
    """The dispatch's view of the block computing in `dtype` (logits' dtype not known)."""
    return dispatch.LayerSpec(
        num_experts=self.num_experts, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size, routing=self.routing,
        activation=self.activation, apply_router_weight_on_input=self.apply_router_weight_on_input,
        has_bias=self.use_bias, in_dtype=dtype)

  def check_float_weights(self, weights: FloatMoEWeights) -> None:
    """ValueError unless `weights` has this block's shapes and bias presence."""
    e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
    if not isinstance(weights, FloatMoEWeights):
      raise TypeError(f"weights must be FloatMoEWeights, got {type(weights).__name__}")
    if jnp.shape(weights.w13) != (e, 2 * i, h) or jnp.shape(weights.w2) != (e, h, i):
      raise ValueError(f"weights have w13 {jnp.shape(weights.w13)} / w2 "
                       f"{jnp.shape(weights.w2)}, the block needs {(e, 2 * i, h)} / {(e, h, i)}")
    self._check_bias_presence(weights.w13_bias, weights.w2_bias)

  def check_int4_weights(self, weights: Int4MoEWeights, group_size: int) -> None:
    """ValueError unless `weights` has this block's shapes, group size and bias presence."""
    e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
    if weights.w13_q.shape != (e, 2 * i, h) or weights.w2_q.shape != (e, h, i):
      raise ValueError(f"weights have w13 {weights.w13_q.shape} / w2 {weights.w2_q.shape}, the "
                       f"block needs {(e, 2 * i, h)} / {(e, h, i)}")
    if weights.group_size != group_size:
      raise ValueError(f"weights were quantized with group_size={weights.group_size}, the block "
                       f"has group_size={group_size}")
    self._check_bias_presence(weights.w13_bias, weights.w2_bias)

  def _check_bias_presence(self, w13_bias, w2_bias) -> None:
    present = [n for n, b in (("w13_bias", w13_bias), ("w2_bias", w2_bias)) if b is not None]
    if self.use_bias and len(present) < 2:
      raise ValueError(f"use_bias=True but the weights have no "
                       f"{' and '.join(sorted({'w13_bias', 'w2_bias'} - set(present)))}")
    if not self.use_bias and present:
      raise ValueError(f"use_bias=False but the weights have {' and '.join(present)}")


def _init_expert_weights(rngs: nnx.Rngs, spec: MoESpec, param_dtype) -> FloatMoEWeights:
  """Fan-in scaled normal init of w13 [E, 2I, H] and w2 [E, H, I] (biases zero)."""
  init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-1,
                                           out_axis=-2, batch_axis=(0,))
  e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
  w13 = init(rngs.params(), (e, 2 * i, h), param_dtype)
  w2 = init(rngs.params(), (e, h, i), param_dtype)
  if not spec.use_bias:
    return FloatMoEWeights(w13, w2)
  return FloatMoEWeights(w13, w2, jnp.zeros((e, 2 * i), param_dtype),
                         jnp.zeros((e, h), param_dtype))


def _given(value: Array, dtype) -> Any:
  """An nnx initializer returning `value` in `dtype`: no random draw for given weights."""
  def init(key, shape, param_dtype=dtype):
    del key
    out = jnp.asarray(value, param_dtype)
    if out.shape != tuple(shape):
      raise ValueError(f"router_weight must be [E, H] = {tuple(shape)[::-1]}, got "
                       f"{tuple(out.shape)[::-1]}")
    return out
  return init


class _MoEBase(nnx.Module):
  """Router, routing, token flattening and the experts call shared by both blocks."""

  spec: MoESpec
  dtype: Any
  experts: MoEExperts

  def _init_router(self, spec: MoESpec, dtype, param_dtype, rngs: nnx.Rngs | None,
                   router_weight: Array | None, correction_bias: Array | None):
    if spec.router:
      if router_weight is None and rngs is None:
        raise ValueError("rngs is required to initialize the router (or pass router_weight)")
      kernel_init = nnx.initializers.lecun_normal()
      if router_weight is not None:
        # nnx.Linear's kernel is [in, out]; checkpoints store the gate as [E, H].
        kernel_init = _given(jnp.asarray(router_weight).T, param_dtype)
        # nnx.Linear asks its rngs for a key even when kernel_init ignores it.
        rngs = nnx.Rngs(0) if rngs is None else rngs
      self.router = nnx.Linear(spec.hidden_size, spec.num_experts, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
    else:
      self.router = None
    if spec.e_score_correction_bias:
      bias = (jnp.zeros((spec.num_experts,), jnp.float32) if correction_bias is None
              else jnp.asarray(correction_bias, jnp.float32))
      self.e_score_correction_bias = nnx.Param(bias)
    elif correction_bias is not None:
      raise ValueError("correction_bias needs e_score_correction_bias=True")
    else:
      self.e_score_correction_bias = None

  def _choose(self, scheme: str, **kw) -> dispatch.ExpertsChoice:
    choice = dispatch.choose_experts(scheme, self.spec.layer(self.dtype), **kw)
    self.experts = choice.experts
    return choice

  def _flatten(self, x: Array, router_logits: Array | None) -> tuple[Array, Array, tuple]:
    spec = self.spec
    if x.shape[-1] != spec.hidden_size:
      raise ValueError(f"x must end in hidden_size={spec.hidden_size}, got shape {x.shape}")
    lead = x.shape[:-1]
    tokens = x.reshape(-1, spec.hidden_size).astype(self.dtype)
    if router_logits is None:
      if self.router is None:
        raise ValueError("this block has no router (router=False): pass router_logits")
      logits = self.router(tokens)
    else:
      if router_logits.shape[:-1] != lead or router_logits.shape[-1] != spec.num_experts:
        raise ValueError(f"router_logits must have shape {lead + (spec.num_experts,)}, got "
                         f"{router_logits.shape}")
      logits = router_logits.reshape(-1, spec.num_experts)
    return tokens, logits, lead

  def _correction_bias(self) -> Array | None:
    return None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]

  def route(self, logits: Array) -> tuple[Array, Array]:
    """(topk_weights f32 [T, K], topk_ids int32 [T, K]) for router logits [T, E]."""
    return self.spec.routing.select(logits, self._correction_bias())

  def _run(self, x: Array, router_logits: Array | None, arrays: dict[str, Array],
           residual: Array | None = None) -> Array:
    tokens, logits, lead = self._flatten(x, router_logits)
    if residual is not None:
      if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {x.shape}, got {residual.shape}")
      residual = residual.reshape(-1, self.spec.hidden_size)
    y = self.experts.apply(tokens, logits, arrays, self.spec.routing, self._correction_bias(),
                           residual=residual)
    return y.reshape(*lead, self.spec.hidden_size)


def _make_spec(num_experts, top_k, hidden_size, intermediate_size, **kw) -> MoESpec:
  return MoESpec(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                 intermediate_size=intermediate_size, **kw)


class MoE(_MoEBase):
  """Float (bf16 / f32) MoE block: the block `QuantizedMoE` replaces.

  Args:
    num_experts, top_k, hidden_size, intermediate_size: E, K, H, I.
    activation: "silu" (silu(gate) * up) or "swigluoai" (GPT-OSS).
    renormalize, scoring_func, use_grouped_topk, num_expert_group, topk_group,
      e_score_correction_bias (bool: hold a learnable [E] bias), routed_scaling_factor: routing,
      as `jax_moeq.select_experts`.
    apply_router_weight_on_input: scale the expert input instead of its output by the router weight.
    use_bias: expert biases `w13_bias [E, 2I]`, `w2_bias [E, H]`.
    router: hold an `nnx.Linear(H, E)` router; False: pass `router_logits` to the call.
    dtype: computation dtype; param_dtype: parameter dtype.
    float_impl: the expert computation (`experts.unquantized.XlaFloatExperts`): "auto" (from the
      shapes), "gather", "dense" or "ragged_dot" (`jax.lax.ragged_dot`).
    rngs: draws the parameters that are not given; may be None when they all are.
    weights: `jax_moeq.weights.FloatMoEWeights` to hold (cast to param_dtype) instead of a random
      init; router_weight [E, H] / correction_bias [E] likewise set the router.
  """

  def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
               activation: str = "silu", renormalize: bool = True, scoring_func: str = "softmax",
               use_grouped_topk: bool = False, num_expert_group: int | None = None,
               topk_group: int | None = None, e_score_correction_bias: bool = False,
               routed_scaling_factor: float = 1.0, apply_router_weight_on_input: bool = False,
               use_bias: bool = False, router: bool = True, dtype=jnp.bfloat16,
               param_dtype=jnp.float32, float_impl: str = "auto", rngs: nnx.Rngs | None = None,
               weights: FloatMoEWeights | None = None, router_weight: Array | None = None,
               correction_bias: Array | None = None):
    self.spec = _make_spec(
        num_experts, top_k, hidden_size, intermediate_size, activation=activation,
        renormalize=renormalize, scoring_func=scoring_func, use_grouped_topk=use_grouped_topk,
        num_expert_group=num_expert_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
        apply_router_weight_on_input=apply_router_weight_on_input, use_bias=use_bias,
        router=router)
    if float_impl not in FLOAT_IMPLS:
      raise ValueError(f"float_impl={float_impl!r} is not one of {FLOAT_IMPLS}")
    if weights is not None:
      self.spec.check_float_weights(weights)
    elif rngs is None:
      raise ValueError("rngs is required when no weights are given")
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.float_impl = float_impl
    self._init_router(self.spec, dtype, param_dtype, rngs, router_weight, correction_bias)
    if weights is None:
      weights = _init_expert_weights(rngs, self.spec, param_dtype)
    param = lambda v: None if v is None else nnx.Param(jnp.asarray(v, param_dtype))
    self.w13 = param(weights.w13)
    self.w2 = param(weights.w2)
    self.w13_bias = param(weights.w13_bias)
    self.w2_bias = param(weights.w2_bias)
    self._choose("unquantized", float_impl=float_impl)

  def float_weights(self) -> FloatMoEWeights:
    """The expert weights in the computation dtype, as the experts receive them."""
    cast = lambda v: None if v is None else v[...].astype(self.dtype)
    return FloatMoEWeights(cast(self.w13), cast(self.w2), cast(self.w13_bias),
                           cast(self.w2_bias))

  def __call__(self, x: Array, router_logits: Array | None = None,
               residual: Array | None = None) -> Array:
    """moe(x) [..., H]; `residual + moe(x)` in residual's dtype when given."""
    return self._run(x, router_logits, self.experts.prepare(self.float_weights()), residual)


class QuantizedMoE(_MoEBase):
  """Int4-weight MoE block with `MoE`'s arguments and call, plus:

  Args:
    scheme: "w4a8_int8" (int4 weights, int8 dynamic activations; the CPU kernel), "wna16" (int4
      weights, float activations; Marlin-class on GPU) or "mxint4" (int4, bf16 scales per 32).
    group_size: 32, 64, 128, or -1 (channel-wise). mxint4 uses 32.
    moe_backend: "auto" (ask the oracle) or an explicit backend name of the scheme.
    allow_activation_quantization: on CPU, let "wna16"/"mxint4" weights run on the W4A8 kernel
      (activations quantized to int8 per token); without it they run on the jnp reference.

  `weights`: int4 experts (`jax_moeq.weights.Int4MoEWeights`, the form `canonical_int4()`
  returns), or `FloatMoEWeights` to quantize (round-to-nearest, SPEC §2); without them, random
  float weights are drawn from `rngs` (like `MoE`) and quantized. `router_weight [E, H]` /
  `correction_bias [E]` set the router; given weights and router draw nothing from `rngs`.
  Usually built with `QuantizedMoE.from_float(moe, ...)` or
  `jax_moeq.nn.moe_from_checkpoint_layer(...)`.
  """

  def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
               activation: str = "silu", renormalize: bool = True, scoring_func: str = "softmax",
               use_grouped_topk: bool = False, num_expert_group: int | None = None,
               topk_group: int | None = None, e_score_correction_bias: bool = False,
               routed_scaling_factor: float = 1.0, apply_router_weight_on_input: bool = False,
               use_bias: bool = False, router: bool = True, dtype=jnp.bfloat16,
               param_dtype=jnp.float32, scheme: str = "w4a8_int8", group_size: int = 128,
               moe_backend: str = "auto", allow_activation_quantization: bool = False,
               rngs: nnx.Rngs | None = None,
               weights: Int4MoEWeights | FloatMoEWeights | None = None,
               router_weight: Array | None = None, correction_bias: Array | None = None):
    self.spec = _make_spec(
        num_experts, top_k, hidden_size, intermediate_size, activation=activation,
        renormalize=renormalize, scoring_func=scoring_func, use_grouped_topk=use_grouped_topk,
        num_expert_group=num_expert_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
        apply_router_weight_on_input=apply_router_weight_on_input, use_bias=use_bias,
        router=router)
    _check_scheme_group(scheme, group_size, hidden_size, intermediate_size)
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.scheme = scheme
    self.group_size = group_size
    self.allow_activation_quantization = bool(allow_activation_quantization)
    if weights is None:
      if rngs is None:
        raise ValueError("rngs is required when no weights are given")
      weights = _init_expert_weights(rngs, self.spec, param_dtype)
    if isinstance(weights, FloatMoEWeights):
      self.spec.check_float_weights(weights)
      weights = quantize_moe_weights(weights, group_size)
    if not isinstance(weights, Int4MoEWeights):
      raise TypeError(f"weights must be Int4MoEWeights or FloatMoEWeights, got "
                      f"{type(weights).__name__}")
    self.spec.check_int4_weights(weights, group_size)
    self._init_router(self.spec, dtype, param_dtype, rngs, router_weight, correction_bias)
    choice = self._choose(scheme, group_size=group_size, moe_backend=moe_backend,
                          allow_activation_quantization=self.allow_activation_quantization)
    logger.info("QuantizedMoE(scheme=%s, E=%d, H=%d, I=%d, group_size=%d): backend %s (%s)",
                scheme, num_experts, hidden_size, intermediate_size, group_size, choice.name,
                choice.reason)
    self.backend = choice.name
    self.backend_reason = choice.reason
    arrays = self.experts.prepare(weights)
    self.quantized_names = tuple(sorted(arrays))
    for name in self.quantized_names:
      setattr(self, name, QuantizedWeight(arrays[name]))

  def _arrays(self) -> dict[str, Array]:
    return {name: getattr(self, name)[...] for name in self.quantized_names}

  def __call__(self, x: Array, router_logits: Array | None = None,
               residual: Array | None = None) -> Array:
    """moe(x) [..., H]; `residual + moe(x)` in residual's dtype when given (the CPU W4A8 kernel
    adds it in its combine)."""
    return self._run(x, router_logits, self._arrays(), residual)

  def canonical_int4(self) -> Int4MoEWeights:
    """The block's int4 weights in canonical form (unpacked from the backend's format)."""
    return self.experts.canonical(self._arrays())

  # ---------------------------------------------------------------- constructors
  @classmethod
  def from_float(cls, moe: MoE, *, scheme: str = "w4a8_int8", group_size: int = 128,
                 moe_backend: str = "auto", allow_activation_quantization: bool = False,
                 dtype=None) -> "QuantizedMoE":
    """Quantizes a float `MoE` block (round-to-nearest symmetric int4, SPEC §2)."""
    if not isinstance(moe, MoE):
      raise TypeError(f"moe must be a jax_moeq.nn.MoE, got {type(moe).__name__}")
    if scheme == "mxint4" and group_size == 128:
      group_size = 32  # the scheme's only group size; 128 is just the default argument
    value = lambda v: None if v is None else v[...]
    weights = FloatMoEWeights(value(moe.w13), value(moe.w2), value(moe.w13_bias),
                              value(moe.w2_bias))
    return cls._from_parts(moe.spec, weights, scheme=scheme, group_size=group_size,
                           moe_backend=moe_backend,
                           allow_activation_quantization=allow_activation_quantization,
                           dtype=moe.dtype if dtype is None else dtype,
                           param_dtype=moe.param_dtype,
                           router_weight=None if moe.router is None else moe.router.kernel[...].T,
                           correction_bias=value(moe.e_score_correction_bias))

  @classmethod
  def _from_parts(cls, spec: MoESpec, weights, *, router_weight=None, correction_bias=None,
                  **kw) -> "QuantizedMoE":
    return cls(spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size,
               activation=spec.activation, renormalize=spec.renormalize,
               scoring_func=spec.scoring_func, use_grouped_topk=spec.use_grouped_topk,
               num_expert_group=spec.num_expert_group, topk_group=spec.topk_group,
               e_score_correction_bias=spec.e_score_correction_bias,
               routed_scaling_factor=spec.routed_scaling_factor,
               apply_router_weight_on_input=spec.apply_router_weight_on_input,
               use_bias=spec.use_bias, router=spec.router and router_weight is not None,
               weights=weights, router_weight=router_weight, correction_bias=correction_bias,
               **kw)


def _check_scheme_group(scheme: str, group_size: int, hidden_size: int,
                        intermediate_size: int) -> None:
  """The block-level checks of a quantized scheme and group size, with the argument named."""
  if scheme not in SCHEMES:
    raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES}")
  if scheme == "mxint4" and group_size != 32:
    raise ValueError(f"scheme='mxint4' uses group_size=32, got group_size={group_size}")
  if group_size not in (32, 64, 128, -1):
    raise ValueError(f"group_size={group_size} is not one of (32, 64, 128, -1)")
  for dim, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
    if group_size != -1 and size % group_size:
      raise ValueError(f"group_size={group_size} does not divide {dim}={size}")
