"""Backend oracle of dense int4 linears (SPEC §6 applied to §12): attention projections, dense
MLPs, LM heads.

One enum per weight scheme, in priority order by platform:
- "w4a8_int8" (`W4A8LinearBackend`): CPU_W4A8 (the CPU op, platform cpu), then REFERENCE.
- "wna16" (`WNA16LinearBackend`): MARLIN (the Hopper op, platform cuda); on the CPU, CPU_W4A8
  (int8 activations per row: only with `allow_activation_quantization`, as the MoE dispatch
  runs weight-only experts); then REFERENCE.
REFERENCE (jnp, every platform) is chosen only when nothing faster fits, with a warning saying
why. The selection loop, its logs and its errors are `oracle.base.select_backend`'s:
"W4A8 Int8 linear backend CPU_W4A8 does not support the deployment configuration since ...".

    backend, cls = select_linear_backend("wna16", LinearConfig(4096, 1024, jnp.bfloat16),
                                         wna16_weight_key(128))
    kernel = cls(config, 128); arrays = kernel.prepare(weights); y = kernel.apply(x, arrays)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_moeq.linears.kernels import (
    CPUW4A8Linear, MarlinLinear, ReferenceW4A8Linear, ReferenceWNA16Linear)
from jax_moeq.oracle import base
from jax_moeq.oracle.base import AUTO, QuantKey

__all__ = ["LINEAR_SCHEMES", "LinearConfig", "W4A8LinearBackend", "WNA16LinearBackend",
           "backend_to_kernel_cls", "linear_weight_key", "map_w4a8_linear_backend",
           "map_wna16_linear_backend", "select_linear_backend"]

LINEAR_SCHEMES = ("w4a8_int8", "wna16")
SCHEME_NAMES = {"w4a8_int8": "W4A8 Int8", "wna16": "WNA16"}
KIND = "linear"


@dataclasses.dataclass(frozen=True)
class LinearConfig:
  """Static description of one int4 linear call, as the oracle sees it.

  Attributes:
    in_features, out_features: K and N of `W [N, K]`.
    in_dtype: dtype of x (and of the output).
    has_bias: a bias [N] is added.
    platform: "cpu", "cuda", ... ("gpu" is normalized); None: JAX's default backend, fixed when
      the config is built.
    backend: "auto", or a backend name the scheme's `map_*_linear_backend` knows.
    allow_activation_quantization: weight-only ("wna16") weights may run on a kernel that
      quantizes activations to int8 per row (the CPU W4A8 op). W4A8 weights always do.
  """
  in_features: int
  out_features: int
  in_dtype: Any = jnp.bfloat16
  has_bias: bool = False
  platform: str | None = None
  backend: str = AUTO
  allow_activation_quantization: bool = False

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    for name in ("in_features", "out_features"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
      set_(name, int(value))
    set_("in_dtype", jnp.dtype(self.in_dtype))
    if not jnp.issubdtype(self.in_dtype, jnp.floating):
      raise ValueError(f"in_dtype must be a float dtype, got {self.in_dtype}")
    set_("has_bias", bool(self.has_bias))
    set_("allow_activation_quantization", bool(self.allow_activation_quantization))
    set_("platform", base.current_platform() if self.platform is None
         else base.normalize_platform(self.platform))
    if not isinstance(self.backend, str):
      raise TypeError(f"backend must be a str, got {type(self.backend).__name__}")
    set_("backend", self.backend.strip().lower())

  @property
  def resolved_platform(self) -> str:
    return self.platform


class W4A8LinearBackend(enum.Enum):
  CPU_W4A8 = "CPU_W4A8"
  REFERENCE = "REFERENCE"


class WNA16LinearBackend(enum.Enum):
  MARLIN = "MARLIN"
  CPU_W4A8 = "CPU_W4A8"
  REFERENCE = "REFERENCE"


def _get_priority_backends(scheme: str, config: LinearConfig) -> list[enum.Enum]:
  """Backends to try, fastest first, for the scheme on the config's platform."""
  _check_scheme(scheme)
  if scheme == "w4a8_int8":
    if config.platform == "cpu":
      return [W4A8LinearBackend.CPU_W4A8, W4A8LinearBackend.REFERENCE]
    return [W4A8LinearBackend.REFERENCE]
  if config.platform == "cuda":
    return [WNA16LinearBackend.MARLIN, WNA16LinearBackend.REFERENCE]
  if config.platform == "cpu":
    # Rejected with its reason unless activation quantization is allowed.
    return [WNA16LinearBackend.CPU_W4A8, WNA16LinearBackend.REFERENCE]
  return [WNA16LinearBackend.REFERENCE]


