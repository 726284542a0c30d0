"""CPU W4A8 fused MoE: int4 weights, int8 dynamic per-row activations.

`convert_to_w4a8_int8_moe_format` packs int4-as-int8 expert weights with their
scales and biases into the kernel's self-contained byte layout (one uint8 row
per expert; documented in csrc/cpu/w4a8_layout.h and docs/design.md), and
`dynamic_4bit_int_moe` runs the fused op of SPEC §4 as an XLA FFI custom call.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq import _ffi
from jax_moeq.ops._token_batching import fold_token_batches

FFI_TARGET = "jax_moeq_w4a8_moe_cpu"
# Same op writing into a given (aliased) buffer: lets tests poison the output.
FFI_TARGET_INTO = "jax_moeq_w4a8_moe_cpu_into"
# out = residual + moe(x), the residual added in the kernel's combine.
FFI_TARGET_RESIDUAL = "jax_moeq_w4a8_moe_residual_cpu"
FFI_TARGET_RESIDUAL_INTO = "jax_moeq_w4a8_moe_residual_cpu_into"
TILE_ROWS = 16  # output rows per tile: one zmm of float32
BLOCK_INPUTS = 8  # inputs per 64-byte block
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
ACTIVATION_KINDS = {0: "swiglustep", 1: "swigluoai", 2: "silu"}
# kW4A8MaxFeatures / kW4A8MaxTopK of csrc/cpu/w4a8_moe.h: the kernel's int32 dot products over a
# channel-wise group of up to 2^20 inputs cannot overflow; a chunk's (token, slot) pairs are
# indexed in int32.
MAX_FEATURES = 1 << 20
MAX_TOP_K = 1 << 24

Array = jax.Array


def _effective_group(group_size: int, in_features: int) -> int:
  return in_features if group_size == -1 else group_size


def _check_group_size(group_size: int, in_features: int, what: str) -> None:
  if group_size not in SUPPORTED_GROUP_SIZES:
    raise ValueError(
        f"group_size={group_size} is not supported: expected one of {SUPPORTED_GROUP_SIZES}"
    )
  if group_size != -1 and in_features % group_size:
    raise ValueError(
        f"group_size={group_size} does not divide the input size {in_features} of {what}"
    )


def w4a8_packed_bytes(n: int, k: int, group_size: int) -> int:
  """Bytes of one expert's packed GEMM with `n` outputs and `k` inputs."""
  groups = k // _effective_group(group_size, k)
  return n * k // 2 + 4 * n * groups + 8 * n


def _pack_gemm(q: Array, scale: Array, bias: Array | None, group_size: int) -> Array:
  """Packs [E, N, K] int4-as-int8 weights into [E, bytes] uint8 (layout above)."""
  e, n, k = q.shape
  g = _effective_group(group_size, k)
  groups = k // g
  tiles = n // TILE_ROWS
  blocks = g // BLOCK_INPUTS
  nibbles = (q.astype(jnp.int32) + 8).astype(jnp.uint8)
  # k = gi*g + kb*8 + h*4 + j; h = 0 goes to the low nibble, h = 1 to the high.
  nibbles = nibbles.reshape(e, tiles, TILE_ROWS, groups, blocks, 2, 4)
  packed = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)
  packed = packed.transpose(0, 1, 3, 4, 2, 5).reshape(e, tiles, groups, blocks * 64)
  scale_f32 = scale.astype(jnp.float32).reshape(e, tiles, TILE_ROWS, groups)
  scale_bytes = jax.lax.bitcast_convert_type(
      scale_f32.transpose(0, 1, 3, 2), jnp.uint8
  ).reshape(e, tiles, groups, TILE_ROWS * 4)
  chunks = jnp.concatenate([packed, scale_bytes], axis=-1).reshape(e, -1)
  group_sums = q.astype(jnp.int32).reshape(e, n, groups, g).sum(-1)
  row_corr = (scale.astype(jnp.float32).reshape(e, n, groups) * group_sums.astype(jnp.float32)).sum(-1)
  bias_f32 = jnp.zeros((e, n), jnp.float32) if bias is None else bias.astype(jnp.float32)
  tail = jax.lax.bitcast_convert_type(jnp.stack([row_corr, bias_f32], axis=1), jnp.uint8)
  return jnp.concatenate([chunks, tail.reshape(e, -1)], axis=-1)


