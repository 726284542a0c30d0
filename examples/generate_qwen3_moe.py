"""Generate with a Qwen3-MoE checkpoint: float vs every linear int4 on the CPU W4A8 kernels.

Without --model the script first writes a small Qwen3-MoE checkpoint with random weights (normal,
std 0.02; norm weights near 1): `config.json`, `generation_config.json` and `model.safetensors`
with the config keys and tensor names that transformers writes for `Qwen3MoeForCausalLM`
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...). It needs numpy only: the safetensors
file is written here (an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the raw little-endian tensor data). With --model DIR it
reads a float qwen3_moe / mixtral / olmoe checkpoint directory instead (both models are held in
memory at once).

It then loads the directory three times with `jax_moeq.models.from_pretrained`: as stored
(float), with its experts quantized to int4 while loading (`quantization="w4a8_int8"`: the fused
CPU W4A8 MoE kernel), and with every linear int4 (`quantize_linears=True,
lm_head_quantization="int4"`: attention, dense MLPs and the LM head on the CPU W4A8 dense-linear
kernel too, attention math and KV cache in bfloat16). It generates greedily from the same prompts
with each, and prints decode and prefill tok/s, the int4 speed-ups, the backends, and how closely
the int4 models' logits on the prompts agree with float (relative Frobenius difference, argmax
agreement). Where `llama-cpp-python` and `gguf` are installed (`pip install ".[llama]"`), the
checkpoint is also written as a Q4_0 GGUF (every linear Q4_0, the LM head included, as ours) and
llama.cpp's decode and prompt tok/s on the first prompt are printed beside ours, with the same
thread count.

Run: python examples/generate_qwen3_moe.py [--model DIR] [--layers 2 --experts 64 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# ------------------------------------------------------------------ safetensors, in numpy
# safetensors dtype names <-> numpy dtypes (bfloat16 is ml_dtypes', which jax installs).
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I32": "int32",
              "I8": "int8", "U8": "uint8"}


def _np_dtype(name: str) -> np.dtype:
  if name == "bfloat16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def _st_dtype(dtype: np.dtype) -> str:
  for st_name, np_name in _ST_DTYPES.items():
    if _np_dtype(np_name) == dtype:
      return st_name
  raise ValueError(f"no safetensors dtype for {dtype}")


def safetensors_header(specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> bytes:
  """The length-prefixed JSON header for tensors laid out in `specs` order, padded to 8 bytes."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name, (shape, dtype) in specs.items():
    size = math.prod(shape) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _st_dtype(np.dtype(dtype)), "shape": list(shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  return len(text).to_bytes(8, "little") + text


def write_safetensors(path: Path, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                      fill: Callable[[str, tuple[int, ...]], np.ndarray]) -> int:
  """Writes `fill(name, shape)` for each tensor of `specs`, one at a time; returns the bytes."""
  with open(path, "wb") as f:
    f.write(safetensors_header(specs))
    for name, (shape, dtype) in specs.items():
      value = np.ascontiguousarray(fill(name, shape), dtype=dtype)
      if value.shape != tuple(shape):
        raise ValueError(f"{name}: filled shape {value.shape}, expected {tuple(shape)}")
      f.write((value.byteswap() if sys.byteorder == "big" else value).tobytes())
    return f.tell()


# ------------------------------------------------------------------ a Qwen3-MoE checkpoint
def qwen3_moe_config(args: argparse.Namespace) -> dict[str, Any]:
  """`config.json` of a Qwen3MoeForCausalLM, keys as transformers 5 writes them."""
  return {
      "architectures": ["Qwen3MoeForCausalLM"],
      "attention_bias": False,
      "attention_dropout": 0.0,
      "bos_token_id": None,
      "decoder_sparse_step": 1,
      "dtype": args.checkpoint_dtype,
      "eos_token_id": None,
      "head_dim": args.head_dim,
      "hidden_act": "silu",
      "hidden_size": args.hidden,
      "initializer_range": 0.02,
      "intermediate_size": 4 * args.moe_intermediate,
      "max_position_embeddings": 32768,
      "mlp_only_layers": [],
      "model_type": "qwen3_moe",
      "moe_intermediate_size": args.moe_intermediate,
      "norm_topk_prob": True,
      "num_attention_heads": args.heads,
      "num_experts_per_tok": args.top_k,
      "num_hidden_layers": args.layers,
      "num_key_value_heads": args.kv_heads,
      "num_local_experts": args.experts,
      "output_router_logits": False,
      "pad_token_id": None,
      "rms_norm_eps": 1e-06,
      "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
      "router_aux_loss_coef": 0.001,
      "sliding_window": None,
      "tie_word_embeddings": False,
      "transformers_version": "5.24.0",
      "use_cache": True,
      "use_sliding_window": False,
      "vocab_size": args.vocab,
  }


def qwen3_moe_tensors(cfg: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
  """(name, shape) of every tensor of a Qwen3MoeForCausalLM checkpoint, sorted by name."""
  h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
  nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  e, i = cfg["num_local_experts"], cfg["moe_intermediate_size"]
  shapes = {"lm_head.weight": (v, h), "model.embed_tokens.weight": (v, h),
            "model.norm.weight": (h,)}
  for layer in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{layer}"
    shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
               f"{p}.self_attn.q_proj.weight": (nh * d, h),
               f"{p}.self_attn.k_proj.weight": (nkv * d, h),
               f"{p}.self_attn.v_proj.weight": (nkv * d, h),
               f"{p}.self_attn.o_proj.weight": (h, nh * d),
               f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,),
               f"{p}.mlp.gate.weight": (e, h)}
    for expert in range(e):
      q = f"{p}.mlp.experts.{expert}"
      shapes |= {f"{q}.gate_proj.weight": (i, h), f"{q}.up_proj.weight": (i, h),
                 f"{q}.down_proj.weight": (h, i)}
  return iter(sorted(shapes.items()))


