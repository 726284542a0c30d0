"""Dense int4 linear implementations the linear oracle (`jax_moeq.oracle.linear`) chooses between.

A kernel class runs `y = x · Wᵀ (+ b)` for one backend, as an experts class runs a MoE layer:

    supported, reason = cls.is_supported_config(config, weight_key)   # before building
    kernel = cls(config, group_size)
    arrays = kernel.prepare(int4_weights)     # once: canonical weights -> the backend's arrays
    y = kernel.apply(x, arrays)               # [..., K] -> [..., N] in x's dtype

Classes:
- `CPUW4A8Linear`: the CPU W4A8 op (`ops.w4a8_linear_cpu`; SPEC §3: int8 activations per row).
- `MarlinLinear`: the Hopper WNA16 op (`ops.wna16_linear_gpu`; bf16 / fp16 activations).
- `ReferenceW4A8Linear`, `ReferenceWNA16Linear`: the jnp references, every platform.

`reason` is a clause that reads after "since" ("the kernel does not run on platform 'cuda'").
Act-order (`g_idx`) on the W4A8 kernels: the input channels are sorted by group once in
`prepare` and the activations gathered in that order per call; the per-row int8 quantization
does not depend on the channel order and each group's integer sum is exact, so the result is
that of the unsorted weights.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq import _ffi, reference
from jax_moeq.linears.weights import Int4LinearWeights, validate_linear_weights
from jax_moeq.oracle.base import W4A8_WEIGHT_KEYS, WNA16_WEIGHT_KEYS, QuantKey

Array = jax.Array

__all__ = ["CPUW4A8Linear", "LinearKernel", "MarlinLinear", "ReferenceW4A8Linear",
           "ReferenceWNA16Linear"]

_W4A8_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CPU_ALIGNMENT = 16  # N and K: the W4A8 packed layout's 16-row tiles
GPU_ALIGNMENT = 64  # N and K: the wgmma GEMM's half tile of rows, its 64-deep chunk along K


# ------------------------------------------------------------------ base
class LinearKernel(abc.ABC):
  """One backend's int4 linear: `is_supported_config` (class level), `prepare` and `apply`.

  `config` is a `jax_moeq.oracle.linear.LinearConfig` (in/out features, dtype, bias, platform,
  whether activations may be quantized to int8); `group_size` that of the weights it runs.
  """

  # The backend's short name, as `jax_moeq.nn.QuantizedLinear.backend` reports it.
  backend_name: ClassVar[str] = ""

  def __init__(self, config: Any, group_size: int):
    self.config = config
    self.group_size = int(group_size)

  # ---------------------------------------------------------------- support checks
  @classmethod
  def is_supported_config(cls, config: Any, weight_key: QuantKey | None,
                          activation_key: QuantKey | None = None,
                          activation_format: Any = None) -> tuple[bool, str | None]:
    """(True, None) if this class can run `config` with weights of `weight_key`, else
    (False, reason). `activation_key` / `activation_format` exist for the shared oracle loop
    (activations always arrive unquantized)."""
    del activation_format
    platform = config.platform
    if not cls._supports_current_device(platform):
      return False, f"the kernel does not run on platform {platform!r}"
    if weight_key is None or not cls._supports_quant_scheme(weight_key) or activation_key:
      return False, f"the kernel does not support the quantization scheme weight={weight_key}"
    k, g = config.in_features, weight_key.group_size
    if g != -1 and k % g:
      return False, f"group_size={g} does not divide in_features={k}"
    reason = cls._unsupported_reason(config, weight_key)
    if reason is not None:
      return False, reason
    return True, None

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return True

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey) -> bool:
    return False

  @classmethod
  def _unsupported_reason(cls, config: Any, weight_key: QuantKey) -> str | None:
    """Backend-specific checks (libraries, dtypes, alignment): a reason, or None if fine."""
    return None

  # ---------------------------------------------------------------- weights and compute
  def _check(self, weights: Int4LinearWeights) -> Int4LinearWeights:
    validate_linear_weights(weights)
    cfg = self.config
    if (weights.out_features, weights.in_features) != (cfg.out_features, cfg.in_features):
      raise ValueError(f"weights are [{weights.out_features}, {weights.in_features}], the "
                       f"linear was built for [{cfg.out_features}, {cfg.in_features}]")
    if weights.group_size != self.group_size:
      raise ValueError(f"weights have group_size={weights.group_size}, the linear was built "
                       f"for group_size={self.group_size}")
    if (weights.bias is not None) != bool(cfg.has_bias):
      raise ValueError(f"weights {'have' if weights.bias is not None else 'have no'} bias, the "
                       f"linear was built with has_bias={cfg.has_bias}")
    return weights

  @abc.abstractmethod
  def prepare(self, weights: Int4LinearWeights) -> dict[str, Array]:
    """Canonical weights -> this backend's named arrays (run once per set of weights)."""

  @abc.abstractmethod
  def apply(self, x: Array, arrays: Mapping[str, Array]) -> Array:
    """[..., in_features] -> [..., out_features] in x's dtype; `arrays` from `prepare`."""

  def _check_input(self, x: Array) -> Array:
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] != self.config.in_features:
      raise ValueError(f"x must end in in_features={self.config.in_features}, got shape "
                       f"{x.shape}")
    return x

  # Equal configs give equal kernels: modules holding them hash alike under jit (static data).
  def _key(self) -> tuple:
    return (type(self), self.config, self.group_size)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, LinearKernel) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.config!r}, group_size={self.group_size})"


