"""What every per-scheme MoE oracle shares (SPEC §6).

An oracle picks, for one quantization scheme, the experts implementation (the
"backend") that runs a MoE layer, from static facts only: shapes, dtypes, the
activation, the routing method, the parallel layout and the platform the
computation runs on. Each scheme's oracle module (`w4a8_int8.py`, `wna16.py`,
`mxint4.py`) has vLLM's shape:

- an enum of backends (`W4A8Int8MoeBackend`, ...) ending with a `REFERENCE`
  member: the jnp reference of the scheme, which runs on every platform;
- `_get_priority_backends(config)`: the backends worth trying on the config's
  platform, fastest first, REFERENCE last;
- `backend_to_kernel_cls(backend)`: the experts classes implementing a backend;
- `map_<scheme>_backend(moe_backend)`: a user's explicit `moe_backend` string
  -> enum member (`map_backend_name` below gives the ValueError listing the
  choices);
- `select_<scheme>_moe_backend(config, weight_key, activation_key)` ->
  `(backend, experts_cls)`: a thin call of `select_backend` below.

An experts class (`jax_moeq.experts.base.MoEExperts`) answers
`is_supported_config(config, weight_key, activation_key, activation_format)`
with `(supported, reason)`; `reason` is a clause that reads after "since"
("the kernel does not run on platform 'cuda'").

Selection rules (`select_backend`):
- explicit `config.moe_backend`: mapped to a backend, whose classes are asked
  in order; the first that fits is returned, else `ValueError("<Scheme> MoE
  backend X does not support the deployment configuration since <reason>.")`.
- "auto": backends in priority order; each rejection is logged once at DEBUG
  with its reason; the first fit is logged once at INFO. When the fit is the
  REFERENCE backend, a WARNING says that the (slow) jnp reference is used and
  why every faster backend was rejected (or that the platform has none).
- nothing fits: `NotImplementedError` naming every backend tried and its reason.

Keys and configs are frozen dataclasses (hashable), so a selection made at
trace time from static information can be cached.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq import routing as routing_lib
from jax_moeq.routing import RoutingMethodType

logger = logging.getLogger("jax_moeq.oracle")

AUTO = "auto"
REFERENCE_BACKEND_NAME = "REFERENCE"  # the jnp fallback member of every backend enum


# ------------------------------------------------------------------ logging
_LOGGED: set[tuple[int, str]] = set()


def log_once(level: int, message: str) -> None:
  """Logs `message` at `level` the first time it is seen (selections repeat on every trace)."""
  key = (level, message)
  if key in _LOGGED:
    return
  _LOGGED.add(key)
  logger.log(level, message)


# ------------------------------------------------------------------ platform
_PLATFORMS = ("cpu", "cuda", "rocm", "tpu", "metal")


def normalize_platform(platform: str) -> str:
  """"cpu" | "cuda" | "rocm" | "tpu"; JAX's "gpu" is split by the GPU client's vendor."""
  p = str(platform).strip().lower()
  if p == "gpu":
    try:
      version = str(jax.devices("gpu")[0].client.platform_version).lower()
    except Exception:  # no GPU client in this process: "gpu" was given by hand
      version = ""
    return "rocm" if "rocm" in version else "cuda"
  if p not in _PLATFORMS:
    raise ValueError(f"platform={platform!r} is not one of {('gpu',) + _PLATFORMS}")
  return p


def detect_platform(*arrays: Any) -> str:
  """The platform a computation on `arrays` runs on.

  Concrete arrays say where they live (the first one that does wins); tracers
  (inside jit) and plain values do not, so JAX's default backend decides, as
  it does for jit.
  """
  for a in arrays:
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      try:
        devices = a.devices()
      except Exception:  # deleted or abstract arrays say nothing
        continue
      if devices:
        return normalize_platform(next(iter(devices)).platform)
  return normalize_platform(jax.default_backend())


def current_platform() -> str:
  """JAX's default platform, normalized ("cpu", "cuda", "rocm", "tpu")."""
  return detect_platform()


