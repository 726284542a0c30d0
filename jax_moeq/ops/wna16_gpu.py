"""GPU WNA16 (int4 weights, bf16/fp16 activations) fused MoE: weight packer and FFI op.

Semantics: SPEC §2, §7. The kernel (csrc/cuda, `jax_moeq_wna16_moe_cuda`) computes, per
(token, slot) pair routed to expert e (standard format) or per row of expert e (batched):
  y13 = round(x @ dequant(w13[e]).T + b13), act = round(activation(y13)),
  acc2 = act @ dequant(w2[e]).T + b2 (f32),
  standard: out[t] = round(sum_k round(acc2 · topk_weights[t, k]))  (f32 sum)
  batched:  out[e, m] = round(acc2) for m < expert_num_tokens[e], else 0,
with dequant(w) = round(q · s) in x's dtype (q = nibble − zero point) and f32 accumulation.

Packed layout (per GEMM of N outputs and K inputs; see csrc/cuda/int4_mma_core.cuh):
  weights  uint32 [E, N/16, K/64, 32, 4]: the mma A-fragments of each lane, one 16-byte load
  scales   [E, G, N/16, 16] in x's dtype: for lane group g the pair (s[row g], s[row g+8])
  zeros    same layout as scales (AWQ zero points as values), or a [1] placeholder
  bias     float32 [E, N], or a [1] placeholder
Act-order (GPTQ desc_act): input channels are sorted by group once here; `w13_perm [E, H]`
gathers each row's inputs in that order on the GPU, and `w2_inv_perm [E, I]` scatters the
activation into w2's sorted order in GEMM1's epilogue.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq.ops import _gpu_launch
from jax_moeq.ops._token_batching import fold_token_batches
from jax_moeq.quant import int4

Array = jax.Array

FFI_TARGET = "jax_moeq_wna16_moe_cuda"
FFI_TARGET_INTO = "jax_moeq_wna16_moe_cuda_into"
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
ACTIVATION_KINDS = (0, 1, 2)


class Wna16Format(enum.Enum):
  """Kernel input formats (mirrors `WNA16MoeBackend` MARLIN / BATCHED_MARLIN)."""
  STANDARD = "standard"
  BATCHED = "batched"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Wna16MoeWeights:
  """Expert weights in the kernel's layout (a pytree; sizes and flags are static)."""
  w13: Array
  w13_scales: Array
  w13_zeros: Array
  w13_bias: Array
  w2: Array
  w2_scales: Array
  w2_zeros: Array
  w2_bias: Array
  w13_perm: Array
  w2_inv_perm: Array
  hidden_size: int = dataclasses.field(metadata=dict(static=True))
  intermediate_size: int = dataclasses.field(metadata=dict(static=True))
  group_size13: int = dataclasses.field(metadata=dict(static=True))
  group_size2: int = dataclasses.field(metadata=dict(static=True))
  has_zeros: bool = dataclasses.field(metadata=dict(static=True))
  has_bias: bool = dataclasses.field(metadata=dict(static=True))
  act_order: bool = dataclasses.field(metadata=dict(static=True))

  @property
  def num_experts(self) -> int:
    return self.w13.shape[0]

  @property
  def dtype(self):
    return self.w13_scales.dtype


