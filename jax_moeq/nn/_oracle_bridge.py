"""Glue between the Flax blocks and the per-scheme oracles, references and GPU ops.

Kept apart from `_backends` so that the block's code does not depend on the exact signatures of
the oracle / reference modules.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_moeq.nn._backends import ACTIVATION_KIND, CPU_INT4, REFERENCE, BackendChoice

def _moe_config(spec, dtype, moe_backend: str):
  """The oracle's MoEConfig for a block. The block routes itself (`select_experts`) and hands the
  op top-k ids, so the experts perform no routing: routing_method is Default."""
  from jax_moeq.oracle import base
  return base.MoEConfig(
      num_experts=spec.num_experts, top_k=spec.top_k, hidden_size=spec.hidden_size,
      intermediate_size=spec.intermediate_size, activation=spec.activation,
      apply_router_weight_on_input=spec.apply_router_weight_on_input,
      routing_method=base.RoutingMethodType.Default, has_bias=spec.use_bias, in_dtype=dtype,
      moe_backend=moe_backend)


def _w4a8_oracle(spec, group_size: int, dtype, moe_backend: str) -> tuple[str, str]:
  """Asks the W4A8 Int8 oracle; returns (our backend name, the reason)."""
  from jax_moeq.oracle import base, w4a8_int8
  config = _moe_config(spec, dtype, moe_backend)
  weight_key = base.w4a8_weight_key(group_size)
  backend, experts_cls = w4a8_int8.select_w4a8_int8_moe_backend(config, weight_key, None)
  if backend == w4a8_int8.W4A8Int8MoeBackend.CPU_INT4:
    return CPU_INT4, f"the W4A8 Int8 oracle chose {backend.value} ({experts_cls.__name__})"
  if moe_backend != "auto":
    return REFERENCE, f"moe_backend={moe_backend!r} was requested"
  # Why the kernel was passed over: the kernel class's own reason.
  fast = w4a8_int8.backend_to_kernel_cls(w4a8_int8.W4A8Int8MoeBackend.CPU_INT4)[0]
  _, why = fast.is_supported_config(config, weight_key, None)
  return REFERENCE, (f"the W4A8 Int8 oracle chose {backend.value}: CPU_INT4 does not fit since "
                     f"{why}")


def choose(spec, scheme: str, group_size: int, dtype, moe_backend: str,
           allow_activation_quantization: bool) -> BackendChoice:
  """Backend for a block: explicit `moe_backend`, or the fastest that fits ("auto")."""
  moe_backend = str(moe_backend).strip().lower()
  if scheme == "w4a8_int8":
    backend, reason = _w4a8_oracle(spec, group_size, dtype, moe_backend)
    return BackendChoice(backend, reason)
  # wna16 / mxint4: weight-only schemes; their GPU kernels come from their own oracles.
  if moe_backend not in ("auto", CPU_INT4, "cpu", REFERENCE, "jnp"):
    return _choose_gpu(spec, scheme, group_size, dtype, moe_backend)
  if moe_backend == "auto" and jax.default_backend() == "gpu":
    return _choose_gpu(spec, scheme, group_size, dtype, moe_backend)
  if moe_backend in (REFERENCE, "jnp"):
    return BackendChoice(REFERENCE, f"moe_backend={moe_backend!r} was requested")
  if not allow_activation_quantization:
    if moe_backend != "auto":
      raise ValueError(f"moe_backend={moe_backend!r} (the CPU W4A8 kernel) quantizes activations "
                       f"to int8, which a {scheme} block does not do unless "
                       "allow_activation_quantization=True")
    return BackendChoice(REFERENCE, f"no {scheme} kernel on {jax.default_backend()}; the CPU W4A8 "
                         "kernel would quantize activations to int8 (allow_activation_quantization"
                         "=True allows it); using the jnp reference")
  # Activation quantization allowed: the int4 data runs as W4A8 (same oracle, same rules).
  backend, reason = _w4a8_oracle(spec, group_size, dtype,
                                 "auto" if moe_backend == "auto" else CPU_INT4)
  return BackendChoice(backend, f"{scheme} weights converted for the W4A8 kernel since activation "
                       f"quantization was allowed; {reason}", via_w4a8=backend == CPU_INT4)


MARLIN = "marlin"
MXINT4_GPU = "mxint4_gpu"
GPU_BACKENDS = {"wna16": MARLIN, "mxint4": MXINT4_GPU}
_WNA16_STATIC = ("hidden_size", "intermediate_size", "group_size13", "group_size2", "has_zeros",
                 "has_bias", "act_order")


def mxint4_routing_method(spec):
  """The kernel-side routing method (SPEC §5) equal to the block's routing, or None."""
  from jax_moeq.routing import RoutingMethodType as R
  if spec.use_grouped_topk:
    if spec.scoring_func == "sigmoid":
      return R.DeepSeekV3
    return None
  if spec.scoring_func != "softmax" or spec.routed_scaling_factor != 1.0:
    return None
  # softmax -> top-k -> renormalize equals top-k -> softmax over the k (softmax is monotone).
  return R.Renormalize if spec.renormalize else R.Default


