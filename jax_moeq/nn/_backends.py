"""The compute behind `jax_moeq.nn`: quantization of expert weights, backend choice (through the
scheme's oracle), one-time conversion to the backend's format, and the per-call apply.

Backends (names as the oracles spell them):
- "cpu_int4": the CPU W4A8 FFI kernel (`dynamic_4bit_int_moe`) on pre-packed bytes. Runs
  "w4a8_int8" weights, and "wna16" / "mxint4" weights when activation quantization is allowed.
- "reference": the jnp reference of the scheme (every platform).
- GPU backends of "wna16" / "mxint4": their ops, on their kernel formats.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

CPU_INT4 = "cpu_int4"
REFERENCE = "reference"
ACTIVATION_KIND = {"silu": 0, "swigluoai": 1}


# ------------------------------------------------------------------ weights
@dataclasses.dataclass
class Int4Experts:
  """Canonical int4 expert weights (host or device arrays), as checkpoints hold them.

  w13 [E, 2I, H], w2 [E, H, I]: int8 holding int4 values, in natural input order.
  w13_scale [E, 2I, H/g] / w2_scale [E, H, I/g] (bf16 or fp16; f32 [.., 1] channel-wise).
  w13_g_idx [E, H] / w2_g_idx [E, I] int32 or None: act-order, the group of each input channel
  (None: contiguous groups, g_idx[k] = k // g).
  """

  w13: Any
  w2: Any
  w13_scale: Any
  w2_scale: Any
  group_size: int
  w13_bias: Any = None
  w2_bias: Any = None
  w13_g_idx: Any = None
  w2_g_idx: Any = None

  def to_layer(self):
    """As a host-side `jax_moeq.loaders.MoELayerTensors` (no router)."""
    from jax_moeq.loaders import MoELayerTensors
    host = lambda a: None if a is None else np.asarray(a)
    return MoELayerTensors(
        w13=host(self.w13), w2=host(self.w2), w13_scale=host(self.w13_scale),
        w2_scale=host(self.w2_scale), group_size=self.group_size, w13_g_idx=host(self.w13_g_idx),
        w2_g_idx=host(self.w2_g_idx), w13_bias=host(self.w13_bias), w2_bias=host(self.w2_bias))


def as_int4_experts(weights) -> Int4Experts:
  """Accepts `Int4Experts` or `jax_moeq.weights.Int4MoEWeights` (w13_q / w2_q fields)."""
  if isinstance(weights, Int4Experts):
    return weights
  if hasattr(weights, "w13_q") and hasattr(weights, "w2_q"):
    return Int4Experts(weights.w13_q, weights.w2_q, weights.w13_scale, weights.w2_scale,
                       int(weights.group_size), getattr(weights, "w13_bias", None),
                       getattr(weights, "w2_bias", None))
  raise TypeError(f"weights must be int4 expert weights (Int4MoEWeights), got "
                  f"{type(weights).__name__}")


def quantize_experts(w13: Array, w2: Array, group_size: int, scheme: str,
                     w13_bias: Array | None = None, w2_bias: Array | None = None) -> Int4Experts:
  """Round-to-nearest symmetric int4 (SPEC §2) of float expert weights."""
  from jax_moeq.quant.int4 import quantize_int4
  q13, s13 = quantize_int4(jnp.asarray(w13, jnp.float32), group_size)
  q2, s2 = quantize_int4(jnp.asarray(w2, jnp.float32), group_size)
  f32 = lambda b: None if b is None else jnp.asarray(b, jnp.float32)
  return Int4Experts(q13, q2, s13, s2, group_size, f32(w13_bias), f32(w2_bias))


def int4_experts_from_layer(layer) -> Int4Experts:
  """`jax_moeq.loaders.MoELayerTensors` (int4) -> `Int4Experts`."""
  if not layer.quantized:
    raise ValueError("the checkpoint layer holds float weights; quantize it (QuantizedMoE.from_float) "
                     "or load an int4 checkpoint")
  dev = lambda a, dt=None: None if a is None else jnp.asarray(a, dt)
  return Int4Experts(dev(layer.w13), dev(layer.w2), dev(layer.w13_scale), dev(layer.w2_scale),
                     layer.group_size, dev(layer.w13_bias, jnp.float32),
                     dev(layer.w2_bias, jnp.float32), dev(layer.w13_g_idx, jnp.int32),
                     dev(layer.w2_g_idx, jnp.int32))


# ------------------------------------------------------------------ routing and float compute
def select_experts(logits: Array, top_k: int, **kw) -> tuple[Array, Array]:
  from jax_moeq.routing import select_experts as _select
  return _select(logits, top_k, **kw)


def apply_activation(y13: Array, activation: str) -> Array:
  """Gated activation of [.., 2I] (gate half first) in float32 (SPEC §4 step 3)."""
  i = y13.shape[-1] // 2
  g, u = y13[..., :i].astype(jnp.float32), y13[..., i:].astype(jnp.float32)
  if activation == "silu":
    return jax.nn.silu(g) * u
  g = jnp.minimum(g, 7.0)
  u = jnp.clip(u, -7.0, 7.0)
  return (u + 1.0) * g * jax.nn.sigmoid(1.702 * g)


def float_moe(x: Array, topk_ids: Array, topk_weights: Array, w13: Array, w2: Array,
              w13_bias: Array | None, w2_bias: Array | None, *, activation: str,
              apply_router_weight_on_input: bool) -> Array:
  """Unquantized MoE with the SPEC §4 rounding points (y13, activation, y2 rounded to x's dtype).

  XLA has no fused MoE, so the strategy follows the shape (measured on CPU, bf16): with few
  (token, slot) pairs (decode) gather the routed experts' weights per pair; with many pairs and
  not too many experts per pair (E/K <= 16) run every expert densely and keep the routed outputs
  (XLA's CPU ragged_dot measured ~2x slower than that at E/K = 8); otherwise sort the pairs by
  expert and use `lax.ragged_dot`.
  """
  t, k = topk_ids.shape
  e = w13.shape[0]
  if t * k <= e:
    return _float_moe_gather(x, topk_ids, topk_weights, w13, w2, w13_bias, w2_bias, activation,
                             apply_router_weight_on_input)
  if e <= 16 * k and not apply_router_weight_on_input:
    return _float_moe_dense(x, topk_ids, topk_weights, w13, w2, w13_bias, w2_bias, activation)
  return _float_moe_ragged(x, topk_ids, topk_weights, w13, w2, w13_bias, w2_bias, activation,
                           apply_router_weight_on_input)


def _gemm(a: Array, w: Array, spec: str, bias: Array | None, dtype) -> Array:
  y = jnp.einsum(spec, a, w, preferred_element_type=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(dtype)


def _combine_slots(y: Array, topk_weights: Array, weighted: bool) -> Array:
  """[T, K, H] expert outputs -> [T, H]: router weight (unless applied on input), slot-order sum."""
  dtype = y.dtype
  if not weighted:
    y = (y.astype(jnp.float32) * topk_weights[..., None].astype(jnp.float32)).astype(dtype)
  out = jnp.zeros(y.shape[::2], dtype)
  for slot in range(y.shape[1]):
    out = out + y[:, slot]
  return out


def _float_moe_gather(x, topk_ids, topk_weights, w13, w2, b13, b2, activation, on_input):
  t, k = topk_ids.shape
  dtype = x.dtype
  ids = topk_ids.reshape(-1)
  a = jnp.repeat(x, k, axis=0)
  if on_input:
    a = (a.astype(jnp.float32) * topk_weights.reshape(-1, 1)).astype(dtype)
  y13 = _gemm(a, w13[ids], "ph,pih->pi", None if b13 is None else b13[ids], dtype)
  act = apply_activation(y13, activation).astype(dtype)
  y = _gemm(act, w2[ids], "pi,phi->ph", None if b2 is None else b2[ids], dtype)
  return _combine_slots(y.reshape(t, k, -1), topk_weights, on_input)


def _float_moe_dense(x, topk_ids, topk_weights, w13, w2, b13, b2, activation):
  dtype = x.dtype
  y13 = _gemm(x, w13, "th,eih->tei", b13, dtype)
  act = apply_activation(y13, activation).astype(dtype)
  y = _gemm(act, w2, "tei,ehi->teh", b2, dtype)  # [T, E, H]
  picked = jnp.take_along_axis(y, topk_ids[..., None].astype(jnp.int32), axis=1)  # [T, K, H]
  return _combine_slots(picked, topk_weights, False)


def _float_moe_ragged(x, topk_ids, topk_weights, w13, w2, b13, b2, activation, on_input):
  t, k = topk_ids.shape
  e = w13.shape[0]
  dtype = x.dtype
  flat_ids = topk_ids.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat_ids, stable=True)
  sorted_ids = flat_ids[order]
  a = x[order // k]
  if on_input:
    w_sorted = topk_weights.reshape(-1)[order].astype(jnp.float32)
    a = (a.astype(jnp.float32) * w_sorted[:, None]).astype(dtype)
  sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
  y13 = jax.lax.ragged_dot(a, w13.transpose(0, 2, 1), sizes, preferred_element_type=jnp.float32)
  if b13 is not None:
    y13 = y13 + b13[sorted_ids].astype(jnp.float32)
  act = apply_activation(y13.astype(dtype), activation).astype(dtype)
  y = jax.lax.ragged_dot(act, w2.transpose(0, 2, 1), sizes, preferred_element_type=jnp.float32)
  if b2 is not None:
    y = y + b2[sorted_ids].astype(jnp.float32)
  y = y.astype(dtype)
  per_pair = jnp.zeros((t * k, y.shape[-1]), dtype).at[order].set(y).reshape(t, k, -1)
  return _combine_slots(per_pair, topk_weights, on_input)


# ------------------------------------------------------------------ backend choice
@dataclasses.dataclass(frozen=True)
class BackendChoice:
  backend: str
  reason: str
  via_w4a8: bool = False  # wna16 / mxint4 weights converted for the W4A8 kernel
  dtype: Any = None  # activation dtype (GPU kernels store scales in it)


def _platform() -> str:
  return jax.default_backend()


def choose_backend(spec, scheme: str, group_size: int, dtype, moe_backend: str,
                   allow_activation_quantization: bool) -> BackendChoice:
  """Asks the scheme's oracle; returns the backend and the oracle's reason."""
  from jax_moeq.nn import _oracle_bridge
  choice = _oracle_bridge.choose(spec, scheme, group_size, dtype, moe_backend,
                                 allow_activation_quantization)
  return dataclasses.replace(choice, dtype=jnp.dtype(dtype))


# ------------------------------------------------------------------ per-backend formats
def prepare(choice: BackendChoice, weights: Int4Experts, spec) -> dict[str, Array]:
  """Converts canonical int4 weights to the chosen backend's arrays, once."""
  if choice.backend == CPU_INT4:
    if weights.w13_g_idx is not None:
      raise ValueError("these weights use act-order on w13 (a per-expert permutation of the "
                       "hidden input), which the W4A8 kernel cannot apply; run them on the "
                       "reference backend (allow_activation_quantization=False)")
    if weights.w2_g_idx is not None:
      # w2's act-order permutes I: fold it into w13's rows (gate and up together), exactly.
      folded, _ = weights.to_layer().sorted_by_group()
      weights = int4_experts_from_layer(folded)
    s13, s2 = weights.w13_scale, weights.w2_scale
    if weights.group_size != -1:
      # The W4A8 kernel takes bf16 group scales; fp16 (GPTQ) scales are rounded to bf16.
      s13, s2 = s13.astype(jnp.bfloat16), s2.astype(jnp.bfloat16)
    else:
      s13, s2 = s13.astype(jnp.float32), s2.astype(jnp.float32)
    from jax_moeq.ops.w4a8_cpu import convert_to_w4a8_int8_moe_format
    w13_packed, w2_packed, *_ = convert_to_w4a8_int8_moe_format(
        jnp.asarray(weights.w13), jnp.asarray(weights.w2), s13, s2, weights.group_size,
        weights.w13_bias, weights.w2_bias)
    return {"w13_packed": w13_packed, "w2_packed": w2_packed}
  if choice.backend == REFERENCE:
    out = {"w13_q": jnp.asarray(weights.w13), "w2_q": jnp.asarray(weights.w2),
           "w13_scale": jnp.asarray(weights.w13_scale), "w2_scale": jnp.asarray(weights.w2_scale)}
    for name in ("w13_bias", "w2_bias", "w13_g_idx", "w2_g_idx"):
      if getattr(weights, name) is not None:
        out[name] = jnp.asarray(getattr(weights, name))
    return out
  from jax_moeq.nn import _oracle_bridge
  return _oracle_bridge.prepare_gpu(choice, weights, spec)


def to_canonical(backend: str, arrays: dict[str, Array], spec, group_size: int) -> Int4Experts:
  """Inverse of `prepare` (host-side; for export and tests)."""
  if backend == CPU_INT4:
    from jax_moeq.ops.w4a8_cpu import unpack_w4a8_gemm
    h, i = spec.hidden_size, spec.intermediate_size
    q13, s13, _, b13 = unpack_w4a8_gemm(arrays["w13_packed"], 2 * i, h, group_size)
    q2, s2, _, b2 = unpack_w4a8_gemm(arrays["w2_packed"], h, i, group_size)
    # Group scales were bf16 before the packer widened them (exactly) to f32.
    sdt = jnp.float32 if group_size == -1 else jnp.bfloat16
    bias = (lambda b: jnp.asarray(b)) if spec.use_bias else (lambda b: None)
    return Int4Experts(jnp.asarray(q13), jnp.asarray(q2), jnp.asarray(s13, sdt),
                       jnp.asarray(s2, sdt), group_size, bias(b13), bias(b2))
  if backend == REFERENCE:
    return Int4Experts(arrays["w13_q"], arrays["w2_q"], arrays["w13_scale"], arrays["w2_scale"],
                       group_size, arrays.get("w13_bias"), arrays.get("w2_bias"),
                       arrays.get("w13_g_idx"), arrays.get("w2_g_idx"))
  from jax_moeq.nn import _oracle_bridge
  return _oracle_bridge.to_canonical_gpu(backend, arrays, spec, group_size)


def apply(backend: str, arrays: dict[str, Array], x: Array, topk_ids: Array, topk_weights: Array,
          spec, scheme: str, group_size: int, logits: Array | None = None) -> Array:
  """One call of the chosen backend on pre-converted arrays."""
  if backend == CPU_INT4:
    from jax_moeq.ops.w4a8_cpu import dynamic_4bit_int_moe
    h, i = spec.hidden_size, spec.intermediate_size
    return dynamic_4bit_int_moe(
        x, topk_ids, topk_weights, arrays["w13_packed"], arrays["w2_packed"], h, i, 2 * i,
        group_size, apply_router_weight_on_input=spec.apply_router_weight_on_input,
        activation_kind=ACTIVATION_KIND[spec.activation])
  if backend == REFERENCE:
    from jax_moeq.nn import _oracle_bridge
    return _oracle_bridge.reference(scheme, arrays, x, topk_ids, topk_weights, spec, group_size)
  from jax_moeq.nn import _oracle_bridge
  return _oracle_bridge.apply_gpu(backend, arrays, x, topk_ids, topk_weights, spec, scheme,
                                  group_size, logits=logits)
