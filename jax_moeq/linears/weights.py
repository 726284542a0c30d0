"""`Int4LinearWeights`: the canonical int4 form of one dense linear layer (SPEC §2, §12).

Every linear backend prepares from it, as every experts backend prepares from
`jax_moeq.weights.Int4MoEWeights`:

    weights = quantize_linear(w, group_size=128)             # RTN, SPEC §2
    qkv = concat_linears([q_proj, k_proj, v_proj])           # one GEMM over all output rows
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq.quant import int4

Array = jax.Array

__all__ = ["Int4LinearWeights", "concat_linears", "dequantize_linear", "quantize_linear",
           "validate_linear_weights"]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q", "scale", "g_idx", "zeros", "bias"],
                   meta_fields=["group_size"])
@dataclasses.dataclass(frozen=True)
class Int4LinearWeights:
  """One linear layer `y = x · Wᵀ (+ b)` with int4 `W [N, K]` (N outputs, K inputs).

  Attributes:
    q: [N, K] int8 holding signed int4 values in [-8, 7], in natural input order (with zero
      points: unsigned values in [0, 15]).
    scale: [N, K/g] group scales (bf16; fp16 / f32 accepted), or [N, 1] f32 (group_size -1).
    group_size: 32, 64, 128, or -1 (channel-wise).
    g_idx: [K] int32, the group of each input channel (GPTQ act-order), or None for contiguous
      groups (k // g).
    zeros: [N, K/g] integer zero points in [0, 15] (w = (q − z)·s with q in [0, 15], AWQ), or
      None (symmetric).
    bias: [N] float, or None.
  """
  q: Array
  scale: Array
  group_size: int
  g_idx: Array | None = None
  zeros: Array | None = None
  bias: Array | None = None

  @property
  def out_features(self) -> int:
    return self.q.shape[0]

  @property
  def in_features(self) -> int:
    return self.q.shape[1]

  @property
  def has_act_order(self) -> bool:
    return self.g_idx is not None

  @property
  def has_zero_points(self) -> bool:
    return self.zeros is not None


def validate_linear_weights(weights: Int4LinearWeights) -> None:
  """TypeError / ValueError naming the field unless `weights` is a well-formed int4 linear."""
  if not isinstance(weights, Int4LinearWeights):
    raise TypeError(f"weights must be Int4LinearWeights, got {type(weights).__name__}")
  q = weights.q
  if jnp.ndim(q) != 2:
    raise ValueError(f"q must be 2-D [out, in], got shape {jnp.shape(q)}")
  if jnp.asarray(q).dtype != jnp.int8:
    raise TypeError(f"q must be int8 holding int4 values, got {jnp.asarray(q).dtype}")
  n, k = q.shape
  group = int4.validate_group_size(weights.group_size, k)
  groups = k // group
  if jnp.shape(weights.scale) != (n, groups):
    raise ValueError(f"scale must have shape {(n, groups)} for q {(n, k)} and group_size="
                     f"{weights.group_size}, got {jnp.shape(weights.scale)}")
  if not jnp.issubdtype(jnp.asarray(weights.scale).dtype, jnp.floating):
    raise TypeError(f"scale must be floating point, got {jnp.asarray(weights.scale).dtype}")
  if weights.g_idx is not None:
    if jnp.shape(weights.g_idx) != (k,):
      raise ValueError(f"g_idx must have shape ({k},), got {jnp.shape(weights.g_idx)}")
    if not jnp.issubdtype(jnp.asarray(weights.g_idx).dtype, jnp.integer):
      raise TypeError(f"g_idx must be integer, got {jnp.asarray(weights.g_idx).dtype}")
  if weights.zeros is not None and jnp.shape(weights.zeros) != (n, groups):
    raise ValueError(f"zeros must have shape {(n, groups)}, got {jnp.shape(weights.zeros)}")
  if weights.bias is not None and jnp.shape(weights.bias) != (n,):
    raise ValueError(f"bias must have shape ({n},), got {jnp.shape(weights.bias)}")


def quantize_linear(w: Array, group_size: int, bias: Array | None = None) -> Int4LinearWeights:
  """Round-to-nearest symmetric int4 of a float `w [out, in]` (`jax_moeq.quantize_int4`, SPEC
  §2): bf16 group scales, or f32 channel scales for group_size -1. `bias [out]` is kept (f32)."""
  w = jnp.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"w must be 2-D [out, in], got shape {w.shape}")
  q, scale = int4.quantize_int4(w, group_size)
  if bias is not None:
    bias = jnp.asarray(bias, jnp.float32)
    if bias.shape != (w.shape[0],):
      raise ValueError(f"bias must have shape ({w.shape[0]},), got {bias.shape}")
  return Int4LinearWeights(q, scale, group_size, bias=bias)


def dequantize_linear(weights: Int4LinearWeights, dtype=jnp.float32) -> Array:
  """`W [out, in]` = (q − z)·s per input channel's group, formed in float32, cast to `dtype`."""
  validate_linear_weights(weights)
  k = weights.in_features
  group = k if weights.group_size == -1 else weights.group_size
  groups_of_k = (jnp.arange(k) // group if weights.g_idx is None
                 else jnp.asarray(weights.g_idx, jnp.int32))
  v = jnp.asarray(weights.q).astype(jnp.float32)
  if weights.zeros is not None:
    v = v - jnp.take(jnp.asarray(weights.zeros).astype(jnp.float32), groups_of_k, axis=1)
  s = jnp.take(jnp.asarray(weights.scale).astype(jnp.float32), groups_of_k, axis=1)
  return (v * s).astype(dtype)


def concat_linears(parts: Sequence[Int4LinearWeights]) -> Int4LinearWeights:
  """One linear whose output rows are `parts`' rows in order (fused q/k/v or gate/up).

  The parts must share the input size, group size, act-order `g_idx`, scale dtype and the
  presence of zero points; a missing bias of some part becomes zeros. Each output row is
  computed from its own weights only, so the fused GEMM equals the separate ones (SPEC §12).

  Raises:
    ValueError: fewer than one part, or parts that differ in any of the above (naming it).
  """
  parts = list(parts)
  if not parts:
    raise ValueError("concat_linears needs at least one Int4LinearWeights")
  for i, p in enumerate(parts):
    try:
      validate_linear_weights(p)
    except (TypeError, ValueError) as e:
      raise type(e)(f"parts[{i}]: {e}") from None
  first = parts[0]
  for i, p in enumerate(parts[1:], 1):
    if p.in_features != first.in_features:
      raise ValueError(f"cannot fuse: parts[{i}] has {p.in_features} inputs, parts[0] "
                       f"{first.in_features}")
    if p.group_size != first.group_size:
      raise ValueError(f"cannot fuse: parts[{i}] has group_size={p.group_size}, parts[0] "
                       f"group_size={first.group_size}")
    if jnp.asarray(p.scale).dtype != jnp.asarray(first.scale).dtype:
      raise ValueError(f"cannot fuse: parts[{i}] has {jnp.asarray(p.scale).dtype} scales, "
                       f"parts[0] {jnp.asarray(first.scale).dtype}")
    if (p.zeros is None) != (first.zeros is None):
      raise ValueError(f"cannot fuse: parts[{i}] and parts[0] differ in having zero points")
    if not _same_g_idx(first.g_idx, p.g_idx):
      raise ValueError(f"cannot fuse: parts[{i}] and parts[0] have different act-order g_idx "
                       "(input channels grouped differently)")
  cat = lambda name: jnp.concatenate([jnp.asarray(getattr(p, name)) for p in parts], axis=0)
  bias = None
  if any(p.bias is not None for p in parts):
    bias = jnp.concatenate([
        jnp.zeros((p.out_features,), jnp.float32) if p.bias is None
        else jnp.asarray(p.bias, jnp.float32) for p in parts])
  return Int4LinearWeights(cat("q"), cat("scale"), first.group_size, g_idx=first.g_idx,
                           zeros=None if first.zeros is None else cat("zeros"), bias=bias)


def _same_g_idx(a: Array | None, b: Array | None) -> bool:
  if a is None or b is None:
    return a is None and b is None
  return bool(np.array_equal(np.asarray(a), np.asarray(b)))