# ------------------------------------------------------------------ activations
class MoEActivation(enum.Enum):
  """The expert MLP's activation (vLLM's names). w13 rows: gate first, then up.

  The CPU W4A8 kernel runs SILU, SWIGLUOAI and SWIGLUSTEP. GELU (gated) and
  the non-gated RELU2_NO_MUL exist so that configurations using them are
  rejected with a reason rather than misread.
  """
  SILU = "silu"  # silu(gate) * up; vLLM maps it to silu-and-mul (kernel kind 2, == kind 0)
  SWIGLUOAI = "swigluoai"  # GPT-OSS: g'=min(g,7), u'=clip(u,-7,7), (u'+1)*g'*sigmoid(1.702 g')
  SWIGLUSTEP = "swiglustep"  # silu(gate) * up (kernel kind 0)
  GELU = "gelu"  # gelu(gate) * up: no kernel here
  RELU2_NO_MUL = "relu2_no_mul"  # relu(x)^2 of one GEMM1 output, not gated: no kernel here

  @property
  def is_act_and_mul(self) -> bool:
    """Whether GEMM1 produces gate and up halves that the activation multiplies."""
    return self is not MoEActivation.RELU2_NO_MUL

  @property
  def kernel_kind(self) -> int:
    """The `activation_kind` integer of the fused ops (SPEC §4): 0, 1 or 2."""
    if self not in _KERNEL_KINDS:
      raise ValueError(f"activation {self.name} has no kernel activation kind; supported: "
                       f"{[a.name for a in _KERNEL_KINDS]}")
    return _KERNEL_KINDS[self]

  @classmethod
  def from_str(cls, activation: str | MoEActivation) -> MoEActivation:
    """"silu" | "swiglu" | "swiglustep" | "swigluoai" | "swiglu_oai" | "gelu" | ... -> member."""
    if isinstance(activation, MoEActivation):
      return activation
    if not isinstance(activation, str):
      raise TypeError(f"activation must be a str or MoEActivation, got "
                      f"{type(activation).__name__}")
    key = activation.strip().lower().replace("-", "_")
    if key not in _ACTIVATION_ALIASES:
      raise ValueError(f"activation={activation!r} is not one of {sorted(_ACTIVATION_ALIASES)}")
    return _ACTIVATION_ALIASES[key]


_KERNEL_KINDS = {MoEActivation.SWIGLUSTEP: 0, MoEActivation.SWIGLUOAI: 1, MoEActivation.SILU: 2}
_ACTIVATION_ALIASES = {
    "silu": MoEActivation.SILU,
    "swiglu": MoEActivation.SWIGLUSTEP,
    "swiglustep": MoEActivation.SWIGLUSTEP,
    "swiglu_step": MoEActivation.SWIGLUSTEP,
    "swigluoai": MoEActivation.SWIGLUOAI,
    "swiglu_oai": MoEActivation.SWIGLUOAI,
    "gelu": MoEActivation.GELU,
    "relu2": MoEActivation.RELU2_NO_MUL,
    "relu2_no_mul": MoEActivation.RELU2_NO_MUL,
}


class FusedMoEActivationFormat(enum.Enum):
  """How tokens reach the experts: `Standard` [T, H], or `BatchedExperts` [E, max_tokens, H]."""
  Standard = "standard"
  BatchedExperts = "batched_experts"


