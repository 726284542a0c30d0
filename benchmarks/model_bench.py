"""End-to-end prefill and decode tok/s of a Qwen3-30B-A3B-shaped model: float vs int4 MoE blocks.

The model is `jax_moeq.models.from_config` with random weights (std 0.02) and Qwen3-30B-A3B's
shapes (hidden 2048, 128 experts, top-8, moe_intermediate 768, 32 heads, 4 kv heads, head_dim 128,
vocab 151936, RMSNorm eps 1e-6, rope_theta 1e6, norm_topk_prob) but only `--layers` layers (2 by
default; the full model has 48). Every variant is built in the same process and timed with
`models.generate` (greedy, compile excluded) in interleaved repeats; the median and the best of
the repeats are reported. Variants:

  float             the float MoE block with its automatic strategy (CPU default)
  float_ragged_dot  the float MoE block forced to `jax.lax.ragged_dot` (GPU default)
  w4a8_int8         experts quantized to int4 on load, the CPU W4A8 kernel (CPU default)
  wna16, mxint4     experts quantized to int4 on load, the GPU kernels (GPU defaults)

The `_all` variants quantize every other linear too (attention, dense MLPs, LM head:
`quantize_linears=True, lm_head_quantization="int4"`) and run them on the int4 linear op of the
platform (CPU W4A8, GPU WNA16). Each row gives the roofline beside its figures: the weight bytes
one decode step reads over the memory rate measured in the same run (the GPU's copy rate, the
CPU's DRAM read rate).

A `no_moe` row times the first variant's model with its MLP blocks swapped for zeros: the cost
of attention, norms, embedding and LM head (as the first variant holds them). Each variant's
decode step minus that floor is its MoE time per step, and the float step over the floor bounds
what int4 experts can gain end to end (at a few layers the LM head, 151936 x 2048, dominates).
Each row also gives the weight bytes a decode step reads (the experts its tokens route to, the
LM head, the rest) and the rate that makes.

Run: python benchmarks/model_bench.py [--layers 2] [--batch 1,16] [--json rows.json]
     JAX_PLATFORMS=cuda python benchmarks/model_bench.py --variants wna16,wna16_all --layers 48 \
         --batch 1:2048,64:128
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import sys
import time
from typing import Any, Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jax_moeq import models  # noqa: E402

# variant -> (quantization on load, float MoE implementation, every linear int4 as well)
VARIANTS: dict[str, tuple[str | None, str, bool]] = {
    "float": (None, "auto", False),
    "float_ragged_dot": (None, "ragged_dot", False),
    "w4a8_int8": ("w4a8_int8", "auto", False),
    "wna16": ("wna16", "auto", False),
    "mxint4": ("mxint4", "auto", False),
    # Attention, dense MLPs and the LM head int4 too (`quantize_linears`, `lm_head_quantization`).
    "w4a8_int8_all": ("w4a8_int8", "auto", True),
    "wna16_all": ("wna16", "auto", True),
}
DEFAULT_VARIANTS = {"cpu": "float,w4a8_int8,w4a8_int8_all",
                    "gpu": "float_ragged_dot,wna16,mxint4,wna16_all"}


# ------------------------------------------------------------------ the model
def qwen3_30b_a3b_config(args: argparse.Namespace) -> dict[str, Any]:
  """A qwen3_moe `config.json` with Qwen3-30B-A3B's shapes (overridable) and --layers layers."""
  return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
          "hidden_size": args.hidden, "num_hidden_layers": args.layers,
          "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
          "head_dim": args.head_dim, "vocab_size": args.vocab, "num_experts": args.experts,
          "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_intermediate,
          "intermediate_size": 6144, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
          "rope_theta": 1e6, "hidden_act": "silu", "decoder_sparse_step": 1,
          "mlp_only_layers": [], "tie_word_embeddings": False, "max_position_embeddings": 40960}


def _supports(fn, name: str) -> bool:
  return name in inspect.signature(fn).parameters


