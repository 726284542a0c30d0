"""Backend oracle of the MxInt4 scheme: signed int4 weights, bf16 scales per 32, routing inside.

Backends, in priority order: HOPPER_MXINT4 (our fused CUDA kernel, platform cuda, compute
capability >= 9.0; the seed's FlashInfer/TRT-LLM kernel needs Blackwell), then REFERENCE (pure
jnp, every platform; chosen only when nothing faster fits, with a warning saying why). See
`oracle.base` for the selection rules.
"""

from __future__ import annotations

import enum

from jax_moeq.experts import mxint4 as experts
from jax_moeq.ops import mxint4_gpu
from jax_moeq.oracle import base
from jax_moeq.oracle.base import MoEConfig, MoEQuantConfig, QuantKey

SCHEME_NAME = "MxInt4"

__all__ = [
    "SCHEME_NAME", "MxInt4MoeBackend", "backend_to_kernel_cls", "convert_to_mxint4_moe_kernel_format",
    "make_mxint4_moe_quant_config", "map_mxint4_backend", "select_mxint4_moe_backend",
]


class MxInt4MoeBackend(enum.Enum):
  HOPPER_MXINT4 = "HOPPER_MXINT4"
  REFERENCE = "REFERENCE"


def _get_priority_backends(config: MoEConfig) -> list[MxInt4MoeBackend]:
  """Backends to try, fastest first, for the config's platform."""
  if config.resolved_platform == "cuda":
    return [MxInt4MoeBackend.HOPPER_MXINT4, MxInt4MoeBackend.REFERENCE]
  return [MxInt4MoeBackend.REFERENCE]


def backend_to_kernel_cls(backend: MxInt4MoeBackend) -> list[type]:
  """The experts classes implementing `backend`, in the order they are tried."""
  if backend == MxInt4MoeBackend.HOPPER_MXINT4:
    return [experts.HopperMxInt4Experts]
  if backend == MxInt4MoeBackend.REFERENCE:
    return [experts.ReferenceExpertsMxInt4]
  raise ValueError(f"Unknown {SCHEME_NAME} MoE backend: {backend!r}")


_BACKEND_NAMES = {
    "hopper_mxint4": MxInt4MoeBackend.HOPPER_MXINT4,
    "hopper": MxInt4MoeBackend.HOPPER_MXINT4,
    "mxint4_gpu": MxInt4MoeBackend.HOPPER_MXINT4,
    "cuda": MxInt4MoeBackend.HOPPER_MXINT4,
    "reference": MxInt4MoeBackend.REFERENCE,
    "jnp": MxInt4MoeBackend.REFERENCE,
}


def map_mxint4_backend(moe_backend: str) -> MxInt4MoeBackend:
  """An explicit `moe_backend` string -> MxInt4MoeBackend."""
  return base.map_backend_name(SCHEME_NAME, moe_backend, _BACKEND_NAMES)


def select_mxint4_moe_backend(config: MoEConfig,
                              weight_key: QuantKey | None = base.kMxInt4StaticGroup32,
                              activation_key: QuantKey | None = None,
                              ) -> tuple[MxInt4MoeBackend, type]:
  """(backend, experts_cls) for `config` (explicit `config.moe_backend`, or "auto").

  Args:
    config: the deployment; `config.platform` (or JAX's default backend) decides the platform.
    weight_key: `oracle.base.kMxInt4StaticGroup32`.
    activation_key: None (bf16 activations).

  Raises:
    ValueError: an explicit backend that is unknown or does not fit, with the reason.
    NotImplementedError: no backend fits (e.g. an activation nothing implements).
  """
  return base.select_backend(SCHEME_NAME, config, weight_key, activation_key,
                             _get_priority_backends(config), backend_to_kernel_cls,
                             map_mxint4_backend)


def convert_to_mxint4_moe_kernel_format(backend: MxInt4MoeBackend | str, gemm1_weights,
                                        gemm1_scales, gemm2_weights, gemm2_scales):
  """Checkpoint MxInt4 tensors (seed shapes, uint8 signed nibbles or uint4b8 int32) -> the
  backend's weights: HOPPER_MXINT4 the prepared dict of `prepare_static_weights_for_mxint4_moe`;
  REFERENCE the dict {w13_q, w13_scale, w2_q, w2_scale} of canonical int4-as-int8 weights."""
  if isinstance(backend, str):
    backend = map_mxint4_backend(backend)
  prepared = mxint4_gpu.prepare_static_weights_for_mxint4_moe(gemm1_weights, gemm1_scales,
                                                             gemm2_weights, gemm2_scales)
  if backend == MxInt4MoeBackend.HOPPER_MXINT4:
    return prepared
  w13_q, w13_scale, w2_q, w2_scale = mxint4_gpu.unpack_mxint4_moe_weights(prepared)
  return dict(w13_q=w13_q, w13_scale=w13_scale, w2_q=w2_q, w2_scale=w2_scale)


def make_mxint4_moe_quant_config() -> MoEQuantConfig:
  """Quant config of MxInt4 experts: (1, 32) blocks, bf16 activations."""
  return MoEQuantConfig(4, (1, 32), None, base.kMxInt4StaticGroup32)
