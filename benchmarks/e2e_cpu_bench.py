"""Whole-model CPU tokens/s: jax_moeq against llama.cpp on the same Qwen3-30B-A3B-shaped weights.

The model: Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top-8, moe_intermediate 768, 32 heads,
4 kv heads, head_dim 128, vocab 151936, RMSNorm eps 1e-6, rope_theta 1e6, norm_topk_prob) with
`--layers` layers (4 by default; the full model has 48) and random bf16 weights (std 0.02, norms
1 + 0.02·N(0,1)) drawn layer by layer from `--seed`. It is written once as a Hugging Face
checkpoint (one safetensors shard per layer plus `model.safetensors.index.json`) under
`--workdir`, reused when the config and seed match, and converted to GGUF with
`jax_moeq.models.gguf.write_gguf` for llama.cpp (`llama-cpp-python`).

Variants (`--variants`, comma-separated):
  llama.cpp:Q4_0     llama.cpp's quantizer (`llama_model_quantize`, as `llama-quantize` does) from
  llama.cpp:Q4_K_M   the bf16 GGUF; its per-tensor mix (the LM head in Q6_K, ...) printed
  jax:w4a8           experts int4 on the CPU W4A8 kernel, every linear float (`quantization=
                     "w4a8_int8"`)
  jax:w4a8+head4     the same with the LM head int4 (`lm_head_quantization="int4"`)
  jax:int4           every linear int4 too (`quantize_linears=True`), LM head float
  jax:int4+head4     every linear and the LM head int4
A variant that this jax_moeq cannot build (a keyword it lacks) is reported as skipped.

Timing: every (round, variant) runs in its own subprocess, pinned to the same `--threads` cores
(`os.sched_setaffinity`; XLA's intra-op pool sized by PJRT_NPROC, llama.cpp's `n_threads` and
`n_threads_batch`), the variants alternating over `--repeats` rounds. Each subprocess loads the
model, warms up (compilation, llama.cpp's first evals) and then times, once:
- prompt processing: `--prompt-tokens` (512) random ids, tokens/s (jax_moeq: `models.generate`'s
  prefill seconds, the LM head at the last position only; llama.cpp: `Llama.eval` of the prompt,
  logits of the last position only, `logits_all=False`);
- batch-1 decode: `--decode-tokens` (128) steps after the prompt (jax_moeq: `generate`'s decode
  loop, greedy, EOS off; llama.cpp: 128 single-token `Llama.eval` calls of fixed ids, no sampler).
The median over rounds is printed, with the best. Beside it: the weight bytes a decode step reads
(top-k/E of each layer's experts, the other weights whole, one embedding row; the KV cache, under
1 % here, is left out) and that volume over the DRAM read bandwidth measured in this run on the
same cores (`_timing.read_bandwidth_gbps`), as % of the roofline. Models that fit in the
last-level cache (`--quick`) read faster than DRAM: their % is no roofline figure.

Disk and memory: the checkpoint is ~1.23 GB per layer plus 1.25 GB (48 layers: 60 GB); each
llama.cpp-quantized GGUF is written from a temporary BF16 GGUF of the same size (deleted after);
Q4_0 / Q4_K_M files are ~0.3 GB per layer. No process holds the float model: the checkpoint is
written and converted a layer at a time, and jax_moeq quantizes while loading.

Cross-check (`--cross-check-layers`, 2 by default, 0 skips): a 2-layer checkpoint of the same
shapes; the logits of a short prompt from llama.cpp (an F32 GGUF, F32 KV cache) against
jax_moeq's float32 model, and from a Q4_0 GGUF (every linear Q4_0, gguf package) against
jax_moeq's whole-int4 model (else its int4-experts model) and against the float model: relative
Frobenius difference at the first token and over the prompt, and top-1 agreement. Float against
F32 should agree to ~1e-5; a large difference is a bug in one of the two.

    python benchmarks/e2e_cpu_bench.py --quick                      # smoke, tiny model
    python benchmarks/e2e_cpu_bench.py --layers 4 --threads 2 --json e2e4.json
    python benchmarks/e2e_cpu_bench.py --layers 48 --threads 16 --repeats 3 --json e2e48.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()

LLAMA_VARIANTS = {"llama.cpp:Q4_0": "Q4_0", "llama.cpp:Q4_K_M": "Q4_K_M"}
# variant -> from_pretrained keywords beyond quantization="w4a8_int8"
JAX_VARIANTS: dict[str, dict[str, Any]] = {
    "jax:w4a8": {},
    "jax:w4a8+head4": {"lm_head_quantization": "int4"},
    "jax:int4": {"quantize_linears": True},
    "jax:int4+head4": {"quantize_linears": True, "lm_head_quantization": "int4"},
}
VARIANTS = list(LLAMA_VARIANTS) + list(JAX_VARIANTS)
RESULT_TAG = "E2E_RESULT "


# ------------------------------------------------------------------ the model
def model_config(args: argparse.Namespace) -> dict[str, Any]:
  """A qwen3_moe `config.json` (no EOS: decoding never stops early)."""
  return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
          "hidden_size": args.hidden, "num_hidden_layers": args.layers,
          "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
          "head_dim": args.head_dim, "vocab_size": args.vocab, "num_experts": args.experts,
          "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_intermediate,
          "intermediate_size": 6144, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
          "rope_theta": 1e6, "hidden_act": "silu", "decoder_sparse_step": 1,
          "mlp_only_layers": [], "tie_word_embeddings": False, "max_position_embeddings": 40960,
          "attention_bias": False, "use_sliding_window": False, "dtype": "bfloat16",
          "torch_dtype": "bfloat16"}


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float = 0.02,
          mean: float = 0.0) -> np.ndarray:
  import ml_dtypes
  return (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)


def _layer_tensors(cfg: dict[str, Any], index: int, seed: int) -> dict[str, np.ndarray]:
  """Layer `index`'s tensors, from its own stream of `seed` (layers are independent)."""
  rng = np.random.default_rng([seed, index + 1])
  h, e, i = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
  nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
  p = f"model.layers.{index}."
  out = {
      p + "input_layernorm.weight": _bf16(rng, (h,), mean=1.0),
      p + "post_attention_layernorm.weight": _bf16(rng, (h,), mean=1.0),
      p + "self_attn.q_proj.weight": _bf16(rng, (nh * d, h)),
      p + "self_attn.k_proj.weight": _bf16(rng, (nkv * d, h)),
      p + "self_attn.v_proj.weight": _bf16(rng, (nkv * d, h)),
      p + "self_attn.o_proj.weight": _bf16(rng, (h, nh * d)),
      p + "self_attn.q_norm.weight": _bf16(rng, (d,), mean=1.0),
      p + "self_attn.k_norm.weight": _bf16(rng, (d,), mean=1.0),
      p + "mlp.gate.weight": _bf16(rng, (e, h)),
  }
  for x in range(e):
    q = f"{p}mlp.experts.{x}."
    out[q + "gate_proj.weight"] = _bf16(rng, (i, h))
    out[q + "up_proj.weight"] = _bf16(rng, (i, h))
    out[q + "down_proj.weight"] = _bf16(rng, (h, i))
  return out


