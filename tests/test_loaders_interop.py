"""Interop with the real compressed-tensors library (and transformers), both directions.

- The library packs (W4A16 and W4A8-int, groups of 32 and 128; experts as per-expert nn.Linear,
  as 3-D stacked projections, and as one fused 3-D gate_up) and our loaders read the result: the
  same integers and, dequantized, the same bits as the library's own decompression.
- Our writer packs and the library (its `PackedQuantizationCompressor`, its config validation, and
  transformers' `from_pretrained` on a whole tiny Qwen3-MoE) reads it back bit for bit.
"""

import json

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="compressed-tensors interop needs torch")
pytest.importorskip("compressed_tensors", reason="interop tests need compressed-tensors")
st_torch = pytest.importorskip("safetensors.torch")

from compressed_tensors.compressors import (  # noqa: E402
    ModelCompressor, PackedQuantizationCompressor, unpack_from_int32)
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig, apply_quantization_config)
from torch import nn  # noqa: E402

from jax_moeq.loaders import (  # noqa: E402
    MoELayerTensors, MoEModelConfig, SafetensorsDir, dequantize_int4, discover_moe_layers,
    load_moe_checkpoint, load_moe_layer, parse_quantization_config, read_config_json,
    read_linear, save_moe_checkpoint)

BF16 = ml_dtypes.bfloat16
E, H, I, V = 4, 256, 128, 32
W4A8 = {"num_bits": 8, "type": "int", "symmetric": False, "dynamic": True, "strategy": "token"}
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def _ct_config(group_size: int, act8: bool) -> dict:
  weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
             "group_size": group_size}
  return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                        "input_activations": W4A8 if act8 else None}},
          "format": "pack-quantized", "ignore": IGNORE}


class Experts3D(nn.Linear):
  """A linear module whose weight is [E, out, in]: compressed-tensors packs it as E 2-D weights."""

  def __init__(self, e: int, out: int, inp: int):
    super().__init__(inp, out, bias=False, dtype=torch.bfloat16)
    self.weight = nn.Parameter(0.05 * torch.randn(e, out, inp, dtype=torch.bfloat16))


def _module(**children) -> nn.Module:
  m = nn.Module()
  for name, child in children.items():
    setattr(m, name, child)
  return m


def _linear(out, inp):
  return nn.Linear(inp, out, bias=False, dtype=torch.bfloat16)


def _tiny_model(experts: str) -> nn.Module:
  """model.layers.0.{self_attn.q_proj, mlp.gate, mlp.experts...} and lm_head, in bf16."""
  if experts == "per_expert":
    ex = nn.ModuleList(_module(gate_proj=_linear(I, H), up_proj=_linear(I, H),
                               down_proj=_linear(H, I)) for _ in range(E))
  elif experts == "stacked":
    ex = _module(gate_proj=Experts3D(E, I, H), up_proj=Experts3D(E, I, H),
                 down_proj=Experts3D(E, H, I))
  else:
    ex = _module(gate_up_proj=Experts3D(E, 2 * I, H), down_proj=Experts3D(E, H, I))
  layer = _module(self_attn=_module(q_proj=_linear(H, H)),
                  mlp=_module(gate=_linear(E, H), experts=ex))
  return _module(model=_module(layers=nn.ModuleList([layer])), lm_head=_linear(V, H))


def _compress_with_library(path, experts: str, group_size: int, act8: bool):
  """Quantizes the tiny model with compressed-tensors (scales absmax/7.5 per group) and saves it
  as llm-compressor does: state dict + config.json from `ModelCompressor.update_config`."""
  torch.manual_seed(0)
  model = _tiny_model(experts)
  qcfg = QuantizationConfig.model_validate(_ct_config(group_size, act8))
  apply_quantization_config(model, qcfg)
  with torch.no_grad():
    for _, m in model.named_modules():
      if hasattr(m, "weight_scale"):
        w = m.weight.float()
        groups = w.reshape(*w.shape[:-1], -1, group_size)
        m.weight_scale.copy_((groups.abs().amax(-1) / 7.5).to(m.weight_scale.dtype))
  originals = {n: p.detach().clone() for n, p in model.named_parameters()}
  compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
  compressor.compress_model(model)
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  st_torch.save_file(state, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(
      {"num_experts": E, "num_experts_per_tok": 2, "hidden_size": H, "moe_intermediate_size": I,
       "num_hidden_layers": 1}))
  compressor.update_config(str(path))
  return state, originals, compressor.quantization_config.config_groups["group_0"]