def force_float_impl(model: models.MoECausalLM, impl: str) -> str | None:
  """Rebuilds the model's float MoE blocks with `float_impl=impl` (same weights); returns a note
  when this jax_moeq has no `float_impl` (the blocks then keep their automatic strategy)."""
  from jax_moeq import nn as moe_nn
  if not _supports(moe_nn.MoE.__init__, "float_impl"):
    return "jax_moeq.nn.MoE has no float_impl option: float blocks keep their automatic strategy"
  from jax_moeq.weights import FloatMoEWeights
  for layer in model.layers:
    block = layer.mlp
    if not isinstance(block, moe_nn.MoE) or getattr(block, "float_impl", None) == impl:
      continue
    spec = block.spec
    layer.mlp = moe_nn.MoE(
        spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size,
        activation=spec.activation, renormalize=spec.renormalize, scoring_func=spec.scoring_func,
        dtype=block.dtype, param_dtype=block.param_dtype, float_impl=impl,
        weights=FloatMoEWeights(block.w13[...], block.w2[...]),
        router_weight=block.router.kernel[...].T)
  return None


def build_variant(name: str, cfg: dict[str, Any], args: argparse.Namespace
                  ) -> tuple[models.MoECausalLM, str | None]:
  """(model, note): the same seed for every variant, so int4 variants quantize the float weights."""
  quantization, impl, all_linears = VARIANTS[name]
  kw: dict[str, Any] = dict(dtype=args.dtype, quantization=quantization, seed=args.seed)
  if all_linears:
    kw.update(quantize_linears=True, lm_head_quantization="int4")
  if impl != "auto" and _supports(models.from_config, "float_impl"):
    return models.from_config(cfg, float_impl=impl, **kw), None
  model = models.from_config(cfg, **kw)
  note = force_float_impl(model, impl) if impl != "auto" else None
  return model, note


def share_float_parts(source: models.MoECausalLM, target: models.MoECausalLM) -> None:
  """Points `target`'s embedding, norms and (where both keep them float) attention and LM head at
  `source`'s modules. Every variant draws them from the same seed, so this changes no value; it
  keeps one copy of them (2.5 GB at vocab 151936 in float32) for all the variants."""
  float_linears = lambda m: not m.linear_backends() or set(m.linear_backends()) == {"float"}
  same_linears = float_linears(source) and float_linears(target)
  target.embed_tokens, target.norm = source.embed_tokens, source.norm
  if same_linears:
    target.lm_head = source.lm_head
  for src, dst in zip(source.layers, target.layers):
    dst.input_layernorm, dst.post_attention_layernorm = (
        src.input_layernorm, src.post_attention_layernorm)
    if same_linears:
      dst.self_attn = src.self_attn


def decode_bytes(model: models.MoECausalLM, batch: int) -> dict[str, float]:
  """Weight bytes one decode step reads: the experts that `batch` tokens route to (expected
  distinct experts under uniform routing), the other weights whole, `batch` embedding rows."""
  cfg = model.config
  touched = 1.0 - (1.0 - cfg.top_k / cfg.num_experts) ** batch  # expected fraction of experts hit
  out = {"experts": 0.0, "lm_head": 0.0, "other": 0.0}
  for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
    where = jax.tree_util.keystr(path)  # e.g. "['layers'][0]['mlp']['w13'].value"
    nbytes = float(getattr(leaf, "nbytes", 0))
    if "['embed_tokens']" in where:
      out["other"] += nbytes * batch / cfg.vocab_size
    elif "['lm_head']" in where:
      out["lm_head"] += nbytes
    elif "['mlp']" in where and "['router']" not in where:
      out["experts"] += nbytes * touched
    else:
      out["other"] += nbytes
  out["total"] = sum(out.values())
  return out


# ------------------------------------------------------------------ timing
def generate_times(model: models.MoECausalLM, prompts: np.ndarray, steps: int
                   ) -> tuple[float, float, float]:
  """(compile, prefill, decode) seconds of one greedy `generate` of `steps` decode steps."""
  out = models.generate(model, prompts, max_new_tokens=steps + 1)
  decoded = int(np.asarray(out.num_tokens).min()) - 1
  if decoded != steps:
    raise RuntimeError(f"generate stopped after {decoded} of {steps} decode steps")
  return out.compile_seconds, out.prefill_seconds, out.decode_seconds