def _require(owner: str, arrays: Mapping[str, Array], names: tuple[str, ...]) -> None:
  missing = [n for n in names if n not in arrays]
  if missing:
    raise ValueError(f"{owner} needs the prepared arrays {list(names)}; missing {missing} "
                     f"(got {sorted(arrays)}); build them with {owner}.prepare")


def _w4a8_scale(weights: Int4LinearWeights) -> Array:
  """Scales in the W4A8 dtypes (SPEC §2): bf16 group-wise (fp16 / f32 rounded), f32 channel."""
  return jnp.asarray(weights.scale, jnp.float32 if weights.group_size == -1 else jnp.bfloat16)


def _sorted_by_group(weights: Int4LinearWeights) -> tuple[Array, Array | None]:
  """(q with input channels sorted by act-order group, the input permutation or None)."""
  if weights.g_idx is None:
    return jnp.asarray(weights.q), None
  perm = np.argsort(np.asarray(weights.g_idx), kind="stable").astype(np.int32)
  return jnp.asarray(weights.q)[:, perm], jnp.asarray(perm)


class _W4A8Base(LinearKernel):
  """Int4 weights, activations quantized to int8 per row inside the op (SPEC §3)."""

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey) -> bool:
    # W4A8 weights, or symmetric weight-only int4 whose activations may be quantized.
    return weight_key in W4A8_WEIGHT_KEYS or (weight_key in WNA16_WEIGHT_KEYS
                                             and weight_key.symmetric)

  @classmethod
  def _unsupported_reason(cls, config: Any, weight_key: QuantKey) -> str | None:
    if weight_key.activation_quant is None and not config.allow_activation_quantization:
      return ("it quantizes activations to int8, which weight-only int4 weights allow only with "
              "allow_activation_quantization=True")
    if config.in_dtype not in _W4A8_DTYPES:
      return f"it does not support {config.in_dtype} activations"
    return None

  def _check(self, weights: Int4LinearWeights) -> Int4LinearWeights:
    weights = super()._check(weights)
    if weights.zeros is not None:
      raise ValueError(f"{type(self).__name__} runs symmetric int4 weights; these have zero "
                       "points")
    return weights

  def _permuted(self, x: Array, arrays: Mapping[str, Array]) -> Array:
    perm = arrays.get("input_perm")
    return x if perm is None else jnp.take(x, perm, axis=-1)


