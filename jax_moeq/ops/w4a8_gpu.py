"""GPU W4A8 (int4 weights, dynamic per-token int8 activations) fused MoE: packer and FFI op.

Semantics: SPEC §3-4, the same function as the CPU op (`ops.w4a8_cpu.dynamic_4bit_int_moe`) and
`reference.fused_moe_w4a8`. The kernel (csrc/cuda/w4a8_moe.cu, `jax_moeq_w4a8_moe_cuda`, Hopper
sm_90a only) runs: alignment of the (token, slot) pairs to experts in blocks of block_m (32, 64
or 128 tokens, `_gpu_launch.choose_w4a8_block_m`) -> int8
quantization of x per token (per pair, x·w rounded, with apply_router_weight_on_input) ->
GEMM1 on int8 tensor cores (wgmma s8·s8 -> s32, group sums promoted to f32 in group order),
y = scale_t · (Σ_g sw·dot_g − zp_t · row_corr) + bias, rounded -> activation, rounded -> int8
quantization per pair -> GEMM2 -> rounded, times the top-k weight and rounded, summed over slots
in order (each sum rounded).

Packed layout (per GEMM of N outputs and K inputs; see csrc/cuda/w4a8_moe.h):
  weights  uint32 [E, N/16, K/128, 32, 8]: lane (g, t), word 2s + j, byte b: low nibble row g,
           high nibble row g + 8 of the 16-row tile, input 32s + 16j + 4t + b of the 128-deep
           chunk, as two's-complement nibbles (the kernel widens them to int8 16·q in registers)
  scales   float32 [E, N/16, G, 16]: entry 2i + h = sw[16·nt + i + 8h, group] / 16
  row_corr float32 [E, N]: Σ_g sw[n, g] · Σ_{k∈g} q[n, k] (as the CPU layout computes it)
  bias     float32 [E, N], or a [1] placeholder
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq.ops import _gpu_launch, w4a8_cpu

Array = jax.Array

FFI_TARGET = "jax_moeq_w4a8_moe_cuda"
FFI_TARGET_INTO = "jax_moeq_w4a8_moe_cuda_into"
FFI_TARGET_QUANTIZE = "jax_moeq_w4a8_quantize_rows_cuda"
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ACTIVATION_KINDS = (0, 1, 2)
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
ALIGNMENT = 128  # H and I: the kernel's 128-deep chunks (and 64-row GEMM1 tiles)
MAX_FEATURES = 65536  # H and I: int32 sums of the int8 products
MAX_EXPERTS = 4096  # the alignment kernel
COMPUTE_CAPABILITY = (9, 0)  # built for sm_90a only


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class W4a8GpuWeights:
  """Expert weights in the GPU kernel's layout (a pytree; sizes and flags are static)."""
  w13: Array
  w13_scales: Array
  w13_row_corr: Array
  w13_bias: Array
  w2: Array
  w2_scales: Array
  w2_row_corr: Array
  w2_bias: Array
  hidden_size: int = dataclasses.field(metadata=dict(static=True))
  intermediate_size: int = dataclasses.field(metadata=dict(static=True))
  group_size: int = dataclasses.field(metadata=dict(static=True))
  has_bias: bool = dataclasses.field(metadata=dict(static=True))

  @property
  def num_experts(self) -> int:
    return self.w13.shape[0]


ARRAY_NAMES = ("w13", "w13_scales", "w13_row_corr", "w13_bias", "w2", "w2_scales",
               "w2_row_corr", "w2_bias")


