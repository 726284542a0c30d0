"""`DecoderConfig`: what the model runtime needs from a Hugging Face `config.json`.

Each architecture module (`qwen3_moe.py`, `mixtral.py`, `olmoe.py`) turns its `config.json` into
one `DecoderConfig`; the decoder and the loader read only this. Key spellings differ between
transformers versions (`rope_theta` vs `rope_parameters.rope_theta`, `num_experts` vs
`num_local_experts`, `torch_dtype` vs `dtype`): `read_key` takes the first spelling present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

QK_NORMS = ("none", "per_head", "whole")
_MISSING = object()
DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


class ConfigError(ValueError):
  """A `config.json` that the runtime cannot use; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """A decoder-only MoE transformer (pre-norm, RMSNorm, GQA with RoPE, MoE or dense MLPs).

  `sparse_layers[i]` says whether layer i has an MoE block (else a dense MLP of
  `intermediate_size`). `qk_norm`: "none", "per_head" (RMSNorm over head_dim of each head,
  Qwen3) or "whole" (RMSNorm over the whole q / k projection, OLMoE).
  """
  model_type: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float
  rope_theta: float
  num_experts: int
  top_k: int
  moe_intermediate_size: int
  norm_topk_prob: bool
  sparse_layers: tuple[bool, ...]
  intermediate_size: int | None = None  # dense MLP layers
  qk_norm: str = "none"
  attention_bias: bool = False
  sliding_window: int | None = None
  clip_qkv: float | None = None
  tie_word_embeddings: bool = False
  max_position_embeddings: int | None = None
  dtype: str | None = None  # the checkpoint's own dtype name
  # Checkpoint tensor names: the MoE block's module under each layer, the expert projections.
  moe_module: str = "mlp"
  expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  bos_token_id: int | None = None
  eos_token_id: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __post_init__(self):
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "num_experts", "top_k", "moe_intermediate_size")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
    if self.top_k > self.num_experts:
      raise ConfigError(f"config.json: num_experts_per_tok={self.top_k} exceeds the number of "
                        f"experts {self.num_experts}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                        f"num_key_value_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"config.json: head_dim={self.head_dim} must be even for RoPE")
    if self.qk_norm not in QK_NORMS:
      raise ConfigError(f"qk_norm={self.qk_norm!r} is not one of {QK_NORMS}")
    if len(self.sparse_layers) != self.num_layers:
      raise ConfigError(f"sparse_layers has {len(self.sparse_layers)} entries for "
                        f"{self.num_layers} layers")
    if not all(self.sparse_layers) and not self.intermediate_size:
      raise ConfigError("config.json: dense MLP layers need intermediate_size")
    if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
      raise ConfigError(f"config.json: rms_norm_eps={self.rms_norm_eps} and rope_theta="
                        f"{self.rope_theta} must be positive")
    if self.dtype is not None and self.dtype not in DTYPES:
      raise ConfigError(f"config.json: dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

  @property
  def num_sparse_layers(self) -> int:
    return sum(self.sparse_layers)

  def moe_prefix(self, layer: int) -> str:
    return f"model.layers.{layer}.{self.moe_module}"


def read_key(cfg: Mapping[str, Any], keys: Sequence[str], default: Any = _MISSING, *,
             kind: type | tuple[type, ...] | None = None) -> Any:
  """The value of the first of `keys` present (and not null) in `cfg`.

  Dotted keys look into nested objects (`rope_parameters.rope_theta`). Raises `ConfigError`
  naming every spelling tried when none is present and there is no default, and naming the key
  when the value has the wrong JSON type.
  """
  for key in keys:
    node: Any = cfg
    for part in key.split("."):
      node = node.get(part) if isinstance(node, Mapping) else None
    if node is None:
      continue
    if kind is not None:
      ok = isinstance(node, kind) and not (isinstance(node, bool) and bool not in _as_tuple(kind))
      if not ok:
        raise ConfigError(f"config.json: {key}={node!r} has type {type(node).__name__}, "
                          f"expected {_type_names(kind)}")
    return node
  if default is _MISSING:
    raise ConfigError(f"config.json has no {' / '.join(keys)}")
  return default


def _as_tuple(kind) -> tuple[type, ...]:
  return kind if isinstance(kind, tuple) else (kind,)


def _type_names(kind) -> str:
  return " or ".join(t.__name__ for t in _as_tuple(kind))


INT = int
NUMBER = (int, float)


def rope_theta(cfg: Mapping[str, Any], default: float = 10000.0) -> float:
  """RoPE base from `rope_theta` or transformers 5's `rope_parameters`; other RoPE types raise."""
  for key in ("rope_parameters", "rope_scaling"):
    params = cfg.get(key)
    if params is None:
      continue
    if not isinstance(params, Mapping):
      raise ConfigError(f"config.json: {key} must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
      raise ConfigError(f"config.json: {key}.rope_type={rope_type!r} is not supported (only "
                        "'default' RoPE)")
  return float(read_key(cfg, ("rope_parameters.rope_theta", "rope_theta"), default, kind=NUMBER))


def token_ids(value: Any, key: str) -> tuple[int, ...]:
  """An id or list of ids (`eos_token_id`) as a tuple; null -> ()."""
  if value is None:
    return ()
  values = value if isinstance(value, list) else [value]
  for v in values:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
      raise ConfigError(f"{key}={value!r}: token ids must be non-negative integers")
  return tuple(values)


def common_fields(cfg: Mapping[str, Any], generation: Mapping[str, Any] | None) -> dict[str, Any]:
  """The fields every architecture reads the same way."""
  hidden = read_key(cfg, ("hidden_size",), kind=INT)
  heads = read_key(cfg, ("num_attention_heads",), kind=INT)
  if heads < 1 or hidden % heads and read_key(cfg, ("head_dim",), None) is None:
    raise ConfigError(f"config.json: hidden_size={hidden} is not a multiple of "
                      f"num_attention_heads={heads} and head_dim is not given")
  gen = generation or {}
  eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
  pad = gen.get("pad_token_id", cfg.get("pad_token_id"))
  bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
  dtype = read_key(cfg, ("dtype", "torch_dtype"), None, kind=str)
  return dict(
      vocab_size=read_key(cfg, ("vocab_size",), kind=INT),
      hidden_size=hidden,
      num_layers=read_key(cfg, ("num_hidden_layers",), kind=INT),
      num_heads=heads,
      num_kv_heads=read_key(cfg, ("num_key_value_heads",), heads, kind=INT),
      head_dim=read_key(cfg, ("head_dim",), hidden // max(heads, 1), kind=INT),
      rms_norm_eps=float(read_key(cfg, ("rms_norm_eps",), 1e-6, kind=NUMBER)),
      rope_theta=rope_theta(cfg),
      tie_word_embeddings=bool(read_key(cfg, ("tie_word_embeddings",), False, kind=bool)),
      max_position_embeddings=read_key(cfg, ("max_position_embeddings",), None, kind=INT),
      dtype=dtype,
      attention_bias=bool(read_key(cfg, ("attention_bias",), False, kind=bool)),
      bos_token_id=token_ids(bos, "bos_token_id")[0] if token_ids(bos, "bos_token_id") else None,
      eos_token_id=token_ids(eos, "eos_token_id"),
      pad_token_id=token_ids(pad, "pad_token_id")[0] if token_ids(pad, "pad_token_id") else None,
  )


def check_activation(cfg: Mapping[str, Any]) -> None:
  act = read_key(cfg, ("hidden_act",), "silu", kind=str)
  if act != "silu":
    raise ConfigError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