def _check_weight(name: str, q: Array, scale: Array, bias: Array | None, group_size: int) -> None:
  if q.ndim != 3:
    raise ValueError(f"{name} must be 3-D [experts, out, in], got shape {q.shape}")
  if q.dtype != jnp.int8:
    raise TypeError(f"{name} must be int8 (int4 values in [-8, 7]), got {q.dtype}")
  e, n, k = q.shape
  if n % TILE_ROWS or k % BLOCK_INPUTS:
    raise ValueError(
        f"{name} shape {q.shape}: out must be a multiple of {TILE_ROWS} and in a multiple of "
        f"{BLOCK_INPUTS}"
    )
  if k > MAX_FEATURES:
    raise ValueError(f"{name} shape {q.shape}: in={k} exceeds the kernel's {MAX_FEATURES}")
  _check_group_size(group_size, k, name)
  groups = k // _effective_group(group_size, k)
  if scale.shape != (e, n, groups):
    raise ValueError(f"{name}_scale must have shape {(e, n, groups)}, got {scale.shape}")
  if bias is not None and bias.shape != (e, n):
    raise ValueError(f"{name}_bias must have shape {(e, n)}, got {bias.shape}")
  if not isinstance(q, jax.core.Tracer):
    # In numpy: under a jit trace, jnp.min of a concrete (closed-over) array is a tracer.
    host = np.asarray(q)
    lo, hi = (int(host.min()), int(host.max())) if host.size else (0, 0)
    if lo < -8 or hi > 7:
      raise ValueError(f"{name} holds values in [{lo}, {hi}], outside the int4 range [-8, 7]")


