"""CPU W4A8 experts: int4 weights, dynamic per-token int8 activations, one fused FFI call.

`prepare` packs canonical int4 weights into the kernel's bytes (`convert_to_w4a8_int8_moe_format`;
already packed `W4A8PackedWeights` pass through); the experts route on the host side
(`routing.select_experts`) and call `ops.w4a8_cpu.dynamic_4bit_int_moe`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jax_moeq import _ffi
from jax_moeq.experts.base import MoEExperts, check_int4_weights, require_arrays
from jax_moeq.oracle.base import (
    W4A8_WEIGHT_KEYS, MoEConfig, QuantKey, RoutingMethodType, kInt8DynamicTokenAsym,
)
from jax_moeq.ops import w4a8_cpu
from jax_moeq.weights import (
    Int4MoEWeights, W4A8PackedWeights, fold_w2_act_order, validate_w4a8_packed_weights,
)

Array = jax.Array

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ALIGNMENT = 16  # H and I: the packed layout's 16-row tiles
_NAMES = ("w13_packed", "w2_packed")


def w4a8_scales(weights: Int4MoEWeights) -> Int4MoEWeights:
  """Scales in the W4A8 scheme's dtypes (SPEC §2): bf16 group-wise (fp16 / f32 scales are
  rounded, as the kernel and the reference must see the same values), f32 channel-wise."""
  dtype = jnp.float32 if weights.group_size == -1 else jnp.bfloat16
  return dataclasses.replace(weights, w13_scale=jnp.asarray(weights.w13_scale, dtype),
                             w2_scale=jnp.asarray(weights.w2_scale, dtype))


class FusedW4A8Experts(MoEExperts):
  """What the fused W4A8 kernels (CPU and GPU) accept: int4 weights with activations quantized
  to int8 per token inside the kernel, and softmax top-k routing done before the call."""

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    # Activations arrive unquantized (activation_key None) and are quantized inside the kernel.
    return weight_key in W4A8_WEIGHT_KEYS and activation_key in (None, kInt8DynamicTokenAsym)

  @staticmethod
  def _supports_routing_method(routing_method: RoutingMethodType, weight_key, activation_key
                               ) -> bool:
    return routing_method in (RoutingMethodType.Default, RoutingMethodType.Renormalize,
                              RoutingMethodType.RenormalizeNaive)


class CPUExpertsInt4(FusedW4A8Experts):
  """The fused CPU W4A8 MoE (`dynamic_4bit_int_moe`, SPEC §4).

  Prepared arrays: {"w13_packed", "w2_packed"}, uint8 [E, bytes] (scales and biases inside).
  """

  backend_name = "cpu_int4"

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return platform == "cpu"

  @staticmethod
  def _supports_expert_map() -> bool:
    return False

  @classmethod
  def _unsupported_reason(cls, moe_config: MoEConfig, weight_key: QuantKey | None,
                          activation_key: QuantKey | None) -> str | None:
    if moe_config.in_dtype not in KERNEL_DTYPES:
      return f"the kernel does not support {moe_config.in_dtype} input/output dtype"
    h, i = moe_config.hidden_size, moe_config.intermediate_size
    if h % ALIGNMENT or i % ALIGNMENT:
      return f"H={h} and I={i} must be multiples of {ALIGNMENT}"
    g = weight_key.group_size
    if g != -1 and (h % g or i % g):
      return f"group_size={g} does not divide H={h} and I={i}"
    if not _ffi.cpu_library_available():
      return "the CPU library jax_moeq._cpu_ffi is not built (pip install . or scripts/dev_build.sh)"
    return None

  def _group_size(self) -> int:
    if self.quant_config is not None:
      return self.quant_config.group_size
    raise ValueError("CPUExpertsInt4 needs a quant_config (make_w4a8_int8_moe_quant_config) "
                     "to know the group size")

  # ---------------------------------------------------------------- weights
  def prepare(self, weights: Int4MoEWeights | W4A8PackedWeights) -> dict[str, Array]:
    """Packs int4 experts (scales as `w4a8_scales`). w2's act-order is folded into w13's rows
    exactly; w13's cannot run here."""
    if isinstance(weights, W4A8PackedWeights):
      self._check_packed(weights)
      return {"w13_packed": weights.w13_packed, "w2_packed": weights.w2_packed}
    w = check_int4_weights(weights)
    self._check_group(w.group_size)
    if w.w13_g_idx is not None:
      raise ValueError("these weights use act-order on w13 (a per-expert permutation of the "
                       "hidden input), which the W4A8 kernel cannot apply; run them on the "
                       "reference backend (allow_activation_quantization=False)")
    w = w4a8_scales(fold_w2_act_order(w))
    w13_packed, w2_packed, *_ = w4a8_cpu.convert_to_w4a8_int8_moe_format(
        jnp.asarray(w.w13_q), jnp.asarray(w.w2_q), w.w13_scale, w.w2_scale, w.group_size,
        w.w13_bias, w.w2_bias)
    return {"w13_packed": w13_packed, "w2_packed": w2_packed}

  def canonical(self, arrays: Mapping[str, Array]) -> Int4MoEWeights:
    """Unpacks on the host: scales in the dtype they were packed from (bf16 group-wise, exact;
    f32 channel-wise), biases when the config has them."""
    require_arrays(type(self).__name__, arrays, _NAMES)
    h, i, g = self.moe_config.hidden_size, self.moe_config.intermediate_size, self._group_size()
    q13, s13, _, b13 = w4a8_cpu.unpack_w4a8_gemm(arrays["w13_packed"], 2 * i, h, g)
    q2, s2, _, b2 = w4a8_cpu.unpack_w4a8_gemm(arrays["w2_packed"], h, i, g)
    sdt = jnp.float32 if g == -1 else jnp.bfloat16
    bias = (lambda b: jnp.asarray(b)) if self.moe_config.has_bias else (lambda b: None)
    return Int4MoEWeights(jnp.asarray(q13), jnp.asarray(s13, sdt), jnp.asarray(q2),
                          jnp.asarray(s2, sdt), g, bias(b13), bias(b2))

  def _check_group(self, group_size: int) -> None:
    if group_size != self._group_size():
      raise ValueError(f"weights have group_size={group_size}, the experts were built for "
                       f"group_size={self._group_size()}")

  def _check_packed(self, packed: W4A8PackedWeights) -> None:
    validate_w4a8_packed_weights(packed)
    self._check_group(packed.group_size)
    cfg = self.moe_config
    if (packed.hidden_size, packed.intermediate_size) != (cfg.hidden_size, cfg.intermediate_size):
      raise ValueError(f"packed weights have H={packed.hidden_size}, I="
                       f"{packed.intermediate_size}; the experts were built for H="
                       f"{cfg.hidden_size}, I={cfg.intermediate_size}")

  # ---------------------------------------------------------------- compute
  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array], residual: Array | None = None) -> Array:
    """`dynamic_4bit_int_moe` on routed tokens (`residual` added in its combine)."""
    require_arrays(type(self).__name__, weights, _NAMES)
    h, i = self.moe_config.hidden_size, self.moe_config.intermediate_size
    return w4a8_cpu.dynamic_4bit_int_moe(
        hidden_states, topk_ids, topk_weights, weights["w13_packed"], weights["w2_packed"], h, i,
        2 * i, self._group_size(), apply_router_weight_on_input=self.apply_router_weight_on_input,
        activation_kind=self.activation.kernel_kind, residual=residual)

  def apply_routed_residual(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                            weights: Mapping[str, Array], residual: Array) -> Array:
    """The residual added by the kernel (no XLA op between layers) where dtypes agree."""
    if residual.dtype != hidden_states.dtype:
      return super().apply_routed_residual(hidden_states, topk_ids, topk_weights, weights,
                                           residual)
    return self.apply_routed(hidden_states, topk_ids, topk_weights, weights, residual)

