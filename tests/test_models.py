"""jax_moeq.models against transformers itself: tiny random Qwen3-MoE, Mixtral and OLMoE models
built and saved by transformers, loaded by `from_pretrained`, float32 logits and greedy
generation compared with transformers' own."""

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

VOCAB = 512


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Float32 comparisons need float32 GEMMs (a GPU would otherwise use TF32)."""
  with jax.default_matmul_precision("float32"):
    yield
# Float32 end to end on both sides: only summation order differs (measured ~5e-7).
FLOAT_RTOL = 1e-3


def _configs():
  common = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256)
  return {
      "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
          common, intermediate_size=384, moe_intermediate_size=128, num_key_value_heads=2,
          head_dim=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
          eos_token_id=5)),
      "qwen3_moe_dense": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
          common, num_hidden_layers=3, intermediate_size=384, moe_intermediate_size=128,
          num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
          norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1,
          tie_word_embeddings=True, eos_token_id=5)),
      "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
          common, intermediate_size=128, num_key_value_heads=2, num_local_experts=8,
          num_experts_per_tok=2, sliding_window=6, eos_token_id=5)),
      "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, dict(
          common, intermediate_size=128, num_key_value_heads=4, num_experts=16,
          num_experts_per_tok=4, clip_qkv=0.2, eos_token_id=5, pad_token_id=1)),
  }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (directory, transformers model in float32)."""
  out = {}
  for name, (config_cls, model_cls, kw) in _configs().items():
    torch.manual_seed(len(out))
    hf = model_cls(config_cls(**kw)).eval()
    # Norm weights are ones at init: perturb them so a missed norm cannot pass.
    with torch.no_grad():
      for pname, p in hf.named_parameters():
        if "norm" in pname:
          p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    out[name] = (path, hf)
  return out


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _hf_logits(hf, ids, mask=None):
  with torch.no_grad():
    kw = {} if mask is None else {"attention_mask": torch.tensor(mask)}
    return hf(torch.tensor(ids), **kw).logits.float().numpy()


@pytest.mark.parametrize("name", list(_configs()))
def test_float_logits_match_transformers(checkpoints, name):
  path, hf = checkpoints[name]
  model = models.from_pretrained(path, dtype=jnp.float32, show_progress=False)
  assert model.dtype == jnp.float32 and model.moe_backends() == {"float": model.moe_backends()[
      "float"]}
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, 13))
  want = _hf_logits(hf, ids)
  got = np.asarray(jax.jit(lambda m, i: m(i))(model, jnp.asarray(ids, jnp.int32)))
  assert got.shape == want.shape == (2, 13, VOCAB)
  assert _rel(got, want) <= FLOAT_RTOL
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_left_padded_logits_match_transformers(checkpoints):
  path, hf = checkpoints["qwen3_moe"]
  model = models.from_pretrained(path, dtype=jnp.float32, show_progress=False)
  ids = np.random.default_rng(1).integers(0, VOCAB, (2, 9))
  mask = np.ones_like(ids)
  mask[1, :4] = 0
  want = _hf_logits(hf, ids, mask)
  got = np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask)))
  # Padding slots' outputs are meaningless on both sides: compare the tokens only.
  keep = mask.astype(bool)
  assert _rel(got[keep], want[keep]) <= FLOAT_RTOL


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_greedy_generation_matches_transformers(checkpoints, name):
  path, hf = checkpoints[name]
  model = models.from_pretrained(path, dtype=jnp.float32, show_progress=False)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(6, VOCAB, 9).tolist(), rng.integers(6, VOCAB, 4).tolist()]
  out = models.generate(model, prompts, max_new_tokens=10, eos_token_id=[])
  ids = np.zeros((2, 9), np.int64)
  mask = np.zeros((2, 9), np.int64)
  for b, p in enumerate(prompts):
    ids[b, 9 - len(p):] = p
    mask[b, 9 - len(p):] = 1
  with torch.no_grad():
    want = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=10,
                       do_sample=False, eos_token_id=None, pad_token_id=0)[:, 9:].numpy()
  np.testing.assert_array_equal(np.asarray(out.tokens), want)
  np.testing.assert_array_equal(np.asarray(out.num_tokens), [10, 10])


def test_generation_stops_at_eos_per_row(checkpoints):
  path, _ = checkpoints["qwen3_moe"]
  model = models.from_pretrained(path, dtype=jnp.float32, show_progress=False)
  prompts = [[7, 8, 9, 10], [11, 12, 13, 14]]
  free = np.asarray(models.generate(model, prompts, max_new_tokens=8, eos_token_id=[]).tokens)
  # Make a token that only row 0 produces, at its first occurrence j, the EOS: row 0 stops
  # there, row 1 runs on unchanged.
  j = next(j for j in range(1, 8)
           if free[0, j] not in free[0, :j].tolist() and free[0, j] not in free[1].tolist())
  eos = int(free[0, j])
  out = models.generate(model, prompts, max_new_tokens=8, eos_token_id=eos, pad_token_id=3)
  tokens = np.asarray(out.tokens)
  np.testing.assert_array_equal(tokens[0, :j + 1], free[0, :j + 1])
  np.testing.assert_array_equal(tokens[0, j + 1:], 3)
  np.testing.assert_array_equal(tokens[1], free[1])
  np.testing.assert_array_equal(np.asarray(out.num_tokens), [j + 1, 8])