def backend_to_kernel_cls(backend: enum.Enum) -> list[type]:
  """The linear classes implementing `backend`, in the order they are tried."""
  if backend in (W4A8LinearBackend.CPU_W4A8, WNA16LinearBackend.CPU_W4A8):
    return [CPUW4A8Linear]
  if backend == WNA16LinearBackend.MARLIN:
    return [MarlinLinear]
  if backend == W4A8LinearBackend.REFERENCE:
    return [ReferenceW4A8Linear]
  if backend == WNA16LinearBackend.REFERENCE:
    return [ReferenceWNA16Linear]
  raise ValueError(f"Unknown linear backend: {backend!r}")


_W4A8_NAMES = {
    "cpu": W4A8LinearBackend.CPU_W4A8,
    "cpu_w4a8": W4A8LinearBackend.CPU_W4A8,
    "cpu_int4": W4A8LinearBackend.CPU_W4A8,
    "reference": W4A8LinearBackend.REFERENCE,
    "jnp": W4A8LinearBackend.REFERENCE,
}
_WNA16_NAMES = {
    "marlin": WNA16LinearBackend.MARLIN,
    "gpu": WNA16LinearBackend.MARLIN,
    "cpu": WNA16LinearBackend.CPU_W4A8,
    "cpu_w4a8": WNA16LinearBackend.CPU_W4A8,
    "cpu_int4": WNA16LinearBackend.CPU_W4A8,
    "reference": WNA16LinearBackend.REFERENCE,
    "jnp": WNA16LinearBackend.REFERENCE,
}


def map_w4a8_linear_backend(backend: str) -> W4A8LinearBackend:
  """An explicit `backend` string -> W4A8LinearBackend (ValueError listing the choices)."""
  return base.map_backend_name(SCHEME_NAMES["w4a8_int8"], backend, _W4A8_NAMES, kind=KIND,
                               argument="backend")


def map_wna16_linear_backend(backend: str) -> WNA16LinearBackend:
  """An explicit `backend` string -> WNA16LinearBackend (ValueError listing the choices)."""
  return base.map_backend_name(SCHEME_NAMES["wna16"], backend, _WNA16_NAMES, kind=KIND,
                               argument="backend")


def linear_weight_key(scheme: str, group_size: int, has_zero_points: bool = False) -> QuantKey:
  """The weights' QuantKey: `w4a8_weight_key(g)` or `wna16_weight_key(g, zero points)`."""
  _check_scheme(scheme)
  if scheme == "w4a8_int8":
    if has_zero_points:
      raise ValueError("w4a8_int8 linear weights are symmetric: zero points are not supported")
    return base.w4a8_weight_key(group_size)
  return base.wna16_weight_key(group_size, has_zero_points)


def select_linear_backend(scheme: str, config: LinearConfig, weight_key: QuantKey | None
                          ) -> tuple[enum.Enum, type]:
  """(backend, linear_cls) for `config` (explicit `config.backend`, or "auto").

  Args:
    scheme: "w4a8_int8" (int4 weights, int8 activations per row) or "wna16" (weight-only).
    config: the deployment; `config.platform` decides the platform.
    weight_key: the weights' QuantKey (`linear_weight_key`).

  Raises:
    ValueError: an unknown scheme; an explicit backend that is unknown or does not fit (naming
      the backend and the reason).
    NotImplementedError: no backend fits.
  """
  _check_scheme(scheme)
  if not isinstance(config, LinearConfig):
    raise TypeError(f"config must be a LinearConfig, got {type(config).__name__}")
  if scheme == "w4a8_int8" and not config.allow_activation_quantization:
    # W4A8 weights are defined with int8 activations (SPEC §3).
    config = dataclasses.replace(config, allow_activation_quantization=True)
  mapper = map_w4a8_linear_backend if scheme == "w4a8_int8" else map_wna16_linear_backend
  return base.select_backend(SCHEME_NAMES[scheme], config, weight_key, None,
                             _get_priority_backends(scheme, config), backend_to_kernel_cls,
                             mapper, kind=KIND, requested_backend=config.backend)


def _check_scheme(scheme: str) -> None:
  if scheme not in LINEAR_SCHEMES:
    raise ValueError(f"scheme={scheme!r} is not one of {LINEAR_SCHEMES}")
