"""`config.json` parsing: the MoE shape of a model and its `quantization_config`.

Supported `quantization_config`s (anything else raises ValueError naming the field):
- compressed-tensors, `format: pack-quantized`, int weights of 4 bits, `symmetric: true`, `strategy`
  `group` (group_size 32/64/128) or `channel`; `input_activations` absent (W4A16) or dynamic
  per-token int8 (W4A8-int; the kernel quantizes rows dynamically, so the activations' own
  `symmetric` flag stores no data and both values load). `actorder: group` stores `weight_g_idx`.
- GPTQ (`quant_method: gptq`): `bits: 4`, `sym: true`, `group_size` 32/64/128/-1, `desc_act`.
- MxInt4: compressed-tensors W4A16 with `group_size: 32` and bf16 scales; `weight_packed` either
  uint4b8 int32 or signed-nibble uint8 (see `int4_format`). `quant_method: mxint4` is accepted as an
  explicit name for the same layout.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping

from jax_moeq.loaders.safetensors_io import parse_json_bytes, read_bounded

SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
SCHEMES = ("w4a8_int8", "wna16", "mxint4")
MAX_CONFIG_BYTES = 16 << 20


class ConfigError(ValueError):
  """A `config.json` (or its `quantization_config`) that is malformed or that we do not support."""


class MissingFieldError(ConfigError):
  """A `config.json` without a field we need (e.g. not an MoE model's config)."""


def match_module_name(name: str, pattern: str) -> bool:
  """compressed-tensors' name matching: `re:` + a regex anchored at the start, else equality."""
  if pattern.startswith("re:"):
    try:
      return re.match(pattern[3:], name) is not None
    except re.error as e:
      raise ConfigError(f"quantization_config pattern {pattern!r} is not a valid regex: "
                        f"{e}") from None
  return pattern == name


@dataclasses.dataclass(frozen=True)
class CheckpointQuantConfig:
  """What the loader needs from `quantization_config`.

  quant_method: "compressed-tensors", "gptq", "mxint4", or "none" (float checkpoint).
  group_size: 32/64/128, or -1 for channel-wise; None for float checkpoints.
  act_order: g_idx tensors may permute input channels (GPTQ desc_act / compressed-tensors
    actorder=group).
  activation_bits: 8 for W4A8-int checkpoints (dynamic per-token int8), None for weight-only.
  scheme: the module scheme this checkpoint maps to by default.
  """

  quant_method: str = "none"
  group_size: int | None = None
  act_order: bool = False
  activation_bits: int | None = None
  scheme: str | None = None
  gptq_v2_zeros: bool = False
  ignore: tuple[str, ...] = ()
  targets: tuple[str, ...] = ()

  @property
  def quantized(self) -> bool:
    return self.quant_method != "none"

  def is_ignored(self, module: str) -> bool:
    """Whether compressed-tensors' `ignore` list names this module (by name or `re:` regex).

    Class-name entries (e.g. "Embedding") cannot be matched from a checkpoint and are skipped.
    """
    return any(match_module_name(module, p) for p in self.ignore)

  def quantizes(self, module: str) -> bool:
    """Whether the config asks for `module` (e.g. "model.layers.0.self_attn.q_proj") quantized.

    True unless ignored, or unless the targets are all `re:` patterns and none matches (a class
    name target such as "Linear" covers every linear layer). Checkpoints still decide per layer
    from their tensors: see `quantized.read_linear`.
    """
    if not self.quantized or self.is_ignored(module):
      return False
    regexes = [t for t in self.targets if t.startswith("re:")]
    if self.targets and len(regexes) == len(self.targets):
      return any(match_module_name(module, t) for t in regexes)
    return True

  def to_json(self) -> dict[str, Any] | None:
    """The `quantization_config` our writer stores for this config (None when float)."""
    if not self.quantized:
      return None
    if self.quant_method == "gptq":
      return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size,
              "desc_act": self.act_order, "sym": True, "checkpoint_format": "gptq"}
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False,
               "strategy": "channel" if self.group_size == -1 else "group",
               "group_size": None if self.group_size == -1 else self.group_size,
               "actorder": "group" if self.act_order else None}
    activations = None
    if self.activation_bits == 8:
      activations = {"num_bits": 8, "type": "int", "symmetric": False, "dynamic": True,
                     "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": list(self.ignore),
            "config_groups": {"group_0": {"targets": list(self.targets or ("Linear",)),
                                          "weights": weights,
                                          "input_activations": activations}}}


