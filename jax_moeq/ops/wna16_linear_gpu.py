"""GPU WNA16 dense linear (int4 weights, bf16/fp16 activations): weight packer and FFI op.

Semantics: SPEC §12 (WNA16). The kernel (csrc/cuda/wna16_linear.cu, `jax_moeq_wna16_linear_cuda`)
computes, for x [M, K] and W [N, K] of signed int4 values q with scales s (and zero points z):
  y = round(x @ dequant(W).T + bias),  dequant(w) = round((q - z) · s) in x's dtype,
with f32 accumulation and one rounding to x's dtype at the end (z = 0: symmetric). Act-order
(GPTQ desc_act, `g_idx`) permutes the input channels as in SPEC §7: they are sorted by group once
when packing, and x's columns are gathered in that order on the GPU before the GEMM.

It runs the fused MoE's GEMMs on a dense problem (one "expert" holding every row in order): the
mma.sync GEMM with split-K for few rows, the wgmma GEMM for many (`choose_linear_launch`).

Packed layout (one expert of the MoE's layout, wna16_gpu.py; see csrc/cuda/int4_mma_core.cuh):
  weights  uint32 [N/16, K/64, 32, 4]: the mma A-fragments of each lane, one 16-byte load
  scales   [G, N/16, 16] in x's dtype: for lane group g the pair (s[row g], s[row g+8])
  zeros    same layout as scales (zero points as nibble values z + 8), or a [1] placeholder
  bias     float32 [N], or a [1] placeholder
  perm     int32 [K]: sorted input channel -> channel (act-order), or a [1] placeholder
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq.ops import _gpu_launch
from jax_moeq.ops import wna16_gpu
from jax_moeq.ops._token_batching import fold_token_batches
from jax_moeq.quant import int4

Array = jax.Array

FFI_TARGET = "jax_moeq_wna16_linear_cuda"
FFI_TARGET_INTO = "jax_moeq_wna16_linear_cuda_into"
KERNEL_DTYPES = wna16_gpu.KERNEL_DTYPES
# N and K: multiples of 64 (the wgmma GEMM's half tile of output rows; the 64-deep chunk along K).
FEATURE_MULTIPLE = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Wna16LinearWeights:
  """A dense int4 linear in the kernel's layout (a pytree; sizes and flags are static)."""
  weights: Array
  scales: Array
  zeros: Array
  bias: Array
  perm: Array
  in_features: int = dataclasses.field(metadata=dict(static=True))
  out_features: int = dataclasses.field(metadata=dict(static=True))
  group_size: int = dataclasses.field(metadata=dict(static=True))  # K when channel-wise
  has_zeros: bool = dataclasses.field(metadata=dict(static=True))
  has_bias: bool = dataclasses.field(metadata=dict(static=True))
  act_order: bool = dataclasses.field(metadata=dict(static=True))

  @property
  def dtype(self):
    return self.scales.dtype


def _is_concrete(a) -> bool:
  return not isinstance(a, jax.core.Tracer)


def _check_int4_values(q: Array) -> None:
  if q.ndim != 2:
    raise ValueError(f"q must be [out_features, in_features], got shape {q.shape}")
  if q.dtype != jnp.int8:
    raise TypeError(f"q must be int8 holding signed int4 values in [-8, 7], got {q.dtype}")
  n, k = q.shape
  if n % FEATURE_MULTIPLE or k % FEATURE_MULTIPLE or n == 0 or k == 0:
    raise ValueError(f"the kernel needs out_features and in_features to be positive multiples of "
                     f"{FEATURE_MULTIPLE}, got q of shape {q.shape}")
  if _is_concrete(q):
    lo, hi = int(jnp.min(q)), int(jnp.max(q))
    if lo < -8 or hi > 7:
      raise ValueError(f"q must hold int4 values in [-8, 7], got values in [{lo}, {hi}]")