# ------------------------------------------------------------------ quantization keys
@dataclasses.dataclass(frozen=True)
class QuantKey:
  """What a quantized tensor holds, as the oracles compare it.

  Attributes:
    name: display name (log and error messages).
    weight_bits: bits per stored value (4 for weights, 8 for int8 activations).
    group_size: input elements per scale: 32, 64, 128, or -1 for one scale per
      row (channel-wise weights; per-token activations).
    symmetric: no zero points (w = q·s) if True; zero points (w = (q − z)·s) if False.
    activation_quant: how the kernel quantizes activations for these weights:
      "int8_dynamic_token" (per-row asymmetric int8, SPEC §3) or None
      (weight-only: activations stay bf16/fp16).
    weight_type: "int4" (signed [-8, 7]), "uint4b8" (unsigned with bias 8: GPTQ /
      compressed-tensors), "uint4" (unsigned with zero points: AWQ), "mxint4",
      "int8".
    scale_dtype: the scales' dtype name when the scheme fixes it; None means
      "the activation dtype" (fp16/bf16).
    static: scales fixed offline (weights) rather than computed per call.
  """
  name: str
  weight_bits: int
  group_size: int
  symmetric: bool
  activation_quant: str | None
  weight_type: str = "int4"
  scale_dtype: str | None = None
  static: bool = True

  @property
  def has_zero_points(self) -> bool:
    return not self.symmetric and self.static

  def __str__(self) -> str:
    return self.name


def _w4a8_key(group_size: int) -> QuantKey:
  where = "channel" if group_size == -1 else f"group{group_size}"
  return QuantKey(f"int4_w4a8_{where}_sym", 4, group_size, True, "int8_dynamic_token", "int4",
                  "float32" if group_size == -1 else "bfloat16")


# W4A8 weights (SPEC §2, §3): signed int4, symmetric, bf16 group scales / f32 channel scales,
# activations quantized per token inside the kernel.
kInt4W4A8StaticGroup32Sym = _w4a8_key(32)
kInt4W4A8StaticGroup64Sym = _w4a8_key(64)
kInt4W4A8StaticGroup128Sym = _w4a8_key(128)
kInt4W4A8StaticGroupSym = _w4a8_key(-1)  # channel-wise: one group spanning the input
kInt4W4A8StaticChannelSym = kInt4W4A8StaticGroupSym  # vLLM's other name for it
W4A8_WEIGHT_KEYS = (kInt4W4A8StaticGroup32Sym, kInt4W4A8StaticGroup64Sym,
                    kInt4W4A8StaticGroup128Sym, kInt4W4A8StaticGroupSym)

# The W4A8 kernel's activations (SPEC §3): int8, dynamic per token, asymmetric. The oracles
# accept it or None (vLLM passes None: activations arrive unquantized).
kInt8DynamicTokenAsym = QuantKey("int8_dynamic_token_asym", 8, -1, False, None, "int8",
                                 "float32", static=False)


def _wna16_key(group_size: int, has_zero_points: bool) -> QuantKey:
  where = "channel" if group_size == -1 else f"group{group_size}"
  if has_zero_points:
    return QuantKey(f"uint4_wna16_{where}_zp", 4, group_size, False, None, "uint4")
  return QuantKey(f"uint4b8_wna16_{where}_sym", 4, group_size, True, None, "uint4b8")


# WNA16 weights (SPEC §7): GPTQ uint4b8 (symmetric) or AWQ uint4 with zero points; scales in
# the activation dtype.
kUint4b8StaticGroup32Sym = _wna16_key(32, False)
kUint4b8StaticGroup64Sym = _wna16_key(64, False)
kUint4b8StaticGroup128Sym = _wna16_key(128, False)
kUint4b8StaticChannelSym = _wna16_key(-1, False)
kUint4StaticGroup32Zp = _wna16_key(32, True)
kUint4StaticGroup64Zp = _wna16_key(64, True)
kUint4StaticGroup128Zp = _wna16_key(128, True)
kUint4StaticChannelZp = _wna16_key(-1, True)
# Same keys, "Asym" spelling.
kUint4StaticGroup32Asym, kUint4StaticGroup64Asym = kUint4StaticGroup32Zp, kUint4StaticGroup64Zp
kUint4StaticGroup128Asym, kUint4StaticChannelAsym = kUint4StaticGroup128Zp, kUint4StaticChannelZp
WNA16_WEIGHT_KEYS = (kUint4b8StaticGroup32Sym, kUint4b8StaticGroup64Sym,
                     kUint4b8StaticGroup128Sym, kUint4b8StaticChannelSym, kUint4StaticGroup32Zp,
                     kUint4StaticGroup64Zp, kUint4StaticGroup128Zp, kUint4StaticChannelZp)