class _NoMoE(nnx.Module):
  """Stands in for a layer's MLP block: adds nothing to the residual stream."""

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.zeros_like(x)


@contextlib.contextmanager
def moe_blocks_off(model: models.MoECausalLM) -> Iterator[models.MoECausalLM]:
  """The model with every MLP block swapped for `_NoMoE` (restored on exit): its decode step is
  what attention, norms, embedding and LM head cost; the variants' steps minus it is their MoE."""
  saved = [layer.mlp for layer in model.layers]
  for layer in model.layers:
    layer.mlp = _NoMoE()
  try:
    yield model
  finally:
    for layer, mlp in zip(model.layers, saved):
      layer.mlp = mlp


FLOOR = "no_moe"  # the first variant's model with its MLP blocks off


def _timed(model: models.MoECausalLM, floor: bool):
  """A call of `generate_times` on the model, or on it with its MLP blocks off."""
  def call(prompts: np.ndarray, steps: int) -> tuple[float, float, float]:
    if not floor:
      return generate_times(model, prompts, steps)
    with moe_blocks_off(model):
      return generate_times(model, prompts, steps)
  return call


def weight_bandwidth(platform_name: str) -> tuple[float, str]:
  """(bytes/s, what it is) of the memory the weights stream from, measured now: the GPU's
  device-to-device copy rate (bytes read plus written), or the CPU's DRAM read rate."""
  if platform_name == "gpu":
    # 2 GiB, many calls: a 512 MiB copy timed from Python read 2.13 TB/s on an H100 whose copy
    # rate is 2.99 (the per-call dispatch counts against the short copy).
    x = jax.random.normal(jax.random.key(0), (1 << 29,), jnp.float32)
    scale = jax.jit(lambda a: a * 1.0001)
    sec, _ = _timing.median_time(lambda i: scale(x), warmup=3, min_repeats=20,
                                 target_seconds=0.5)
    return 2 * x.nbytes / sec, "HBM copy"
  read = _timing.read_bandwidth_gbps(1 << 30, _timing.usable_cores())
  return read["best"] * 1e9, "DRAM read"


def bench_batch(built: dict[str, models.MoECausalLM], batch: int, prompt_len: int,
                args: argparse.Namespace, machine: str, bandwidth: float
                ) -> list[dict[str, Any]]:
  """Interleaved repeats of every variant (and the no-MoE floor) at one batch size."""
  first = next(iter(built.values()))
  prompts = np.random.default_rng(args.seed).integers(
      0, first.config.vocab_size, (batch, prompt_len), dtype=np.int32)
  calls = {name: _timed(model, False) for name, model in built.items()}
  if args.floor:
    calls[FLOOR] = _timed(first, True)
  compile_s: dict[str, float] = {}
  for name, call in calls.items():
    _timing.progress(f"batch {batch}: compiling {name}")
    compile_s[name] = call(prompts, args.decode_steps)[0]
  times: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
  for rep in range(args.repeats):
    for name, call in calls.items():
      _, prefill, decode = call(prompts, args.decode_steps)
      times[name].append((prefill, decode))
      _timing.progress(f"batch {batch} repeat {rep + 1}/{args.repeats} {name}: prefill "
                       f"{prefill:.3f} s, decode {decode:.3f} s")
  floor_step = (statistics.median(d for _, d in times[FLOOR]) / args.decode_steps
                if FLOOR in times else None)
  rows = []
  for name in calls:
    model = first if name == FLOOR else built[name]
    prefill = [p for p, _ in times[name]]
    decode = [d for _, d in times[name]]
    step_s = statistics.median(decode) / args.decode_steps
    nbytes = decode_bytes(model, batch)
    if name == FLOOR:
      nbytes = {k: (0.0 if k == "experts" else v) for k, v in nbytes.items()}
      nbytes["total"] = nbytes["lm_head"] + nbytes["other"]
    moe_s = None if floor_step is None or name == FLOOR else max(0.0, step_s - floor_step)
    roofline_step_s = nbytes["total"] / bandwidth
    rows.append({
        "variant": name, "batch": batch, "prompt_len": prompt_len,
        "decode_steps": args.decode_steps, "layers": model.config.num_layers,
        "dtype": str(model.dtype),
        "backends": {} if name == FLOOR else model.moe_backends(),
        "compile_s": compile_s[name],
        "backends_linear": {} if name == FLOOR else model.linear_backends(),
        "prefill_tok_s": batch * prompt_len / statistics.median(prefill),
        "prefill_tok_s_best": batch * prompt_len / min(prefill),
        "decode_tok_s": batch * args.decode_steps / statistics.median(decode),
        "decode_tok_s_best": batch * args.decode_steps / min(decode),
        "decode_step_ms": 1e3 * step_s,
        "moe_ms_per_step": None if moe_s is None else 1e3 * moe_s,
        "moe_share": None if moe_s is None else moe_s / step_s,
        "decode_read_mb": {k: v / 1e6 for k, v in nbytes.items()},
        "decode_gb_s": nbytes["total"] / step_s / 1e9,
        "weight_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_decode_tok_s": batch / roofline_step_s,
        "roofline_share": roofline_step_s / step_s,
        "repeats": args.repeats, "machine": machine})
  return rows


