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
import json
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
SCHEMES = ("w4a8_int8", "wna16", "mxint4")


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

  @property
  def quantized(self) -> bool:
    return self.quant_method != "none"

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
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


def _require(cond: bool, field: str, value: Any, want: str) -> None:
  if not cond:
    raise ValueError(f"unsupported quantization_config: {field}={value!r} ({want})")


def _group_size_from(field: str, value: Any) -> int:
  _require(isinstance(value, int) and value in SUPPORTED_GROUP_SIZES, field, value,
           f"expected one of {SUPPORTED_GROUP_SIZES}")
  return int(value)


def _parse_compressed_tensors(qc: Mapping[str, Any], method: str) -> CheckpointQuantConfig:
  groups = qc.get("config_groups")
  _require(isinstance(groups, Mapping) and len(groups) > 0, "quantization_config.config_groups",
           groups, "expected a non-empty mapping of scheme groups")
  items = list(groups.items())
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
  _require(w.get("num_bits") == 4, f"{gname}.weights.num_bits", w.get("num_bits"),
           "only 4-bit weights are supported")
  _require(w.get("type", "int") == "int", f"{gname}.weights.type", w.get("type"),
           "only int weights are supported")
  _require(w.get("symmetric", True) is True, f"{gname}.weights.symmetric", w.get("symmetric"),
           "only symmetric int4 weights are supported (no zero points)")
  _require(not w.get("dynamic", False), f"{gname}.weights.dynamic", w.get("dynamic"),
           "weights must be statically quantized")
  strategy = w.get("strategy")
  _require(strategy in ("group", "channel"), f"{gname}.weights.strategy", strategy,
           "expected 'group' or 'channel'")
  if strategy == "channel":
    group_size = -1
  else:
    group_size = _group_size_from(f"{gname}.weights.group_size", w.get("group_size"))
    _require(group_size != -1, f"{gname}.weights.group_size", -1,
             "strategy 'group' needs a positive group size")
  actorder = w.get("actorder")
  _require(actorder in (None, "group", "weight", "dynamic", False), f"{gname}.weights.actorder",
           actorder, "expected null, 'weight', 'group' or 'dynamic'")
  act_bits = None
  a = group.get("input_activations")
  if a is not None:
    _require(a.get("num_bits") == 8, f"{gname}.input_activations.num_bits", a.get("num_bits"),
             "only 8-bit activations (W4A8-int) are supported")
    _require(a.get("type", "int") == "int", f"{gname}.input_activations.type", a.get("type"),
             "only int8 activations are supported")
    _require(a.get("strategy") == "token", f"{gname}.input_activations.strategy",
             a.get("strategy"), "only per-token activation scales are supported")
    _require(a.get("dynamic") is True, f"{gname}.input_activations.dynamic", a.get("dynamic"),
             "only dynamic activation quantization is supported (static scales are not)")
    act_bits = 8
  if method == "mxint4":
    _require(group_size == 32, f"{gname}.weights.group_size", group_size,
             "MxInt4 uses groups of 32")
    scheme = "mxint4"
  else:
    scheme = "w4a8_int8" if act_bits == 8 else "wna16"
  return CheckpointQuantConfig(
      quant_method=method, group_size=group_size, act_order=actorder in ("group", "dynamic"),
      activation_bits=act_bits, scheme=scheme, ignore=tuple(qc.get("ignore") or ()))


def _parse_gptq(qc: Mapping[str, Any]) -> CheckpointQuantConfig:
  _require(qc.get("bits") == 4, "quantization_config.bits", qc.get("bits"),
           "only 4-bit GPTQ is supported")
  _require(qc.get("sym", True) is True, "quantization_config.sym", qc.get("sym"),
           "only symmetric GPTQ is supported (asymmetric zero points are not)")
  group_size = _group_size_from("quantization_config.group_size", qc.get("group_size", 128))
  fmt = qc.get("checkpoint_format", "gptq")
  _require(fmt in ("gptq", "gptq_v2"), "quantization_config.checkpoint_format", fmt,
           "expected 'gptq' or 'gptq_v2'")
  return CheckpointQuantConfig(
      quant_method="gptq", group_size=group_size, act_order=bool(qc.get("desc_act", False)),
      scheme="wna16", gptq_v2_zeros=fmt == "gptq_v2")


def parse_quantization_config(qc: Mapping[str, Any] | None) -> CheckpointQuantConfig:
  """Parses `config.json["quantization_config"]` (None -> float checkpoint)."""
  if qc is None:
    return CheckpointQuantConfig()
  if not isinstance(qc, Mapping):
    raise ValueError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
  method = qc.get("quant_method")
  if method in ("compressed-tensors", "compressed_tensors", "mxint4"):
    return _parse_compressed_tensors(qc, "mxint4" if method == "mxint4" else "compressed-tensors")
  if method == "gptq":
    return _parse_gptq(qc)
  raise ValueError(
      f"unsupported quantization_config: quant_method={method!r} (expected 'compressed-tensors', "
      "'gptq' or 'mxint4')")


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


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...], what: str, default: Any = KeyError):
  for k in keys:
    if cfg.get(k) is not None:
      return cfg[k]
  if default is KeyError:
    raise ValueError(f"config.json has no {what} (looked for {', '.join(keys)})")
  return default


def parse_model_config(cfg: Mapping[str, Any]) -> MoEModelConfig:
  """Reads the MoE shape from a `config.json` dict."""
  act = _first(cfg, ("hidden_act",), "activation", "silu")
  activation = "swigluoai" if act in ("swigluoai", "swiglu_oai") else "silu"
  return MoEModelConfig(
      num_experts=int(_first(cfg, ("num_experts", "num_local_experts", "n_routed_experts"),
                             "expert count")),
      top_k=int(_first(cfg, ("num_experts_per_tok", "top_k", "moe_topk"), "top-k")),
      hidden_size=int(_first(cfg, ("hidden_size",), "hidden size")),
      intermediate_size=int(_first(cfg, ("moe_intermediate_size", "intermediate_size"),
                                   "expert intermediate size")),
      num_layers=int(_first(cfg, ("num_hidden_layers",), "layer count")),
      # Mixtral has no flag and renormalizes; Qwen/OLMoE say so with norm_topk_prob.
      renormalize=bool(_first(cfg, ("norm_topk_prob",), "", True)),
      scoring_func=str(_first(cfg, ("scoring_func",), "", "softmax")),
      num_expert_group=_first(cfg, ("n_group",), "", None),
      topk_group=_first(cfg, ("topk_group",), "", None),
      routed_scaling_factor=float(_first(cfg, ("routed_scaling_factor",), "", 1.0)),
      activation=activation,
  )


def read_config_json(path: str | Path) -> dict[str, Any]:
  """Reads `config.json` of a checkpoint directory (or the file itself)."""
  path = Path(path)
  if path.is_dir():
    path = path / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"no config.json at {path}")
  with open(path) as f:
    return json.load(f)