# MxInt4 weights (SPEC §8): signed int4, one bf16 scale per 32 inputs, bf16 activations.
kMxInt4StaticGroup32 = QuantKey("mxint4_group32_bf16", 4, 32, True, None, "mxint4", "bfloat16")
kMxInt4Group32 = kMxInt4StaticGroup32
MXINT4_WEIGHT_KEYS = (kMxInt4StaticGroup32,)

_GROUP_SIZES = (32, 64, 128, -1)


def w4a8_weight_key(group_size: int) -> QuantKey:
  """The W4A8 weight key of `group_size` (32, 64, 128, or -1 channel-wise)."""
  if group_size not in _GROUP_SIZES:
    raise ValueError(f"group_size={group_size} is not one of {_GROUP_SIZES}")
  return _w4a8_key(group_size)


def wna16_weight_key(group_size: int, has_zero_points: bool = False) -> QuantKey:
  """The WNA16 weight key of `group_size`: GPTQ uint4b8, or AWQ uint4 with zero points."""
  if group_size not in _GROUP_SIZES:
    raise ValueError(f"group_size={group_size} is not one of {_GROUP_SIZES}")
  return _wna16_key(group_size, has_zero_points)


# ------------------------------------------------------------------ quant config
@dataclasses.dataclass(frozen=True)
class MoEQuantConfig:
  """How an experts instance's weights and activations are quantized (vLLM's
  FusedMoEQuantConfig, trimmed to what the ops here read).

  Attributes:
    weight_bits: bits per weight value (4).
    block_shape: (rows, cols) of one weight scale's block: (1, g) group-wise;
      (-1, 1) or None channel-wise (vLLM's convention).
    activation_quant: "int8_dynamic_token" (W4A8) or None (weight-only).
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
        raise ValueError(f"block_shape must be (1, group_size), (-1, 1) or None, got "
                         f"{self.block_shape}")
      object.__setattr__(self, "block_shape", shape)

  @property
  def group_size(self) -> int:
    """The ops' integer group size: -1 channel-wise, else the block's columns."""
    if self.block_shape is None or self.block_shape == (-1, 1):
      return -1
    return self.block_shape[1]


# ------------------------------------------------------------------ MoE config
@dataclasses.dataclass(frozen=True)
class MoEParallelConfig:
  """Parallel layout seen *inside* one MoE op.

  jax_moeq shards MoE layers around the op (`jax.shard_map`, see
  `jax_moeq.sharding`), so the ops themselves run one shard with
  tp_size = ep_size = 1; larger sizes describe an op that would have to
  communicate, which no experts class here does.
  """
  tp_size: int = 1
  ep_size: int = 1
  ep_rank: int = 0
  use_batched_activation_format: bool = False

  def __post_init__(self):
    for name in ("tp_size", "ep_size"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if not 0 <= self.ep_rank < self.ep_size:
      raise ValueError(f"ep_rank={self.ep_rank} must be in [0, ep_size={self.ep_size})")

  @property
  def activation_format(self) -> FusedMoEActivationFormat:
    return (FusedMoEActivationFormat.BatchedExperts if self.use_batched_activation_format
            else FusedMoEActivationFormat.Standard)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Static description of one MoE layer call, as the oracles see it (vLLM's FusedMoEConfig,
  trimmed).

  Attributes:
    num_experts: E of the weights this op holds.
    top_k: experts per token.
    hidden_size, intermediate_size: H and I (per partition).
    activation: MoEActivation (strings are converted with `from_str`).
    apply_router_weight_on_input: the router weight scales the GEMM1 input instead of the output.
    routing_method: RoutingMethodType of the routing the experts perform (see
      `routing_method_for` for the one `select_experts` options compute).
    router_logits_dtype: dtype of the router logits (None: not known).
    has_bias: w13 / w2 biases present.
    in_dtype: dtype of the hidden states (and the output).
    parallel_config: MoEParallelConfig (also readable as `moe_parallel_config`).
    has_expert_map: a global -> local expert map would be passed (EP inside the op).
    platform: "cpu", "cuda", "rocm", "tpu" ("gpu" is normalized); None means the
      default JAX platform, fixed when the config is built.
    moe_backend: "auto", or a backend name the scheme's oracle maps.
  """
  num_experts: int
  top_k: int
  hidden_size: int
  intermediate_size: int
  activation: MoEActivation = MoEActivation.SILU
  apply_router_weight_on_input: bool = False
  routing_method: RoutingMethodType = RoutingMethodType.RenormalizeNaive
  router_logits_dtype: Any = jnp.float32
  has_bias: bool = False
  in_dtype: Any = jnp.bfloat16
  parallel_config: MoEParallelConfig = MoEParallelConfig()
  has_expert_map: bool = False
  platform: str | None = None
  moe_backend: str = AUTO

  def __post_init__(self):
    # Normalize convenience spellings so that equal configs compare (and hash) equal.
    set_ = lambda name, value: object.__setattr__(self, name, value)
    for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
      set_(name, int(value))
    if self.top_k > self.num_experts:
      raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
    set_("activation", MoEActivation.from_str(self.activation))
    try:
      set_("routing_method", RoutingMethodType(int(self.routing_method)))
    except (ValueError, TypeError):
      raise ValueError(f"routing_method={self.routing_method!r} is not a RoutingMethodType"
                       ) from None
    if self.router_logits_dtype is not None:
      set_("router_logits_dtype", jnp.dtype(self.router_logits_dtype))
    set_("in_dtype", jnp.dtype(self.in_dtype))
    for name in ("apply_router_weight_on_input", "has_bias", "has_expert_map"):
      set_(name, bool(getattr(self, name)))
    if not isinstance(self.parallel_config, MoEParallelConfig):
      raise TypeError(f"parallel_config must be a MoEParallelConfig, got "
                      f"{type(self.parallel_config).__name__}")
    set_("platform", current_platform() if self.platform is None
         else normalize_platform(self.platform))
    if not isinstance(self.moe_backend, str):
      raise TypeError(f"moe_backend must be a str, got {type(self.moe_backend).__name__}")
    set_("moe_backend", self.moe_backend.strip().lower())

  @property
  def resolved_platform(self) -> str:
    return self.platform

  @property
  def moe_parallel_config(self) -> MoEParallelConfig:
    return self.parallel_config

  @property
  def activation_format(self) -> FusedMoEActivationFormat:
    return self.parallel_config.activation_format

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


