"""WNA16 experts (int4 weights, bf16/fp16 activations; SPEC §7).

- `MarlinExperts` (backend MARLIN): `ops.wna16_gpu.fused_marlin_moe` on a CUDA GPU of compute
  capability >= 9.0 with our CUDA library, standard [T, H] format.
- `BatchedMarlinExperts` (backend BATCHED_MARLIN): `batched_fused_marlin_moe`, batched
  [E, max_tokens, H] format with per-expert counts (`apply_batched`).
- `ReferenceExpertsWNA16` (backend REFERENCE): `reference.fused_moe_wna16` on canonical
  [E, N, K] int4-as-int8 weights (act-order g_idx included), every platform.

All prepare from `weights.Int4MoEWeights` (symmetric int4: GPTQ uint4b8 without zero points).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jax_moeq import reference
from jax_moeq.experts.base import MoEExperts, check_int4_weights, require_arrays
from jax_moeq.oracle.base import WNA16_WEIGHT_KEYS, FusedMoEActivationFormat, QuantKey
from jax_moeq.ops import wna16_gpu
from jax_moeq.quant import int4
from jax_moeq.weights import Int4MoEWeights

Array = jax.Array

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The statics of `Wna16MoeWeights` are rebuilt from the config and the arrays at call time, so
# the prepared dict holds arrays only (the blocks keep it as variables).
_MARLIN_ARRAYS = ("w13", "w13_scales", "w13_zeros", "w13_bias", "w2", "w2_scales", "w2_zeros",
                  "w2_bias", "w13_perm", "w2_inv_perm")
_REFERENCE_ARRAYS = ("w13_q", "w13_scale", "w2_q", "w2_scale")


class _WNA16ExpertsBase(MoEExperts):

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    return weight_key in WNA16_WEIGHT_KEYS and activation_key is None

  def _group_size(self) -> int:
    if self.quant_config is None:
      raise ValueError(f"{type(self).__name__} needs a quant_config "
                       "(make_wna16_moe_quant_config) to know the group size")
    return self.quant_config.group_size

  def _check_int4(self, weights: Int4MoEWeights) -> Int4MoEWeights:
    w = check_int4_weights(weights)
    if w.group_size != self._group_size():
      raise ValueError(f"weights have group_size={w.group_size}, the experts were built for "
                       f"group_size={self._group_size()}")
    return w


class _MarlinBase(_WNA16ExpertsBase):

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return platform == "cuda"

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    if moe_config.in_dtype not in _KERNEL_DTYPES:
      return f"the kernel takes bfloat16/float16 activations, not {moe_config.in_dtype}"
    if moe_config.apply_router_weight_on_input:
      return "the kernel applies the router weights in GEMM2's epilogue, not on the input"
    h, i = moe_config.hidden_size, moe_config.intermediate_size
    if h % 64 or i % 64:
      return f"the kernel needs H and I multiples of 64, got H={h}, I={i}"
    g = weight_key.group_size
    if g != -1 and (h % g or i % g):
      return f"group_size={g} does not divide H={h} and I={i}"
    if moe_config.num_experts > 4096:
      return "the alignment kernel supports at most 4096 experts"
    try:
      available = wna16_gpu.wna16_gpu_available()
    except Exception:  # pylint: disable=broad-except
      available = False
    if not available:
      return ("no CUDA GPU of compute capability >= 9.0 with jax_moeq's CUDA library "
              "(libjax_moeq_cuda.so) is available")
    return None

  def prepare(self, weights: Int4MoEWeights) -> dict[str, Array]:
    """Canonical int4 -> the kernel's tiles (GPTQ uint4b8 through
    `convert_to_wna16_moe_kernel_format`), scales in the activation dtype; array fields only."""
    w = self._check_int4(weights)
    b13, b2 = w.w13_bias, w.w2_bias
    if (b13 is None) != (b2 is None):  # the kernel takes both biases or neither
      e, h, i = w.num_experts, w.hidden_size, w.intermediate_size
      b13 = jnp.zeros((e, 2 * i), jnp.float32) if b13 is None else b13
      b2 = jnp.zeros((e, h), jnp.float32) if b2 is None else b2
    packed = wna16_gpu.convert_to_wna16_moe_kernel_format(
        "MARLIN", int4.pack_uint4b8_gptq(jnp.asarray(w.w13_q)),
        int4.pack_uint4b8_gptq(jnp.asarray(w.w2_q)),
        jnp.swapaxes(jnp.asarray(w.w13_scale), -1, -2),
        jnp.swapaxes(jnp.asarray(w.w2_scale), -1, -2), group_size=w.group_size,
        w13_g_idx=w.w13_g_idx, w2_g_idx=w.w2_g_idx, w13_bias=b13, w2_bias=b2,
        dtype=self.moe_config.in_dtype)
    return {name: getattr(packed, name) for name in _MARLIN_ARRAYS}

  def kernel_weights(self, arrays: Mapping[str, Array]) -> wna16_gpu.Wna16MoeWeights:
    """The prepared arrays as `Wna16MoeWeights`; placeholders ([1]) mark absent parts."""
    require_arrays(type(self).__name__, arrays, _MARLIN_ARRAYS)
    h, i, g = self.moe_config.hidden_size, self.moe_config.intermediate_size, self._group_size()
    return wna16_gpu.Wna16MoeWeights(
        **{name: arrays[name] for name in _MARLIN_ARRAYS}, hidden_size=h, intermediate_size=i,
        group_size13=h if g == -1 else g, group_size2=i if g == -1 else g,
        has_zeros=arrays["w13_zeros"].ndim > 1, has_bias=arrays["w13_bias"].ndim > 1,
        act_order=arrays["w13_perm"].ndim > 1)


class MarlinExperts(_MarlinBase):
  """`fused_marlin_moe` on routed tokens; prepared arrays: the `Wna16MoeWeights` array fields."""

  backend_name = "marlin"

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    return wna16_gpu.fused_marlin_moe(hidden_states, self.kernel_weights(weights), topk_weights,
                                      topk_ids, activation_kind=self.activation.kernel_kind)


class BatchedMarlinExperts(_MarlinBase):
  """`apply_batched(x [E, M, H], expert_num_tokens [E], weights)` -> [E, M, H]."""

  backend_name = "batched_marlin"

  @staticmethod
  def activation_format() -> FusedMoEActivationFormat:
    return FusedMoEActivationFormat.BatchedExperts

  def apply_batched(self, hidden_states: Array, expert_num_tokens: Array,
                    weights: Mapping[str, Array]) -> Array:
    return wna16_gpu.batched_fused_marlin_moe(hidden_states, expert_num_tokens,
                                              self.kernel_weights(weights),
                                              activation_kind=self.activation.kernel_kind)

  def apply_routed(self, *args, **kwargs):
    raise NotImplementedError("BatchedMarlinExperts takes the batched format: use apply_batched")


class ReferenceExpertsWNA16(_WNA16ExpertsBase):
  """`reference.fused_moe_wna16` (jnp). Prepared arrays: {"w13_q", "w13_scale", "w2_q",
  "w2_scale"} (+ "w13_bias", "w2_bias", "w13_g_idx", "w2_g_idx"): the `Int4MoEWeights` fields,
  scales as given (fp16 or bf16)."""

  backend_name = "reference"

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    h, i, g = moe_config.hidden_size, moe_config.intermediate_size, weight_key.group_size
    if g != -1 and (h % g or i % g):
      return f"group_size={g} does not divide H={h} and I={i}"
    return None

  def prepare(self, weights: Int4MoEWeights) -> dict[str, Array]:
    w = self._check_int4(weights)
    arrays = {name: jnp.asarray(getattr(w, name)) for name in _REFERENCE_ARRAYS}
    for name in ("w13_bias", "w2_bias", "w13_g_idx", "w2_g_idx"):
      if getattr(w, name) is not None:
        arrays[name] = jnp.asarray(getattr(w, name))
    return arrays

  def canonical(self, arrays: Mapping[str, Array]) -> Int4MoEWeights:
    require_arrays(type(self).__name__, arrays, _REFERENCE_ARRAYS)
    return Int4MoEWeights(arrays["w13_q"], arrays["w13_scale"], arrays["w2_q"],
                          arrays["w2_scale"], self._group_size(), arrays.get("w13_bias"),
                          arrays.get("w2_bias"), arrays.get("w13_g_idx"),
                          arrays.get("w2_g_idx"))

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array,
                   weights: Mapping[str, Array]) -> Array:
    require_arrays(type(self).__name__, weights, _REFERENCE_ARRAYS)
    return reference.fused_moe_wna16(
        hidden_states, topk_ids, topk_weights, weights["w13_q"], weights["w13_scale"],
        weights["w2_q"], weights["w2_scale"], self._group_size(),
        w13_g_idx=weights.get("w13_g_idx"), w2_g_idx=weights.get("w2_g_idx"),
        w13_bias=weights.get("w13_bias"), w2_bias=weights.get("w2_bias"),
        activation_kind=self.activation.kernel_kind,
        apply_router_weight_on_input=self.apply_router_weight_on_input)