def _library_decompress(state, prefix, scheme):
  sd = {k: state[f"{prefix}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
  return PackedQuantizationCompressor.decompress(sd, scheme)["weight"]


def _as_np(t):
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(BF16)
  return t.numpy()


# ------------------------------------------------------------------ library writes, we read
@pytest.mark.parametrize("experts", ["per_expert", "stacked", "fused"])
@pytest.mark.parametrize("group_size,act8", [(32, False), (128, False), (32, True), (128, True)])
def test_library_packed_checkpoint_reads_identically(tmp_path, experts, group_size, act8):
  state, originals, scheme = _compress_with_library(tmp_path, experts, group_size, act8)
  ex = "model.layers.0.mlp.experts"
  names = {"per_expert": [f"{ex}.0.gate_proj.weight_packed"],
           "stacked": [f"{ex}.gate_proj.weight_packed"],
           "fused": [f"{ex}.gate_up_proj.weight_packed"]}[experts]
  for n in names:  # what the library wrote for 3-D weights: [E, out, in/8] int32, shape [3]
    assert state[n].dtype == torch.int32
    if experts != "per_expert":
      assert state[n].ndim == 3 and state[n.replace("packed", "shape")].tolist()[0] == E
  ck = load_moe_checkpoint(tmp_path, show_progress=False)
  qc = ck.quant_config
  assert qc.scheme == ("w4a8_int8" if act8 else "wna16") and qc.group_size == group_size
  assert qc.is_ignored("lm_head") and qc.is_ignored("model.layers.0.mlp.gate")
  layer = ck.layers[0]
  assert layer.w13.shape == (E, 2 * I, H) and layer.w13_scale.dtype == BF16
  # The library's own decompression, arranged as w13 / w2.
  if experts == "per_expert":
    deq = {p: torch.stack([_library_decompress(state, f"{ex}.{e}.{p}", scheme) for e in range(E)])
           for p in ("gate_proj", "up_proj", "down_proj")}
    packed_gate = torch.stack([state[f"{ex}.{e}.gate_proj.weight_packed"] for e in range(E)])
  elif experts == "stacked":
    deq = {p: _library_decompress(state, f"{ex}.{p}", scheme)
           for p in ("gate_proj", "up_proj", "down_proj")}
    packed_gate = state[f"{ex}.gate_proj.weight_packed"]
  else:
    gu = _library_decompress(state, f"{ex}.gate_up_proj", scheme)
    deq = {"gate_proj": gu[:, :I], "up_proj": gu[:, I:],
           "down_proj": _library_decompress(state, f"{ex}.down_proj", scheme)}
    packed_gate = state[f"{ex}.gate_up_proj.weight_packed"][:, :I]
  want13 = _as_np(torch.cat([deq["gate_proj"], deq["up_proj"]], dim=1))
  ours13 = dequantize_int4(layer.w13, layer.w13_scale, group_size, dtype=BF16)
  np.testing.assert_array_equal(ours13.view(np.int16), want13.view(np.int16))
  ours2 = dequantize_int4(layer.w2, layer.w2_scale, group_size, dtype=BF16)
  np.testing.assert_array_equal(ours2.view(np.int16), _as_np(deq["down_proj"]).view(np.int16))
  # The same integers as the library's unpacking.
  q_gate = unpack_from_int32(packed_gate, 4, torch.Size([E, I, H])).numpy()
  np.testing.assert_array_equal(layer.w13[:, :I], q_gate)
  # Dense layers: the packed attention projection dequantizes alike; ignored ones are float.
  ckpt = SafetensorsDir(tmp_path)
  w, _ = read_linear(ckpt, "model.layers.0.self_attn.q_proj", qc, dtype=BF16)
  want = _as_np(_library_decompress(state, "model.layers.0.self_attn.q_proj", scheme))
  np.testing.assert_array_equal(w.view(np.int16), want.view(np.int16))
  w, _ = read_linear(ckpt, "lm_head", qc)
  np.testing.assert_array_equal(w, originals["lm_head.weight"].float().numpy())
  w, _ = read_linear(ckpt, "model.layers.0.mlp.gate", qc)
  np.testing.assert_array_equal(w, originals["model.layers.0.mlp.gate.weight"].float().numpy())


def test_library_config_has_the_fields_we_parse(tmp_path):
  _compress_with_library(tmp_path, "per_expert", 32, True)
  qc = read_config_json(tmp_path)["quantization_config"]
  assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
  parsed = parse_quantization_config(qc)
  assert parsed.targets == ("Linear",) and parsed.activation_bits == 8


# ------------------------------------------------------------------ we write, the library reads
def _random_layer(rng, group_size, scale_dtype):
  groups = lambda k: 1 if group_size == -1 else k // group_size
  return MoELayerTensors(
      w13=rng.integers(-8, 8, (E, 2 * I, H)).astype(np.int8),
      w2=rng.integers(-8, 8, (E, H, I)).astype(np.int8),
      w13_scale=rng.uniform(0.001, 0.05, (E, 2 * I, groups(H))).astype(scale_dtype),
      w2_scale=rng.uniform(0.001, 0.05, (E, H, groups(I))).astype(scale_dtype),
      group_size=group_size, router_weight=rng.normal(size=(E, H)).astype(BF16))


@pytest.mark.parametrize("group_size,act8", [(32, False), (128, False), (32, True), (128, True),
                                             (-1, False)])
def test_our_writer_decompresses_identically_with_the_library(tmp_path, group_size, act8):
  rng = np.random.default_rng(abs(group_size) + act8)
  scale_dtype = np.float32 if group_size == -1 else BF16
  layers = {0: _random_layer(rng, group_size, scale_dtype),
            1: _random_layer(rng, group_size, scale_dtype)}
  extra = {"model.layers.0.self_attn.q_proj.weight": rng.normal(size=(H, H)).astype(BF16),
           "model.norm.weight": np.ones(H, BF16)}
  save_moe_checkpoint(tmp_path, layers, fmt="compressed-tensors",
                      activation_bits=8 if act8 else None, extra_tensors=extra,
                      show_progress=False)
  qc_json = read_config_json(tmp_path)["quantization_config"]
  qcfg = QuantizationConfig.model_validate(qc_json)  # the library accepts our config
  scheme = qcfg.config_groups["group_0"]
  assert (scheme.input_activations is not None) == act8
  # Modules we wrote float are in `ignore`, so loaders do not expect them packed.
  assert "model.layers.0.self_attn.q_proj" in qcfg.ignore
  assert "model.layers.1.mlp.gate" in qcfg.ignore
  state = st_torch.load_file(str(tmp_path / "model.safetensors"))
  for index, layer in layers.items():
    ex = f"model.layers.{index}.mlp.experts"
    for e in range(E):
      for proj, q, s in (("gate_proj", layer.w13[e, :I], layer.w13_scale[e, :I]),
                         ("up_proj", layer.w13[e, I:], layer.w13_scale[e, I:]),
                         ("down_proj", layer.w2[e], layer.w2_scale[e])):
        got = _as_np(_library_decompress(state, f"{ex}.{e}.{proj}", scheme))
        want = dequantize_int4(q, s, group_size, dtype=got.dtype)
        assert got.dtype == s.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
  # And our own reader agrees with what we wrote.
  back = load_moe_checkpoint(tmp_path, show_progress=False)
  np.testing.assert_array_equal(back.layers[1].w13, layers[1].w13)
  assert sorted(discover_moe_layers(SafetensorsDir(tmp_path))) == [0, 1]


def test_transformers_loads_our_whole_model_checkpoint(tmp_path):
  """A tiny Qwen3-MoE: its experts quantized by us and written with our writer next to its float
  attention / norms / embeddings; transformers (compressed-tensors underneath) loads the directory
  and holds exactly our dequantized experts and the float layers as they were."""
  transformers = pytest.importorskip("transformers", reason="end-to-end load with transformers")
  cfg = transformers.Qwen3MoeConfig(
      vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=64, num_experts_per_tok=2, moe_intermediate_size=I,
      num_experts=E, intermediate_size=2 * I)
  torch.manual_seed(1)
  model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
  state = model.state_dict()
  g = 32

  def quantize(w):  # [E, out, in] -> int4 q, bf16 scales (absmax / 7.5)
    w = w.float().numpy()
    groups = w.reshape(*w.shape[:-1], -1, g)
    s = (np.abs(groups).max(-1) / 7.5).astype(BF16)
    sf = np.where(s.astype(np.float32) == 0, 1, s.astype(np.float32))
    q = np.clip(np.rint(groups / sf[..., None]), -8, 7).astype(np.int8).reshape(w.shape)
    return q, s

  layers, extra = {}, {}
  for name, value in state.items():
    if ".mlp.experts." not in name and not name.endswith("mlp.gate.weight"):
      extra[name] = _as_np(value.contiguous())
  for index in range(cfg.num_hidden_layers):
    # transformers 5 holds experts fused in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I].
    q13, s13 = quantize(state[f"model.layers.{index}.mlp.experts.gate_up_proj"])
    q2, s2 = quantize(state[f"model.layers.{index}.mlp.experts.down_proj"])
    layers[index] = MoELayerTensors(
        w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, group_size=g,
        router_weight=_as_np(state[f"model.layers.{index}.mlp.gate.weight"]))
  save_moe_checkpoint(tmp_path, layers, fmt="compressed-tensors", extra_tensors=extra,
                      extra_config=cfg.to_dict(), model_config=MoEModelConfig(
                          num_experts=E, top_k=2, hidden_size=H, intermediate_size=I,
                          num_layers=2), show_progress=False)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
  for index, layer in layers.items():
    mlp = loaded.model.layers[index].mlp
    want13 = dequantize_int4(layer.w13, layer.w13_scale, g, dtype=BF16)
    np.testing.assert_array_equal(_as_np(mlp.experts.gate_up_proj.detach()).view(np.int16),
                                  want13.view(np.int16))
    want2 = dequantize_int4(layer.w2, layer.w2_scale, g, dtype=BF16)
    np.testing.assert_array_equal(_as_np(mlp.experts.down_proj.detach()).view(np.int16),
                                  want2.view(np.int16))
    assert torch.equal(mlp.gate.weight, model.model.layers[index].mlp.gate.weight)
    assert torch.equal(loaded.model.layers[index].self_attn.q_proj.weight,
                       model.model.layers[index].self_attn.q_proj.weight)
  assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_transformers_float_experts_on_disk_and_in_memory_layouts(tmp_path, arch):
  """save_pretrained writes per-expert tensors; a raw state dict holds transformers 5's fused
  [E, 2I, H] gate_up_proj (gate rows then up, not interleaved) and [E, H, I] down_proj. With
  H == 2I, gate_up_proj's shape alone would fit GPT-OSS's [E, H, 2I] too: down_proj decides."""
  transformers = pytest.importorskip("transformers", reason="transformers' own layouts")
  h, i = 64, 32
  common = dict(vocab_size=V, hidden_size=h, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts_per_tok=2)
  if arch == "qwen3_moe":
    cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=i, num_experts=E, **common)
    model_cls = transformers.Qwen3MoeForCausalLM
  else:
    cfg = transformers.MixtralConfig(intermediate_size=i, num_local_experts=E, **common)
    model_cls = transformers.MixtralForCausalLM
  torch.manual_seed(2)
  model = model_cls(cfg)
  experts = model.model.layers[0].mlp.experts
  want13 = experts.gate_up_proj.detach().numpy()  # [E, 2I, H]
  want2 = experts.down_proj.detach().numpy()  # [E, H, I]
  assert want13.shape == (E, 2 * i, h) and want2.shape == (E, h, i)
  model.save_pretrained(str(tmp_path / "saved"))
  (tmp_path / "raw").mkdir()
  st_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                     str(tmp_path / "raw" / "model.safetensors"))
  for sub, storage in (("saved", "per_expert"), ("raw", "fused")):
    ckpt = SafetensorsDir(tmp_path / sub)
    layout = discover_moe_layers(ckpt)[0]
    assert layout.storage == storage
    layer = load_moe_layer(ckpt, layout, parse_quantization_config(None))
    np.testing.assert_array_equal(layer.w13, want13)
    np.testing.assert_array_equal(layer.w2, want2)
    np.testing.assert_array_equal(layer.router_weight,
                                  model.model.layers[0].mlp.gate.weight.detach().numpy())
