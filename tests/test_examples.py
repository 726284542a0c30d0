"""The examples, run in-process with tiny settings."""

import json

import _helpers
import numpy as np
import pytest

TINY_QWEN3_MOE = ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
                  "--head-dim", "32", "--experts", "8", "--top-k", "2", "--moe-intermediate", "64",
                  "--vocab", "256"]


def test_generate_qwen3_moe_tiny(tmp_path, capsys):
  example = _helpers.load_example("generate_qwen3_moe")
  out = example.main(TINY_QWEN3_MOE + ["--random", "--out", str(tmp_path / "ckpt"), "--batch", "2",
                                       "--prompt-len", "6", "--max-new-tokens", "4",
                                       "--repeats", "1", "--no-llama-cpp"])
  text = capsys.readouterr().out
  assert "decode speed-up over float" in text and "argmax agreement" in text
  assert out["backends"]["w4a8_int8"] == "cpu_int4" and "float" in out["backends"]
  assert out["linear_backends"] == {"w4a8_int8": "cpu_w4a8"}
  for name in ("float", "w4a8_int8", "all_int4"):
    run = out[name]
    assert run["tokens"].shape == (2, 4)
    for key in ("decode_tok_s", "prefill_tok_s"):
      assert np.isfinite(run[key]) and run[key] > 0
  for name in ("w4a8_int8", "all_int4"):
    assert np.isfinite(out["speedup"][name]) and out["speedup"][name] > 0
  # Int4 experts perturb the logits by int4 noise, not more. Round-to-nearest int4 with a per-group
  # absmax scale (groups of 64 normal weights: absmax ~2.5 sigma, step ~0.36 sigma) leaves ~10 %
  # rms relative error per expert GEMM, ~15 % through both; the logits see it only through the
  # MoE blocks' share of the residual stream, so they move well under 15 % (measured 1.5-3 %), and
  # clearly above 0 (the blocks really were replaced).
  experts = out["agreement"]["w4a8_int8"]
  assert 1e-3 < experts["rel_frobenius"] < 0.15
  assert experts["argmax_agreement"] >= 0.5  # 12 positions; measured 92-100 %
  # Every linear int4: each int4 GEMM adds ~10 % rms relative error (as above) and the errors are
  # independent. In this random model the attention branch dominates the residual stream (its
  # output, ~0.02 * sqrt(H) larger than the embedding), so the logits carry the v and o
  # projections' errors of both layers (4 GEMMs in series) plus the LM head's:
  # sqrt(5) * 10 % ~ 22 % (measured 21.9 %; attention projections alone 19.2 %, the head alone
  # 11.2 %). 0.3 leaves room for the spread of per-group absmax scales, not for a broken kernel
  # (a wrong nibble order or scale gives ~100 %).
  whole = out["agreement"]["all_int4"]
  assert 1e-3 < whole["rel_frobenius"] < 0.3
  assert whole["argmax_agreement"] >= 0.5


def test_generate_qwen3_moe_shipped_model_writes_text(capsys):
  """The default: the trained model in examples/tiny_qwen3_moe continues text prompts in float
  and int4 and reports the held-out perplexity of each."""
  pytest.importorskip("tokenizers", reason="the shipped model's prompts need `tokenizers`")
  example = _helpers.load_example("generate_qwen3_moe")
  out = example.main(["--max-new-tokens", "6", "--repeats", "1", "--ppl-windows", "2",
                      "--no-llama-cpp", "--prompt", "The for statement", "--prompt",
                      "Return the number of"])
  text = capsys.readouterr().out
  assert "model: tiny_qwen3_moe" in text and "held-out perplexity" in text
  assert out["prompts"] == ["The for statement", "Return the number of"]
  for name in ("float", "w4a8_int8", "all_int4"):
    assert len(out["texts"][name]) == 2 and all(out["texts"][name])
    assert f"{name:9s} 'The for statement" in text
    assert out[name]["tokens"].shape == (1, 6)  # rates from the first prompt alone
  # Trained weights: float perplexity on held-out text far below the 4096 of uniform guessing
  # (measured 100.5 on these first 2 windows, whose text is harder than the average: 67.3 over all
  # 158), and int4 costing a few percent (measured +1.4 % experts int4, +3.3 % every linear int4
  # on these 2 windows). This checks the example's wiring; tests/test_quality.py holds the bounds
  # derived from the quality table.
  ppl = out["perplexity"]
  assert ppl["float"] < 200
  for name in ("w4a8_int8", "all_int4"):
    assert 0.99 < ppl[name] / ppl["float"] < 1.1


