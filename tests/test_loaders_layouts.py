"""MoE expert storages: per expert, stacked 3-D (compressed-tensors' 3-D weights) and fused
gate_up (transformers 5's concatenated [E, 2I, H] vs GPT-OSS's interleaved [E, H, 2I]), found
per layer and told apart without guessing.
"""

import json

import ml_dtypes
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from jax_moeq.loaders import (  # noqa: E402
    CheckpointQuantConfig, SafetensorsDir, discover_moe_layers, find_moe_layout,
    load_moe_checkpoint, load_moe_layer, parse_quantization_config)

BF16 = ml_dtypes.bfloat16
# H == 2I: gate_up_proj alone cannot tell [E, 2I, H] from [E, H, 2I]; down_proj can.
E, H, I = 4, 64, 32
EXPERTS = "model.layers.0.mlp.experts"
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
          "group_size": 32}}}}


def _words(q):
  """[..., n] int4 -> [..., n/8] int32, element 8r+j at bits 4j of word r, stored as q + 8."""
  u = (q.astype(np.int64) + 8).reshape(*q.shape[:-1], -1, 8)
  word = np.zeros(u.shape[:-1], np.int64)
  for j in range(8):
    word |= u[..., j] << (4 * j)
  return word.astype(np.uint32).view(np.int32)


def _ckpt(tmp_path, tensors, cfg=None):
  safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
  if cfg is not None:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
  return SafetensorsDir(tmp_path)


def _float_experts(seed=0):
  rng = np.random.default_rng(seed)
  gate, up = (rng.normal(size=(E, I, H)).astype(np.float32) for _ in range(2))
  down = rng.normal(size=(E, H, I)).astype(np.float32)
  return gate, up, down