# ------------------------------------------------------------------ report
def _fmt(value: float) -> str:
  """Three significant figures or so, without exponents."""
  return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def print_rows(rows: list[dict[str, Any]]) -> None:
  header = ["variant", "batch", "prompt", "prefill tok/s", "decode tok/s (best)", "step ms",
            "MoE ms/step (share)", "read MB/step (experts/head/other)", "GB/s",
            "roofline tok/s (share)", "machine"]
  table = []
  for r in rows:
    mb = r["decode_read_mb"]
    share = ("—" if r["moe_share"] is None
             else f"{_fmt(r['moe_ms_per_step'])} ({r['moe_share']:.0%})")
    table.append([r["variant"], r["batch"], r["prompt_len"], _fmt(r["prefill_tok_s"]),
                  f"{_fmt(r['decode_tok_s'])} ({_fmt(r['decode_tok_s_best'])})",
                  _fmt(r["decode_step_ms"]), share,
                  "/".join(_fmt(mb[k]) for k in ("experts", "lm_head", "other")),
                  _fmt(r["decode_gb_s"]),
                  f"{_fmt(r['roofline_decode_tok_s'])} ({r['roofline_share']:.0%})",
                  r["machine"]])
  print(_timing.markdown_table(header, table))


def _ratio(a: float | None, b: float | None) -> str:
  return "—" if a is None or not b else f"{a / b:.2f}x"