# ------------------------------------------------------------------ layout (jittable)
def pack_int4_tiles(u: Array) -> Array:
  """Unsigned nibbles [E, N, K] (values 0..15) -> uint32 [E, N/16, K/64, 32, 4].

  Word (nt, kc, lane = 4g + t, s), nibble b*4 + p*2 + h holds row nt*16 + 8h + g and input
  kc*64 + 16t + 4s + 2p + b (the m16n8k16 A-fragment order of int4_mma_core.cuh).
  """
  e, n, k = u.shape
  if n % 16 or k % 64:
    raise ValueError(f"packed GEMM needs N % 16 == 0 and K % 64 == 0, got N={n}, K={k}")
  u = u.astype(jnp.uint32).reshape(e, n // 16, 2, 8, k // 64, 4, 4, 2, 2)
  #            dims:                  0  1      2  3  4       5  6  7  8
  #                                   e  nt     h  g  kc      t  s  p  b
  u = u.transpose(0, 1, 4, 3, 5, 6, 8, 7, 2).reshape(e, n // 16, k // 64, 8, 4, 4, 8)
  shifts = jnp.arange(8, dtype=jnp.uint32) * 4
  words = jnp.sum(u << shifts, axis=-1, dtype=jnp.uint32)  # nibbles are disjoint: sum == or
  return words.reshape(e, n // 16, k // 64, 32, 4)


def unpack_int4_tiles(words: Array) -> Array:
  """Inverse of `pack_int4_tiles`: uint32 [E, N/16, K/64, 32, 4] -> uint8 nibbles [E, N, K]."""
  e, nt, kc = words.shape[:3]
  w = words.reshape(e, nt, kc, 8, 4, 4)
  shifts = jnp.arange(8, dtype=jnp.uint32) * 4
  u = (w[..., None] >> shifts) & 0xF  # [e, nt, kc, g, t, s, (b, p, h)]
  u = u.reshape(e, nt, kc, 8, 4, 4, 2, 2, 2)
  u = u.transpose(0, 1, 8, 3, 2, 4, 5, 7, 6)  # e nt h g kc t s p b
  return u.reshape(e, nt * 16, kc * 64).astype(jnp.uint8)


def pack_row_pairs(s: Array) -> Array:
  """Per-output values [E, G, N] -> [E, G, N/16, 16]: (row g, row g+8) adjacent."""
  e, g, n = s.shape
  return s.reshape(e, g, n // 16, 2, 8).swapaxes(-1, -2).reshape(e, g, n // 16, 16)


def unpack_row_pairs(s: Array) -> Array:
  e, g, nt, _ = s.shape
  return s.reshape(e, g, nt, 8, 2).swapaxes(-1, -2).reshape(e, g, nt * 16)


# ------------------------------------------------------------------ GPTQ ingest
def _check_rank(name: str, a: Array, rank: int):
  if a.ndim != rank:
    raise ValueError(f"{name} must be {rank}-D, got shape {a.shape}")


def _unpack_qzeros(qzeros: Array, n_out: int, name: str) -> Array:
  """GPTQ-order packed zero points int32 [E, G, N/8] -> int32 [E, G, N] in 0..15."""
  _check_rank(name, qzeros, 3)
  if qzeros.shape[-1] * 8 != n_out:
    raise ValueError(f"{name} must be [E, groups, {n_out // 8}] int32, got {qzeros.shape}")
  words = qzeros.astype(jnp.uint32)
  shifts = jnp.arange(8, dtype=jnp.uint32) * 4
  z = (words[..., None] >> shifts) & 0xF
  return z.reshape(*qzeros.shape[:-1], n_out).astype(jnp.int32)


def _process_gemm(qweight: Array, scales: Array, *, name: str, group_size: int, g_idx, qzeros,
                  dtype) -> dict[str, Any]:
  """One GEMM's GPTQ tensors -> packed weights, scales, zeros and the act-order permutation."""
  _check_rank(f"{name}_qweight", qweight, 3)
  _check_rank(f"{name}_scales", scales, 3)
  e, k8, n = qweight.shape
  k = k8 * 8
  if qweight.dtype not in (jnp.int32, jnp.uint32):
    raise TypeError(f"{name}_qweight must be int32 (GPTQ uint4b8), got {qweight.dtype}")
  eff_group = int4.validate_group_size(group_size, k, name="group_size")
  groups = k // eff_group
  if scales.shape != (e, groups, n):
    raise ValueError(f"{name}_scales must be [E, in/group, out] = {(e, groups, n)}, "
                     f"got {scales.shape}")
  if k % 64 or n % 16:
    raise ValueError(f"{name}: the kernel needs in % 64 == 0 and out % 16 == 0, got in={k}, "
                     f"out={n}")
  # Raw nibbles u in 0..15, [E, out, in].
  u = (int4.unpack_uint4b8_gptq(qweight).astype(jnp.int32) + 8)
  perm = None
  if g_idx is not None:
    g_idx = jnp.asarray(g_idx)
    if g_idx.shape != (e, k):
      raise ValueError(f"{name}_g_idx must be [E, in] = {(e, k)}, got {g_idx.shape}")
    # Sorting by group makes groups contiguous (GPTQ act-order: group_size channels each).
    perm = jnp.argsort(g_idx.astype(jnp.int32), axis=-1, stable=True).astype(jnp.int32)
    u = jnp.take_along_axis(u, perm[:, None, :], axis=-1)
  zeros = None
  if qzeros is not None:
    zeros = _unpack_qzeros(jnp.asarray(qzeros), n, f"{name}_qzeros")
    if zeros.shape[:2] != (e, groups):
      raise ValueError(f"{name}_qzeros must be [E, {groups}, {n // 8}], got {qzeros.shape}")
    zeros = pack_row_pairs(zeros.astype(dtype))
  return dict(
      w=pack_int4_tiles(u.astype(jnp.uint8)),
      s=pack_row_pairs(scales.astype(dtype)),
      z=zeros,
      perm=perm,
      group=eff_group,
      n=n,
      k=k,
  )


def _bias(b, shape, name):
  if b is None:
    return None
  b = jnp.asarray(b)
  if b.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {b.shape}")
  return b.astype(jnp.float32)


def _process_weights_marlin(w13_qweight, w2_qweight, w13_scales, w2_scales, *, group_size,
                            w13_g_idx=None, w2_g_idx=None, w13_qzeros=None, w2_qzeros=None,
                            w13_bias=None, w2_bias=None, dtype=None) -> Wna16MoeWeights:
  """GPTQ tensors -> `Wna16MoeWeights` for the MARLIN (standard) kernel."""
  dtype = jnp.dtype(dtype or w13_scales.dtype)
  if dtype not in [jnp.dtype(d) for d in KERNEL_DTYPES]:
    raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
  if (w13_qzeros is None) != (w2_qzeros is None):
    raise ValueError("w13_qzeros and w2_qzeros must be given together")
  if (w13_g_idx is None) != (w2_g_idx is None):
    raise ValueError("w13_g_idx and w2_g_idx must be given together")
  if (w13_bias is None) != (w2_bias is None):
    raise ValueError("w13_bias and w2_bias must be given together")
  g13 = _process_gemm(w13_qweight, w13_scales, name="w13", group_size=group_size,
                      g_idx=w13_g_idx, qzeros=w13_qzeros, dtype=dtype)
  g2 = _process_gemm(w2_qweight, w2_scales, name="w2", group_size=group_size, g_idx=w2_g_idx,
                     qzeros=w2_qzeros, dtype=dtype)
  e = g13["w"].shape[0]
  hidden, two_i = g13["k"], g13["n"]
  inter = two_i // 2
  if g2["w"].shape[0] != e:
    raise ValueError(f"w13 has {e} experts, w2 has {g2['w'].shape[0]}")
  if g2["k"] != inter or g2["n"] != hidden:
    raise ValueError(f"w2_qweight must be [E, I/8, H] = [{e}, {inter // 8}, {hidden}] for w13 "
                     f"[E, H/8, 2I] = [{e}, {hidden // 8}, {two_i}]")
  if inter % 64:
    raise ValueError(f"intermediate size {inter} must be a multiple of 64")
  b13 = _bias(w13_bias, (e, two_i), "w13_bias")
  b2 = _bias(w2_bias, (e, hidden), "w2_bias")
  placeholder = lambda dt: jnp.zeros((1,), dt)
  act_order = g13["perm"] is not None
  return Wna16MoeWeights(
      w13=g13["w"], w13_scales=g13["s"],
      w13_zeros=g13["z"] if g13["z"] is not None else placeholder(dtype),
      w13_bias=b13 if b13 is not None else placeholder(jnp.float32),
      w2=g2["w"], w2_scales=g2["s"],
      w2_zeros=g2["z"] if g2["z"] is not None else placeholder(dtype),
      w2_bias=b2 if b2 is not None else placeholder(jnp.float32),
      w13_perm=g13["perm"] if act_order else placeholder(jnp.int32),
      w2_inv_perm=(jnp.argsort(g2["perm"], axis=-1).astype(jnp.int32) if act_order
                   else placeholder(jnp.int32)),
      hidden_size=hidden, intermediate_size=inter, group_size13=g13["group"],
      group_size2=g2["group"], has_zeros=g13["z"] is not None, has_bias=b13 is not None,
      act_order=act_order)


# The batched kernel reads the same layout.
_process_weights_batched_marlin = _process_weights_marlin


def _process_weights_reference(w13_qweight, w2_qweight, w13_scales, w2_scales, *, group_size,
                               w13_g_idx=None, w2_g_idx=None, w13_qzeros=None, w2_qzeros=None,
                               w13_bias=None, w2_bias=None, dtype=None) -> dict[str, Any]:
  """The jnp reference keeps the GPTQ tensors as they are."""
  return dict(w13_qweight=w13_qweight, w2_qweight=w2_qweight, w13_scales=w13_scales,
              w2_scales=w2_scales, group_size=group_size, w13_g_idx=w13_g_idx,
              w2_g_idx=w2_g_idx, w13_qzeros=w13_qzeros, w2_qzeros=w2_qzeros, w13_bias=w13_bias,
              w2_bias=w2_bias)


_PROCESSORS = {
    "MARLIN": _process_weights_marlin,
    "BATCHED_MARLIN": _process_weights_batched_marlin,
    "REFERENCE": _process_weights_reference,
}


def convert_to_wna16_moe_kernel_format(backend, w13_qweight, w2_qweight, w13_scales, w2_scales,
                                       *, group_size, w13_g_idx=None, w2_g_idx=None,
                                       w13_qzeros=None, w2_qzeros=None, w13_bias=None,
                                       w2_bias=None, dtype=None):
  """GPTQ MoE tensors -> the chosen backend's format (jittable).

  Args:
    backend: a `WNA16MoeBackend` (or its name): MARLIN, BATCHED_MARLIN or REFERENCE.
    w13_qweight: int32 uint4b8 [E, H/8, 2I] (gate rows then up rows); w2_qweight [E, I/8, H].
    w13_scales / w2_scales: [E, in/group, out] float16/bfloat16.
    group_size: 32, 64, 128 or -1 (channel-wise).
    w13_g_idx / w2_g_idx: act-order group of each input channel, [E, in].
    w13_qzeros / w2_qzeros: AWQ-style zero points, int32 [E, in/group, out/8], nibble j of word c
      is output 8c + j, value z in 0..15 (w = (nibble - z) · s); None: symmetric (z = 8).
    w13_bias [E, 2I] / w2_bias [E, H]: optional.
    dtype: activation dtype the kernel will run in (scales are stored in it); default the
      scales' dtype. Packing in the model's dtype avoids a cast on every call.
  """
  name = getattr(backend, "name", backend)
  if name not in _PROCESSORS:
    raise ValueError(f"backend must be one of {sorted(_PROCESSORS)}, got {backend!r}")
  return _PROCESSORS[name](w13_qweight, w2_qweight, w13_scales, w2_scales, group_size=group_size,
                           w13_g_idx=w13_g_idx, w2_g_idx=w2_g_idx, w13_qzeros=w13_qzeros,
                           w2_qzeros=w2_qzeros, w13_bias=w13_bias, w2_bias=w2_bias, dtype=dtype)


def pack_wna16_from_int4(w13: Array, w2: Array, w13_scale: Array, w2_scale: Array,
                         group_size: int, *, w13_perm=None, w13_bias=None, w2_bias=None,
                         dtype=jnp.bfloat16) -> Wna16MoeWeights:
  """Canonical int4-as-int8 experts (w13 [E, 2I, H], scales [E, out, in/g]) -> kernel format.

  `w13_perm [E, H]` (act-order already folded: expert e computes with x[:, w13_perm[e]]).
  """
  qw13 = int4.pack_uint4b8_gptq(w13)
  qw2 = int4.pack_uint4b8_gptq(w2)
  s13 = jnp.swapaxes(jnp.asarray(w13_scale), -1, -2)
  s2 = jnp.swapaxes(jnp.asarray(w2_scale), -1, -2)
  weights = _process_weights_marlin(qw13, qw2, s13, s2, group_size=group_size, w13_bias=w13_bias,
                                    w2_bias=w2_bias, dtype=dtype)
  if w13_perm is None:
    return weights
  e, i = w2.shape[0], w2.shape[2]
  ident = jnp.broadcast_to(jnp.arange(i, dtype=jnp.int32), (e, i))
  return dataclasses.replace(weights, w13_perm=jnp.asarray(w13_perm, jnp.int32),
                             w2_inv_perm=ident, act_order=True)


# ------------------------------------------------------------------ the op
def _max_padded(rows: int, experts: int, block_m: int, batched: bool, max_tokens: int) -> int:
  if batched:
    return max(block_m, experts * (-(-max_tokens // block_m)) * block_m)
  return _gpu_launch.max_padded_rows(rows, experts, block_m)


def _check_x_dtype(x: Array, weights: Wna16MoeWeights) -> Wna16MoeWeights:
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in KERNEL_DTYPES]:
    raise TypeError(f"x must be bfloat16 or float16, got {x.dtype}")
  if weights.dtype != x.dtype:  # one cast per call; pack with dtype=x.dtype to avoid it
    weights = dataclasses.replace(
        weights, w13_scales=weights.w13_scales.astype(x.dtype),
        w2_scales=weights.w2_scales.astype(x.dtype),
        w13_zeros=weights.w13_zeros.astype(x.dtype), w2_zeros=weights.w2_zeros.astype(x.dtype))
  return weights


def _call(x, route_ids, route_weights, weights: Wna16MoeWeights, *, batched: bool,
          activation_kind: int, block_m: int | None, out_init: Array | None,
          mainloop: str | None = None, fused_decode: bool | None = None):
  if activation_kind not in ACTIVATION_KINDS:
    raise ValueError(f"activation_kind must be one of {ACTIVATION_KINDS}, got {activation_kind}")
  h, i, e = weights.hidden_size, weights.intermediate_size, weights.num_experts
  if batched:
    rows, max_tokens = e * x.shape[1], x.shape[1]
  else:
    rows, max_tokens = route_ids.shape[0] * route_ids.shape[1], 0
  _gpu_launch.check_problem_size(rows, h, i, "E * M (x's experts x max tokens)" if batched
                                 else "T * K (topk_ids' tokens x top_k)")
  pairs_per_expert = max_tokens if batched else rows / max(1, min(e, rows))
  block_m, mainloop_id = _gpu_launch.choose_launch("wna16", pairs_per_expert, block_m, mainloop)
  wgmma = _gpu_launch.uses_wgmma(block_m, mainloop_id)
  from jax_moeq import _ffi
  _ffi.cuda_library()
  padded = _max_padded(rows, e, block_m, batched, max_tokens)
  blocks = padded // block_m
  busy_blocks = (blocks if batched else
                 min(blocks, _gpu_launch.expected_busy_blocks(rows, e, block_m)))
  split13, split2 = _gpu_launch.choose_gemm_splits(busy_blocks, h, i, block_m, rows, mainloop_id)
  # act-order gathers each row's inputs in its expert's order (rows x H); the wgmma GEMM alone
  # permutes each token's inputs once (T x H; rows x H when batched).
  if weights.act_order or (batched and wgmma):
    x_perm_len = rows * h
  elif wgmma:
    x_perm_len = x.shape[0] * h
  else:
    x_perm_len = 1
  # The one-token decode path: decided here, checked again by the FFI handler.
  one_token = _gpu_launch.decodes_without_alignment(x.shape[0], block_m, batched=batched,
                                                    act_order=weights.act_order)
  top_k = 0 if batched else route_ids.shape[1]
  fused = _gpu_launch.choose_fused_decode(
      fused_decode, one_token=one_token, top_k=top_k, hidden=h, intermediate=i)
  mainloop_id = _gpu_launch.choose_one_token_mainloop(
      mainloop_id, mainloop, one_token=one_token, fused=fused, top_k=top_k, hidden=h,
      intermediate=i)
  dt = x.dtype
  out_shape = x.shape
  results = [
      jax.ShapeDtypeStruct(out_shape, dt),
      jax.ShapeDtypeStruct((padded,), jnp.int32),
      jax.ShapeDtypeStruct((blocks,), jnp.int32),
      jax.ShapeDtypeStruct((1,), jnp.int32),
      jax.ShapeDtypeStruct((x_perm_len,), dt),
      jax.ShapeDtypeStruct((max(rows, 1) * i,), dt),
      jax.ShapeDtypeStruct((_gpu_launch.gemm1_workspace_floats(rows, i, split13, one_token),),
                           jnp.float32),
      jax.ShapeDtypeStruct((_gpu_launch.gemm2_workspace_floats(max(rows, 1), h),), jnp.float32),
  ]
  operands = [x, route_ids, route_weights, weights.w13, weights.w13_scales, weights.w13_zeros,
              weights.w13_bias, weights.w2, weights.w2_scales, weights.w2_zeros, weights.w2_bias,
              weights.w13_perm, weights.w2_inv_perm]
  kwargs = dict(
      batched=batched, hidden_size=np.int64(h), intermediate_size=np.int64(i),
      groups13=np.int64(h // weights.group_size13), groups2=np.int64(i // weights.group_size2),
      block_m=np.int64(block_m), split13=np.int64(split13), split2=np.int64(split2),
      activation_kind=np.int64(activation_kind), has_zeros=weights.has_zeros,
      has_bias=weights.has_bias, act_order=weights.act_order, mainloop=np.int64(mainloop_id),
      one_token=one_token, fused_decode=fused)
  # The standard format's vmap rule folds tokens (fused_marlin_moe); the batched format's calls
  # run one per batch element.
  vmap_method = "sequential" if batched else None
  if out_init is None:
    call = jax.ffi.ffi_call(FFI_TARGET, results, vmap_method=vmap_method)
  else:
    if out_init.shape != out_shape or out_init.dtype != dt:
      raise ValueError(f"out_init must be {out_shape} {dt}, got {out_init.shape} {out_init.dtype}")
    operands.append(out_init)
    call = jax.ffi.ffi_call(FFI_TARGET_INTO, results, vmap_method=vmap_method,
                            input_output_aliases={len(operands) - 1: 0})
  return call(*operands, **kwargs)[0]


def _validate_common(x, weights: Wna16MoeWeights, x_rank: int):
  if not isinstance(weights, Wna16MoeWeights):
    raise TypeError("weights must be Wna16MoeWeights (convert_to_wna16_moe_kernel_format)")
  if x.ndim != x_rank:
    raise ValueError(f"x must be {x_rank}-D, got shape {x.shape}")
  if x.shape[-1] != weights.hidden_size:
    raise ValueError(f"x has hidden size {x.shape[-1]}, weights have {weights.hidden_size}")


def fused_marlin_moe(x: Array, weights: Wna16MoeWeights, topk_weights: Array, topk_ids: Array,
                     *, activation_kind: int = 0, block_m: int | None = None,
                     out_init: Array | None = None, mainloop: str | None = None,
                     fused_decode: bool | None = None) -> Array:
  """WNA16 fused MoE on the GPU (MARLIN backend, standard format); usable under jit.

  Args:
    x: [T, H] bfloat16/float16.
    weights: `Wna16MoeWeights` from `convert_to_wna16_moe_kernel_format`.
    topk_weights: [T, K] float32; topk_ids: [T, K] int32 (int64 accepted). Ids outside [0, E)
      contribute nothing (the kernel cannot raise on data).
    activation_kind: 0 silu(g)·u, 1 swigluoai, 2 silu (== 0).
    block_m: tokens per expert block (8/16/32/64, or 128: the wgmma GEMM); default from the
      routing density (_gpu_launch.choose_block_m: 8, or the wgmma GEMM's 32-, 64- or 128-token
      tile).
    out_init: optional buffer aliased to the output (tests poison it with NaN).
    mainloop: GEMM main loop, "registers", "async_ring", "bulk_copy" or "wgmma" (block_m 32,
      64 or 128; see `_gpu_launch.MAINLOOPS`), or "stream": a one-token call as two streaming
      kernels (deterministic; ValueError off the one-token path). None: the measured-fastest
      ("stream" for one token where it fits, `_gpu_launch.choose_one_token_mainloop`; else
      `_gpu_launch.default_mainloop`: "wgmma" where block_m 32 or 64 was chosen for the pairs
      per expert, else "registers").
    fused_decode: True runs a one-token call as the single fused decode kernel (its pairs'
      weights must fit the SMs' shared memory, else ValueError); None / False: the one-token
      path's separate kernels (measured faster so far, `_gpu_launch.choose_fused_decode`).
  Returns:
    [T, H] in x's dtype. Under vmap, token sets sharing the weights are one call on their
    concatenated tokens (launch choices follow the folded T); per-batch weights run in sequence.
  """
  _validate_common(x, weights, 2)
  if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
    raise ValueError(f"topk_ids must be [T, K] with T = {x.shape[0]}, got {topk_ids.shape}")
  if topk_weights.shape != topk_ids.shape:
    raise ValueError(f"topk_weights shape {topk_weights.shape} != topk_ids shape "
                     f"{topk_ids.shape}")
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise TypeError(f"topk_ids must be integer, got {topk_ids.dtype}")
  weights = _check_x_dtype(x, weights)
  token_args = (x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32))
  has_out = out_init is not None
  if has_out:
    token_args += (out_init,)

  def call(x, ids, w, *rest):
    out_buffer, shared = (rest[0], rest[1]) if has_out else (None, rest[0])
    return _call(x, ids, w, shared, batched=False, activation_kind=activation_kind,
                 block_m=block_m, out_init=out_buffer, mainloop=mainloop,
                 fused_decode=fused_decode)

  return fold_token_batches(call, len(token_args))(*token_args, weights)


def batched_fused_marlin_moe(x: Array, expert_num_tokens: Array, weights: Wna16MoeWeights, *,
                             activation_kind: int = 0, block_m: int | None = None,
                             out_init: Array | None = None, mainloop: str | None = None) -> Array:
  """WNA16 MoE on the batched format (BATCHED_MARLIN): x [E, M, H], counts [E] -> [E, M, H].

  Row m of expert e is computed when m < expert_num_tokens[e]; other rows are zero. No top-k
  weights are applied (the finalize step of the batched format does that).
  """
  _validate_common(x, weights, 3)
  if x.shape[0] != weights.num_experts:
    raise ValueError(f"x has {x.shape[0]} experts, weights have {weights.num_experts}")
  if expert_num_tokens.shape != (weights.num_experts,):
    raise ValueError(f"expert_num_tokens must be [{weights.num_experts}], got "
                     f"{expert_num_tokens.shape}")
  weights = _check_x_dtype(x, weights)
  return _call(x, expert_num_tokens.astype(jnp.int32), jnp.zeros((1,), jnp.float32), weights,
               batched=True, activation_kind=activation_kind, block_m=block_m,
               out_init=out_init, mainloop=mainloop)


def wna16_gpu_available() -> bool:
  """A CUDA device with compute capability >= 9.0 and our CUDA library."""
  from jax_moeq import _ffi
  cc = _ffi.cuda_compute_capability()
  return cc is not None and cc >= (9, 0) and _ffi.cuda_library_available()
