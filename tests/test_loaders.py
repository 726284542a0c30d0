"""Checkpoint loaders and writers.

Checkpoints are built two ways: by hand here with plain numpy + safetensors following each format's
description (so the loader is not only tested against our own writer), and by our writer (round trip).
"""

import io
import json

import ml_dtypes
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from jax_moeq.loaders import checkpoint, config, int4_format, progress  # noqa: E402

BF16 = ml_dtypes.bfloat16
E, H, I = 4, 128, 64


def _rng(seed):
  return np.random.default_rng(seed)


def _rand_q(rng, shape):
  return rng.integers(-8, 8, shape).astype(np.int8)


def _rand_scale(rng, shape, dtype):
  return rng.uniform(0.01, 0.1, shape).astype(dtype)


# Packing written out from the format descriptions (independent of jax_moeq.loaders.int4_format).
def _hand_uint4b8_last(q):
  """compressed-tensors: [out, in] -> [out, in/8] int32, nibble j of word r = element 8r+j, +8."""
  u = (q.astype(np.int64) + 8).reshape(q.shape[0], -1, 8)
  word = np.zeros(u.shape[:2], np.int64)
  for j in range(8):
    word |= u[..., j] << (4 * j)
  return word.astype(np.uint32).view(np.int32)


def _hand_uint4b8_first(q_in_out):
  """GPTQ: [in, out] -> [in/8, out] int32 along the input axis."""
  return _hand_uint4b8_last(q_in_out.T).T.copy()


def _hand_signed_bytes(q):
  """MxInt4: [out, in] -> [out, in/2] uint8 two's-complement nibbles, even index low."""
  lo = q[:, 0::2].astype(np.int16) & 0xF
  hi = q[:, 1::2].astype(np.int16) & 0xF
  return (lo | (hi << 4)).astype(np.uint8)


def _write(tmp_path, tensors, cfg):
  safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  return tmp_path


def _model_cfg(layers=1):
  return {"num_experts": E, "num_experts_per_tok": 2, "hidden_size": H, "moe_intermediate_size": I,
          "num_hidden_layers": layers, "norm_topk_prob": True}


def _ct_qconfig(group_size=32, activations=None, **weight_overrides):
  weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False,
             "strategy": "group" if group_size != -1 else "channel",
             "group_size": group_size if group_size != -1 else None, "actorder": None}
  weights.update(weight_overrides)
  return {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                        "input_activations": activations}}}


def _expert_q(rng, group_size, dtype):
  """Random q/scales for gate, up, down of every expert, as [out, in] per projection."""
  out = {}
  for e in range(E):
    for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
      g = 1 if group_size == -1 else k // group_size
      out[e, proj] = (_rand_q(rng, (n, k)), _rand_scale(rng, (n, g), dtype))
  return out


def _check_stacked(layer, qs):
  for e in range(E):
    np.testing.assert_array_equal(layer.w13[e, :I], qs[e, "gate_proj"][0])
    np.testing.assert_array_equal(layer.w13[e, I:], qs[e, "up_proj"][0])
    np.testing.assert_array_equal(layer.w2[e], qs[e, "down_proj"][0])
    np.testing.assert_array_equal(layer.w13_scale[e, :I].astype(np.float32),
                                  qs[e, "gate_proj"][1].astype(np.float32))
    np.testing.assert_array_equal(layer.w13_scale[e, I:].astype(np.float32),
                                  qs[e, "up_proj"][1].astype(np.float32))
    np.testing.assert_array_equal(layer.w2_scale[e].astype(np.float32),
                                  qs[e, "down_proj"][1].astype(np.float32))


