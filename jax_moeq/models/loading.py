"""`from_pretrained`: a Hugging Face MoE checkpoint directory -> `MoECausalLM`, layer by layer.

The route from weights to kernel is the blocks' own: each layer's experts become a
`jax_moeq.nn.QuantizedMoE` (int4 checkpoints, or float experts quantized while loading; the
scheme's oracle picks the backend for the platform) or a float `jax_moeq.nn.MoE`. Everything
else (embeddings, attention, norms, dense MLPs, LM head) is float in `dtype`; linear layers that a
checkpoint quantized are dequantized on load. Only one layer's float experts are held at a time.

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
_GROUP_SIZES = (128, 64, 32)


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
  if model_type not in ARCHITECTURES:
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
      "q_proj": source.linear(f"{p}.self_attn.q_proj", nh * d, h, bias),
      "k_proj": source.linear(f"{p}.self_attn.k_proj", nkv * d, h, bias),
      "v_proj": source.linear(f"{p}.self_attn.v_proj", nkv * d, h, bias),
      "o_proj": source.linear(f"{p}.self_attn.o_proj", h, nh * d, bias),
  }
  if cfg.qk_norm == "per_head":
    out["q_norm"] = source.tensor(f"{p}.self_attn.q_norm.weight", (d,))
    out["k_norm"] = source.tensor(f"{p}.self_attn.k_norm.weight", (d,))
  elif cfg.qk_norm == "whole":
    out["q_norm"] = source.tensor(f"{p}.self_attn.q_norm.weight", (nh * d,))
    out["k_norm"] = source.tensor(f"{p}.self_attn.k_norm.weight", (nkv * d,))
  return out


def _dense_mlp(source, cfg: config_lib.DecoderConfig, index: int, dtype) -> decoder.DenseMLP:
  p = f"model.layers.{index}.mlp"
  h, i = cfg.hidden_size, cfg.intermediate_size
  return decoder.DenseMLP({"gate_proj": source.linear(f"{p}.gate_proj", i, h),
                           "up_proj": source.linear(f"{p}.up_proj", i, h),
                           "down_proj": source.linear(f"{p}.down_proj", h, i)}, dtype)


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


def build_model(cfg: config_lib.DecoderConfig, source, dtype, *, quantization: str | None = None,
                group_size: int | None = None, moe_backend: str = "auto", qcfg=None,
                allow_activation_quantization: bool | None = None, float_impl: str = "auto",
                generation_config: dict | None = None, show_progress: bool = True,
                shard: sharded_lib.ShardPlan | None = None) -> decoder.MoECausalLM:
  """Builds the model layer by layer from a tensor source (checkpoint or random); with `shard`,
  only this process's experts of each MoE layer are read, and the model is placed on its mesh."""
  from jax_moeq.loaders import CheckpointQuantConfig, Progress
  qcfg = qcfg if qcfg is not None else CheckpointQuantConfig()
  scheme, quantize_to, group_size, allow = _plan_quantization(qcfg, cfg, quantization,
                                                              group_size)
  if allow_activation_quantization is not None:
    allow = allow or allow_activation_quantization
  if shard is not None:
    sharded_lib.check_w4a8(scheme, quantize_to, allow)
  h, v = cfg.hidden_size, cfg.vocab_size
  embed = source.tensor("model.embed_tokens.weight", (v, h))
  layers = []
  desc = "loading layers" + (f" (quantizing experts to {quantize_to})" if quantize_to else "")
  with Progress(cfg.num_layers, desc, enabled=show_progress) as bar:
    for index in range(cfg.num_layers):
      weights = _attention_weights(source, cfg, index)
      if cfg.sparse_layers[index] and shard is not None:
        mlp = sharded_lib.sharded_moe_block(
            source.moe_layer(index, shard.experts(cfg.num_experts)), cfg, dtype, shard,
            quantize_to=quantize_to, group_size=group_size, quantize_fn=_quantize_experts)
      elif cfg.sparse_layers[index]:
        mlp = _moe_block(source.moe_layer(index), cfg, dtype, scheme=scheme,
                         quantize_to=quantize_to, group_size=group_size, moe_backend=moe_backend,
                         allow_activation_quantization=allow, float_impl=float_impl)
      else:
        mlp = _dense_mlp(source, cfg, index, dtype)
      layers.append(decoder.DecoderLayer(cfg, weights, mlp, dtype))
      bar.update(note=f"layer {index}")
  norm = source.tensor("model.norm.weight", (h,))
  lm_head = None
  if not cfg.tie_word_embeddings or source.has("lm_head.weight"):
    lm_head = source.linear("lm_head", v, h)[0]
  model = decoder.MoECausalLM(cfg, embed, layers, norm, lm_head, dtype,
                              generation_config=generation_config,
                              quantization=quantize_to or scheme)
  if shard is not None:
    sharded_lib.replicate_on_mesh(model, shard.mesh)
  return model


def from_pretrained(path: str | Path, *, dtype=None, quantization: str | None = None,
                    moe_backend: str = "auto", group_size: int | None = None,
                    allow_activation_quantization: bool | None = None, float_impl: str = "auto",
                    show_progress: bool = True, mesh=None, expert_axis: str | None = "ep",
                    tensor_axis: str | None = None, dispatch: str = "replicated",
                    capacity_factor: float | None = 2.0) -> decoder.MoECausalLM:
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
    mesh: a `jax.sharding.Mesh` of CPU devices (`jax_moeq.sharding.make_mesh`) to split the
      experts over (expert and/or tensor parallelism, `jax_moeq.sharding`). Each process reads
      only the experts of its own devices' EP ranks (rank r: experts [r*E/n_ep, (r+1)*E/n_ep);
      of stacked [E, ...] tensors only those rows' bytes) and places them on those devices; the
      other weights are replicated over the mesh. The experts run on the CPU W4A8 kernel:
      float checkpoints need quantization="w4a8_int8", weight-only int4 ones
      quantization="w4a8_int8" (or allow_activation_quantization=True). Under
      `jax.distributed`, every process calls `from_pretrained` with the same global mesh.
    expert_axis, tensor_axis: mesh axis names for EP and TP (None: not split that way).
    dispatch: "replicated" or "all_to_all" token dispatch (`jax_moeq.sharding.w4a8_moe_sharded`).
    capacity_factor: the dispatch's capacity (`w4a8_moe_sharded`).

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
                      show_progress=show_progress, shard=shard)
  logger.info("loaded %s (%s, %d layers) from %s: experts %s", cfg.model_type, dt,
              cfg.num_layers, path, model.moe_backends())
  return model


def from_config(config_json: Mapping[str, Any], *, dtype="float32", quantization: str | None = None,
                group_size: int | None = None, moe_backend: str = "auto", seed: int = 0,
                allow_activation_quantization: bool | None = None, float_impl: str = "auto",
                show_progress: bool = False) -> decoder.MoECausalLM:
  """A model of a `config.json` dict with random weights (std 0.02), built layer by layer."""
  cfg = decoder_config(config_json)
  dt = resolve_dtype(dtype, cfg)
  return build_model(cfg, _RandomSource(cfg, seed, dt), dt, quantization=quantization,
                     group_size=group_size, moe_backend=moe_backend,
                     allow_activation_quantization=allow_activation_quantization,
                     float_impl=float_impl, show_progress=show_progress)
