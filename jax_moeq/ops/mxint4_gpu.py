"""GPU MxInt4 fused MoE on Hopper (SPEC §2, §5, §8): weight preparation and the FFI op.

MxInt4: signed int4 weights with one bfloat16 scale per 32 input elements, bf16 activations,
router logits in and routing inside the call. The op (`mxint4_moe`, CUDA target
`jax_moeq_mxint4_moe_cuda`) runs, on XLA's stream and without a host sync:

  1. routing of `router_logits` [T, E] (a warp per token; `RoutingMethodType` semantics of
     `jax_moeq.routing.route`) -> topk_ids / topk_weights; ids outside this rank's experts
     [ep_rank·L, (ep_rank+1)·L) are dropped (expert parallelism: the ranks' outputs add up);
  2. alignment of the rank's (token, slot) pairs to per-expert blocks;
  3. GEMM1 with the SwiGLU activation in its epilogue, GEMM2 (the shared int4 tensor-core core
     of csrc/cuda/moe_int4_gemm.cuh, signed nibbles);
  4. out[t] = round(sum_k round(y2 · w[t, k])) over the rank's pairs (f32 sum).
The arithmetic is `reference.fused_moe_mxint4`'s: dequantized weights round(q·s) in bf16,
f32 accumulation, y13 / activation / weighted y2 rounded to bf16.

Weight preparation keeps the steps of the FlashInfer/TRT-LLM seed
(`prepare_static_weights_for_trtllm_mxint4_moe`) that still mean something on Hopper, as named
functions:
  - `convert_packed_uint4b8_to_signed_int4`: checkpoint uint4b8 int32 -> signed nibble bytes
    (XOR 0x88888888), as the seed;
  - `order_w13_rows`: the seed reorders w13 to (up, gate) for its Blackwell epilogue; our kernel
    pairs gate row n with up row I + n inside one warp, so it wants (gate, up), the checkpoint
    order, and this step only converts an (up, gate) input back;
  - `shuffle_weights_for_mma_tiles`: the seed's per-expert row shuffle (epilogue tile 128) and
    block layout (128 along K) become our tile layout: per 16 output rows and 64 inputs, each
    lane's mma.sync A fragments in one 16-byte load (int4_mma_core.cuh);
  - `interleave_block_scales`: the seed's `block_scale_interleave` becomes our scale layout
    [E, K/32, N/16, 16]: for lane group g the pair (s[row g], s[row g + 8]) in one 32-bit load.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq import routing as routing_lib
from jax_moeq.ops import _gpu_launch, wna16_gpu
from jax_moeq.ops._token_batching import fold_token_batches
from jax_moeq.routing import RoutingMethodType

Array = jax.Array

FFI_TARGET = "jax_moeq_mxint4_moe_cuda"
FFI_TARGET_INTO = "jax_moeq_mxint4_moe_cuda_into"
FFI_TARGET_ROUTING = "jax_moeq_mxint4_routing_cuda"
GROUP_SIZE = 32
# Methods the GPU routing kernel implements (everything but Unspecified).
SUPPORTED_ROUTING_METHODS = tuple(m for m in RoutingMethodType
                                  if m != RoutingMethodType.Unspecified)
MAX_EXPERTS = 1024  # the routing kernel keeps 32 experts per lane
MAX_TOP_K = 32
MAX_EXPERT_GROUPS = 32

WEIGHT_KEYS = ("gemm1_weights", "gemm1_scales", "gemm2_weights", "gemm2_scales")


# ------------------------------------------------------------------ preparation steps
def convert_packed_uint4b8_to_signed_int4(words: Array) -> Array:
  """uint4b8 int32 [..., n/8] -> signed-nibble bytes uint8 [..., n/2] (XOR 0x88888888).

  Byte b of the result holds elements 2b (low nibble) and 2b + 1 (high nibble), each the
  two's-complement nibble of q: exactly the little-endian bytes of the converted words.
  """
  words = jnp.asarray(words)
  if words.dtype not in (jnp.int32, jnp.uint32):
    raise TypeError(f"uint4b8 weights must be int32, got {words.dtype}")
  u = words if words.dtype == jnp.uint32 else jax.lax.bitcast_convert_type(words, jnp.uint32)
  u = u ^ jnp.uint32(0x88888888)
  shifts = jnp.arange(4, dtype=jnp.uint32) * 8
  # Explicit little-endian byte order (not the platform's bitcast order).
  bytes_ = ((u[..., None] >> shifts) & 0xFF).astype(jnp.uint8)
  return bytes_.reshape(*u.shape[:-1], u.shape[-1] * 4)


def signed_nibbles_to_int8(packed: Array) -> Array:
  """Signed-nibble bytes uint8 [..., n/2] -> int4-as-int8 [..., n] (even index in the low nibble)."""
  packed = jnp.asarray(packed)
  if packed.dtype != jnp.uint8:
    raise TypeError(f"signed packed int4 weights must be uint8, got {packed.dtype}")
  lo = (packed & 0xF).astype(jnp.int8)
  hi = (packed >> 4).astype(jnp.int8)
  both = jnp.stack([lo, hi], axis=-1)
  both = jnp.where(both > 7, both - 16, both).astype(jnp.int8)
  return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def int8_to_signed_nibbles(q: Array) -> Array:
  """int4-as-int8 [..., n] -> signed-nibble bytes uint8 [..., n/2] (the seed's uint8 format)."""
  q = jnp.asarray(q)
  if q.dtype != jnp.int8:
    raise TypeError(f"int4 values must be int8, got {q.dtype}")
  if q.shape[-1] % 2:
    raise ValueError(f"last axis of shape {q.shape} must be even to pack nibbles")
  u = q.astype(jnp.uint8) & 0xF
  return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(jnp.uint8)


def order_w13_rows(w13: Array, w13_scales: Array, *, input_order: str = "gate_up"
                   ) -> tuple[Array, Array]:
  """Rows of w13 (and its scales) in our kernel's order: gate rows [0, I), then up rows.

  The seed reorders to (up, gate) for the Blackwell kernel; ours applies SwiGLU on pairs
  (gate n, up I + n) in one warp, so checkpoint order is kept. `input_order="up_gate"` swaps an
  (up, gate) input back.
  """
  if input_order == "gate_up":
    return w13, w13_scales
  if input_order != "up_gate":
    raise ValueError(f"input_order must be 'gate_up' or 'up_gate', got {input_order!r}")
  half = w13.shape[-2] // 2
  swap = lambda a: jnp.concatenate([a[..., half:, :], a[..., :half, :]], axis=-2)
  return swap(w13), swap(w13_scales)


def shuffle_weights_for_mma_tiles(q: Array) -> Array:
  """int4-as-int8 [E, N, K] -> uint32 [E, N/16, K/64, 32, 4] (two's-complement nibbles)."""
  return wna16_gpu.pack_int4_tiles((q.astype(jnp.uint8) & 0xF))


def unshuffle_weights_from_mma_tiles(words: Array) -> Array:
  """Inverse of `shuffle_weights_for_mma_tiles`: -> int8 [E, N, K]."""
  u = wna16_gpu.unpack_int4_tiles(words).astype(jnp.int8)
  return jnp.where(u > 7, u - 16, u).astype(jnp.int8)


def interleave_block_scales(scales: Array) -> Array:
  """bf16 block scales [E, N, K/32] -> [E, K/32, N/16, 16] (row pairs g, g + 8 adjacent)."""
  return wna16_gpu.pack_row_pairs(jnp.swapaxes(scales, -1, -2))


def deinterleave_block_scales(packed: Array) -> Array:
  """Inverse of `interleave_block_scales`: -> [E, N, K/32]."""
  return jnp.swapaxes(wna16_gpu.unpack_row_pairs(packed), -1, -2)


# ------------------------------------------------------------------ preparation
def _check_rank3(name: str, a) -> None:
  if jnp.ndim(a) != 3:
    raise ValueError(f"{name} must be 3-D, got shape {jnp.shape(a)}")


def _weights_to_int8(name: str, w: Array, in_features_hint: str) -> Array:
  """uint4b8 int32 [E, N, K/8] or signed-nibble uint8 [E, N, K/2] -> int8 [E, N, K]."""
  _check_rank3(name, w)
  if w.dtype in (jnp.int32, jnp.uint32):
    return signed_nibbles_to_int8(convert_packed_uint4b8_to_signed_int4(w))
  if w.dtype == jnp.uint8:
    return signed_nibbles_to_int8(w)
  raise TypeError(f"{name} must be uint8 (packed signed int4, [E, out, {in_features_hint}/2]) or "
                  f"int32 (uint4b8, [E, out, {in_features_hint}/8]), got {w.dtype}")


def _check_scales(name: str, s: Array, shape: tuple[int, ...]) -> None:
  _check_rank3(name, s)
  if s.dtype != jnp.bfloat16:
    raise TypeError(f"{name} must be bfloat16, got {s.dtype}")
  if s.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {s.shape}")


def prepare_static_weights_for_mxint4_moe(gemm1_weights: Array, gemm1_scales: Array,
                                          gemm2_weights: Array, gemm2_scales: Array,
                                          *, w13_order: str = "gate_up") -> dict[str, Array]:
  """MxInt4 checkpoint tensors -> our kernel's layout (jittable).

  Args:
    gemm1_weights: w13, [E, 2I, H/2] uint8 (signed nibbles, even input in the low nibble) or
      [E, 2I, H/8] int32 (uint4b8, as compressed-tensors checkpoints); gate rows first.
    gemm1_scales: [E, 2I, H/32] bfloat16.
    gemm2_weights: w2, [E, H, I/2] uint8 or [E, H, I/8] int32.
    gemm2_scales: [E, H, I/32] bfloat16.
    w13_order: "gate_up" (checkpoint order) or "up_gate" (rows already reordered, as the seed's
      Blackwell preparation does).

  Returns:
    {"gemm1_weights": uint32 [E, 2I/16, H/64, 32, 4], "gemm1_scales": bf16 [E, H/32, 2I/16, 16],
     "gemm2_weights": uint32 [E, H/16, I/64, 32, 4], "gemm2_scales": bf16 [E, I/32, H/16, 16]}:
    the `w13_packed, w13_scale, w2_packed, w2_scale` arguments of `mxint4_moe`.
  """
  gemm1_weights, gemm2_weights = jnp.asarray(gemm1_weights), jnp.asarray(gemm2_weights)
  gemm1_scales, gemm2_scales = jnp.asarray(gemm1_scales), jnp.asarray(gemm2_scales)
  q13 = _weights_to_int8("gemm1_weights", gemm1_weights, "H")
  q2 = _weights_to_int8("gemm2_weights", gemm2_weights, "I")
  e, two_i, h = q13.shape
  if two_i % 2:
    raise ValueError(f"gemm1_weights must have 2I rows (gate, up), got {two_i}")
  i = two_i // 2
  if q2.shape != (e, h, i):
    raise ValueError(f"gemm2_weights must unpack to [E, H, I] = {(e, h, i)} for gemm1_weights "
                     f"unpacking to [E, 2I, H] = {q13.shape}, got {q2.shape}")
  if h % 64 or i % 64:
    raise ValueError(f"the kernel needs H % 64 == 0 and I % 64 == 0, got H={h}, I={i}")
  _check_scales("gemm1_scales", gemm1_scales, (e, two_i, h // GROUP_SIZE))
  _check_scales("gemm2_scales", gemm2_scales, (e, h, i // GROUP_SIZE))
  q13, s13 = order_w13_rows(q13, gemm1_scales, input_order=w13_order)
  return {
      "gemm1_weights": shuffle_weights_for_mma_tiles(q13),
      "gemm1_scales": interleave_block_scales(s13),
      "gemm2_weights": shuffle_weights_for_mma_tiles(q2),
      "gemm2_scales": interleave_block_scales(gemm2_scales),
  }


def unpack_mxint4_moe_weights(prepared: dict[str, Array]) -> tuple[Array, Array, Array, Array]:
  """Inverse of the preparation: (w13_q int8 [E, 2I, H], w13_scale bf16 [E, 2I, H/32],
  w2_q int8 [E, H, I], w2_scale bf16 [E, H, I/32]), the arguments of
  `reference.fused_moe_mxint4`."""
  missing = [k for k in WEIGHT_KEYS if k not in prepared]
  if missing:
    raise ValueError(f"prepared weights lack {missing}")
  return (unshuffle_weights_from_mma_tiles(prepared["gemm1_weights"]),
          deinterleave_block_scales(prepared["gemm1_scales"]),
          unshuffle_weights_from_mma_tiles(prepared["gemm2_weights"]),
          deinterleave_block_scales(prepared["gemm2_scales"]))


# ------------------------------------------------------------------ the op
def _check_packed(name: str, a, shape: tuple[int, ...], dtype) -> None:
  if jnp.dtype(a.dtype) != jnp.dtype(dtype):
    raise TypeError(f"{name} must be {jnp.dtype(dtype).name} (prepare_static_weights_for_"
                    f"mxint4_moe output), got {a.dtype}")
  if tuple(a.shape) != shape:
    raise ValueError(f"{name} must have shape {shape} (prepare_static_weights_for_mxint4_moe "
                     f"output), got {tuple(a.shape)}")


def _validate_routing(router_logits, top_k, routing_method, num_expert_group, topk_group,
                      e_score_correction_bias, routed_scaling_factor) -> RoutingMethodType:
  """The checks of `routing.route` (same messages), traced on shapes only."""
  try:
    method = RoutingMethodType(int(routing_method))
  except (ValueError, TypeError):
    raise ValueError(f"routing_method={routing_method!r} is not a RoutingMethodType "
                     f"(0..{len(RoutingMethodType) - 1})") from None
  if method not in SUPPORTED_ROUTING_METHODS:
    raise NotImplementedError(f"routing method {method.name} ({int(method)}) is not "
                              "implemented by the MxInt4 GPU kernel")
  shape = jax.ShapeDtypeStruct(router_logits.shape, jnp.float32)
  bias = (None if e_score_correction_bias is None else
          jax.ShapeDtypeStruct(jnp.shape(e_score_correction_bias), jnp.float32))
  jax.eval_shape(
      lambda logits, b: routing_lib.route(
          logits, top_k, method, num_expert_group=num_expert_group, topk_group=topk_group,
          e_score_correction_bias=b, routed_scaling_factor=routed_scaling_factor),
      shape, bias)
  if num_expert_group is not None and num_expert_group > MAX_EXPERT_GROUPS:
    raise ValueError(f"num_expert_group={num_expert_group} exceeds the kernel's "
                     f"{MAX_EXPERT_GROUPS}")
  return method


def _routing_operands(router_logits: Array, num_experts: int, top_k: int, **sizes: int
                      ) -> Array:
  """Checks the routing's sizes (and `sizes`: more positive ints) against the kernel's limits;
  router logits as the kernel reads them (float32 or bf16)."""
  if not jnp.issubdtype(router_logits.dtype, jnp.floating):
    raise TypeError(f"router_logits must be floating point, got {router_logits.dtype}")
  for name, v in (("num_experts", num_experts), ("top_k", top_k), *sizes.items()):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  if num_experts > MAX_EXPERTS:
    raise ValueError(f"num_experts={num_experts} exceeds the kernel's {MAX_EXPERTS}")
  if top_k > MAX_TOP_K:
    raise ValueError(f"top_k={top_k} exceeds the kernel's {MAX_TOP_K}")
  if router_logits.dtype not in (jnp.float32, jnp.bfloat16):
    router_logits = router_logits.astype(jnp.float32)
  return router_logits


def _mxint4_call(x, router_logits, w13_packed, w13_scale, w2_packed, w2_scale, *, num_experts,
                 top_k, intermediate_size, local_num_experts, ep_rank, num_expert_group,
                 topk_group, e_score_correction_bias, routed_scaling_factor, routing_method,
                 block_m, out_init, mainloop=None, fused_decode=None):
  """Validates, then calls the FFI target; returns (out, topk_ids, topk_weights)."""
  x = jnp.asarray(x)
  router_logits = jnp.asarray(router_logits)
  if x.ndim != 2:
    raise ValueError(f"x must be 2-D [T, H], got shape {x.shape}")
  if x.dtype != jnp.bfloat16:
    raise TypeError(f"x must be bfloat16, got {x.dtype}")
  t, h = x.shape
  if router_logits.ndim != 2 or router_logits.shape != (t, num_experts):
    raise ValueError(f"router_logits must be [T, num_experts] = {(t, num_experts)}, got shape "
                     f"{router_logits.shape}")
  router_logits = _routing_operands(router_logits, num_experts, top_k,
                                    intermediate_size=intermediate_size,
                                    local_num_experts=local_num_experts)
  if not isinstance(ep_rank, (int, np.integer)) or ep_rank < 0:
    raise ValueError(f"ep_rank must be a non-negative int, got {ep_rank!r}")
  offset = int(ep_rank) * int(local_num_experts)
  if offset + local_num_experts > num_experts:
    raise ValueError(f"ep_rank={ep_rank} with local_num_experts={local_num_experts} covers "
                     f"experts [{offset}, {offset + local_num_experts}), outside the "
                     f"{num_experts} experts")
  method = _validate_routing(router_logits, top_k, routing_method, num_expert_group, topk_group,
                             e_score_correction_bias, routed_scaling_factor)
  i, el = int(intermediate_size), int(local_num_experts)
  if h % 64 or i % 64:
    raise ValueError(f"the kernel needs H % 64 == 0 and I % 64 == 0, got H={h}, I={i}")
  _gpu_launch.check_problem_size(t * int(top_k), h, i, "T * K (x's tokens x top_k)")
  _check_packed("w13_packed", w13_packed, (el, 2 * i // 16, h // 64, 32, 4), jnp.uint32)
  _check_packed("w13_scale", w13_scale, (el, h // GROUP_SIZE, 2 * i // 16, 16), jnp.bfloat16)
  _check_packed("w2_packed", w2_packed, (el, h // 16, i // 64, 32, 4), jnp.uint32)
  _check_packed("w2_scale", w2_scale, (el, i // GROUP_SIZE, h // 16, 16), jnp.bfloat16)

  if t == 0:
    return (jnp.zeros((0, h), jnp.bfloat16), jnp.zeros((0, top_k), jnp.int32),
            jnp.zeros((0, top_k), jnp.float32))

  has_bias = e_score_correction_bias is not None
  bias = (jnp.asarray(e_score_correction_bias, jnp.float32).reshape(num_experts) if has_bias
          else jnp.zeros((1,), jnp.float32))
  static = dict(num_experts=num_experts, top_k=top_k, intermediate_size=i, local_experts=el,
                offset=offset, method=method, num_expert_group=num_expert_group,
                topk_group=topk_group, has_bias=has_bias,
                routed_scaling_factor=routed_scaling_factor, block_m=block_m, mainloop=mainloop,
                fused_decode=fused_decode)
  token_args = (x, router_logits)
  has_out = out_init is not None
  if has_out:
    if out_init.shape != (t, h) or out_init.dtype != jnp.bfloat16:
      raise ValueError(f"out_init must be {(t, h)} bfloat16, got {out_init.shape} "
                       f"{out_init.dtype}")
    token_args += (out_init,)

  def call(x, router_logits, *rest):
    out_buffer, shared = (rest[0], rest[1:]) if has_out else (None, rest)
    return _mxint4_ffi(x, router_logits, out_buffer, *shared, **static)

  # Under vmap, token sets sharing the weights are one call (_token_batching).
  return fold_token_batches(call, len(token_args))(
      *token_args, w13_packed, w13_scale, w2_packed, w2_scale, bias)


def _mxint4_ffi(x, router_logits, out_init, w13_packed, w13_scale, w2_packed, w2_scale, bias, *,
                num_experts, top_k, intermediate_size, local_experts, offset, method,
                num_expert_group, topk_group, has_bias, routed_scaling_factor, block_m, mainloop,
                fused_decode):
  """The FFI call on validated operands; launch choices follow x's token count."""
  from jax_moeq import _ffi
  _ffi.cuda_library()
  t, h = x.shape
  i, el = intermediate_size, local_experts
  pairs = t * top_k
  local_pairs = pairs * el / num_experts  # expected, for the heuristics
  block_m, mainloop_id = _gpu_launch.choose_launch(
      "mxint4", local_pairs / max(1.0, min(el, local_pairs)), block_m, mainloop)
  wgmma = _gpu_launch.uses_wgmma(block_m, mainloop_id)
  padded = _gpu_launch.max_padded_rows(pairs, el, block_m)
  blocks = padded // block_m
  busy = min(blocks, _gpu_launch.expected_busy_blocks(local_pairs, el, block_m))
  split13, split2 = _gpu_launch.choose_gemm_splits(busy, h, i, block_m, pairs, mainloop_id)
  scale = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
  groups = 1 if num_expert_group is None else int(num_expert_group)
  kept = 1 if topk_group is None else int(topk_group)
  # The one-token decode path: decided here, checked again by the FFI handler.
  one_token = _gpu_launch.decodes_without_alignment(t, block_m)
  fused = _gpu_launch.choose_fused_decode(fused_decode, one_token=one_token, top_k=top_k,
                                          hidden=h, intermediate=i)
  mainloop_id = _gpu_launch.choose_one_token_mainloop(
      mainloop_id, mainloop, one_token=one_token, fused=fused, top_k=top_k, hidden=h,
      intermediate=i)
  results = [
      jax.ShapeDtypeStruct((t, h), jnp.bfloat16),         # out
      jax.ShapeDtypeStruct((t, top_k), jnp.int32),        # topk_ids
      jax.ShapeDtypeStruct((t, top_k), jnp.float32),      # topk_weights
      jax.ShapeDtypeStruct((t, top_k), jnp.int32),        # local_ids
      jax.ShapeDtypeStruct((padded,), jnp.int32),         # sorted_ids
      jax.ShapeDtypeStruct((blocks,), jnp.int32),         # expert_ids
      jax.ShapeDtypeStruct((1,), jnp.int32),              # num_post_padded
      jax.ShapeDtypeStruct((pairs * i,), jnp.bfloat16),   # act
      jax.ShapeDtypeStruct((_gpu_launch.gemm1_workspace_floats(pairs, i, split13, one_token),),
                           jnp.float32),                  # ws13
      jax.ShapeDtypeStruct((_gpu_launch.gemm2_workspace_floats(pairs, h),), jnp.float32),  # ws2
      jax.ShapeDtypeStruct((t * h if wgmma else 1,),
                           jnp.bfloat16),                 # x_perm
  ]
  operands = [x, router_logits, bias, w13_packed, w13_scale, w2_packed, w2_scale]
  attrs = dict(top_k=np.int64(top_k), intermediate_size=np.int64(i),
               local_expert_offset=np.int64(offset), routing_method=np.int64(int(method)),
               num_expert_group=np.int64(groups), topk_group=np.int64(kept),
               routed_scaling_factor=np.float32(scale), has_bias=has_bias,
               block_m=np.int64(block_m), split13=np.int64(split13), split2=np.int64(split2),
               mainloop=np.int64(mainloop_id), one_token=one_token, fused_decode=fused)
  if out_init is None:
    call = jax.ffi.ffi_call(FFI_TARGET, results)
  else:
    operands.append(out_init)
    call = jax.ffi.ffi_call(FFI_TARGET_INTO, results,
                            input_output_aliases={len(operands) - 1: 0})
  res = call(*operands, **attrs)
  return res[0], res[1], res[2]


def mxint4_moe(x: Array, router_logits: Array, w13_packed: Array, w13_scale: Array,
               w2_packed: Array, w2_scale: Array, *, num_experts: int, top_k: int,
               intermediate_size: int, local_num_experts: int, ep_rank: int = 0,
               num_expert_group: int | None = None, topk_group: int | None = None,
               e_score_correction_bias: Array | None = None,
               routed_scaling_factor: float | None = None,
               routing_method: int | RoutingMethodType = RoutingMethodType.Renormalize,
               block_m: int | None = None, out_init: Array | None = None,
               mainloop: str | None = None, fused_decode: bool | None = None) -> Array:
  """MxInt4 fused MoE on a Hopper GPU, routing included (the seed's
  `flashinfer_trtllm_mxint4_moe` arguments); an `ffi_call`, usable under jit.

  Args:
    x: [T, H] bfloat16 hidden states.
    router_logits: [T, num_experts] float32 or bfloat16 (other floats are cast to float32).
    w13_packed, w13_scale, w2_packed, w2_scale: this rank's experts, the
      `prepare_static_weights_for_mxint4_moe` outputs ("gemm1_weights", "gemm1_scales",
      "gemm2_weights", "gemm2_scales").
    num_experts: experts routed over (all ranks).
    top_k: experts per token (<= 32).
    intermediate_size: I per partition.
    local_num_experts: experts on this rank; they are global ids
      [ep_rank · local_num_experts, (ep_rank + 1) · local_num_experts).
    ep_rank: this rank; pairs routed to other ranks' experts contribute nothing.
    num_expert_group, topk_group, e_score_correction_bias, routed_scaling_factor: DeepSeekV3
      (and MiniMax2: bias and scaling) routing arguments, as `routing.route`. The bias is used
      in float32 (the seed rounds it to bf16 first; pass a bf16-rounded bias to match).
    routing_method: a `RoutingMethodType` (Default, Renormalize, DeepSeekV3, Llama4,
      RenormalizeNaive, TopK, SigmoidRenorm, MiniMax2, Sigmoid).
    block_m: tokens per expert block (8/16/32/64, or 128: the wgmma GEMM); default from the
      routing density (_gpu_launch.choose_block_m: 8, or the wgmma GEMM's 32-, 64- or 128-token
      tile).
    out_init: optional [T, H] bf16 buffer aliased to the output (tests poison it).
    mainloop: GEMM main loop (see _gpu_launch.MAINLOOPS), or "stream" (one token: routing, then
      two streaming kernels); None picks the measured-fastest: "stream" for one token where it
      fits, else for the block_m ("async_ring" up to block_m 16; "wgmma" where block_m 32 or 64
      was chosen for the pairs per expert; else "registers").
    fused_decode: True runs a one-token call as routing then the single fused decode kernel
      (its pairs' weights must fit the SMs' shared memory, else ValueError); None / False: the
      one-token path's separate kernels (measured faster so far,
      `_gpu_launch.choose_fused_decode`).

  Returns:
    [T, H] bfloat16.
  """
  return _mxint4_call(
      x, router_logits, w13_packed, w13_scale, w2_packed, w2_scale, num_experts=num_experts,
      top_k=top_k, intermediate_size=intermediate_size, local_num_experts=local_num_experts,
      ep_rank=ep_rank, num_expert_group=num_expert_group, topk_group=topk_group,
      e_score_correction_bias=e_score_correction_bias,
      routed_scaling_factor=routed_scaling_factor, routing_method=routing_method,
      block_m=block_m, out_init=out_init, mainloop=mainloop, fused_decode=fused_decode)[0]


def mxint4_moe_with_routing(x: Array, router_logits: Array, w13_packed: Array, w13_scale: Array,
                            w2_packed: Array, w2_scale: Array, **kwargs: Any
                            ) -> tuple[Array, Array, Array]:
  """`mxint4_moe`, also returning the GPU routing's (topk_ids int32 [T, K] global ids,
  topk_weights float32 [T, K])."""
  return _mxint4_call(x, router_logits, w13_packed, w13_scale, w2_packed, w2_scale,
                      **{**dict(ep_rank=0, num_expert_group=None, topk_group=None,
                                e_score_correction_bias=None, routed_scaling_factor=None,
                                routing_method=RoutingMethodType.Renormalize, block_m=None,
                                out_init=None), **kwargs})


def mxint4_routing(router_logits: Array, *, top_k: int,
                   routing_method: int | RoutingMethodType = RoutingMethodType.Renormalize,
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   e_score_correction_bias: Array | None = None,
                   routed_scaling_factor: float | None = None) -> tuple[Array, Array]:
  """The routing step of `mxint4_moe` alone, on the GPU: the same kernel, so the same bits as
  the fused op routes with (`routing.route` semantics; its float rounding may differ from XLA's
  by an ulp). Expert parallelism routes with it before exchanging pairs.

  Returns:
    (topk_weights float32 [T, K], topk_ids int32 [T, K] global ids), as `routing.route`.
  """
  router_logits = jnp.asarray(router_logits)
  if router_logits.ndim != 2:
    raise ValueError(f"router_logits must be [T, num_experts], got shape {router_logits.shape}")
  t, num_experts = router_logits.shape
  router_logits = _routing_operands(router_logits, num_experts, top_k)
  method = _validate_routing(router_logits, top_k, routing_method, num_expert_group, topk_group,
                             e_score_correction_bias, routed_scaling_factor)
  if t == 0:
    return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
  from jax_moeq import _ffi
  _ffi.cuda_library()
  has_bias = e_score_correction_bias is not None
  bias = (jnp.asarray(e_score_correction_bias, jnp.float32).reshape(num_experts) if has_bias
          else jnp.zeros((1,), jnp.float32))
  results = [jax.ShapeDtypeStruct((t, top_k), jnp.int32),    # topk_ids
             jax.ShapeDtypeStruct((t, top_k), jnp.float32),  # topk_weights
             jax.ShapeDtypeStruct((t, top_k), jnp.int32)]    # local_ids (every expert local)
  ids, weights, _ = jax.ffi.ffi_call(FFI_TARGET_ROUTING, results)(
      router_logits, bias, top_k=np.int64(top_k), local_expert_offset=np.int64(0),
      local_num_experts=np.int64(num_experts), routing_method=np.int64(int(method)),
      num_expert_group=np.int64(1 if num_expert_group is None else int(num_expert_group)),
      topk_group=np.int64(1 if topk_group is None else int(topk_group)),
      routed_scaling_factor=np.float32(1.0 if routed_scaling_factor is None
                                       else float(routed_scaling_factor)),
      has_bias=has_bias)
  return weights, ids


def is_mxint4_moe_available() -> bool:
  """A CUDA device with compute capability >= 9.0 and our CUDA library loaded."""
  from jax_moeq import _ffi
  cc = _ffi.cuda_compute_capability()
  return cc is not None and cc >= (9, 0) and _ffi.cuda_library_available()