def convert_to_w4a8_int8_moe_format(
    w13_weight: Array,
    w2_weight: Array,
    w13_weight_scale: Array,
    w2_weight_scale: Array,
    group_size: int,
    w13_bias: Array | None = None,
    w2_bias: Array | None = None,
) -> tuple[Array, Array, Array, Array, Array, Array]:
  """Packs int4 MoE weights for `dynamic_4bit_int_moe` (vLLM's signature).

  Args:
    w13_weight: [E, 2I, H] int8 holding int4 values; rows [0, I) gate, [I, 2I) up.
    w2_weight: [E, H, I] int8 holding int4 values.
    w13_weight_scale: [E, 2I, H/g] (bf16) or [E, 2I, 1] (f32, channel-wise).
    w2_weight_scale: [E, H, I/g] or [E, H, 1].
    group_size: 32, 64, 128, or -1 for channel-wise.
    w13_bias, w2_bias: optional [E, 2I], [E, H].

  Returns:
    (w13_packed [E, B13] uint8, w2_packed [E, B2] uint8, and four empty arrays
    where vLLM returns its unused scale/bias slots): scales and biases live
    inside the packed buffers.
  """
  _check_weight("w13", w13_weight, w13_weight_scale, w13_bias, group_size)
  _check_weight("w2", w2_weight, w2_weight_scale, w2_bias, group_size)
  e, i2, h = w13_weight.shape
  if w2_weight.shape != (e, h, i2 // 2):
    raise ValueError(
        f"w2 must have shape {(e, h, i2 // 2)} to match w13 {w13_weight.shape}, got "
        f"{w2_weight.shape}"
    )
  w13_packed = _pack_gemm(w13_weight, w13_weight_scale, w13_bias, group_size)
  w2_packed = _pack_gemm(w2_weight, w2_weight_scale, w2_bias, group_size)
  empty = jnp.zeros((0,), jnp.float32)
  return w13_packed, w2_packed, empty, empty, empty, empty


def unpack_w4a8_gemm(packed: Any, n: int, k: int, group_size: int):
  """Inverse of the packing for one GEMM (numpy; for tests and debugging).

  Returns (q int8 [E, N, K], scale f32 [E, N, G], row_corr f32 [E, N], bias f32 [E, N]).
  """
  packed = np.asarray(packed)
  e = packed.shape[0]
  g = _effective_group(group_size, k)
  groups, tiles, blocks = k // g, n // TILE_ROWS, g // BLOCK_INPUTS
  body = packed[:, : tiles * groups * (blocks * 64 + 64)].reshape(e, tiles, groups, blocks * 64 + 64)
  w = body[..., : blocks * 64].reshape(e, tiles, groups, blocks, TILE_ROWS, 4)
  lo = (w & 0x0F).astype(np.int8) - 8
  hi = (w >> 4).astype(np.int8) - 8
  q = np.stack([lo, hi], axis=-2)  # [e, tiles, groups, blocks, 16, 2, 4]
  q = q.transpose(0, 1, 4, 2, 3, 5, 6).reshape(e, n, k)
  scale = body[..., blocks * 64 :].copy().view(np.float32).reshape(e, tiles, groups, TILE_ROWS)
  scale = scale.transpose(0, 1, 3, 2).reshape(e, n, groups)
  tail = packed[:, tiles * groups * (blocks * 64 + 64) :].copy().view(np.float32).reshape(e, 2, n)
  return q, scale, tail[:, 0], tail[:, 1]


# ------------------------------------------------------------------ the op
def _validate_call(x, topk_ids, topk_weights, w13_packed, w2_packed, H, I, I2, group_size,
                   activation_kind, residual=None):
  if x.ndim != 2:
    raise ValueError(f"x must be 2-D [tokens, hidden], got shape {x.shape}")
  if x.dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
  if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
    raise ValueError(f"residual must have x's shape and dtype {x.dtype}{x.shape}, got "
                     f"{residual.dtype}{residual.shape}")
  t = x.shape[0]
  if topk_ids.ndim != 2 or topk_ids.shape[0] != t:
    raise ValueError(f"topk_ids must be [tokens={t}, top_k], got shape {topk_ids.shape}")
  if topk_weights.shape != topk_ids.shape:
    raise ValueError(
        f"topk_weights shape {topk_weights.shape} differs from topk_ids shape {topk_ids.shape}"
    )
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
  if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
    raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
  if x.shape[1] != H:
    raise ValueError(f"x has hidden size {x.shape[1]} but H={H}")
  if I2 != 2 * I:
    raise ValueError(f"I2={I2} must equal 2*I={2 * I}")
  for name, size in (("H", H), ("I", I)):
    if size <= 0 or size > MAX_FEATURES:
      raise ValueError(f"{name}={size} must be in [1, {MAX_FEATURES}] (the kernel's int32 dot "
                       "products over a channel-wise group)")
  if topk_ids.shape[1] > MAX_TOP_K:
    raise ValueError(f"topk_ids has top_k={topk_ids.shape[1]}, more than {MAX_TOP_K}")
  if H % TILE_ROWS or I % TILE_ROWS:
    raise ValueError(f"H={H} and I={I} must be multiples of {TILE_ROWS}")
  _check_group_size(group_size, H, "w13 (input size H)")
  _check_group_size(group_size, I, "w2 (input size I)")
  if activation_kind not in ACTIVATION_KINDS:
    raise ValueError(f"activation_kind={activation_kind} is not one of {sorted(ACTIVATION_KINDS)}")
  for name, w in (("w13_packed", w13_packed), ("w2_packed", w2_packed)):
    if w.ndim != 2 or w.dtype != jnp.uint8:
      raise ValueError(f"{name} must be a 2-D uint8 array [experts, bytes], got {w.dtype}{w.shape}")
  if w13_packed.shape[0] != w2_packed.shape[0]:
    raise ValueError(
        f"w13_packed has {w13_packed.shape[0]} experts but w2_packed has {w2_packed.shape[0]}"
    )
  want13, want2 = w4a8_packed_bytes(2 * I, H, group_size), w4a8_packed_bytes(H, I, group_size)
  if w13_packed.shape[1] != want13 or w2_packed.shape[1] != want2:
    raise ValueError(
        f"packed weights have {w13_packed.shape[1]} / {w2_packed.shape[1]} bytes per expert; "
        f"H={H}, I={I}, group_size={group_size} needs {want13} / {want2} (pack them with "
        "convert_to_w4a8_int8_moe_format)"
    )
  if not isinstance(topk_ids, jax.core.Tracer):
    ids = np.asarray(topk_ids)
    e = w13_packed.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= e):
      raise ValueError(
          f"expert id out of range: topk_ids holds values in [{ids.min()}, {ids.max()}], "
          f"expected [0, {e})"
      )