def print_speedups(rows: list[dict[str, Any]], machine: str) -> None:
  """Each int4 variant over the float variant of its batch: end to end, the MoE blocks' time per
  decode step, and the end-to-end ceiling (the float step over the no-MoE floor); each
  every-linear-int4 variant over its experts-only one."""
  for batch in sorted({r["batch"] for r in rows}):
    at = {r["variant"]: r for r in rows if r["batch"] == batch}
    for name, r in at.items():
      experts_only = name.removesuffix("_all")
      if name.endswith("_all") and experts_only in at:
        print(f"batch {batch}: {name} vs {experts_only}: decode "
              f"{_ratio(r['decode_tok_s'], at[experts_only]['decode_tok_s'])}, prefill "
              f"{_ratio(r['prefill_tok_s'], at[experts_only]['prefill_tok_s'])}; roofline share "
              f"{r['roofline_share']:.0%} vs {at[experts_only]['roofline_share']:.0%} [{machine}]")
    base = next((at[v] for v in ("float", "float_ragged_dot") if v in at), None)
    if base is None:
      continue
    floor = at.get(FLOOR)
    for name, r in at.items():
      if name == FLOOR or VARIANTS[name][0] is None:
        continue
      ceiling = None if floor is None else _ratio(base["decode_step_ms"], floor["decode_step_ms"])
      print(f"batch {batch}: {name} vs {base['variant']}: decode "
            f"{_ratio(r['decode_tok_s'], base['decode_tok_s'])}, prefill "
            f"{_ratio(r['prefill_tok_s'], base['prefill_tok_s'])}; MoE time per decode step, "
            f"{base['variant']} over {name}: "
            f"{_ratio(base['moe_ms_per_step'], r['moe_ms_per_step'])}; decode ceiling with free "
            f"MoE blocks {ceiling}; weight bytes per step, {base['variant']} over {name}: "
            f"{_ratio(base['decode_read_mb']['total'], r['decode_read_mb']['total'])} "
            f"[{machine}]")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=2, help="decoder layers (the full model has 48)")
  p.add_argument("--variants", default=None,
                 help=f"comma-separated, of {sorted(VARIANTS)} (default: {DEFAULT_VARIANTS})")
  p.add_argument("--batch", default="1,16",
                 help="comma-separated batch sizes, each optionally with its own prompt length "
                      "as BATCH:PROMPT (e.g. 1:2048,64:128)")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--decode-steps", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3, help="timed generate calls per variant")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="activations and float weights (default: float32 on CPU, XLA's fastest "
                      "float path there; bfloat16 on GPU)")
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--experts", type=int, default=128)
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--moe-intermediate", type=int, default=768)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-floor", dest="floor", action="store_false",
                 help="skip the no-MoE floor (the first variant with its MLP blocks off)")
  p.add_argument("--allow-reference", action="store_true",
                 help="on a GPU, time int4 variants even when they fall back to the jnp reference")
  p.add_argument("--json", default=None, help="write the rows and the machine here")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  args = _parse_args(argv)
  info = _timing.machine_info()
  machine = _timing.machine_line(info)
  platform_name = "gpu" if info["platform"] == "gpu" else "cpu"
  args.dtype = args.dtype or ("bfloat16" if platform_name == "gpu" else "float32")
  names = (args.variants or DEFAULT_VARIANTS[platform_name]).split(",")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    raise SystemExit(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
  batches = [(int(b.split(":")[0]), int(b.split(":")[1]) if ":" in b else args.prompt_len)
             for b in args.batch.split(",")]
  cfg = qwen3_30b_a3b_config(args)
  print(f"machine: {machine}; jax {info['jax']} on {info['platform']} ({info['device']})")
  print(f"model: Qwen3-30B-A3B shapes, {args.layers} layers, hidden {args.hidden}, "
        f"{args.experts} experts top-{args.top_k} x {args.moe_intermediate}, vocab {args.vocab}, "
        f"{args.dtype}; {args.decode_steps} decode steps, median of "
        f"{args.repeats} interleaved repeats")
  built: dict[str, models.MoECausalLM] = {}
  for name in names:
    start = time.perf_counter()
    built[name], note = build_variant(name, cfg, args)
    if len(built) > 1:
      share_float_parts(next(iter(built.values())), built[name])
    if note:
      print(f"note ({name}): {note}")
    backends = built[name].moe_backends()
    _timing.progress(f"built {name} in {time.perf_counter() - start:.1f} s: {backends}")
    if platform_name == "gpu" and "reference" in backends.values() and not args.allow_reference:
      raise SystemExit(f"{name} runs on the jnp reference backend ({backends}): this jax_moeq has "
                       "no CUDA library (build it: scripts/dev_build.sh with JAX_MOEQ_CUDA=ON); "
                       "--allow-reference times it anyway")
  bandwidth, what = weight_bandwidth(platform_name)
  print(f"{what}: {bandwidth / 1e9:.0f} GB/s (the roofline's rate, measured in this run)")
  rows = []
  for batch, prompt_len in batches:
    rows += bench_batch(built, batch, prompt_len, args, machine, bandwidth)
  print_rows(rows)
  print_speedups(rows, machine)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"machine": info, "config": cfg, "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
