"""`from_pretrained`: a Hugging Face MoE checkpoint directory -> `MoECausalLM`, layer by layer.

The route from weights to kernel is the blocks' own: each layer's experts become a
`jax_moeq.nn.QuantizedMoE` (int4 checkpoints, or float experts quantized while loading; the
scheme's oracle picks the backend for the platform) or a float `jax_moeq.nn.MoE`. Dense linears
(attention q/k/v/o, dense MLPs, LM head) become `jax_moeq.nn.QuantizedLinear`s through the linear
oracle when the checkpoint stores them int4 (kept as stored, not dequantized), when
`quantize_linears=True` quantizes float ones on load, or (LM head) with
`lm_head_quantization="int4"`; otherwise they are float in `dtype`. Router gates, embeddings and
norms stay float. q/k/v (a dense MLP's gate/up) that are int4 alike run as one fused GEMM. Only
one layer's float experts are held at a time.

`from_config` builds the same model with random weights (benchmarks, examples).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moeq.models import config as config_lib
from jax_moeq.models import decoder
from jax_moeq.models import mixtral, olmoe, qwen3_moe
from jax_moeq.models import sharded as sharded_lib

logger = logging.getLogger("jax_moeq.models")

ConfigParser = Callable[[Mapping[str, Any], Mapping[str, Any] | None], config_lib.DecoderConfig]
# model_type -> config parser. One more architecture: one more module with `config_from_json`.
ARCHITECTURES: dict[str, ConfigParser] = {
    qwen3_moe.MODEL_TYPE: qwen3_moe.config_from_json,
    mixtral.MODEL_TYPE: mixtral.config_from_json,
    olmoe.MODEL_TYPE: olmoe.config_from_json,
}
QUANTIZATIONS = ("w4a8_int8", "wna16", "mxint4")
LM_HEAD_QUANTIZATIONS = (None, "int4")
_GROUP_SIZES = (128, 64, 32)
# The dense linears' scheme that goes with each experts' scheme (mxint4 linears are WNA16).
_LINEAR_SCHEMES = {"w4a8_int8": "w4a8_int8", "wna16": "wna16", "mxint4": "wna16"}
_ATTENTION_DTYPES = ("float32", "bfloat16", "float16")


# ------------------------------------------------------------------ config
def read_json(path: Path, *, required: bool = True) -> dict[str, Any] | None:
  """A JSON object from `path`; errors name the file (and the line and column)."""
  if not path.exists():
    if required:
      raise FileNotFoundError(f"{path} does not exist")
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise config_lib.ConfigError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: "
                                 f"{e.msg}") from None
  except UnicodeDecodeError as e:
    raise config_lib.ConfigError(f"{path}: not UTF-8 text ({e.reason})") from None
  if not isinstance(data, dict):
    raise config_lib.ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


def decoder_config(cfg_json: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                   *, source: str = "config.json") -> config_lib.DecoderConfig:
  """The `DecoderConfig` of a `config.json` dict, by its `model_type`."""
  model_type = cfg_json.get("model_type")
  if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
    raise config_lib.ConfigError(f"{source}: model_type={model_type!r} is not supported; "
                                 f"supported: {sorted(ARCHITECTURES)}")
  try:
    return ARCHITECTURES[model_type](cfg_json, generation)
  except config_lib.ConfigError as e:
    raise config_lib.ConfigError(f"{source}: {e}") from None


def resolve_dtype(dtype: Any, cfg: config_lib.DecoderConfig) -> jnp.dtype:
  """`dtype`, else the checkpoint's own float dtype; on a GPU a float32 checkpoint runs bf16."""
  if dtype is not None:
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dt}")
    return dt
  own = jnp.dtype(cfg.dtype or "float32")
  if jax.default_backend() == "gpu" and own == jnp.dtype(jnp.float32):
    return jnp.dtype(jnp.bfloat16)
  return own


def default_group_size(cfg: config_lib.DecoderConfig, scheme: str) -> int:
  if scheme == "mxint4":
    return 32
  for g in _GROUP_SIZES:
    if cfg.hidden_size % g == 0 and cfg.moe_intermediate_size % g == 0:
      return g
  return -1


