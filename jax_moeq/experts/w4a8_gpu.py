"""GPU W4A8 experts: int4 weights, dynamic per-token int8 activations, Hopper int8 tensor cores.

`W4A8GpuExperts` (backend CUDA_W4A8 of the W4A8 Int8 scheme) packs canonical int4 weights into
the GPU kernel's layout (`ops.w4a8_gpu.convert_to_w4a8_gpu_format`; scales as
`cpu_int4.w4a8_scales`, the same values the CPU kernel and the reference see), routes on the host
side (`routing.select_experts`) and calls `ops.w4a8_gpu.w4a8_gpu_moe`. It runs on a CUDA GPU of
compute capability 9.0 (the kernel is built for sm_90a) with jax_moeq's CUDA library.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jax_moeq.experts.base import check_int4_weights, require_arrays
from jax_moeq.experts.cpu_int4 import FusedW4A8Experts, w4a8_scales
from jax_moeq.oracle.base import MoEConfig, QuantKey
from jax_moeq.ops import w4a8_gpu
from jax_moeq.weights import Int4MoEWeights, W4A8PackedWeights, fold_w2_act_order

Array = jax.Array


class W4A8GpuExperts(FusedW4A8Experts):
  """The fused GPU W4A8 MoE (SPEC §4 semantics). Prepared arrays: the `W4a8GpuWeights` array
  fields (`ops.w4a8_gpu.ARRAY_NAMES`); a [1] bias marks "no bias"."""

  backend_name = "cuda_w4a8"

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return platform == "cuda"

  @classmethod
  def _unsupported_reason(cls, moe_config: MoEConfig, weight_key: QuantKey | None,
                          activation_key: QuantKey | None) -> str | None:
    if moe_config.in_dtype not in w4a8_gpu.KERNEL_DTYPES:
      return f"the kernel does not support {moe_config.in_dtype} input/output dtype"
    h, i = moe_config.hidden_size, moe_config.intermediate_size
    a = w4a8_gpu.ALIGNMENT
    if h % a or i % a:
      return f"the kernel needs H and I multiples of {a}, got H={h}, I={i}"
    if max(h, i) > w4a8_gpu.MAX_FEATURES:
      return f"the kernel needs H and I at most {w4a8_gpu.MAX_FEATURES}, got H={h}, I={i}"
    g = weight_key.group_size
    if g != -1 and (h % g or i % g):
      return f"group_size={g} does not divide H={h} and I={i}"
    if moe_config.num_experts > w4a8_gpu.MAX_EXPERTS:
      return f"the alignment kernel supports at most {w4a8_gpu.MAX_EXPERTS} experts"
    try:
      reason = w4a8_gpu.w4a8_gpu_unavailable_reason()
    except Exception as e:  # pylint: disable=broad-except
      reason = f"the CUDA library could not be checked ({e})"
    return reason

  def _group_size(self) -> int:
    if self.quant_config is None:
      raise ValueError("W4A8GpuExperts needs a quant_config (make_w4a8_int8_moe_quant_config) "
                       "to know the group size")
    return self.quant_config.group_size

  # ---------------------------------------------------------------- weights
  def prepare(self, weights: Int4MoEWeights | W4A8PackedWeights) -> dict[str, Array]:
    """Packs int4 experts (scales as `w4a8_scales`); CPU-packed weights are unpacked first.
    w2's act-order is folded into w13's rows exactly; w13's cannot run here."""
    w = check_int4_weights(weights)
    if w.group_size != self._group_size():
      raise ValueError(f"weights have group_size={w.group_size}, the experts were built for "
                       f"group_size={self._group_size()}")
    if w.w13_g_idx is not None:
      raise ValueError("these weights use act-order on w13 (a per-expert permutation of the "
                       "hidden input), which the W4A8 kernel cannot apply; run them on the "
                       "reference backend")
    w = fold_w2_act_order(w)
    if not isinstance(weights, W4A8PackedWeights):
      w = w4a8_scales(w)
    packed = w4a8_gpu.convert_to_w4a8_gpu_format(
        jnp.asarray(w.w13_q), jnp.asarray(w.w2_q), w.w13_scale, w.w2_scale, w.group_size,
        w.w13_bias, w.w2_bias)
    return {name: getattr(packed, name) for name in w4a8_gpu.ARRAY_NAMES}

  def kernel_weights(self, arrays: Mapping[str, Array]) -> w4a8_gpu.W4a8GpuWeights:
    require_arrays(type(self).__name__, arrays, w4a8_gpu.ARRAY_NAMES)
    return w4a8_gpu.W4a8GpuWeights(
        **{name: arrays[name] for name in w4a8_gpu.ARRAY_NAMES},
        hidden_size=self.moe_config.hidden_size,
        intermediate_size=self.moe_config.intermediate_size, group_size=self._group_size(),
        has_bias=arrays["w13_bias"].ndim > 1)

  def canonical(self, arrays: Mapping[str, Array]) -> Int4MoEWeights:
    """Unpacks: int4 weights, scales in the W4A8 dtypes (bf16 group-wise, f32 channel-wise;
    exact), biases when the config has them."""
    kw = self.kernel_weights(arrays)
    q13, s13, q2, s2 = w4a8_gpu.canonical_from_w4a8_gpu(kw)
    g = self._group_size()
    sdt = jnp.float32 if g == -1 else jnp.bfloat16
    has_bias = self.moe_config.has_bias and kw.has_bias
    return Int4MoEWeights(q13, s13.astype(sdt), q2, s2.astype(sdt), g,
                          kw.w13_bias if has_bias else None, kw.w2_bias if has_bias else None)

  # ---------------------------------------------------------------- compute
  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    return w4a8_gpu.w4a8_gpu_moe(
        hidden_states, self.kernel_weights(weights), topk_weights, topk_ids,
        activation_kind=self.activation.kernel_kind,
        apply_router_weight_on_input=self.apply_router_weight_on_input)
