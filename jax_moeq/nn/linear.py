"""Flax NNX `QuantizedLinear`: an int4 dense layer `y = x · Wᵀ (+ b)` (SPEC §12).

Built like `QuantizedMoE`: the linear oracle (`jax_moeq.oracle.linear`) picks an implementation
class once, at construction; its `prepare` converts the canonical `Int4LinearWeights` to the
backend's arrays, held as `QuantizedWeight` variables (not `nnx.Param`: optimizers leave them
alone; `jax.jit`, `nnx.split` / `nnx.state` see plain arrays), and its `apply` runs each call.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moeq.linears import Int4LinearWeights, quantize_linear, validate_linear_weights
from jax_moeq.linears.kernels import LinearKernel
from jax_moeq.nn.moe import QuantizedWeight
from jax_moeq.oracle import linear as linear_oracle

logger = logging.getLogger("jax_moeq")

Array = jax.Array
SCHEMES = linear_oracle.LINEAR_SCHEMES


class QuantizedLinear(nnx.Module):
  """Int4 linear layer: `[..., in_features] -> [..., out_features]` in x's dtype.

  Args:
    in_features, out_features: K and N of the weight `[N, K]`.
    scheme: "w4a8_int8" (int4 weights, int8 activations per row; the CPU op) or "wna16"
      (weight-only int4, float activations; the Hopper op).
    weights: the canonical int4 weights (`jax_moeq.linears.Int4LinearWeights`).
    backend: "auto" (the oracle's choice for the platform) or an explicit backend name
      ("cpu_w4a8", "marlin", "reference").
    dtype: the computation dtype (the call casts x to it and the result back to x's dtype).
    allow_activation_quantization: let "wna16" weights run on the CPU W4A8 op (int8
      activations); default: only for "w4a8_int8".
    platform: "cpu", "cuda", ...; None: JAX's default backend.

  Attributes: `scheme`, `backend` (the chosen class's short name), `backend_reason`, `kernel`.
  """

  def __init__(self, in_features: int, out_features: int, *, scheme: str = "w4a8_int8",
               weights: Int4LinearWeights, backend: str = "auto", dtype=jnp.bfloat16,
               allow_activation_quantization: bool | None = None, platform: str | None = None):
    if scheme not in SCHEMES:
      raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES}")
    validate_linear_weights(weights)
    if (weights.out_features, weights.in_features) != (out_features, in_features):
      raise ValueError(f"weights are [{weights.out_features}, {weights.in_features}] [out, in]; "
                       f"the layer needs [{out_features}, {in_features}]")
    if allow_activation_quantization is None:
      allow_activation_quantization = scheme == "w4a8_int8"
    config = linear_oracle.LinearConfig(
        in_features, out_features, dtype, has_bias=weights.bias is not None, platform=platform,
        backend=backend, allow_activation_quantization=allow_activation_quantization)
    key = linear_oracle.linear_weight_key(scheme, weights.group_size, weights.has_zero_points)
    chosen, cls = linear_oracle.select_linear_backend(scheme, config, key)
    self.in_features = int(in_features)
    self.out_features = int(out_features)
    self.dtype = jnp.dtype(dtype)
    self.scheme = scheme
    self.group_size = weights.group_size
    self.kernel: LinearKernel = cls(config, weights.group_size)
    self.backend = cls.backend_name
    self.backend_reason = (f"the {linear_oracle.SCHEME_NAMES[scheme]} linear oracle chose "
                           f"{chosen.name} ({cls.__name__})")
    logger.debug("QuantizedLinear(scheme=%s, [%d, %d], group_size=%d): backend %s", scheme,
                 out_features, in_features, weights.group_size, self.backend)
    arrays = self.kernel.prepare(weights)
    self.quantized_names = tuple(sorted(arrays))
    for name in self.quantized_names:
      setattr(self, name, QuantizedWeight(arrays[name]))

  def _arrays(self) -> dict[str, Array]:
    return {name: getattr(self, name)[...] for name in self.quantized_names}

  def __call__(self, x: Array) -> Array:
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] != self.in_features:
      raise ValueError(f"x must end in in_features={self.in_features}, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"x must be floating point, got {x.dtype}")
    y = self.kernel.apply(x.astype(self.dtype), self._arrays())
    return y.astype(x.dtype)

  @classmethod
  def from_float(cls, weight: Array, bias: Array | None = None, *, scheme: str = "w4a8_int8",
                 group_size: int = 128, backend: str = "auto", dtype=jnp.bfloat16,
                 allow_activation_quantization: bool | None = None,
                 platform: str | None = None) -> "QuantizedLinear":
    """Quantizes a float `weight [out, in]` (round-to-nearest symmetric int4, SPEC §2)."""
    weights = quantize_linear(weight, group_size, bias)
    return cls(weights.in_features, weights.out_features, scheme=scheme, weights=weights,
               backend=backend, dtype=dtype,
               allow_activation_quantization=allow_activation_quantization, platform=platform)


def linear_info(module: Any) -> tuple[str, str]:
  """(scheme, backend) of a `QuantizedLinear`, ("float", "xla") of anything else."""
  if isinstance(module, QuantizedLinear):
    return module.scheme, module.backend
  return "float", "xla"