def _choose_gpu(spec, scheme, group_size, dtype, moe_backend) -> BackendChoice:
  """GPU platforms: the scheme's own oracle (WNA16: MARLIN; MxInt4: HOPPER_MXINT4)."""
  if scheme not in GPU_BACKENDS:
    raise ValueError(f"moe_backend={moe_backend!r} is not a backend of scheme={scheme!r}")
  from jax_moeq.oracle import base
  config = _moe_config(spec, dtype, moe_backend)
  if scheme == "wna16":
    from jax_moeq.oracle import wna16 as oracle
    weight_key = base.wna16_weight_key(group_size)
    if moe_backend == MARLIN:
      config = dataclasses.replace(config, moe_backend="marlin")
    backend, cls = oracle.select_wna16_moe_backend(config, weight_key)
    fast = oracle.WNA16MoeBackend.MARLIN
  else:
    from jax_moeq.oracle import mxint4 as oracle
    method = mxint4_routing_method(spec)
    if method is None:
      # The kernel routes inside; a block routing it cannot express runs on the reference.
      return BackendChoice(REFERENCE, "the block's routing has no MxInt4 kernel-side routing "
                           "method; using the jnp reference")
    weight_key = base.kMxInt4StaticGroup32
    config = dataclasses.replace(config, routing_method=method,
                                 moe_backend="hopper_mxint4" if moe_backend == MXINT4_GPU
                                 else moe_backend)
    backend, cls = oracle.select_mxint4_moe_backend(config, weight_key)
    fast = oracle.MxInt4MoeBackend.HOPPER_MXINT4
  if backend == fast:
    return BackendChoice(GPU_BACKENDS[scheme], f"the {scheme} oracle chose {backend.value} "
                         f"({cls.__name__})")
  if backend.name == "BATCHED_MARLIN":
    return BackendChoice(REFERENCE, "the oracle chose BATCHED_MARLIN (batched activation format), "
                         "which the block does not use; using the jnp reference")
  _, why = oracle.backend_to_kernel_cls(fast)[0].is_supported_config(config, weight_key, None)
  return BackendChoice(REFERENCE, f"the {scheme} oracle chose {backend.value}: {fast.value} does "
                       f"not fit since {why}")


def prepare_gpu(choice, weights, spec):
  """Canonical int4 -> the GPU kernel's arrays (once, at construction)."""
  from jax_moeq.quant import int4
  if choice.backend == MARLIN:
    from jax_moeq.ops import wna16_gpu
    packed = wna16_gpu.convert_to_wna16_moe_kernel_format(
        "MARLIN", int4.pack_uint4b8_gptq(jnp.asarray(weights.w13)),
        int4.pack_uint4b8_gptq(jnp.asarray(weights.w2)),
        jnp.swapaxes(jnp.asarray(weights.w13_scale), -1, -2),
        jnp.swapaxes(jnp.asarray(weights.w2_scale), -1, -2), group_size=weights.group_size,
        w13_g_idx=weights.w13_g_idx, w2_g_idx=weights.w2_g_idx, w13_bias=weights.w13_bias,
        w2_bias=weights.w2_bias, dtype=choice.dtype)
    # The static fields are recomputed from the block at call time (see apply_gpu).
    return {f: getattr(packed, f) for f in packed.__dataclass_fields__ if f not in _WNA16_STATIC}
  if choice.backend == MXINT4_GPU:
    from jax_moeq.ops import mxint4_gpu
    if weights.w13_g_idx is not None or weights.w2_g_idx is not None:
      raise ValueError("MxInt4 weights have no act-order (g_idx)")
    return mxint4_gpu.prepare_static_weights_for_mxint4_moe(
        mxint4_gpu.int8_to_signed_nibbles(jnp.asarray(weights.w13)),
        jnp.asarray(weights.w13_scale, jnp.bfloat16),
        mxint4_gpu.int8_to_signed_nibbles(jnp.asarray(weights.w2)),
        jnp.asarray(weights.w2_scale, jnp.bfloat16))
  raise NotImplementedError(f"backend {choice.backend!r} has no converter")