# ------------------------------------------------------------------ tensor sources
class _CheckpointSource:
  """Float tensors, dequantized linears and MoE layers of a safetensors checkpoint directory."""

  def __init__(self, path: Path, cfg: config_lib.DecoderConfig, qcfg):
    from jax_moeq import loaders
    self._loaders = loaders
    self.cfg = cfg
    self.qcfg = qcfg
    self.ckpt = loaders.SafetensorsDir(path)
    self.path = path
    self._layouts = loaders.discover_moe_layers(self.ckpt.keys())

  def _where(self, name: str) -> str:
    return f"{self.path} tensor {name!r}"

  def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.ckpt:
      raise KeyError(f"{self.path}: the checkpoint has no tensor {name!r}")
    value = self.ckpt.get(name)
    _check_shape(value, shape, self._where(name))
    _check_float(value, self._where(name))
    return value

  def has(self, name: str) -> bool:
    return name in self.ckpt

  def linear(self, prefix: str, out: int, inp: int, bias: bool | None = None
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """[out, in] weight (dequantized when the checkpoint quantized it) and its bias if any."""
    if f"{prefix}.weight" in self.ckpt:
      w = self.tensor(f"{prefix}.weight", (out, inp))
      b = self.ckpt.get(f"{prefix}.bias") if f"{prefix}.bias" in self.ckpt else None
    else:
      read_linear = getattr(self._loaders, "read_linear", None)
      if read_linear is None or not self.qcfg.quantized:
        raise KeyError(f"{self.path}: the checkpoint has no tensor {prefix + '.weight'!r}")
      w, b = read_linear(self.ckpt, prefix, self.qcfg)
      _check_shape(w, (out, inp), f"{self.path} linear {prefix!r} (dequantized)")
    if b is not None:
      _check_shape(b, (out,), self._where(f"{prefix}.bias"))
      _check_float(b, self._where(f"{prefix}.bias"))
    return w, b

  def projection(self, prefix: str, out: int, inp: int, bias: bool | None = None):
    """A dense linear as stored: float `(weight [out, in], bias)`, or `Int4LinearWeights` when
    the checkpoint stores it int4 (shapes and group size checked against config.json)."""
    from jax_moeq.linears import Int4LinearWeights
    if f"{prefix}.weight" in self.ckpt or not self.qcfg.quantized:
      return self.linear(prefix, out, inp, bias)
    value, b = self._loaders.read_projection(self.ckpt, prefix, self.qcfg)
    if not isinstance(value, self._loaders.Int4Projection):
      return self.linear(prefix, out, inp, bias)
    stored = (f"{prefix}.qweight" if f"{prefix}.qweight" in self.ckpt
              else f"{prefix}.weight_packed")
    if self.qcfg.is_ignored(prefix):
      raise self._loaders.CheckpointFormatError(
          f"{prefix!r} is int4 in the checkpoint, but config.json's quantization_config.ignore "
          "lists it as unquantized", path=self.path, tensor=stored)
    if value.q.ndim != 2 or tuple(value.q.shape) != (out, inp):
      raise ValueError(f"{self._where(stored)} holds an int4 weight of shape "
                       f"{list(value.q.shape)} [out, in], expected {[out, inp]} from config.json")
    g = value.group_size
    if g != -1 and inp % g:
      raise ValueError(f"{self._where(stored)}: group_size={g} does not divide in_features={inp}")
    if b is not None:
      _check_shape(b, (out,), self._where(f"{prefix}.bias"))
      _check_float(b, self._where(f"{prefix}.bias"))
      b = jnp.asarray(np.asarray(b, np.float32))
    return Int4LinearWeights(jnp.asarray(value.q, jnp.int8), jnp.asarray(value.scale), g,
                             g_idx=None if value.g_idx is None
                             else jnp.asarray(value.g_idx, jnp.int32), bias=b)

  def moe_layer(self, index: int, experts: tuple[int, ...] | None = None):
    """Layer `index`'s experts (only `experts`, when given: no other expert's bytes are read)."""
    cfg = self.cfg
    layout = self._layouts.get(index)
    want = f"{cfg.moe_prefix(index)}.experts"
    if layout is None:
      raise KeyError(f"{self.path}: layer {index} has no MoE expert tensors (expected names like "
                     f"'{want}.0.{cfg.expert_names[0]}...')")
    if layout.experts != want:
      raise ValueError(f"{self.path}: layer {index}'s experts are under {layout.experts!r}, the "
                       f"{cfg.model_type} layout puts them under {want!r}")
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if layout.num_experts not in (-1, e):
      raise ValueError(f"{self.path}: layer {index}'s experts are E={layout.num_experts}; "
                       f"config.json says E={e}")
    layer = self._loaders.load_moe_layer(self.ckpt, layout, self.qcfg, experts=experts)
    held = e if experts is None else len(experts)
    if (layer.num_experts, layer.hidden_size, layer.intermediate_size) != (held, h, i):
      raise ValueError(f"{self.path}: layer {index}'s experts are E={layer.num_experts}, "
                       f"H={layer.hidden_size}, I={layer.intermediate_size}; config.json says "
                       f"E={e}, H={h}, I={i}"
                       + ("" if experts is None else f" ({held} of them read here)"))
    if layer.router_weight is None:
      layer.router_weight, _ = self.linear(f"{cfg.moe_prefix(index)}.gate", e, h)
    _check_shape(layer.router_weight, (e, h), self._where(f"{cfg.moe_prefix(index)}.gate.weight"))
    return layer


class _RandomSource:
  """Random weights (normal, std 0.02; norms near 1) drawn layer by layer on the device."""

  def __init__(self, cfg: config_lib.DecoderConfig, seed: int, dtype):
    self.cfg = cfg
    self.dtype = dtype
    self._key = jax.random.key(seed)
    self._count = 0

  def _next(self):
    self._count += 1
    return jax.random.fold_in(self._key, self._count)

  def _normal(self, shape, std=0.02):
    return (std * jax.random.normal(self._next(), shape, jnp.float32)).astype(self.dtype)

  def has(self, name: str) -> bool:
    return False

  def tensor(self, name: str, shape: tuple[int, ...]):
    if name.endswith("norm.weight"):
      return (1.0 + self._normal(shape, 0.1).astype(jnp.float32)).astype(self.dtype)
    return self._normal(shape)

  def linear(self, prefix: str, out: int, inp: int, bias: bool | None = None):
    return self._normal((out, inp)), (self._normal((out,)) if bias else None)

  def projection(self, prefix: str, out: int, inp: int, bias: bool | None = None):
    return self.linear(prefix, out, inp, bias)

  def moe_layer(self, index: int):
    from jax_moeq.loaders import MoELayerTensors
    cfg = self.cfg
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return MoELayerTensors(w13=self._normal((e, 2 * i, h)), w2=self._normal((e, h, i)),
                           router_weight=self._normal((e, h)))


def _check_shape(value, shape: tuple[int, ...], where: str) -> None:
  if tuple(value.shape) != tuple(shape):
    raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {tuple(shape)} from "
                     "config.json")


