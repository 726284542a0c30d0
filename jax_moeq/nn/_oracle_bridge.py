"""Glue between the Flax blocks and the per-scheme oracles, references and GPU ops.

Kept apart from `_backends` so that the block's code does not depend on the exact signatures of
the oracle / reference modules.
"""

from __future__ import annotations

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