def routing_method_for(*, renormalize: bool, scoring_func: str = "softmax",
                       use_grouped_topk: bool = False) -> RoutingMethodType:
  """The RoutingMethodType that `routing.select_experts` computes with these options."""
  if use_grouped_topk:
    return RoutingMethodType.DeepSeekV3
  if scoring_func == "softmax":
    return RoutingMethodType.RenormalizeNaive if renormalize else RoutingMethodType.Default
  if scoring_func == "sigmoid":
    return RoutingMethodType.SigmoidRenorm if renormalize else RoutingMethodType.Sigmoid
  raise ValueError(f"scoring_func={scoring_func!r} is not one of ('softmax', 'sigmoid')")


# ------------------------------------------------------------------ routing options
@dataclasses.dataclass(frozen=True)
class RoutingOptions:
  """A layer's `routing.select_experts` options (SPEC §5), static and hashable.

  The correction bias is an array and is passed per call; `has_correction_bias` says whether
  the layer has one (its presence decides the kernel-side routing method).
  """
  top_k: int
  renormalize: bool = True
  scoring_func: str = "softmax"
  use_grouped_topk: bool = False
  num_expert_group: int | None = None
  topk_group: int | None = None
  routed_scaling_factor: float = 1.0
  has_correction_bias: bool = False

  def __post_init__(self):
    if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool):
      raise TypeError(f"top_k must be an int, got {self.top_k!r}")
    if self.scoring_func not in ("softmax", "sigmoid"):
      raise ValueError(f"scoring_func={self.scoring_func!r} is not one of ('softmax', 'sigmoid')")
    if self.has_correction_bias and not self.use_grouped_topk:
      raise ValueError("e_score_correction_bias is only used with use_grouped_topk=True")
    set_ = lambda name, value: object.__setattr__(self, name, value)
    set_("top_k", int(self.top_k))
    for name in ("renormalize", "use_grouped_topk", "has_correction_bias"):
      set_(name, bool(getattr(self, name)))
    set_("routed_scaling_factor", float(self.routed_scaling_factor))

  @property
  def routing_method(self) -> RoutingMethodType:
    """The method these options compute (what host-routed experts are asked to support)."""
    return routing_method_for(renormalize=self.renormalize, scoring_func=self.scoring_func,
                              use_grouped_topk=self.use_grouped_topk)

  @property
  def kernel_routing_method(self) -> RoutingMethodType | None:
    """The kernel-side method (`routing.route`) giving these options' result, or None.

    softmax -> top-k -> renormalize equals top-k -> softmax over the k (softmax is monotone),
    so it maps to Renormalize; grouped sigmoid with a correction bias and renormalization is
    DeepSeekV3. Anything else (a scaling factor without groups, sigmoid without groups,
    grouped softmax, grouped without bias or renormalization) has no kernel-side method.
    """
    if self.use_grouped_topk:
      if self.scoring_func == "sigmoid" and self.has_correction_bias and self.renormalize:
        return RoutingMethodType.DeepSeekV3
      return None
    if self.scoring_func != "softmax" or self.routed_scaling_factor != 1.0:
      return None
    return RoutingMethodType.Renormalize if self.renormalize else RoutingMethodType.Default

  def kernel_routing_kwargs(self) -> dict[str, Any]:
    """`routing.route` / kernel keyword arguments (groups and scaling) besides the bias."""
    if self.kernel_routing_method == RoutingMethodType.DeepSeekV3:
      return dict(num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                  routed_scaling_factor=self.routed_scaling_factor)
    return dict(num_expert_group=None, topk_group=None, routed_scaling_factor=None)

  def select(self, router_logits: Any, e_score_correction_bias: Any = None) -> tuple[Any, Any]:
    """`routing.select_experts` with these options: (topk_weights f32, topk_ids int32) [T, K]."""
    if (e_score_correction_bias is not None) != self.has_correction_bias:
      want = "an [E] array" if self.has_correction_bias else "None"
      raise ValueError(f"e_score_correction_bias must be {want} for routing options with "
                       f"has_correction_bias={self.has_correction_bias}")
    return routing_lib.select_experts(
        router_logits, self.top_k, renormalize=self.renormalize, scoring_func=self.scoring_func,
        use_grouped_topk=self.use_grouped_topk, num_expert_group=self.num_expert_group,
        topk_group=self.topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=self.routed_scaling_factor)