def _check_float(value, where: str) -> None:
  if not jnp.issubdtype(jnp.dtype(value.dtype), jnp.floating):
    raise ValueError(f"{where} has dtype {value.dtype}, expected a float tensor")


# ------------------------------------------------------------------ building
def _attention_weights(source, cfg: config_lib.DecoderConfig, index: int) -> dict[str, Any]:
  p = f"model.layers.{index}"
  h, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  bias = cfg.attention_bias
  out = {
      "input_layernorm": source.tensor(f"{p}.input_layernorm.weight", (h,)),
      "post_attention_layernorm": source.tensor(f"{p}.post_attention_layernorm.weight", (h,)),
      "q_proj": source.projection(f"{p}.self_attn.q_proj", nh * d, h, bias),
      "k_proj": source.projection(f"{p}.self_attn.k_proj", nkv * d, h, bias),
      "v_proj": source.projection(f"{p}.self_attn.v_proj", nkv * d, h, bias),
      "o_proj": source.projection(f"{p}.self_attn.o_proj", h, nh * d, bias),
  }
  if cfg.qk_norm == "per_head":
    out["q_norm"] = source.tensor(f"{p}.self_attn.q_norm.weight", (d,))
    out["k_norm"] = source.tensor(f"{p}.self_attn.k_norm.weight", (d,))
  elif cfg.qk_norm == "whole":
    out["q_norm"] = source.tensor(f"{p}.self_attn.q_norm.weight", (nh * d,))
    out["k_norm"] = source.tensor(f"{p}.self_attn.k_norm.weight", (nkv * d,))
  return out