def apply_gpu(backend, arrays, x, topk_ids, topk_weights, spec, scheme, group_size, logits=None):
  if backend == MARLIN:
    from jax_moeq.ops import wna16_gpu
    h, i = spec.hidden_size, spec.intermediate_size
    weights = wna16_gpu.Wna16MoeWeights(
        **arrays, hidden_size=h, intermediate_size=i,
        group_size13=h if group_size == -1 else group_size,
        group_size2=i if group_size == -1 else group_size, has_zeros=False,
        has_bias=spec.use_bias, act_order=arrays["w13_perm"].ndim == 2)  # [1] placeholder if not
    return wna16_gpu.fused_marlin_moe(x, weights, topk_weights, topk_ids,
                                      activation_kind=ACTIVATION_KIND[spec.activation])
  if backend == MXINT4_GPU:
    from jax_moeq.ops import mxint4_gpu
    return mxint4_gpu.mxint4_moe(
        x, logits, arrays["gemm1_weights"], arrays["gemm1_scales"], arrays["gemm2_weights"],
        arrays["gemm2_scales"], num_experts=spec.num_experts, top_k=spec.top_k,
        intermediate_size=spec.intermediate_size, local_num_experts=spec.num_experts,
        num_expert_group=spec.num_expert_group, topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling_factor if spec.use_grouped_topk else None,
        routing_method=mxint4_routing_method(spec))
  raise NotImplementedError(f"backend {backend!r} is not wired")


def to_canonical_gpu(backend, arrays, spec, group_size):
  raise NotImplementedError(f"exporting weights from backend {backend!r} is not supported; build "
                            "the block with moe_backend='reference' to export")


def reference(scheme: str, arrays, x, topk_ids, topk_weights, spec, group_size: int):
  """The jnp reference of `scheme` on canonical int4 arrays (natural order, optional g_idx).

  "w4a8_int8": `reference.fused_moe_w4a8`. "wna16": `reference.fused_moe_wna16`. "mxint4": the
  MxInt4 kernel's arithmetic is `fused_moe_wna16`'s with group 32 (reference.fused_moe_mxint4
  routes inside; the block has routed already), so it runs through `fused_moe_wna16`.
  """
  from jax_moeq import reference as ref
  kind = ACTIVATION_KIND[spec.activation]
  common = dict(w13_bias=arrays.get("w13_bias"), w2_bias=arrays.get("w2_bias"),
                apply_router_weight_on_input=spec.apply_router_weight_on_input,
                activation_kind=kind)
  if scheme == "w4a8_int8":
    if "w13_g_idx" in arrays or "w2_g_idx" in arrays:
      raise ValueError("w4a8_int8 weights with act-order (g_idx) are not supported")
    return ref.fused_moe_w4a8(x, topk_ids, topk_weights, arrays["w13_q"], arrays["w13_scale"],
                              arrays["w2_q"], arrays["w2_scale"], group_size, **common)
  return ref.fused_moe_wna16(x, topk_ids, topk_weights, arrays["w13_q"], arrays["w13_scale"],
                             arrays["w2_q"], arrays["w2_scale"], group_size,
                             w13_g_idx=arrays.get("w13_g_idx"), w2_g_idx=arrays.get("w2_g_idx"),
                             **common)
