"""CPU W4A8 dense linear `y = x · Wᵀ (+ b)` (SPEC §12) as an XLA FFI custom call.

The weights of one linear are one packed GEMM of the MoE's layout (csrc/cpu/w4a8_layout.h), a
1-D uint8 array from `pack_w4a8_linear`; `w4a8_linear` quantizes each row of x to int8 (SPEC §3)
and runs the MoE's GEMM on it: the same arithmetic as `dynamic_4bit_int_moe`'s GEMM1 for one
expert, output rounded to x's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq import _ffi
from jax_moeq.ops import w4a8_cpu
from jax_moeq.ops._token_batching import fold_token_batches

FFI_TARGET = "jax_moeq_w4a8_linear_cpu"
# Same op writing into a given (aliased) buffer: lets tests poison the output.
FFI_TARGET_INTO = "jax_moeq_w4a8_linear_cpu_into"
# Row lengths of the kernel's row ops are multiples of 16 (csrc/cpu/w4a8_rows.h).
FEATURE_MULTIPLE = 16
# kW4A8MaxFeatures / kW4A8LinearMaxOutFeatures of csrc/cpu/w4a8_moe.h / w4a8_linear.h.
MAX_IN_FEATURES = w4a8_cpu.MAX_FEATURES
MAX_OUT_FEATURES = 1 << 24

Array = jax.Array

__all__ = ["pack_w4a8_linear", "unpack_w4a8_linear", "w4a8_linear", "w4a8_linear_packed_bytes"]


def _check_features(out_features: int, in_features: int, group_size: int) -> None:
  for name, size, most in (("out_features", out_features, MAX_OUT_FEATURES),
                           ("in_features", in_features, MAX_IN_FEATURES)):
    if size <= 0 or size > most:
      raise ValueError(f"{name}={size} must be in [1, {most}]")
    if size % FEATURE_MULTIPLE:
      raise ValueError(f"{name}={size} must be a multiple of {FEATURE_MULTIPLE}")
  w4a8_cpu._check_group_size(group_size, in_features, "the linear")


def w4a8_linear_packed_bytes(out_features: int, in_features: int, group_size: int) -> int:
  """Bytes of a packed linear with `out_features` (N) outputs and `in_features` (K) inputs."""
  out_features, in_features, group_size = int(out_features), int(in_features), int(group_size)
  _check_features(out_features, in_features, group_size)
  return w4a8_cpu.w4a8_packed_bytes(out_features, in_features, group_size)


def pack_w4a8_linear(q: Array, scale: Array, group_size: int, bias: Array | None = None
                     ) -> Array:
  """Packs one int4 linear for `w4a8_linear`.

  Args:
    q: [N, K] int8 holding int4 values in [-8, 7] (N outputs, K inputs; both multiples of 16).
    scale: [N, K/g] group scales (bf16), or [N, 1] (f32) with group_size -1.
    group_size: 32, 64, 128, or -1 (channel-wise).
    bias: optional [N], added in float32 before the output is rounded.

  Returns:
    uint8 [w4a8_linear_packed_bytes(N, K, group_size)]: weights, scales, the zero-point
    correction and the bias (zeros without one), in the MoE's GEMM layout.
  """
  q, scale = jnp.asarray(q), jnp.asarray(scale)
  group_size = int(group_size)
  if q.ndim != 2:
    raise ValueError(f"q must be 2-D [out_features, in_features], got shape {q.shape}")
  if scale.ndim != 2:
    raise ValueError(f"scale must be 2-D [out_features, groups], got shape {scale.shape}")
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (q.shape[0],):
      raise ValueError(f"bias must have shape ({q.shape[0]},), got {bias.shape}")
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise TypeError(f"scale must be floating point, got {scale.dtype}")
  n, k = q.shape
  _check_features(n, k, group_size)
  bias3 = None if bias is None else bias[None]
  w4a8_cpu._check_weight("q", q[None], scale[None], bias3, group_size)
  return w4a8_cpu._pack_gemm(q[None], scale[None], bias3, group_size)[0]


def unpack_w4a8_linear(packed: Any, out_features: int, in_features: int, group_size: int):
  """Inverse of `pack_w4a8_linear` (numpy; for tests and debugging).

  Returns (q int8 [N, K], scale f32 [N, G], row_corr f32 [N], bias f32 [N]).
  """
  packed = np.asarray(packed)
  want = w4a8_linear_packed_bytes(out_features, in_features, group_size)
  if packed.shape != (want,) or packed.dtype != np.uint8:
    raise ValueError(f"packed must be uint8 ({want},), got {packed.dtype}{packed.shape}")
  q, scale, row_corr, bias = w4a8_cpu.unpack_w4a8_gemm(packed[None], out_features, in_features,
                                                       group_size)
  return q[0], scale[0], row_corr[0], bias[0]


# ------------------------------------------------------------------ the op
def _ffi_linear(x, w_packed, *, in_features, out_features, group_size, out_buffer=None):
  """The bare custom call on x [M, K] (no Python-side validation: the handler validates)."""
  _ffi.cpu_module()
  lead = x.shape[:1] if x.ndim else ()
  result = jax.ShapeDtypeStruct((*lead, out_features), x.dtype)
  operands = (x, w_packed)
  if out_buffer is None:
    call = jax.ffi.ffi_call(FFI_TARGET, result)
  else:
    call = jax.ffi.ffi_call(FFI_TARGET_INTO, result, input_output_aliases={2: 0})
    operands += (out_buffer,)
  return call(*operands, in_features=np.int64(in_features), out_features=np.int64(out_features),
              group_size=np.int64(group_size))


def _validate_call(x, w_packed, in_features: int, out_features: int, group_size: int) -> None:
  if x.ndim < 1:
    raise ValueError(f"x must have at least one axis [..., in_features], got shape {x.shape}")
  if x.dtype not in w4a8_cpu.SUPPORTED_DTYPES:
    raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
  _check_features(out_features, in_features, group_size)
  if x.shape[-1] != in_features:
    raise ValueError(f"x has last axis {x.shape[-1]} but in_features={in_features}")
  want = w4a8_cpu.w4a8_packed_bytes(out_features, in_features, group_size)
  if w_packed.ndim != 1 or w_packed.dtype != jnp.uint8:
    raise ValueError(f"w_packed must be a 1-D uint8 array, got {w_packed.dtype}{w_packed.shape}")
  if w_packed.shape[0] != want:
    raise ValueError(
        f"w_packed has {w_packed.shape[0]} bytes; out_features={out_features}, "
        f"in_features={in_features}, group_size={group_size} needs {want} (pack it with "
        "pack_w4a8_linear)")


def w4a8_linear(x: Array, w_packed: Array, *, in_features: int, out_features: int,
                group_size: int, out_buffer: Array | None = None) -> Array:
  """y = x · Wᵀ (+ b) with int4 W and x quantized to int8 per row, on the CPU (SPEC §12).

  Args:
    x: [..., K] float32, bfloat16 or float16; the leading axes are flattened to M rows (M = 0
      gives an empty [..., N]).
    w_packed: uint8 [w4a8_linear_packed_bytes(N, K, group_size)] from `pack_w4a8_linear`.
    in_features, out_features, group_size: K, N and the group size, as packed.
    out_buffer: [..., N] in x's dtype for the kernel to write into (aliased to the output);
      tests pass a NaN-filled one to prove every element is written.

  Returns:
    [..., N] in x's dtype: per row, SPEC §3's int32 group dots, float32 across groups, times
    the row scale, plus bias, rounded once. Works under jit and vmap (a batch of inputs is
    folded into the rows: the weights are shared). A row holding a NaN or an infinity gives NaN
    in every element of its output row and changes no other row.
  """
  in_features, out_features, group_size = int(in_features), int(out_features), int(group_size)
  x, w_packed = jnp.asarray(x), jnp.asarray(w_packed)
  _validate_call(x, w_packed, in_features, out_features, group_size)
  lead = x.shape[:-1]
  rows = math.prod(lead)
  static = dict(in_features=in_features, out_features=out_features, group_size=group_size)
  x2 = x.reshape(rows, in_features)
  if out_buffer is None:
    op = fold_token_batches(lambda a, w: _ffi_linear(a, w, **static), num_token_args=1)
    y = op(x2, w_packed)
  else:
    out_buffer = jnp.asarray(out_buffer)
    if out_buffer.shape != (*lead, out_features) or out_buffer.dtype != x.dtype:
      raise ValueError(f"out_buffer must be {x.dtype}{(*lead, out_features)}, got "
                       f"{out_buffer.dtype}{out_buffer.shape}")
    op = fold_token_batches(lambda a, o, w: _ffi_linear(a, w, out_buffer=o, **static),
                            num_token_args=2)
    y = op(x2, out_buffer.reshape(rows, out_features), w_packed)
  return y.reshape(*lead, out_features)
