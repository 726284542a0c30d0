"""MoE expert weight containers (pytrees) and the conversions between them.

- `FloatMoEWeights`: unquantized w13 [E, 2I, H], w2 [E, H, I] (+ biases).
- `Int4MoEWeights`: the canonical unpacked int4 form every scheme converts
  from: int4-as-int8 weights, scales (bf16 [.., out, in/g] group-wise, f32
  [.., out, 1] channel-wise), optional biases; `group_size` is static.
- `W4A8PackedWeights`: the CPU W4A8 kernel's packed bytes (scales and biases
  inside), with H, I and the group size static.

All are frozen dataclasses registered as pytrees: arrays are leaves, the ints
are metadata (part of the tree structure, so they are static under jit).
Validation lives in functions (`validate_*`), not in `__post_init__`, because
JAX rebuilds pytrees with placeholder leaves.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq.quant import int4 as int4_lib

Array = jax.Array

__all__ = [
    "FloatMoEWeights", "Int4MoEWeights", "W4A8PackedWeights", "fold_w2_act_order", "pack_w4a8",
    "quantize_moe_weights", "unpack_w4a8", "validate_float_weights", "validate_int4_weights",
    "validate_w4a8_packed_weights",
]


def _pytree(data_fields: list[str], meta_fields: list[str]):
  return functools.partial(jax.tree_util.register_dataclass, data_fields=data_fields,
                           meta_fields=meta_fields)


@_pytree(["w13", "w2", "w13_bias", "w2_bias"], [])
@dataclasses.dataclass(frozen=True)
class FloatMoEWeights:
  """Unquantized experts: w13 [E, 2I, H] (gate rows first, then up), w2 [E, H, I]."""
  w13: Array
  w2: Array
  w13_bias: Array | None = None  # [E, 2I]
  w2_bias: Array | None = None  # [E, H]

  @property
  def num_experts(self) -> int:
    return self.w13.shape[0]

  @property
  def hidden_size(self) -> int:
    return self.w13.shape[2]

  @property
  def intermediate_size(self) -> int:
    return self.w13.shape[1] // 2

  @property
  def has_bias(self) -> bool:
    return self.w13_bias is not None or self.w2_bias is not None


@_pytree(["w13_q", "w13_scale", "w2_q", "w2_scale", "w13_bias", "w2_bias", "w13_g_idx",
          "w2_g_idx"], ["group_size"])
@dataclasses.dataclass(frozen=True)
class Int4MoEWeights:
  """Symmetric int4 experts, unpacked (SPEC §2): the canonical form every scheme prepares from.

  w13_q [E, 2I, H] int8 and w2_q [E, H, I] int8 hold values in [-8, 7];
  w13_scale [E, 2I, H/g], w2_scale [E, H, I/g] (bf16 group-wise; fp16 or f32
  also accepted), or [E, 2I, 1] / [E, H, 1] f32 with group_size = -1.
  w13_g_idx [E, H] / w2_g_idx [E, I] int32 (GPTQ act-order): the group of each
  input channel; None means contiguous groups (k // g).
  """
  w13_q: Array
  w13_scale: Array
  w2_q: Array
  w2_scale: Array
  group_size: int
  w13_bias: Array | None = None
  w2_bias: Array | None = None
  w13_g_idx: Array | None = None
  w2_g_idx: Array | None = None

  @property
  def num_experts(self) -> int:
    return self.w13_q.shape[0]

  @property
  def hidden_size(self) -> int:
    return self.w13_q.shape[2]

  @property
  def intermediate_size(self) -> int:
    return self.w13_q.shape[1] // 2

  @property
  def has_bias(self) -> bool:
    return self.w13_bias is not None or self.w2_bias is not None

  @property
  def has_act_order(self) -> bool:
    return self.w13_g_idx is not None or self.w2_g_idx is not None

  def to_layer(self):
    """As a host-side `jax_moeq.loaders.MoELayerTensors` (no router), for checkpoint writers."""
    from jax_moeq.loaders import MoELayerTensors
    host = lambda a: None if a is None else np.asarray(a)
    return MoELayerTensors(
        w13=host(self.w13_q), w2=host(self.w2_q), w13_scale=host(self.w13_scale),
        w2_scale=host(self.w2_scale), group_size=self.group_size,
        w13_g_idx=host(self.w13_g_idx), w2_g_idx=host(self.w2_g_idx),
        w13_bias=host(self.w13_bias), w2_bias=host(self.w2_bias))

  @classmethod
  def from_layer(cls, layer) -> "Int4MoEWeights":
    """An int4 `jax_moeq.loaders.MoELayerTensors` as device arrays (biases f32, g_idx int32)."""
    if not layer.quantized:
      raise ValueError("layer holds float weights; quantize them (quantize_moe_weights, "
                       "QuantizedMoE.from_float) or load an int4 checkpoint")
    dev = lambda a, dt=None: None if a is None else jnp.asarray(a, dt)
    return cls(dev(layer.w13), dev(layer.w13_scale), dev(layer.w2), dev(layer.w2_scale),
               int(layer.group_size), dev(layer.w13_bias, jnp.float32),
               dev(layer.w2_bias, jnp.float32), dev(layer.w13_g_idx, jnp.int32),
               dev(layer.w2_g_idx, jnp.int32))


@_pytree(["w13_packed", "w2_packed"], ["hidden_size", "intermediate_size", "group_size"])
@dataclasses.dataclass(frozen=True)
class W4A8PackedWeights:
  """The CPU W4A8 kernel's format: uint8 [E, bytes] per GEMM (docs/design.md).

  Scales and biases are inside the buffers (biases are zeros when absent).
  """
  w13_packed: Array
  w2_packed: Array
  hidden_size: int
  intermediate_size: int
  group_size: int

  @property
  def num_experts(self) -> int:
    return self.w13_packed.shape[0]

  @property
  def nbytes_per_expert(self) -> int:
    return self.w13_packed.shape[1] + self.w2_packed.shape[1]


# ------------------------------------------------------------------ validation
def _check_bias(name: str, bias, shape) -> None:
  if bias is None:
    return
  if jnp.shape(bias) != shape:
    raise ValueError(f"{name} must have shape {shape}, got {jnp.shape(bias)}")
  if not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
    raise TypeError(f"{name} must be floating point, got {jnp.result_type(bias)}")


def _expert_shapes(name13: str, w13, name2: str, w2) -> tuple[int, int, int]:
  s13, s2 = jnp.shape(w13), jnp.shape(w2)
  if len(s13) != 3 or s13[1] % 2:
    raise ValueError(f"{name13} must be [E, 2I, H] (gate rows, then up rows), got shape {s13}")
  e, i2, h = s13
  if s2 != (e, h, i2 // 2):
    raise ValueError(f"{name2} must have shape {(e, h, i2 // 2)} to match {name13} {s13}, "
                     f"got {s2}")
  return e, h, i2 // 2


def validate_float_weights(weights: FloatMoEWeights) -> None:
  """Raises ValueError / TypeError if `weights` is not a consistent float MoE."""
  e, h, i = _expert_shapes("w13", weights.w13, "w2", weights.w2)
  for name in ("w13", "w2"):
    dtype = jnp.result_type(getattr(weights, name))
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got {dtype}")
  _check_bias("w13_bias", weights.w13_bias, (e, 2 * i))
  _check_bias("w2_bias", weights.w2_bias, (e, h))


def validate_int4_weights(weights: Int4MoEWeights) -> None:
  """Raises ValueError / TypeError if `weights` is not a consistent int4 MoE."""
  e, h, i = _expert_shapes("w13_q", weights.w13_q, "w2_q", weights.w2_q)
  for name in ("w13_q", "w2_q"):
    dtype = jnp.result_type(getattr(weights, name))
    if dtype != jnp.int8:
      raise TypeError(f"{name} must be int8 holding int4 values in [-8, 7], got {dtype}")
  g13 = int4_lib.validate_group_size(weights.group_size, h, name="group_size (w13, input H)")
  g2 = int4_lib.validate_group_size(weights.group_size, i, name="group_size (w2, input I)")
  for name, shape in (("w13_scale", (e, 2 * i, h // g13)), ("w2_scale", (e, h, i // g2))):
    scale = getattr(weights, name)
    if jnp.shape(scale) != shape:
      raise ValueError(f"{name} must have shape {shape} for group_size={weights.group_size}, "
                       f"got {jnp.shape(scale)}")
    if not jnp.issubdtype(jnp.result_type(scale), jnp.floating):
      raise TypeError(f"{name} must be floating point, got {jnp.result_type(scale)}")
  _check_bias("w13_bias", weights.w13_bias, (e, 2 * i))
  _check_bias("w2_bias", weights.w2_bias, (e, h))
  for name, k in (("w13_g_idx", h), ("w2_g_idx", i)):
    g_idx = getattr(weights, name)
    if g_idx is None:
      continue
    if jnp.shape(g_idx) != (e, k):
      raise ValueError(f"{name} must have shape {(e, k)}, got {jnp.shape(g_idx)}")
    if not jnp.issubdtype(jnp.result_type(g_idx), jnp.integer):
      raise TypeError(f"{name} must be integer, got {jnp.result_type(g_idx)}")


def validate_w4a8_packed_weights(weights: W4A8PackedWeights) -> None:
  """Raises ValueError if the packed buffers do not match H, I and the group size."""
  from jax_moeq.ops.w4a8_cpu import w4a8_packed_bytes
  h, i, g = weights.hidden_size, weights.intermediate_size, weights.group_size
  int4_lib.validate_group_size(g, h, name="group_size (w13, input H)")
  int4_lib.validate_group_size(g, i, name="group_size (w2, input I)")
  for name, n, k in (("w13_packed", 2 * i, h), ("w2_packed", h, i)):
    buf = getattr(weights, name)
    want = w4a8_packed_bytes(n, k, g)
    if len(jnp.shape(buf)) != 2 or jnp.result_type(buf) != jnp.uint8 or jnp.shape(buf)[1] != want:
      raise ValueError(f"{name} must be uint8 [E, {want}] for H={h}, I={i}, group_size={g}; got "
                       f"{jnp.result_type(buf)}{tuple(jnp.shape(buf))}")
  if jnp.shape(weights.w13_packed)[0] != jnp.shape(weights.w2_packed)[0]:
    raise ValueError(f"w13_packed has {jnp.shape(weights.w13_packed)[0]} experts but w2_packed "
                     f"has {jnp.shape(weights.w2_packed)[0]}")


# ------------------------------------------------------------------ conversions
def quantize_moe_weights(float_weights: FloatMoEWeights, group_size: int) -> Int4MoEWeights:
  """Round-to-nearest symmetric int4 of every expert (SPEC §2; `quant.int4.quantize_int4`).

  Biases are kept (as float32). Jittable with `group_size` static.
  """
  validate_float_weights(float_weights)
  q13, s13 = int4_lib.quantize_int4(float_weights.w13, group_size)
  q2, s2 = int4_lib.quantize_int4(float_weights.w2, group_size)
  f32 = lambda b: None if b is None else jnp.asarray(b, jnp.float32)
  return Int4MoEWeights(q13, s13, q2, s2, group_size, f32(float_weights.w13_bias),
                        f32(float_weights.w2_bias))


def fold_w2_act_order(weights: Int4MoEWeights) -> Int4MoEWeights:
  """Folds w2's act-order (a per-expert permutation of I) into w13's rows, exactly (jittable).

  w2's inputs are sorted by group, so its groups become contiguous; w13's gate and up rows (and
  their scales and biases) move with them: the activation is elementwise, so the layer computes
  the same. w13's own act-order (a permutation of the hidden input) is left as it is.
  """
  if weights.w2_g_idx is None:
    return weights
  i = weights.intermediate_size
  perm = jnp.argsort(jnp.asarray(weights.w2_g_idx, jnp.int32), axis=-1, stable=True)  # [E, I]
  rows = jnp.concatenate([perm, perm + i], axis=-1)  # gate and up halves move together
  return dataclasses.replace(
      weights, w2_q=jnp.take_along_axis(jnp.asarray(weights.w2_q), perm[:, None, :], axis=-1),
      w13_q=_take_rows(weights.w13_q, rows), w13_scale=_take_rows(weights.w13_scale, rows),
      w13_bias=_take_rows(weights.w13_bias, rows), w2_g_idx=None)


def _take_rows(a: Array | None, rows: Array) -> Array | None:
  """a [E, N, ...] with its rows reordered per expert by rows [E, N]."""
  if a is None:
    return None
  a = jnp.asarray(a)
  return jnp.take_along_axis(a, rows.reshape(rows.shape + (1,) * (a.ndim - 2)), axis=1)


def pack_w4a8(int4_weights: Int4MoEWeights) -> W4A8PackedWeights:
  """Packs int4 experts for the CPU W4A8 kernel (`convert_to_w4a8_int8_moe_format`).

  Pure jnp (no native library needed), jittable. Pack once and keep the result
  when the same weights run many times: `fused_moe` on `Int4MoEWeights` packs
  on every call.
  """
  from jax_moeq.ops.w4a8_cpu import convert_to_w4a8_int8_moe_format
  validate_int4_weights(int4_weights)
  if int4_weights.has_act_order:
    raise ValueError("pack_w4a8 takes weights without act-order (g_idx); fold w2's with "
                     "fold_w2_act_order (w13's cannot run on the W4A8 kernel)")
  w = int4_weights
  w13_packed, w2_packed, *_ = convert_to_w4a8_int8_moe_format(
      w.w13_q, w.w2_q, w.w13_scale, w.w2_scale, w.group_size, w.w13_bias, w.w2_bias)
  return W4A8PackedWeights(w13_packed, w2_packed, w.hidden_size, w.intermediate_size,
                           w.group_size)


def _unpack_gemm(packed: Array, n: int, k: int, group_size: int):
  """jnp inverse of the packing of one GEMM (layout in docs/design.md).

  Returns (q int8 [E, N, K], scale f32 [E, N, G], bias f32 [E, N]).
  """
  from jax_moeq.ops.w4a8_cpu import BLOCK_INPUTS, TILE_ROWS
  e = packed.shape[0]
  g = k if group_size == -1 else group_size
  groups, tiles, blocks = k // g, n // TILE_ROWS, g // BLOCK_INPUTS
  chunk = blocks * 64 + 4 * TILE_ROWS
  body = packed[:, :tiles * groups * chunk].reshape(e, tiles, groups, chunk)
  w = body[..., :blocks * 64].reshape(e, tiles, groups, blocks, TILE_ROWS, 4)
  lo = (w & 0x0F).astype(jnp.int8) - 8
  hi = (w >> 4).astype(jnp.int8) - 8
  q = jnp.stack([lo, hi], axis=-2)  # [e, tiles, groups, blocks, 16, 2, 4]
  q = q.transpose(0, 1, 4, 2, 3, 5, 6).reshape(e, n, k)
  scale_bytes = body[..., blocks * 64:].reshape(e, tiles, groups, TILE_ROWS, 4)
  scale = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)  # [e, tiles, groups, 16]
  scale = scale.transpose(0, 1, 3, 2).reshape(e, n, groups)
  tail = packed[:, tiles * groups * chunk:].reshape(e, 2, n, 4)
  bias = jax.lax.bitcast_convert_type(tail[:, 1], jnp.float32)
  return q, scale, bias


def unpack_w4a8(packed: W4A8PackedWeights) -> Int4MoEWeights:
  """Inverse of `pack_w4a8` in jnp (jittable), for running packed weights on the reference.

  Scales come back as float32 (the packer widened them exactly), biases as
  float32 (zeros where the packed weights had none).
  """
  validate_w4a8_packed_weights(packed)
  h, i, g = packed.hidden_size, packed.intermediate_size, packed.group_size
  q13, s13, b13 = _unpack_gemm(packed.w13_packed, 2 * i, h, g)
  q2, s2, b2 = _unpack_gemm(packed.w2_packed, h, i, g)
  return Int4MoEWeights(q13, s13, q2, s2, g, b13, b2)