def test_sampling_is_seeded_and_stays_in_the_nucleus(checkpoints):
  path, _ = checkpoints["mixtral"]
  model = models.from_pretrained(path, dtype=jnp.float32, show_progress=False)
  prompts = [[7, 8, 9], [10, 11, 12]]
  kw = dict(max_new_tokens=6, temperature=0.7, top_p=0.5, eos_token_id=[])
  a = models.generate(model, prompts, rng=jax.random.key(1), **kw).tokens
  b = models.generate(model, prompts, rng=jax.random.key(1), **kw).tokens
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # top_p -> 0 keeps only the best token: sampling equals greedy.
  greedy = models.generate(model, prompts, max_new_tokens=6, eos_token_id=[]).tokens
  tiny = models.generate(model, prompts, rng=jax.random.key(2), max_new_tokens=6,
                         temperature=1.0, top_p=1e-6, eos_token_id=[]).tokens
  np.testing.assert_array_equal(np.asarray(tiny), np.asarray(greedy))


def test_sample_tokens_nucleus():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000, jnp.float32))
  drawn = np.asarray(models.sample_tokens(logits, jax.random.key(0), 1.0, 0.7))
  # Nucleus 0.7: {0, 1} (0.5 + 0.3 >= 0.7); renormalized 0.625 / 0.375.
  assert set(drawn.tolist()) == {0, 1}
  assert abs((drawn == 0).mean() - 0.625) < 0.03


@pytest.mark.parametrize("quantization,backend", [("w4a8_int8", "cpu_int4"),
                                                  ("wna16", "reference")])
def test_quantized_on_load_stays_close_to_float(checkpoints, quantization, backend):
  path, hf = checkpoints["qwen3_moe"]
  if jax.default_backend() != "cpu":
    pytest.skip("backend expectations are the CPU's")
  model = models.from_pretrained(path, dtype=jnp.float32, quantization=quantization,
                                 group_size=32, show_progress=False)
  assert model.moe_backends() == {quantization: backend}
  ids = np.random.default_rng(3).integers(0, VOCAB, (2, 8))
  want = _hf_logits(hf, ids)
  got = np.asarray(jax.jit(lambda m, i: m(i))(model, jnp.asarray(ids, jnp.int32)))
  # Int4 experts (RTN, ~10 % weight noise per GEMM) move the logits of this random model by a
  # few percent (the residual stream and attention are exact); 0.1 bounds it, 1e-4 proves that
  # the experts really were replaced.
  assert 1e-4 < _rel(got, want) < 0.1


def test_config_spellings_old_and_new():
  new = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "moe_intermediate_size": 16, "intermediate_size": 32,
         "num_local_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
         "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "dtype": "bfloat16"}
  old = dict(new)
  del old["rope_parameters"], old["num_local_experts"], old["dtype"]
  old.update(rope_theta=5e5, num_experts=4, torch_dtype="bfloat16")
  assert models.decoder_config(new) == models.decoder_config(old)
  cfg = models.decoder_config(new)
  assert cfg.rope_theta == 5e5 and cfg.num_experts == 4 and cfg.dtype == "bfloat16"


def test_bad_configs_raise_naming_the_key(tmp_path):
  base = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 16,
          "num_local_experts": 4, "num_experts_per_tok": 2}
  models.decoder_config(base)
  with pytest.raises(ValueError, match="model_type='llama'"):
    models.decoder_config(dict(base, model_type="llama"))
  with pytest.raises(ValueError, match="num_experts_per_tok=8 exceeds"):
    models.decoder_config(dict(base, num_experts_per_tok=8))
  with pytest.raises(ValueError, match="hidden_size='32'"):
    models.decoder_config(dict(base, hidden_size="32"))
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    models.decoder_config(dict(base, rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}))
  with pytest.raises(ValueError, match="num_local_experts / num_experts"):
    models.decoder_config({k: v for k, v in base.items() if k != "num_local_experts"})
  (tmp_path / "config.json").write_text('{"model_type": "mixtral",\n "vocab_size": }')
  with pytest.raises(ValueError, match=r"config.json: malformed JSON at line 2"):
    models.from_pretrained(tmp_path)


