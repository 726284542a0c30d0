"""Int4 checkpoints through `jax_moeq.models.from_pretrained`, written by the real ecosystem:
compressed-tensors 0.20's own packer (pack-quantized W4A16 / W4A8-int, group 32 / 128) and the
GPTQ layout (qweight / qzeros / scales / g_idx, with and without desc_act) packed here with numpy.
Each is compared with transformers running the same weights dequantized (float32)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import models

torch = pytest.importorskip("torch", reason="the interop tests need torch (test extras)")
transformers = pytest.importorskip("transformers",
                                   reason="the interop tests need transformers (test extras)")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 256
EXPERT_KEYS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Float32 comparisons need float32 GEMMs (a GPU would otherwise use TF32)."""
  with jax.default_matmul_precision("float32"):
    yield
ATTENTION_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _tiny_qwen3(seed: int):
  torch.manual_seed(seed)
  cfg = transformers.Qwen3MoeConfig(
      vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=64, intermediate_size=256, moe_intermediate_size=128,
      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128)
  return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _per_expert(state_dict) -> dict:
  """transformers 5 holds a layer's experts fused (`experts.gate_up_proj [E, 2I, H]`,
  `experts.down_proj [E, H, I]`) and saves them per expert; this is the saved layout."""
  out = {}
  for name, w in state_dict.items():
    if name.endswith("experts.gate_up_proj"):
      base, half = name[:-len("gate_up_proj")], w.shape[1] // 2
      for e in range(w.shape[0]):
        out[f"{base}{e}.gate_proj.weight"] = w[e, :half]
        out[f"{base}{e}.up_proj.weight"] = w[e, half:]
    elif name.endswith("experts.down_proj"):
      base = name[:-len("down_proj")]
      for e in range(w.shape[0]):
        out[f"{base}{e}.down_proj.weight"] = w[e]
    else:
      out[name] = w
  return out


def _fused(per_expert, like) -> dict:
  """The inverse of `_per_expert`, for `load_state_dict`."""
  out = {}
  for name, w in like.items():
    if name.endswith("experts.gate_up_proj"):
      base = name[:-len("gate_up_proj")]
      out[name] = torch.stack([torch.cat([per_expert[f"{base}{e}.gate_proj.weight"],
                                          per_expert[f"{base}{e}.up_proj.weight"]])
                               for e in range(w.shape[0])])
    elif name.endswith("experts.down_proj"):
      base = name[:-len("down_proj")]
      out[name] = torch.stack([per_expert[f"{base}{e}.down_proj.weight"]
                               for e in range(w.shape[0])])
    else:
      out[name] = per_expert[name]
  return out


def _quantized(name: str) -> bool:
  """What llm-compressor's W4A16 recipe quantizes: every Linear but lm_head and the routers."""
  return name.endswith(".weight") and any(f".{k}." in name for k in EXPERT_KEYS + ATTENTION_KEYS)


def _group_scales(w: torch.Tensor, group: int) -> torch.Tensor:
  """Symmetric int4 scales absmax / 7.5 per group (SPEC §2), [out, in / group]."""
  out, k = w.shape
  amax = w.reshape(out, k // group, group).abs().amax(-1)
  return torch.where(amax > 0, amax / 7.5, torch.ones_like(amax))


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _logits(model, ids):
  return np.asarray(jax.jit(lambda m, i: m(i))(model, jnp.asarray(ids, jnp.int32)))


def _hf_logits(hf, state_dict, ids):
  hf.load_state_dict(_fused(state_dict, hf.state_dict()))
  with torch.no_grad():
    return hf(torch.tensor(ids)).logits.float().numpy()


def _save(path, tensors, hf, quantization_config):
  path.mkdir()
  hf.config.save_pretrained(path)
  config = json.loads((path / "config.json").read_text())
  config["quantization_config"] = quantization_config
  (path / "config.json").write_text(json.dumps(config))
  safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                              str(path / "model.safetensors"))


# ------------------------------------------------------------------ compressed-tensors
def _ct_checkpoint(path, group: int, activations: bool, seed: int):
  """Packs a tiny Qwen3-MoE with compressed-tensors' own compressor; returns the transformers
  model and the state dict its decompressor gives back (the weights the checkpoint means)."""
  ct = pytest.importorskip("compressed_tensors", reason="needs compressed-tensors (test extras)")
  from compressed_tensors.compressors import PackedQuantizationCompressor
  from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                               QuantizationScheme)
  hf = _tiny_qwen3(seed)
  weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                             group_size=group)
  acts = (QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="token",
                           dynamic=True) if activations else None)
  scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
  qconfig = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                               quantization_status="compressed",
                               ignore=["lm_head", "re:.*mlp.gate$"])
  tensors, dequantized = {}, {}
  for name, w in _per_expert(hf.state_dict()).items():
    if not _quantized(name):
      tensors[name] = dequantized[name] = w
      continue
    prefix = name[:-len(".weight")]
    packed = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": _group_scales(w, group)}, scheme)
    for key, value in packed.items():
      tensors[f"{prefix}.{key}"] = value
    dequantized[name] = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
  _save(path, tensors, hf, qconfig.model_dump(exclude_none=False))
  assert ct is not None
  return hf, {k: v.to(torch.float32) for k, v in dequantized.items()}