def _require(cond: bool, field: str, value: Any, want: str) -> None:
  if not cond:
    raise ConfigError(f"unsupported quantization_config: {field}={_short(value)} ({want})")


def _short(value: Any, limit: int = 120) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def _mapping(value: Any, field: str, *, optional: bool = False) -> Mapping[str, Any] | None:
  if value is None and optional:
    return None
  if not isinstance(value, Mapping):
    raise ConfigError(f"quantization_config: {field} must be a JSON object, got "
                      f"{type(value).__name__} {_short(value)}")
  return value


def _str_list(value: Any, field: str) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    value = [value]
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise ConfigError(f"quantization_config: {field} must be a list of strings, got "
                      f"{_short(value)}")
  return tuple(value)


def _bool(value: Any, field: str, default: bool) -> bool:
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ConfigError(f"quantization_config: {field} must be true or false, got {_short(value)}")
  return value


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _group_size_from(field: str, value: Any) -> int:
  _require(_is_int(value) and value in SUPPORTED_GROUP_SIZES, field, value,
           f"expected one of {SUPPORTED_GROUP_SIZES}")
  return int(value)


def _parse_activations(a: Mapping[str, Any], gname: str) -> int:
  field = f"{gname}.input_activations"
  _require(a.get("num_bits") == 8 and _is_int(a.get("num_bits")), f"{field}.num_bits",
           a.get("num_bits"), "only 8-bit activations (W4A8-int) are supported")
  _require(a.get("type", "int") == "int", f"{field}.type", a.get("type"),
           "only int8 activations are supported")
  _require(a.get("strategy") == "token", f"{field}.strategy", a.get("strategy"),
           "only per-token activation scales are supported")
  _require(a.get("dynamic") is True, f"{field}.dynamic", a.get("dynamic"),
           "only dynamic activation quantization is supported (static scales are not)")
  _bool(a.get("symmetric"), f"{field}.symmetric", False)
  return 8


def _parse_weights(w: Mapping[str, Any], gname: str) -> tuple[int, bool]:
  """-> (group_size, act_order) of a compressed-tensors weights section."""
  field = f"{gname}.weights"
  _require(w.get("num_bits") == 4 and _is_int(w.get("num_bits")), f"{field}.num_bits",
           w.get("num_bits"), "only 4-bit weights are supported")
  _require(w.get("type", "int") == "int", f"{field}.type", w.get("type"),
           "only int weights are supported")
  _require(w.get("symmetric", True) is True, f"{field}.symmetric", w.get("symmetric"),
           "only symmetric int4 weights are supported (no zero points)")
  _require(not _bool(w.get("dynamic"), f"{field}.dynamic", False), f"{field}.dynamic",
           w.get("dynamic"), "weights must be statically quantized")
  strategy = w.get("strategy")
  _require(strategy in ("group", "channel"), f"{field}.strategy", strategy,
           "expected 'group' or 'channel'")
  if strategy == "channel":
    _require(w.get("group_size") in (None, -1), f"{field}.group_size", w.get("group_size"),
             "strategy 'channel' has no group size")
    group_size = -1
  else:
    group_size = _group_size_from(f"{field}.group_size", w.get("group_size"))
    _require(group_size != -1, f"{field}.group_size", -1,
             "strategy 'group' needs a positive group size")
  actorder = w.get("actorder")
  _require(actorder in (None, "group", "weight", "static", "dynamic", False), f"{field}.actorder",
           actorder, "expected null, 'weight', 'static', 'group' or 'dynamic'")
  return group_size, actorder in ("group", "dynamic")