def test_bad_checkpoints_raise_naming_the_tensor(checkpoints, tmp_path):
  from safetensors.numpy import load_file, save_file
  src, _ = checkpoints["mixtral"]
  tensors = load_file(str(src / "model.safetensors"))
  config = json.loads((src / "config.json").read_text())

  def write(name, tensors, cfg=config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    return d

  missing = dict(tensors)
  del missing["model.layers.1.self_attn.k_proj.weight"]
  with pytest.raises(KeyError, match="model.layers.1.self_attn.k_proj.weight"):
    models.from_pretrained(write("missing", missing), show_progress=False)
  wrong = dict(tensors, **{"model.norm.weight": np.ones(7, np.float32)})
  with pytest.raises(ValueError, match=r"model.norm.weight.*\(7,\), expected \(256,\)"):
    models.from_pretrained(write("shape", wrong), show_progress=False)
  with pytest.raises(ValueError, match="E=8.*config.json says E=4"):
    models.from_pretrained(write("experts", tensors, dict(config, num_local_experts=4)),
                           show_progress=False)
  with pytest.raises(ValueError, match="quantization='int3'"):
    models.from_pretrained(src, quantization="int3", show_progress=False)
  with pytest.raises(ValueError, match="group_size is only used"):
    models.from_pretrained(src, group_size=32, show_progress=False)
  truncated = tmp_path / "truncated"
  truncated.mkdir()
  (truncated / "config.json").write_text(json.dumps(config))
  raw = (src / "model.safetensors").read_bytes()
  (truncated / "model.safetensors").write_bytes(raw[:len(raw) // 2])
  with pytest.raises(Exception, match="model.safetensors") as info:
    models.from_pretrained(truncated, show_progress=False)
  assert isinstance(info.value, (ValueError, OSError, KeyError))


def test_generate_rejects_bad_input(checkpoints):
  path, _ = checkpoints["olmoe"]
  model = models.from_pretrained(path, dtype=jnp.float32, show_progress=False)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    models.generate(model, [[1, VOCAB]], max_new_tokens=2)
  with pytest.raises(ValueError, match="left padding"):
    models.generate(model, np.ones((1, 3), np.int32), attention_mask=[[1, 1, 0]],
                    max_new_tokens=2)
  with pytest.raises(ValueError, match="max_new_tokens"):
    models.generate(model, [[1, 2]], max_new_tokens=0)
  with pytest.raises(ValueError, match="top_p"):
    models.generate(model, [[1, 2]], max_new_tokens=1, top_p=0.0)


def test_random_model_from_config_runs_under_jit():
  cfg = {"model_type": "olmoe", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32,
         "num_experts": 8, "num_experts_per_tok": 2}
  model = models.from_config(cfg, quantization="w4a8_int8", group_size=32)
  out = models.generate(model, [[1, 2, 3]], max_new_tokens=4)
  assert np.asarray(out.tokens).shape == (1, 4)
  logits = jax.jit(lambda m, i: m(i))(model, jnp.ones((1, 5), jnp.int32))
  assert np.isfinite(np.asarray(logits)).all()


def test_cli_prints_backends_and_rates(checkpoints, capsys):
  from jax_moeq import generate as cli
  path, _ = checkpoints["qwen3_moe"]
  out = cli.main(["--model", str(path), "--prompt-ids", "7,8,9", "--max-new-tokens", "4",
                  "--quantization", "w4a8_int8", "--quiet"])
  text = capsys.readouterr().out
  assert "MoE backend (w4a8_int8)" in text and "time to first token" in text
  assert "tok/s" in text and len(out["ids"]) >= 1


@pytest.mark.parametrize("quantization", ["wna16", "mxint4"])
def test_gpu_int4_kernels_match_their_reference_in_a_model(checkpoints, quantization):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (the WNA16 / MxInt4 kernels run on Hopper)")
  from jax_moeq.ops.wna16_gpu import wna16_gpu_available
  if not wna16_gpu_available():
    pytest.skip("our CUDA library is not built or the GPU is below compute capability 9.0")
  path, _ = checkpoints["qwen3_moe"]
  kw = dict(dtype=jnp.bfloat16, quantization=quantization, show_progress=False)
  fast = models.from_pretrained(path, **kw)
  ref = models.from_pretrained(path, moe_backend="reference", **kw)
  assert fast.moe_backends()[quantization] != "reference"
  ids = np.random.default_rng(4).integers(0, VOCAB, (2, 12))
  got = np.asarray(fast(jnp.asarray(ids, jnp.int32)))
  want = np.asarray(ref(jnp.asarray(ids, jnp.int32)))
  # bf16 activations: the kernels round at the reference's points; rare one-ulp flips through
  # two layers stay well under 1e-2 (SPEC §9).
  assert _rel(got, want) <= 1e-2
  out = models.generate(fast, [[7, 8, 9], [10, 11]], max_new_tokens=6)
  assert np.asarray(out.tokens).shape == (2, 6)