# ------------------------------------------------------------------ selection
BackendT = TypeVar("BackendT", bound=enum.Enum)


def unsupported_message(scheme_name: str, backend: enum.Enum, reason: str | None, *,
                        kind: str = "MoE") -> str:
  """vLLM's wording for a backend that does not fit (`kind`: "MoE" or "linear")."""
  if reason:
    return (f"{scheme_name} {kind} backend {backend.name} does not support the deployment "
            f"configuration since {reason}.")
  return (f"{scheme_name} {kind} backend {backend.name} does not support the deployment "
          "configuration.")


def map_backend_name(scheme_name: str, moe_backend: str, mapping: dict[str, BackendT], *,
                     kind: str = "MoE", argument: str = "moe_backend") -> BackendT:
  """For `map_<scheme>_backend`: case-insensitive lookup, ValueError listing the choices."""
  backend = mapping.get(str(moe_backend).strip().lower())
  if backend is None:
    raise ValueError(f"{argument}={moe_backend!r} is not supported for {scheme_name} {kind}. "
                     f"Expected one of {[AUTO, *mapping]}.")
  return backend


def first_fit(classes: Sequence[type], config: MoEConfig, weight_key, activation_key
               ) -> tuple[type | None, str | None]:
  """The first class that fits, or (None, the last class's reason)."""
  reason = None
  for cls in classes:
    supported, reason = cls.is_supported_config(config, weight_key, activation_key,
                                                getattr(config, "activation_format", None))
    if supported:
      return cls, None
  return None, reason or "no experts class implements it"