def _parse_compressed_tensors(qc: Mapping[str, Any], method: str) -> CheckpointQuantConfig:
  groups = qc.get("config_groups")
  _require(isinstance(groups, Mapping) and len(groups) > 0, "quantization_config.config_groups",
           groups, "expected a non-empty mapping of scheme groups")
  items = [(name, _mapping(g, f"config_groups.{name}")) for name, g in groups.items()]
  targets = tuple(t for name, g in items for t in _str_list(g.get("targets"),
                                                            f"config_groups.{name}.targets"))
  first = {k: v for k, v in items[0][1].items() if k != "targets"}
  for name, group in items[1:]:
    other = {k: v for k, v in group.items() if k != "targets"}
    _require(other == first, f"quantization_config.config_groups.{name}", "…",
             "all groups must use the same scheme; mixed schemes are not supported")
  gname = f"quantization_config.config_groups.{items[0][0]}"
  group = items[0][1]
  fmt = group.get("format") or qc.get("format")
  _require(fmt == "pack-quantized", "quantization_config.format", fmt,
           "only 'pack-quantized' int4 is supported")
  w = group.get("weights")
  _require(isinstance(w, Mapping), f"{gname}.weights", w, "weight quantization args are required")
  group_size, act_order = _parse_weights(w, gname)
  a = _mapping(group.get("input_activations"), f"config_groups.{items[0][0]}.input_activations",
               optional=True)
  act_bits = None if a is None else _parse_activations(a, gname)
  _require(group.get("output_activations") is None, f"{gname}.output_activations",
           group.get("output_activations"), "output activation quantization is not supported")
  if method == "mxint4":
    _require(group_size == 32, f"{gname}.weights.group_size", group_size,
             "MxInt4 uses groups of 32")
    scheme = "mxint4"
  else:
    scheme = "w4a8_int8" if act_bits == 8 else "wna16"
  ignore = _str_list(qc.get("ignore"), "ignore")
  for pattern in ignore + targets:
    match_module_name("", pattern)  # a bad regex is an error now, not at first use
  return CheckpointQuantConfig(
      quant_method=method, group_size=group_size, act_order=act_order,
      activation_bits=act_bits, scheme=scheme, ignore=ignore, targets=targets)


def _parse_gptq(qc: Mapping[str, Any]) -> CheckpointQuantConfig:
  _require(qc.get("bits") == 4 and _is_int(qc.get("bits")), "quantization_config.bits",
           qc.get("bits"), "only 4-bit GPTQ is supported")
  _require(qc.get("sym", True) is True, "quantization_config.sym", qc.get("sym"),
           "only symmetric GPTQ is supported (asymmetric zero points are not)")
  group_size = _group_size_from("quantization_config.group_size", qc.get("group_size", 128))
  fmt = qc.get("checkpoint_format", "gptq")
  _require(fmt in ("gptq", "gptq_v2"), "quantization_config.checkpoint_format", fmt,
           "expected 'gptq' or 'gptq_v2'")
  desc_act = _bool(qc.get("desc_act"), "quantization_config.desc_act", False)
  return CheckpointQuantConfig(
      quant_method="gptq", group_size=group_size, act_order=desc_act,
      scheme="wna16", gptq_v2_zeros=fmt == "gptq_v2")


def parse_quantization_config(qc: Mapping[str, Any] | None) -> CheckpointQuantConfig:
  """Parses `config.json["quantization_config"]` (None -> float checkpoint).

  Raises `ConfigError` (a ValueError) naming the field for anything malformed or unsupported.
  """
  if qc is None:
    return CheckpointQuantConfig()
  if not isinstance(qc, Mapping):
    raise ConfigError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
  method = qc.get("quant_method")
  if method in ("compressed-tensors", "compressed_tensors", "mxint4"):
    return _parse_compressed_tensors(qc, "mxint4" if method == "mxint4" else "compressed-tensors")
  if method == "gptq":
    return _parse_gptq(qc)
  raise ConfigError(
      f"unsupported quantization_config: quant_method={_short(method)} (expected "
      "'compressed-tensors', 'gptq' or 'mxint4')")