def _outer_tensors(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng([seed, 0])
  h, v = cfg["hidden_size"], cfg["vocab_size"]
  return {"model.embed_tokens.weight": _bf16(rng, (v, h)),
          "model.norm.weight": _bf16(rng, (h,), mean=1.0),
          "lm_head.weight": _bf16(rng, (v, h))}


def checkpoint_dir(workdir: Path, cfg: dict[str, Any], seed: int) -> Path:
  key = hashlib.sha256(json.dumps([cfg, seed], sort_keys=True).encode()).hexdigest()[:12]
  return workdir / f"qwen3moe_l{cfg['num_hidden_layers']}_h{cfg['hidden_size']}_s{seed}_{key}"


def build_checkpoint(workdir: Path, cfg: dict[str, Any], seed: int) -> Path:
  """Writes the checkpoint layer by layer (one shard each), or reuses a complete one."""
  import safetensors.numpy
  path = checkpoint_dir(workdir, cfg, seed)
  done = path / "complete.json"
  if done.exists() and json.loads(done.read_text()) == {"config": cfg, "seed": seed}:
    return path
  path.mkdir(parents=True, exist_ok=True)
  n = cfg["num_hidden_layers"]
  shards = [f"model-{k + 1:05d}-of-{n + 1:05d}.safetensors" for k in range(n + 1)]
  weight_map: dict[str, str] = {}
  total = 0
  for k in range(n + 1):
    start = time.perf_counter()
    tensors = _layer_tensors(cfg, k, seed) if k < n else _outer_tensors(cfg, seed)
    safetensors.numpy.save_file(tensors, str(path / shards[k]), metadata={"format": "pt"})
    weight_map.update({name: shards[k] for name in tensors})
    total += sum(t.nbytes for t in tensors.values())
    del tensors
    _timing.progress(f"checkpoint: {'layer ' + str(k) if k < n else 'embedding/head'} written "
                     f"({time.perf_counter() - start:.1f} s)")
  (path / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
  (path / "config.json").write_text(json.dumps(cfg, indent=1))
  done.write_text(json.dumps({"config": cfg, "seed": seed}))
  return path


def build_gguf(ckpt: Path, qtype: str, quantizer: str, threads: int) -> tuple[Path, dict[str, str]]:
  """The checkpoint's GGUF in `qtype` (reused when complete); (path, tensor types)."""
  from jax_moeq.models import gguf
  out = ckpt / f"model-{qtype}-{quantizer.replace('.', '')}.gguf"
  done = out.with_suffix(".types.json")
  if out.exists() and done.exists():
    return out, json.loads(done.read_text())
  start = time.perf_counter()
  result = gguf.write_gguf(ckpt, out, qtype=qtype, quantizer=quantizer, threads=threads,
                           progress=_timing.progress)
  done.write_text(json.dumps(result.tensor_types))
  _timing.progress(f"{out.name} written in {time.perf_counter() - start:.1f} s: "
                   f"{result.type_counts()}")
  return out, result.tensor_types


# ------------------------------------------------------------------ decode bytes
def gguf_decode_bytes(path: Path, cfg: dict[str, Any]) -> dict[str, float]:
  """Weight bytes of a llama.cpp decode step: top-k/E of the expert stacks, the rest whole, one
  embedding row."""
  from jax_moeq.models import gguf as gguf_lib
  reader = gguf_lib._gguf().GGUFReader(str(path))
  frac = cfg["num_experts_per_tok"] / cfg["num_experts"]
  out = {"experts": 0.0, "lm_head": 0.0, "other": 0.0}
  for t in reader.tensors:
    nbytes = float(t.n_bytes)
    if "_exps." in t.name:
      out["experts"] += nbytes * frac
    elif t.name == "output.weight":
      out["lm_head"] += nbytes
    elif t.name == "token_embd.weight":
      out["other"] += nbytes / cfg["vocab_size"]
    else:
      out["other"] += nbytes
  out["total"] = sum(out.values())
  return out


def jax_decode_bytes(model) -> dict[str, float]:
  """Weight bytes of a jax_moeq decode step at batch 1 (`model_bench.decode_bytes`)."""
  import model_bench
  return model_bench.decode_bytes(model, 1)


# ------------------------------------------------------------------ workers
def _pin(spec: dict[str, Any]) -> None:
  """Same cores and thread count for every engine; before JAX or llama.cpp start."""
  os.environ["PJRT_NPROC"] = str(spec["threads"])
  if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, spec["cores"])


def _prompt(spec: dict[str, Any], n: int, salt: int = 0) -> np.ndarray:
  rng = np.random.default_rng([spec["seed"], 1000 + salt])
  return rng.integers(0, spec["vocab"], n, dtype=np.int64)


def _jax_model(ckpt: str, kwargs: dict[str, Any], dtype: str):
  """from_pretrained with `kwargs`, or (None, why) when this jax_moeq lacks one of them."""
  import inspect
  from jax_moeq import models
  accepted = inspect.signature(models.from_pretrained).parameters
  missing = [k for k in kwargs if k not in accepted]
  if missing:
    return None, (f"models.from_pretrained has no {missing} keyword(s) in this jax_moeq: the "
                  "int4 dense linears are not available")
  try:
    return models.from_pretrained(ckpt, dtype=dtype, show_progress=False, **kwargs), None
  except (ValueError, NotImplementedError) as e:
    return None, f"from_pretrained({kwargs}) refused: {e}"


def worker_jax(spec: dict[str, Any]) -> dict[str, Any]:
  _pin(spec)
  import jax  # noqa: F401  (after pinning)
  from jax_moeq import models
  kwargs = dict(quantization="w4a8_int8", **JAX_VARIANTS[spec["variant"]])
  start = time.perf_counter()
  model, why = _jax_model(spec["ckpt"], kwargs, spec["dtype"])
  if model is None:
    return {"skipped": why}
  load_s = time.perf_counter() - start
  prompt = _prompt(spec, spec["prompt_tokens"])[None].astype(np.int32)
  steps = spec["decode_tokens"]

  def once():
    out = models.generate(model, prompt, max_new_tokens=steps + 1, eos_token_id=[])
    decoded = int(np.asarray(out.num_tokens).min()) - 1
    if decoded != steps:
      raise RuntimeError(f"generate stopped after {decoded} of {steps} decode steps")
    return out

  warm = once()  # compiles
  out = once()
  return {"load_s": load_s, "compile_s": warm.compile_seconds,
          "prefill_s": out.prefill_seconds, "decode_s": out.decode_seconds,
          "backends": model.moe_backends(), "decode_bytes": jax_decode_bytes(model)}


def _llama(path: str, spec: dict[str, Any], n_ctx: int, **kw):
  from llama_cpp import Llama
  return Llama(model_path=path, n_ctx=n_ctx, n_batch=max(512, spec.get("prompt_tokens", 0)),
               n_ubatch=512, n_threads=spec["threads"], n_threads_batch=spec["threads"],
               flash_attn=spec.get("flash_attn", False), verbose=False, **kw)


def worker_llama(spec: dict[str, Any]) -> dict[str, Any]:
  _pin(spec)
  try:
    import llama_cpp  # noqa: F401
  except ImportError:
    return {"skipped": "llama_cpp is not importable (pip install 'llama-cpp-python>=0.3')"}
  p, steps = spec["prompt_tokens"], spec["decode_tokens"]
  start = time.perf_counter()
  llm = _llama(spec["gguf"], spec, p + steps + 16, logits_all=False)
  load_s = time.perf_counter() - start
  prompt = [int(t) for t in _prompt(spec, p)]
  follow = [int(t) for t in _prompt(spec, steps, salt=1)]
  start = time.perf_counter()
  llm.eval(prompt)  # warm-up: buffers, repacked weights, thread pool
  for t in follow[:4]:
    llm.eval([t])
  warm_s = time.perf_counter() - start
  llm.reset()
  t0 = time.perf_counter()
  llm.eval(prompt)
  t1 = time.perf_counter()
  for t in follow:
    llm.eval([t])
  t2 = time.perf_counter()
  return {"load_s": load_s, "compile_s": warm_s, "prefill_s": t1 - t0, "decode_s": t2 - t1,
          "backends": {"llama.cpp": spec["qtype"]},
          "decode_bytes": gguf_decode_bytes(Path(spec["gguf"]), spec["config"])}


def worker_xcheck_llama(spec: dict[str, Any]) -> dict[str, Any]:
  """Logits [S, V] of the cross-check prompt from each GGUF (F32 KV cache), saved as .npy."""
  _pin(spec)
  import llama_cpp
  prompt = [int(t) for t in _prompt(spec, spec["xcheck_tokens"], salt=2)]
  saved = {}
  for name, path in spec["ggufs"].items():
    llm = _llama(path, spec, len(prompt) + 8, logits_all=True,
                 type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(prompt)
    out = Path(spec["out_dir"]) / f"xcheck_llama_{name}.npy"
    np.save(out, np.array(llm.scores[:len(prompt)], np.float32))
    saved[name] = str(out)
    del llm
  return {"saved": saved}


def worker_xcheck_jax(spec: dict[str, Any]) -> dict[str, Any]:
  """Logits [S, V] of the cross-check prompt from the float32 model and the int4 models."""
  _pin(spec)
  import jax
  import jax.numpy as jnp
  from jax_moeq import models
  prompt = jnp.asarray(_prompt(spec, spec["xcheck_tokens"], salt=2)[None], jnp.int32)
  saved, notes = {}, {}
  for name, kwargs in (("float", {}),
                       ("int4", dict(quantization="w4a8_int8", quantize_linears=True,
                                     lm_head_quantization="int4")),
                       ("w4a8", dict(quantization="w4a8_int8"))):
    if name == "w4a8" and "int4" in saved:
      continue  # the int4-experts model only stands in for a missing whole-int4 one
    model, why = _jax_model(spec["ckpt"], kwargs, "float32")
    if model is None:
      notes[name] = why
      continue
    with jax.default_matmul_precision("float32"):
      logits = np.asarray(jax.jit(lambda m, i: m(i))(model, prompt))[0]
    out = Path(spec["out_dir"]) / f"xcheck_jax_{name}.npy"
    np.save(out, logits.astype(np.float32))
    saved[name] = str(out)
    del model
  return {"saved": saved, "notes": notes}


WORKERS = {"jax": worker_jax, "llama": worker_llama, "xcheck_llama": worker_xcheck_llama,
           "xcheck_jax": worker_xcheck_jax}


def run_worker(spec: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
  """Runs `spec` in a fresh interpreter; its result, or {"error": ...}."""
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout} s"}
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(RESULT_TAG):
      return json.loads(line[len(RESULT_TAG):])
  tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
  return {"error": f"exit code {proc.returncode}: " + " | ".join(tail)}


# ------------------------------------------------------------------ the comparison
def _rel(got: np.ndarray, want: np.ndarray) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def compare_logits(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
  """a against b ([S, V]): relative difference at the first token and overall, top-1 agreement."""
  return {"rel_first": _rel(a[0], b[0]), "rel_all": _rel(a, b),
          "top1_first": bool(a[0].argmax() == b[0].argmax()),
          "top1_agree": float(np.mean(a.argmax(-1) == b.argmax(-1)))}


def cross_check(args: argparse.Namespace, cores: list[int]) -> dict[str, Any]:
  cfg = dict(model_config(args), num_hidden_layers=args.cross_check_layers)
  ckpt = build_checkpoint(Path(args.workdir), cfg, args.seed)
  ggufs = {q: str(build_gguf(ckpt, q, "gguf", args.threads)[0]) for q in ("F32", "Q4_0")}
  base = dict(seed=args.seed, vocab=args.vocab, threads=args.threads, cores=cores,
              xcheck_tokens=args.cross_check_tokens, out_dir=str(ckpt), ckpt=str(ckpt))
  _timing.progress(f"cross-check: llama.cpp logits ({args.cross_check_layers} layers)")
  lres = run_worker(dict(base, worker="xcheck_llama", ggufs=ggufs))
  _timing.progress("cross-check: jax_moeq logits")
  jres = run_worker(dict(base, worker="xcheck_jax"))
  for res in (lres, jres):
    if "error" in res or "skipped" in res:
      return {"error": res.get("error") or res.get("skipped")}
  ll = {k: np.load(v) for k, v in lres["saved"].items()}
  jj = {k: np.load(v) for k, v in jres["saved"].items()}
  out: dict[str, Any] = {"layers": args.cross_check_layers, "tokens": args.cross_check_tokens,
                         "notes": jres.get("notes", {})}
  out["llama_F32_vs_jax_float"] = compare_logits(ll["F32"], jj["float"])
  int4 = "int4" if "int4" in jj else "w4a8"
  out["jax_int4_model"] = int4
  out["llama_Q4_0_vs_jax_" + int4] = compare_logits(ll["Q4_0"], jj[int4])
  out["llama_Q4_0_vs_jax_float"] = compare_logits(ll["Q4_0"], jj["float"])
  out[f"jax_{int4}_vs_jax_float"] = compare_logits(jj[int4], jj["float"])
  return out


def summarize(name: str, runs: list[dict[str, Any]], args: argparse.Namespace,
              bandwidth: float) -> dict[str, Any]:
  good = [r for r in runs if "prefill_s" in r]
  if not good:
    bad = runs[0] if runs else {}
    return {"variant": name, "skipped": bad.get("skipped") or bad.get("error") or "no runs"}
  prefill = [args.prompt_tokens / r["prefill_s"] for r in good]
  decode = [args.decode_tokens / r["decode_s"] for r in good]
  nbytes = good[0]["decode_bytes"]
  step_s = 1.0 / statistics.median(decode)
  floor_s = nbytes["total"] / (bandwidth * 1e9)
  return {"variant": name, "rounds": len(good),
          "prefill_tok_s": statistics.median(prefill), "prefill_tok_s_best": max(prefill),
          "decode_tok_s": statistics.median(decode), "decode_tok_s_best": max(decode),
          "decode_step_ms": 1e3 * step_s,
          "decode_read_mb": {k: v / 1e6 for k, v in nbytes.items()},
          "dram_roofline_pct": 100.0 * floor_s / step_s,
          "load_s": statistics.median(r["load_s"] for r in good),
          "warmup_s": statistics.median(r["compile_s"] for r in good),
          "backends": good[0]["backends"]}


def _fmt(v: float) -> str:
  return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def print_table(rows: list[dict[str, Any]], machine: str) -> None:
  header = ["variant", "prompt tok/s (best)", "decode tok/s (best)", "step ms",
            "read MB/step (experts/head/other)", "% DRAM roofline", "kernels"]
  table = []
  for r in rows:
    if "skipped" in r:
      table.append([r["variant"], None, None, None, None, None, f"skipped: {r['skipped']}"])
      continue
    mb = r["decode_read_mb"]
    table.append([r["variant"], f"{_fmt(r['prefill_tok_s'])} ({_fmt(r['prefill_tok_s_best'])})",
                  f"{_fmt(r['decode_tok_s'])} ({_fmt(r['decode_tok_s_best'])})",
                  _fmt(r["decode_step_ms"]),
                  "/".join(_fmt(mb[k]) for k in ("experts", "lm_head", "other")),
                  f"{r['dram_roofline_pct']:.0f}%",
                  ", ".join(f"{k}: {v}" for k, v in r["backends"].items())])
  print(_timing.markdown_table(header, table))
  print(f"[{machine}]")


def print_cross_check(xc: dict[str, Any]) -> None:
  if "error" in xc:
    print(f"cross-check failed: {xc['error']}")
    return
  print(f"cross-check ({xc['layers']} layers, {xc['tokens']}-token prompt, logits of every "
        "position; rel = relative Frobenius difference):")
  for key, v in xc.items():
    if isinstance(v, dict) and "rel_all" in v:
      print(f"  {key}: rel first token {v['rel_first']:.2e}, rel all {v['rel_all']:.2e}, top-1 "
            f"first token {'same' if v['top1_first'] else 'DIFFERENT'}, top-1 agreement "
            f"{v['top1_agree']:.0%}")
  for key, note in xc.get("notes", {}).items():
    print(f"  note ({key}): {note}")


# ------------------------------------------------------------------ main
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=4, help="decoder layers (the full model has 48)")
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"comma-separated of {VARIANTS}, or none (the cross-check alone)")
  p.add_argument("--threads", type=int, default=None, help="threads and cores for every engine "
                 "(default: all usable cores)")
  p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every variant once")
  p.add_argument("--prompt-tokens", type=int, default=512)
  p.add_argument("--decode-tokens", type=int, default=128)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="jax_moeq activations and float weights (float32: XLA's fast CPU path)")
  p.add_argument("--llama-flash-attn", action="store_true",
                 help="llama.cpp's flash attention (off: llama-cpp-python's default)")
  p.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                   "jax_moeq_e2e"))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--cross-check-layers", type=int, default=2, help="0 skips the cross-check")
  p.add_argument("--cross-check-tokens", type=int, default=8)
  p.add_argument("--quick", action="store_true",
                 help="smoke run: tiny model (hidden 256, 16 experts top-4, vocab 2048, 2 "
                      "layers), prompt 64, 16 decode tokens, 1 round, three variants unless "
                      "--variants names others; its figures sit in cache, not DRAM")
  p.add_argument("--json", default=None, help="write the machine, config and rows here")
  for name, default in (("hidden", 2048), ("experts", 128), ("top-k", 8),
                        ("moe-intermediate", 768), ("heads", 32), ("kv-heads", 4),
                        ("head-dim", 128), ("vocab", 151936)):
    p.add_argument(f"--{name}", type=int, default=default)
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.quick:
    if args.variants == ",".join(VARIANTS):
      args.variants = "llama.cpp:Q4_0,jax:w4a8,jax:int4+head4"
    args.layers, args.hidden, args.experts, args.top_k = 2, 256, 16, 4
    args.moe_intermediate, args.heads, args.kv_heads, args.head_dim = 128, 4, 2, 64
    args.vocab, args.prompt_tokens, args.decode_tokens, args.repeats = 2048, 64, 16, 1
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = _parse_args(argv)
  if args.worker is not None:
    spec = json.loads(args.worker)
    print(RESULT_TAG + json.dumps(WORKERS[spec["worker"]](spec)), flush=True)
    return {}
  names = [] if args.variants == "none" else args.variants.split(",")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
  usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  args.threads = args.threads or len(usable) or os.cpu_count() or 1
  if usable and args.threads > len(usable):
    raise SystemExit(f"--threads {args.threads} exceeds the {len(usable)} usable cores")
  cores = usable[:args.threads]
  if cores:
    os.sched_setaffinity(0, cores)  # the bandwidth probe and the GGUF quantizer on those cores
  info = _timing.machine_info()
  machine = _timing.machine_line(info)
  _timing.progress("measuring DRAM read bandwidth")
  # 1 GiB, 8x the largest LLC here; the quick smoke run probes less.
  bw = _timing.read_bandwidth_gbps(nbytes=(256 << 20) if args.quick else (1 << 30),
                                   threads=args.threads, repeats=3 if args.quick else 5)
  cfg = model_config(args)
  print(f"machine: {machine}; DRAM read {bw['best']:.1f} GB/s ({args.threads} threads, "
        f"cores {cores}); jax {info['jax']}")
  print(f"model: Qwen3-30B-A3B shapes, {args.layers} layers, hidden {args.hidden}, "
        f"{args.experts} experts top-{args.top_k} x {args.moe_intermediate}, vocab {args.vocab}, "
        f"bf16 random weights (seed {args.seed}); prompt {args.prompt_tokens} tokens, "
        f"{args.decode_tokens} decode tokens, batch 1, {args.repeats} rounds; jax_moeq "
        f"{args.dtype}")
  llama_info = _llama_cpp_info()
  if llama_info and any(n in LLAMA_VARIANTS for n in names):
    print(f"llama.cpp: llama-cpp-python {llama_info['version']}, "
          f"{llama_info['system_info']}; flash attention "
          f"{'on' if args.llama_flash_attn else 'off'}")
  ckpt = build_checkpoint(Path(args.workdir), cfg, args.seed)
  base = dict(seed=args.seed, vocab=args.vocab, threads=args.threads, cores=cores,
              prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
              dtype=args.dtype, ckpt=str(ckpt), config=cfg, flash_attn=args.llama_flash_attn)
  specs: dict[str, dict[str, Any]] = {}
  gguf_types: dict[str, dict[str, str]] = {}
  for name in names:
    if name in LLAMA_VARIANTS:
      qtype = LLAMA_VARIANTS[name]
      try:
        path, types = build_gguf(ckpt, qtype, "llama.cpp", args.threads)
      except ImportError as e:
        specs[name] = {"skip": str(e)}
        continue
      gguf_types[name] = types
      specs[name] = dict(base, worker="llama", variant=name, qtype=qtype, gguf=str(path))
      head = types.get("output.weight", types["token_embd.weight"])
      print(f"{name}: {path.name}, LM head {head}, token_embd {types['token_embd.weight']}, "
            f"tensor types {_count(types)}")
    else:
      specs[name] = dict(base, worker="jax", variant=name)
  runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
  for rnd in range(args.repeats):
    for name in names:
      if "skip" in specs[name]:
        runs[name] = [{"skipped": specs[name]["skip"]}]
        continue
      if runs[name] and "skipped" in runs[name][0]:
        continue
      res = run_worker(specs[name])
      runs[name].append(res)
      if "prefill_s" in res:
        _timing.progress(f"round {rnd + 1}/{args.repeats} {name}: prompt "
                         f"{args.prompt_tokens / res['prefill_s']:.1f} tok/s, decode "
                         f"{args.decode_tokens / res['decode_s']:.2f} tok/s")
      else:
        _timing.progress(f"round {rnd + 1}/{args.repeats} {name}: "
                         f"{res.get('skipped') or res.get('error')}")
  rows = [summarize(n, runs[n], args, bw["best"]) for n in names]
  if rows:
    print_table(rows, machine)
  xc = None
  if args.cross_check_layers > 0:
    if args.quick:
      args.cross_check_layers = args.layers
    xc = cross_check(args, cores)
    print_cross_check(xc)
  result = {"machine": info, "machine_line": machine, "bandwidth_gbps": bw, "config": cfg,
            "threads": args.threads, "cores": cores, "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens, "repeats": args.repeats,
            "llama_cpp": llama_info, "llama_flash_attn": args.llama_flash_attn, "jax_dtype": args.dtype, "rows": rows,
            "gguf_tensor_types": {k: _count(v) for k, v in gguf_types.items()},
            "cross_check": xc}
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return result


def _llama_cpp_info() -> dict[str, str] | None:
  """llama-cpp-python's version and the ggml CPU features it was built with."""
  try:
    import llama_cpp
  except ImportError:
    return None
  return {"version": getattr(llama_cpp, "__version__", "?"),
          "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def _count(types: dict[str, str]) -> dict[str, int]:
  counts: dict[str, int] = {}
  for t in types.values():
    counts[t] = counts.get(t, 0) + 1
  return counts


if __name__ == "__main__":
  main(sys.argv[1:])
