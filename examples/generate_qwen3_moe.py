"""The main job: a trained Qwen3-MoE, float against int4 on the CPU W4A8 kernels.

By default the script runs the model that ships in examples/tiny_qwen3_moe (trained by
examples/train_tiny_moe.py on the Python standard library's documentation: 4 layers, hidden 256,
16 experts, top-2, a 4096-token byte-level BPE). With --model DIR it reads another float qwen3_moe
/ mixtral / olmoe checkpoint directory; with --random it first writes a Qwen3-MoE checkpoint with
random weights (normal, std 0.02; norm weights near 1; --layers, --experts, ... set its shape):
`config.json`, `generation_config.json` and `model.safetensors` with the config keys and tensor
names that transformers writes for `Qwen3MoeForCausalLM`, written here with numpy alone (an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw
little-endian tensor data).

It loads the directory three times with `jax_moeq.models.from_pretrained`: as stored (float),
with its experts quantized to int4 while loading (`quantization="w4a8_int8"`: the fused CPU W4A8
MoE kernel), and with every linear int4 (`quantize_linears=True, lm_head_quantization="int4"`:
attention and the LM head on the CPU W4A8 dense-linear kernel too, attention math and KV cache in
bfloat16). Where the checkpoint has a `tokenizer.json` (and `tokenizers` is installed), each model
continues the text prompts (--prompt, greedy unless --temperature) and the script prints the three
continuations; else the prompts are random token ids. It prints decode and prefill tok/s, the int4
speed-ups, the backends, how closely the int4 models' logits on the prompts agree with float
(relative Frobenius difference, argmax agreement) and, where the checkpoint has a `heldout.txt`,
each model's perplexity on its first --ppl-windows windows of 256 tokens and the int4 models'
difference from float (benchmarks/quality.py measures every scheme on the whole text). Where
`llama-cpp-python` and `gguf` are installed (`pip install ".[llama]"`), the checkpoint is also
written as a Q4_0 GGUF (every linear Q4_0, the LM head included, as ours) and llama.cpp's decode
and prompt tok/s on the first prompt are printed beside ours, with the same thread count.

Run: python examples/generate_qwen3_moe.py [--prompt "The for statement"] [--model DIR | --random
[--layers 2 --experts 64 ...]]
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
SHIPPED_MODEL = Path(__file__).resolve().parent / "tiny_qwen3_moe"
DEFAULT_PROMPTS = ('def read(self, size=-1):\n    """', "The for statement")
PPL_WINDOW = 256


def _prompt_tokens(prompts: np.ndarray | list[list[int]]) -> tuple[int, int]:
  """(rows, real prompt tokens) of a [B, S] array or a list of token lists."""
  if isinstance(prompts, np.ndarray):
    return prompts.shape[0], prompts.size
  return len(prompts), sum(len(row) for row in prompts)