@dataclasses.dataclass(frozen=True)
class MoEModelConfig:
  """The MoE fields of a Hugging Face `config.json` (Mixtral / Qwen-MoE / OLMoE / DeepSeek)."""

  num_experts: int
  top_k: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  renormalize: bool = True
  scoring_func: str = "softmax"
  num_expert_group: int | None = None
  topk_group: int | None = None
  routed_scaling_factor: float = 1.0
  activation: str = "silu"

  def to_json(self) -> dict[str, Any]:
    out = {"num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
           "hidden_size": self.hidden_size, "moe_intermediate_size": self.intermediate_size,
           "num_hidden_layers": self.num_layers, "norm_topk_prob": self.renormalize,
           "scoring_func": self.scoring_func, "routed_scaling_factor": self.routed_scaling_factor,
           "hidden_act": "silu" if self.activation == "silu" else self.activation}
    if self.num_expert_group is not None:
      out["n_group"] = self.num_expert_group
      out["topk_group"] = self.topk_group
    return out


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...], what: str,
           default: Any = KeyError) -> tuple[str | None, Any]:
  """(key, value) of the first of `keys` set in `cfg`, else (None, default)."""
  for k in keys:
    if cfg.get(k) is not None:
      return k, cfg[k]
  if default is KeyError:
    raise MissingFieldError(f"config.json has no {what} (looked for {', '.join(keys)})")
  return None, default


def _int(cfg: Mapping[str, Any], keys: tuple[str, ...], what: str, default: Any = KeyError,
         minimum: int = 1) -> Any:
  key, value = _first(cfg, keys, what, default)
  if key is None:
    return value
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if not _is_int(value) or value < minimum:
    raise ConfigError(f"config.json: {key} must be an integer >= {minimum}, got {_short(value)}")
  return value


def _float(cfg: Mapping[str, Any], keys: tuple[str, ...], default: float) -> float:
  key, value = _first(cfg, keys, "", default)
  if key is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
    raise ConfigError(f"config.json: {key} must be a number, got {_short(value)}")
  return float(value)


def _cfg_bool(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
  value = cfg.get(key)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ConfigError(f"config.json: {key} must be true or false, got {_short(value)}")
  return value


def _cfg_str(cfg: Mapping[str, Any], key: str, default: str) -> str:
  value = cfg.get(key)
  if value is None:
    return default
  if not isinstance(value, str):
    raise ConfigError(f"config.json: {key} must be a string, got {_short(value)}")
  return value


def parse_model_config(cfg: Mapping[str, Any]) -> MoEModelConfig:
  """Reads the MoE shape from a `config.json` dict; a wrongly typed field is a `ConfigError`
  naming its key."""
  if not isinstance(cfg, Mapping):
    raise ConfigError(f"config.json must be a JSON object, got {type(cfg).__name__}")
  act = _cfg_str(cfg, "hidden_act", "silu")
  activation = "swigluoai" if act in ("swigluoai", "swiglu_oai") else "silu"
  num_expert_group = _int(cfg, ("n_group",), "", None)
  return MoEModelConfig(
      num_experts=_int(cfg, ("num_experts", "num_local_experts", "n_routed_experts"),
                       "expert count"),
      top_k=_int(cfg, ("num_experts_per_tok", "top_k", "moe_topk"), "top-k"),
      hidden_size=_int(cfg, ("hidden_size",), "hidden size"),
      intermediate_size=_int(cfg, ("moe_intermediate_size", "intermediate_size"),
                             "expert intermediate size"),
      num_layers=_int(cfg, ("num_hidden_layers",), "layer count"),
      # Mixtral has no flag and renormalizes; Qwen/OLMoE say so with norm_topk_prob.
      renormalize=_cfg_bool(cfg, "norm_topk_prob", True),
      scoring_func=_cfg_str(cfg, "scoring_func", "softmax"),
      num_expert_group=num_expert_group,
      topk_group=_int(cfg, ("topk_group",), "", None),
      routed_scaling_factor=_float(cfg, ("routed_scaling_factor",), 1.0),
      activation=activation,
  )


def read_config_json(path: str | Path, *, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
  """Reads `config.json` of a checkpoint directory (or the file itself) as a JSON object.

  Malformed JSON raises `ConfigError` naming the file, line and column.
  """
  path = Path(path)
  if path.is_dir():
    path = path / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"no config.json at {path}")
  try:
    data = parse_json_bytes(read_bounded(path, max_bytes, "config.json"), path, "config.json")
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data