def test_generate_qwen3_moe_beside_llama_cpp(tmp_path, capsys):
  """With llama-cpp-python and gguf installed, the main job prints llama.cpp's rates beside ours."""
  pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")
  pytest.importorskip("gguf", reason="gguf is not installed (pip install .[llama])")
  example = _helpers.load_example("generate_qwen3_moe")
  out = example.main(TINY_QWEN3_MOE + ["--random", "--out", str(tmp_path / "ckpt"), "--batch", "1",
                                       "--prompt-len", "6", "--max-new-tokens", "4",
                                       "--repeats", "1"])
  text = capsys.readouterr().out
  assert "llama.cpp" in text and "over llama.cpp Q4_0" in text
  for key in ("decode_tok_s", "prefill_tok_s"):
    assert np.isfinite(out["llama_cpp"][key]) and out["llama_cpp"][key] > 0


def test_qwen3_moe_checkpoint_layout(tmp_path):
  """The written checkpoint is a valid safetensors file with transformers' Qwen3-MoE names."""
  from jax_moeq.loaders.safetensors_io import read_header, read_tensor
  example = _helpers.load_example("generate_qwen3_moe")
  cfg = example.qwen3_moe_config(example._parse_args(TINY_QWEN3_MOE))
  example.write_qwen3_moe_checkpoint(tmp_path, cfg, seed=0)
  infos, metadata = read_header(tmp_path / "model.safetensors")  # validates offsets and coverage
  assert metadata == {"format": "pt"}
  shapes = {name: tuple(info.shape) for name, info in infos.items()}
  assert shapes == dict(example.qwen3_moe_tensors(cfg))
  assert shapes["model.layers.1.mlp.experts.7.down_proj.weight"] == (128, 64)
  assert shapes["model.layers.0.self_attn.q_norm.weight"] == (32,)
  embed = read_tensor(infos["model.embed_tokens.weight"], "model.embed_tokens.weight")
  assert embed.dtype.name == "bfloat16" and 0.015 < np.std(embed.astype(np.float32)) < 0.025
  assert json.loads((tmp_path / "config.json").read_text()) == cfg


def test_qwen3_moe_checkpoint_matches_transformers(tmp_path):
  """transformers reads the checkpoint with no missing or unexpected tensor, and what it saves
  back has our tensor names, shapes and config keys."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  from jax_moeq.loaders.safetensors_io import read_header
  example = _helpers.load_example("generate_qwen3_moe")
  cfg = example.qwen3_moe_config(example._parse_args(TINY_QWEN3_MOE))
  example.write_qwen3_moe_checkpoint(tmp_path / "ours", cfg, seed=0)
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "ours", output_loading_info=True, dtype=torch.bfloat16)
  assert type(model).__name__ == "Qwen3MoeForCausalLM"
  assert not info["missing_keys"] and not info["unexpected_keys"]
  assert not info["mismatched_keys"]
  model.save_pretrained(tmp_path / "theirs")
  infos, _ = read_header(tmp_path / "theirs" / "model.safetensors")
  assert {name: tuple(i.shape) for name, i in infos.items()} == dict(example.qwen3_moe_tensors(cfg))
  saved = json.loads((tmp_path / "theirs" / "config.json").read_text())
  assert set(saved) == set(cfg)
  assert {k: saved[k] for k in cfg if k != "transformers_version"} == {
      k: v for k, v in cfg.items() if k != "transformers_version"}


@pytest.mark.parametrize("fmt", ["compressed-tensors-w4a8", "gptq", "mxint4"])
def test_convert_checkpoint_tiny(tmp_path, capsys, fmt):
  pytest.importorskip("safetensors")
  conv = _helpers.load_example("convert_checkpoint")
  args = ["--out", str(tmp_path / "ckpt"), "--format", fmt, "--layers", "2", "--experts", "4",
          "--hidden", "128", "--intermediate", "128", "--tokens", "3"]
  if fmt != "compressed-tensors-w4a8":
    args.append("--allow-activation-quantization")
  out = conv.main(args)
  text = capsys.readouterr().out
  assert "loaded 2 MoE layers" in text
  assert out["output"].shape == (3, 128) and np.isfinite(out["output"]).all()
  # Same int4 data, same backend, same kernel: identical outputs.
  assert out["max_abs_diff_vs_exported"] == 0.0
  # Loading an existing directory (--path) gives the same result.
  again = conv.main(["--path", str(tmp_path / "ckpt"), "--tokens", "3"] + (
      ["--allow-activation-quantization"] if fmt != "compressed-tensors-w4a8" else []))
  np.testing.assert_array_equal(again["output"], out["output"])
