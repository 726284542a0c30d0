"""Hostile `config.json`, `generation_config.json` and `quantization_config` (issue: files from
strangers). A small valid Qwen3-MoE checkpoint gets mutated configs: keys deleted, values of the
wrong type, negative, zero, huge (2^62), NaN, nested where a number belongs. Loading must either
succeed or raise ValueError (ConfigError is one) / KeyError naming what is wrong, within seconds:
never TypeError, AttributeError, OverflowError, MemoryError, a crash or a hang. Sizes come from
the config, but nothing is allocated from them before they are checked against the tensors'
headers. A checkpoint that only has pickled weights (`pytorch_model.bin`) is refused without
being unpickled.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import time
from pathlib import Path

import _helpers
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jax_moeq import models  # noqa: E402
from jax_moeq.loaders import config as qconfig  # noqa: E402

# Loading this checkpoint takes well under a second; a mutated config that makes the loader
# loop, allocate or compile what the config claims shows up as many seconds (a hang guard, not a
# performance bound).
SECONDS_PER_LOAD = 60.0

HOSTILE_VALUES = [None, True, False, -1, 0, 1, 3, 7, 2**31, 2**62, -2**63, 10**30, 0.5, 1e308,
                  -1e308, math.nan, math.inf, "", "silu", "bfloat16", "gelu", "yarn", [], [0],
                  [1, 2, 3], {}, {"rope_type": "yarn"}, {"rope_theta": -1.0}]
REFUSALS = (ValueError, KeyError)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  import argparse
  example = _helpers.load_example("generate_qwen3_moe")
  args = argparse.Namespace(checkpoint_dtype="float32", head_dim=16, hidden=64, moe_intermediate=32,
                            heads=4, top_k=2, layers=2, kv_heads=2, experts=4, vocab=64)
  cfg = example.qwen3_moe_config(args)
  path = tmp_path_factory.mktemp("hostile") / "ckpt"
  example.write_qwen3_moe_checkpoint(path, cfg, seed=0)
  return path, cfg


def _with_config(path: Path, cfg, name: str = "config.json") -> None:
  # allow_nan: JSON readers in the wild accept NaN / Infinity, so a checkpoint may hold them.
  (path / name).write_text(json.dumps(cfg, allow_nan=True))


def _load_or_refuse(path: Path) -> str:
  """'loaded' or 'refused'; any other exception, or a load past SECONDS_PER_LOAD, fails."""
  start = time.monotonic()
  try:
    models.from_pretrained(path, show_progress=False)
    outcome = "loaded"
  except REFUSALS as e:
    assert str(e), "a refusal must say what is wrong"
    outcome = "refused"
  elapsed = time.monotonic() - start
  assert elapsed < SECONDS_PER_LOAD, f"{outcome} after {elapsed:.0f} s"
  return outcome


# Every key of the config (nested rope_parameters and quantization_config included) can be
# deleted or set to a hostile value; keys a config may lack are offered too.
_EXTRA_KEYS = ["rope_theta", "num_experts", "torch_dtype", "head_dim", "quantization_config",
               "tie_word_embeddings", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
               "eos_token_id", "bos_token_id", "pad_token_id"]


def _mutations(keys):
  action = st.one_of(st.just(("delete", None)),
                     st.tuples(st.just("set"), st.sampled_from(HOSTILE_VALUES)),
                     st.tuples(st.just("set"), st.integers(-2**64, 2**64)),
                     st.tuples(st.just("set"), st.text(max_size=6)))
  return st.lists(st.tuples(st.sampled_from(sorted(keys)), action), min_size=1, max_size=3)


def _apply(cfg, mutations):
  cfg = copy.deepcopy(cfg)
  for key, (what, value) in mutations:
    node, leaf = cfg, key
    if "." in key:
      head, leaf = key.split(".", 1)
      if not isinstance(cfg.get(head), dict):
        cfg[head] = {}
      node = cfg[head]
    if what == "delete":
      node.pop(leaf, None)
    else:
      node[leaf] = value
  return cfg


def test_the_unmutated_checkpoint_loads(checkpoint):
  path, cfg = checkpoint
  _with_config(path, cfg)
  assert _load_or_refuse(path) == "loaded"


@settings(max_examples=60)
@given(data=st.data())
def test_mutated_config_json_loads_or_raises_a_clear_error(checkpoint, data):
  path, cfg = checkpoint
  keys = set(cfg) | set(_EXTRA_KEYS) | {f"rope_parameters.{k}" for k in cfg["rope_parameters"]}
  mutated = _apply(cfg, data.draw(_mutations(keys)))
  _with_config(path, mutated)
  try:
    _load_or_refuse(path)
  finally:
    _with_config(path, cfg)


@settings(max_examples=30)
@given(data=st.data())
def test_mutated_generation_config_loads_or_raises_a_clear_error(checkpoint, data):
  path, cfg = checkpoint
  generation_file = path / "generation_config.json"
  original = generation_file.read_text()
  generation = {"eos_token_id": [1, 2], "bos_token_id": 0, "pad_token_id": 0,
                "temperature": 0.7, "top_p": 0.9, "do_sample": True, "max_new_tokens": 8}
  mutated = _apply(generation, data.draw(_mutations(set(generation))))
  try:
    _with_config(path, mutated, "generation_config.json")
    _load_or_refuse(path)
  finally:
    generation_file.write_text(original)


def _compressed_tensors_config():
  return {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "ignore": ["lm_head"],
          "config_groups": {"group_0": {
              "targets": ["Linear"],
              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False,
                          "strategy": "group", "group_size": 32, "actorder": None},
              "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                    "dynamic": True, "strategy": "token"}}}}


def _gptq_config():
  return {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
          "checkpoint_format": "gptq"}


def _paths(node, prefix=""):
  """Every key path of a nested dict, as dotted strings."""
  out = []
  for key, value in node.items():
    out.append(prefix + key)
    if isinstance(value, dict):
      out += _paths(value, prefix + key + ".")
  return out


def _set_path(cfg, dotted, what, value):
  *heads, leaf = dotted.split(".")
  node = cfg
  for head in heads:
    if not isinstance(node.get(head), dict):
      return  # an earlier mutation replaced the parent: nothing left to mutate
    node = node[head]
  if what == "delete":
    node.pop(leaf, None)
  else:
    node[leaf] = value


@settings(max_examples=150)
@given(base=st.sampled_from([_compressed_tensors_config, _gptq_config]), data=st.data())
def test_mutated_quantization_config_parses_or_names_the_field(base, data):
  qc = base()
  action = st.one_of(st.just(("delete", None)),
                     st.tuples(st.just("set"), st.sampled_from(HOSTILE_VALUES)),
                     st.tuples(st.just("set"), st.integers(-2**64, 2**64)))
  for dotted, (what, value) in data.draw(st.lists(
      st.tuples(st.sampled_from(_paths(qc)), action), min_size=1, max_size=3)):
    _set_path(qc, dotted, what, value)
  try:
    parsed = qconfig.parse_quantization_config(qc)
  except ValueError as e:
    assert str(e)
    return
  # What parses is a configuration the loaders support: 4-bit, symmetric, a usable group size.
  if parsed.quantized:
    assert parsed.group_size == -1 or parsed.group_size in (32, 64, 128, 256, 512, 1024), parsed


def test_quantization_config_in_a_checkpoint_is_checked_before_any_tensor(checkpoint):
  path, cfg = checkpoint
  broken = dict(cfg, quantization_config={"quant_method": "compressed-tensors",
                                          "config_groups": [1, 2]})
  _with_config(path, broken)
  try:
    with pytest.raises(ValueError, match="config.json"):
      models.from_pretrained(path, show_progress=False)
  finally:
    _with_config(path, cfg)


class _Payload:
  """Unpickling this object would create the marker file: proof that a pickle ran."""

  def __init__(self, marker: Path):
    self.marker = marker

  def __reduce__(self):
    return (open, (str(self.marker), "w"))


def test_pickled_weights_are_refused_unread(tmp_path, checkpoint):
  _, cfg = checkpoint
  marker = tmp_path / "unpickled"
  ckpt = tmp_path / "pickled"
  ckpt.mkdir()
  _with_config(ckpt, cfg)
  for name in ("pytorch_model.bin", "model.ckpt", "model.pt"):
    (ckpt / name).write_bytes(pickle.dumps(_Payload(marker)))
  with pytest.raises((FileNotFoundError, ValueError), match="safetensors"):
    models.from_pretrained(ckpt, show_progress=False)
  assert not marker.exists(), "a checkpoint's pickle was executed"
  assert not os.path.exists(str(marker))