# ------------------------------------------------------------------ layout (jittable)
def pack_w4a8_gpu_weights(q: Array) -> Array:
  """int4-as-int8 [E, N, K] -> uint32 [E, N/16, K/128, 32, 8] (layout in the module doc)."""
  e, n, k = q.shape
  if n % 16 or k % 128:
    raise ValueError(f"the GPU W4A8 layout needs N % 16 == 0 and K % 128 == 0, got N={n}, K={k}")
  nib = (jnp.asarray(q).astype(jnp.int32) & 0xF).astype(jnp.uint32)
  nib = nib.reshape(e, n // 16, 2, 8, k // 128, 4, 2, 4, 4)
  #      dims:       0  1      2  3  4        5  6  7  8
  #                  e  nt     h  g  kc       s  j  t  b
  nib = nib.transpose(0, 1, 4, 3, 7, 5, 6, 8, 2)  # e nt kc g t s j b h
  nib = nib.reshape(e, n // 16, k // 128, 32, 8, 8)
  shifts = jnp.arange(8, dtype=jnp.uint32) * 4  # nibble 2b + h at bits 8b + 4h
  return jnp.sum(nib << shifts, axis=-1, dtype=jnp.uint32)  # disjoint nibbles: sum == or


def unpack_w4a8_gpu_weights(words: Array) -> Array:
  """Inverse of `pack_w4a8_gpu_weights`: uint32 [E, N/16, K/128, 32, 8] -> int8 [E, N, K]."""
  e, nt, kc = words.shape[:3]
  shifts = jnp.arange(8, dtype=jnp.uint32) * 4
  nib = ((jnp.asarray(words)[..., None] >> shifts) & 0xF).astype(jnp.int32)
  nib = jnp.where(nib >= 8, nib - 16, nib)  # two's complement
  nib = nib.reshape(e, nt, kc, 8, 4, 4, 2, 4, 2)  # e nt kc g t s j b h
  nib = nib.transpose(0, 1, 8, 3, 2, 5, 6, 4, 7)  # e nt h g kc s j t b
  return nib.reshape(e, nt * 16, kc * 128).astype(jnp.int8)


def pack_w4a8_gpu_scales(scale: Array) -> Array:
  """Scales [E, N, G] -> float32 [E, N/16, G, 16], each divided by 16 (exact)."""
  e, n, g = scale.shape
  s = jnp.asarray(scale).astype(jnp.float32) / 16.0
  return s.reshape(e, n // 16, 2, 8, g).transpose(0, 1, 4, 3, 2).reshape(e, n // 16, g, 16)


def unpack_w4a8_gpu_scales(packed: Array) -> Array:
  """Inverse of `pack_w4a8_gpu_scales`: -> float32 [E, N, G]."""
  e, nt, g, _ = packed.shape
  s = jnp.asarray(packed).reshape(e, nt, g, 8, 2).transpose(0, 1, 4, 3, 2)
  return s.reshape(e, nt * 16, g) * 16.0


def row_correction(q: Array, scale: Array, group: int) -> Array:
  """row_corr [E, N] = Σ_g sw[n, g] · Σ_{k∈g} q[n, k], in float32 as the CPU packer computes it."""
  e, n, k = q.shape
  groups = k // group
  sums = q.astype(jnp.int32).reshape(e, n, groups, group).sum(-1)
  return (scale.astype(jnp.float32).reshape(e, n, groups) * sums.astype(jnp.float32)).sum(-1)


def _pack_gemm(name: str, q: Array, scale: Array, bias, group_size: int):
  w4a8_cpu._check_weight(name, q, scale, bias, group_size)  # pylint: disable=protected-access
  e, n, k = q.shape
  if k % ALIGNMENT or n % 64:
    raise ValueError(f"{name} shape {q.shape}: the GPU kernel needs in % {ALIGNMENT} == 0 and "
                     "out % 64 == 0")
  if k > MAX_FEATURES:
    raise ValueError(f"{name} shape {q.shape}: in={k} exceeds the GPU kernel's {MAX_FEATURES}")
  group = k if group_size == -1 else group_size
  return (pack_w4a8_gpu_weights(q), pack_w4a8_gpu_scales(scale), row_correction(q, scale, group),
          None if bias is None else jnp.asarray(bias, jnp.float32))


def convert_to_w4a8_gpu_format(w13_q: Array, w2_q: Array, w13_scale: Array, w2_scale: Array,
                               group_size: int, w13_bias: Array | None = None,
                               w2_bias: Array | None = None) -> W4a8GpuWeights:
  """Canonical W4A8 experts -> `W4a8GpuWeights` (jittable once the int4 range check passed).

  Args:
    w13_q: int8 [E, 2I, H] holding int4 values (gate rows first); w2_q: int8 [E, H, I].
    w13_scale / w2_scale: [E, out, in/g] (bfloat16 group-wise) or [E, out, 1] (float32
      channel-wise), the W4A8 scheme's scales (SPEC §2).
    group_size: 32, 64, 128 or -1.
    w13_bias [E, 2I] / w2_bias [E, H]: optional (one given: the other is zeros).
  """
  w13_q, w2_q = jnp.asarray(w13_q), jnp.asarray(w2_q)
  if (w13_bias is None) != (w2_bias is None):
    e, i2, h = w13_q.shape
    w13_bias = jnp.zeros((e, i2), jnp.float32) if w13_bias is None else w13_bias
    w2_bias = jnp.zeros((e, h), jnp.float32) if w2_bias is None else w2_bias
  w13, s13, rc13, b13 = _pack_gemm("w13", w13_q, jnp.asarray(w13_scale), w13_bias, group_size)
  w2, s2, rc2, b2 = _pack_gemm("w2", w2_q, jnp.asarray(w2_scale), w2_bias, group_size)
  e, i2, h = w13_q.shape
  if i2 % 2 or w2_q.shape != (e, h, i2 // 2):
    raise ValueError(f"w2_q must be [E, H, I] = {(e, h, i2 // 2)} for w13_q {w13_q.shape}, got "
                     f"{w2_q.shape}")
  placeholder = jnp.zeros((1,), jnp.float32)
  return W4a8GpuWeights(
      w13=w13, w13_scales=s13, w13_row_corr=rc13,
      w13_bias=b13 if b13 is not None else placeholder, w2=w2, w2_scales=s2, w2_row_corr=rc2,
      w2_bias=b2 if b2 is not None else placeholder, hidden_size=h, intermediate_size=i2 // 2,
      group_size=group_size, has_bias=b13 is not None)


def canonical_from_w4a8_gpu(weights: W4a8GpuWeights):
  """(w13_q, w13_scale, w2_q, w2_scale) unpacked: int8 weights, float32 scales [E, out, G]."""
  return (unpack_w4a8_gpu_weights(weights.w13), unpack_w4a8_gpu_scales(weights.w13_scales),
          unpack_w4a8_gpu_weights(weights.w2), unpack_w4a8_gpu_scales(weights.w2_scales))


# ------------------------------------------------------------------ availability
def w4a8_gpu_unavailable_reason() -> str | None:
  """Why the kernel cannot run here (no CUDA device, not sm_90, library missing), or None."""
  from jax_moeq import _ffi
  cc = _ffi.cuda_compute_capability()
  if cc is None:
    return "no CUDA GPU is visible to JAX"
  if tuple(cc) != COMPUTE_CAPABILITY:
    return (f"the GPU has compute capability {cc[0]}.{cc[1]}; the W4A8 kernel is built for "
            "sm_90a (Hopper, compute capability 9.0) only")
  if not _ffi.cuda_library_available():
    return "jax_moeq's CUDA library (libjax_moeq_cuda.so) is not built"
  return None


def w4a8_gpu_available() -> bool:
  try:
    return w4a8_gpu_unavailable_reason() is None
  except Exception:  # pylint: disable=broad-except
    return False


# ------------------------------------------------------------------ the op
def _validate(x, weights, topk_weights, topk_ids, activation_kind):
  if not isinstance(weights, W4a8GpuWeights):
    raise TypeError("weights must be W4a8GpuWeights (convert_to_w4a8_gpu_format)")
  if x.ndim != 2:
    raise ValueError(f"x must be 2-D [T, H], got shape {x.shape}")
  if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
    raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
  if x.shape[1] != weights.hidden_size:
    raise ValueError(f"x has hidden size {x.shape[1]}, weights have {weights.hidden_size}")
  if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
    raise ValueError(f"topk_ids must be [T, K] with T = {x.shape[0]}, got {topk_ids.shape}")
  if topk_weights.shape != topk_ids.shape:
    raise ValueError(f"topk_weights shape {topk_weights.shape} != topk_ids shape "
                     f"{topk_ids.shape}")
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise TypeError(f"topk_ids must be integer, got {topk_ids.dtype}")
  if activation_kind not in ACTIVATION_KINDS:
    raise ValueError(f"activation_kind must be one of {ACTIVATION_KINDS}, got {activation_kind}")
  if weights.num_experts > MAX_EXPERTS:
    raise ValueError(f"the kernel supports at most {MAX_EXPERTS} experts")
  h, i = weights.hidden_size, weights.intermediate_size
  rows = topk_ids.shape[0] * topk_ids.shape[1]
  if rows * max(h, 2 * i) >= 2**31:
    raise ValueError(f"problem too large for 32-bit indexing: T * K = {rows} rows x "
                     f"max(H, 2I) = {max(h, 2 * i)} must be below 2^31")


def w4a8_gpu_moe(x: Array, weights: W4a8GpuWeights, topk_weights: Array, topk_ids: Array, *,
                 activation_kind: int = 0, apply_router_weight_on_input: bool = False,
                 block_m: int | None = None, out_init: Array | None = None) -> Array:
  """W4A8 fused MoE on a Hopper GPU (SPEC §4); usable under jit.

  Args:
    x: [T, H] float32 / bfloat16 / float16.
    weights: `W4a8GpuWeights` from `convert_to_w4a8_gpu_format`.
    topk_weights: [T, K] (float32 inside); topk_ids: [T, K] int32 (int64 accepted). Ids outside
      [0, E) contribute nothing (the kernel cannot raise on data).
    activation_kind: 0 silu(g)·u, 1 swigluoai, 2 silu (== 0).
    apply_router_weight_on_input: multiply x[t] by the pair's weight (rounded to x's dtype)
      before GEMM1 instead of weighting GEMM2's output.
    block_m: tokens per expert block of the GEMMs (32, 64 or 128); None chooses it from the
      expected pairs per expert (`_gpu_launch.choose_w4a8_block_m`). Results do not depend on it.
    out_init: optional buffer aliased to the output (tests poison it to prove every element is
      written).
  Returns:
    [T, H] in x's dtype.
  """
  x = jnp.asarray(x)
  _validate(x, weights, topk_weights, topk_ids, activation_kind)
  t, k = topk_ids.shape
  h, i, e = weights.hidden_size, weights.intermediate_size, weights.num_experts
  g = weights.group_size
  rows = t * k
  in_rows = rows if apply_router_weight_on_input else t
  block_m = _gpu_launch.choose_w4a8_block_m(rows / max(e, 1), block_m)
  padded = _gpu_launch.max_padded_rows(rows, e, block_m)
  dt = x.dtype
  r1 = max(rows, 1)
  results = [
      jax.ShapeDtypeStruct((t, h), dt),
      jax.ShapeDtypeStruct((padded,), jnp.int32),
      jax.ShapeDtypeStruct((padded // block_m,), jnp.int32),
      jax.ShapeDtypeStruct((1,), jnp.int32),
      jax.ShapeDtypeStruct((max(in_rows, 1) * h,), jnp.int8),
      jax.ShapeDtypeStruct((max(in_rows, 1) * 2,), jnp.float32),
      jax.ShapeDtypeStruct((r1 * i,), dt),
      jax.ShapeDtypeStruct((r1 * i,), jnp.int8),
      jax.ShapeDtypeStruct((r1 * 2,), jnp.float32),
      jax.ShapeDtypeStruct((r1 * h,), dt),
  ]
  operands = [x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), weights.w13,
              weights.w13_scales, weights.w13_row_corr, weights.w13_bias, weights.w2,
              weights.w2_scales, weights.w2_row_corr, weights.w2_bias]
  kwargs = dict(hidden_size=np.int64(h), intermediate_size=np.int64(i),
                groups13=np.int64(1 if g == -1 else h // g),
                groups2=np.int64(1 if g == -1 else i // g),
                activation_kind=np.int64(activation_kind), has_bias=weights.has_bias,
                apply_router_weight_on_input=bool(apply_router_weight_on_input),
                block_m=np.int64(block_m))
  from jax_moeq import _ffi
  _ffi.cuda_library()
  if out_init is None:
    call = jax.ffi.ffi_call(FFI_TARGET, results, vmap_method="sequential")
  else:
    if out_init.shape != (t, h) or out_init.dtype != dt:
      raise ValueError(f"out_init must be {(t, h)} {dt}, got {out_init.shape} {out_init.dtype}")
    operands.append(out_init)
    call = jax.ffi.ffi_call(FFI_TARGET_INTO, results, vmap_method="sequential",
                            input_output_aliases={len(operands) - 1: 0})
  return call(*operands, **kwargs)[0]


def quantize_rows_gpu(x: Array) -> tuple[Array, Array, Array]:
  """The op's int8 activation quantizer alone (SPEC §3) on [R, C] rows: (qa int8 [R, C],
  scale float32 [R], zp int32 [R]), as `reference.quantize_activations_int8`."""
  x = jnp.asarray(x)
  if x.ndim != 2 or x.shape[1] == 0:
    raise ValueError(f"x must be [rows, cols] with cols > 0, got {x.shape}")
  if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
    raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
  from jax_moeq import _ffi
  _ffi.cuda_library()
  q, params = jax.ffi.ffi_call(FFI_TARGET_QUANTIZE, [
      jax.ShapeDtypeStruct(x.shape, jnp.int8),
      jax.ShapeDtypeStruct((x.shape[0], 2), jnp.float32)])(x)
  return q, params[:, 0], params[:, 1].astype(jnp.int32)