def _check_g_idx(g_idx, k: int, groups: int, group: int) -> Array:
  g_idx = jnp.asarray(g_idx)
  if g_idx.shape != (k,):
    raise ValueError(f"g_idx must be [in_features] = [{k}], got shape {g_idx.shape}")
  if not jnp.issubdtype(g_idx.dtype, jnp.integer):
    raise TypeError(f"g_idx must be integer, got {g_idx.dtype}")
  if _is_concrete(g_idx):
    counts = np.bincount(np.asarray(g_idx, np.int64).clip(-1, groups) + 1, minlength=groups + 2)
    if counts[0] or counts[-1] or np.any(counts[1:-1] != group):
      raise ValueError(f"g_idx must give each of the {groups} groups exactly group_size = {group} "
                       "input channels (GPTQ act-order), values in [0, groups)")
  return g_idx.astype(jnp.int32)


def pack_wna16_linear(q: Array, scale: Array, group_size: int, *, g_idx: Array | None = None,
                      zeros: Array | None = None, bias: Array | None = None,
                      dtype=jnp.bfloat16) -> Wna16LinearWeights:
  """A dense int4 linear -> `Wna16LinearWeights` in the kernel's layout (jittable when the
  arrays are traced; concrete arrays are also checked for their values).

  Args:
    q: [N, K] int8, signed int4 values in [-8, 7] (SPEC §2), natural input order.
    scale: [N, K / group_size] (bf16 group-wise), or [N, 1] (f32 channel-wise, group_size -1);
      stored in `dtype`.
    group_size: 32, 64, 128 or -1 (channel-wise); must divide K.
    g_idx: [K] act-order group of each input channel (each group exactly group_size channels),
      or None.
    zeros: [N, K / group_size] integer zero points in q's value domain ([-8, 7]; AWQ style,
      w = (q - z) · s), or None (symmetric).
    bias: [N] (any float dtype; kept as float32), or None.
    dtype: activation dtype of the calls (bfloat16 or float16): scales and zeros are stored in
      it, so a call in that dtype casts nothing.
  """
  dtype = jnp.dtype(dtype)
  if dtype not in [jnp.dtype(d) for d in KERNEL_DTYPES]:
    raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
  q = jnp.asarray(q)
  _check_int4_values(q)
  n, k = q.shape
  group = int4.validate_group_size(group_size, k, name="group_size")
  groups = k // group
  scale = jnp.asarray(scale)
  if scale.shape != (n, groups):
    raise ValueError(f"scale must be [out_features, in_features / group_size] = {(n, groups)}, "
                     f"got {scale.shape}")
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise TypeError(f"scale must be floating point, got {scale.dtype}")
  qzeros = None
  if zeros is not None:
    zeros = jnp.asarray(zeros)
    if zeros.shape != (n, groups):
      raise ValueError(f"zeros must be [out_features, in_features / group_size] = {(n, groups)}, "
                       f"got {zeros.shape}")
    if not jnp.issubdtype(zeros.dtype, jnp.integer):
      raise TypeError(f"zeros must be integer zero points in [-8, 7], got {zeros.dtype}")
    if _is_concrete(zeros) and zeros.size and (int(jnp.min(zeros)) < -8 or
                                               int(jnp.max(zeros)) > 7):
      raise ValueError("zeros must hold zero points in q's value domain [-8, 7]")
    # Nibble-domain zero points z + 8, GPTQ qzeros order (nibble j of word c: output 8c + j).
    qzeros = int4.pack_uint4b8_ct(jnp.swapaxes(zeros, 0, 1)[None])
  if g_idx is not None:
    g_idx = _check_g_idx(g_idx, k, groups, group)[None]
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (n,):
      raise ValueError(f"bias must be [out_features] = [{n}], got {bias.shape}")
  # One expert of the MoE packer: GPTQ qweight [1, K/8, N], scales [1, G, N].
  gemm = wna16_gpu._process_gemm(  # pylint: disable=protected-access
      int4.pack_uint4b8_gptq(q[None]), jnp.swapaxes(scale, 0, 1)[None], name="linear",
      group_size=group_size, g_idx=g_idx, qzeros=qzeros, dtype=dtype)
  placeholder = lambda dt: jnp.zeros((1,), dt)
  return Wna16LinearWeights(
      weights=gemm["w"][0],
      scales=gemm["s"][0],
      zeros=gemm["z"][0] if gemm["z"] is not None else placeholder(dtype),
      bias=bias.astype(jnp.float32) if bias is not None else placeholder(jnp.float32),
      perm=gemm["perm"][0] if gemm["perm"] is not None else placeholder(jnp.int32),
      in_features=k, out_features=n, group_size=gemm["group"], has_zeros=zeros is not None,
      has_bias=bias is not None, act_order=g_idx is not None)


