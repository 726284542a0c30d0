"""Held-out perplexity of a trained MoE under every int4 scheme jax_moeq runs on the CPU.

The model is examples/tiny_qwen3_moe (examples/train_tiny_moe.py: a 4-layer, 16-expert
Qwen3-MoE trained on the Python standard library's documentation), and the text its held-out
split (`heldout.txt`: documents neither the tokenizer nor the model saw). The text is tokenized
with the checkpoint's `tokenizer.json` and cut into consecutive windows of `--window` tokens
(stride = window, no overlap); each window is scored on its own (every token after the first is
predicted from the window's earlier tokens), and the perplexity is exp of the mean negative
log-likelihood over all scored tokens.

Schemes, each loaded with `jax_moeq.models.from_pretrained` from the same bf16 checkpoint and run
with float32 activations:
- float: the checkpoint as stored;
- W4A8 (`quantization="w4a8_int8"`, the CPU W4A8 kernel: int4 experts, int8 activations per
  token) at groups 32, 64, 128 and channel-wise (-1);
- WNA16 (`"wna16"`, GPTQ-style round-to-nearest int4 weights, activations unquantized; the jnp
  reference backend on a CPU) at the same groups;
- MxInt4 (`"mxint4"`, int4 with bf16 scales per 32; the jnp reference on a CPU);
- every linear int4 (`quantization="w4a8_int8", quantize_linears=True,
  lm_head_quantization="int4"`: experts, attention, LM head; bf16 attention math) at groups 128
  and 32;
- where `llama_cpp` and `gguf` are importable: llama.cpp on a GGUF of the same weights
  (`jax_moeq.models.gguf.write_gguf`), F32 and Q4_0 (every linear Q4_0, the LM head too). The GGUF
  holds a synthetic vocabulary that keeps the token ids, so llama.cpp is fed ids, not text.

Each scheme's perplexity is shown relative to float (ratio and difference); llama.cpp Q4_0 also
relative to llama.cpp F32.

Run: python benchmarks/quality.py [--windows N] [--window 256] [--json out.json] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# The perplexity arithmetic is the library's (the README main job uses it too).
from jax_moeq.models.perplexity import (  # noqa: E402
    perplexity, token_windows as windows, window_nll,
)

CHECKPOINT = Path(__file__).resolve().parent.parent / "examples" / "tiny_qwen3_moe"

# name -> from_pretrained keywords
SCHEMES: dict[str, dict[str, Any]] = {
    "float": {},
    **{f"w4a8_int8 g{g}": {"quantization": "w4a8_int8", "group_size": g}
       for g in (32, 64, 128, -1)},
    **{f"wna16 g{g}": {"quantization": "wna16", "group_size": g} for g in (32, 64, 128, -1)},
    "mxint4 g32": {"quantization": "mxint4"},
    "all_int4 g128": {"quantization": "w4a8_int8", "group_size": 128, "quantize_linears": True,
                      "lm_head_quantization": "int4"},
    "all_int4 g32": {"quantization": "w4a8_int8", "group_size": 32, "quantize_linears": True,
                     "lm_head_quantization": "int4"},
}


def held_out_ids(checkpoint: Path = CHECKPOINT) -> np.ndarray:
  """The held-out text's token ids (int32), `<|endoftext|>` between documents."""
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
  text = (checkpoint / "heldout.txt").read_text(encoding="utf-8")
  return np.asarray(tok.encode(text).ids, np.int32)


def load(checkpoint: Path, **kw):
  import jax.numpy as jnp
  from jax_moeq import models
  return models.from_pretrained(checkpoint, dtype=jnp.float32, show_progress=False, **kw)