def _q_experts(seed=1):
  rng = np.random.default_rng(seed)
  out = {}
  for name, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
    out[name] = (rng.integers(-8, 8, (E, n, k)).astype(np.int8),
                 rng.uniform(0.01, 0.1, (E, n, k // 32)).astype(BF16))
  return out


# ------------------------------------------------------------------ fused float parameters
def test_transformers5_concat_fused_experts(tmp_path):
  gate, up, down = _float_experts()
  tensors = {f"{EXPERTS}.gate_up_proj": np.concatenate([gate, up], axis=1),  # [E, 2I, H]
             f"{EXPERTS}.down_proj": down,  # [E, H, I]
             "model.layers.0.mlp.gate.weight": np.ones((E, H), np.float32)}
  ckpt = _ckpt(tmp_path, tensors)
  layout = discover_moe_layers(ckpt)[0]
  assert layout.storage == "fused" and layout.num_experts == E
  layer = load_moe_layer(ckpt, layout, CheckpointQuantConfig())
  np.testing.assert_array_equal(layer.w13, np.concatenate([gate, up], axis=1))
  np.testing.assert_array_equal(layer.w2, down)
  assert layer.router_weight.shape == (E, H)
  # The caller may say so, and may give H and I.
  again = load_moe_layer(ckpt, layout, CheckpointQuantConfig(), fused_layout="concat",
                         hidden_size=H, intermediate_size=I)
  np.testing.assert_array_equal(again.w13, layer.w13)
  with pytest.raises(ValueError, match="fused_layout='interleaved' needs"):
    load_moe_layer(ckpt, layout, CheckpointQuantConfig(), fused_layout="interleaved")


def test_gpt_oss_interleaved_fused_experts(tmp_path):
  gate, up, down = _float_experts(2)
  gate_up = np.empty((E, H, 2 * I), np.float32)  # [E, H, 2I], gate at even columns
  gate_up[..., 0::2] = gate.transpose(0, 2, 1)
  gate_up[..., 1::2] = up.transpose(0, 2, 1)
  tensors = {f"{EXPERTS}.gate_up_proj": gate_up,
             f"{EXPERTS}.down_proj": down.transpose(0, 2, 1).copy()}  # [E, I, H]
  ckpt = _ckpt(tmp_path, tensors)
  layer = load_moe_layer(ckpt, EXPERTS, CheckpointQuantConfig())
  np.testing.assert_array_equal(layer.w13, np.concatenate([gate, up], axis=1))
  np.testing.assert_array_equal(layer.w2, down)
  with pytest.raises(ValueError, match="fused_layout='concat' needs"):
    load_moe_layer(ckpt, EXPERTS, CheckpointQuantConfig(), fused_layout="concat")


def test_fused_shapes_that_fit_no_layout(tmp_path):
  tensors = {f"{EXPERTS}.gate_up_proj": np.zeros((E, 2 * I, H), np.float32),
             f"{EXPERTS}.down_proj": np.zeros((E, I, I), np.float32)}
  ckpt = _ckpt(tmp_path, tensors)
  with pytest.raises(ValueError, match="fit neither"):
    load_moe_layer(ckpt, EXPERTS, CheckpointQuantConfig())


def test_config_sizes_decide_and_check(tmp_path):
  gate, up, down = _float_experts(3)
  tensors = {f"{EXPERTS}.gate_up_proj": np.concatenate([gate, up], axis=1),
             f"{EXPERTS}.down_proj": down}
  ckpt = _ckpt(tmp_path, tensors)
  with pytest.raises(ValueError, match="with H=32, I=64"):
    load_moe_layer(ckpt, EXPERTS, CheckpointQuantConfig(), hidden_size=32, intermediate_size=64)
  # load_moe_checkpoint passes config.json's sizes.
  (tmp_path / "config.json").write_text(json.dumps(
      {"num_experts": E, "num_experts_per_tok": 2, "hidden_size": H, "moe_intermediate_size": I,
       "num_hidden_layers": 1}))
  ck = load_moe_checkpoint(tmp_path, show_progress=False)
  np.testing.assert_array_equal(ck.layers[0].w2, down)


# ------------------------------------------------------------------ stacked 3-D
def test_stacked_float_experts(tmp_path):
  gate, up, down = _float_experts(4)
  tensors = {f"{EXPERTS}.gate_proj.weight": gate, f"{EXPERTS}.up_proj.weight": up,
             f"{EXPERTS}.down_proj.weight": down,
             # a shared expert is a plain 2-D MLP, not a stacked experts tensor
             "model.layers.0.mlp.shared_experts.gate_proj.weight": np.ones((I, H), np.float32)}
  ckpt = _ckpt(tmp_path, tensors)
  layouts = discover_moe_layers(ckpt.keys())
  assert list(layouts) == [0] and layouts[0].experts == EXPERTS
  assert layouts[0].storage == "stacked" and layouts[0].num_experts == -1  # names only
  assert discover_moe_layers(ckpt)[0].num_experts == E  # shapes, no data read
  layer = load_moe_layer(ckpt, layouts[0], CheckpointQuantConfig())
  np.testing.assert_array_equal(layer.w13, np.concatenate([gate, up], axis=1))
  np.testing.assert_array_equal(layer.w2, down)


@pytest.mark.parametrize("fused", [False, True])
def test_packed_3d_experts_match_per_expert(tmp_path, fused):
  qs = _q_experts()
  tensors = {}
  if fused:  # one [E, 2I, H/8] gate_up module weight, as compressed-tensors packs a 3-D weight
    q13 = np.concatenate([qs["gate_proj"][0], qs["up_proj"][0]], axis=1)
    s13 = np.concatenate([qs["gate_proj"][1], qs["up_proj"][1]], axis=1)
    items = {"gate_up_proj": (q13, s13), "down_proj": qs["down_proj"]}
  else:
    items = qs
  for name, (q, s) in items.items():
    p = f"{EXPERTS}.{name}"
    tensors[f"{p}.weight_packed"] = _words(q)
    tensors[f"{p}.weight_scale"] = s
    tensors[f"{p}.weight_shape"] = np.array(q.shape, np.int64)  # [E, out, in]
  (tmp_path / "a").mkdir()
  ckpt = _ckpt(tmp_path / "a", tensors)
  layout = discover_moe_layers(ckpt)[0]
  assert layout.storage == ("fused" if fused else "stacked") and layout.num_experts == E
  layer = load_moe_layer(ckpt, layout, parse_quantization_config(CT))
  # The same experts written one by one.
  per = {}
  for name, (q, s) in qs.items():
    for e in range(E):
      p = f"{EXPERTS}.{e}.{name}"
      per[f"{p}.weight_packed"] = _words(q[e])
      per[f"{p}.weight_scale"] = s[e]
      per[f"{p}.weight_shape"] = np.array(q[e].shape, np.int64)
  (tmp_path / "b").mkdir()
  ckpt_b = _ckpt(tmp_path / "b", per)
  layout_b = discover_moe_layers(ckpt_b)[0]
  assert layout_b.storage == "per_expert"
  want = load_moe_layer(ckpt_b, layout_b, parse_quantization_config(CT))
  for f in ("w13", "w2", "w13_scale", "w2_scale"):
    np.testing.assert_array_equal(getattr(layer, f), getattr(want, f), err_msg=f)
  np.testing.assert_array_equal(layer.w13[:, :I], qs["gate_proj"][0])
  assert layer.group_size == 32 and layer.w13_g_idx is None


def test_fused_module_rows_interleaved_on_request(tmp_path):
  qs = _q_experts(5)
  q13 = np.empty((E, 2 * I, H), np.int8)
  s13 = np.empty((E, 2 * I, H // 32), BF16)
  q13[:, 0::2], q13[:, 1::2] = qs["gate_proj"][0], qs["up_proj"][0]
  s13[:, 0::2], s13[:, 1::2] = qs["gate_proj"][1], qs["up_proj"][1]
  tensors = {f"{EXPERTS}.gate_up_proj.weight_packed": _words(q13),
             f"{EXPERTS}.gate_up_proj.weight_scale": s13,
             f"{EXPERTS}.down_proj.weight_packed": _words(qs["down_proj"][0]),
             f"{EXPERTS}.down_proj.weight_scale": qs["down_proj"][1]}
  ckpt = _ckpt(tmp_path, tensors)
  layer = load_moe_layer(ckpt, EXPERTS, parse_quantization_config(CT), fused_layout="interleaved")
  np.testing.assert_array_equal(layer.w13[:, :I], qs["gate_proj"][0])
  np.testing.assert_array_equal(layer.w13[:, I:], qs["up_proj"][0])
  np.testing.assert_array_equal(layer.w13_scale[:, I:], qs["up_proj"][1])


# ------------------------------------------------------------------ discovery per layer
def test_find_layout_per_layer_and_errors(tmp_path):
  gate, up, down = _float_experts(6)
  tensors = {}
  for layer in (1, 3):
    for e in range(E):
      p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
      tensors[f"{p}.w1.weight"], tensors[f"{p}.w3.weight"] = gate[e], up[e]
      tensors[f"{p}.w2.weight"] = down[e]
  ckpt = _ckpt(tmp_path, tensors)
  layouts = discover_moe_layers(ckpt.keys())
  assert sorted(layouts) == [1, 3] and layouts[3].projs == ("w1", "w3", "w2")
  prefix = "model.layers.3.block_sparse_moe.experts"
  assert find_moe_layout(ckpt.keys(), prefix) == layouts[3]
  assert layouts[3].layer == 3 and layouts[3].parent == "model.layers.3.block_sparse_moe"
  layer = load_moe_layer(ckpt, prefix, CheckpointQuantConfig())
  np.testing.assert_array_equal(layer.w13[2, I:], up[2])
  with pytest.raises(KeyError, match="model.layers.2"):
    find_moe_layout(ckpt.keys(), "model.layers.2.block_sparse_moe.experts")


@pytest.mark.parametrize("names,words", [
    ([f"{EXPERTS}.0.gate_proj.weight", f"{EXPERTS}.gate_up_proj"], "two layouts"),
    ([f"{EXPERTS}.0.gate_proj.weight", f"{EXPERTS}.2.gate_proj.weight"], "are not 0..1"),
    ([f"{EXPERTS}.0.gate_proj.weight", f"{EXPERTS}.0.w3.weight"], "mix gate_proj"),
    (["model.layers.0.mlp.experts.0.up_proj.weight",
      "model.layers.0.moe.experts.0.up_proj.weight"], "two prefixes"),
    ([f"{EXPERTS}.down_proj.weight_packed"], "no gate/up"),
])
def test_inconsistent_names_are_errors(names, words):
  with pytest.raises(ValueError, match=words):
    discover_moe_layers(names)


def test_per_expert_mixing_float_and_int4_is_an_error(tmp_path):
  qs = _q_experts(7)
  tensors = {}
  for name, (q, s) in qs.items():
    for e in range(E):
      p = f"{EXPERTS}.{e}.{name}"
      if e == 1 and name == "up_proj":
        tensors[f"{p}.weight"] = q[e].astype(np.float32)
      else:
        tensors[f"{p}.weight_packed"] = _words(q[e])
        tensors[f"{p}.weight_scale"] = s[e]
  ckpt = _ckpt(tmp_path, tensors)
  with pytest.raises(ValueError, match="mix float and int4"):
    load_moe_layer(ckpt, EXPERTS, parse_quantization_config(CT))


def test_find_layout_under_any_prefix(tmp_path):
  gate, up, down = _float_experts(8)
  ex = "transformer.moe_block.experts"  # no "layers.{L}" in the names
  tensors = {f"{ex}.gate_up_proj": np.concatenate([gate, up], axis=1), f"{ex}.down_proj": down}
  ckpt = _ckpt(tmp_path, tensors)
  assert discover_moe_layers(ckpt) == {}
  layout = find_moe_layout(ckpt, ex)
  assert layout.storage == "fused" and layout.layer == -1 and layout.num_experts == E
  layer = load_moe_layer(ckpt, ex, CheckpointQuantConfig())
  np.testing.assert_array_equal(layer.w2, down)