def select_backend(
    scheme_name: str,
    config: MoEConfig,
    weight_key: QuantKey | None,
    activation_key: QuantKey | None,
    priority_backends: Sequence[BackendT],
    backend_to_kernel_cls: Callable[[BackendT], Sequence[type]],
    map_backend: Callable[[str], BackendT],
    *,
    reference_backend: BackendT | None = None,
    kind: str = "MoE",
    requested_backend: str | None = None,
) -> tuple[BackendT, type]:
  """The oracle loop shared by every scheme (rules in the module docstring).

  Args:
    scheme_name: display name in messages ("W4A8 Int8", "WNA16", "MxInt4").
    config: the layer's MoEConfig (`config.moe_backend` "auto" or explicit).
    weight_key, activation_key: passed to each class's `is_supported_config`.
    priority_backends: backends to try under "auto", fastest first, REFERENCE last.
    backend_to_kernel_cls: backend -> experts classes, tried in order.
    map_backend: explicit `moe_backend` string -> backend (ValueError if unknown).
    reference_backend: the scheme's jnp fallback; default: the member of the
      priority list named REFERENCE.
    kind: what the backend runs, in messages: "MoE" (experts) or "linear" (dense layers).
    requested_backend: "auto" or an explicit backend name; default `config.moe_backend`.

  Returns:
    (backend, experts_cls).

  Raises:
    ValueError: explicit `moe_backend` unknown or not fitting (naming backend and reason).
    NotImplementedError: "auto" and no backend fits.
  """
  requested = config.moe_backend if requested_backend is None else requested_backend
  if requested != AUTO:
    backend = map_backend(requested)
    cls, reason = first_fit(backend_to_kernel_cls(backend), config, weight_key, activation_key)
    if cls is None:
      raise ValueError(unsupported_message(scheme_name, backend, reason, kind=kind))
    log_once(logging.INFO, f"Using {backend.name} {scheme_name} {kind} backend "
             f"({'moe_backend' if kind == 'MoE' else 'backend'}={requested!r} was requested).")
    return backend, cls

  if reference_backend is None:
    reference_backend = next(
        (b for b in priority_backends if b.name == REFERENCE_BACKEND_NAME), None)
  rejected: list[str] = []
  for backend in priority_backends:
    cls, reason = first_fit(backend_to_kernel_cls(backend), config, weight_key, activation_key)
    if cls is None:
      log_once(logging.DEBUG, unsupported_message(scheme_name, backend, reason, kind=kind))
      rejected.append(f"{backend.name}: {reason}")
      continue
    if backend == reference_backend:
      why = ("; ".join(rejected) if rejected else
             f"no {scheme_name} kernel exists for platform {config.platform!r}")
      log_once(logging.WARNING, f"Using the {backend.name} (pure jax.numpy) {scheme_name} {kind} "
               f"backend since no faster backend fits the deployment configuration ({why}). "
               "It is exact but much slower than a fused kernel.")
    else:
      log_once(logging.INFO, f"Using {backend.name} {scheme_name} {kind} backend out of potential "
               f"backends: {[b.name for b in priority_backends]}.")
    return backend, cls

  detail = "; ".join(rejected) if rejected else f"none exists for platform {config.platform!r}"
  raise NotImplementedError(
      f"No {scheme_name} {kind} backend supports the deployment configuration ({detail}).")
