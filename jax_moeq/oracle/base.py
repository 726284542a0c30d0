"""Shared machinery of the per-scheme MoE backend oracles (SPEC §6).

Each quantization scheme has its own oracle module (`w4a8_int8.py`, `wna16.py`, `mxint4.py`)
with the same shape as vLLM's:

- an enum of backends (`W4A8Int8MoeBackend`, ...), always ending with `REFERENCE` (the jnp
  reference of the scheme, which runs on every platform and is picked by "auto" only when
  nothing faster fits);
- `_get_priority_backends(config)`: the backends worth trying on `config.platform`, fastest
  first;
- `backend_to_kernel_cls(backend)`: the experts classes implementing a backend;
- `map_<scheme>_backend(moe_backend)`: a user's explicit `moe_backend` string -> enum member
  (`ValueError` listing the choices for an unknown string);
- `select_<scheme>_moe_backend(config, weight_key, activation_key)` -> `(backend, experts_cls)`,
  which is a thin call of `select_backend` below.

An experts class (see `jax_moeq.experts.base.MoEExperts`) answers
`is_supported_config(config, weight_key, activation_key, activation_format) -> (bool, reason)`;
`reason` is a short clause that reads after "since" ("the platform is cuda, not cpu").

Selection rules (`select_backend`):
- explicit `config.moe_backend` -> mapped to a backend -> its classes are asked in order; the
  first that fits is returned, else `ValueError("<Scheme> MoE backend X does not support the
  deployment configuration since <reason>.")`.
- "auto" -> backends in priority order; each rejection is logged at DEBUG with its reason; the
  first fit is returned and logged once at INFO. When the fit is the REFERENCE backend and a
  faster backend was tried, the INFO line says that the jnp reference is used and why the
  faster ones were rejected.
- nothing fits -> `NotImplementedError` naming every backend tried and its reason.

Keys and configs are frozen dataclasses (hashable), so a selection made at trace time from
static information can be cached.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq.routing import RoutingMethodType

logger = logging.getLogger("jax_moeq.oracle")

_logged: set[tuple[int, str]] = set()


def log_once(level: int, message: str) -> None:
  """Logs `message` at `level` the first time it is seen (selections repeat per trace)."""
  key = (level, message)
  if key in _logged:
    return
  _logged.add(key)
  logger.log(level, message)


# ------------------------------------------------------------------ platform
def current_platform() -> str:
  """The default JAX platform: "cpu", "cuda", "rocm" or "tpu" (JAX's "gpu" split by vendor)."""
  platform = jax.default_backend()
  if platform != "gpu":
    return platform
  version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
  return "rocm" if "rocm" in version else "cuda"


# ------------------------------------------------------------------ activations
class MoEActivation(enum.Enum):
  """Gated activations of the expert MLP (w13 rows: gate first, then up)."""

  SILU = "silu"  # vLLM's default: silu(gate) * up (kernel kind 2, same math as kind 0)
  SWIGLUOAI = "swigluoai"  # GPT-OSS: clamped gate/up, (u + 1) * g * sigmoid(1.702 g)
  SWIGLUSTEP = "swiglustep"  # silu(gate) * up (kernel kind 0)

  @property
  def is_act_and_mul(self) -> bool:
    """Gated (act(gate) * up): every activation here is."""
    return True

  @property
  def kernel_kind(self) -> int:
    """The `activation_kind` integer of the CPU op (SPEC §4)."""
    return _KERNEL_KINDS[self]

  @classmethod
  def from_str(cls, activation: "str | MoEActivation") -> "MoEActivation":
    if isinstance(activation, MoEActivation):
      return activation
    if not isinstance(activation, str):
      raise TypeError(f"activation must be a string or MoEActivation, got {type(activation)}")
    try:
      return cls(activation.lower())
    except ValueError:
      raise ValueError(f"activation={activation!r} is not one of "
                       f"{[a.value for a in cls]}") from None


_KERNEL_KINDS = {MoEActivation.SWIGLUSTEP: 0, MoEActivation.SWIGLUOAI: 1, MoEActivation.SILU: 2}


class FusedMoEActivationFormat(enum.Enum):
  """How tokens reach the experts: `Standard` [T, H], or `BatchedExperts` [E, max_tokens, H]."""

  Standard = "standard"
  BatchedExperts = "batched_experts"


# ------------------------------------------------------------------ quantization keys
@dataclasses.dataclass(frozen=True)
class QuantKey:
  """What a quantized tensor holds; weights and activations each get one (None: unquantized).

  Attributes:
    dtype: stored element type: "int4" (signed, held as int8 / nibbles), "uint4b8" (GPTQ /
      compressed-tensors int32 words, q + 8), "uint4" (AWQ, with zero points), "mxint4"
      (signed int4 with per-32 bf16 block scales), "int8".
    group_size: elements per scale along the input: 32/64/128, or -1 for one scale per row
      (channel-wise weights; per-token activations).
    static: scales fixed offline (weights) rather than computed per call (activations).
    symmetric: no zero point.
    scale_dtype: "bfloat16", "float32", or None for "the activation dtype" (fp16/bf16).
    has_zero_points: asymmetric weights with stored zero points (AWQ).
  """

  dtype: str
  group_size: int
  static: bool = True
  symmetric: bool = True
  scale_dtype: str | None = None
  has_zero_points: bool = False

  def __str__(self) -> str:
    group = "channel" if self.group_size == -1 else f"group{self.group_size}"
    kind = "static" if self.static else "dynamic"
    sym = "sym" if self.symmetric else ("zp" if self.has_zero_points else "asym")
    return f"{self.dtype}-{kind}-{group}-{sym}" + (f"-{self.scale_dtype}" if self.scale_dtype else "")


def _w4a8_key(group_size: int) -> QuantKey:
  return QuantKey("int4", group_size, scale_dtype="float32" if group_size == -1 else "bfloat16")


# W4A8 weights (SPEC §2): signed int4, symmetric, bf16 group scales or f32 channel scales.
kInt4W4A8StaticGroup32Sym = _w4a8_key(32)
kInt4W4A8StaticGroup64Sym = _w4a8_key(64)
kInt4W4A8StaticGroup128Sym = _w4a8_key(128)
kInt4W4A8StaticChannelSym = _w4a8_key(-1)
# vLLM also names the channel-wise key "StaticGroupSym" (one group spanning the input).
kInt4W4A8StaticGroupSym = kInt4W4A8StaticChannelSym
W4A8_WEIGHT_KEYS = (kInt4W4A8StaticGroup32Sym, kInt4W4A8StaticGroup64Sym,
                    kInt4W4A8StaticGroup128Sym, kInt4W4A8StaticChannelSym)

# The W4A8 kernel's activations: int8, dynamic per token, asymmetric (SPEC §3).
kInt8DynamicTokenAsym = QuantKey("int8", -1, static=False, symmetric=False, scale_dtype="float32")


def _wna16_key(group_size: int, has_zero_points: bool) -> QuantKey:
  if has_zero_points:
    return QuantKey("uint4", group_size, symmetric=False, has_zero_points=True)
  return QuantKey("uint4b8", group_size)


# WNA16 weights (SPEC §7): GPTQ uint4b8 symmetric, or AWQ uint4 with zero points; scales in the
# activation dtype (fp16/bf16).
kUint4b8StaticGroup32Sym = _wna16_key(32, False)
kUint4b8StaticGroup64Sym = _wna16_key(64, False)
kUint4b8StaticGroup128Sym = _wna16_key(128, False)
kUint4b8StaticChannelSym = _wna16_key(-1, False)
kUint4StaticGroup32Zp = _wna16_key(32, True)
kUint4StaticGroup64Zp = _wna16_key(64, True)
kUint4StaticGroup128Zp = _wna16_key(128, True)
kUint4StaticChannelZp = _wna16_key(-1, True)
WNA16_WEIGHT_KEYS = (kUint4b8StaticGroup32Sym, kUint4b8StaticGroup64Sym,
                     kUint4b8StaticGroup128Sym, kUint4b8StaticChannelSym, kUint4StaticGroup32Zp,
                     kUint4StaticGroup64Zp, kUint4StaticGroup128Zp, kUint4StaticChannelZp)

# MxInt4 weights (SPEC §8): signed int4, bf16 scale per 32 inputs.
kMxInt4StaticGroup32 = QuantKey("mxint4", 32, scale_dtype="bfloat16")
MXINT4_WEIGHT_KEYS = (kMxInt4StaticGroup32,)


def w4a8_weight_key(group_size: int) -> QuantKey:
  """The W4A8 weight key of `group_size` (32, 64, 128 or -1)."""
  if group_size not in (32, 64, 128, -1):
    raise ValueError(f"group_size={group_size} is not one of (32, 64, 128, -1)")
  return _w4a8_key(group_size)


def wna16_weight_key(group_size: int, has_zero_points: bool = False) -> QuantKey:
  """The WNA16 weight key of `group_size` (32, 64, 128 or -1), GPTQ or AWQ (zero points)."""
  if group_size not in (32, 64, 128, -1):
    raise ValueError(f"group_size={group_size} is not one of (32, 64, 128, -1)")
  return _wna16_key(group_size, has_zero_points)


# ------------------------------------------------------------------ quant config
@dataclasses.dataclass(frozen=True)
class MoEQuantConfig:
  """How the experts' operands are quantized (built by each oracle's `make_*_quant_config`).

  Attributes:
    weight_bits: bits per weight (4).
    block_shape: weight quantization block (rows, cols): (1, g) group-wise, (-1, 1) or None
      channel-wise.
    activation_quant: how GEMM inputs are quantized: None (unquantized, e.g. WNA16) or
      "int8_dynamic_token" (W4A8: per-token int8 computed inside the kernel).
    weight_key: the weights' QuantKey, when known.
  """

  weight_bits: int = 4
  block_shape: tuple[int, int] | None = None
  activation_quant: str | None = None
  weight_key: QuantKey | None = None

  def __post_init__(self):
    if self.block_shape is not None:
      shape = tuple(int(v) for v in self.block_shape)
      if len(shape) != 2 or not (shape == (-1, 1) or (shape[0] == 1 and shape[1] > 0)):
        raise ValueError(f"block_shape={self.block_shape} must be (1, group_size) or (-1, 1)")
      object.__setattr__(self, "block_shape", shape)

  @property
  def group_size(self) -> int:
    """The kernels' group size: -1 for channel-wise (block (-1, 1) or None), else block[1]."""
    if self.block_shape is None or self.block_shape == (-1, 1):
      return -1
    return self.block_shape[1]


# ------------------------------------------------------------------ MoE config
@dataclasses.dataclass(frozen=True)
class MoEParallelConfig:
  """Parallelism seen by one MoE op. The ops here run one shard: tp_size and ep_size say how
  the layer was split (jax_moeq.sharding does the splitting around the op)."""

  tp_size: int = 1
  ep_size: int = 1
  ep_rank: int = 0
  use_batched_activation_format: bool = False

  def __post_init__(self):
    for name in ("tp_size", "ep_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if not 0 <= self.ep_rank < self.ep_size:
      raise ValueError(f"ep_rank={self.ep_rank} must be in [0, ep_size={self.ep_size})")

  @property
  def activation_format(self) -> FusedMoEActivationFormat:
    return (FusedMoEActivationFormat.BatchedExperts if self.use_batched_activation_format
            else FusedMoEActivationFormat.Standard)


def _dtype_or_none(dtype) -> np.dtype | None:
  return None if dtype is None else jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Static description of one MoE layer call, as the oracles see it.

  Attributes:
    num_experts: experts held by this op (E of the weights).
    top_k: experts per token.
    hidden_size, intermediate_size: H and I (per partition).
    activation: MoEActivation (strings are converted).
    apply_router_weight_on_input: router weight scales the GEMM1 input instead of the output.
    routing_method: RoutingMethodType describing the routing the experts must perform.
    router_logits_dtype: dtype of the router logits (None: not known / not used).
    has_bias: w13/w2 biases present.
    in_dtype: activation (x) dtype.
    moe_parallel_config: MoEParallelConfig.
    has_expert_map: a global -> local expert map is needed (EP inside the op).
    platform: "cpu", "cuda", ...; None means `current_platform()` at construction.
    moe_backend: "auto" or an explicit backend name (mapped by the scheme's oracle).
  """

  num_experts: int
  top_k: int
  hidden_size: int
  intermediate_size: int
  activation: MoEActivation = MoEActivation.SILU
  apply_router_weight_on_input: bool = False
  routing_method: RoutingMethodType = RoutingMethodType.Default
  router_logits_dtype: Any = jnp.float32
  has_bias: bool = False
  in_dtype: Any = jnp.bfloat16
  moe_parallel_config: MoEParallelConfig = MoEParallelConfig()
  has_expert_map: bool = False
  platform: str | None = None
  moe_backend: str = "auto"

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
      set_(name, int(getattr(self, name)))
    if self.top_k > self.num_experts:
      raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
    set_("activation", MoEActivation.from_str(self.activation))
    try:
      set_("routing_method", RoutingMethodType(int(self.routing_method)))
    except ValueError:
      raise ValueError(f"routing_method={self.routing_method!r} is not a RoutingMethodType") from None
    set_("router_logits_dtype", _dtype_or_none(self.router_logits_dtype))
    set_("in_dtype", jnp.dtype(self.in_dtype))
    set_("apply_router_weight_on_input", bool(self.apply_router_weight_on_input))
    set_("has_bias", bool(self.has_bias))
    set_("has_expert_map", bool(self.has_expert_map))
    if self.platform is None:
      set_("platform", current_platform())
    if not isinstance(self.moe_backend, str):
      raise TypeError(f"moe_backend must be a string, got {type(self.moe_backend)}")
    set_("moe_backend", self.moe_backend.lower())

  @property
  def activation_format(self) -> FusedMoEActivationFormat:
    return self.moe_parallel_config.activation_format

  @property
  def parallel_config(self) -> MoEParallelConfig:
    return self.moe_parallel_config

  @property
  def resolved_platform(self) -> str:
    """The platform the config describes (fixed at construction)."""
    return self.platform

  # vLLM's names.
  @property
  def experts_per_token(self) -> int:
    return self.top_k

  @property
  def hidden_dim(self) -> int:
    return self.hidden_size

  @property
  def intermediate_size_per_partition(self) -> int:
    return self.intermediate_size


# ------------------------------------------------------------------ selection
def unsupported_message(scheme: str, backend: enum.Enum, reason: str | None) -> str:
  """vLLM's wording for a backend that does not fit."""
  if reason:
    return (f"{scheme} MoE backend {backend.value} does not support the deployment "
            f"configuration since {reason}.")
  return f"{scheme} MoE backend '{backend.value}' does not support the deployment configuration."


def _first_fit(classes: Sequence[type], config: MoEConfig, weight_key, activation_key
               ) -> tuple[type | None, str | None]:
  reason = None
  for cls in classes:
    supported, reason = cls.is_supported_config(config, weight_key, activation_key,
                                                config.activation_format)
    if supported:
      return cls, None
  return None, reason


def select_backend(
    scheme: str,
    config: MoEConfig,
    weight_key: QuantKey | None,
    activation_key: QuantKey | None,
    priority_backends: Sequence[enum.Enum],
    backend_to_kernel_cls: Callable[[enum.Enum], Sequence[type]],
    map_backend: Callable[[str], enum.Enum],
    reference_backend: enum.Enum | None = None,
) -> tuple[enum.Enum, type]:
  """The generic oracle loop (module docstring): returns `(backend, experts_cls)`.

  Args:
    scheme: the scheme's display name in messages ("W4A8 Int8", "WNA16", "MxInt4").
    config: the layer's MoEConfig (`config.moe_backend` "auto" or explicit).
    weight_key, activation_key: the QuantKeys passed to `is_supported_config`.
    priority_backends: backends to try for "auto", fastest first (the reference last).
    backend_to_kernel_cls: backend -> experts classes, tried in order.
    map_backend: explicit `moe_backend` string -> backend (raises ValueError if unknown).
    reference_backend: the scheme's jnp backend (default: the member named "REFERENCE"):
      choosing it under "auto" after a faster backend was rejected is logged at INFO with the
      reasons.
  """
  if reference_backend is None:
    reference_backend = next((b for b in priority_backends if b.name == "REFERENCE"), None)
  if config.moe_backend != "auto":
    backend = map_backend(config.moe_backend)
    cls, reason = _first_fit(backend_to_kernel_cls(backend), config, weight_key, activation_key)
    if cls is None:
      raise ValueError(unsupported_message(scheme, backend, reason))
    log_once(logging.INFO, f"Using {backend.value} {scheme} MoE backend "
             f"(moe_backend={config.moe_backend!r} was requested).")
    return backend, cls

  rejected: list[tuple[enum.Enum, str | None]] = []
  for backend in priority_backends:
    cls, reason = _first_fit(backend_to_kernel_cls(backend), config, weight_key, activation_key)
    if cls is None:
      rejected.append((backend, reason))
      log_once(logging.DEBUG, unsupported_message(scheme, backend, reason))
      continue
    names = [b.value for b in priority_backends]
    if backend == reference_backend:
      why = ("; ".join(f"{b.value}: {r or 'not supported'}" for b, r in rejected) if rejected
             else f"none exists for platform {config.platform!r}")
      log_once(logging.INFO, f"Using the {backend.value} (jnp) {scheme} MoE backend: no faster "
               f"backend fits the deployment configuration ({why}).")
    else:
      log_once(logging.INFO, f"Using {backend.value} {scheme} MoE backend out of potential "
               f"backends: {names}.")
    return backend, cls
  detail = "; ".join(f"{b.value}: {r or 'not supported'}" for b, r in rejected)
  raise NotImplementedError(
      f"No {scheme} MoE backend supports the deployment configuration"
      + (f" ({detail})." if detail else f" on platform {config.platform!r}."))


def map_backend_name(scheme: str, moe_backend: str, mapping: dict[str, enum.Enum]) -> enum.Enum:
  """Helper for `map_<scheme>_backend`: case-insensitive lookup with vLLM's error wording."""
  backend = mapping.get(str(moe_backend).lower())
  if backend is not None:
    return backend
  raise ValueError(f"moe_backend={moe_backend!r} is not supported for {scheme} MoE. "
                   f"Expected one of {sorted(mapping)}.")
