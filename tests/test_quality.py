"""The shipped trained model (examples/tiny_qwen3_moe): jax_moeq's logits equal transformers', and
each int4 scheme's held-out perplexity stays within a bound of float derived from the quality
table (benchmarks/quality.py, docs/performance.md), so that a regression in a packer or a kernel
shows up as lost quality."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import models

torch = pytest.importorskip("torch", reason="the interop tests need torch (test extras)")
transformers = pytest.importorskip("transformers",
                                   reason="the interop tests need transformers (test extras)")
pytest.importorskip("tokenizers", reason="the held-out text is tokenized with `tokenizers`")

# test_models' float32 comparison: its autouse fixture (float32 GEMMs) and tolerance.
from test_models import FLOAT_RTOL, _float32_matmuls, _hf_logits, _rel  # noqa: E402,F401

_ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = _ROOT / "examples" / "tiny_qwen3_moe"
_spec = importlib.util.spec_from_file_location("quality", _ROOT / "benchmarks" / "quality.py")
quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality)

WINDOW = 256
SUBSET = 32  # the first 32 of the 158 held-out windows: 8,160 scored tokens

# Bounds on perplexity(scheme) / perplexity(float) over the subset. Derivation, per scheme:
#   bound = full_ratio * exp(3 * se)
# - full_ratio: the ratio over all 158 held-out windows (40,290 tokens), the quality table of
#   docs/performance.md (2026-11-26, benchmarks/quality.py);
# - se: the standard error of the subset's mean per-token log-likelihood difference (scheme minus
#   float), from the spread of that difference over the subset's 32 windows (same run, first 32
#   windows). log(subset ratio) is that mean, so a 32-window subset of text on which the scheme
#   is as good as over the whole set lands within 3 se of log(full_ratio) but for 0.3 % of
#   draws; the subset is fixed, so the bound fails only when the scheme itself got worse by more
#   than the window-sampling noise (3 se: 0.4-0.6 % for int4 experts, ~1 % for every linear
#   int4). Subtle quantization bugs cost more than that; measured on this subset with W4A8 experts
#   at group 128 (bound 1.0061), each bug planted in `quantize_int4`: scales 7 % too large
#   (absmax / 7 instead of / 7.5) 1.028; each group's scale moved to the next group 1.014; the
#   int4 values' lowest bit dropped 1.065. A wrong nibble order or garbage weights cost far more.
#   Differences between group sizes (<= 0.4 %) are below this resolution.
# Measured on this subset (same run): the subset ratios below the bound in brackets.
# scheme: (full_ratio, se)
RATIO_BOUNDS: dict[str, tuple[float, float]] = {
    "w4a8_int8 g32": (1.00042, 0.00134),    # subset 1.00138
    "w4a8_int8 g64": (1.00201, 0.00142),    # subset 1.00186
    "w4a8_int8 g128": (1.00123, 0.00163),   # subset 1.00230
    "w4a8_int8 g-1": (1.00415, 0.00206),    # subset 1.00330
    "wna16 g32": (1.00062, 0.00123),        # subset 1.00196
    "wna16 g64": (1.00211, 0.00138),        # subset 1.00174
    "wna16 g128": (1.00097, 0.00163),       # subset 1.00209
    "wna16 g-1": (1.00409, 0.00199),        # subset 1.00270
    "mxint4 g32": (1.00062, 0.00123),       # subset 1.00196
    "all_int4 g128": (1.01298, 0.00362),    # subset 1.01808
    "all_int4 g32": (1.01343, 0.00307),     # subset 1.01413
}

# Float perplexity over the subset: measured 52.716 (jax_moeq float32, 2026-11-26). Float32
# numerics differ between machines only in summation order (logits within 1e-3 relative of
# transformers', FLOAT_RTOL; measured ~1e-6 on this model), which moves the perplexity by far less
# than 1 %; 53.5 (+1.5 %) is that with room to spare. A broken loader (a missed norm, a transposed
# or misnamed weight, shuffled experts) gives hundreds or more: uniform guessing over the 4096-token
# vocabulary is 4096.
FLOAT_PPL_BOUND = 53.5


@pytest.fixture(scope="module")
def subset() -> np.ndarray:
  return quality.windows(quality.held_out_ids(CHECKPOINT), WINDOW, SUBSET)


@pytest.fixture(scope="module")
def float_nll(subset) -> np.ndarray:
  return quality.window_nll(quality.load(CHECKPOINT), subset)


@pytest.fixture(scope="module")
def hf_model():
  return transformers.AutoModelForCausalLM.from_pretrained(
      CHECKPOINT, dtype=torch.float32).eval()


def test_checkpoint_files_are_found_and_complete():
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "heldout.txt"):
    assert (CHECKPOINT / name).is_file(), name
  size = sum(p.stat().st_size for p in CHECKPOINT.iterdir())
  assert size < 25e6, f"{CHECKPOINT} holds {size / 1e6:.1f} MB"


def test_float_logits_on_held_out_text_match_transformers(hf_model, subset):
  """float32 on both sides from the same bf16 weights: only summation order differs."""
  model = models.from_pretrained(CHECKPOINT, dtype=jnp.float32, show_progress=False)
  ids = subset[:2, :128]
  want = _hf_logits(hf_model, ids)
  got = np.asarray(model(jnp.asarray(ids, jnp.int32)))
  assert got.shape == want.shape == (2, 128, 4096)
  assert _rel(got, want) <= FLOAT_RTOL
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_float_perplexity_matches_transformers_and_its_bound(hf_model, subset, float_nll):
  ours = quality.perplexity(float_nll, WINDOW)
  with torch.no_grad():
    logits = torch.cat([hf_model(torch.tensor(subset[i:i + 8])).logits.float()
                        for i in range(0, len(subset), 8)])
  target = torch.tensor(subset[:, 1:], dtype=torch.long)
  nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                          target.reshape(-1), reduction="mean")
  theirs = math.exp(float(nll))
  # Logits within FLOAT_RTOL move each log-probability by ~1e-3 of the logits' scale at most.
  assert abs(ours / theirs - 1) < 1e-3, (ours, theirs)
  assert ours < FLOAT_PPL_BOUND, ours


@pytest.mark.parametrize("scheme", list(RATIO_BOUNDS))
def test_int4_perplexity_stays_within_its_bound(subset, float_nll, scheme):
  model = quality.load(CHECKPOINT, **quality.SCHEMES[scheme])
  expected = {"w4a8_int8": "cpu_int4", "wna16": "reference", "mxint4": "reference"}
  scheme_name = quality.SCHEMES[scheme]["quantization"]
  if jax.default_backend() == "cpu":
    assert model.moe_backends() == {scheme_name: expected[scheme_name]}
  if quality.SCHEMES[scheme].get("quantize_linears"):
    assert "float" not in model.linear_backends()  # the LM head and attention too
  nll = quality.window_nll(model, subset)
  ratio = quality.perplexity(nll, WINDOW) / quality.perplexity(float_nll, WINDOW)
  full_ratio, se = RATIO_BOUNDS[scheme]
  bound = full_ratio * math.exp(3 * se)
  assert ratio < bound, f"{scheme}: perplexity ratio {ratio:.5f} to float, bound {bound:.5f}"
  # It really is quantized: int4 weights change every window's likelihood.
  assert not np.allclose(nll, float_nll, rtol=1e-6)


def test_windows_reject_bad_sizes():
  ids = np.arange(10, dtype=np.int32)
  with pytest.raises(ValueError, match="window=1"):
    quality.windows(ids, 1)
  with pytest.raises(ValueError, match="make no window"):
    quality.windows(ids, 16)
  with pytest.raises(ValueError, match="count=0"):
    quality.windows(ids, 4, 0)
  assert quality.windows(ids, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