# ------------------------------------------------------------------ hand-built checkpoints
@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_compressed_tensors_w4a16_hand_built(tmp_path, group_size):
  rng = _rng(1)
  qs = _expert_q(rng, group_size, BF16 if group_size != -1 else np.float32)
  tensors = {}
  for (e, proj), (q, s) in qs.items():
    p = f"model.layers.3.mlp.experts.{e}.{proj}"
    tensors[f"{p}.weight_packed"] = _hand_uint4b8_last(q)
    tensors[f"{p}.weight_scale"] = s
    tensors[f"{p}.weight_shape"] = np.array(q.shape, np.int64)
  router = rng.normal(size=(E, H)).astype(BF16)
  tensors["model.layers.3.mlp.gate.weight"] = router
  cfg = dict(_model_cfg(4), quantization_config=_ct_qconfig(group_size))
  ck = checkpoint.load_moe_checkpoint(_write(tmp_path, tensors, cfg), show_progress=False)
  assert list(ck.layers) == [3]
  assert ck.quant_config.scheme == "wna16" and ck.quant_config.group_size == group_size
  assert ck.model_config.num_experts == E and ck.model_config.intermediate_size == I
  layer = ck.layers[3]
  assert layer.w13.shape == (E, 2 * I, H) and layer.w2.shape == (E, H, I)
  _check_stacked(layer, qs)
  np.testing.assert_array_equal(layer.router_weight, router)
  assert layer.w13_g_idx is None and layer.w2_g_idx is None


def test_compressed_tensors_w4a8_int_scheme(tmp_path):
  rng = _rng(2)
  qs = _expert_q(rng, 32, BF16)
  tensors = {}
  for (e, proj), (q, s) in qs.items():
    p = f"model.layers.0.mlp.experts.{e}.{proj}"
    tensors[f"{p}.weight_packed"] = _hand_uint4b8_last(q)
    tensors[f"{p}.weight_scale"] = s
  act = {"num_bits": 8, "type": "int", "symmetric": False, "dynamic": True, "strategy": "token"}
  cfg = dict(_model_cfg(), quantization_config=_ct_qconfig(32, act))
  ck = checkpoint.load_moe_checkpoint(_write(tmp_path, tensors, cfg), show_progress=False)
  assert ck.quant_config.scheme == "w4a8_int8" and ck.quant_config.activation_bits == 8
  _check_stacked(ck.layers[0], qs)