def _ffi_moe(x, topk_ids, topk_weights, w13_packed, w2_packed, *, H, I, group_size,
             apply_router_weight_on_input, activation_kind, out_buffer=None, residual=None):
  """The bare custom call (no Python-side validation: the handler validates)."""
  _ffi.cpu_module()
  result = jax.ShapeDtypeStruct(x.shape, x.dtype)
  operands = (x, topk_ids, topk_weights, w13_packed, w2_packed)
  plain, into = FFI_TARGET, FFI_TARGET_INTO
  if residual is not None:
    plain, into = FFI_TARGET_RESIDUAL, FFI_TARGET_RESIDUAL_INTO
    operands += (residual,)
  if out_buffer is None:
    call = jax.ffi.ffi_call(plain, result)
  else:
    call = jax.ffi.ffi_call(into, result, input_output_aliases={len(operands): 0})
    operands += (out_buffer,)
  return call(
      *operands,
      hidden_size=np.int64(H), intermediate_size=np.int64(I), group_size=np.int64(group_size),
      apply_router_weight_on_input=bool(apply_router_weight_on_input),
      activation_kind=np.int64(activation_kind),
  )


def _batched_moe(static: dict, num_token_args: int):
  """The op with a vmap rule (_token_batching): a batch of token sets sharing weights is one
  bigger token set; per-batch weights fall back to a sequential map. Token arguments: x,
  topk_ids, topk_weights and, when there are four, the residual."""
  def call(*args):
    (x, topk_ids, topk_weights, *residual), (w13_packed, w2_packed) = (
        args[:num_token_args], args[num_token_args:])
    return _ffi_moe(x, topk_ids, topk_weights, w13_packed, w2_packed,
                    residual=residual[0] if residual else None, **static)
  return fold_token_batches(call, num_token_args)


def dynamic_4bit_int_moe(
    x: Array,
    topk_ids: Array,
    topk_weights: Array,
    w13_packed: Array,
    w2_packed: Array,
    H: int,
    I: int,
    I2: int,
    group_size: int,
    apply_router_weight_on_input: bool = False,
    activation_kind: int = 0,
    residual: Array | None = None,
) -> Array:
  """Fused int4-weight / int8-activation MoE on the CPU (SPEC §4).

  Args:
    x: [T, H] float32, bfloat16 or float16.
    topk_ids: [T, K] int32 (int64 accepted) expert ids in [0, E).
    topk_weights: [T, K] router weights (computed in float32).
    w13_packed, w2_packed: from `convert_to_w4a8_int8_moe_format`.
    H, I, I2: hidden size, intermediate size, and 2*I (vLLM's arguments).
    group_size: 32, 64, 128 or -1 (channel-wise), as packed.
    apply_router_weight_on_input: scale x by the router weight before GEMM1
      instead of scaling the expert output.
    activation_kind: 0 SwiGLU, 1 SwiGLU-OAI (GPT-OSS), 2 SiLU (= SwiGLU).
    residual: optional [T, H] in x's dtype: the result is then `residual + moe(x)`,
      bit for bit as that add in x's dtype after the op, done in the kernel's combine
      (a decoder layer's residual add without an XLA op of its own between the layers).

  Returns:
    [T, H] in x's dtype. Works under jit and vmap (a batch of token sets is
    folded into the token axis).

  Expert ids outside [0, E): concrete ids (outside jit) raise ValueError; under
  jit, where ids are data, such a (token, slot) pair contributes nothing to its
  token (a token with no id in range gets zeros), as in
  `reference.fused_moe_w4a8`.

  Non-finite activations: a token whose row of x holds a NaN or an infinity
  gets NaN in every element of its output (its int8 quantization scale is
  NaN), and no other token's output changes, bit for bit (the quantization is
  per row, tokens are independent), on every ISA path.
  """
  H, I, I2, group_size, activation_kind = map(int, (H, I, I2, group_size, activation_kind))
  x, topk_ids, topk_weights = jnp.asarray(x), jnp.asarray(topk_ids), jnp.asarray(topk_weights)
  residual = None if residual is None else jnp.asarray(residual)
  _validate_call(x, topk_ids, topk_weights, w13_packed, w2_packed, H, I, I2, group_size,
                 activation_kind, residual)
  static = dict(H=H, I=I, group_size=group_size,
                apply_router_weight_on_input=bool(apply_router_weight_on_input),
                activation_kind=activation_kind)
  token_args = (x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32))
  if residual is not None:
    token_args += (residual,)
  return _batched_moe(static, len(token_args))(*token_args, w13_packed, w2_packed)
