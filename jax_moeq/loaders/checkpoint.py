"""Reading and writing MoE expert weights in safetensors checkpoints.

Per-expert tensors are named `{experts}.{e}.{proj}.{tensor}` with `{experts}` e.g.
`model.layers.{L}.mlp.experts` (Qwen-MoE, OLMoE, DeepSeek: projections gate_proj/up_proj/down_proj)
or `model.layers.{L}.block_sparse_moe.experts` (Mixtral: w1/w3/w2). They are stacked into
`w13 [E, 2I, H]` (gate rows first, then up) and `w2 [E, H, I]`. A fused float layout
`{experts}.gate_up_proj [E, H, 2I]` with gate/up interleaved along the last axis (GPT-OSS) and
`{experts}.down_proj [E, I, H]` is converted to halves.

The router (`{parent}.gate.weight [E, H]`, optional `{parent}.gate.e_score_correction_bias [E]`) is
loaded when present. `safetensors` is imported lazily: it is only needed here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from jax_moeq.loaders import int4_format
from jax_moeq.loaders.config import (
    CheckpointQuantConfig, MoEModelConfig, parse_model_config, parse_quantization_config,
    read_config_json)
from jax_moeq.loaders.progress import Progress

INDEX_FILE = "model.safetensors.index.json"
PROJ_NAMES = {"gate_proj": ("gate_proj", "up_proj", "down_proj"), "w1": ("w1", "w3", "w2")}
_EXPERT_KEY = re.compile(
    r"^(?P<experts>.*?layers\.(?P<layer>\d+)\..*?experts)\.(?P<e>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.")
_FUSED_KEY = re.compile(r"^(?P<experts>.*?layers\.(?P<layer>\d+)\..*?experts)\.gate_up_proj$")


def _safetensors():
  try:
    import safetensors.numpy  # noqa: F401
    from safetensors import safe_open
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("reading/writing checkpoints needs `safetensors` "
                      "(pip install 'jax_moeq[checkpoints]')") from e
  return safe_open, safetensors.numpy


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


class SafetensorsDir:
  """Name -> tensor access over a checkpoint directory's safetensors files (lazy, per tensor)."""

  def __init__(self, path: str | Path):
    safe_open, _ = _safetensors()
    self._safe_open = safe_open
    self.path = Path(path)
    if self.path.is_file():
      files = [self.path]
    elif (self.path / INDEX_FILE).exists():
      with open(self.path / INDEX_FILE) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted({self.path / v for v in weight_map.values()})
    else:
      files = sorted(self.path.glob("*.safetensors"))
    if not files:
      raise FileNotFoundError(f"no .safetensors files in {self.path}")
    self._where: dict[str, Path] = {}
    for file in files:
      with safe_open(str(file), "numpy") as f:
        for key in f.keys():
          self._where[key] = file

  def keys(self) -> list[str]:
    return list(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def get(self, name: str) -> np.ndarray:
    if name not in self._where:
      raise KeyError(f"tensor {name!r} is not in the checkpoint {self.path}")
    with self._safe_open(str(self._where[name]), "numpy") as f:
      return f.get_tensor(name)

  def get_optional(self, name: str) -> np.ndarray | None:
    return self.get(name) if name in self else None


@dataclasses.dataclass(frozen=True)
class _ExpertsLayout:
  experts: str  # key prefix up to and including ".experts"
  projs: tuple[str, str, str] | None  # (gate, up, down) names; None for the fused layout
  num_experts: int

  @property
  def parent(self) -> str:
    return self.experts.rsplit(".", 1)[0]


def discover_moe_layers(keys: Iterable[str]) -> dict[int, _ExpertsLayout]:
  """Finds the MoE layers of a checkpoint from its tensor names."""
  found: dict[int, dict[str, Any]] = {}
  for key in keys:
    m = _EXPERT_KEY.match(key)
    if m:
      d = found.setdefault(int(m["layer"]), {"experts": m["experts"], "ids": set(), "projs": set()})
      if d["experts"] != m["experts"]:
        raise ValueError(f"layer {m['layer']} has experts under two prefixes: {d['experts']!r} "
                         f"and {m['experts']!r}")
      d["ids"].add(int(m["e"]))
      d["projs"].add(m["proj"])
      continue
    m = _FUSED_KEY.match(key)
    if m:
      found[int(m["layer"])] = {"experts": m["experts"], "ids": None, "projs": None}
  layouts = {}
  for layer, d in sorted(found.items()):
    if d["ids"] is None:
      layouts[layer] = _ExpertsLayout(d["experts"], None, -1)
      continue
    ids = sorted(d["ids"])
    if ids != list(range(len(ids))):
      raise ValueError(f"layer {layer}: expert ids {ids[:8]}... are not 0..{len(ids) - 1}")
    style = "w1" if "w1" in d["projs"] else "gate_proj"
    layouts[layer] = _ExpertsLayout(d["experts"], PROJ_NAMES[style], len(ids))
  return layouts


# ------------------------------------------------------------------ per-projection readers
def _trivial_g_idx(g_idx: np.ndarray, group_size: int) -> bool:
  k = g_idx.shape[-1]
  g = k if group_size == -1 else group_size
  return bool(np.array_equal(g_idx, np.arange(k) // g))


def _read_proj_compressed(ckpt: SafetensorsDir, p: str, qcfg: CheckpointQuantConfig):
  packed = ckpt.get(f"{p}.weight_packed")
  scale = ckpt.get(f"{p}.weight_scale")
  if packed.dtype == np.uint8:
    q = int4_format.unpack_signed_nibbles(packed)  # MxInt4 signed-nibble bytes [out, in/2]
  elif packed.dtype in (np.int32, np.uint32):
    q = int4_format.unpack_uint4b8(packed, axis=-1)  # [out, in/8] -> [out, in]
  else:
    raise TypeError(f"{p}.weight_packed must be int32 (uint4b8) or uint8 (signed nibbles), got "
                    f"{packed.dtype}")
  shape = ckpt.get_optional(f"{p}.weight_shape")
  if shape is not None:
    out, k = (int(v) for v in np.asarray(shape).reshape(-1))
    if q.shape[0] != out or q.shape[1] < k:
      raise ValueError(f"{p}.weight_shape={[out, k]} does not match weight_packed {packed.shape}")
    q = q[:, :k]
  zp = ckpt.get_optional(f"{p}.weight_zero_point")
  if zp is not None and np.any(zp != 0):
    raise ValueError(f"{p}.weight_zero_point holds non-zero zero points: asymmetric int4 weights "
                     "are not supported")
  g_idx = ckpt.get_optional(f"{p}.weight_g_idx")
  return q, scale, g_idx


def _read_proj_gptq(ckpt: SafetensorsDir, p: str, qcfg: CheckpointQuantConfig):
  qweight = ckpt.get(f"{p}.qweight")  # [in/8, out]
  q = int4_format.unpack_uint4b8(qweight, axis=0).T  # -> [out, in]
  scale = ckpt.get(f"{p}.scales").T  # [in/g, out] -> [out, in/g]
  qzeros = ckpt.get_optional(f"{p}.qzeros")
  if qzeros is not None:
    # Symmetric GPTQ stores zero 8 as 8 - 1 = 7 (v1) or 8 (gptq_v2) in every nibble.
    want = 8 if qcfg.gptq_v2_zeros else 7
    z = int4_format.unpack_uint4b8(qzeros, axis=-1) + 8
    if np.any(z != want):
      raise ValueError(f"{p}.qzeros holds zero points other than {want}: asymmetric GPTQ weights "
                       "are not supported (sym must be true)")
  g_idx = ckpt.get_optional(f"{p}.g_idx")
  return np.ascontiguousarray(q), np.ascontiguousarray(scale), g_idx


def _read_proj(ckpt: SafetensorsDir, p: str, qcfg: CheckpointQuantConfig):
  """-> (weight [out, in] (int8 for int4), scale [out, G] | None, g_idx [in] | None, bias)."""
  bias = ckpt.get_optional(f"{p}.bias")
  if not qcfg.quantized:
    return ckpt.get(f"{p}.weight"), None, None, bias
  reader = _read_proj_gptq if qcfg.quant_method == "gptq" else _read_proj_compressed
  q, scale, g_idx = reader(ckpt, p, qcfg)
  out, k = q.shape
  groups = 1 if qcfg.group_size == -1 else k // qcfg.group_size
  if qcfg.group_size != -1 and k % qcfg.group_size:
    raise ValueError(f"{p}: group_size={qcfg.group_size} does not divide the input size {k}")
  if scale.shape != (out, groups):
    raise ValueError(f"{p}: scales have shape {scale.shape}, expected {(out, groups)} for "
                     f"group_size={qcfg.group_size}")
  if qcfg.group_size == -1:
    scale = scale.astype(np.float32)
  if g_idx is not None:
    g_idx = np.asarray(g_idx).astype(np.int32)
    if g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= groups:
      raise ValueError(f"{p}: g_idx must be [{k}] with groups in [0, {groups}), got shape "
                       f"{g_idx.shape}")
    if np.any(np.bincount(g_idx, minlength=groups) != k // groups):
      raise ValueError(f"{p}: g_idx does not assign {k // groups} channels to every group")
    if _trivial_g_idx(g_idx, qcfg.group_size):
      g_idx = None
  return q, scale, g_idx, bias


def _stack(parts: list[np.ndarray | None], what: str) -> np.ndarray | None:
  present = [p is not None for p in parts]
  if not any(present):
    return None
  if not all(present):
    raise ValueError(f"{what} is present for some experts only")
  return np.stack(parts)


def load_moe_layer(ckpt: SafetensorsDir, layout: _ExpertsLayout,
                   qcfg: CheckpointQuantConfig) -> MoELayerTensors:
  """Reads and stacks one layer's experts (and its router when present)."""
  router = ckpt.get_optional(f"{layout.parent}.gate.weight")
  corr = ckpt.get_optional(f"{layout.parent}.gate.e_score_correction_bias")
  if layout.projs is None:
    return _load_fused_float(ckpt, layout, qcfg, router, corr)
  gate_name, up_name, down_name = layout.projs
  cols: dict[str, list] = {k: [] for k in ("w13", "s13", "g13", "b13", "w2", "s2", "g2", "b2")}
  for e in range(layout.num_experts):
    base = f"{layout.experts}.{e}"
    wg, sg, gg, bg = _read_proj(ckpt, f"{base}.{gate_name}", qcfg)
    wu, su, gu, bu = _read_proj(ckpt, f"{base}.{up_name}", qcfg)
    wd, sd, gd, bd = _read_proj(ckpt, f"{base}.{down_name}", qcfg)
    if wg.shape != wu.shape:
      raise ValueError(f"{base}: {gate_name} {wg.shape} and {up_name} {wu.shape} differ in shape")
    # gate and up read the same input, so act-order (a permutation of that input) must agree.
    if (gg is None) != (gu is None) or (gg is not None and not np.array_equal(gg, gu)):
      raise ValueError(f"{base}: {gate_name}.g_idx and {up_name}.g_idx differ; w13 needs one "
                       "input order for gate and up")
    cols["w13"].append(np.concatenate([wg, wu], axis=0))
    cols["s13"].append(None if sg is None else np.concatenate([sg, su], axis=0))
    cols["g13"].append(gg)
    cols["b13"].append(None if bg is None and bu is None else np.concatenate(
        [bg if bg is not None else np.zeros(wg.shape[0], bu.dtype),
         bu if bu is not None else np.zeros(wu.shape[0], bg.dtype)]))
    cols["w2"].append(wd)
    cols["s2"].append(sd)
    cols["g2"].append(gd)
    cols["b2"].append(bd)
  # Experts without act-order next to experts with it: give them the trivial order.
  for key, k in (("g13", cols["w13"][0].shape[1]), ("g2", cols["w2"][0].shape[1])):
    if any(g is not None for g in cols[key]):
      g = k if qcfg.group_size == -1 else qcfg.group_size
      cols[key] = [gi if gi is not None else (np.arange(k) // g).astype(np.int32)
                   for gi in cols[key]]
  return MoELayerTensors(
      w13=np.stack(cols["w13"]), w2=np.stack(cols["w2"]),
      w13_scale=_stack(cols["s13"], "w13 scale"), w2_scale=_stack(cols["s2"], "w2 scale"),
      group_size=qcfg.group_size if qcfg.quantized else None,
      w13_g_idx=_stack(cols["g13"], "w13 g_idx"), w2_g_idx=_stack(cols["g2"], "w2 g_idx"),
      w13_bias=_stack(cols["b13"], "w13 bias"), w2_bias=_stack(cols["b2"], "w2 bias"),
      router_weight=router, e_score_correction_bias=corr)


def _load_fused_float(ckpt, layout, qcfg, router, corr) -> MoELayerTensors:
  if qcfg.quantized:
    raise ValueError(f"{layout.experts}.gate_up_proj: the fused interleaved gate/up layout is "
                     "supported for float checkpoints only")
  gate_up = ckpt.get(f"{layout.experts}.gate_up_proj")  # [E, H, 2I], gate/up interleaved
  down = ckpt.get(f"{layout.experts}.down_proj")  # [E, I, H]
  w13 = int4_format.deinterleave_gate_up(gate_up, axis=-1).transpose(0, 2, 1)
  b13 = ckpt.get_optional(f"{layout.experts}.gate_up_proj_bias")
  if b13 is not None:
    b13 = int4_format.deinterleave_gate_up(b13, axis=-1)
  return MoELayerTensors(
      w13=np.ascontiguousarray(w13), w2=np.ascontiguousarray(down.transpose(0, 2, 1)),
      w13_bias=b13, w2_bias=ckpt.get_optional(f"{layout.experts}.down_proj_bias"),
      router_weight=router, e_score_correction_bias=corr)


def load_moe_checkpoint(path: str | Path, *, layers: Iterable[int] | None = None,
                        show_progress: bool = True) -> MoECheckpoint:
  """Loads every MoE layer (or `layers`) of a safetensors checkpoint directory.

  Reads `config.json` (model shape and `quantization_config`), finds the per-expert tensors, and
  stacks them into `MoELayerTensors` (host numpy). Unsupported quantization configs raise
  ValueError naming the field.
  """
  path = Path(path)
  cfg_json = read_config_json(path) if (path / "config.json").exists() else {}
  qcfg = parse_quantization_config(cfg_json.get("quantization_config"))
  try:
    model_cfg = parse_model_config(cfg_json) if cfg_json else None
  except ValueError:
    model_cfg = None  # not an MoE config.json we know; the tensors still load
  ckpt = SafetensorsDir(path)
  layouts = discover_moe_layers(ckpt.keys())
  if not layouts:
    raise ValueError(f"{path}: found no MoE expert tensors (expected names like "
                     "'model.layers.0.mlp.experts.0.gate_proj.weight')")
  wanted = sorted(layouts) if layers is None else list(layers)
  missing = [l for l in wanted if l not in layouts]
  if missing:
    raise ValueError(f"layers {missing} have no MoE experts in {path} (found {sorted(layouts)})")
  out = {}
  with Progress(len(wanted), "loading MoE layers", enabled=show_progress) as bar:
    for layer in wanted:
      out[layer] = load_moe_layer(ckpt, layouts[layer], qcfg)
      bar.update(note=f"layer {layer}")
  return MoECheckpoint(model_cfg, qcfg, out, cfg_json)


# ------------------------------------------------------------------ writer
WRITE_FORMATS = ("float", "compressed-tensors", "gptq", "mxint4")


def _proj_tensors(prefix: str, w: np.ndarray, scale: np.ndarray | None, g_idx: np.ndarray | None,
                  bias: np.ndarray | None, fmt: str, group_size: int | None) -> dict[str, np.ndarray]:
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
                     activation_bits: int | None = None) -> CheckpointQuantConfig:
  """The `CheckpointQuantConfig` that describes `layers` written as `fmt`."""
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
                               activation_bits=activation_bits, scheme=scheme)


def save_moe_checkpoint(path: str | Path, layers: Mapping[int, MoELayerTensors], *,
                        fmt: str | None = None, model_config: MoEModelConfig | None = None,
                        activation_bits: int | None = None,
                        experts_prefix: str = "model.layers.{layer}.mlp.experts",
                        naming: str = "gate_proj", extra_tensors: Mapping[str, np.ndarray] | None = None,
                        extra_config: Mapping[str, Any] | None = None,
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
    max_shard_bytes: files are split above this size, with a `model.safetensors.index.json`.
  """
  _, st_numpy = _safetensors()
  if not layers:
    raise ValueError("layers is empty: nothing to write")
  kinds = {l.quantized for l in layers.values()}
  if len(kinds) != 1:
    raise ValueError("layers mix float and int4 experts; write them as one kind")
  if fmt is None:
    fmt = "compressed-tensors" if kinds.pop() else "float"
  qcfg = quant_config_for(fmt, layers, activation_bits)
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors: dict[str, np.ndarray] = dict(extra_tensors or {})
  with Progress(len(layers), f"writing {fmt} MoE layers", enabled=show_progress) as bar:
    for index, layer in sorted(layers.items()):
      tensors.update(layer_tensors(layer, experts_prefix.format(layer=index), fmt, naming))
      bar.update(note=f"layer {index}")
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
