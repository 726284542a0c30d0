"""Glue between the Flax blocks and the per-scheme oracles, references and GPU ops.

Kept apart from `_backends` so that the block's code does not depend on the exact signatures of
the oracle / reference modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moeq.nn._backends import ACTIVATION_KIND, CPU_INT4, REFERENCE, BackendChoice

W4A8_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
W4A8_GROUP_SIZES = (32, 64, 128, -1)


def _w4a8_kernel_fit(spec, group_size: int, dtype) -> tuple[bool, str]:
  """Whether the CPU W4A8 kernel can run this block, and why not."""
  if jax.default_backend() != "cpu":
    return False, f"the W4A8 kernel runs on CPU, the default platform is {jax.default_backend()}"
  from jax_moeq import _ffi
  if not _ffi.cpu_library_available():
    return False, "the CPU library (jax_moeq._cpu_ffi) is not built"
  h, i = spec.hidden_size, spec.intermediate_size
  if h % 16 or i % 16:
    return False, f"H={h} and I={i} must be multiples of 16"
  if group_size not in W4A8_GROUP_SIZES:
    return False, f"group_size={group_size} is not one of {W4A8_GROUP_SIZES}"
  if group_size != -1 and (h % group_size or i % group_size):
    return False, f"group_size={group_size} does not divide H={h} and I={i}"
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in W4A8_KERNEL_DTYPES]:
    return False, f"activation dtype {jnp.dtype(dtype).name} is not float32/bfloat16/float16"
  return True, "CPU W4A8 kernel fits (int4 weights, dynamic per-token int8 activations)"


def choose(spec, scheme: str, group_size: int, dtype, moe_backend: str,
           allow_activation_quantization: bool) -> BackendChoice:
  """Backend for a block: explicit `moe_backend`, or the fastest that fits ("auto")."""
  fits, why = _w4a8_kernel_fit(spec, group_size, dtype)
  if moe_backend not in ("auto", CPU_INT4, REFERENCE):
    return _choose_gpu(spec, scheme, group_size, dtype, moe_backend)
  if moe_backend == REFERENCE:
    return BackendChoice(REFERENCE, "moe_backend='reference' was requested")
  if scheme == "w4a8_int8":
    if fits:
      return BackendChoice(CPU_INT4, why)
    if moe_backend == CPU_INT4:
      raise ValueError(f"moe_backend='{CPU_INT4}' does not fit: {why}")
    return BackendChoice(REFERENCE, f"no faster backend fits ({why}); using the jnp reference")
  # wna16 / mxint4: weight-only schemes.
  if jax.default_backend() == "gpu" and moe_backend == "auto":
    return _choose_gpu(spec, scheme, group_size, dtype, moe_backend)
  if allow_activation_quantization and fits:
    return BackendChoice(CPU_INT4, f"{scheme} weights converted for the CPU W4A8 kernel: "
                         "activation quantization was allowed; " + why, via_w4a8=True)
  if moe_backend == CPU_INT4:
    if not allow_activation_quantization:
      raise ValueError(f"moe_backend='{CPU_INT4}' quantizes activations to int8, which a {scheme} "
                       "block does not do unless allow_activation_quantization=True")
    raise ValueError(f"moe_backend='{CPU_INT4}' does not fit: {why}")
  reason = (f"no {scheme} kernel on {jax.default_backend()}; " +
            ("the W4A8 kernel does not fit (" + why + ")" if allow_activation_quantization else
             "the W4A8 CPU kernel would quantize activations to int8 "
             "(allow_activation_quantization=True allows it)") + "; using the jnp reference")
  return BackendChoice(REFERENCE, reason)


def _choose_gpu(spec, scheme, group_size, dtype, moe_backend) -> BackendChoice:
  raise ValueError(f"moe_backend={moe_backend!r} is not available for scheme={scheme!r} on "
                   f"{jax.default_backend()} (GPU backends need the CUDA library and a GPU)")


def prepare_gpu(choice, weights, spec):
  raise NotImplementedError(f"backend {choice.backend!r} has no converter here")


def apply_gpu(backend, arrays, x, topk_ids, topk_weights, spec, scheme, group_size):
  raise NotImplementedError(f"backend {backend!r} is not wired")


def to_canonical_gpu(backend, arrays, spec, group_size):
  raise NotImplementedError(f"backend {backend!r} has no inverse conversion here")


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
