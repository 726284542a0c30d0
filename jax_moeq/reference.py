"""Pure jax.numpy ground truth for every op (SPEC §9), with the kernels' rounding points.

Also the REFERENCE backend, so every MoE here runs at real sizes (E=64, H=2048, I=1024, T=512)
in bounded memory. How: the T·K (token, slot) pairs are sorted by expert (stable) and laid out
in blocks of B rows (the mean pairs per expert rounded up to a power of two, clamped to
[8, 64], at most T·K), each expert's run padded to a multiple of B (the
`moe_align_block_size` layout); `lax.map` walks the at most ceil(T·K/B) + min(E, T·K) blocks,
skipping empty ones with `lax.cond`, and each block runs one expert's whole MLP on its B rows.
Cost: GEMM work for at most T·K + E·(B−1) rows (≤ 2x the routed work at T·K ≥ E·B, less
padding when fewer experts are hit); memory: one expert's weights widened to float32 plus
O(B·N) per step, and the [T·K, H] expert outputs. Nothing is gathered per pair, so no
[T, K, N, H] weight tensor ever exists.

Rounding: `round_to_dtype` rounds float32 values to bf16/fp16 and back with operations XLA never
drops (`reduce_precision`, and an exact subnormal path for fp16), so jit and every backend give
the same values. Pairs whose expert id is outside [0, E) contribute nothing (under jit ids are
data; outside jit they raise ValueError, as the kernel does).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq import routing as routing_lib
from jax_moeq.quant import int4

Array = jax.Array

ACTIVATION_KINDS = (0, 1, 2)  # SWIGLUSTEP silu(g)*u, SWIGLUOAI, SILU (== 0)
_HIGHEST = jax.lax.Precision.HIGHEST
# (qa - zp) in [-255, 255] times int4 in [-8, 7] is at most 2040 in magnitude, so float32 sums
# of up to 8192 such products are exact integers (8192 * 2040 < 2**24).
_EXACT_CHUNK = 8192
_BLOCK_ROWS = 64
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# ------------------------------------------------------------------ rounding
def round_to_dtype(v: Array, dtype) -> Array:
  """float32 `v` rounded to nearest-even in `dtype` (f32 / bf16 / fp16), returned as float32."""
  v = v.astype(jnp.float32)
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return v
  if dtype == jnp.bfloat16:
    return jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)
  if dtype == jnp.float16:
    # reduce_precision flushes fp16 subnormals; below 2**-14 fp16 is a fixed-point grid of 2**-24.
    normal = jax.lax.reduce_precision(v, exponent_bits=5, mantissa_bits=10)
    subnormal = jnp.round(v * 2.0**24) * 2.0**-24
    return jnp.where(jnp.abs(v) < 2.0**-14, subnormal, normal)
  raise TypeError(f"cannot round to {dtype}; expected float32, bfloat16 or float16")


def _exact_divide(a: Array, b) -> Array:
  """a / b correctly rounded in float32. XLA rewrites division by a broadcast or a constant into
  a multiplication by the reciprocal (an ulp off, enough to flip an int8 rounding); hiding the
  divisor behind an optimization barrier keeps the true division."""
  a = jnp.asarray(a, jnp.float32)
  shape = jnp.broadcast_shapes(a.shape, jnp.shape(b))
  b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), shape))
  return a / b


def _check_float_dtype(name: str, dtype) -> None:
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {jnp.dtype(dtype).name}")


# ------------------------------------------------------------------ int8 activations (SPEC §3)
def quantize_activations_int8(x: Array) -> tuple[Array, Array, Array]:
  """Dynamic asymmetric per-row int8 quantization (KleidiAI qai8dxp / XNNPACK), SPEC §3.

  In float32 (bf16/fp16 upcast first), in the written order, rounding half to even.

  Args:
    x: [..., K] floats.

  Returns:
    (qa int8 [..., K], scale float32 [...], zp int32 [...]); rows with max == min (all zero,
    the range always includes 0), or a range so small (below ~7.5e-37) that 1 / scale
    overflows, give qa 0, scale 0, zp 0; rows holding a NaN or an infinity
    give qa 0, zp 0 and scale NaN (every GEMM output of the row is NaN, as in the kernel).
    Dequantized: (qa - zp) * scale.
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must be floating point, got {x.dtype}")
  if x.ndim < 1:
    raise ValueError(f"x must have at least one axis, got shape {x.shape}")
  x = x.astype(jnp.float32)
  rmin = jnp.minimum(jnp.min(x, axis=-1), 0.0)
  rmax = jnp.maximum(jnp.max(x, axis=-1), 0.0)
  scale = _exact_divide(rmax - rmin, 255.0)
  inv = _exact_divide(1.0, scale)
  # A range so small that 1 / scale overflows (subnormal or flushed scale) counts as empty.
  empty = (rmax == rmin) | ~(inv <= jnp.finfo(jnp.float32).max)
  scale = jnp.where(empty, 0.0, scale)
  inv = jnp.where(empty, 0.0, inv)
  min_term = jnp.float32(-128.0) + rmin * inv
  max_term = jnp.float32(127.0) + rmax * inv
  zp = jnp.where(min_term + max_term > 0.0, jnp.float32(-128.0) - rmin * inv,
                 jnp.float32(127.0) - rmax * inv)
  zp = jnp.round(jnp.clip(zp, -128.0, 127.0)).astype(jnp.int32)
  zp = jnp.where(empty, 0, zp)
  qa = jnp.round(x * inv[..., None]).astype(jnp.int32) + zp[..., None]
  qa = jnp.where(empty[..., None], 0, jnp.clip(qa, -128, 127)).astype(jnp.int8)
  finite = jnp.all(jnp.isfinite(x), axis=-1)
  qa = jnp.where(finite[..., None], qa, jnp.int8(0))
  zp = jnp.where(finite, zp, 0)
  scale = jnp.where(finite, scale, jnp.float32(jnp.nan))
  return qa, scale.astype(jnp.float32), zp