# ------------------------------------------------------------------ launch choice
# Launch rule of the dense linear, from the H100 (2026-11-26, bf16, group 128, us per call with
# weights colder than L2; benchmarks/gpu_linear_bench.py --variants, two runs) on Qwen3-30B-A3B's
# shapes and a dense MLP of hidden 2048 (gate/up N = 12288, down K = 6144):
#   M = 16: mma.sync block_m 16 with split-K 13.5-21 vs the wgmma 32-row tile 19.7-53 on N <= 12288
#     (the same launch measured 14.5-18.7 in two processes: small calls vary by ~25 %); the LM
#     head: wgmma 32-row 82.5-83.0 vs mma.sync 86.9.
#   M = 64: wgmma 64-row tile 24.1 / 25.3 vs mma.sync block_m 32 33.5 / 43.1 at N = 5120 / 12288
#     (20 / 48 CTAs); at N = 2048 (8 CTAs) mma.sync block_m 32 with split-K 31.1 / 32.6 vs wgmma
#     42.9 / 64.8 (block_m 32 ahead of 64 on all four shapes of the first run); the LM head: wgmma
#     64-row 118-121 vs 128-row 149.
#   M = 256: wgmma 64-row tile 24.8 / 44.1 / 65.3 vs 128-row 31.9 / 56.4 / 82.9 where the 128-row
#     launch has 40 / 16 / 16 CTAs; 128-row 33.2 vs 64-row 45.4 at 96 CTAs (gate/up) and 309 vs
#     431 on the LM head.
#   M = 2048 (128-row launches of 128-9496 CTAs): 128-row 77.5-2458 vs 64-row 100.7-3325.
# Rows up to which the mma.sync GEMM at block_m 8 streams the weights once per call, as the MoE's
# decode blocks do (_gpu_launch.BLOCK_FILL of 8 rows).
MMA_BLOCK8_MAX_ROWS = int(_gpu_launch.BLOCK_FILL * 8)
# Up to this many rows the mma.sync GEMM (block_m 16, split-K) unless the wgmma 32-row tile alone
# fills a wave of the SMs.
MMA_BLOCK16_MAX_ROWS = 16
# Up to this many rows the wgmma 32/64-row tile where its launch has at least WGMMA_MIN_CTAS CTAs,
# else the mma.sync GEMM at block_m 32 with split-K.
WGMMA_SMALL_TILE_MAX_ROWS = 64
WGMMA_MIN_CTAS = 16
# Beyond: the 128-row tile where its launch has at least this fraction of a wave (one CTA per SM),
# else the 64-row tile (twice the CTAs); measured crossover between 40 and 96 CTAs (132 SMs).
WGMMA_TILE128_MIN_WAVE = 0.5
MMA_BLOCK_MS = (8, 16, 32, 64)


