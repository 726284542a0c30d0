"""Backend oracle of unquantized (float) experts.

Backends, in priority order: XLA (plain XLA ops on every platform: a per-pair gather, every expert
densely, or `lax.ragged_dot`, chosen from the shapes or by `float_impl`), then REFERENCE
(`reference.fused_moe_float`, float32 GEMMs, exact rounding points; only on request). See
`oracle.base` for the selection rules.
"""

from __future__ import annotations

import enum

from jax_moeq.experts import unquantized as experts
from jax_moeq.oracle import base
from jax_moeq.oracle.base import MoEConfig, QuantKey

SCHEME_NAME = "Unquantized"

__all__ = [
    "SCHEME_NAME", "UnquantizedMoeBackend", "backend_to_kernel_cls", "map_unquantized_backend",
    "select_unquantized_moe_backend",
]


class UnquantizedMoeBackend(enum.Enum):
  XLA = "XLA"
  REFERENCE = "REFERENCE"


def _get_priority_backends(config: MoEConfig) -> list[UnquantizedMoeBackend]:
  """Backends to try, fastest first: XLA runs on every platform."""
  del config
  return [UnquantizedMoeBackend.XLA, UnquantizedMoeBackend.REFERENCE]


def backend_to_kernel_cls(backend: UnquantizedMoeBackend) -> list[type]:
  """The experts classes implementing `backend`, in the order they are tried."""
  if backend == UnquantizedMoeBackend.XLA:
    return [experts.XlaFloatExperts]
  if backend == UnquantizedMoeBackend.REFERENCE:
    return [experts.ReferenceExpertsFloat]
  raise ValueError(f"Unknown {SCHEME_NAME} MoE backend: {backend!r}")


_BACKEND_NAMES = {
    "xla": UnquantizedMoeBackend.XLA,
    "reference": UnquantizedMoeBackend.REFERENCE,
    "jnp": UnquantizedMoeBackend.REFERENCE,
}


def map_unquantized_backend(moe_backend: str) -> UnquantizedMoeBackend:
  """An explicit `moe_backend` string -> UnquantizedMoeBackend."""
  return base.map_backend_name(SCHEME_NAME, moe_backend, _BACKEND_NAMES)


def select_unquantized_moe_backend(config: MoEConfig, weight_key: QuantKey | None = None,
                                   activation_key: QuantKey | None = None,
                                   ) -> tuple[UnquantizedMoeBackend, type]:
  """(backend, experts_cls) for `config` (explicit `config.moe_backend`, or "auto").

  Raises:
    ValueError: an explicit backend that is unknown or does not fit, with the reason.
    NotImplementedError: no backend fits (e.g. an activation nothing implements).
  """
  return base.select_backend(SCHEME_NAME, config, weight_key, activation_key,
                             _get_priority_backends(config), backend_to_kernel_cls,
                             map_unquantized_backend)
