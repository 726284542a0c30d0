"""Backend oracle of the WNA16 scheme: int4 weights (GPTQ uint4b8 / AWQ uint4 + zeros), bf16 or
fp16 activations (SPEC §6, §7).

Backends, in priority order: MARLIN (our fused CUDA kernel, standard [T, H] format),
BATCHED_MARLIN (the same kernel on the batched [E, max_tokens, H] format), then REFERENCE (pure
jnp, every platform; chosen only when nothing faster fits, with a warning saying why). The
selection rules are `oracle.base.select_backend`'s.
"""

from __future__ import annotations

import enum

from jax_moeq.experts import marlin
from jax_moeq.ops import wna16_gpu
from jax_moeq.oracle import base
from jax_moeq.oracle.base import MoEConfig, MoEQuantConfig, QuantKey

SCHEME_NAME = "WNA16"

__all__ = [
    "SCHEME_NAME", "WNA16MoeBackend", "backend_to_kernel_cls",
    "convert_to_wna16_moe_kernel_format", "make_wna16_moe_quant_config", "map_wna16_backend",
    "select_wna16_moe_backend",
]


class WNA16MoeBackend(enum.Enum):
  MARLIN = "MARLIN"
  BATCHED_MARLIN = "BATCHED_MARLIN"
  REFERENCE = "REFERENCE"


def _get_priority_backends(config: MoEConfig) -> list[WNA16MoeBackend]:
  """Backends to try, fastest first, for the config's platform."""
  if config.resolved_platform == "cuda":
    return [WNA16MoeBackend.MARLIN, WNA16MoeBackend.BATCHED_MARLIN, WNA16MoeBackend.REFERENCE]
  return [WNA16MoeBackend.REFERENCE]


def backend_to_kernel_cls(backend: WNA16MoeBackend) -> list[type]:
  """The experts classes implementing `backend`, in the order they are tried."""
  if backend == WNA16MoeBackend.MARLIN:
    return [marlin.MarlinExperts]
  if backend == WNA16MoeBackend.BATCHED_MARLIN:
    return [marlin.BatchedMarlinExperts]
  if backend == WNA16MoeBackend.REFERENCE:
    return [marlin.ReferenceExpertsWNA16]
  raise ValueError(f"Unknown {SCHEME_NAME} MoE backend: {backend!r}")


_BACKEND_NAMES = {
    "marlin": WNA16MoeBackend.MARLIN,
    "batched_marlin": WNA16MoeBackend.BATCHED_MARLIN,
    "reference": WNA16MoeBackend.REFERENCE,
    "jnp": WNA16MoeBackend.REFERENCE,
}


def map_wna16_backend(moe_backend: str) -> WNA16MoeBackend:
  """An explicit `moe_backend` string -> WNA16MoeBackend."""
  return base.map_backend_name(SCHEME_NAME, moe_backend, _BACKEND_NAMES)


def select_wna16_moe_backend(config: MoEConfig, weight_key: QuantKey | None,
                             weight_bits: int = 4,
                             activation_key: QuantKey | None = None,
                             ) -> tuple[WNA16MoeBackend, type]:
  """(backend, experts_cls) for `config` (explicit `config.moe_backend`, or "auto").

  Args:
    config: the deployment; `config.platform` (or JAX's default backend) decides the platform.
    weight_key: one of `oracle.base.WNA16_WEIGHT_KEYS` (`wna16_weight_key(group, zp)`).
    weight_bits: 4 (8-bit WNA16 weights are not implemented).
    activation_key: None (activations stay bf16/fp16).

  Raises:
    ValueError: weight_bits other than 4; an explicit backend that is unknown or does not fit.
    NotImplementedError: no backend fits.
  """
  if weight_bits != 4:
    raise ValueError(f"weight_bits={weight_bits}: only 4-bit {SCHEME_NAME} weights are supported")
  return base.select_backend(SCHEME_NAME, config, weight_key, activation_key,
                             _get_priority_backends(config), backend_to_kernel_cls,
                             map_wna16_backend)


def convert_to_wna16_moe_kernel_format(backend, *args, **kwargs):
  """GPTQ tensors -> the backend's format (`ops.wna16_gpu.convert_to_wna16_moe_kernel_format`)."""
  return wna16_gpu.convert_to_wna16_moe_kernel_format(backend, *args, **kwargs)


def make_wna16_moe_quant_config(group_size: int, has_zero_points: bool = False
                                ) -> MoEQuantConfig:
  """Quant config of WNA16 experts: (1, g) blocks (channel-wise: (-1, 1)), weight-only."""
  block = (-1, 1) if group_size == -1 else (1, group_size)
  return MoEQuantConfig(4, block, None, base.wna16_weight_key(group_size, has_zero_points))
