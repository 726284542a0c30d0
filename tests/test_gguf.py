"""`jax_moeq.models.gguf.write_gguf`: a tiny random qwen3_moe checkpoint saved by transformers,
converted to GGUF; tensor names, shapes, types and values read back with `gguf.GGUFReader`; where
llama-cpp-python is importable, llama.cpp's logits of a short prompt against jax_moeq's."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import models

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package (jax_moeq[llama])")
torch = pytest.importorskip("torch", reason="the checkpoints are made by transformers (torch)")
transformers = pytest.importorskip("transformers",
                                   reason="the checkpoints are made by transformers")

from jax_moeq.models import gguf as gguf_export  # noqa: E402

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K, MOE_I, HEADS, KV_HEADS, HEAD_DIM = (
    512, 256, 2, 16, 4, 128, 4, 2, 64)


def _llama_cpp_or_skip():
  try:
    import llama_cpp
  except ImportError:
    pytest.skip("llama-cpp-python is not importable (pip install 'llama-cpp-python>=0.3')")
  return llama_cpp


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory, transformers model in float32) of a tiny qwen3_moe with perturbed norms."""
  torch.manual_seed(0)
  cfg = transformers.Qwen3MoeConfig(
      vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256,
      intermediate_size=384, moe_intermediate_size=MOE_I, num_experts=EXPERTS,
      num_experts_per_tok=TOP_K, norm_topk_prob=True, rope_theta=10000.0, eos_token_id=5)
  hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name:  # ones at init: perturbed so that a missed or misplaced norm shows
        p.add_(0.1 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("qwen3_moe")
  hf.save_pretrained(path)
  return path, hf


@pytest.fixture(scope="module")
def written(checkpoint, tmp_path_factory):
  """qtype -> GGUFResult for F32 and Q4_0 (gguf package)."""
  path, _ = checkpoint
  out = tmp_path_factory.mktemp("gguf")
  return {q: gguf_export.write_gguf(path, out / f"tiny-{q}.gguf", qtype=q) for q in ("F32", "Q4_0")}


def _hf_weights(hf) -> dict[str, np.ndarray]:
  """The transformers model's float32 weights by GGUF name, stacked [E, out, in] for experts."""
  sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
  out = {"token_embd.weight": sd["model.embed_tokens.weight"],
         "output_norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
  for b in range(LAYERS):
    p = f"model.layers.{b}."
    out[f"blk.{b}.attn_q.weight"] = sd[p + "self_attn.q_proj.weight"]
    out[f"blk.{b}.attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
    out[f"blk.{b}.ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"]
    if p + "mlp.experts.gate_up_proj" in sd:  # transformers 5: fused [E, 2I, H], gate rows first
      gate_up = sd[p + "mlp.experts.gate_up_proj"]
      out[f"blk.{b}.ffn_gate_exps.weight"] = gate_up[:, :MOE_I]
      out[f"blk.{b}.ffn_up_exps.weight"] = gate_up[:, MOE_I:]
      out[f"blk.{b}.ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]
    else:
      for proj, name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
        out[f"blk.{b}.ffn_{name}_exps.weight"] = np.stack(
            [sd[f"{p}mlp.experts.{e}.{proj}.weight"] for e in range(EXPERTS)])
  return out


def _reader_tensors(path) -> dict:
  return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _field(reader, key):
  f = reader.fields[key]
  value = f.parts[f.data[0]]
  return value.tobytes().decode() if f.types[0] == gguf.GGUFValueType.STRING else value[0]


def test_f32_gguf_has_llama_cpp_names_shapes_and_exact_values(checkpoint, written):
  path, hf = checkpoint
  result = written["F32"]
  tensors = _reader_tensors(result.path)
  per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
               "attn_k_norm", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
               "ffn_down_exps"]
  want_names = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
      f"blk.{b}.{n}.weight" for b in range(LAYERS) for n in per_layer}
  assert set(tensors) == want_names
  # GGUF lists dimensions innermost first: [in, out] for a linear, [H, I, E] for gate/up stacks.
  ne = {n: tuple(int(d) for d in t.shape) for n, t in tensors.items()}
  assert ne["token_embd.weight"] == ne["output.weight"] == (HIDDEN, VOCAB)
  assert ne["blk.0.attn_q.weight"] == (HIDDEN, HEADS * HEAD_DIM)
  assert ne["blk.0.attn_k.weight"] == ne["blk.0.attn_v.weight"] == (HIDDEN, KV_HEADS * HEAD_DIM)
  assert ne["blk.0.attn_output.weight"] == (HEADS * HEAD_DIM, HIDDEN)
  assert ne["blk.1.attn_q_norm.weight"] == ne["blk.1.attn_k_norm.weight"] == (HEAD_DIM,)
  assert ne["blk.1.ffn_gate_inp.weight"] == (HIDDEN, EXPERTS)
  assert ne["blk.1.ffn_gate_exps.weight"] == ne["blk.1.ffn_up_exps.weight"] == (
      HIDDEN, MOE_I, EXPERTS)
  assert ne["blk.1.ffn_down_exps.weight"] == (MOE_I, HIDDEN, EXPERTS)
  assert set(result.tensor_types.values()) == {"F32"}
  # Values: the checkpoint's float32 weights, unchanged and untransposed.
  for name, want in _hf_weights(hf).items():
    got = np.asarray(tensors[name].data).reshape(want.shape)
    np.testing.assert_array_equal(got, want, err_msg=name)
  reader = gguf.GGUFReader(str(result.path))
  assert _field(reader, "general.architecture") == "qwen3moe"
  assert _field(reader, "qwen3moe.expert_count") == EXPERTS
  assert _field(reader, "qwen3moe.expert_used_count") == TOP_K
  assert _field(reader, "qwen3moe.expert_feed_forward_length") == MOE_I
  assert _field(reader, "qwen3moe.attention.key_length") == HEAD_DIM
  assert _field(reader, "qwen3moe.rope.freq_base") == pytest.approx(10000.0)
  assert _field(reader, "tokenizer.ggml.model") == "llama"
  assert len(reader.fields["tokenizer.ggml.tokens"].data) == VOCAB


def test_q4_0_gguf_quantizes_every_linear_and_keeps_norms_and_router(checkpoint, written):
  _, hf = checkpoint
  result = written["Q4_0"]
  types = result.tensor_types
  for name, t in types.items():
    float_kept = name.endswith("norm.weight") or "ffn_gate_inp" in name
    assert t == ("F32" if float_kept else "Q4_0"), name
  assert result.output_type == result.token_embd_type == "Q4_0"
  tensors = _reader_tensors(result.path)
  for name, want in _hf_weights(hf).items():
    t = tensors[name]
    got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    if types[name] == "F32":
      assert err == 0.0, name
    else:
      # Q4_0: 16 levels over [-max, max] per 32 values: RMS error ~ 1/(8·sqrt(12)) of the block
      # maximum, about 10 % of the RMS for normal weights; 0.15 bounds it, a layout error is ~1.4.
      assert 0.02 < err < 0.15, (name, err)


def test_write_gguf_rejects_what_llama_cpp_cannot_run(checkpoint, tmp_path):
  path, _ = checkpoint
  with pytest.raises(ValueError, match="gguf package has no Python quantizer"):
    gguf_export.write_gguf(path, tmp_path / "x.gguf", qtype="Q4_K_M", quantizer="gguf")
  with pytest.raises(ValueError, match="qtype="):
    gguf_export.write_gguf(path, tmp_path / "x.gguf", qtype="Q3_X")
  with pytest.raises(ValueError, match="quantizer="):
    gguf_export.write_gguf(path, tmp_path / "x.gguf", quantizer="numpy")
  with pytest.raises(FileNotFoundError):
    gguf_export.write_gguf(tmp_path / "missing", tmp_path / "x.gguf")
  cfg = json.loads((path / "config.json").read_text())
  for change, message in (({"norm_topk_prob": False}, "norm_topk_prob"),
                          ({"model_type": "mixtral"}, "qwen3_moe"),
                          ({"mlp_only_layers": [0]}, "dense")):
    bad = tmp_path / f"bad_{len(list(tmp_path.iterdir()))}"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
      gguf_export.write_gguf(bad, tmp_path / "x.gguf")


# ------------------------------------------------------------------ against llama.cpp
PROMPT = [7, 300, 41, 5, 511, 123, 64, 2, 99, 250, 18]


def _llama_logits(llama_cpp, path) -> np.ndarray:
  """llama.cpp's logits [S, V] of PROMPT: F32 KV cache, every position's logits."""
  llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=2,
                        n_threads_batch=2, logits_all=True, verbose=False,
                        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
  llm.eval(PROMPT)
  out = np.array(llm.scores[:len(PROMPT)], np.float32)
  llm.close()
  return out


def _jax_logits(path, **kw) -> np.ndarray:
  model = models.from_pretrained(path, dtype=jnp.float32, show_progress=False, **kw)
  with jax.default_matmul_precision("float32"):
    return np.asarray(jax.jit(lambda m, i: m(i))(model, jnp.asarray([PROMPT], jnp.int32)))[0]


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_llama_cpp_f32_logits_match_jax_moeq_float(checkpoint, written):
  llama_cpp = _llama_cpp_or_skip()
  path, _ = checkpoint
  want = _jax_logits(path)
  got = _llama_logits(llama_cpp, written["F32"].path)
  assert got.shape == want.shape == (len(PROMPT), VOCAB)
  # Both float32 end to end (weights, activations, KV cache): only summation order and the
  # exp/rsqrt implementations differ, ~1e-7 relative per op (measured 6e-7 over the prompt);
  # 1e-5 leaves room while a wrong layout, norm or RoPE form gives O(1).
  assert _rel(got, want) < 1e-5
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_llama_cpp_q4_0_logits_stay_near_jax_moeq_int4(checkpoint, written):
  llama_cpp = _llama_cpp_or_skip()
  path, _ = checkpoint
  float_logits = _jax_logits(path)
  kw = dict(quantization="w4a8_int8", group_size=32)
  try:
    int4_logits = _jax_logits(path, quantize_linears=True, lm_head_quantization="int4", **kw)
  except TypeError:  # a jax_moeq without int4 dense linears: experts only
    int4_logits = _jax_logits(path, **kw)
  got = _llama_logits(llama_cpp, written["Q4_0"].path)
  ours, theirs = _rel(int4_logits, float_logits), _rel(got, float_logits)
  # Two int4 round-to-nearest schemes of the same weights (llama.cpp Q4_0: scale max/-8 per 32,
  # int8 activations per 32; ours absmax/7.5 per 32, int8 activations per row), embedding and
  # LM head included: each moves the logits by int4 noise (~10 % per GEMM), and the two differ
  # from each other by about sqrt(2) times that. Measured here: Q4_0 0.23 and ours 0.21 from
  # the float logits, 0.27 from each other; 0.5 bounds them, while a wrong layout or tensor
  # gives ~1.4 (uncorrelated logits).
  assert 1e-3 < theirs < 0.5 and 1e-3 < ours < 0.5, (theirs, ours)
  assert _rel(got, int4_logits) < 0.5


def test_llama_cpp_quantizer_writes_q4_k_m_with_its_own_mix(checkpoint, tmp_path):
  _llama_cpp_or_skip()
  path, _ = checkpoint
  result = gguf_export.write_gguf(path, tmp_path / "tiny-Q4_K_M.gguf", qtype="Q4_K_M")
  assert result.quantizer == "llama.cpp"
  assert not any(p.name.endswith(".F32.gguf") for p in tmp_path.iterdir())  # temp file removed
  # llama.cpp's Q4_K_M: the LM head in Q6_K, the embedding in Q4_K, norms and router unquantized.
  assert (result.output_type, result.token_embd_type) == ("Q6_K", "Q4_K")
  assert result.tensor_types["blk.0.attn_q.weight"] == "Q4_K"
  assert result.tensor_types["blk.0.ffn_gate_inp.weight"] == "F32"
  assert result.tensor_types["blk.1.attn_k_norm.weight"] == "F32"
