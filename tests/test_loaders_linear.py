"""`read_linear`: dense layers as float, from float, compressed-tensors, MxInt4 and GPTQ storage,
checked against dequantizers written here from the format descriptions (not our packers); and
`config.json` errors that name the file, the line and the field.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from jax_moeq.loaders import (  # noqa: E402
    CheckpointFormatError, CheckpointQuantConfig, ConfigError, MissingFieldError,
    SafetensorsDir, dequantize_int4, load_moe_checkpoint, parse_model_config,
    parse_quantization_config, read_config_json, read_linear, read_projection)

BF16 = ml_dtypes.bfloat16
OUT, IN = 64, 256


def _ct_config(group_size=32, ignore=(), targets=("Linear",), activations=None):
  weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False,
             "strategy": "group" if group_size != -1 else "channel",
             "group_size": None if group_size == -1 else group_size}
  return {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "ignore": list(ignore),
          "config_groups": {"group_0": {"targets": list(targets), "weights": weights,
                                        "input_activations": activations}}}


# ------------------------------------------------------------------ independent encoders
def _nibbles_to_words(u):
  """[..., n] values 0..15 -> [..., n/8] int32, element 8r+j at bits 4j of word r."""
  u = u.astype(np.uint64).reshape(*u.shape[:-1], -1, 8)
  word = np.zeros(u.shape[:-1], np.uint64)
  for j in range(8):
    word |= u[..., j] << np.uint64(4 * j)
  return word.astype(np.uint32).view(np.int32)


def _word_nibble(words, i):
  """Nibble i (of the 8 in each word, along the last axis) as int64 0..15."""
  return (words.astype(np.int64) & 0xFFFFFFFF) >> (4 * i) & 0xF


def _deq_compressed(packed, scale, k, group_size):
  """compressed-tensors: element i of a row at bits 4(i % 8) of word i // 8, stored as q + 8."""
  out = np.empty((packed.shape[0], k), np.float64)
  g = k if group_size == -1 else group_size
  for i in range(k):
    q = _word_nibble(packed[:, i // 8], i % 8) - 8
    out[:, i] = q * scale[:, i // g].astype(np.float64)
  return out


def _deq_gptq(qweight, qzeros, scales, g_idx):
  """AutoGPTQ v1: w[n, k] = scales[g, n] * (q - (z + 1)), g = g_idx[k], q and z nibbles."""
  k, n = qweight.shape[0] * 8, qweight.shape[1]
  out = np.empty((n, k), np.float64)
  zeros = np.stack([_word_nibble(qzeros[:, c // 8], c % 8) for c in range(n)], axis=1) + 1
  for i in range(k):
    q = _word_nibble(qweight[i // 8, :], i % 8)
    g = g_idx[i]
    out[:, i] = scales[g, :].astype(np.float64) * (q - zeros[g, :])
  return out


def _write(tmp_path, tensors, cfg=None):
  safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
  if cfg is not None:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
  return SafetensorsDir(tmp_path)


def _rand(rng, group_size, scale_dtype, out=OUT, k=IN):
  q = rng.integers(-8, 8, (out, k))
  groups = 1 if group_size == -1 else k // group_size
  scale = rng.uniform(0.001, 0.1, (out, groups)).astype(scale_dtype)
  return q, scale


# ------------------------------------------------------------------ compressed-tensors / MxInt4
@pytest.mark.parametrize("group_size,scale_dtype", [(32, BF16), (128, BF16), (128, np.float16),
                                                    (-1, np.float32)])
def test_compressed_tensors_linear_is_exact(tmp_path, group_size, scale_dtype):
  rng = np.random.default_rng(0)
  q, scale = _rand(rng, group_size, scale_dtype)
  packed = _nibbles_to_words(q + 8)
  bias = rng.normal(size=OUT).astype(BF16)
  p = "model.layers.0.self_attn.q_proj"
  ckpt = _write(tmp_path, {f"{p}.weight_packed": packed, f"{p}.weight_scale": scale,
                           f"{p}.weight_shape": np.array([OUT, IN], np.int64), f"{p}.bias": bias})
  qcfg = parse_quantization_config(_ct_config(group_size))
  w, b = read_linear(ckpt, p, qcfg)
  want = _deq_compressed(packed, scale, IN, group_size)
  assert w.dtype == np.float32 and w.shape == (OUT, IN)
  # Exact for bf16/fp16 scales; float32 scales: the exact product rounded once.
  np.testing.assert_array_equal(w, want.astype(np.float32))
  if scale_dtype != np.float32:
    np.testing.assert_array_equal(w.astype(np.float64), want)
  np.testing.assert_array_equal(b, bias.astype(np.float32))
  w16, b16 = read_linear(ckpt, p, qcfg, dtype=BF16)
  assert w16.dtype == BF16 and b16.dtype == BF16
  np.testing.assert_array_equal(w16, want.astype(np.float32).astype(BF16))  # rounded once


def test_mxint4_signed_nibbles_linear(tmp_path):
  rng = np.random.default_rng(1)
  q, scale = _rand(rng, 32, BF16)
  u = (q & 0xF).astype(np.uint8)
  packed = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
  p = "model.layers.0.mlp.down_proj"
  ckpt = _write(tmp_path, {f"{p}.weight_packed": packed, f"{p}.weight_scale": scale})
  qc = _ct_config(32)
  qc["quant_method"] = "mxint4"
  w, b = read_linear(ckpt, p, parse_quantization_config(qc))
  assert b is None
  np.testing.assert_array_equal(w, q.astype(np.float32) * np.repeat(scale.astype(np.float32), 32,
                                                                     axis=1))


def test_weight_shape_trims_padding(tmp_path):
  rng = np.random.default_rng(2)
  k = 96  # packed to 12 words; weight_shape says the true width
  q, scale = _rand(rng, 32, BF16, k=k)
  p = "lin"
  ckpt = _write(tmp_path, {f"{p}.weight_packed": _nibbles_to_words(q + 8),
                           f"{p}.weight_scale": scale, f"{p}.weight_shape": np.array([OUT, k])})
  w, _ = read_linear(ckpt, p, parse_quantization_config(_ct_config(32)))
  assert w.shape == (OUT, k)


# ------------------------------------------------------------------ GPTQ
def _gptq_tensors(rng, group_size, desc_act, out=OUT, k=IN):
  """As AutoGPTQ lays them out: qweight [in/8, out], qzeros [groups, out/8] holding zero - 1 = 7,
  scales [groups, out] fp16, g_idx [in] (desc_act: the group of each input channel after the
  activation-order permutation; qweight stays in natural input order)."""
  g = k if group_size == -1 else group_size
  groups = k // g
  q = rng.integers(-8, 8, (out, k))
  scales = rng.uniform(0.001, 0.1, (groups, out)).astype(np.float16)
  if desc_act:
    perm = rng.permutation(k)
    g_idx = np.empty(k, np.int32)
    g_idx[perm] = np.arange(k) // g
  else:
    g_idx = (np.arange(k) // g).astype(np.int32)
  qweight = _pack_in_axis(q + 8)
  qzeros = _nibbles_to_words(np.full((groups, out), 7))
  return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}, q


def _pack_in_axis(u):
  """[out, in] nibbles -> [in/8, out] int32 (GPTQ packs along the input axis)."""
  return _nibbles_to_words(u).T.copy()


@pytest.mark.parametrize("desc_act,group_size", [(False, 32), (True, 32), (False, 128),
                                                 (True, 128), (False, -1)])
def test_gptq_linear_matches_independent_dequantizer(tmp_path, desc_act, group_size):
  rng = np.random.default_rng(3)
  t, q = _gptq_tensors(rng, group_size, desc_act)
  p = "model.layers.2.self_attn.o_proj"
  ckpt = _write(tmp_path, {f"{p}.{k}": v for k, v in t.items()})
  qcfg = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                    "desc_act": desc_act, "sym": True})
  w, b = read_linear(ckpt, p, qcfg)
  want = _deq_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"])
  assert b is None and w.shape == (OUT, IN)
  np.testing.assert_array_equal(w.astype(np.float64), want)
  # The same numbers from q directly: scale of each channel's group.
  np.testing.assert_array_equal(want, q * t["scales"].astype(np.float64)[t["g_idx"], :].T)
  proj, _ = read_projection(ckpt, p, qcfg)
  assert (proj.g_idx is None) == (not desc_act)


def test_gptq_asymmetric_zeros_rejected(tmp_path):
  t, _ = _gptq_tensors(np.random.default_rng(4), 32, False)
  t["qzeros"] = _nibbles_to_words(np.full((IN // 32, OUT), 3))
  ckpt = _write(tmp_path, {f"l.{k}": v for k, v in t.items()})
  qcfg = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 32})
  with pytest.raises(CheckpointFormatError, match=r"'l\.qzeros'.*zero points other than 7"):
    read_linear(ckpt, "l", qcfg)


# ------------------------------------------------------------------ per-layer decisions
def _mixed_checkpoint(tmp_path):
  """W4A16 as llm-compressor writes it: attention and dense MLP packed, lm_head and gates float."""
  rng = np.random.default_rng(5)
  tensors = {}
  for p in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.0.up_proj"):
    q, scale = _rand(rng, 32, BF16)
    tensors.update({f"{p}.weight_packed": _nibbles_to_words(q + 8), f"{p}.weight_scale": scale,
                    f"{p}.weight_shape": np.array([OUT, IN])})
  tensors["lm_head.weight"] = rng.normal(size=(OUT, IN)).astype(BF16)
  tensors["model.layers.0.mlp.gate.weight"] = rng.normal(size=(8, IN)).astype(BF16)
  return _write(tmp_path, tensors), tensors


def test_each_layer_read_from_its_own_tensors(tmp_path):
  ckpt, tensors = _mixed_checkpoint(tmp_path)
  qcfg = parse_quantization_config(_ct_config(32, ignore=["lm_head", "re:.*mlp.gate$"]))
  assert qcfg.is_ignored("lm_head") and qcfg.is_ignored("model.layers.0.mlp.gate")
  assert not qcfg.is_ignored("model.layers.0.mlp.gate_proj")
  assert qcfg.quantizes("model.layers.0.self_attn.q_proj") and not qcfg.quantizes("lm_head")
  w, _ = read_linear(ckpt, "lm_head", qcfg)
  np.testing.assert_array_equal(w, tensors["lm_head.weight"].astype(np.float32))
  w, _ = read_linear(ckpt, "model.layers.0.mlp.gate", qcfg)
  assert w.shape == (8, IN)
  w, _ = read_linear(ckpt, "model.layers.0.self_attn.q_proj", qcfg)
  assert w.shape == (OUT, IN) and np.abs(w).max() > 0


def test_ignored_layer_stored_packed_is_an_error(tmp_path):
  ckpt, _ = _mixed_checkpoint(tmp_path)
  qcfg = parse_quantization_config(_ct_config(32, ignore=["re:.*q_proj$"]))
  with pytest.raises(CheckpointFormatError, match="q_proj.*ignore"):
    read_linear(ckpt, "model.layers.0.self_attn.q_proj", qcfg)


def test_regex_targets_select_modules():
  qcfg = parse_quantization_config(_ct_config(32, targets=["re:.*experts.*"]))
  assert qcfg.quantizes("model.layers.0.mlp.experts.3.up_proj")
  assert not qcfg.quantizes("model.layers.0.self_attn.q_proj")
  assert not CheckpointQuantConfig().quantizes("model.layers.0.self_attn.q_proj")


@pytest.mark.parametrize("tensors,qc,words", [
    ({"l.weight": np.ones((4, 8), np.float32), "l.weight_packed": np.zeros((4, 1), np.int32)},
     _ct_config(32), "stored twice"),
    ({"other.weight": np.ones((4, 8), np.float32)}, _ct_config(32), "no weight for 'l'"),
    ({"l.weight_packed": np.zeros((4, 4), np.int32), "l.weight_scale": np.ones((4, 1), BF16)},
     None, "no quantization_config"),
    ({"l.weight_packed": np.zeros((4, 4), np.int32), "l.weight_scale": np.ones((4, 3), BF16)},
     _ct_config(32), "has 3 groups per row, expected 1"),
    ({"l.weight_packed": np.zeros((4, 4), np.int32), "l.weight_scale": np.ones((5, 1), BF16)},
     _ct_config(32), "does not fit the weight"),
    ({"l.weight_packed": np.zeros((4, 4), np.float32), "l.weight_scale": np.ones((4, 1), BF16)},
     _ct_config(32), "int32 (uint4b8) or uint8"),
    ({"l.weight_packed": np.zeros((4, 4), np.int32), "l.weight_scale": np.ones((4, 1), BF16),
      "l.weight_shape": np.array([4, 64])}, _ct_config(32), "does not fit weight_packed"),
    ({"l.weight_packed": np.zeros((4, 4), np.int32), "l.weight_scale": np.ones((4, 1), np.int32)},
     _ct_config(32), "must be floating point"),
    ({"l.weight_packed": np.zeros((4, 4), np.int32), "l.weight_scale": np.ones((4, 1), BF16),
      "l.weight_g_idx": np.full(32, 3, np.int32)}, _ct_config(32), "groups outside"),
    ({"l.weight_packed": np.zeros((4, 4), np.int32), "l.weight_scale": np.ones((4, 1), BF16),
      "l.weight_zero_point": np.ones((4, 1), np.int8)}, _ct_config(32), "non-zero zero points"),
    ({"l.qweight": np.zeros((4, 8), np.int32), "l.scales": np.ones((1, 8), np.float16)},
     _ct_config(32), "GPTQ packed, but config.json says compressed-tensors"),
    ({"l.weight": np.ones((4, 8), np.float32), "l.weight_scale": np.ones((4, 1), np.float32)},
     _ct_config(32), "FP8"),
    ({"l.weight": np.ones((4, 8), np.int8)}, None, "must be floating point"),
    ({"l.weight": np.ones((2, 4, 8), np.float32)}, None, "not a 2-D linear layer"),
    ({"l.weight": np.ones((4, 8), np.float32), "l.bias": np.ones(5, np.float32)}, None,
     "has shape (5,), expected (4,)"),
])
def test_bad_linear_names_the_tensor(tmp_path, tensors, qc, words):
  ckpt = _write(tmp_path, tensors)
  with pytest.raises(CheckpointFormatError) as info:
    read_linear(ckpt, "l", parse_quantization_config(qc))
  assert words in str(info.value), str(info.value)
  assert isinstance(info.value, ValueError)


def test_dequantize_int4_per_expert_g_idx():
  rng = np.random.default_rng(6)
  q = rng.integers(-8, 8, (3, 4, 64)).astype(np.int8)
  s = rng.uniform(0.1, 1, (3, 4, 2)).astype(np.float32)
  g = np.stack([rng.permutation(np.arange(64) // 32) for _ in range(3)])
  got = dequantize_int4(q, s, 32, g_idx=g)
  for e in range(3):
    np.testing.assert_array_equal(got[e], q[e] * s[e][:, g[e]])


# ------------------------------------------------------------------ config.json errors
def test_malformed_config_json_names_file_line_and_column(tmp_path):
  (tmp_path / "config.json").write_text('{\n  "hidden_size": 8,\n  "oops" 3\n}')
  with pytest.raises(ConfigError) as info:
    read_config_json(tmp_path)
  msg = str(info.value)
  assert str(tmp_path / "config.json") in msg and "line 3 column 10" in msg
  (tmp_path / "config.json").write_text("[1]")
  with pytest.raises(ConfigError, match="expected a JSON object"):
    read_config_json(tmp_path / "config.json")
  with pytest.raises(FileNotFoundError):
    read_config_json(tmp_path / "missing")


def _moe_cfg(**over):
  cfg = {"num_experts": 4, "num_experts_per_tok": 2, "hidden_size": 64,
         "moe_intermediate_size": 32, "num_hidden_layers": 1}
  cfg.update(over)
  return cfg


@pytest.mark.parametrize("over,key", [
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": [64]}, "hidden_size"),
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": 2.5}, "num_experts_per_tok"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"scoring_func": 3}, "scoring_func"),
    ({"routed_scaling_factor": "2"}, "routed_scaling_factor"),
    ({"n_group": True}, "n_group"),
    ({"hidden_act": ["silu"]}, "hidden_act"),
])
def test_wrong_model_config_type_names_the_key(over, key):
  with pytest.raises(ConfigError, match=key):
    parse_model_config(_moe_cfg(**over))


def test_model_config_accepts_integral_floats_and_reports_missing_fields():
  assert parse_model_config(_moe_cfg(hidden_size=64.0)).hidden_size == 64
  with pytest.raises(MissingFieldError, match="hidden size"):
    parse_model_config({k: v for k, v in _moe_cfg().items() if k != "hidden_size"})


@pytest.mark.parametrize("mutate,key", [
    (lambda q: q["config_groups"].__setitem__("group_0", [1]), "config_groups.group_0"),
    (lambda q: q["config_groups"]["group_0"].__setitem__("weights", [4]), "weights"),
    (lambda q: q["config_groups"]["group_0"].__setitem__("input_activations", "int8"),
     "input_activations"),
    (lambda q: q["config_groups"]["group_0"].__setitem__("targets", "Linear"), None),
    (lambda q: q["config_groups"]["group_0"].__setitem__("targets", [3]), "targets"),
    (lambda q: q.__setitem__("ignore", [None]), "ignore"),
    (lambda q: q.__setitem__("ignore", ["re:("]), "valid regex"),
    (lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("dynamic", "no"),
     "weights.dynamic"),
    (lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 4.0),
     "weights.num_bits"),
    (lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("group_size", "32"),
     "weights.group_size"),
    (lambda q: q["config_groups"]["group_0"].__setitem__(
        "output_activations", {"num_bits": 8}), "output_activations"),
])
def test_wrong_quantization_config_type_names_the_key(mutate, key):
  qc = _ct_config(32)
  mutate(qc)
  if key is None:
    assert parse_quantization_config(qc).targets == ("Linear",)
    return
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    parse_quantization_config(qc)


@pytest.mark.parametrize("field,value", [("desc_act", "false"), ("bits", "4"), ("sym", 1),
                                         ("group_size", True)])
def test_wrong_gptq_type_names_the_key(field, value):
  qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
  qc[field] = value
  with pytest.raises(ConfigError, match=f"quantization_config.{field}"):
    parse_quantization_config(qc)


def test_load_moe_checkpoint_config_error_names_config_file(tmp_path):
  safetensors_numpy.save_file({"x": np.ones(1, np.float32)}, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(dict(_moe_cfg(hidden_size="wide"))))
  with pytest.raises(ConfigError, match=r"config\.json: config\.json: hidden_size"):
    load_moe_checkpoint(tmp_path, show_progress=False)
  (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": 5}}))
  with pytest.raises(ConfigError, match=r"config\.json: unsupported quantization_config"):
    load_moe_checkpoint(tmp_path, show_progress=False)


@pytest.mark.parametrize("desc_act", [False, True])
def test_our_gptq_writer_matches_independent_dequantizer(tmp_path, desc_act):
  from jax_moeq.loaders import MoELayerTensors, save_moe_checkpoint
  rng = np.random.default_rng(8)
  e, h, i, g = 2, 128, 64, 32

  def order(k):
    groups = np.arange(k) // g
    return np.stack([rng.permutation(groups) if desc_act else groups for _ in range(e)])

  layer = MoELayerTensors(
      w13=rng.integers(-8, 8, (e, 2 * i, h)).astype(np.int8),
      w2=rng.integers(-8, 8, (e, h, i)).astype(np.int8),
      w13_scale=rng.uniform(0.01, 0.1, (e, 2 * i, h // g)).astype(np.float16),
      w2_scale=rng.uniform(0.01, 0.1, (e, h, i // g)).astype(np.float16), group_size=g,
      w13_g_idx=order(h).astype(np.int32) if desc_act else None,
      w2_g_idx=order(i).astype(np.int32) if desc_act else None)
  save_moe_checkpoint(tmp_path, {0: layer}, fmt="gptq", show_progress=False)
  cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
  assert cfg["desc_act"] == desc_act and cfg["sym"] is True and cfg["bits"] == 4
  ckpt = SafetensorsDir(tmp_path)
  for x in range(e):
    for proj, q, s, gi in (
        ("up_proj", layer.w13[x, i:], layer.w13_scale[x, i:], layer.w13_g_idx),
        ("down_proj", layer.w2[x], layer.w2_scale[x], layer.w2_g_idx)):
      p = f"model.layers.0.mlp.experts.{x}.{proj}"
      t = {k: ckpt.get(f"{p}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
      assert t["qweight"].dtype == np.int32 and t["qweight"].shape == (q.shape[1] // 8, q.shape[0])
      assert t["qzeros"].shape == (q.shape[1] // g, q.shape[0] // 8)
      got = _deq_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"])
      want_g = np.arange(q.shape[1]) // g if gi is None else gi[x]
      np.testing.assert_array_equal(t["g_idx"], want_g)
      np.testing.assert_array_equal(got, q * s.astype(np.float64)[:, want_g])


_DTYPES = [np.int32, np.uint8, np.int64, np.float32, np.float16, BF16]
_SUFFIXES = ["weight", "weight_packed", "weight_scale", "weight_shape", "weight_g_idx",
             "weight_zero_point", "qweight", "qzeros", "scales", "g_idx", "bias"]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(
    st.sampled_from(_SUFFIXES),
    st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 9), min_size=1, max_size=3),
              st.integers(0, 2**31 - 1)), min_size=1, max_size=5),
    st.sampled_from(["none", "ct", "gptq"]))
def test_arbitrary_tensors_either_read_or_raise_value_error(tmp_path, spec, method):
  tensors = {}
  for suffix, (dtype, shape, seed) in spec.items():
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
      info = np.iinfo(dtype)
      value = rng.integers(max(info.min, -9), min(info.max, 2**31 - 1), shape, endpoint=True)
      tensors[f"l.{suffix}"] = value.astype(dtype)
    else:
      tensors[f"l.{suffix}"] = rng.normal(size=shape).astype(dtype)
  qc = {"none": None, "ct": _ct_config(32),
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}}[method]
  ckpt = _write(tmp_path, tensors)
  try:
    w, b = read_linear(ckpt, "l", parse_quantization_config(qc))
  except ValueError as e:  # CheckpointFormatError among them
    assert "'l" in str(e) or "l." in str(e), str(e)
    return
  assert w.ndim == 2 and w.dtype == np.float32 and (b is None or b.shape == w.shape[:1])