def _dense_mlp(source, cfg: config_lib.DecoderConfig, index: int, dtype,
               linears: "_LinearBuilder") -> decoder.DenseMLP:
  p = f"model.layers.{index}.mlp"
  h, i = cfg.hidden_size, cfg.intermediate_size
  weights = {"gate_proj": source.projection(f"{p}.gate_proj", i, h),
             "up_proj": source.projection(f"{p}.up_proj", i, h),
             "down_proj": source.projection(f"{p}.down_proj", h, i)}
  return decoder.DenseMLP(linears.modules(weights, fuse={"gate_up_proj": ("gate_proj",
                                                                          "up_proj")}), dtype)


# ------------------------------------------------------------------ dense linears
_quantize_linear_jit = jax.jit(lambda w, g: _quantize_int4(w, g), static_argnums=1)


def _quantize_int4(w, group_size: int):
  from jax_moeq.quant.int4 import quantize_int4
  return quantize_int4(w, group_size)


def linear_group_size(in_features: int, preferred: int | None = None) -> int:
  """`preferred` (the experts' group size) when it divides `in_features`, else the largest of
  128 / 64 / 32 that does, else -1 (channel-wise)."""
  if preferred is not None and preferred != -1 and in_features % preferred == 0:
    return preferred
  for g in _GROUP_SIZES:
    if in_features % g == 0:
      return g
  return -1