def _cpu_op():
  """The CPU W4A8 linear op module, or None when it is not importable."""
  try:
    from jax_moeq.ops import w4a8_linear_cpu
  except ImportError:
    return None
  return w4a8_linear_cpu


class CPUW4A8Linear(_W4A8Base):
  """The CPU W4A8 linear (`ops.w4a8_linear_cpu.w4a8_linear`): N % 16 == 0, K % 16 == 0.

  Prepared arrays: {"packed"} uint8 (weights, scales, bias), + {"input_perm"} with act-order.
  """

  backend_name = "cpu_w4a8"

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return platform == "cpu"

  @classmethod
  def _unsupported_reason(cls, config: Any, weight_key: QuantKey) -> str | None:
    reason = super()._unsupported_reason(config, weight_key)
    if reason is not None:
      return reason
    n, k = config.out_features, config.in_features
    if n % CPU_ALIGNMENT or k % CPU_ALIGNMENT:
      return (f"out_features={n} and in_features={k} must be multiples of {CPU_ALIGNMENT}")
    if _cpu_op() is None:
      return "the CPU W4A8 linear op (jax_moeq.ops.w4a8_linear_cpu) is not available"
    if not _ffi.cpu_library_available():
      return "the CPU library jax_moeq._cpu_ffi is not built (pip install . or scripts/dev_build.sh)"
    return None

  def prepare(self, weights: Int4LinearWeights) -> dict[str, Array]:
    w = self._check(weights)
    q, perm = _sorted_by_group(w)
    bias = None if w.bias is None else jnp.asarray(w.bias, jnp.float32)
    arrays = {"packed": _cpu_op().pack_w4a8_linear(q, _w4a8_scale(w), w.group_size, bias)}
    if perm is not None:
      arrays["input_perm"] = perm
    return arrays

  def apply(self, x: Array, arrays: Mapping[str, Array]) -> Array:
    _require(type(self).__name__, arrays, ("packed",))
    x = self._permuted(self._check_input(x), arrays)
    cfg = self.config
    return _cpu_op().w4a8_linear(x, arrays["packed"], in_features=cfg.in_features,
                                 out_features=cfg.out_features, group_size=self.group_size)


class ReferenceW4A8Linear(_W4A8Base):
  """`reference.linear_w4a8` on the canonical weights, every platform.

  Prepared arrays: {"q", "scale"} (+ "bias", "input_perm"): scales in the W4A8 dtypes.
  """

  backend_name = "reference"

  def prepare(self, weights: Int4LinearWeights) -> dict[str, Array]:
    w = self._check(weights)
    q, perm = _sorted_by_group(w)
    arrays = {"q": q, "scale": _w4a8_scale(w)}
    if w.bias is not None:
      arrays["bias"] = jnp.asarray(w.bias, jnp.float32)
    if perm is not None:
      arrays["input_perm"] = perm
    return arrays

  def apply(self, x: Array, arrays: Mapping[str, Array]) -> Array:
    _require(type(self).__name__, arrays, ("q", "scale"))
    x = self._permuted(self._check_input(x), arrays)
    return reference.linear_w4a8(x, arrays["q"], arrays["scale"], self.group_size,
                                 arrays.get("bias"))


class _WNA16Base(LinearKernel):
  """Weight-only int4: activations stay float."""

  @staticmethod
  def _supports_quant_scheme(weight_key: QuantKey) -> bool:
    return weight_key in WNA16_WEIGHT_KEYS


