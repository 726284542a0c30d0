"""Backend oracle of the W4A8 Int8 scheme: int4 weights, dynamic per-token int8 activations.

Backends, in priority order: CPU_INT4 (the fused CPU kernel, platform cpu) or
CUDA_W4A8 (the fused Hopper kernel on int8 tensor cores, platform cuda, compute
capability 9.0 only), then REFERENCE (pure jnp, every platform; chosen only when
no kernel fits, with a warning saying why). See `oracle.base` for the selection
rules.
"""

from __future__ import annotations

import enum

from jax_moeq.experts.cpu_int4 import CPUExpertsInt4
from jax_moeq.experts.reference import ReferenceExpertsW4A8
from jax_moeq.experts.w4a8_gpu import W4A8GpuExperts
from jax_moeq.oracle import base
from jax_moeq.oracle.base import MoEConfig, MoEQuantConfig, QuantKey
from jax_moeq.ops.w4a8_cpu import convert_to_w4a8_int8_moe_format

SCHEME_NAME = "W4A8 Int8"

__all__ = [
    "SCHEME_NAME", "W4A8Int8MoeBackend", "backend_to_kernel_cls", "convert_to_w4a8_int8_moe_format",
    "make_w4a8_int8_moe_quant_config", "map_w4a8_int8_backend", "select_w4a8_int8_moe_backend",
]


class W4A8Int8MoeBackend(enum.Enum):
  CPU_INT4 = "CPU_INT4"
  CUDA_W4A8 = "CUDA_W4A8"
  REFERENCE = "REFERENCE"


def _get_priority_backends(config: MoEConfig) -> list[W4A8Int8MoeBackend]:
  """Backends to try, fastest first, for the config's platform."""
  if config.resolved_platform == "cpu":
    return [W4A8Int8MoeBackend.CPU_INT4, W4A8Int8MoeBackend.REFERENCE]
  if config.resolved_platform == "cuda":
    return [W4A8Int8MoeBackend.CUDA_W4A8, W4A8Int8MoeBackend.REFERENCE]
  return [W4A8Int8MoeBackend.REFERENCE]


def backend_to_kernel_cls(backend: W4A8Int8MoeBackend) -> list[type]:
  """The experts classes implementing `backend`, in the order they are tried."""
  if backend == W4A8Int8MoeBackend.CPU_INT4:
    return [CPUExpertsInt4]
  if backend == W4A8Int8MoeBackend.CUDA_W4A8:
    return [W4A8GpuExperts]
  if backend == W4A8Int8MoeBackend.REFERENCE:
    return [ReferenceExpertsW4A8]
  raise ValueError(f"Unknown {SCHEME_NAME} MoE backend: {backend!r}")


_BACKEND_NAMES = {
    "cpu": W4A8Int8MoeBackend.CPU_INT4,
    "cpu_int4": W4A8Int8MoeBackend.CPU_INT4,
    "cuda": W4A8Int8MoeBackend.CUDA_W4A8,
    "cuda_w4a8": W4A8Int8MoeBackend.CUDA_W4A8,
    "gpu": W4A8Int8MoeBackend.CUDA_W4A8,
    "reference": W4A8Int8MoeBackend.REFERENCE,
    "jnp": W4A8Int8MoeBackend.REFERENCE,
}


def map_w4a8_int8_backend(moe_backend: str) -> W4A8Int8MoeBackend:
  """An explicit `moe_backend` string -> W4A8Int8MoeBackend."""
  return base.map_backend_name(SCHEME_NAME, moe_backend, _BACKEND_NAMES)


def select_w4a8_int8_moe_backend(config: MoEConfig, weight_key: QuantKey | None,
                                 activation_key: QuantKey | None = None,
                                 ) -> tuple[W4A8Int8MoeBackend, type]:
  """(backend, experts_cls) for `config` (explicit `config.moe_backend`, or "auto").

  Args:
    config: the deployment; `config.platform` (or JAX's default backend)
      decides the platform.
    weight_key: one of `oracle.base.W4A8_WEIGHT_KEYS` (by group size).
    activation_key: None (activations are quantized inside the kernel).

  Raises:
    ValueError: an explicit backend that is unknown or does not fit, with the reason.
    NotImplementedError: no backend fits (e.g. an activation nothing implements).
  """
  return base.select_backend(SCHEME_NAME, config, weight_key, activation_key,
                             _get_priority_backends(config), backend_to_kernel_cls,
                             map_w4a8_int8_backend)


def make_w4a8_int8_moe_quant_config(block_shape: tuple[int, int] | None = None
                                    ) -> MoEQuantConfig:
  """Quant config of W4A8 experts: (1, group_size) group-wise, (-1, 1) or None channel-wise."""
  config = MoEQuantConfig(weight_bits=4, block_shape=block_shape,
                          activation_quant="int8_dynamic_token")
  return MoEQuantConfig(4, config.block_shape, config.activation_quant,
                        base.w4a8_weight_key(config.group_size))
