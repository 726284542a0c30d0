"""Models with every linear int4 (attention q/k/v/o, dense MLPs, LM head), not only the experts.

Tiny checkpoints written by transformers (float) are quantized on load with
`quantize_linears=True`; int4 checkpoints (compressed-tensors W4A16 packed by the real library,
GPTQ with and without desc_act) keep their linears int4 and are compared with transformers
running the same weights dequantized. The figures asserted are printed (`pytest -s`)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import models
from jax_moeq.nn import QuantizedLinear

torch = pytest.importorskip("torch", reason="the interop tests need torch (test extras)")
transformers = pytest.importorskip("transformers",
                                   reason="the interop tests need transformers (test extras)")
safetensors_torch = pytest.importorskip("safetensors.torch")

# The int4 checkpoint writers of the experts-only interop tests.
from test_models_int4 import (  # noqa: E402
    _ct_checkpoint, _fused, _gptq_pack_cols, _gptq_pack_rows, _hf_logits, _per_expert, _save,
    _tiny_qwen3)

VOCAB = 512
ON_CPU = jax.default_backend() == "cpu"


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Float32 comparisons need float32 GEMMs (a GPU would otherwise use TF32)."""
  with jax.default_matmul_precision("float32"):
    yield


def _configs():
  common = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, eos_token_id=5)
  return {
      # A dense layer (gate/up fused) and tied embeddings (the int4 head is a quantized copy).
      "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
          common, intermediate_size=384, moe_intermediate_size=128, num_key_value_heads=2,
          head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
          mlp_only_layers=[0], decoder_sparse_step=1, tie_word_embeddings=True)),
      "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
          common, intermediate_size=128, num_key_value_heads=2, num_local_experts=8,
          num_experts_per_tok=2)),
      # q/k norms over the whole projection and clip_qkv after the fused split.
      "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, dict(
          common, intermediate_size=128, num_key_value_heads=4, num_experts=8,
          num_experts_per_tok=2, clip_qkv=0.2, pad_token_id=1)),
  }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> directory of a float checkpoint saved by transformers."""
  out = {}
  for name, (config_cls, model_cls, kw) in _configs().items():
    torch.manual_seed(11 + len(out))
    hf = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # norms are ones at init: perturb them so a missed norm cannot pass
      for pname, p in hf.named_parameters():
        if "norm" in pname:
          p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    out[name] = path
  return out


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _agree(got, want) -> float:
  return float(np.mean(np.asarray(got).argmax(-1) == np.asarray(want).argmax(-1)))


def _logits(model, ids):
  return np.asarray(jax.jit(lambda m, i: m(i))(model, jnp.asarray(ids, jnp.int32)))


def _load(path, **kw):
  return models.from_pretrained(path, dtype=jnp.float32, show_progress=False, **kw)


# ------------------------------------------------------------------ float checkpoints
@pytest.mark.parametrize("name, scheme", [("qwen3_moe", "w4a8_int8"), ("qwen3_moe", "wna16"),
                                          ("mixtral", "w4a8_int8"), ("olmoe", "w4a8_int8")])
def test_quantize_linears_on_a_float_checkpoint(checkpoints, name, scheme):
  path = checkpoints[name]
  ids = np.random.default_rng(3).integers(0, VOCAB, (2, 12))
  float_model = _load(path)
  experts = _load(path, quantization=scheme, group_size=32)
  whole = _load(path, quantization=scheme, group_size=32, quantize_linears=True,
                lm_head_quantization="int4")
  assert float_model.linear_backends() == {"float": "xla"}
  assert experts.linear_backends() == {"float": "xla"}
  assert experts.attention_dtype == jnp.float32 and whole.attention_dtype == jnp.bfloat16
  if ON_CPU:
    # The head runs W4A8 on a CPU whatever the experts' scheme; weight-only linears run on the
    # jnp reference unless activation quantization is allowed.
    want = {"w4a8_int8": "cpu_w4a8"} if scheme == "w4a8_int8" else {
        "wna16": "reference", "w4a8_int8": "cpu_w4a8"}
    assert whole.linear_backends() == want
  attn = whole.layers[0].self_attn
  assert isinstance(attn.qkv_proj, QuantizedLinear) and attn.q_proj is None
  assert isinstance(attn.o_proj, QuantizedLinear) and isinstance(whole.lm_head, QuantizedLinear)
  assert attn.qkv_proj.group_size == 32  # the experts' group size divides H
  if name == "qwen3_moe":
    assert isinstance(whole.layers[0].mlp.gate_up_proj, QuantizedLinear)
    assert whole.embed_tokens[...].dtype == jnp.float32  # tied: the embedding stays float
  want = _logits(float_model, ids)
  e_rel, w_rel = _rel(_logits(experts, ids), want), _rel(got := _logits(whole, ids), want)
  e_agree, w_agree = _agree(_logits(experts, ids), want), _agree(got, want)
  print(f"\n{name} {scheme}: logits rel. diff vs float: experts-only {e_rel:.4f} "
        f"(argmax agreement {e_agree:.2f}), every linear int4 {w_rel:.4f} ({w_agree:.2f})")
  # RTN int4 adds ~10 % relative noise per weight matrix (scale absmax / 7.5). Experts only: a
  # few percent (as in test_models.py; measured 0.014-0.034). Every linear: the LM head alone
  # puts its ~10 % straight on the logits (measured 0.11 with nothing else int4), and noisy q/k
  # reshuffle these random models' nearly flat attention (0.21-0.23 measured in all). That
  # noise is the quantization's, not the route's: test_int4_linears_equal_a_float_model_of_
  # their_dequantized_weights shows the int4 layers are exact. Argmax: chance is 1/512.
  assert 1e-4 < e_rel < 0.1
  assert e_rel < w_rel < 0.35
  assert w_agree >= 0.4 and e_agree >= 0.6


def test_int4_linears_equal_a_float_model_of_their_dequantized_weights():
  """Every int4 linear (fused q/k/v, o, fused gate/up, down) against float `Linear`s holding
  the dequantized weights: WNA16 on the reference dequantizes exactly in float32, so the two
  models agree to float32 summation order (measured: bitwise)."""
  from jax_moeq.linears import Int4LinearWeights, dequantize_linear
  cfg = dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=384,
             moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-6, rope_theta=1e4)
  # The same seed draws the same float weights; only the linears differ.
  experts = models.from_config(cfg, quantization="wna16", seed=3)
  whole = models.from_config(cfg, quantization="wna16", quantize_linears=True, seed=3,
                             attention_dtype="float32", allow_activation_quantization=False)
  assert whole.linear_backends()["wna16"] == "reference"

  def dequantized(module):
    a = {n: getattr(module, n)[...] for n in module.quantized_names}
    return dequantize_linear(Int4LinearWeights(a["q"], a["scale"], module.group_size))

  for float_layer, int4_layer in zip(experts.layers, whole.layers):
    fa, qa = float_layer.self_attn, int4_layer.self_attn
    qkv = dequantized(qa.qkv_proj)
    for proj, rows in ((fa.q_proj, slice(0, 256)), (fa.k_proj, slice(256, 384)),
                       (fa.v_proj, slice(384, 512))):
      proj.weight[...] = qkv[rows]
    fa.o_proj.weight[...] = dequantized(qa.o_proj)
    if int4_layer.mlp.__class__.__name__ == "DenseMLP":
      gate_up = dequantized(int4_layer.mlp.gate_up_proj)
      float_layer.mlp.gate_proj.weight[...] = gate_up[:384]
      float_layer.mlp.up_proj.weight[...] = gate_up[384:]
      float_layer.mlp.down_proj.weight[...] = dequantized(int4_layer.mlp.down_proj)
  ids = np.random.default_rng(9).integers(0, VOCAB, (2, 12))
  assert _rel(_logits(whole, ids), _logits(experts, ids)) <= 1e-6


def test_attention_dtype(checkpoints):
  path = checkpoints["qwen3_moe"]
  ids = np.random.default_rng(4).integers(0, VOCAB, (2, 10))
  kw = dict(quantization="w4a8_int8", quantize_linears=True)
  bf16 = _load(path, **kw)
  f32 = _load(path, attention_dtype="float32", **kw)
  assert bf16.attention_dtype == jnp.bfloat16 and f32.attention_dtype == jnp.float32
  assert bf16.init_cache(1, 4).k[0].dtype == jnp.bfloat16
  assert f32.init_cache(1, 4).k[0].dtype == jnp.float32
  rel = _rel(_logits(bf16, ids), _logits(f32, ids))
  print(f"\nattention bf16 vs f32 (every linear int4): logits rel. diff {rel:.2e}")
  # bf16 q/k/v/probabilities: ~2^-9 relative per element, averaged over the heads.
  assert 0 < rel < 2e-2
  # A float model keeps its dtype by default (so it matches transformers in float32) and can
  # run its attention in bf16 on request.
  float_model = _load(path)
  assert float_model.attention_dtype == jnp.float32
  bf16_attention = _load(path, attention_dtype=jnp.bfloat16)
  assert 0 < _rel(_logits(bf16_attention, ids), _logits(float_model, ids)) < 2e-2
  with pytest.raises(ValueError, match="attention_dtype='int8' is not one of"):
    _load(path, attention_dtype="int8")


def test_linear_options_are_validated(checkpoints):
  path = checkpoints["mixtral"]
  with pytest.raises(ValueError, match="quantize_linears=True needs quantization="):
    _load(path, quantize_linears=True)
  with pytest.raises(ValueError, match=r"lm_head_quantization='int8' is not one of \(None, "
                                       r"'int4'\) \(an int8 LM head is not built\)"):
    _load(path, lm_head_quantization="int8")
  with pytest.raises(ValueError, match="lm_head_quantization='fp8' is not one of"):
    _load(path, lm_head_quantization="fp8")
  # An int4 head alone: every other linear float; untied, so the head is its own copy.
  model = _load(path, lm_head_quantization="int4")
  assert isinstance(model.lm_head, QuantizedLinear)
  assert set(model.linear_backends()) == {"float", "w4a8_int8" if ON_CPU else "wna16"}


def test_greedy_generation_on_the_whole_int4_model(checkpoints):
  path = checkpoints["qwen3_moe"]
  model = _load(path, quantization="w4a8_int8", quantize_linears=True,
                lm_head_quantization="int4")
  ids = np.random.default_rng(5).integers(6, VOCAB, (2, 7))
  out = models.generate(model, ids, max_new_tokens=6)
  again = models.generate(model, ids, max_new_tokens=6)
  tokens = np.asarray(out.tokens)
  np.testing.assert_array_equal(tokens, np.asarray(again.tokens))
  assert tokens.shape[0] == 2 and np.all((tokens >= 0) & (tokens < VOCAB))
  # The first new token is the argmax of the full-sequence forward's last position (the cache
  # holds the same bf16 keys and values) wherever that argmax is not a near-tie.
  last = _logits(model, ids)[:, -1]
  top2 = np.sort(last, axis=-1)[:, -2:]
  clear = (top2[:, 1] - top2[:, 0]) > 1e-2 * np.abs(top2[:, 1])
  np.testing.assert_array_equal(tokens[clear, 0], last.argmax(-1)[clear])


def test_cli_quantizes_linears_and_prints_their_backends(checkpoints, capsys):
  from jax_moeq import generate as cli
  out = cli.main(["--model", str(checkpoints["mixtral"]), "--prompt-ids", "7,8,9",
                  "--max-new-tokens", "3", "--quantization", "w4a8_int8", "--quantize-linears",
                  "--lm-head-quantization", "int4", "--quiet"])
  text = capsys.readouterr().out
  assert "linear backend (w4a8_int8)" in text and "attention dtype: bfloat16" in text
  assert set(out["linear_backends"]) == {"w4a8_int8"}


# ------------------------------------------------------------------ int4 checkpoints
def test_compressed_tensors_w4a16_linears_stay_int4(tmp_path):
  hf, dequantized = _ct_checkpoint(tmp_path / "ckpt", 32, activations=False, seed=21)
  ids = np.random.default_rng(6).integers(0, 256, (2, 10))
  want = _hf_logits(hf, dequantized, ids)
  exact = _load(tmp_path / "ckpt", attention_dtype="float32")
  # lm_head is in the checkpoint's ignore list: float; the routers are always float.
  assert set(exact.linear_backends()) == {"wna16", "float"}
  assert isinstance(exact.layers[1].self_attn.qkv_proj, QuantizedLinear)
  assert not isinstance(exact.lm_head, QuantizedLinear)
  # WNA16 dequantizes in float32 exactly: only summation order differs.
  assert _rel(_logits(exact, ids), want) <= 1e-4
  default = _load(tmp_path / "ckpt")
  assert default.attention_dtype == jnp.bfloat16
  rel = _rel(got := _logits(default, ids), want)
  per_position = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
  print(f"\ncompressed-tensors W4A16, bf16 attention: rel. diff {rel:.2e} (median per position "
        f"{np.median(per_position):.2e}), argmax agreement {_agree(got, want):.2f}")
  # bf16 attention: ~2^-9 per element, a few 1e-3 per position; a position whose top-k expert
  # choice flips under that perturbation moves by ~10 % (measured 0.13 at one of 20).
  assert np.median(per_position) < 1e-2 and rel < 0.1
  if ON_CPU:
    fast = _load(tmp_path / "ckpt", quantization="w4a8_int8")
    assert fast.linear_backends() == {"wna16": "cpu_w4a8", "float": "xla"}
    rel = _rel(got := _logits(fast, ids), want)
    print(f"compressed-tensors W4A16 on the W4A8 kernels: rel. diff {rel:.2e}, argmax "
          f"agreement {_agree(got, want):.2f}")
    # Per-token int8 activations in every GEMM (~0.5 % each) plus bf16 attention.
    assert 1e-4 < rel < 5e-2


def _gptq_all_linears(path, group: int, desc_act: bool, seed: int, *, experts: bool = True):
  """A GPTQ checkpoint of a tiny Qwen3-MoE with attention (and, with `experts`, the experts)
  int4. With desc_act, q/k/v share one input order (they read the same input, as a real GPTQ
  run gives them), so they can fuse; o_proj and each expert projection get their own."""
  hf = _tiny_qwen3(seed)
  rng = np.random.default_rng(seed)
  tensors, dequantized, orders = {}, {}, {}
  keys = ("q_proj", "k_proj", "v_proj", "o_proj") + (
      ("gate_proj", "up_proj", "down_proj") if experts else ())
  for name, w in _per_expert(hf.state_dict()).items():
    if not (name.endswith(".weight") and any(f".{k}." in name for k in keys)):
      tensors[name] = dequantized[name] = w
      continue
    prefix = name[:-len(".weight")]
    out, k = w.shape
    groups = k // group
    g_idx = np.arange(k) // group
    if desc_act:
      key = name.replace("up_proj", "gate_proj").replace("k_proj", "q_proj").replace(
          "v_proj", "q_proj")
      g_idx = orders.setdefault(key, rng.permutation(g_idx))
    wn = w.numpy().astype(np.float64)
    scales = np.stack([np.abs(wn[:, g_idx == gi]).max(axis=1) / 7.5 for gi in range(groups)])
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
def test_gptq_linears_stay_int4(tmp_path, desc_act):
  hf, dequantized = _gptq_all_linears(tmp_path / "ckpt", 32, desc_act, seed=31 + desc_act)
  ids = np.random.default_rng(7).integers(0, 256, (2, 10))
  want = _hf_logits(hf, dequantized, ids)
  model = _load(tmp_path / "ckpt", attention_dtype="float32")
  assert "wna16" in model.linear_backends()
  attn = model.layers[0].self_attn
  assert isinstance(attn.qkv_proj, QuantizedLinear)  # one act-order for q/k/v: fused
  assert (attn.qkv_proj.kernel.config.in_features, attn.qkv_proj.out_features) == (256, 512)
  # fp16 scales are exact in float32 and act-order is applied exactly.
  assert _rel(_logits(model, ids), want) <= 1e-4
  if ON_CPU and not desc_act:  # the MoE kernel cannot permute w13's input (act-order)
    fast = _load(tmp_path / "ckpt", quantization="w4a8_int8")
    assert fast.linear_backends()["wna16"] == "cpu_w4a8"
    rel = _rel(_logits(fast, ids), want)
    print(f"\nGPTQ on the W4A8 kernels (experts and linears): rel. diff {rel:.2e}")
    assert 1e-4 < rel < 5e-2
  if ON_CPU and desc_act:
    # The linears' act-order runs on the W4A8 kernel (inputs sorted by group once); the MoE
    # kernel cannot permute w13's input, so this checkpoint keeps its experts float.
    hf, dequantized = _gptq_all_linears(tmp_path / "attn", 32, True, seed=33, experts=False)
    want = _hf_logits(hf, dequantized, ids)
    fast = _load(tmp_path / "attn", allow_activation_quantization=True)
    assert fast.linear_backends() == {"wna16": "cpu_w4a8", "float": "xla"}
    assert "input_perm" in fast.layers[0].self_attn.qkv_proj.quantized_names
    rel = _rel(_logits(fast, ids), want)
    print(f"\nGPTQ desc_act, linears on the W4A8 kernel: rel. diff {rel:.2e}")
    assert 1e-4 < rel < 5e-2


# ------------------------------------------------------------------ hostile checkpoints
def _rewrite(path, edit):
  tensors = safetensors_torch.load_file(str(path / "model.safetensors"))
  edit(tensors)
  safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                              str(path / "model.safetensors"))


def test_hostile_linears_raise_naming_the_tensor(tmp_path):
  _ct_checkpoint(tmp_path / "ckpt", 32, activations=False, seed=41)
  path = tmp_path / "ckpt"
  config = json.loads((path / "config.json").read_text())
  name = "model.layers.0.self_attn.k_proj"

  def wrong_shape(t):  # a [64, 256] int4 weight where config.json says [128, 256]
    t[f"{name}.weight_packed"] = t[f"{name}.weight_packed"][:64].clone()
    t[f"{name}.weight_scale"] = t[f"{name}.weight_scale"][:64].clone()
    t[f"{name}.weight_shape"] = torch.tensor([64, 256], dtype=torch.int32)

  _rewrite(path, wrong_shape)
  with pytest.raises(ValueError, match=rf"{name}.weight_packed.* shape \[64, 256\] \[out, in\], "
                                       r"expected \[128, 256\]"):
    _load(path)

  _ct_checkpoint(tmp_path / "ckpt2", 32, activations=False, seed=41)
  path = tmp_path / "ckpt2"

  def wrong_group(t):  # 4 scale groups per row: group 64, where config.json says 32
    t[f"{name}.weight_scale"] = t[f"{name}.weight_scale"][:, :4].clone()

  _rewrite(path, wrong_group)
  with pytest.raises(ValueError, match=rf"{name}.weight_scale.*has 4 groups per row, expected 8"):
    _load(path)
  # An int4 linear that the ignore list says is float.
  config["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.gate$",
                                             "re:.*self_attn.q_proj$"]
  _ct_checkpoint(tmp_path / "ckpt3", 32, activations=False, seed=41)
  (tmp_path / "ckpt3" / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="q_proj.*ignore lists it as unquantized"):
    _load(tmp_path / "ckpt3")