class ReferenceWNA16Linear(_WNA16Base):
  """`reference.linear_wna16` on the canonical weights (act-order, zero points), every platform.

  Prepared arrays: {"q", "scale"} (+ "g_idx", "zeros", "bias").
  """

  backend_name = "reference"

  @classmethod
  def _unsupported_reason(cls, config: Any, weight_key: QuantKey) -> str | None:
    if config.in_dtype not in _W4A8_DTYPES:
      return f"the reference does not support {config.in_dtype} activations"
    return None

  def prepare(self, weights: Int4LinearWeights) -> dict[str, Array]:
    w = self._check(weights)
    arrays = {"q": jnp.asarray(w.q), "scale": jnp.asarray(w.scale)}
    for name in ("g_idx", "zeros", "bias"):
      if getattr(w, name) is not None:
        arrays[name] = jnp.asarray(getattr(w, name))
    return arrays

  def apply(self, x: Array, arrays: Mapping[str, Array]) -> Array:
    _require(type(self).__name__, arrays, ("q", "scale"))
    x = self._check_input(x)
    return reference.linear_wna16(x, arrays["q"], arrays["scale"], self.group_size,
                                  g_idx=arrays.get("g_idx"), zeros=arrays.get("zeros"),
                                  bias=arrays.get("bias"))


def _gpu_op():
  """The GPU WNA16 linear op module, or None when it is not importable."""
  try:
    from jax_moeq.ops import wna16_linear_gpu
  except ImportError:
    return None
  return wna16_linear_gpu


class MarlinLinear(_WNA16Base):
  """The Hopper WNA16 linear (`ops.wna16_linear_gpu.wna16_linear`), bf16 / fp16 activations.

  Prepared arrays: the leaves of `pack_wna16_linear`'s pytree, named "packed_<i>"; the tree's
  structure is kept on the instance (fixed by the config and the weights' optional parts).
  """

  backend_name = "marlin"

  def __init__(self, config: Any, group_size: int):
    super().__init__(config, group_size)
    self._treedef = None

  @staticmethod
  def _supports_current_device(platform: str) -> bool:
    return platform == "cuda"

  @classmethod
  def _unsupported_reason(cls, config: Any, weight_key: QuantKey) -> str | None:
    if config.in_dtype not in _HALF_DTYPES:
      return f"the kernel takes bfloat16/float16 activations, not {config.in_dtype}"
    n, k = config.out_features, config.in_features
    if n % GPU_ALIGNMENT or k % GPU_ALIGNMENT:
      return f"out_features={n} and in_features={k} must be multiples of {GPU_ALIGNMENT}"
    op = _gpu_op()
    if op is None:
      return "the GPU WNA16 linear op (jax_moeq.ops.wna16_linear_gpu) is not available"
    try:
      available = op.wna16_linear_gpu_available()
    except Exception:  # pylint: disable=broad-except
      available = False
    if not available:
      return "the CUDA library is not built or the GPU is below compute capability 9.0"
    return None

  def prepare(self, weights: Int4LinearWeights) -> dict[str, Array]:
    w = self._check(weights)
    q, zeros = jnp.asarray(w.q), w.zeros
    if zeros is not None:
      # Unsigned q and zero points in [0, 15] -> the op's signed domain: (q - z) is unchanged.
      q, zeros = q - jnp.int8(8), jnp.asarray(zeros).astype(jnp.int8) - jnp.int8(8)
    packed = _gpu_op().pack_wna16_linear(q, jnp.asarray(w.scale), w.group_size, g_idx=w.g_idx,
                                         zeros=zeros, bias=w.bias, dtype=self.config.in_dtype)
    leaves, treedef = jax.tree_util.tree_flatten(packed)
    self._treedef = treedef
    return {f"packed_{i}": leaf for i, leaf in enumerate(leaves)}

  def apply(self, x: Array, arrays: Mapping[str, Array]) -> Array:
    if self._treedef is None:
      raise ValueError("MarlinLinear.apply needs the arrays of this instance's prepare")
    names = tuple(f"packed_{i}" for i in range(self._treedef.num_leaves))
    _require(type(self).__name__, arrays, names)
    packed = jax.tree_util.tree_unflatten(self._treedef, [arrays[n] for n in names])
    return _gpu_op().wna16_linear(self._check_input(x), packed)

  def _key(self) -> tuple:
    return super()._key() + (self._treedef,)