@pytest.mark.parametrize("group", [32, 128])
def test_compressed_tensors_w4a16_matches_transformers_dequantized(tmp_path, group):
  hf, dequantized = _ct_checkpoint(tmp_path / "ckpt", group, activations=False, seed=group)
  # The attention projections stay int4 (WNA16); attention math in float32, as transformers'
  # (the default for int4 linears is bfloat16).
  model = models.from_pretrained(tmp_path / "ckpt", dtype=jnp.float32, show_progress=False,
                                 attention_dtype=jnp.float32)
  # W4A16 on the CPU: no weight-only int4 kernel, so the jnp reference (the exact dequantized
  # arithmetic in float32).
  assert model.moe_backends() == {"wna16": "reference" if jax.default_backend() == "cpu"
                                  else model.moe_backends()["wna16"]}
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, 10))
  want = _hf_logits(hf, dequantized, ids)
  got = _logits(model, ids)
  # Same float32 weights on both sides (dequantized exactly): reassociation only.
  assert _rel(got, want) <= 1e-4
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("group", [32, 128])
def test_compressed_tensors_w4a8_runs_on_the_w4a8_scheme(tmp_path, group):
  hf, dequantized = _ct_checkpoint(tmp_path / "ckpt", group, activations=True, seed=group + 1)
  model = models.from_pretrained(tmp_path / "ckpt", dtype=jnp.float32, show_progress=False)
  reference = models.from_pretrained(tmp_path / "ckpt", moe_backend="reference",
                                     dtype=jnp.float32, show_progress=False)
  assert set(model.moe_backends()) == {"w4a8_int8"}
  if jax.default_backend() == "cpu":
    assert model.moe_backends() == {"w4a8_int8": "cpu_int4"}
  ids = np.random.default_rng(1).integers(0, VOCAB, (2, 10))
  got, ref = _logits(model, ids), _logits(reference, ids)
  # Kernel vs the W4A8 reference: same int8 activation rule, f32 sums (SPEC §9: 1e-4 in f32).
  assert _rel(got, ref) <= 1e-4
  # Against float activations: per-token int8 activations add ~0.5 % per GEMM.
  want = _hf_logits(hf, dequantized, ids)
  assert 1e-6 < _rel(got, want) < 5e-2


# ------------------------------------------------------------------ GPTQ
def _gptq_pack_rows(q_in_out: np.ndarray) -> np.ndarray:
  """[in, out] int4 -> qweight [in/8, out] int32: nibble j of row r holds input 8r + j, as q+8."""
  u = (q_in_out.astype(np.int64) + 8).reshape(-1, 8, q_in_out.shape[1])
  words = sum(u[:, j, :] << (4 * j) for j in range(8))
  return words.astype(np.uint32).view(np.int32)


def _gptq_pack_cols(z: np.ndarray) -> np.ndarray:
  """[groups, out] stored zero points -> qzeros [groups, out/8] int32 (nibble j: column 8c+j)."""
  u = z.astype(np.int64).reshape(z.shape[0], -1, 8)
  words = sum(u[:, :, j] << (4 * j) for j in range(8))
  return words.astype(np.uint32).view(np.int32)


def _gptq_checkpoint(path, group: int, desc_act: bool, seed: int):
  hf = _tiny_qwen3(seed)
  rng = np.random.default_rng(seed)
  tensors, dequantized, orders = {}, {}, {}
  for name, w in _per_expert(hf.state_dict()).items():
    if not (_quantized(name) and any(f".{k}." in name for k in EXPERT_KEYS)):
      tensors[name] = dequantized[name] = w
      continue
    prefix = name[:-len(".weight")]
    out, k = w.shape
    groups = k // group
    g_idx = np.arange(k) // group
    if desc_act:
      # Each group still holds `group` channels, scattered. desc_act orders an input by its
      # Hessian, which gate and up share (same input): one order per expert for both.
      key = name.replace("up_proj", "gate_proj")
      g_idx = orders.setdefault(key, rng.permutation(g_idx))
    wn = w.numpy().astype(np.float64)
    scales = np.zeros((groups, out), np.float64)
    for gi in range(groups):
      scales[gi] = np.abs(wn[:, g_idx == gi]).max(axis=1) / 7.5
    scales = scales.astype(np.float16)
    s = scales.astype(np.float64)[g_idx].T  # [out, in]
    q = np.clip(np.rint(wn / s), -8, 7).astype(np.int8)
    tensors[f"{prefix}.qweight"] = torch.from_numpy(_gptq_pack_rows(q.T))
    tensors[f"{prefix}.qzeros"] = torch.from_numpy(_gptq_pack_cols(np.full((groups, out), 7)))
    tensors[f"{prefix}.scales"] = torch.from_numpy(scales)
    tensors[f"{prefix}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
    dequantized[name] = torch.from_numpy((q * s).astype(np.float32))
  _save(path, tensors, hf, {"quant_method": "gptq", "bits": 4, "group_size": group,
                            "desc_act": desc_act, "sym": True, "checkpoint_format": "gptq"})
  return hf, dequantized


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_matches_transformers_dequantized(tmp_path, desc_act):
  hf, dequantized = _gptq_checkpoint(tmp_path / "ckpt", 32, desc_act, seed=7 + desc_act)
  model = models.from_pretrained(tmp_path / "ckpt", dtype=jnp.float32, show_progress=False)
  assert set(model.moe_backends()) == {"wna16"}
  ids = np.random.default_rng(2).integers(0, VOCAB, (2, 10))
  want = _hf_logits(hf, dequantized, ids)
  got = _logits(model, ids)
  # fp16 scales are exact in float32; the reference applies act-order exactly.
  assert _rel(got, want) <= 1e-4
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
  # On the CPU W4A8 kernel (activation quantization allowed), within int8 activation noise.
  if jax.default_backend() == "cpu" and not desc_act:
    fast = models.from_pretrained(tmp_path / "ckpt", quantization="w4a8_int8",
                                  dtype=jnp.float32, show_progress=False)
    assert fast.moe_backends() == {"wna16": "cpu_int4"}
    assert _rel(_logits(fast, ids), want) < 5e-2