@pytest.mark.parametrize("packed_kind", ["int32", "uint8"])
def test_mxint4_hand_built(tmp_path, packed_kind):
  rng = _rng(3)
  qs = _expert_q(rng, 32, BF16)
  tensors = {}
  for (e, proj), (q, s) in qs.items():
    p = f"model.layers.0.mlp.experts.{e}.{proj}"
    tensors[f"{p}.weight_packed"] = (_hand_uint4b8_last(q) if packed_kind == "int32"
                                     else _hand_signed_bytes(q))
    tensors[f"{p}.weight_scale"] = s
  qcfg = _ct_qconfig(32)
  qcfg["quant_method"] = "mxint4"
  cfg = dict(_model_cfg(), quantization_config=qcfg)
  ck = checkpoint.load_moe_checkpoint(_write(tmp_path, tensors, cfg), show_progress=False)
  assert ck.quant_config.scheme == "mxint4"
  _check_stacked(ck.layers[0], qs)


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_hand_built(tmp_path, desc_act):
  rng = _rng(4)
  group_size = 32
  tensors, qs, g_idxs = {}, {}, {}
  for e in range(E):
    # gate and up share the input, hence one act-order permutation (as GPTQ produces).
    g13 = rng.permutation(np.arange(H) // group_size) if desc_act else np.arange(H) // group_size
    g2 = rng.permutation(np.arange(I) // group_size) if desc_act else np.arange(I) // group_size
    for proj, (n, k), g_idx in (("gate_proj", (I, H), g13), ("up_proj", (I, H), g13),
                                ("down_proj", (H, I), g2)):
      q = _rand_q(rng, (n, k))
      s = _rand_scale(rng, (n, k // group_size), np.float16)
      p = f"model.layers.1.mlp.experts.{e}.{proj}"
      tensors[f"{p}.qweight"] = _hand_uint4b8_first(q.T.copy())
      tensors[f"{p}.scales"] = s.T.copy()
      tensors[f"{p}.qzeros"] = np.full((k // group_size, n // 8), 0x77777777, np.int32)
      tensors[f"{p}.g_idx"] = g_idx.astype(np.int32)
      qs[e, proj] = (q, s)
      g_idxs[e, proj] = g_idx
  qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
          "sym": True}
  cfg = dict(_model_cfg(2), quantization_config=qcfg)
  ck = checkpoint.load_moe_checkpoint(_write(tmp_path, tensors, cfg), show_progress=False)
  layer = ck.layers[1]
  assert layer.w13_scale.dtype == np.float16
  _check_stacked(layer, qs)
  if not desc_act:
    assert layer.w13_g_idx is None and layer.w2_g_idx is None
    return
  np.testing.assert_array_equal(layer.w13_g_idx[2], g_idxs[2, "gate_proj"])
  np.testing.assert_array_equal(layer.w2_g_idx[2], g_idxs[2, "down_proj"])
  # Folding act-order into contiguous groups keeps the expert function exactly: compare a float64
  # forward of the dequantized weights in natural order with the folded one (x permuted by w13_perm).
  folded, w13_perm = layer.sorted_by_group()
  assert folded.w13_g_idx is None and w13_perm.shape == (E, H)
  x = rng.normal(size=H)
  for e in range(E):
    def deq(q, s, g):
      return q.astype(np.float64) * s.astype(np.float64)[:, g]
    w13 = deq(layer.w13[e], layer.w13_scale[e], layer.w13_g_idx[e])
    w2 = deq(layer.w2[e], layer.w2_scale[e], layer.w2_g_idx[e])
    contiguous13 = np.arange(H) // group_size
    contiguous2 = np.arange(I) // group_size
    w13f = deq(folded.w13[e], folded.w13_scale[e], contiguous13)
    w2f = deq(folded.w2[e], folded.w2_scale[e], contiguous2)
    act = lambda y: y[:I] / (1 + np.exp(-y[:I])) * y[I:]
    want = w2 @ act(w13 @ x)
    got = w2f @ act(w13f @ x[w13_perm[e]])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_mixtral_naming_and_float(tmp_path):
  rng = _rng(5)
  tensors, ws = {}, {}
  for e in range(E):
    for proj, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
      w = rng.normal(size=(n, k)).astype(BF16)
      tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{proj}.weight"] = w
      ws[e, proj] = w
  tensors["model.layers.0.block_sparse_moe.gate.weight"] = rng.normal(size=(E, H)).astype(BF16)
  cfg = {"num_local_experts": E, "num_experts_per_tok": 2, "hidden_size": H,
         "intermediate_size": I, "num_hidden_layers": 1}
  ck = checkpoint.load_moe_checkpoint(_write(tmp_path, tensors, cfg), show_progress=False)
  layer = ck.layers[0]
  assert not layer.quantized and layer.w13.dtype == BF16
  assert ck.model_config.renormalize  # Mixtral renormalizes without saying so
  np.testing.assert_array_equal(layer.w13[1, :I], ws[1, "w1"])
  np.testing.assert_array_equal(layer.w13[1, I:], ws[1, "w3"])
  np.testing.assert_array_equal(layer.w2[3], ws[3, "w2"])
  assert layer.router_weight.shape == (E, H)


def test_fused_interleaved_gate_up_float(tmp_path):
  rng = _rng(6)
  gate = rng.normal(size=(E, I, H)).astype(np.float32)
  up = rng.normal(size=(E, I, H)).astype(np.float32)
  down = rng.normal(size=(E, H, I)).astype(np.float32)
  gate_b, up_b = rng.normal(size=(E, I)).astype(np.float32), rng.normal(size=(E, I)).astype(np.float32)
  gate_up = np.empty((E, H, 2 * I), np.float32)  # GPT-OSS: [E, H, 2I], gate at even columns
  gate_up[..., 0::2] = gate.transpose(0, 2, 1)
  gate_up[..., 1::2] = up.transpose(0, 2, 1)
  gate_up_b = np.empty((E, 2 * I), np.float32)
  gate_up_b[:, 0::2], gate_up_b[:, 1::2] = gate_b, up_b
  tensors = {"model.layers.0.mlp.experts.gate_up_proj": gate_up,
             "model.layers.0.mlp.experts.gate_up_proj_bias": gate_up_b,
             "model.layers.0.mlp.experts.down_proj": down.transpose(0, 2, 1).copy(),
             "model.layers.0.mlp.experts.down_proj_bias": rng.normal(size=(E, H)).astype(np.float32)}
  layer = checkpoint.load_moe_checkpoint(_write(tmp_path, tensors, {}), show_progress=False).layers[0]
  np.testing.assert_array_equal(layer.w13, np.concatenate([gate, up], axis=1))
  np.testing.assert_array_equal(layer.w2, down)
  np.testing.assert_array_equal(layer.w13_bias, np.concatenate([gate_b, up_b], axis=1))


# ------------------------------------------------------------------ writer round trips
def _random_layer(rng, group_size, act_order=False, bias=False, scale_dtype=BF16):
  g = 1 if group_size == -1 else None
  w13 = _rand_q(rng, (E, 2 * I, H))
  w2 = _rand_q(rng, (E, H, I))
  sdt = np.float32 if group_size == -1 else scale_dtype
  s13 = _rand_scale(rng, (E, 2 * I, g or H // group_size), sdt)
  s2 = _rand_scale(rng, (E, H, g or I // group_size), sdt)
  g13 = g2 = None
  if act_order:
    g13 = np.stack([rng.permutation(np.arange(H) // group_size) for _ in range(E)]).astype(np.int32)
    g2 = np.stack([rng.permutation(np.arange(I) // group_size) for _ in range(E)]).astype(np.int32)
  b13 = rng.normal(size=(E, 2 * I)).astype(np.float32) if bias else None
  b2 = rng.normal(size=(E, H)).astype(np.float32) if bias else None
  return checkpoint.MoELayerTensors(
      w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, group_size=group_size, w13_g_idx=g13,
      w2_g_idx=g2, w13_bias=b13, w2_bias=b2,
      router_weight=rng.normal(size=(E, H)).astype(np.float32))


def _assert_layers_equal(a, b):
  for f in ("w13", "w2", "w13_scale", "w2_scale", "w13_g_idx", "w2_g_idx", "w13_bias", "w2_bias",
            "router_weight"):
    x, y = getattr(a, f), getattr(b, f)
    assert (x is None) == (y is None), f
    if x is not None:
      assert x.dtype == y.dtype, f
      np.testing.assert_array_equal(x, y, err_msg=f)
  assert a.group_size == b.group_size


@pytest.mark.parametrize("fmt,group_size,act_order,bias", [
    ("compressed-tensors", 128 // 2, False, True),
    ("compressed-tensors", -1, False, False),
    ("compressed-tensors", 32, True, False),
    ("gptq", 32, True, True),
    ("gptq", -1, False, False),
    ("mxint4", 32, False, False),
])
def test_writer_round_trip(tmp_path, fmt, group_size, act_order, bias):
  rng = _rng(7)
  layers = {0: _random_layer(rng, group_size, act_order, bias,
                             np.float16 if fmt == "gptq" else BF16),
            2: _random_layer(rng, group_size, act_order, bias,
                             np.float16 if fmt == "gptq" else BF16)}
  checkpoint.save_moe_checkpoint(tmp_path, layers, fmt=fmt, show_progress=False)
  ck = checkpoint.load_moe_checkpoint(tmp_path, show_progress=False)
  assert sorted(ck.layers) == [0, 2]
  for i in layers:
    _assert_layers_equal(ck.layers[i], layers[i])


def test_writer_float_sharded_with_mixtral_naming(tmp_path):
  rng = _rng(8)
  layers = {i: checkpoint.MoELayerTensors(w13=rng.normal(size=(E, 2 * I, H)).astype(BF16),
                                          w2=rng.normal(size=(E, H, I)).astype(BF16))
            for i in range(3)}
  mc = config.MoEModelConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I,
                             num_layers=3)
  checkpoint.save_moe_checkpoint(tmp_path, layers, model_config=mc, naming="w1",
                                 experts_prefix="model.layers.{layer}.block_sparse_moe.experts",
                                 max_shard_bytes=E * 2 * I * H * 2, show_progress=False)
  assert (tmp_path / checkpoint.INDEX_FILE).exists()
  ck = checkpoint.load_moe_checkpoint(tmp_path, show_progress=False)
  assert ck.model_config == mc
  for i in layers:
    _assert_layers_equal(ck.layers[i], layers[i])


def test_w4a8_written_config_round_trips(tmp_path):
  layers = {0: _random_layer(_rng(9), 32)}
  checkpoint.save_moe_checkpoint(tmp_path, layers, activation_bits=8, show_progress=False)
  qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
  assert qc["config_groups"]["group_0"]["input_activations"]["num_bits"] == 8
  assert checkpoint.load_moe_checkpoint(tmp_path, show_progress=False).quant_config.scheme == (
      "w4a8_int8")


# ------------------------------------------------------------------ bad configs
@pytest.mark.parametrize("qc,field", [
    (_ct_qconfig(32, num_bits=8), "weights.num_bits"),
    (_ct_qconfig(32, symmetric=False), "weights.symmetric"),
    (_ct_qconfig(32, strategy="tensor"), "weights.strategy"),
    (_ct_qconfig(32, strategy="block"), "weights.strategy"),
    (_ct_qconfig(48), "weights.group_size"),
    (_ct_qconfig(32, type="float"), "weights.type"),
    (dict(_ct_qconfig(32), format="marlin-24"), "quantization_config.format"),
    (_ct_qconfig(32, {"num_bits": 4, "type": "int", "strategy": "token", "dynamic": True}),
     "input_activations.num_bits"),
    (_ct_qconfig(32, {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}),
     "input_activations.strategy"),
    (_ct_qconfig(32, {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": False}),
     "input_activations.dynamic"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True}, "quantization_config.bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, "quantization_config.sym"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100, "sym": True},
     "quantization_config.group_size"),
    ({"quant_method": "awq", "bits": 4}, "quant_method"),
])
def test_unsupported_configs_name_the_field(qc, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    config.parse_quantization_config(qc)


def test_asymmetric_zero_points_in_tensors_raise(tmp_path):
  rng = _rng(10)
  tensors = {}
  for e in range(E):
    for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
      p = f"model.layers.0.mlp.experts.{e}.{proj}"
      tensors[f"{p}.qweight"] = _hand_uint4b8_first(_rand_q(rng, (k, n)))
      tensors[f"{p}.scales"] = _rand_scale(rng, (k // 32, n), np.float16)
      zeros = rng.integers(0, 16, (k // 32, n)).astype(np.int8) - 8
      tensors[f"{p}.qzeros"] = _hand_uint4b8_last(zeros)
  cfg = dict(_model_cfg(), quantization_config={"quant_method": "gptq", "bits": 4,
                                                "group_size": 32, "sym": True})
  with pytest.raises(ValueError, match="qzeros"):
    checkpoint.load_moe_checkpoint(_write(tmp_path, tensors, cfg), show_progress=False)


def test_writer_rejects_float_layer_as_int4(tmp_path):
  layer = checkpoint.MoELayerTensors(w13=np.ones((E, 2 * I, H), np.float32),
                                     w2=np.ones((E, H, I), np.float32))
  with pytest.raises(ValueError, match="format='gptq'"):
    checkpoint.save_moe_checkpoint(tmp_path, {0: layer}, fmt="gptq", show_progress=False)


def test_int4_format_round_trips():
  rng = _rng(11)
  q = _rand_q(rng, (16, 64))
  np.testing.assert_array_equal(int4_format.pack_uint4b8(q, -1), _hand_uint4b8_last(q))
  np.testing.assert_array_equal(int4_format.unpack_uint4b8(_hand_uint4b8_last(q), -1), q)
  np.testing.assert_array_equal(int4_format.unpack_signed_nibbles(_hand_signed_bytes(q)), q)
  # The signed-nibble bytes are the uint4b8 words' bytes XOR 0x88 (SPEC §2, §8).
  np.testing.assert_array_equal(_hand_uint4b8_last(q).view(np.uint8) ^ 0x88, _hand_signed_bytes(q))
  with pytest.raises(ValueError, match="int4 range"):
    int4_format.pack_uint4b8(np.full((2, 8), 9, np.int8))


def test_progress_prints_bounded_lines():
  buf = io.StringIO()
  with progress.Progress(100, "experts", stream=buf) as bar:
    for _ in range(100):
      bar.update()
  lines = buf.getvalue().splitlines()
  assert 2 <= len(lines) <= 12 and lines[-1].startswith("experts [") and "100/100" in lines[-1]
  assert list(progress.track_progress(range(3), "x", stream=io.StringIO())) == [0, 1, 2]


def test_host_packers_agree_with_jnp_packers():
  """The loaders' numpy packers and jax_moeq.quant.int4's jnp packers write the same words."""
  int4 = pytest.importorskip("jax_moeq.quant.int4")
  q = _rand_q(_rng(12), (3, 16, 64))
  np.testing.assert_array_equal(int4_format.pack_uint4b8(q, axis=-1),
                                np.asarray(int4.pack_uint4b8_ct(q)))
  np.testing.assert_array_equal(int4_format.pack_uint4b8(np.swapaxes(q, -1, -2), axis=-2),
                                np.asarray(int4.pack_uint4b8_gptq(q)))
