"""Reading and writing MoE expert weights in safetensors checkpoints.

Expert tensors come in three storages (`ExpertsLayout.storage`), under `{experts}` e.g.
`model.layers.{L}.mlp.experts` (Qwen-MoE, OLMoE, DeepSeek: gate_proj/up_proj/down_proj) or
`model.layers.{L}.block_sparse_moe.experts` (Mixtral: w1/w3/w2):
- per expert: `{experts}.{e}.{proj}.weight` (or the int4 tensors of `quantized`), 2-D each;
- stacked: `{experts}.{proj}.weight[_packed]`, 3-D `[E, out, in(/8)]`, as compressed-tensors writes
  a 3-D weight (each expert packed like a 2-D one; `weight_shape` is `[E, out, in]`);
- fused: `{experts}.gate_up_proj` + `{experts}.down_proj`, either transformers 5's raw parameters
  (`[E, 2I, H]` gate rows then up rows, `[E, H, I]`) or GPT-OSS's (`[E, H, 2I]` interleaved,
  `[E, I, H]`), told apart by their shapes (or `fused_layout=`); or 3-D module weights
  `{experts}.gate_up_proj.weight[_packed]` `[E, 2I, H(/8)]`.
All are loaded as `w13 [E, 2I, H]` (gate rows first, then up) and `w2 [E, H, I]`. The router
(`{parent}.gate.weight [E, H]`, optional `{parent}.gate.e_score_correction_bias [E]`) is loaded when
present. Tensor files are read by `safetensors_io` (validated); `safetensors` itself is only
needed to write.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jax_moeq.loaders import int4_format, quantized
from jax_moeq.loaders.config import (
    CheckpointQuantConfig, ConfigError, MissingFieldError, MoEModelConfig, parse_model_config,
    parse_quantization_config, read_config_json)
from jax_moeq.loaders.progress import Progress
from jax_moeq.loaders.safetensors_io import (
    INDEX_FILE, CheckpointFormatError, SafetensorsDir, TensorNotFoundError)

PROJ_NAMES = {"gate_proj": ("gate_proj", "up_proj", "down_proj"), "w1": ("w1", "w3", "w2")}


def _safetensors_numpy():
  try:
    import safetensors.numpy
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("writing checkpoints needs `safetensors` "
                      "(pip install 'jax_moeq[checkpoints]')") from e
  return safetensors.numpy


@dataclasses.dataclass
class MoELayerTensors:
  """One MoE layer's expert weights, on the host, in our canonical orientation.

  Float layers: `w13 [E, 2I, H]`, `w2 [E, H, I]` floating point, no scales.
  Int4 layers: `w13`, `w2` int8 holding int4 values in natural input order, scales
  `[E, out, in/g]` (group) or `[E, out, 1]` (channel, group_size -1) in the checkpoint's dtype, and
  optional act-order `w13_g_idx [E, H]`, `w2_g_idx [E, I]`: the group of each input channel
  (None when groups are contiguous, i.e. g_idx[k] == k // g).
  """

  w13: np.ndarray
  w2: np.ndarray
  w13_scale: np.ndarray | None = None
  w2_scale: np.ndarray | None = None
  group_size: int | None = None
  w13_g_idx: np.ndarray | None = None
  w2_g_idx: np.ndarray | None = None
  w13_bias: np.ndarray | None = None
  w2_bias: np.ndarray | None = None
  router_weight: np.ndarray | None = None
  e_score_correction_bias: np.ndarray | None = None

  def __post_init__(self):
    e, i2, h = self.w13.shape
    if self.w2.shape != (e, h, i2 // 2) or i2 % 2:
      raise ValueError(f"w2 shape {self.w2.shape} does not match w13 shape {self.w13.shape} "
                       f"(expected {(e, h, i2 // 2)})")
    if self.quantized:
      if self.w13_scale is None or self.w2_scale is None or self.group_size is None:
        raise ValueError("int4 layers need w13_scale, w2_scale and group_size")
      for name, q, s in (("w13", self.w13, self.w13_scale), ("w2", self.w2, self.w2_scale)):
        k = q.shape[-1]
        groups = 1 if self.group_size == -1 else k // self.group_size
        if self.group_size != -1 and k % self.group_size:
          raise ValueError(f"group_size={self.group_size} does not divide {name}'s input size {k}")
        if s.shape != q.shape[:2] + (groups,):
          raise ValueError(f"{name}_scale must have shape {q.shape[:2] + (groups,)}, got {s.shape}")

  @property
  def quantized(self) -> bool:
    return self.w13.dtype == np.int8

  @property
  def num_experts(self) -> int:
    return self.w13.shape[0]

  @property
  def hidden_size(self) -> int:
    return self.w13.shape[2]

  @property
  def intermediate_size(self) -> int:
    return self.w13.shape[1] // 2

  def sorted_by_group(self) -> "tuple[MoELayerTensors, np.ndarray | None]":
    """Applies act-order permutations so groups are contiguous; returns (layer, w13_perm).

    w2's input permutation (over I) is folded exactly into w13's rows (gate and up together: the
    activation is elementwise), so only w13's per-expert input permutation over H remains; it is
    returned as `w13_perm [E, H]` (None when w13 had no act-order), to be applied to activations.
    """
    return _fold_act_order(self)


def _fold_act_order(layer: MoELayerTensors) -> tuple[MoELayerTensors, np.ndarray | None]:
  """See `MoELayerTensors.sorted_by_group`."""
  if not layer.quantized:
    return layer, None
  w13, w2 = layer.w13, layer.w2
  w13_bias = layer.w13_bias
  w13_perm = None
  i = layer.intermediate_size
  if layer.w2_g_idx is not None:
    perm = np.argsort(layer.w2_g_idx, axis=-1, kind="stable")  # [E, I]
    w2 = np.take_along_axis(w2, perm[:, None, :], axis=-1)
    rows = np.concatenate([perm, perm + i], axis=-1)  # gate and up halves move together
    w13 = np.take_along_axis(w13, rows[:, :, None], axis=1)
    w13_scale = np.take_along_axis(layer.w13_scale, rows[:, :, None], axis=1)
    if w13_bias is not None:
      w13_bias = np.take_along_axis(w13_bias, rows, axis=1)
  else:
    w13_scale = layer.w13_scale
  if layer.w13_g_idx is not None:
    w13_perm = np.argsort(layer.w13_g_idx, axis=-1, kind="stable").astype(np.int32)  # [E, H]
    w13 = np.take_along_axis(w13, w13_perm[:, None, :], axis=-1)
  out = dataclasses.replace(layer, w13=w13, w2=w2, w13_scale=w13_scale, w13_bias=w13_bias,
                            w13_g_idx=None, w2_g_idx=None)
  return out, w13_perm


@dataclasses.dataclass
class MoECheckpoint:
  """A loaded checkpoint: model shape, quantization, and MoE layers by layer index."""

  model_config: MoEModelConfig | None
  quant_config: CheckpointQuantConfig
  layers: dict[int, MoELayerTensors]
  config_json: dict[str, Any] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------ MoE layouts
STORAGES = ("per_expert", "stacked", "fused")
FUSED_LAYOUTS = ("auto", "concat", "interleaved")
_PROJ = r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
# `{experts}` ends in a path segment that is exactly "experts" (not "shared_experts").
_EXPERTS = r"(?P<experts>.*?layers\.(?P<layer>\d+)\.(?:.+\.)?experts)"


def _key_patterns(experts: str) -> tuple[re.Pattern, re.Pattern, re.Pattern]:
  """(per-expert, stacked, fused) key patterns for an `experts` prefix regex."""
  return (re.compile(rf"^{experts}\.(?P<e>\d+)\.{_PROJ}\."),
          re.compile(rf"^{experts}\.{_PROJ}\.(?:weight|weight_packed)$"),
          re.compile(rf"^{experts}\.gate_up_proj(?P<module>\.weight|\.weight_packed)?$"))


_KEYS = _key_patterns(_EXPERTS)


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
  """How one MoE layer's experts are stored (found by `discover_moe_layers` from tensor names).

  experts: the key prefix up to and including ".experts".
  projs: (gate, up, down) projection names ("gate_proj", "up_proj", "down_proj", or Mixtral's
    "w1", "w3", "w2"); ("gate_up_proj", None, "down_proj") for the fused storage.
  num_experts: E, or -1 when only the tensors' shapes tell (stacked / fused, from names alone).
  storage:
    "per_expert": `{experts}.{e}.{proj}.{weight | weight_packed... | qweight...}`, 2-D each.
    "stacked": `{experts}.{proj}.{weight | weight_packed...}` of shape [E, out, in(/8)]: one 3-D
      tensor per projection (compressed-tensors packs each expert's [out, in] as a 2-D weight).
    "fused": gate and up in one `{experts}.gate_up_proj` tensor: a raw float parameter as
      transformers 5 holds it in memory ([E, 2I, H], gate rows then up rows, with
      `down_proj [E, H, I]`) or as GPT-OSS stores it ([E, H, 2I] with gate/up interleaved along
      the last axis, `down_proj [E, I, H]`); or a 3-D module weight `{experts}.gate_up_proj.weight`
      / `.weight_packed` ([E, 2I, H(/8)], out-major like every compressed-tensors weight) with
      `{experts}.down_proj.weight[_packed]`.
  layer: the decoder layer index in the names.
  """

  experts: str
  projs: tuple[str, str | None, str] | None
  num_experts: int
  storage: str = "per_expert"
  layer: int = -1

  @property
  def parent(self) -> str:
    return self.experts.rsplit(".", 1)[0]


_ExpertsLayout = ExpertsLayout  # the name before it was public


def _classify(keys: Iterable[str], patterns=_KEYS) -> dict[str, dict[str, Any]]:
  """experts prefix -> what its tensor names show."""
  per_expert, stacked, fused = patterns
  found: dict[str, dict[str, Any]] = {}

  def entry(m: re.Match) -> dict[str, Any]:
    layer = m.groupdict().get("layer")
    return found.setdefault(m["experts"], {"layer": -1 if layer is None else int(layer),
                                           "ids": set(), "projs": set(), "stacked": set(),
                                           "fused": None})
  for key in keys:
    m = per_expert.match(key)
    if m:
      d = entry(m)
      d["ids"].add(int(m["e"]))
      d["projs"].add(m["proj"])
      continue
    m = stacked.match(key)
    if m:
      entry(m)["stacked"].add(m["proj"])
      continue
    m = fused.match(key)
    if m:
      entry(m)["fused"] = "module" if m["module"] else "raw"
  return found


def _naming(projs: set[str], where: str) -> tuple[str, str, str]:
  styles = {"w1" if p in ("w1", "w2", "w3") else "gate_proj" for p in projs}
  if len(styles) != 1:
    raise ValueError(f"{where}: experts mix gate_proj/up_proj/down_proj and w1/w3/w2 names")
  return PROJ_NAMES[styles.pop()]


def _layout_of(experts: str, d: dict[str, Any], shapes: SafetensorsDir | None) -> ExpertsLayout:
  kinds = [k for k, present in (("per_expert", d["ids"]), ("stacked", d["stacked"] - {"down_proj"}),
                                ("fused", d["fused"])) if present]
  if len(kinds) > 1:
    raise ValueError(f"{experts}: experts are stored in two layouts at once "
                     f"({' and '.join(kinds)})")
  if not kinds and d["stacked"]:
    raise ValueError(f"{experts}: has {sorted(d['stacked'])} 3-D expert tensors but no gate/up "
                     "projection")
  storage = kinds[0]
  if storage == "per_expert":
    ids = sorted(d["ids"])
    if ids != list(range(len(ids))):
      raise ValueError(f"{experts}: expert ids {ids[:8]}... are not 0..{len(ids) - 1}")
    return ExpertsLayout(experts, _naming(d["projs"], experts), len(ids), storage, d["layer"])
  if storage == "stacked":
    projs = _naming(d["stacked"], experts)
    first = f"{experts}.{projs[0]}.weight"
  else:
    projs = ("gate_up_proj", None, "down_proj")
    first = f"{experts}.gate_up_proj" + ("" if d["fused"] == "raw" else ".weight")
  num = -1
  if shapes is not None:
    name = first if first in shapes else first + "_packed"
    if name in shapes and len(shapes.get_shape(name)) == 3:
      num = shapes.get_shape(name)[0]
  return ExpertsLayout(experts, projs, num, storage, d["layer"])


def discover_moe_layers(keys: Iterable[str] | SafetensorsDir) -> dict[int, ExpertsLayout]:
  """Finds the MoE layers of a checkpoint from its tensor names -> {layer index: layout}.

  Given a `SafetensorsDir` instead of names, stacked and fused layouts also get their expert
  count from the tensors' shapes (no data is read).
  """
  shapes = keys if isinstance(keys, SafetensorsDir) else None
  names = keys.keys() if shapes is not None else keys
  layouts: dict[int, ExpertsLayout] = {}
  for experts, d in _classify(names).items():
    layout = _layout_of(experts, d, shapes)
    other = layouts.get(layout.layer)
    if other is not None:
      raise ValueError(f"layer {layout.layer} has experts under two prefixes: {other.experts!r} "
                       f"and {experts!r}")
    layouts[layout.layer] = layout
  return dict(sorted(layouts.items()))


def find_moe_layout(keys: Iterable[str] | SafetensorsDir, experts: str) -> ExpertsLayout:
  """The layout of the experts under one prefix (e.g. "model.layers.3.mlp.experts"; any prefix,
  with or without a `layers.{L}` in it)."""
  shapes = keys if isinstance(keys, SafetensorsDir) else None
  names = keys.keys() if shapes is not None else keys
  experts = experts.rstrip(".")
  layer = re.search(r"layers\.(\d+)\.", experts + ".")
  own = _key_patterns(rf"(?P<experts>{re.escape(experts)})")
  found = _classify((n for n in names if n.startswith(experts + ".")), own)
  if experts not in found:
    raise TensorNotFoundError(
        f"no MoE expert tensors under {experts!r} (expected names like "
        f"'{experts}.0.gate_proj.weight', '{experts}.gate_up_proj' or "
        f"'{experts}.gate_proj.weight_packed')", tensor=experts)
  d = found[experts]
  d["layer"] = -1 if layer is None else int(layer.group(1))
  return _layout_of(experts, d, shapes)


# ------------------------------------------------------------------ MoE loading
@dataclasses.dataclass
class _Proj:
  """One projection, float (`w`) or int4 (`w` int8 + scale/g_idx/group_size), [..., out, in]."""

  w: np.ndarray
  scale: np.ndarray | None = None
  g_idx: np.ndarray | None = None
  group_size: int | None = None
  bias: np.ndarray | None = None


def _read(ckpt: SafetensorsDir, prefix: str, qcfg: CheckpointQuantConfig,
          rows: tuple[int, int] | None = None) -> _Proj:
  value, bias = quantized.read_projection(ckpt, prefix, qcfg, rows=rows)
  if isinstance(value, quantized.Int4Projection):
    return _Proj(value.q, value.scale, value.g_idx, value.group_size, bias)
  return _Proj(value, bias=bias)


def _same_kind(projs: list[_Proj], where: str) -> None:
  """One storage for all: float of one dtype, or int4 of one group size and scale dtype."""
  kinds = {(str(p.w.dtype), p.group_size, None if p.scale is None else str(p.scale.dtype))
           for p in projs}
  if len(kinds) != 1:
    described = sorted(f"{w}" if g is None else f"int4 group {g}, {s} scales" for w, g, s in kinds)
    raise ValueError(f"{where}: projections mix float and int4, dtypes or group sizes: "
                     f"{', '.join(described)}")


def _join_gate_up(gate: _Proj, up: _Proj, where: str) -> _Proj:
  """gate and up [..., I, H] -> w13 [..., 2I, H] (gate rows first)."""
  _same_kind([gate, up], where)
  if gate.w.shape != up.w.shape:
    raise ValueError(f"{where}: gate {gate.w.shape} and up {up.w.shape} differ in shape")
  # gate and up read the same input, so act-order (a permutation of that input) must agree.
  if (gate.g_idx is None) != (up.g_idx is None) or (
      gate.g_idx is not None and not np.array_equal(gate.g_idx, up.g_idx)):
    raise ValueError(f"{where}: gate and up g_idx differ; w13 needs one input order for both")
  bias = None
  if gate.bias is not None or up.bias is not None:
    dt = (gate.bias if gate.bias is not None else up.bias).dtype
    zeros = np.zeros(gate.w.shape[:-1], dt)
    bias = np.concatenate([gate.bias if gate.bias is not None else zeros,
                           up.bias if up.bias is not None else zeros], axis=-1)
  scale = None if gate.scale is None else np.concatenate([gate.scale, up.scale], axis=-2)
  return _Proj(np.concatenate([gate.w, up.w], axis=-2), scale, gate.g_idx, gate.group_size, bias)


def _stack(parts: list[np.ndarray | None], what: str) -> np.ndarray | None:
  present = [p is not None for p in parts]
  if not any(present):
    return None
  if not all(present):
    raise ValueError(f"{what} is present for some experts only")
  return np.stack(parts)


def _stack_projs(projs: list[_Proj], where: str) -> _Proj:
  """Per-expert projections -> one [E, ...] projection."""
  _same_kind(projs, where)
  shapes = sorted({p.w.shape for p in projs})
  if len(shapes) != 1:
    raise ValueError(f"{where}: experts have different shapes {shapes}")
  g_idx = [p.g_idx for p in projs]
  if any(g is not None for g in g_idx):
    # Experts without act-order next to experts with it: give them the trivial order.
    k, g = projs[0].w.shape[-1], projs[0].group_size
    trivial = (np.arange(k) // (k if g == -1 else g)).astype(np.int32)
    g_idx = [trivial if gi is None else gi for gi in g_idx]
  return _Proj(np.stack([p.w for p in projs]), _stack([p.scale for p in projs], f"{where} scale"),
               _stack(g_idx, f"{where} g_idx"), projs[0].group_size,
               _stack([p.bias for p in projs], f"{where} bias"))


def _concat_projs(projs: list[_Proj]) -> _Proj:
  """Runs of experts [E_a, ...], [E_b, ...] of one projection -> [E_a + E_b, ...]."""
  if len(projs) == 1:
    return projs[0]
  cat = lambda parts: None if parts[0] is None else np.concatenate(parts)
  return _Proj(cat([p.w for p in projs]), cat([p.scale for p in projs]),
               cat([p.g_idx for p in projs]), projs[0].group_size, cat([p.bias for p in projs]))


def _expert_runs(experts: Sequence[int] | None, num_experts: int,
                 where: str) -> list[tuple[int, int]] | None:
  """Sorted distinct expert ids -> contiguous [start, stop) runs (None: all experts)."""
  if experts is None:
    return None
  ids = [int(e) for e in experts]
  if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= num_experts:
    raise ValueError(f"{where}: experts must be sorted distinct ids in [0, {num_experts}), got "
                     f"{ids[:8]}{'...' if len(ids) > 8 else ''}")
  runs: list[tuple[int, int]] = []
  for e in ids:
    if runs and runs[-1][1] == e:
      runs[-1] = (runs[-1][0], e + 1)
    else:
      runs.append((e, e + 1))
  return runs


def _stacked_experts(ckpt: SafetensorsDir, layout: ExpertsLayout) -> int:
  """E of a stacked / fused layer, from its gate (or gate_up) tensor's shape (no data read)."""
  ex = layout.experts
  first = f"{ex}.{layout.projs[0]}"
  for name in (first, f"{first}.weight", f"{first}.weight_packed"):
    if name in ckpt and len(ckpt.get_shape(name)) == 3:
      return ckpt.get_shape(name)[0]
  raise ValueError(f"{ex}: no 3-D {first} tensor tells the number of experts")


def _deinterleave_rows(p: _Proj) -> _Proj:
  """gate/up alternating along the output rows -> halves (the act order is per input: kept)."""
  rows = lambda a: None if a is None else int4_format.deinterleave_gate_up(a, axis=-2)
  bias = None if p.bias is None else int4_format.deinterleave_gate_up(p.bias, axis=-1)
  return _Proj(rows(p.w), rows(p.scale), p.g_idx, p.group_size, bias)


def _fused_orientation(gu: tuple[int, ...], down: tuple[int, ...], fused_layout: str,
                       hidden: int | None, inter: int | None, where: str) -> str:
  """"concat" ([E, 2I, H] + down [E, H, I]) or "interleaved" ([E, H, 2I] + down [E, I, H])."""
  if len(gu) != 3 or len(down) != 3 or gu[0] != down[0]:
    raise ValueError(f"{where}: gate_up_proj {list(gu)} and down_proj {list(down)} are not 3-D "
                     "tensors over the same experts")
  a, b, c, d = gu[1], gu[2], down[1], down[2]
  ok = {"concat": a == 2 * d and b == c, "interleaved": b == 2 * c and a == d}
  if hidden is not None and inter is not None:
    ok["concat"] &= (a, b) == (2 * inter, hidden)
    ok["interleaved"] &= (a, b) == (hidden, 2 * inter)
  want = {"concat": "gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]",
          "interleaved": "gate_up_proj [E, H, 2I] (gate/up interleaved) and down_proj [E, I, H]"}
  sizes = "" if hidden is None else f" with H={hidden}, I={inter}"
  if fused_layout != "auto":
    if not ok[fused_layout]:
      raise ValueError(f"{where}: fused_layout={fused_layout!r} needs {want[fused_layout]}"
                       f"{sizes}; got gate_up_proj {list(gu)}, down_proj {list(down)}")
    return fused_layout
  fits = [k for k, v in ok.items() if v]
  if len(fits) != 1:
    raise ValueError(f"{where}: gate_up_proj {list(gu)} and down_proj {list(down)} fit "
                     f"{'both' if fits else 'neither'} of {want['concat']} and "
                     f"{want['interleaved']}{sizes}; pass fused_layout= (and hidden_size, "
                     "intermediate_size)")
  return fits[0]


def _load_fused(ckpt: SafetensorsDir, layout: ExpertsLayout, qcfg: CheckpointQuantConfig,
                fused_layout: str, hidden: int | None, inter: int | None,
                rows: tuple[int, int] | None = None) -> tuple[_Proj, _Proj]:
  ex = layout.experts
  if f"{ex}.gate_up_proj" in ckpt:  # raw parameters (float)
    if f"{ex}.down_proj" not in ckpt:
      raise CheckpointFormatError(f"{ex}.gate_up_proj has no {ex}.down_proj next to it",
                                  path=ckpt.path, tensor=f"{ex}.down_proj")
    gu_shape, down_shape = ckpt.get_shape(f"{ex}.gate_up_proj"), ckpt.get_shape(f"{ex}.down_proj")
    orient = _fused_orientation(gu_shape, down_shape, fused_layout, hidden, inter, ex)
    w13 = _float(ckpt, f"{ex}.gate_up_proj", rows)
    w2 = _float(ckpt, f"{ex}.down_proj", rows)
    b13 = _optional_float(ckpt, f"{ex}.gate_up_proj_bias", rows)
    b2 = _optional_float(ckpt, f"{ex}.down_proj_bias", rows)
    if orient == "interleaved":
      w13 = int4_format.deinterleave_gate_up(w13, axis=-1).transpose(0, 2, 1)
      w2 = w2.transpose(0, 2, 1)
      if b13 is not None:
        b13 = int4_format.deinterleave_gate_up(b13, axis=-1)
    for name, b, shape in (("gate_up_proj_bias", b13, w13.shape[:2]),
                           ("down_proj_bias", b2, w2.shape[:2])):
      if b is not None and b.shape != shape:
        raise ValueError(f"{ckpt.where(f'{ex}.{name}')} has shape {b.shape}, expected {shape}")
    return (_Proj(np.ascontiguousarray(w13), bias=b13),
            _Proj(np.ascontiguousarray(w2), bias=b2))
  w13 = _read(ckpt, f"{ex}.gate_up_proj", qcfg, rows)  # module weights: [E, 2I, H] out-major
  w2 = _read(ckpt, f"{ex}.down_proj", qcfg, rows)
  if w13.w.ndim != 3 or w2.w.ndim != 3:
    raise ValueError(f"{ex}: fused gate_up_proj {w13.w.shape} / down_proj {w2.w.shape} must be "
                     "3-D [E, out, in]")
  if fused_layout == "interleaved":
    w13 = _deinterleave_rows(w13)
  return w13, w2


def _float(ckpt: SafetensorsDir, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
  # Raw fused tensors and their biases all lead with the expert axis.
  a = ckpt.get(name) if rows is None else ckpt.get_rows(name, *rows)
  if not quantized.is_float_dtype(a.dtype):
    raise ValueError(f"{ckpt.where(name)} has dtype {a.dtype}; a raw fused expert tensor must be "
                     "floating point (int4 fused experts are stored as .weight_packed)")
  return a


def _optional_float(ckpt: SafetensorsDir, name: str,
                    rows: tuple[int, int] | None = None) -> np.ndarray | None:
  return _float(ckpt, name, rows) if name in ckpt else None


def load_moe_layer(ckpt: SafetensorsDir, layout: ExpertsLayout | str,
                   qcfg: CheckpointQuantConfig, *, fused_layout: str = "auto",
                   hidden_size: int | None = None,
                   intermediate_size: int | None = None,
                   experts: Sequence[int] | None = None) -> MoELayerTensors:
  """Reads one layer's experts (and its router when present) as `MoELayerTensors`.

  Args:
    ckpt: the checkpoint.
    layout: from `discover_moe_layers` / `find_moe_layout`, or the experts prefix itself
      (e.g. "model.layers.3.mlp.experts").
    qcfg: the checkpoint's quantization config; each projection's storage (float, compressed-tensors
      or GPTQ) is read from its tensors and must agree with it.
    fused_layout: for `gate_up_proj` storage: "auto" (decide from the shapes of gate_up_proj and
      down_proj, and `hidden_size`/`intermediate_size` when given), "concat" (gate rows, then up
      rows: transformers 5) or "interleaved" (gate/up alternating: GPT-OSS's [E, H, 2I]; for a
      3-D module weight `gate_up_proj.weight[_packed]`, alternating output rows).
    hidden_size, intermediate_size: H and I from config.json; when given, the layer must have them.
    experts: sorted distinct expert ids to read (None: all). The result holds only these, in this
      order (`num_experts` is their count); per-expert tensors of other experts are not read, and
      of stacked / fused [E, ...] tensors only these experts' rows are (by byte range), so a
      process holding a block of the experts never reads the others. The router is read whole.
  """
  if fused_layout not in FUSED_LAYOUTS:
    raise ValueError(f"fused_layout={fused_layout!r} is not one of {FUSED_LAYOUTS}")
  if isinstance(layout, str):
    layout = find_moe_layout(ckpt, layout)
  ex = layout.experts
  if layout.storage in ("fused", "stacked"):
    runs = _expert_runs(experts, _stacked_experts(ckpt, layout), ex) or [None]
    parts = []
    for rows in runs:
      if layout.storage == "fused":
        parts.append(_load_fused(ckpt, layout, qcfg, fused_layout, hidden_size,
                                 intermediate_size, rows))
      else:
        gate, up, down = (_read(ckpt, f"{ex}.{p}", qcfg, rows) for p in layout.projs)
        parts.append((_join_gate_up(gate, up, ex), down))
    w13, w2 = _concat_projs([p[0] for p in parts]), _concat_projs([p[1] for p in parts])
  elif layout.storage == "per_expert":
    if layout.num_experts < 1:
      raise ValueError(f"{ex}: no experts")
    runs = _expert_runs(experts, layout.num_experts, ex)
    ids = range(layout.num_experts) if runs is None else [e for a, b in runs for e in range(a, b)]
    w13s, w2s = [], []
    for e in ids:
      base = f"{ex}.{e}"
      gate, up, down = (_read(ckpt, f"{base}.{p}", qcfg) for p in layout.projs)
      w13s.append(_join_gate_up(gate, up, base))
      w2s.append(down)
    w13, w2 = _stack_projs(w13s, f"{ex} w13"), _stack_projs(w2s, f"{ex} w2")
  else:
    raise ValueError(f"{ex}: unknown storage {layout.storage!r} (one of {STORAGES})")
  if w13.w.ndim != 3 or w2.w.ndim != 3:
    raise ValueError(f"{ex}: expert weights must be 3-D [E, out, in], got w13 {w13.w.shape}, "
                     f"w2 {w2.w.shape}")
  _same_kind([w13, w2], ex)
  e, i2, h = w13.w.shape
  if hidden_size is not None and intermediate_size is not None and (
      (i2, h) != (2 * intermediate_size, hidden_size)):
    raise ValueError(f"{ex}: experts have H={h}, I={i2 // 2}; expected H={hidden_size}, "
                     f"I={intermediate_size}")
  try:
    return MoELayerTensors(
        w13=w13.w, w2=w2.w, w13_scale=w13.scale, w2_scale=w2.scale, group_size=w13.group_size,
        w13_g_idx=w13.g_idx, w2_g_idx=w2.g_idx, w13_bias=w13.bias, w2_bias=w2.bias,
        router_weight=ckpt.get_optional(f"{layout.parent}.gate.weight"),
        e_score_correction_bias=ckpt.get_optional(
            f"{layout.parent}.gate.e_score_correction_bias"))
  except ValueError as err:
    raise ValueError(f"{ex}: {err}") from None


def load_moe_checkpoint(path: str | Path, *, layers: Iterable[int] | None = None,
                        fused_layout: str = "auto", show_progress: bool = True) -> MoECheckpoint:
  """Loads every MoE layer (or `layers`) of a safetensors checkpoint directory.

  Reads `config.json` (model shape and `quantization_config`), finds the expert tensors, and
  stacks them into `MoELayerTensors` (host numpy). Unsupported or malformed configs raise
  `ConfigError` (a ValueError) naming the file and the field; `fused_layout` as in
  `load_moe_layer`.
  """
  path = Path(path)
  cfg_path = path / "config.json"
  cfg_json = read_config_json(path) if cfg_path.exists() else {}
  try:
    qcfg = parse_quantization_config(cfg_json.get("quantization_config"))
    model_cfg = parse_model_config(cfg_json) if cfg_json else None
  except MissingFieldError:
    model_cfg = None  # not an MoE config.json we know; the tensors still load
  except ConfigError as e:
    raise ConfigError(f"{cfg_path}: {e}") from None
  ckpt = SafetensorsDir(path)
  layouts = discover_moe_layers(ckpt)
  if not layouts:
    raise ValueError(f"{path}: found no MoE expert tensors (expected names like "
                     "'model.layers.0.mlp.experts.0.gate_proj.weight')")
  wanted = sorted(layouts) if layers is None else list(layers)
  missing = [l for l in wanted if l not in layouts]
  if missing:
    raise ValueError(f"layers {missing} have no MoE experts in {path} (found {sorted(layouts)})")
  sizes = {}
  if model_cfg is not None:
    sizes = dict(hidden_size=model_cfg.hidden_size, intermediate_size=model_cfg.intermediate_size)
  out = {}
  with Progress(len(wanted), "loading MoE layers", enabled=show_progress) as bar:
    for layer in wanted:
      out[layer] = load_moe_layer(ckpt, layouts[layer], qcfg, fused_layout=fused_layout, **sizes)
      bar.update(note=f"layer {layer}")
  return MoECheckpoint(model_cfg, qcfg, out, cfg_json)


# ------------------------------------------------------------------ writer
WRITE_FORMATS = ("float", "compressed-tensors", "gptq", "mxint4")


def _proj_tensors(prefix: str, w: np.ndarray, scale: np.ndarray | None, g_idx: np.ndarray | None,
                  bias: np.ndarray | None, fmt: str,
                  group_size: int | None) -> dict[str, np.ndarray]:
  out: dict[str, np.ndarray] = {}
  if fmt == "float":
    out[f"{prefix}.weight"] = np.ascontiguousarray(w)
  elif fmt == "gptq":
    out[f"{prefix}.qweight"] = int4_format.pack_uint4b8(np.ascontiguousarray(w.T), axis=0)
    out[f"{prefix}.scales"] = np.ascontiguousarray(scale.T)
    n_out = w.shape[0]
    if n_out % 8:
      raise ValueError(f"{prefix}: GPTQ qzeros need the output size {n_out} to be a multiple of 8")
    zeros = np.full((scale.shape[1], n_out), 7 - 8, np.int8)  # v1 stores zero-1 = 7 as q = -1
    out[f"{prefix}.qzeros"] = int4_format.pack_uint4b8(zeros, axis=-1)
    k = w.shape[1]
    g = k if group_size == -1 else group_size
    out[f"{prefix}.g_idx"] = (g_idx if g_idx is not None else np.arange(k) // g).astype(np.int32)
  else:
    if fmt == "mxint4":
      out[f"{prefix}.weight_packed"] = int4_format.pack_signed_nibbles(w)
    else:
      out[f"{prefix}.weight_packed"] = int4_format.pack_uint4b8(w, axis=-1)
    out[f"{prefix}.weight_scale"] = np.ascontiguousarray(scale)
    out[f"{prefix}.weight_shape"] = np.asarray(w.shape, np.int64)
    if g_idx is not None:
      out[f"{prefix}.weight_g_idx"] = g_idx.astype(np.int32)
  if bias is not None:
    out[f"{prefix}.bias"] = np.ascontiguousarray(bias)
  return out


def layer_tensors(layer: MoELayerTensors, experts_prefix: str, fmt: str,
                  naming: str = "gate_proj") -> dict[str, np.ndarray]:
  """The safetensors entries of one MoE layer in format `fmt`."""
  if fmt not in WRITE_FORMATS:
    raise ValueError(f"format={fmt!r} is not one of {WRITE_FORMATS}")
  if naming not in PROJ_NAMES:
    raise ValueError(f"naming={naming!r} is not one of {tuple(PROJ_NAMES)}")
  if (fmt == "float") == layer.quantized:
    raise ValueError(f"format={fmt!r} does not fit a {'int4' if layer.quantized else 'float'} "
                     "layer (quantize it first, or write it as 'float')")
  if fmt == "mxint4" and (layer.group_size != 32 or layer.w13_g_idx is not None
                          or layer.w2_g_idx is not None):
    raise ValueError(f"format='mxint4' needs group_size 32 and no act-order, got group_size="
                     f"{layer.group_size}")
  gate_name, up_name, down_name = PROJ_NAMES[naming]
  i = layer.intermediate_size
  out: dict[str, np.ndarray] = {}
  halves = lambda a: (None, None) if a is None else (a[:i], a[i:])
  for e in range(layer.num_experts):
    base = f"{experts_prefix}.{e}"
    (wg, wu), (sg, su) = halves(layer.w13[e]), halves(
        None if layer.w13_scale is None else layer.w13_scale[e])
    bg, bu = halves(None if layer.w13_bias is None else layer.w13_bias[e])
    g13 = None if layer.w13_g_idx is None else layer.w13_g_idx[e]
    out.update(_proj_tensors(f"{base}.{gate_name}", wg, sg, g13, bg, fmt, layer.group_size))
    out.update(_proj_tensors(f"{base}.{up_name}", wu, su, g13, bu, fmt, layer.group_size))
    out.update(_proj_tensors(
        f"{base}.{down_name}", layer.w2[e], None if layer.w2_scale is None else layer.w2_scale[e],
        None if layer.w2_g_idx is None else layer.w2_g_idx[e],
        None if layer.w2_bias is None else layer.w2_bias[e], fmt, layer.group_size))
  parent = experts_prefix.rsplit(".", 1)[0]
  if layer.router_weight is not None:
    out[f"{parent}.gate.weight"] = np.ascontiguousarray(layer.router_weight)
  if layer.e_score_correction_bias is not None:
    out[f"{parent}.gate.e_score_correction_bias"] = np.ascontiguousarray(
        layer.e_score_correction_bias)
  return out


def quant_config_for(fmt: str, layers: Mapping[int, MoELayerTensors],
                     activation_bits: int | None = None,
                     ignore: Sequence[str] = ()) -> CheckpointQuantConfig:
  """The `CheckpointQuantConfig` that describes `layers` written as `fmt` (`ignore`: the linear
  modules left float, for compressed-tensors)."""
  if fmt == "float":
    return CheckpointQuantConfig()
  sizes = {l.group_size for l in layers.values()}
  if len(sizes) != 1:
    raise ValueError(f"all layers must share one group_size to be written, got {sorted(sizes)}")
  act_order = any(l.w13_g_idx is not None or l.w2_g_idx is not None for l in layers.values())
  method = {"gptq": "gptq", "mxint4": "mxint4"}.get(fmt, "compressed-tensors")
  if activation_bits not in (None, 8):
    raise ValueError(f"activation_bits={activation_bits} is not supported (None or 8)")
  if activation_bits == 8 and fmt != "compressed-tensors":
    raise ValueError(f"activation_bits=8 (W4A8-int) is written as compressed-tensors, not {fmt!r}")
  scheme = {"gptq": "wna16", "mxint4": "mxint4"}.get(
      fmt, "w4a8_int8" if activation_bits == 8 else "wna16")
  return CheckpointQuantConfig(quant_method=method, group_size=sizes.pop(), act_order=act_order,
                               activation_bits=activation_bits, scheme=scheme,
                               ignore=tuple(ignore) if method != "gptq" else ())


def float_linear_modules(tensors: Mapping[str, np.ndarray]) -> list[str]:
  """Modules stored as a 2-D float `{module}.weight`: the ones a quantization config must list as
  ignored (routers, and attention / LM head / embeddings passed as extra tensors)."""
  return sorted(name[:-len(".weight")] for name, t in tensors.items()
                if name.endswith(".weight") and np.ndim(t) == 2
                and quantized.is_float_dtype(np.asarray(t).dtype))


def save_moe_checkpoint(path: str | Path, layers: Mapping[int, MoELayerTensors], *,
                        fmt: str | None = None, model_config: MoEModelConfig | None = None,
                        activation_bits: int | None = None,
                        experts_prefix: str = "model.layers.{layer}.mlp.experts",
                        naming: str = "gate_proj",
                        extra_tensors: Mapping[str, np.ndarray] | None = None,
                        extra_config: Mapping[str, Any] | None = None,
                        ignore: Sequence[str] | None = None,
                        max_shard_bytes: int = 2 << 30, show_progress: bool = True) -> Path:
  """Writes MoE layers as a safetensors checkpoint directory with `config.json`.

  Args:
    path: the directory (created).
    layers: layer index -> `MoELayerTensors`.
    fmt: "float", "compressed-tensors" (uint4b8 int32), "gptq", or "mxint4" (signed-nibble uint8,
      bf16 group-32 scales). Default: "float" for float layers, else "compressed-tensors".
    model_config: written into config.json (MoE shape and routing) when given.
    activation_bits: 8 marks a compressed-tensors checkpoint as W4A8-int (dynamic per token).
    experts_prefix: name template with `{layer}`; `naming` "gate_proj" or "w1" (Mixtral).
    extra_tensors: other model tensors (embeddings, attention, norms) written as they are.
    extra_config: more config.json fields (e.g. attention sizes of the example model).
    ignore: compressed-tensors `ignore` (modules left float). Default: every module written as a
      2-D float `.weight` (routers, and extra tensors such as attention and lm_head), so that
      transformers and vLLM load a whole model whose experts alone are int4.
    max_shard_bytes: files are split above this size, with a `model.safetensors.index.json`.
  """
  st_numpy = _safetensors_numpy()
  if not layers:
    raise ValueError("layers is empty: nothing to write")
  kinds = {l.quantized for l in layers.values()}
  if len(kinds) != 1:
    raise ValueError("layers mix float and int4 experts; write them as one kind")
  if fmt is None:
    fmt = "compressed-tensors" if kinds.pop() else "float"
  quant_config_for(fmt, layers, activation_bits)  # fails early on a bad combination
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors: dict[str, np.ndarray] = dict(extra_tensors or {})
  with Progress(len(layers), f"writing {fmt} MoE layers", enabled=show_progress) as bar:
    for index, layer in sorted(layers.items()):
      tensors.update(layer_tensors(layer, experts_prefix.format(layer=index), fmt, naming))
      bar.update(note=f"layer {index}")
  qcfg = quant_config_for(fmt, layers, activation_bits,
                          float_linear_modules(tensors) if ignore is None else ignore)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(tensors):
    nbytes = tensors[name].nbytes
    if size and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += nbytes
  if len(shards) == 1:
    st_numpy.save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
  else:
    weight_map = {}
    for n, shard in enumerate(shards):
      fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
      st_numpy.save_file(shard, str(path / fname), metadata={"format": "pt"})
      weight_map.update({k: fname for k in shard})
    with open(path / INDEX_FILE, "w") as f:
      json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": weight_map}, f, indent=1)
  config: dict[str, Any] = {}
  if model_config is not None:
    config.update(model_config.to_json())
  config.update(extra_config or {})
  qjson = qcfg.to_json()
  if qjson is not None:
    if fmt == "mxint4":
      qjson["quant_method"] = "mxint4"
    config["quantization_config"] = qjson
  with open(path / "config.json", "w") as f:
    json.dump(config, f, indent=1)
  return path