# ------------------------------------------------------------------ W4A8 GEMM
def _exact_chunk(group: int) -> int:
  """Largest divisor of `group` that keeps float32 sums of W4A8 products exact."""
  if group <= _EXACT_CHUNK:
    return group
  for parts in range(2, group + 1):
    if group % parts == 0 and group // parts <= _EXACT_CHUNK:
      return group // parts
  return 1


def _w4a8_matmul(qa: Array, a_scale: Array, zp: Array, q_w: Array, w_scale: Array, group: int,
                 bias: Array | None) -> Array:
  """[M, K] int8 activations x [N, K] int4 weights -> f32 [M, N] (SPEC §3 GEMM).

  Per group: sum_k (qa - zp) * qw as an exact integer (float32 dots over chunks whose sums stay
  below 2**24, chunks added in int32); across groups: float32, times sw[n, g]; then times the
  row scale, plus bias.
  """
  m, k = qa.shape
  n = q_w.shape[0]
  groups = k // group
  chunk = _exact_chunk(group)
  chunks = k // chunk
  a = (qa.astype(jnp.int32) - zp[:, None]).astype(jnp.float32)
  a = a.reshape(m, chunks, chunk).transpose(1, 0, 2)  # [J, M, c]
  w = q_w.astype(jnp.float32).reshape(n, chunks, chunk).transpose(1, 2, 0)  # [J, c, N]
  dots = jax.lax.dot_general(a, w, (((2,), (1,)), ((0,), (0,))), precision=_HIGHEST,
                             preferred_element_type=jnp.float32)  # [J, M, N], exact integers
  per_group = dots.astype(jnp.int32).reshape(groups, chunks // groups, m, n).sum(axis=1)
  scaled = per_group.astype(jnp.float32) * w_scale.astype(jnp.float32).T[:, None, :]
  acc = jnp.sum(scaled, axis=0)  # [M, N]
  y = acc * a_scale[:, None]
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y


def w4a8_linear(x: Array, q_w: Array, w_scale: Array, group_size: int,
                bias: Array | None = None) -> Array:
  """y = W4A8(x, q_w) (SPEC §3): x quantized to int8 per row, int4 weights, float32 output.

  Args:
    x: [..., K] floats.
    q_w: [N, K] int8 holding int4 values.
    w_scale: [N, K/g] (bf16 group scales) or [N, 1] (f32, group_size=-1).
    group_size: 32, 64, 128 or -1.
    bias: optional [N].

  Returns:
    float32 [..., N] (not rounded to x's dtype).
  """
  x = jnp.asarray(x)
  q_w = jnp.asarray(q_w)
  if q_w.ndim != 2:
    raise ValueError(f"q_w must be 2-D [N, K], got shape {q_w.shape}")
  if q_w.dtype != jnp.int8:
    raise TypeError(f"q_w must be int8 holding int4 values, got {q_w.dtype}")
  n, k = q_w.shape
  if x.shape[-1:] != (k,):
    raise ValueError(f"x has last axis {x.shape[-1:]} but q_w has K={k}")
  group = int4.validate_group_size(group_size, k)
  if jnp.shape(w_scale) != (n, k // group):
    raise ValueError(f"w_scale must have shape {(n, k // group)}, got {jnp.shape(w_scale)}")
  if bias is not None and jnp.shape(bias) != (n,):
    raise ValueError(f"bias must have shape ({n},), got {jnp.shape(bias)}")
  lead = x.shape[:-1]
  qa, a_scale, zp = quantize_activations_int8(x.reshape(-1, k))
  y = _w4a8_matmul(qa, a_scale, zp, q_w, jnp.asarray(w_scale), group, bias)
  return y.reshape(*lead, n)


def linear_w4a8(x: Array, q_w: Array, w_scale: Array, group_size: int,
                bias: Array | None = None) -> Array:
  """The W4A8 dense linear of SPEC §12: `w4a8_linear` rounded once to x's dtype.

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    q_w: [N, K] int8 holding int4 values. w_scale: [N, K/g] (bf16) or [N, 1] (f32, g = -1).
    group_size: 32, 64, 128 or -1. bias: optional [N], added in float32 before the rounding.

  Returns:
    [..., N] in x.dtype (`dynamic_4bit_int_moe`'s GEMM1 output for one expert, rounded as the
    MoE rounds it before the activation).
  """
  x = jnp.asarray(x)
  _check_float_dtype("x", x.dtype)
  return round_to_dtype(w4a8_linear(x, q_w, w_scale, group_size, bias), x.dtype).astype(x.dtype)


def linear_wna16(x: Array, q_w: Array, w_scale: Array, group_size: int, *,
                 g_idx: Array | None = None, zeros: Array | None = None,
                 bias: Array | None = None) -> Array:
  """The weight-only int4 dense linear of SPEC §12 (Marlin's dense GEMM).

  Weights dequantized per element to x's dtype as the WNA16 MoE does (round(f32(q - z)·f32(s))),
  float32 products and accumulation, plus bias in float32, rounded once to x's dtype.

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    q_w: [N, K] int8: signed int4 values, or 0..15 with `zeros` (w = (q - z)·s).
    w_scale: [N, K/g] group scales ([N, 1] for group_size -1).
    group_size: 32, 64, 128 or -1.
    g_idx: optional [K] integer group of each input channel (act-order): the scale of (n, k) is
      w_scale[n, g_idx[k]]; without it, k // g.
    zeros: optional [N, K/g] zero points; None = symmetric.
    bias: optional [N].

  Returns:
    [..., N] in x.dtype.
  """
  x, q_w = jnp.asarray(x), jnp.asarray(q_w)
  _check_float_dtype("x", x.dtype)
  if q_w.ndim != 2:
    raise ValueError(f"q_w must be 2-D [N, K], got shape {q_w.shape}")
  if q_w.dtype != jnp.int8:
    raise TypeError(f"q_w must be int8 (int4 values, or 0..15 with zeros), got {q_w.dtype}")
  n, k = q_w.shape
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(f"x must be [..., {k}] to match q_w {q_w.shape}, got shape {x.shape}")
  group = int4.validate_group_size(group_size, k)
  _check_bias("w_scale", w_scale, (n, k // group))
  _check_bias("zeros", zeros, (n, k // group))
  _check_bias("bias", bias, (n,))
  if g_idx is not None:
    g_idx = jnp.asarray(g_idx)
    if g_idx.shape != (k,):
      raise ValueError(f"g_idx must have shape ({k},), got {g_idx.shape}")
    if not jnp.issubdtype(g_idx.dtype, jnp.integer):
      raise TypeError(f"g_idx must be integer, got {g_idx.dtype}")
  w = _dequantize_expert(q_w, jnp.asarray(w_scale), None if zeros is None else jnp.asarray(zeros),
                         g_idx, group, x.dtype)
  y = _dot_f32(x.reshape(-1, k), w)
  y = _add_bias(y, None if bias is None else jnp.asarray(bias)[None], 0)
  return round_to_dtype(y, x.dtype).astype(x.dtype).reshape(*x.shape[:-1], n)


# ------------------------------------------------------------------ activation
def _sigmoid(v: Array) -> Array:
  return 1.0 / (1.0 + jnp.exp(-v))  # the kernels' formula (not lax.logistic)


def apply_activation(y13: Array, activation_kind: int = 0) -> Array:
  """Gated activation of y13 [..., 2I] (gate half first) in float32 (SPEC §4 step 3).

  0 (SWIGLUSTEP) and 2 (SILU): silu(g) * u. 1 (SWIGLUOAI): g' = min(g, 7),
  u' = clip(u, -7, 7), (u' + 1) * g' * sigmoid(1.702 g').
  """
  if activation_kind not in ACTIVATION_KINDS:
    raise ValueError(f"activation_kind={activation_kind} is not one of {ACTIVATION_KINDS}")
  if y13.shape[-1] % 2:
    raise ValueError(f"y13 must have an even last axis (gate, up), got shape {y13.shape}")
  i = y13.shape[-1] // 2
  g = y13[..., :i].astype(jnp.float32)
  u = y13[..., i:].astype(jnp.float32)
  if activation_kind == 1:
    g = jnp.minimum(g, 7.0)
    u = jnp.clip(u, -7.0, 7.0)
    return (u + 1.0) * (g * _sigmoid(jnp.float32(1.702) * g))
  return g * _sigmoid(g) * u


# ------------------------------------------------------------------ expert-block engine
def _check_routing(x: Array, topk_ids: Array, topk_weights: Array, num_experts: int):
  x = jnp.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"x must be 2-D [T, H], got shape {x.shape}")
  _check_float_dtype("x", x.dtype)
  topk_ids = jnp.asarray(topk_ids) if not isinstance(topk_ids, jax.core.Tracer) else topk_ids
  if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
    raise ValueError(f"topk_ids must be [T, K] with T={x.shape[0]}, got shape {topk_ids.shape}")
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise TypeError(f"topk_ids must be int32 (or int64), got {topk_ids.dtype}")
  if jnp.shape(topk_weights) != topk_ids.shape:
    raise ValueError(f"topk_weights shape {jnp.shape(topk_weights)} != topk_ids shape "
                     f"{topk_ids.shape}")
  if not isinstance(topk_ids, jax.core.Tracer) and topk_ids.size:
    ids = np.asarray(topk_ids)
    bad = np.argwhere((ids < 0) | (ids >= num_experts))
    if bad.size:
      t, k = bad[0]
      raise ValueError(f"expert id out of range: topk_ids[{t}, {k}] = {ids[t, k]}, expected "
                       f"[0, {num_experts})")
  return x, topk_ids.astype(jnp.int32), jnp.asarray(topk_weights).astype(jnp.float32)


def _check_call(x: Array, topk_ids: Array, topk_weights: Array, num_experts: int, hidden: int,
                activation_kind: int):
  """The checks every fused-MoE reference makes of its call: the activation kind, the routing
  (_check_routing) and x's hidden size against the weights'. Returns _check_routing's arrays."""
  if activation_kind not in ACTIVATION_KINDS:
    raise ValueError(f"activation_kind={activation_kind} is not one of {ACTIVATION_KINDS}")
  x, topk_ids, topk_weights = _check_routing(x, topk_ids, topk_weights, num_experts)
  if x.shape[1] != hidden:
    raise ValueError(f"x has hidden size {x.shape[1]}, the weights {hidden}")
  return x, topk_ids, topk_weights


def _run_expert_blocks(topk_ids: Array, num_experts: int, out_features: int, out_dtype,
                       expert_fn) -> Array:
  """Runs `expert_fn(e, pairs [B], rows_valid [B]) -> [B, out_features]` over expert blocks.

  Pairs are flat (token, slot) indices t*K + k. Returns [T*K, out_features] in pair order;
  pairs with an id outside [0, E) get zeros.
  """
  flat = topk_ids.reshape(-1)
  pairs = flat.shape[0]
  # Rows per block: the mean pairs per expert (so decode does not pad every expert to 64),
  # between 8 and 64.
  mean_rows = -(-pairs // num_experts)
  block = min(_BLOCK_ROWS, max(8, 1 << (mean_rows - 1).bit_length()), pairs)
  num_blocks = -(-pairs // block) + min(num_experts, pairs)
  valid = (flat >= 0) & (flat < num_experts)
  key = jnp.where(valid, flat, num_experts)
  order = jnp.argsort(key, stable=True)  # sorted position -> pair
  sorted_key = key[order]
  counts = jnp.bincount(key, length=num_experts + 1)[:num_experts]
  padded = (counts + block - 1) // block * block
  padded_end = jnp.cumsum(padded)
  sorted_start = jnp.concatenate([jnp.zeros(1, counts.dtype), jnp.cumsum(counts)])
  safe_key = jnp.minimum(sorted_key, num_experts - 1)
  rank = jnp.arange(pairs) - sorted_start[safe_key]
  dest = jnp.where(sorted_key < num_experts, padded_end[safe_key] - padded[safe_key] + rank,
                   num_blocks * block)
  slot_pair = jnp.full(num_blocks * block, -1, jnp.int32).at[dest].set(
      order.astype(jnp.int32), mode="drop")
  block_expert = jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right")
  block_pairs = slot_pair.reshape(num_blocks, block)

  def one_block(args):
    e, pair_ids = args
    rows_valid = pair_ids >= 0
    safe_pairs = jnp.maximum(pair_ids, 0)
    return jax.lax.cond(
        e < num_experts,
        lambda: expert_fn(e, safe_pairs, rows_valid).astype(out_dtype),
        lambda: jnp.zeros((block, out_features), out_dtype))

  outs = jax.lax.map(one_block, (block_expert.astype(jnp.int32), block_pairs))
  outs = outs.reshape(num_blocks * block, out_features)
  pair_dest = jnp.zeros(pairs, dest.dtype).at[order].set(dest)
  per_pair = jnp.take(outs, pair_dest, axis=0, mode="fill", fill_value=0)
  return jnp.where(valid[:, None], per_pair, jnp.zeros((), out_dtype))


def _combine_rounded(y2: Array, topk_weights: Array, weighted: bool, dtype) -> Array:
  """SPEC §4 step 5: v = round(y2 * w) (if weighted); out = round(out + v) in slot order."""
  t, k, _ = y2.shape
  out = jnp.zeros((t, y2.shape[-1]), jnp.float32)
  for slot in range(k):
    v = y2[:, slot].astype(jnp.float32)
    if weighted:
      v = round_to_dtype(v * topk_weights[:, slot, None], dtype)
    out = round_to_dtype(out + v, dtype)
  return out.astype(dtype)


def _routed_input(x: Array, topk_weights: Array, pair_ids: Array, top_k: int,
                  on_input: bool) -> Array:
  """float32 GEMM1 input rows for `pair_ids`: x[t], or round(x[t] * w[t, k]) on input."""
  a = x[pair_ids // top_k].astype(jnp.float32)
  if on_input:
    a = round_to_dtype(a * topk_weights.reshape(-1)[pair_ids][:, None], x.dtype)
  return a


def _check_bias(name: str, bias, shape) -> None:
  if bias is not None and jnp.shape(bias) != shape:
    raise ValueError(f"{name} must have shape {shape}, got {jnp.shape(bias)}")


def _zeros_like_tokens(x: Array) -> Array:
  return jnp.zeros(x.shape, x.dtype)


# ------------------------------------------------------------------ fused W4A8 MoE (SPEC §4)
def fused_moe_w4a8(x: Array, topk_ids: Array, topk_weights: Array, w13_q: Array,
                   w13_scale: Array, w2_q: Array, w2_scale: Array, group_size: int, *,
                   w13_bias: Array | None = None, w2_bias: Array | None = None,
                   apply_router_weight_on_input: bool = False,
                   activation_kind: int = 0) -> Array:
  """The CPU W4A8 fused MoE (`dynamic_4bit_int_moe`, SPEC §4) on unpacked weights.

  Rounding points, as the kernel: GEMM1 input a = x[t] (or round(x[t]·w) per pair with
  `apply_router_weight_on_input`), int8-quantized per row; y13 = W4A8 -> rounded to x.dtype;
  activation in float32 on the rounded gate/up -> rounded; quantized per row; y2 = W4A8 ->
  rounded; v = round(y2·w) unless applied on input; out = round(out + v) over slots in order,
  from zeros.

  Args:
    x: [T, H] float32 / bfloat16 / float16.
    topk_ids: [T, K] int32 (int64 accepted). topk_weights: [T, K].
    w13_q: [E, 2I, H] int8 (int4 values), gate rows first. w13_scale: [E, 2I, H/g] or [E, 2I, 1].
    w2_q: [E, H, I] int8. w2_scale: [E, H, I/g] or [E, H, 1].
    group_size: 32, 64, 128 or -1 (channel-wise), for both GEMMs.
    w13_bias: optional [E, 2I]; w2_bias: optional [E, H] (added in float32 before rounding).

  Returns:
    [T, H] in x.dtype.
  """
  w13_q, w2_q = jnp.asarray(w13_q), jnp.asarray(w2_q)
  for name, q in (("w13_q", w13_q), ("w2_q", w2_q)):
    if q.ndim != 3:
      raise ValueError(f"{name} must be 3-D [E, N, K], got shape {q.shape}")
    if q.dtype != jnp.int8:
      raise TypeError(f"{name} must be int8 holding int4 values, got {q.dtype}")
  e, i2, h = w13_q.shape
  if i2 % 2:
    raise ValueError(f"w13_q has {i2} output rows; expected 2I (gate, up)")
  i = i2 // 2
  if w2_q.shape != (e, h, i):
    raise ValueError(f"w2_q must have shape {(e, h, i)} to match w13_q {w13_q.shape}, got "
                     f"{w2_q.shape}")
  g13 = int4.validate_group_size(group_size, h)
  g2 = int4.validate_group_size(group_size, i)
  _check_bias("w13_scale", w13_scale, (e, i2, h // g13))
  _check_bias("w2_scale", w2_scale, (e, h, i // g2))
  _check_bias("w13_bias", w13_bias, (e, i2))
  _check_bias("w2_bias", w2_bias, (e, h))
  x, topk_ids, topk_weights = _check_call(x, topk_ids, topk_weights, e, h, activation_kind)
  t, k = topk_ids.shape
  if t * k == 0:
    return _zeros_like_tokens(x)
  dtype = x.dtype
  on_input = bool(apply_router_weight_on_input)

  def expert_mlp(ex, pair_ids, rows_valid):
    del rows_valid
    a = _routed_input(x, topk_weights, pair_ids, k, on_input)
    qa, s, zp = quantize_activations_int8(a)
    b13 = None if w13_bias is None else w13_bias[ex]
    y13 = round_to_dtype(_w4a8_matmul(qa, s, zp, w13_q[ex], w13_scale[ex], g13, b13), dtype)
    act = round_to_dtype(apply_activation(y13, activation_kind), dtype)
    qa, s, zp = quantize_activations_int8(act)
    b2 = None if w2_bias is None else w2_bias[ex]
    return _w4a8_matmul(qa, s, zp, w2_q[ex], w2_scale[ex], g2, b2)

  y2 = _run_expert_blocks(topk_ids, e, h, dtype, expert_mlp).reshape(t, k, h)
  return _combine_rounded(y2, topk_weights, not on_input, dtype)


# ------------------------------------------------------------------ unquantized MoE
def _check_float_experts(w13: Array, w2: Array, w13_bias, w2_bias):
  w13, w2 = jnp.asarray(w13), jnp.asarray(w2)
  if w13.ndim != 3 or w13.shape[1] % 2:
    raise ValueError(f"w13 must be [E, 2I, H], got shape {w13.shape}")
  e, i2, h = w13.shape
  if w2.shape != (e, h, i2 // 2):
    raise ValueError(f"w2 must have shape {(e, h, i2 // 2)} to match w13 {w13.shape}, got "
                     f"{w2.shape}")
  _check_float_dtype("w13", w13.dtype)
  _check_float_dtype("w2", w2.dtype)
  _check_bias("w13_bias", w13_bias, (e, i2))
  _check_bias("w2_bias", w2_bias, (e, h))
  return w13, w2


def _dot_f32(a: Array, w: Array) -> Array:
  """a [M, K] @ w[N, K].T with float32 inputs and accumulation."""
  return jax.lax.dot_general(a.astype(jnp.float32), w.astype(jnp.float32),
                             (((1,), (1,)), ((), ())), precision=_HIGHEST,
                             preferred_element_type=jnp.float32)


def _add_bias(y: Array, bias: Array | None, ex) -> Array:
  return y if bias is None else y + bias[ex].astype(jnp.float32)


def fused_moe_float(x: Array, topk_ids: Array, topk_weights: Array, w13: Array, w2: Array, *,
                    w13_bias: Array | None = None, w2_bias: Array | None = None,
                    apply_router_weight_on_input: bool = False,
                    activation_kind: int = 0) -> Array:
  """Unquantized MoE with the W4A8 op's rounding points (SPEC §4) and float32 GEMMs.

  w13 [E, 2I, H], w2 [E, H, I] in any float dtype, used as float32 (products and sums in
  float32, `Precision.HIGHEST`). y13, the activation and y2 are rounded to x.dtype;
  v = round(y2·w) unless on input; out = round(out + v) over slots in order.
  """
  w13, w2 = _check_float_experts(w13, w2, w13_bias, w2_bias)
  e, _, h = w13.shape
  x, topk_ids, topk_weights = _check_call(x, topk_ids, topk_weights, e, h, activation_kind)
  t, k = topk_ids.shape
  if t * k == 0:
    return _zeros_like_tokens(x)
  dtype = x.dtype
  on_input = bool(apply_router_weight_on_input)

  def expert_mlp(ex, pair_ids, rows_valid):
    del rows_valid
    a = _routed_input(x, topk_weights, pair_ids, k, on_input)
    y13 = round_to_dtype(_add_bias(_dot_f32(a, w13[ex]), w13_bias, ex), dtype)
    act = round_to_dtype(apply_activation(y13, activation_kind), dtype)
    return _add_bias(_dot_f32(act, w2[ex]), w2_bias, ex)

  y2 = _run_expert_blocks(topk_ids, e, h, dtype, expert_mlp).reshape(t, k, h)
  return _combine_rounded(y2, topk_weights, not on_input, dtype)


def fused_moe_ragged_dot(x: Array, topk_ids: Array, topk_weights: Array, w13: Array, w2: Array,
                         *, w13_bias: Array | None = None, w2_bias: Array | None = None,
                         apply_router_weight_on_input: bool = False,
                         activation_kind: int = 0) -> Array:
  """The plain-XLA MoE baseline: pairs sorted by expert, `lax.ragged_dot` GEMMs.

  Weights are cast to x.dtype (as a bf16/fp16 deployment holds them), GEMMs accumulate in
  float32 (`preferred_element_type`); rounding points as `fused_moe_float`, so with weights
  already in x.dtype the two agree up to float32 summation order.
  """
  w13, w2 = _check_float_experts(w13, w2, w13_bias, w2_bias)
  e, _, h = w13.shape
  x, topk_ids, topk_weights = _check_call(x, topk_ids, topk_weights, e, h, activation_kind)
  t, k = topk_ids.shape
  if t * k == 0:
    return _zeros_like_tokens(x)
  dtype = x.dtype
  on_input = bool(apply_router_weight_on_input)
  flat = topk_ids.reshape(-1)
  valid = (flat >= 0) & (flat < e)
  key = jnp.where(valid, flat, e)
  order = jnp.argsort(key, stable=True)
  sorted_ids = jnp.minimum(key[order], e - 1)
  # Invalid pairs sort last, outside every group, and come out as zeros.
  sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
  a = _routed_input(x, topk_weights, order, k, on_input).astype(dtype)
  y13 = jax.lax.ragged_dot(a, jnp.swapaxes(w13, 1, 2).astype(dtype), sizes,
                           preferred_element_type=jnp.float32)
  if w13_bias is not None:
    y13 = y13 + w13_bias[sorted_ids].astype(jnp.float32)
  y13 = round_to_dtype(y13, dtype)
  act = round_to_dtype(apply_activation(y13, activation_kind), dtype).astype(dtype)
  y2 = jax.lax.ragged_dot(act, jnp.swapaxes(w2, 1, 2).astype(dtype), sizes,
                          preferred_element_type=jnp.float32)
  if w2_bias is not None:
    y2 = y2 + w2_bias[sorted_ids].astype(jnp.float32)
  y2 = jnp.where(valid[order][:, None], round_to_dtype(y2, dtype), 0.0)
  per_pair = jnp.zeros((t * k, h), jnp.float32).at[order].set(y2).reshape(t, k, h)
  return _combine_rounded(per_pair, topk_weights, not on_input, dtype)


# ------------------------------------------------------------------ weight-only int4 (WNA16)
def _dequantize_expert(q: Array, scale: Array, zeros: Array | None, g_idx: Array | None,
                       group: int, dtype) -> Array:
  """One expert's [N, K] weights -> round_dtype(f32(q - z) * f32(s)) as float32 values."""
  n, k = q.shape
  if g_idx is None:
    groups_of_k = jnp.arange(k) // group
  else:
    groups_of_k = g_idx.astype(jnp.int32)
  s = jnp.take(scale.astype(jnp.float32), groups_of_k, axis=1)  # [N, K]
  v = q.astype(jnp.float32)
  if zeros is not None:
    v = v - jnp.take(zeros.astype(jnp.float32), groups_of_k, axis=1)
  return round_to_dtype(v * s, dtype)


def _wna16_moe(x, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale, g13, g2, w13_zeros,
               w2_zeros, w13_g_idx, w2_g_idx, w13_bias, w2_bias, activation_kind, on_input):
  e, _, h = w13_q.shape
  t, k = topk_ids.shape
  dtype = x.dtype

  def pick(arr, ex):
    return None if arr is None else arr[ex]

  def expert_mlp(ex, pair_ids, rows_valid):
    del rows_valid
    a = _routed_input(x, topk_weights, pair_ids, k, on_input)
    w13 = _dequantize_expert(w13_q[ex], w13_scale[ex], pick(w13_zeros, ex), pick(w13_g_idx, ex),
                             g13, dtype)
    y13 = round_to_dtype(_add_bias(_dot_f32(a, w13), w13_bias, ex), dtype)
    act = round_to_dtype(apply_activation(y13, activation_kind), dtype)
    w2 = _dequantize_expert(w2_q[ex], w2_scale[ex], pick(w2_zeros, ex), pick(w2_g_idx, ex),
                            g2, dtype)
    y2 = _add_bias(_dot_f32(act, w2), w2_bias, ex)
    if not on_input:
      y2 = y2 * topk_weights.reshape(-1)[pair_ids][:, None]
    return round_to_dtype(y2, dtype)

  y2 = _run_expert_blocks(topk_ids, e, h, dtype, expert_mlp).reshape(t, k, h)
  return round_to_dtype(jnp.sum(y2.astype(jnp.float32), axis=1), dtype).astype(dtype)


def _check_wna16_weights(name: str, q, scale, zeros, g_idx, group_size: int, e: int, n: int,
                         kk: int) -> int:
  if q.shape != (e, n, kk):
    raise ValueError(f"{name}_q must have shape {(e, n, kk)}, got {q.shape}")
  if q.dtype != jnp.int8:
    raise TypeError(f"{name}_q must be int8 (int4 values, or 0..15 with zeros), got {q.dtype}")
  group = int4.validate_group_size(group_size, kk)
  if jnp.shape(scale) != (e, n, kk // group):
    raise ValueError(f"{name}_scale must have shape {(e, n, kk // group)}, got "
                     f"{jnp.shape(scale)}")
  if zeros is not None and jnp.shape(zeros) != (e, n, kk // group):
    raise ValueError(f"{name}_zeros must have shape {(e, n, kk // group)}, got "
                     f"{jnp.shape(zeros)}")
  if g_idx is not None:
    if jnp.shape(g_idx) != (e, kk):
      raise ValueError(f"{name}_g_idx must have shape {(e, kk)}, got {jnp.shape(g_idx)}")
    if not jnp.issubdtype(jnp.asarray(g_idx).dtype, jnp.integer):
      raise TypeError(f"{name}_g_idx must be integer, got {jnp.asarray(g_idx).dtype}")
  return group


def fused_moe_wna16(x: Array, topk_ids: Array, topk_weights: Array, w13_q: Array,
                    w13_scale: Array, w2_q: Array, w2_scale: Array, group_size: int, *,
                    w13_zeros: Array | None = None, w2_zeros: Array | None = None,
                    w13_g_idx: Array | None = None, w2_g_idx: Array | None = None,
                    w13_bias: Array | None = None, w2_bias: Array | None = None,
                    activation_kind: int = 0,
                    apply_router_weight_on_input: bool = False) -> Array:
  """Weight-only int4 MoE (SPEC §7, Marlin-class), in canonical [E, N, K] orientation.

  Weights: q int8 [E, N, K] signed int4, or 0..15 when zeros are given (w = (q - z)·s);
  scales [E, N, G] fp16/bf16; zeros [E, N, G] in [0, 15]; g_idx [E, K] the group of each input
  channel (act-order): the scale of (n, k) is scale[n, g_idx[k]] (without g_idx, k // g).

  Arithmetic: weights dequantized to x.dtype (round(f32(q - z)·f32(s))); GEMMs with float32
  products and accumulation; y13 (+ bias) rounded to x.dtype; activation rounded; GEMM2
  accumulator (+ bias) times the top-k weight (unless applied on input) in float32, rounded
  once; out = round(sum over slots in float32).
  """
  w13_q, w2_q = jnp.asarray(w13_q), jnp.asarray(w2_q)
  if w13_q.ndim != 3 or w13_q.shape[1] % 2:
    raise ValueError(f"w13_q must be [E, 2I, H], got shape {w13_q.shape}")
  e, i2, h = w13_q.shape
  i = i2 // 2
  g13 = _check_wna16_weights("w13", w13_q, w13_scale, w13_zeros, w13_g_idx, group_size, e, i2,
                             h)
  g2 = _check_wna16_weights("w2", w2_q, w2_scale, w2_zeros, w2_g_idx, group_size, e, h, i)
  _check_bias("w13_bias", w13_bias, (e, i2))
  _check_bias("w2_bias", w2_bias, (e, h))
  x, topk_ids, topk_weights = _check_call(x, topk_ids, topk_weights, e, h, activation_kind)
  if topk_ids.size == 0:
    return _zeros_like_tokens(x)
  return _wna16_moe(x, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale, g13, g2,
                    w13_zeros, w2_zeros, w13_g_idx, w2_g_idx, w13_bias, w2_bias, activation_kind,
                    bool(apply_router_weight_on_input))


# ------------------------------------------------------------------ MxInt4 (SPEC §8)
def fused_moe_mxint4(x: Array, router_logits: Array, w13_q: Array, w13_scale: Array, w2_q: Array,
                     w2_scale: Array, *, top_k: int, routing_method: int,
                     num_expert_group: int | None = None, topk_group: int | None = None,
                     e_score_correction_bias: Array | None = None,
                     routed_scaling_factor: float | None = None, local_expert_offset: int = 0,
                     local_num_experts: int | None = None) -> Array:
  """MxInt4 MoE with routing inside (SPEC §8): `routing.route` over all E experts (E =
  router_logits.shape[1]), then the local experts [offset, offset + local) only; pairs routed
  elsewhere contribute nothing (expert parallelism: the shards' outputs are summed).

  Weights: w13_q [local, 2I, H] int8 (signed int4, gate rows first), w13_scale [local, 2I, H/32]
  bf16; w2_q [local, H, I], w2_scale [local, H, I/32]. Arithmetic of `fused_moe_wna16` with
  group 32, SwiGLU, router weights applied to GEMM2's output. The kernel takes bf16 x; other
  float dtypes are accepted here and rounded to.
  """
  w13_q = jnp.asarray(w13_q)
  if w13_q.ndim != 3 or w13_q.shape[1] % 2:
    raise ValueError(f"w13_q must be [local_num_experts, 2I, H], got shape {w13_q.shape}")
  local, i2, h = w13_q.shape
  if local_num_experts is None:
    local_num_experts = local
  if local_num_experts != local:
    raise ValueError(f"local_num_experts={local_num_experts} but w13_q holds {local} experts")
  logits = jnp.asarray(router_logits)
  if logits.ndim != 2:
    raise ValueError(f"router_logits must be [T, E], got shape {logits.shape}")
  num_experts = logits.shape[1]
  if not 0 <= local_expert_offset <= num_experts - local:
    raise ValueError(f"local experts [{local_expert_offset}, {local_expert_offset + local}) are "
                     f"not inside the {num_experts} routed experts")
  g13 = _check_wna16_weights("w13", w13_q, w13_scale, None, None, 32, local, i2, h)
  g2 = _check_wna16_weights("w2", jnp.asarray(w2_q), w2_scale, None, None, 32, local, h, i2 // 2)
  x = jnp.asarray(x)
  if x.ndim != 2 or x.shape != (logits.shape[0], h):
    raise ValueError(f"x must be [T, H] = {(logits.shape[0], h)}, got shape {x.shape}")
  _check_float_dtype("x", x.dtype)
  weights, ids = routing_lib.route(
      logits, top_k, routing_method, num_expert_group=num_expert_group, topk_group=topk_group,
      e_score_correction_bias=e_score_correction_bias,
      routed_scaling_factor=routed_scaling_factor)
  if ids.size == 0:
    return _zeros_like_tokens(x)
  local_ids = ids - local_expert_offset  # outside [0, local): dropped by the block engine
  return _wna16_moe(x, local_ids, weights, w13_q, w13_scale, jnp.asarray(w2_q), w2_scale, g13,
                    g2, None, None, None, None, None, None, 0, False)