def llama_cpp_window_nll(checkpoint: Path, qtype: str, batches: np.ndarray,
                         threads: int) -> np.ndarray | None:
  """llama.cpp's summed NLL per window on a GGUF of the checkpoint, or None without llama_cpp."""
  import importlib.util
  if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
    return None
  from llama_cpp import Llama
  from jax_moeq.models.gguf import write_gguf
  window = batches.shape[1]
  with tempfile.TemporaryDirectory(prefix="gguf_") as tmp:
    path = Path(tmp) / f"model-{qtype}.gguf"
    write_gguf(checkpoint, path, qtype=qtype, quantizer="gguf")
    llm = Llama(model_path=str(path), n_ctx=window, n_batch=window, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    out = []
    for row in batches:
      llm.reset()
      llm.eval([int(t) for t in row])
      logits = np.asarray(llm.scores[:window - 1], np.float64)
      logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
      out.append(float((logz - logits[np.arange(window - 1), row[1:]]).sum()))
    del llm
  return np.asarray(out)


def machine() -> str:
  cpu = platform.processor() or "unknown CPU"
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return f"{cpu}, {cores} cores"


def run(checkpoint: Path, window: int, count: int | None, schemes: list[str],
        llama_cpp: bool) -> dict[str, Any]:
  ids = held_out_ids(checkpoint)
  batches = windows(ids, window, count)
  scored = batches.shape[0] * (window - 1)
  print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}; "
        f"{checkpoint.name}: {len(ids)} held-out tokens, {batches.shape[0]} windows of {window} "
        f"({scored} scored tokens)", flush=True)
  results: dict[str, dict[str, Any]] = {}
  for name in schemes:
    start = time.perf_counter()
    model = load(checkpoint, **SCHEMES[name])
    nll = window_nll(model, batches)
    results[name] = {"ppl": perplexity(nll, window), "nll": nll.tolist(),
                     "backends": {**model.moe_backends(), **{
                         f"linear {k}": v for k, v in model.linear_backends().items()}},
                     "seconds": time.perf_counter() - start}
    print(f"  {name:15s} ppl {results[name]['ppl']:8.3f}   ({results[name]['seconds']:.0f} s, "
          f"{results[name]['backends']})", flush=True)
    del model
  if llama_cpp:
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    for qtype in ("F32", "Q4_0"):
      start = time.perf_counter()
      nll = llama_cpp_window_nll(checkpoint, qtype, batches, threads)
      if nll is None:
        print("  llama.cpp: llama_cpp or gguf not installed, skipped")
        break
      results[f"llama.cpp {qtype}"] = {"ppl": perplexity(nll, window), "nll": nll.tolist(),
                                       "seconds": time.perf_counter() - start}
      print(f"  llama.cpp {qtype:5s} ppl {results[f'llama.cpp {qtype}']['ppl']:8.3f}", flush=True)
  base = results["float"]["ppl"] if "float" in results else None
  print("\n| scheme | perplexity | ratio to float | difference |\n| --- | --- | --- | --- |")
  for name, r in results.items():
    ref = results.get("llama.cpp F32", {}).get("ppl") if name == "llama.cpp Q4_0" else base
    if ref is not None:
      r["ratio"], r["delta"] = r["ppl"] / ref, r["ppl"] - ref
      against = " (to llama.cpp F32)" if name == "llama.cpp Q4_0" else ""
      print(f"| {name} | {r['ppl']:.3f} | {r['ratio']:.4f}{against} | {r['delta']:+.3f} |")
  return {"machine": machine(), "date": f"{datetime.date.today()}", "window": window,
          "windows": int(batches.shape[0]), "scored_tokens": scored, "results": results}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--checkpoint", default=str(CHECKPOINT))
  p.add_argument("--window", type=int, default=256)
  p.add_argument("--windows", type=int, default=None, help="the first N windows (default: all)")
  p.add_argument("--schemes", default=",".join(SCHEMES),
                 help=f"comma-separated, of {list(SCHEMES)}")
  p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
  p.add_argument("--json", help="write the results here")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = _parse_args(argv)
  schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
  unknown = [s for s in schemes if s not in SCHEMES]
  if unknown:
    raise ValueError(f"--schemes: unknown {unknown}; known: {list(SCHEMES)}")
  out = run(Path(args.checkpoint), args.window, args.windows, schemes, args.llama_cpp)
  if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
