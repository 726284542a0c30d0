"""examples/train_tiny_moe.py: the corpus split, and a few training steps that give a checkpoint
both transformers and jax_moeq load."""

import json

import _helpers
import numpy as np
import pytest

pytest.importorskip("torch", reason="training needs torch (test extras)")
pytest.importorskip("transformers", reason="training needs transformers (test extras)")
pytest.importorskip("tokenizers", reason="the tokenizer is trained with `tokenizers`")


def test_split_depends_on_the_name_only():
  train = _helpers.load_example("train_tiny_moe")
  names = [f"module:pkg/m{i}.py" for i in range(2000)]
  splits = [train.split_of(n) for n in names]
  assert splits == [train.split_of(n) for n in names]  # deterministic
  share = {s: splits.count(s) / len(names) for s in ("held_out", "validation")}
  # 13 of 256 first-byte values each: 5.1 %; 2000 names give a binomial spread of 0.5 %.
  assert 0.03 < share["held_out"] < 0.075 and 0.03 < share["validation"] < 0.075
  docs = {"topic:a": "x", "topic:b": "y", "module:c.py": "z"}
  train_docs, val_docs, held_docs = train.split_documents(docs)
  assert sorted(train_docs + val_docs + held_docs) == ["x", "y", "z"]


def test_module_text_puts_docstrings_under_signatures():
  train = _helpers.load_example("train_tiny_moe")
  text = train.module_text('"""Module doc."""\n\ndef f(a, b=1):\n  """Adds.\n\n  More."""\n'
                           'class C:\n  """A class."""\n  def g(self):\n    pass\n')
  assert text.startswith("Module doc.")
  assert 'def f(a, b=1):\n    """Adds.\n\n    More."""' in text
  assert 'class C:\n    """A class."""' in text and "def g" not in text


def test_a_few_steps_give_a_checkpoint_both_engines_load(tmp_path, capsys):
  import jax.numpy as jnp
  from jax_moeq import models
  train = _helpers.load_example("train_tiny_moe")
  out = tmp_path / "ckpt"
  summary = train.main(["--out", str(out), "--steps", "2", "--batch", "2", "--seq", "32",
                        "--eval-every", "1", "--warmup", "1", "--vocab", "512",
                        "--device", "cpu"])
  assert summary["steps"] == 2 and np.isfinite(summary["held_out_loss"])
  assert "greedy:" in capsys.readouterr().out
  for name in ("config.json", "model.safetensors", "tokenizer.json", "heldout.txt"):
    assert (out / name).is_file(), name
  assert not (out / "ids.npz").exists()
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["model_type"] == "qwen3_moe" and cfg["num_local_experts"] == 16
  assert cfg["num_experts_per_tok"] == 2 and cfg["output_router_logits"] is False
  model = models.from_pretrained(out, dtype=jnp.float32, show_progress=False)
  logits = np.asarray(model(jnp.asarray([[1, 2, 3, 4]], jnp.int32)))
  assert logits.shape == (1, 4, 512) and np.isfinite(logits).all()