def random_weights(seed: int) -> Callable[[str, tuple[int, ...]], np.ndarray]:
  """Normal weights with std 0.02; norm weights 1 + N(0, 0.1^2) (trained models' scale)."""
  rng = np.random.default_rng(seed)

  def fill(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("norm.weight"):
      return 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
    return 0.02 * rng.standard_normal(shape, np.float32)

  return fill


def write_qwen3_moe_checkpoint(path: Path, cfg: Mapping[str, Any], seed: int) -> int:
  """Writes config.json, generation_config.json and model.safetensors; returns the file bytes."""
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
  generation = {"_from_model_config": True, "output_attentions": False,
                "output_hidden_states": False, "transformers_version": cfg["transformers_version"],
                "use_cache": True}
  (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
  dtype = _np_dtype(cfg["dtype"])
  specs = {name: (shape, dtype) for name, shape in qwen3_moe_tensors(cfg)}
  return write_safetensors(path / "model.safetensors", specs, random_weights(seed))


# ------------------------------------------------------------------ load, generate, compare
def timed_generate(named_models: Mapping[str, Any], prompts: np.ndarray, new_tokens: int,
                   repeats: int) -> dict[str, dict[str, Any]]:
  """Greedy generation with each model: a first (compiling) call, then `repeats` rounds over
  the models in turn; the best prefill and decode rates of each."""
  from jax_moeq import models
  batch, length = prompts.shape
  first = {name: models.generate(m, prompts, max_new_tokens=new_tokens)
           for name, m in named_models.items()}
  best = {name: [math.inf, math.inf] for name in named_models}
  for _ in range(repeats):
    for name, m in named_models.items():
      out = models.generate(m, prompts, max_new_tokens=new_tokens)
      best[name] = [min(best[name][0], out.prefill_seconds),
                    min(best[name][1], out.decode_seconds)]
  runs = {}
  for name, out in first.items():
    decoded = int(np.asarray(out.num_tokens).sum()) - batch  # tokens after each row's first
    prefill_s, decode_s = best[name]
    runs[name] = {"tokens": np.asarray(out.tokens), "compile_s": out.compile_seconds,
                  "prefill_tok_s": batch * length / prefill_s,
                  "decode_tok_s": decoded / decode_s if decoded > 0 else 0.0}
  return runs


def llama_cpp_rates(path: Path, prompt: np.ndarray, new_tokens: int, repeats: int,
                    threads: int) -> dict[str, Any] | None:
  """llama.cpp's prompt and decode tok/s on a Q4_0 GGUF of the checkpoint (one prompt row, best
  of `repeats` after a warm-up), or None when llama-cpp-python or gguf is not installed."""
  import importlib.util
  if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
    return None
  from llama_cpp import Llama
  from jax_moeq.models.gguf import write_gguf
  with tempfile.TemporaryDirectory(prefix="gguf_") as tmp:
    gguf_path = Path(tmp) / "model-q4_0.gguf"
    write_gguf(path, gguf_path, qtype="Q4_0", quantizer="gguf")
    llm = Llama(model_path=str(gguf_path), n_ctx=len(prompt) + new_tokens + 8,
                n_batch=max(64, len(prompt)), n_threads=threads, n_threads_batch=threads,
                verbose=False)
    ids = [int(t) for t in prompt]
    best = [math.inf, math.inf]
    for rep in range(repeats + 1):  # the first round warms up
      llm.reset()
      start = time.perf_counter()
      llm.eval(ids)
      token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
      mid = time.perf_counter()
      for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
      end = time.perf_counter()
      if rep:
        best = [min(best[0], mid - start), min(best[1], end - mid)]
    del llm
  return {"prefill_tok_s": len(ids) / best[0],
          "decode_tok_s": (new_tokens - 1) / best[1] if new_tokens > 1 else 0.0}


def prompt_logits(model, prompts: np.ndarray) -> np.ndarray:
  """The model's float32 logits [B, S, V] on the prompts (one jitted forward)."""
  from flax import nnx
  return np.asarray(nnx.jit(lambda m, ids: m(ids))(model, prompts))


def logit_agreement(quantized: np.ndarray, reference: np.ndarray) -> dict[str, float]:
  """Relative Frobenius difference and the fraction of positions with the same argmax."""
  diff = np.linalg.norm((quantized - reference).ravel()) / np.linalg.norm(reference.ravel())
  same = np.mean(quantized.argmax(-1) == reference.argmax(-1))
  return {"rel_frobenius": float(diff), "argmax_agreement": float(same)}


def common_prefix(a: np.ndarray, b: np.ndarray) -> float:
  """Mean over rows of the number of leading positions where the token rows agree."""
  differ = a != b
  first = np.where(differ.any(axis=1), differ.argmax(axis=1), a.shape[1])
  return float(first.mean())


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", help="an existing checkpoint directory (default: write a random one)")
  p.add_argument("--out", help="where to write the random checkpoint (default: a temporary "
                 "directory, removed at the end)")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--moe-intermediate", type=int, default=384)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--checkpoint-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="dtype of the written checkpoint")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="dtype the models run in (float32: XLA's fastest float path on CPU)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--prompt-len", type=int, default=16)
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3,
                 help="timed generate calls per model, alternating between the models")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                 help="skip the llama.cpp comparison even where llama-cpp-python is installed")
  return p.parse_args(argv)


# name -> from_pretrained keywords
VARIANTS: dict[str, dict[str, Any]] = {
    "float": {},
    "w4a8_int8": {"quantization": "w4a8_int8"},
    "all_int4": {"quantization": "w4a8_int8", "quantize_linears": True,
                 "lm_head_quantization": "int4"},
}


def _load(path: Path, dtype: str, **kw):
  from jax_moeq import models
  start = time.perf_counter()
  model = models.from_pretrained(path, dtype=dtype, show_progress=False, **kw)
  return model, time.perf_counter() - start


def run(path: Path, args: argparse.Namespace) -> dict[str, Any]:
  """Loads `path` float, with int4 experts and with every linear int4; generates; compares."""
  import jax
  loaded = {name: _load(path, args.dtype, **kw) for name, kw in VARIANTS.items()}
  named = {name: model for name, (model, _) in loaded.items()}
  float_model = named["float"]
  cfg = float_model.config
  prompts = np.random.default_rng(args.seed).integers(
      0, cfg.vocab_size, (args.batch, args.prompt_len), dtype=np.int32)
  runs = timed_generate(named, prompts, args.max_new_tokens, args.repeats)
  reference_logits = prompt_logits(float_model, prompts)
  agreement = {name: logit_agreement(prompt_logits(named[name], prompts), reference_logits)
               for name in VARIANTS if name != "float"}
  same_prefix = {name: common_prefix(runs[name]["tokens"], runs["float"]["tokens"])
                 for name in agreement}
  backends = {}
  for model in named.values():
    backends.update(model.moe_backends())
  linear_backends = named["all_int4"].linear_backends()
  threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  llama = llama_cpp_rates(path, prompts[0], args.max_new_tokens, args.repeats,
                          threads) if args.llama_cpp else None
  print(f"model: {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts (top-{cfg.top_k}, {cfg.moe_intermediate_size} wide), "
        f"vocab {cfg.vocab_size}, {float_model.dtype} on {jax.default_backend()} "
        f"({jax.device_count()} device)")
  print("loaded in " + ", ".join(f"{load_s:.1f} s ({name})" for name, (_, load_s)
                                 in loaded.items())
        + f"; MoE backends: {backends}; linear backends (all_int4): {linear_backends}")
  print(f"batch {args.batch}, prompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens "
        f"(greedy), best of {args.repeats} alternating calls after compiling")
  for name, r in runs.items():
    print(f"  {name:9s}  decode tok/s {r['decode_tok_s']:8.1f}   prefill tok/s "
          f"{r['prefill_tok_s']:8.1f}   compile {r['compile_s']:.1f} s")
  if llama is not None:
    print(f"  {'llama.cpp':9s}  decode tok/s {llama['decode_tok_s']:8.1f}   prompt tok/s "
          f"{llama['prefill_tok_s']:8.1f}   (Q4_0 GGUF, every linear Q4_0, batch 1, "
          f"{threads} threads)")
  f = runs["float"]
  speedups = {name: runs[name]["decode_tok_s"] / f["decode_tok_s"] for name in agreement}
  for name in agreement:
    q, a = runs[name], agreement[name]
    print(f"{name}: decode speed-up over float {speedups[name]:.2f}x, prefill "
          f"{q['prefill_tok_s'] / f['prefill_tok_s']:.2f}x; logits on the prompts vs float: "
          f"relative Frobenius difference {a['rel_frobenius']:.3f}, argmax agreement "
          f"{a['argmax_agreement']:.1%}; greedy tokens equal for the first "
          f"{same_prefix[name]:.1f} of {args.max_new_tokens} (mean over rows)")
  if llama is not None and args.batch == 1:
    print(f"all_int4 decode over llama.cpp Q4_0: "
          f"{runs['all_int4']['decode_tok_s'] / llama['decode_tok_s']:.2f}x")
  return {**runs, "speedup": speedups, "backends": backends, "linear_backends": linear_backends,
          "same_prefix": same_prefix, "agreement": agreement, "llama_cpp": llama,
          "load_s": {name: load_s for name, (_, load_s) in loaded.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = _parse_args(argv)
  if args.model is not None:
    return run(Path(args.model), args)
  path = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="qwen3_moe_"))
  try:
    start = time.perf_counter()
    nbytes = write_qwen3_moe_checkpoint(path, qwen3_moe_config(args), args.seed)
    print(f"wrote a random Qwen3-MoE checkpoint to {path} ({nbytes / 1e6:.0f} MB, "
          f"{time.perf_counter() - start:.1f} s)")
    return run(path, args) | {"checkpoint": str(path)}
  finally:
    if not args.out:
      shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
  main(sys.argv[1:])