class _LinearBuilder:
  """Turns a layer's projections (float `(weight, bias)` or checkpoint `Int4LinearWeights`) into
  modules: int4 ones (stored, or float quantized when `quantize_to` is set) become
  `QuantizedLinear`s, fused when their group size and act-order agree; float ones stay
  `(weight, bias)` for `decoder.Linear`."""

  def __init__(self, dtype, *, stored_scheme: str | None, quantize_to: str | None,
               group_size: int | None, allow_activation_quantization: bool,
               platform: str | None = None):
    self.dtype = dtype
    self.stored_scheme = stored_scheme
    self.quantize_to = quantize_to
    self.group_size = group_size
    self.allow = allow_activation_quantization
    self.platform = platform
    self.any_int4 = False

  def _int4(self, value) -> tuple[str, Any] | None:
    """(scheme, Int4LinearWeights) of a projection that runs int4, or None (float)."""
    from jax_moeq.linears import Int4LinearWeights
    if isinstance(value, Int4LinearWeights):
      return self.stored_scheme, value
    if self.quantize_to is None:
      return None
    w, b = value
    w = jnp.asarray(w, jnp.float32)
    g = linear_group_size(w.shape[1], self.group_size)
    q, scale = _quantize_linear_jit(w, g)
    bias = None if b is None else jnp.asarray(b, jnp.float32)
    return self.quantize_to, Int4LinearWeights(q, scale, g, bias=bias)

  def module(self, scheme: str, weights):
    from jax_moeq.nn.linear import QuantizedLinear
    self.any_int4 = True
    return QuantizedLinear(weights.in_features, weights.out_features, scheme=scheme,
                           weights=weights, dtype=self.dtype,
                           allow_activation_quantization=self.allow, platform=self.platform)

  def modules(self, values: dict[str, Any], fuse: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """`values` with int4 projections as modules; the `fuse` groups (fused name -> parts) that
    are all int4 of one scheme and compatible become one module under the fused name."""
    from jax_moeq.linears import concat_linears
    out = dict(values)
    int4 = {name: self._int4(value) for name, value in values.items()}
    for fused, parts in fuse.items():
      found = [int4[p] for p in parts]
      if any(f is None for f in found) or len({f[0] for f in found}) != 1:
        continue
      try:
        weights = concat_linears([f[1] for f in found])
      except ValueError as e:
        logger.debug("not fusing %s: %s", fused, e)
        continue
      for p in parts:
        del out[p]
        int4[p] = None
      out[fused] = self.module(found[0][0], weights)
    for name, found in int4.items():
      if found is not None:
        out[name] = self.module(*found)
    return out


_quantize_experts = jax.jit(lambda w13, w2, g: _quantize(w13, w2, g), static_argnums=2)


def _quantize(w13, w2, group_size: int):
  from jax_moeq.weights import FloatMoEWeights, quantize_moe_weights
  return quantize_moe_weights(FloatMoEWeights(w13, w2), group_size)


def _moe_block(layer, cfg: config_lib.DecoderConfig, dtype, *, scheme: str | None,
               quantize_to: str | None, group_size: int | None, moe_backend: str,
               allow_activation_quantization: bool, float_impl: str):
  """The layer's MoE block: int4 as stored, float quantized to `quantize_to`, or float."""
  from jax_moeq import nn as moe_nn
  opts = dict(renormalize=cfg.norm_topk_prob, dtype=dtype, param_dtype=dtype)
  if layer.quantized or quantize_to is None:
    extra = {} if layer.quantized else {"float_impl": float_impl}
    return moe_nn.moe_from_checkpoint_layer(
        layer, cfg.top_k, scheme=scheme, moe_backend=moe_backend,
        allow_activation_quantization=allow_activation_quantization, **extra, **opts)
  # One compiled quantizer per layer shape (eager jnp ops took ~70 s per Qwen3-30B layer).
  int4 = _quantize_experts(jnp.asarray(layer.w13, jnp.float32), jnp.asarray(layer.w2, jnp.float32),
                           group_size)
  e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  return moe_nn.QuantizedMoE(e, cfg.top_k, h, i, scheme=quantize_to, group_size=group_size,
                             moe_backend=moe_backend,
                             allow_activation_quantization=allow_activation_quantization,
                             weights=int4, router_weight=layer.router_weight, **opts)


def _plan_quantization(qcfg, cfg: config_lib.DecoderConfig, quantization: str | None,
                       group_size: int | None) -> tuple[str | None, str | None, int | None, bool]:
  """(scheme of stored int4 experts, scheme to quantize float experts to, group size,
  allow activation quantization)."""
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization={quantization!r} is not one of {QUANTIZATIONS} (or None: run "
                     "the checkpoint as stored)")
  if qcfg.quantized:
    stored = qcfg.scheme
    if group_size is not None and group_size != qcfg.group_size:
      raise ValueError(f"group_size={group_size}: the checkpoint is already int4 with group size "
                       f"{qcfg.group_size}")
    if quantization in (None, stored):
      return stored, None, qcfg.group_size, stored == "w4a8_int8"
    if quantization == "w4a8_int8":
      # Weight-only int4 experts on the W4A8 kernel: activations quantized per token on request.
      return stored, None, qcfg.group_size, True
    raise ValueError(f"quantization={quantization!r}: the checkpoint already holds {stored} int4 "
                     "experts, which cannot be re-quantized to another scheme; pass None")
  if quantization is None:
    if group_size is not None:
      raise ValueError("group_size is only used with quantization=...")
    return None, None, None, False
  g = default_group_size(cfg, quantization) if group_size is None else group_size
  if quantization == "mxint4" and g != 32:
    raise ValueError(f"quantization='mxint4' uses group_size=32, got {g}")
  return None, quantization, g, quantization == "w4a8_int8"


def _check_linear_options(quantize_linears: bool, lm_head_quantization: str | None,
                          attention_dtype) -> jnp.dtype | None:
  """ValueErrors for the linears' keywords; the attention dtype asked for (None: default)."""
  if not isinstance(quantize_linears, (bool, np.bool_)):
    raise TypeError(f"quantize_linears must be a bool, got {type(quantize_linears).__name__}")
  if lm_head_quantization not in LM_HEAD_QUANTIZATIONS:
    extra = (" (an int8 LM head is not built)" if str(lm_head_quantization).lower() == "int8"
             else "")
    raise ValueError(f"lm_head_quantization={lm_head_quantization!r} is not one of "
                     f"{LM_HEAD_QUANTIZATIONS}{extra}")
  if attention_dtype is None:
    return None
  try:
    dt = jnp.dtype(attention_dtype)
  except TypeError:
    dt = None
  if dt is None or dt.name not in _ATTENTION_DTYPES:
    raise ValueError(f"attention_dtype={attention_dtype!r} is not one of {_ATTENTION_DTYPES} "
                     "(or None: bfloat16 when a linear is int4, else the model's dtype)")
  return dt


def _linear_scheme(qcfg, quantization: str | None, quantize_linears: bool) -> tuple[
    str | None, str | None]:
  """(scheme of linears a checkpoint stores int4, scheme float linears are quantized to)."""
  stored = _LINEAR_SCHEMES.get(qcfg.scheme) if qcfg.quantized else None
  if not quantize_linears:
    return stored, None
  if quantization is not None:
    return stored, _LINEAR_SCHEMES[quantization]
  if stored is not None:
    return stored, stored
  raise ValueError("quantize_linears=True needs quantization='w4a8_int8' | 'wna16' | 'mxint4' "
                   "for a float checkpoint: the linears' scheme follows the experts' "
                   "(w4a8_int8 -> w4a8_int8, wna16 / mxint4 -> wna16)")


def _lm_head(source, cfg: config_lib.DecoderConfig, embed, dtype, linears: _LinearBuilder,
             lm_head_quantization: str | None):
  """The LM head: None (tied, float), a float [V, H] weight, or a `QuantizedLinear` (stored
  int4, or quantized with `lm_head_quantization="int4"`: W4A8 on a CPU, WNA16 elsewhere)."""
  from jax_moeq.linears import Int4LinearWeights
  from jax_moeq.oracle.base import current_platform
  h, v = cfg.hidden_size, cfg.vocab_size
  tied = cfg.tie_word_embeddings and not source.has("lm_head.weight") and not (
      hasattr(source, "ckpt") and any(f"lm_head.{s}" in source.ckpt
                                      for s in ("weight_packed", "qweight")))
  value = (np.asarray(embed), None) if tied else source.projection("lm_head", v, h)
  if isinstance(value, Int4LinearWeights):
    return linears.module(linears.stored_scheme, value)
  if lm_head_quantization != "int4":
    return None if tied else value[0]
  platform = linears.platform or current_platform()
  scheme = "w4a8_int8" if platform == "cpu" else "wna16"
  g = linear_group_size(h)
  q, scale = _quantize_linear_jit(jnp.asarray(value[0], jnp.float32), g)
  return linears.module(scheme, Int4LinearWeights(q, scale, g))


def build_model(cfg: config_lib.DecoderConfig, source, dtype, *, quantization: str | None = None,
                group_size: int | None = None, moe_backend: str = "auto", qcfg=None,
                allow_activation_quantization: bool | None = None, float_impl: str = "auto",
                generation_config: dict | None = None, show_progress: bool = True,
                shard: sharded_lib.ShardPlan | None = None, quantize_linears: bool = False,
                lm_head_quantization: str | None = None,
                attention_dtype=None) -> decoder.MoECausalLM:
  """Builds the model layer by layer from a tensor source (checkpoint or random); with `shard`,
  only this process's experts of each MoE layer are read, and the model is placed on its mesh.
  `quantize_linears`, `lm_head_quantization`, `attention_dtype`: see `from_pretrained`."""
  from jax_moeq.loaders import CheckpointQuantConfig, Progress
  qcfg = qcfg if qcfg is not None else CheckpointQuantConfig()
  attn_dt = _check_linear_options(quantize_linears, lm_head_quantization, attention_dtype)
  scheme, quantize_to, group_size, allow = _plan_quantization(qcfg, cfg, quantization,
                                                              group_size)
  stored_linears, linears_to = _linear_scheme(qcfg, quantization, bool(quantize_linears))
  if allow_activation_quantization is not None:
    allow = allow or allow_activation_quantization
  if shard is not None:
    sharded_lib.check_mesh_scheme(scheme, quantize_to)
  linears = _LinearBuilder(dtype, stored_scheme=stored_linears, quantize_to=linears_to,
                           group_size=group_size, allow_activation_quantization=allow)
  h, v = cfg.hidden_size, cfg.vocab_size
  embed = source.tensor("model.embed_tokens.weight", (v, h))
  layers = []
  desc = "loading layers" + (f" (quantizing experts to {quantize_to})" if quantize_to else "")
  with Progress(cfg.num_layers, desc, enabled=show_progress) as bar:
    for index in range(cfg.num_layers):
      weights = _attention_weights(source, cfg, index)
      projections = {k: weights.pop(k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")}
      weights.update(linears.modules(projections,
                                     fuse={"qkv_proj": ("q_proj", "k_proj", "v_proj")}))
      if cfg.sparse_layers[index] and shard is not None:
        mlp = sharded_lib.sharded_moe_block(
            source, index, cfg, dtype, shard, scheme=scheme, quantize_to=quantize_to,
            group_size=group_size, moe_backend=moe_backend,
            allow_activation_quantization=allow, quantize_fn=_quantize_experts)
      elif cfg.sparse_layers[index]:
        mlp = _moe_block(source.moe_layer(index), cfg, dtype, scheme=scheme,
                         quantize_to=quantize_to, group_size=group_size, moe_backend=moe_backend,
                         allow_activation_quantization=allow, float_impl=float_impl)
      else:
        mlp = _dense_mlp(source, cfg, index, dtype, linears)
      layers.append(decoder.DecoderLayer(cfg, weights, mlp, dtype))
      bar.update(note=f"layer {index}")
  norm = source.tensor("model.norm.weight", (h,))
  lm_head = _lm_head(source, cfg, embed, dtype, linears, lm_head_quantization)
  # The whole-int4 path runs attention in bf16; float models keep their dtype (and so match
  # transformers in float32).
  if attn_dt is None:
    attn_dt = jnp.dtype(jnp.bfloat16) if linears.any_int4 else jnp.dtype(dtype)
  for layer in layers:
    layer.self_attn.attention_dtype = attn_dt
  model = decoder.MoECausalLM(cfg, embed, layers, norm, lm_head, dtype,
                              generation_config=generation_config,
                              quantization=quantize_to or scheme, attention_dtype=attn_dt)
  if shard is not None:
    sharded_lib.replicate_on_mesh(model, shard.mesh)
  return model


def from_pretrained(path: str | Path, *, dtype=None, quantization: str | None = None,
                    moe_backend: str = "auto", group_size: int | None = None,
                    allow_activation_quantization: bool | None = None, float_impl: str = "auto",
                    show_progress: bool = True, mesh=None, expert_axis: str | None = "ep",
                    tensor_axis: str | None = None, dispatch: str = "replicated",
                    capacity_factor: float | None = 2.0, quantize_linears: bool = False,
                    lm_head_quantization: str | None = None,
                    attention_dtype=None) -> decoder.MoECausalLM:
  """Loads a Hugging Face MoE checkpoint directory (qwen3_moe, mixtral, olmoe) as an NNX model.

  Args:
    path: a directory with `config.json` and `model.safetensors` or a sharded
      `model.safetensors.index.json`; `generation_config.json` is read when present.
    dtype: activations and float weights (default: the checkpoint's dtype; bf16 on a GPU when
      the checkpoint is float32).
    quantization: None runs the checkpoint as stored: float experts stay float, int4 experts
      (GPTQ, compressed-tensors pack-quantized W4A16 / W4A8-int, MxInt4) run on their scheme's
      backend. "w4a8_int8" | "wna16" | "mxint4" quantize float experts while loading, one layer
      at a time (round-to-nearest symmetric int4, SPEC §2). "w4a8_int8" on a weight-only int4
      checkpoint runs its int4 experts on the W4A8 kernel (int8 activations per token).
    moe_backend: "auto" (the scheme's oracle picks for the platform) or a backend name
      ("cpu_int4", "reference", "marlin", "mxint4_gpu", ...).
    group_size: for quantization on load (default: 128, or the largest of 64/32 dividing H and
      I; 32 for mxint4).
    allow_activation_quantization: let weight-only int4 experts run on the CPU W4A8 kernel
      (default: only when the checkpoint or `quantization` is W4A8).
    float_impl: the computation of float MoE blocks ("auto", "gather", "dense", "ragged_dot";
      `jax_moeq.nn.MoE`).
    mesh: a `jax.sharding.Mesh` (CPU or GPU devices, `jax_moeq.sharding.make_mesh`) to split
      the experts over (expert and/or tensor parallelism, `jax_moeq.sharding.moe_sharded`).
      Each process reads only the experts of its own devices' EP ranks (rank r: experts
      [r*E/n_ep, (r+1)*E/n_ep); of stacked [E, ...] tensors only those rows' bytes), and each
      device's share is prepared by the experts class the scheme's oracle chose for one shard
      (`moe_backend` as without a mesh), on that device. Float checkpoints need a
      `quantization`. The other weights are replicated over the mesh; when the batch divides
      the mesh, attention and the KV cache run data-parallel over it. Under
      `jax.distributed`, every process calls `from_pretrained` with the same global mesh.
    expert_axis, tensor_axis: mesh axis names for EP and TP (None: not split that way).
    dispatch: "replicated", "all_to_all" or "ragged_all_to_all" (GPU / TPU meshes) token
      dispatch (`jax_moeq.sharding.moe_sharded`).
    capacity_factor: the dispatch's capacity (`moe_sharded`).
    quantize_linears: also quantize float attention q/k/v/o and dense-MLP linears on load
      (round to nearest, SPEC §2) to the linear scheme of `quantization` (w4a8_int8 ->
      w4a8_int8; wna16 / mxint4 -> wna16), with the experts' group size when it divides the
      linear's input, else the largest of 128 / 64 / 32 that does, else channel-wise. Needs
      `quantization` on a float checkpoint. Linears an int4 checkpoint stores int4 run int4
      whatever this says (on the checkpoint's scheme: "wna16" for weight-only, "w4a8_int8" for
      W4A8-int; weight-only ones on the CPU W4A8 kernel when activation quantization is
      allowed, as the experts); those its `ignore` list names stay float; routers always do.
    lm_head_quantization: None (float head) or "int4" (W4A8 on a CPU, WNA16 elsewhere; group
      128 or the largest dividing H; tied embeddings: a quantized copy, the embedding table
      stays float).
    attention_dtype: dtype of the KV cache and the attention math ("float32", "bfloat16",
      "float16"); default bfloat16 when any linear is int4, else `dtype`.

  Returns:
    `MoECausalLM`: `model(input_ids [B, S]) -> logits [B, S, vocab]` (float32), jittable.
  """
  from jax_moeq.loaders import parse_quantization_config
  path = Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"{path} is not a checkpoint directory")
  cfg_json = read_json(path / "config.json")
  generation = read_json(path / "generation_config.json", required=False)
  cfg = decoder_config(cfg_json, generation, source=str(path / "config.json"))
  try:
    qcfg = parse_quantization_config(cfg_json.get("quantization_config"))
  except ValueError as e:
    raise config_lib.ConfigError(f"{path / 'config.json'}: {e}") from None
  dt = resolve_dtype(dtype, cfg)
  shard = None
  if mesh is not None:
    _, _, g, _ = _plan_quantization(qcfg, cfg, quantization, group_size)
    shard = sharded_lib.make_plan(mesh, cfg, expert_axis=expert_axis, tensor_axis=tensor_axis,
                                  dispatch=dispatch, capacity_factor=capacity_factor,
                                  moe_backend=moe_backend, group_size=g)
  source = _CheckpointSource(path, cfg, qcfg)
  model = build_model(cfg, source, dt, quantization=quantization, group_size=group_size,
                      moe_backend=moe_backend, qcfg=qcfg,
                      allow_activation_quantization=allow_activation_quantization,
                      float_impl=float_impl, generation_config=generation,
                      show_progress=show_progress, shard=shard,
                      quantize_linears=quantize_linears,
                      lm_head_quantization=lm_head_quantization,
                      attention_dtype=attention_dtype)
  logger.info("loaded %s (%s, %d layers) from %s: experts %s, linears %s", cfg.model_type, dt,
              cfg.num_layers, path, model.moe_backends(), model.linear_backends())
  return model


def from_config(config_json: Mapping[str, Any], *, dtype="float32", quantization: str | None = None,
                group_size: int | None = None, moe_backend: str = "auto", seed: int = 0,
                allow_activation_quantization: bool | None = None, float_impl: str = "auto",
                show_progress: bool = False, quantize_linears: bool = False,
                lm_head_quantization: str | None = None,
                attention_dtype=None, mesh=None, expert_axis: str | None = "ep",
                tensor_axis: str | None = None, dispatch: str = "replicated",
                capacity_factor: float | None = 2.0) -> decoder.MoECausalLM:
  """A model of a `config.json` dict with random weights (std 0.02), built layer by layer
  (keywords as `from_pretrained`). With a `mesh`, each device draws and prepares only its own
  experts (expert e from the layer's key folded with e: the same model on every mesh)."""
  cfg = decoder_config(config_json)
  dt = resolve_dtype(dtype, cfg)
  shard = None
  if mesh is not None:
    from jax_moeq.loaders import CheckpointQuantConfig
    _, _, g, _ = _plan_quantization(CheckpointQuantConfig(), cfg, quantization, group_size)
    shard = sharded_lib.make_plan(mesh, cfg, expert_axis=expert_axis, tensor_axis=tensor_axis,
                                  dispatch=dispatch, capacity_factor=capacity_factor,
                                  moe_backend=moe_backend, group_size=g)
  return build_model(cfg, _RandomSource(cfg, seed, dt), dt, quantization=quantization,
                     group_size=group_size, moe_backend=moe_backend,
                     allow_activation_quantization=allow_activation_quantization,
                     float_impl=float_impl, show_progress=show_progress,
                     quantize_linears=quantize_linears,
                     lm_head_quantization=lm_head_quantization, attention_dtype=attention_dtype,
                     shard=shard)
