"""WNA16 experts (int4 weights, bf16/fp16 activations; SPEC §7).

- `MarlinExperts` (backend MARLIN): `ops.wna16_gpu.fused_marlin_moe` on a CUDA GPU of compute
  capability >= 9.0 with our CUDA library, standard [T, H] format; weights a `Wna16MoeWeights`.
- `BatchedMarlinExperts` (backend BATCHED_MARLIN): `batched_fused_marlin_moe`, batched
  [E, max_tokens, H] format with per-expert counts.
- `ReferenceExpertsWNA16` (backend REFERENCE): `reference.fused_moe_wna16` on canonical
  [E, N, K] int4-as-int8 weights, every platform.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_moeq.experts.base import MoEExperts
from jax_moeq.oracle.base import (
    WNA16_WEIGHT_KEYS, FusedMoEActivationFormat, MoEActivation, QuantKey,
)

Array = jax.Array

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class _WNA16ExpertsBase(MoEExperts):

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey | None,
                             activation_key: QuantKey | None) -> bool:
    return weight_key in WNA16_WEIGHT_KEYS and activation_key is None


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
    from jax_moeq.ops import wna16_gpu
    try:
      available = wna16_gpu.wna16_gpu_available()
    except Exception:  # pylint: disable=broad-except
      available = False
    if not available:
      return ("no CUDA GPU of compute capability >= 9.0 with jax_moeq's CUDA library "
              "(libjax_moeq_cuda.so) is available")
    return None


class MarlinExperts(_MarlinBase):
  """`apply_routed(x [T, H], topk_ids, topk_weights, w1=weights: Wna16MoeWeights, w2=None)`."""

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array, w1: Any,
                   w2: Any = None, activation=None, *, apply_router_weight_on_input=None,
                   block_m: int | None = None) -> Array:
    from jax_moeq.ops import wna16_gpu
    act, on_input = self._resolve(activation, apply_router_weight_on_input)
    if on_input:
      raise ValueError("MarlinExperts applies router weights on the output only")
    return wna16_gpu.fused_marlin_moe(hidden_states, w1, topk_weights, topk_ids,
                                      activation_kind=act.kernel_kind, block_m=block_m)


class BatchedMarlinExperts(_MarlinBase):
  """`apply_batched(x [E, M, H], expert_num_tokens [E], weights)` -> [E, M, H]."""

  @staticmethod
  def activation_format() -> FusedMoEActivationFormat:
    return FusedMoEActivationFormat.BatchedExperts

  def apply_batched(self, hidden_states: Array, expert_num_tokens: Array, weights: Any,
                    activation=None) -> Array:
    from jax_moeq.ops import wna16_gpu
    act, _ = self._resolve(activation, False)
    return wna16_gpu.batched_fused_marlin_moe(hidden_states, expert_num_tokens, weights,
                                              activation_kind=act.kernel_kind)

  def apply_routed(self, *args, **kwargs):
    raise NotImplementedError("BatchedMarlinExperts takes the batched format: use apply_batched")


class ReferenceExpertsWNA16(_WNA16ExpertsBase):
  """`reference.fused_moe_wna16` (jnp): `apply_routed(x, topk_ids, topk_weights, w1=w13_q
  [E, 2I, H], w2=w2_q [E, H, I], w1_scale=[E, 2I, G], w2_scale=[E, H, G], w1_zeros=None,
  w2_zeros=None, w1_g_idx=None, w2_g_idx=None, w1_bias=None, w2_bias=None)`."""

  @classmethod
  def _unsupported_reason(cls, moe_config, weight_key, activation_key) -> str | None:
    h, i, g = moe_config.hidden_size, moe_config.intermediate_size, weight_key.group_size
    if g != -1 and (h % g or i % g):
      return f"group_size={g} does not divide H={h} and I={i}"
    return None

  def apply_routed(self, hidden_states: Array, topk_ids: Array, topk_weights: Array, w1: Any,
                   w2: Any, activation=None, *, apply_router_weight_on_input=None,
                   w1_scale: Array = None, w2_scale: Array = None, w1_zeros=None, w2_zeros=None,
                   w1_g_idx=None, w2_g_idx=None, w1_bias=None, w2_bias=None) -> Array:
    from jax_moeq import reference
    if w1_scale is None or w2_scale is None:
      raise ValueError("ReferenceExpertsWNA16 needs w1_scale and w2_scale")
    act, on_input = self._resolve(activation, apply_router_weight_on_input)
    group = self.quant_config.group_size if self.quant_config is not None else None
    if group is None:
      raise ValueError("ReferenceExpertsWNA16 needs a quant_config to know the group size")
    return reference.fused_moe_wna16(
        hidden_states, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, group,
        w13_zeros=w1_zeros, w2_zeros=w2_zeros, w13_g_idx=w1_g_idx, w2_g_idx=w2_g_idx,
        w13_bias=w1_bias, w2_bias=w2_bias, activation_kind=act.kernel_kind,
        apply_router_weight_on_input=on_input)