def timed_generate(named_models: Mapping[str, Any], prompts, new_tokens: int, repeats: int,
                   temperature: float = 0.0) -> dict[str, dict[str, Any]]:
  """Generation (greedy unless `temperature`, seeded) with each model: a first (compiling) call,
  then `repeats` rounds over the models in turn; the best prefill and decode rates of each.
  `prompts`: [B, S] ids, or a list of token lists (left-padded by `generate`)."""
  import jax
  from jax_moeq import models
  batch, prompt_tokens = _prompt_tokens(prompts)

  def call(m):
    return models.generate(m, prompts, max_new_tokens=new_tokens, temperature=temperature,
                           top_p=0.9 if temperature else 1.0, rng=jax.random.key(0))

  first = {name: call(m) for name, m in named_models.items()}
  best = {name: [math.inf, math.inf] for name in named_models}
  for _ in range(repeats):
    for name, m in named_models.items():
      out = call(m)
      best[name] = [min(best[name][0], out.prefill_seconds),
                    min(best[name][1], out.decode_seconds)]
  runs = {}
  for name, out in first.items():
    decoded = int(np.asarray(out.num_tokens).sum()) - batch  # tokens after each row's first
    prefill_s, decode_s = best[name]
    runs[name] = {"tokens": np.asarray(out.tokens), "num_tokens": np.asarray(out.num_tokens),
                  "compile_s": out.compile_seconds,
                  "prefill_tok_s": prompt_tokens / prefill_s,
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


def load_tokenizer(path: Path):
  """The checkpoint's `tokenizer.json` as a `tokenizers.Tokenizer`, or None where there is none
  (or `tokenizers` is not installed)."""
  if not (path / "tokenizer.json").is_file():
    return None
  try:
    from tokenizers import Tokenizer
  except ImportError:
    return None
  return Tokenizer.from_file(str(path / "tokenizer.json"))


def held_out_windows(path: Path, tokenizer, count: int) -> np.ndarray | None:
  """The first `count` windows of PPL_WINDOW tokens of the checkpoint's `heldout.txt`, or None."""
  from jax_moeq.models.perplexity import token_windows
  if tokenizer is None or count < 1 or not (path / "heldout.txt").is_file():
    return None
  ids = np.asarray(tokenizer.encode((path / "heldout.txt").read_text(encoding="utf-8")).ids,
                   np.int32)
  return token_windows(ids, PPL_WINDOW, count) if len(ids) >= PPL_WINDOW else None


def perplexity(model, windows: np.ndarray) -> float:
  """Held-out perplexity of `windows` (`jax_moeq.models.perplexity`, as benchmarks/quality.py)."""
  from jax_moeq.models.perplexity import perplexity as from_nll, window_nll
  return from_nll(window_nll(model, windows), windows.shape[1])


def decode_rows(tokenizer, runs: Mapping[str, Any]) -> dict[str, list[str]]:
  """Each model's generated tokens as text, each row cut at its own length (EOS)."""
  return {name: [tokenizer.decode(row[:n].tolist())
                 for row, n in zip(r["tokens"], r["num_tokens"])] for name, r in runs.items()}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", help="a checkpoint directory (default: the trained model shipped in "
                 f"{SHIPPED_MODEL.parent.name}/{SHIPPED_MODEL.name})")
  p.add_argument("--random", action="store_true",
                 help="write a Qwen3-MoE checkpoint with random weights (--layers ...) and run it")
  p.add_argument("--out", help="with --random: where to write the checkpoint (default: a "
                 "temporary directory, removed at the end)")
  p.add_argument("--prompt", action="append",
                 help=f"text to continue (repeatable; default: {list(DEFAULT_PROMPTS)}); needs "
                 "the checkpoint's tokenizer.json")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="0: greedy (the default); else sampling with top-p 0.9, seeded")
  p.add_argument("--ppl-windows", type=int, default=16,
                 help="windows of 256 held-out tokens for the perplexity (0: none)")
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
  p.add_argument("--batch", type=int, default=1, help="rows of random prompt ids (no tokenizer)")
  p.add_argument("--prompt-len", type=int, default=16, help="length of random prompt ids")
  p.add_argument("--max-new-tokens", type=int, default=48)
  p.add_argument("--repeats", type=int, default=3,
                 help="timed generate calls per model, alternating between the models")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                 help="skip the llama.cpp comparison even where llama-cpp-python is installed")
  args = p.parse_args(argv)
  if args.random and args.model:
    p.error("--random writes its own checkpoint: leave out --model")
  if args.out and not args.random:
    p.error("--out is where --random writes its checkpoint: add --random")
  return args


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
  tokenizer = load_tokenizer(path)
  if args.prompt and tokenizer is None:
    raise SystemExit(f"--prompt needs {path / 'tokenizer.json'} and the `tokenizers` package")
  texts = list(args.prompt or DEFAULT_PROMPTS) if tokenizer is not None else None
  if texts is not None:
    prompts: Any = [tokenizer.encode(t).ids for t in texts]
    if min(map(len, prompts)) == 0:
      raise SystemExit("--prompt: an empty prompt has no tokens to continue")
    logit_rows = np.asarray([prompts[0]], np.int32)
  else:
    prompts = np.random.default_rng(args.seed).integers(
        0, cfg.vocab_size, (args.batch, args.prompt_len), dtype=np.int32)
    logit_rows = prompts
  # Rates on the first prompt alone when the prompts are texts (batch 1, as llama.cpp's line);
  # the continuations of every prompt from one more call per model.
  runs = timed_generate(named, prompts[:1] if texts is not None else prompts,
                        args.max_new_tokens, args.repeats, args.temperature)
  text_runs = timed_generate(named, prompts, args.max_new_tokens, 0,
                             args.temperature) if texts is not None else runs
  reference_logits = prompt_logits(float_model, logit_rows)
  agreement = {name: logit_agreement(prompt_logits(named[name], logit_rows), reference_logits)
               for name in VARIANTS if name != "float"}
  same_prefix = {name: common_prefix(text_runs[name]["tokens"], text_runs["float"]["tokens"])
                 for name in agreement}
  windows = held_out_windows(path, tokenizer, args.ppl_windows)
  ppl = {name: perplexity(m, windows) for name, m in named.items()} if windows is not None else {}
  backends = {}
  for model in named.values():
    backends.update(model.moe_backends())
  linear_backends = named["all_int4"].linear_backends()
  threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  first_prompt = np.asarray(prompts[0], np.int32)
  llama = llama_cpp_rates(path, first_prompt, args.max_new_tokens, args.repeats,
                          threads) if args.llama_cpp else None
  print(f"model: {path.name}: {cfg.model_type}, {cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_experts} experts (top-{cfg.top_k}, "
        f"{cfg.moe_intermediate_size} wide), vocab {cfg.vocab_size}, {float_model.dtype} on "
        f"{jax.default_backend()} ({jax.device_count()} device)")
  print("loaded in " + ", ".join(f"{load_s:.1f} s ({name})" for name, (_, load_s)
                                 in loaded.items())
        + f"; MoE backends: {backends}; linear backends (all_int4): {linear_backends}")
  mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-p 0.9"
  batch, prompt_tokens = _prompt_tokens(prompts[:1] if texts is not None else prompts)
  decoded = None
  if texts is not None:
    decoded = decode_rows(tokenizer, text_runs)
    for row, text in enumerate(texts):
      print(f"\nprompt: {text!r}")
      for name in VARIANTS:
        print(f"  {name:9s} {text + decoded[name][row]!r}")
    print()
  print(f"batch {batch}, {prompt_tokens} prompt tokens, up to {args.max_new_tokens} new tokens "
        f"({mode}), best of {args.repeats} alternating calls after compiling")
  for name, r in runs.items():
    print(f"  {name:9s}  decode tok/s {r['decode_tok_s']:8.1f}   prefill tok/s "
          f"{r['prefill_tok_s']:8.1f}   compile {r['compile_s']:.1f} s")
  if llama is not None:
    print(f"  {'llama.cpp':9s}  decode tok/s {llama['decode_tok_s']:8.1f}   prompt tok/s "
          f"{llama['prefill_tok_s']:8.1f}   (Q4_0 GGUF, every linear Q4_0, the first prompt, "
          f"{threads} threads)")
  f = runs["float"]
  speedups = {name: runs[name]["decode_tok_s"] / f["decode_tok_s"] for name in agreement}
  for name in agreement:
    q, a = runs[name], agreement[name]
    print(f"{name}: decode speed-up over float {speedups[name]:.2f}x, prefill "
          f"{q['prefill_tok_s'] / f['prefill_tok_s']:.2f}x; logits on the first prompt vs float: "
          f"relative Frobenius difference {a['rel_frobenius']:.3f}, argmax agreement "
          f"{a['argmax_agreement']:.1%}; generated tokens equal for the first "
          f"{same_prefix[name]:.1f} of {args.max_new_tokens} (mean over prompts)")
  if ppl:
    print(f"held-out perplexity ({windows.shape[0]} windows of {PPL_WINDOW} tokens of "
          f"heldout.txt): float {ppl['float']:.2f}; "
          + "; ".join(f"{name} {ppl[name]:.2f} ({ppl[name] - ppl['float']:+.2f}, "
                      f"{ppl[name] / ppl['float'] - 1:+.2%})" for name in agreement))
  if llama is not None and batch == 1:
    print(f"all_int4 decode over llama.cpp Q4_0: "
          f"{runs['all_int4']['decode_tok_s'] / llama['decode_tok_s']:.2f}x")
  return {**runs, "speedup": speedups, "backends": backends, "linear_backends": linear_backends,
          "same_prefix": same_prefix, "agreement": agreement, "llama_cpp": llama,
          "texts": decoded, "prompts": texts, "perplexity": ppl,
          "load_s": {name: load_s for name, (_, load_s) in loaded.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = _parse_args(argv)
  if not args.random:
    return run(Path(args.model) if args.model else SHIPPED_MODEL, args)
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
