"""Symmetric int4 quantization and int4 storage formats (SPEC §2), in jax.numpy.

- int4-as-int8: int8 arrays holding values in [-8, 7], the unpacked form every
  packer starts from.
- nibbles: uint8, two values a byte, value + 8, even input index low.
- uint4b8 int32 (GPTQ / compressed-tensors checkpoints): eight nibbles per
  int32, nibble j holds element 8r + j of the packed axis, stored as q + 8.
  GPTQ packs the input axis of [in, out] (`qweight [in/8, out]`);
  compressed-tensors the input axis of [out, in] (`weight_packed [out, in/8]`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
INT4_MIN, INT4_MAX = -8, 7
_NIBBLE_SHIFTS = tuple(4 * j for j in range(8))


def _exact_divide(a: Array, b: Array) -> Array:
  """a / b correctly rounded: XLA rewrites division by a broadcast or a constant into a
  multiplication by its reciprocal (off by an ulp), which the barrier prevents."""
  a = jnp.asarray(a)
  shape = jnp.broadcast_shapes(a.shape, jnp.shape(b))
  b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), shape))
  return a / b


def validate_group_size(group_size: int, in_features: int, *, name: str = "group_size") -> int:
  """Checks a group size against the input size; returns the effective group."""
  if group_size not in SUPPORTED_GROUP_SIZES:
    raise ValueError(f"{name}={group_size} is not one of {SUPPORTED_GROUP_SIZES}")
  if group_size == -1:
    return in_features
  if in_features % group_size:
    raise ValueError(f"{name}={group_size} does not divide the input size {in_features}")
  return group_size


def quantize_int4(w: Array, group_size: int) -> tuple[Array, Array]:
  """Round-to-nearest symmetric int4 along the last (input) axis.

  scale = absmax / 7.5 per group (the GPTQ / compressed-tensors symmetric rule),
  q = clamp(round_half_even(w / scale), -8, 7); an all-zero group gets scale 1.
  The scale is rounded to its storage dtype (bf16 for groups, f32 for
  channel-wise) *before* dividing, so q is the best fit for the stored scale.
  Divisions are correctly rounded float32 (see `_exact_divide`), as numpy's.

  Args:
    w: [..., out, in] float weights.
    group_size: 32, 64, 128, or -1 (channel-wise).

  Returns:
    (q int8 [..., out, in], scale bf16 [..., out, in/g] or f32 [..., out, 1]).
  """
  w = jnp.asarray(w)
  if w.ndim < 2:
    raise ValueError(f"w must be at least 2-D [..., out, in], got shape {w.shape}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"w must be floating point, got {w.dtype}")
  in_features = w.shape[-1]
  g = validate_group_size(group_size, in_features)
  groups = w.reshape(*w.shape[:-1], in_features // g, g).astype(jnp.float32)
  absmax = jnp.max(jnp.abs(groups), axis=-1)
  scale_dtype = jnp.float32 if group_size == -1 else jnp.bfloat16
  scale = jnp.where(absmax == 0, 1.0, _exact_divide(absmax, 7.5)).astype(scale_dtype)
  q = jnp.round(_exact_divide(groups, scale.astype(jnp.float32)[..., None]))
  q = jnp.clip(q, INT4_MIN, INT4_MAX).astype(jnp.int8).reshape(w.shape)
  return q, scale


def dequantize_int4(q: Array, scale: Array, group_size: int, dtype=jnp.float32) -> Array:
  """q [..., out, in] int8 and its scales -> float weights of `dtype`."""
  in_features = q.shape[-1]
  g = validate_group_size(group_size, in_features)
  groups = q.reshape(*q.shape[:-1], in_features // g, g).astype(jnp.float32)
  w = groups * scale.astype(jnp.float32)[..., None]
  return w.reshape(q.shape).astype(dtype)


def pack_int4_nibbles(q: Array) -> Array:
  """int4-as-int8 [..., n] -> uint8 [..., n/2]: value + 8, even index in the low nibble."""
  if q.shape[-1] % 2:
    raise ValueError(f"the last axis of {q.shape} must be even to pack nibbles")
  u = (q.astype(jnp.int32) + 8).astype(jnp.uint8)
  return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4_nibbles(packed: Array) -> Array:
  """Inverse of `pack_int4_nibbles`."""
  if packed.dtype != jnp.uint8:
    raise TypeError(f"packed nibbles must be uint8, got {packed.dtype}")
  lo = (packed & 0x0F).astype(jnp.int8) - 8
  hi = (packed >> 4).astype(jnp.int8) - 8
  return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], -1)


def _pack_uint4b8_last(q: Array) -> Array:
  if q.shape[-1] % 8:
    raise ValueError(f"the packed axis of {q.shape} must be a multiple of 8")
  u = (q.astype(jnp.int32) + 8).astype(jnp.uint32).reshape(*q.shape[:-1], -1, 8)
  words = jnp.zeros(u.shape[:-1], jnp.uint32)
  for j, shift in enumerate(_NIBBLE_SHIFTS):
    words = words | (u[..., j] << shift)
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def _unpack_uint4b8_last(words: Array) -> Array:
  if words.dtype not in (jnp.int32, jnp.uint32):
    raise TypeError(f"uint4b8 data must be int32, got {words.dtype}")
  u = jax.lax.bitcast_convert_type(words, jnp.uint32) if words.dtype == jnp.int32 else words
  nibbles = jnp.stack([(u >> s) & 0xF for s in _NIBBLE_SHIFTS], axis=-1)
  return (nibbles.astype(jnp.int8) - 8).reshape(*u.shape[:-1], -1)


def pack_uint4b8_ct(q: Array) -> Array:
  """int4-as-int8 [..., out, in] -> compressed-tensors `weight_packed` int32 [..., out, in/8]."""
  return _pack_uint4b8_last(q)


def unpack_uint4b8_ct(weight_packed: Array) -> Array:
  """compressed-tensors `weight_packed` int32 [..., out, in/8] -> int8 [..., out, in]."""
  return _unpack_uint4b8_last(weight_packed)


def pack_uint4b8_gptq(q: Array) -> Array:
  """int4-as-int8 [..., out, in] -> GPTQ `qweight` int32 [..., in/8, out]."""
  return jnp.swapaxes(_pack_uint4b8_last(q), -1, -2)


def unpack_uint4b8_gptq(qweight: Array) -> Array:
  """GPTQ `qweight` int32 [..., in/8, out] -> int8 [..., out, in]."""
  return _unpack_uint4b8_last(jnp.swapaxes(qweight, -1, -2))


def uint4b8_to_signed_int4(words: Array) -> Array:
  """uint4b8 int32 -> int32 whose nibbles are two's-complement int4 (XOR 0x88888888)."""
  u = jax.lax.bitcast_convert_type(words, jnp.uint32) if words.dtype == jnp.int32 else words
  return jax.lax.bitcast_convert_type(u ^ jnp.uint32(0x88888888), jnp.int32)