def _wgmma_ctas(rows: int, out_features: int, block_m: int) -> int:
  """CTAs of a wgmma launch: row blocks x tiles of 256 output rows."""
  return -(-rows // block_m) * -(-out_features // 256)


def _wgmma_ctas_per_sm(block_m: int) -> int:
  return 2 if block_m == 32 else 1  # WgmmaTile<kN>::kCtasPerSm


def _automatic_launch(rows: int, out_features: int) -> tuple[int, int]:
  """(block_m, main-loop code) of the automatic rule (see the measurements above)."""
  sms = _gpu_launch.num_sms()
  registers, wgmma = _gpu_launch.MAINLOOPS["registers"], _gpu_launch.MAINLOOPS["wgmma"]
  if rows <= MMA_BLOCK8_MAX_ROWS:
    return 8, registers
  if rows <= MMA_BLOCK16_MAX_ROWS:
    if _wgmma_ctas(rows, out_features, 32) >= sms * _wgmma_ctas_per_sm(32):
      return 32, wgmma
    return 16, registers
  if rows <= WGMMA_SMALL_TILE_MAX_ROWS:
    tile = 32 if rows <= 32 else 64
    if _wgmma_ctas(rows, out_features, tile) >= WGMMA_MIN_CTAS:
      return tile, wgmma
    return 32, registers
  if _wgmma_ctas(rows, out_features, 128) >= WGMMA_TILE128_MIN_WAVE * sms:
    return 128, wgmma
  return 64, wgmma


def choose_linear_launch(rows: int, out_features: int, in_features: int, *,
                         block_m: int | None = None, mainloop: str | None = None,
                         split: int | None = None) -> tuple[int, int, int]:
  """(block_m, main-loop code, split-K factor) of one call of M = `rows` rows.

  Automatic (block_m and mainloop None, `_automatic_launch`): the mma.sync GEMM at block_m 8 up to
  MMA_BLOCK8_MAX_ROWS rows (one block streams the weights once) and at block_m 16 up to
  MMA_BLOCK16_MAX_ROWS; then the wgmma GEMM's 32- or 64-row tile where that launch has enough CTAs
  (else the mma.sync GEMM at block_m 32), and beyond WGMMA_SMALL_TILE_MAX_ROWS rows its 128-row tile
  where that launch has at least half a wave of CTAs, else the 64-row tile. A dense linear is one
  "expert": at few rows its launches hold few CTAs, which split-K (mma.sync only) or the smaller
  tile multiplies. Split-K as the MoE chooses it (_gpu_launch.choose_split; 1 in deterministic mode
  and on the wgmma GEMM). Explicit block_m / mainloop / split (benchmarks, tests) are taken as given
  (ValueError for ones the kernels do not take).
  """
  if block_m is None and mainloop is None:
    block_m, mainloop_id = _automatic_launch(rows, out_features)
  else:
    if block_m is None:
      raise ValueError("mainloop needs block_m (8, 16, 32, 64 or 128)")
    block_m, mainloop_id = _gpu_launch.choose_launch("wna16", float(rows), block_m, mainloop)
  wgmma = _gpu_launch.uses_wgmma(block_m, mainloop_id)
  if split is None:
    if wgmma or _gpu_launch.deterministic():
      split = 1
    else:
      split = _gpu_launch.choose_split(-(-rows // block_m), out_features // 32,
                                       in_features // 64, block_m, rows * out_features * 4)
  elif not isinstance(split, (int, np.integer)) or not 1 <= split <= 1024:
    raise ValueError(f"split must be an int in [1, 1024], got {split!r}")
  elif wgmma and split != 1:
    raise ValueError("the wgmma GEMM (block_m 128 or a wgmma main loop) does not split K: "
                     f"split must be 1, got {split}")
  return block_m, mainloop_id, int(split)


# ------------------------------------------------------------------ the op
def _check_x(x: Array, weights: Wna16LinearWeights) -> Wna16LinearWeights:
  if not isinstance(weights, Wna16LinearWeights):
    raise TypeError("weights must be Wna16LinearWeights (pack_wna16_linear), got "
                    f"{type(weights).__name__}")
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in KERNEL_DTYPES]:
    raise TypeError(f"x must be bfloat16 or float16, got {x.dtype}")
  if x.ndim < 1 or x.shape[-1] != weights.in_features:
    raise ValueError(f"x must be [..., in_features = {weights.in_features}], got shape "
                     f"{x.shape}")
  if weights.dtype != x.dtype:  # one cast per call; pack with dtype=x.dtype to avoid it
    weights = dataclasses.replace(weights, scales=weights.scales.astype(x.dtype),
                                  zeros=weights.zeros.astype(x.dtype))
  return weights


def _call(x: Array, weights: Wna16LinearWeights, out_init: Array | None, *,
          block_m: int | None, mainloop: str | None, split: int | None) -> Array:
  m, k = x.shape
  n = weights.out_features
  if m == 0:
    return jnp.zeros((0, n), x.dtype)
  if m * max(n, k) >= 1 << 31:
    raise ValueError(f"x has {m} rows of max(in, out) = {max(n, k)} features: 2^31 elements or "
                     f"more, past the kernels' 32-bit row indexing; call with fewer than "
                     f"{(1 << 31) // max(n, k)} rows")
  block_m, mainloop_id, split = choose_linear_launch(m, n, k, block_m=block_m, mainloop=mainloop,
                                                     split=split)
  from jax_moeq import _ffi
  _ffi.cuda_library()
  permuted_rows = m if weights.act_order or _gpu_launch.uses_wgmma(block_m, mainloop_id) else 0
  ws_floats = _gpu_launch.gemm2_workspace_floats(m, n) if split > 1 else 0
  results = [
      jax.ShapeDtypeStruct((m, n), x.dtype),
      jax.ShapeDtypeStruct((max(1, permuted_rows * k),), x.dtype),
      jax.ShapeDtypeStruct((max(1, ws_floats),), jnp.float32),
  ]
  operands = [x, weights.weights, weights.scales, weights.zeros, weights.bias, weights.perm]
  attrs = dict(in_features=np.int64(k), out_features=np.int64(n),
               groups=np.int64(k // weights.group_size), block_m=np.int64(block_m),
               split=np.int64(split), mainloop=np.int64(mainloop_id),
               has_zeros=weights.has_zeros, has_bias=weights.has_bias,
               act_order=weights.act_order)
  if out_init is None:
    call = jax.ffi.ffi_call(FFI_TARGET, results)
  else:
    operands.append(out_init)
    call = jax.ffi.ffi_call(FFI_TARGET_INTO, results,
                            input_output_aliases={len(operands) - 1: 0})
  return call(*operands, **attrs)[0]


def wna16_linear(x: Array, weights: Wna16LinearWeights, *, block_m: int | None = None,
                 mainloop: str | None = None, split: int | None = None,
                 out_init: Array | None = None) -> Array:
  """y = round(x @ dequant(W).T + bias) on the GPU (SPEC §12 WNA16); usable under jit and vmap.

  Args:
    x: [..., K] bfloat16 or float16 (any leading dims; rows are independent).
    weights: `Wna16LinearWeights` from `pack_wna16_linear`.
    block_m, mainloop, split: launch overrides for benchmarks and tests (see
      `choose_linear_launch`); None chooses from the rows.
    out_init: optional [..., N] buffer of x's dtype aliased to the output (tests poison it).
  Returns:
    [..., N] in x's dtype. Under vmap with shared weights the batch folds into the rows (one
    call); weights mapped too run one call per element.
  """
  weights = _check_x(x, weights)
  n = weights.out_features
  lead = x.shape[:-1]
  rows = math.prod(lead)
  x2 = x.reshape(rows, weights.in_features)
  token_args = (x2,)
  if out_init is not None:
    if out_init.shape != lead + (n,) or out_init.dtype != x.dtype:
      raise ValueError(f"out_init must be {lead + (n,)} {x.dtype}, got {out_init.shape} "
                       f"{out_init.dtype}")
    token_args += (out_init.reshape(rows, n),)
  has_out = out_init is not None

  def call(x2, *rest):
    out_buffer, shared = (rest[0], rest[1]) if has_out else (None, rest[0])
    return _call(x2, shared, out_buffer, block_m=block_m, mainloop=mainloop, split=split)

  y = fold_token_batches(call, len(token_args))(*token_args, weights)
  return y.reshape(lead + (n,))


def wna16_linear_gpu_available() -> bool:
  """A CUDA device with compute capability >= 9.0 and our CUDA library."""
  return wna16_gpu.wna16_gpu_available()
