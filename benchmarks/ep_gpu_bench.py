"""Expert parallelism on 1, 2 and 4 GPUs: one MoE layer shape, 8 layers with their own weights in
one jit, per token dispatch (`jax_moeq.sharding.moe_sharded`), one process driving all local GPUs.

Shapes: "dsv3" (DeepSeek-V3 layer: E=256, top-8, H=7168, I=2048, group 128) and "qwen235"
(Qwen3-235B-A22B layer: E=128, top-8, H=4096, I=1536, group 128). Random int4 experts are drawn
and prepared on the GPU that holds them (`shard_experts` with a weights callable); routing is a
random bf16 router on the layer's input (softmax top-k, renormalized), each layer's output RMS-
normalized into the next layer.

For each (shape, GPUs n, T tokens per GPU, dispatch) it prints:
- per-layer time (median of the 8-layer jit / 8);
- collectives: with --profile, the time inside NCCL kernels from a jax.profiler trace (the
  perfetto trace's GPU events whose name holds "nccl", per GPU and layer) and its share of the
  layer; without it "-";
- bytes per GPU per layer through the collectives and GB/s over the collective time (or over
  the layer time, marked "~", without a profile). all_to_all: rounds x 2 exchanges (out and
  back) x n x C rows x H x 2 bytes (+ 8 bytes of id and weight per row out), C the per-
  destination capacity, rounds from the first layer's routing (the rows for the GPU itself are
  counted: an upper bound of what crosses NVLink). ragged_all_to_all: the filled rows only, out
  and back. replicated: below 64 tokens per GPU the bf16 all-gather of the n T x H tokens and
  the float32 psum of their outputs ((n-1)/n and 2 (n-1)/n of them per GPU: ring bus bytes), from
  64 up the all-gather and a float32 reduce-scatter ((n-1)/n each);
- weak-scaling efficiency: t(1 GPU holding E/n experts, T tokens) / t(n GPUs, T tokens each):
  the same pairs per expert per GPU, without communication (measured here, same scheme).
The header prints the GPUs, their clocks (nvidia-smi), jax / jaxlib, the NCCL version (the pip
wheel jaxlib loads, else "unknown") and the NCCL_* environment. Keep NCCL_NVLS_ENABLE=0.

    python benchmarks/ep_gpu_bench.py --shapes dsv3,qwen235 --gpus 1,2,4 \\
        --tokens 1,16,128,1024,4096 --dispatch replicated,all_to_all,ragged_all_to_all \\
        --profile --json /tmp/ep_gpu.json
    python benchmarks/ep_gpu_bench.py --quick   # qwen235, T 16 and 1024, all_to_all, 2 layers
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "dsv3": dict(experts=256, top_k=8, hidden=7168, intermediate=2048, group=128),
    "qwen235": dict(experts=128, top_k=8, hidden=4096, intermediate=1536, group=128),
    "tiny": dict(experts=16, top_k=4, hidden=256, intermediate=128, group=64),  # smoke runs
}
DISPATCHES = ("replicated", "all_to_all", "ragged_all_to_all")


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default="dsv3,qwen235")
  p.add_argument("--scheme", default="wna16", choices=("wna16", "mxint4", "w4a8_int8"))
  p.add_argument("--gpus", default="1,2,4", help="GPU counts (those above the local count skip)")
  p.add_argument("--tokens", default="1,16,128,1024,4096", help="tokens per GPU")
  p.add_argument("--dispatch", default=",".join(DISPATCHES))
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--capacity-factor", type=float, default=2.0)
  p.add_argument("--no-baseline", action="store_true", help="skip the weak-scaling baselines")
  p.add_argument("--profile", action="store_true", help="time the NCCL kernels (jax.profiler)")
  p.add_argument("--target-seconds", type=float, default=0.5)
  p.add_argument("--budget-seconds", type=float, default=0.0,
                 help="stop starting new configurations after this many seconds (0: none)")
  p.add_argument("--json", default=None)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--platform", default="gpu",
                 help="'cpu': a smoke run on CPU devices with the jnp reference experts")
  args = p.parse_args(argv)
  if args.quick:
    args.shapes, args.tokens, args.dispatch, args.layers = "qwen235", "16,1024", "all_to_all", 2
  return args


def environment() -> dict:
  """GPUs and clocks, jax / jaxlib, NCCL (pip wheel version), NCCL_* variables."""
  import importlib.metadata as md
  import jax
  out = {"jax": jax.__version__, "jaxlib": md.version("jaxlib")}
  nccl = "unknown"
  for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl"):
    try:
      nccl = f"{md.version(name)} ({name})"
      break
    except md.PackageNotFoundError:
      continue
  out["nccl"] = nccl
  out["nccl_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
  out["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  try:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,name,clocks.sm,clocks.max.sm,clocks.mem,memory.total",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
    out["gpus"] = [line.strip() for line in smi.splitlines() if line.strip()]
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                          timeout=30).stdout
    out["topology"] = topo.strip()
  except (OSError, subprocess.SubprocessError):
    out["gpus"] = [str(d) for d in jax.devices()]
  return out


_DRAW_CHUNK = 16  # experts drawn per call: bounds the random bits' temporaries


def _random_q(key, e: int, rows: int, cols: int):
  """[e, rows, cols] int4-as-int8 values in [-8, 7], drawn in chunks of experts (8-bit draws)."""
  import jax
  import jax.numpy as jnp
  draw = jax.jit(lambda k, n: (jax.random.bits(k, (n, rows, cols), jnp.uint8) & 15
                               ).astype(jnp.int8) - 8, static_argnums=1)
  parts = [draw(jax.random.fold_in(key, s), min(_DRAW_CHUNK, e - s))
           for s in range(0, e, _DRAW_CHUNK)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _random_int4(key, start: int, stop: int, hidden: int, inter: int, group: int):
  """Int4MoEWeights of experts [start, stop) drawn on the current default device."""
  import jax
  import jax.numpy as jnp
  from jax_moeq.weights import Int4MoEWeights
  e = stop - start
  k = jax.random.split(jax.random.fold_in(key, start), 4)
  q13 = _random_q(k[0], e, 2 * inter, hidden)
  q2 = _random_q(k[1], e, hidden, inter)
  # Scales ~ 1 / (7.5 sqrt(fan-in)): outputs of order 1 for inputs of order 1.
  s13 = jax.random.uniform(k[2], (e, 2 * inter, hidden // group), jnp.float32, .5, 1.5)
  s2 = jax.random.uniform(k[3], (e, hidden, inter // group), jnp.float32, .5, 1.5)
  s13 = (s13 / (7.5 * math.sqrt(hidden))).astype(jnp.bfloat16)
  s2 = (s2 / (7.5 * math.sqrt(inter))).astype(jnp.bfloat16)
  return Int4MoEWeights(q13, s13, q2, s2, group)


class Stack:
  """`layers` MoE layers of one shape over a mesh of n GPUs, each with its own weights."""

  def __init__(self, shape: dict, scheme: str, gpus: list, experts: int, layers: int, seed: int,
               backend: str = "auto"):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_moeq import dispatch, sharding as sh
    from jax_moeq.oracle.base import RoutingOptions
    self.n = len(gpus)
    self.mesh = sh.make_mesh(self.n, 1, devices=gpus)
    h, i = shape["hidden"], shape["intermediate"]
    g = 32 if scheme == "mxint4" else shape["group"]
    self.hidden, self.top_k, self.experts = h, shape["top_k"], experts
    self.routing = RoutingOptions(top_k=shape["top_k"], renormalize=True)
    spec = dispatch.LayerSpec(experts, h, i, self.routing, in_dtype=jnp.bfloat16)
    self.layouts, self.arrays, routers = [], [], []
    key = jax.random.key(seed)
    for layer in range(layers):
      lk = jax.random.fold_in(key, layer)
      make = lambda a, b, lk=lk: _random_int4(lk, a, b, h, i, g)
      layout, arrays = sh.shard_experts(scheme, spec, make, mesh=self.mesh, group_size=g,
                                        moe_backend=backend)
      if layout.backend == "reference" and backend != "reference":
        raise SystemExit(f"the {scheme} oracle chose the jnp reference on this machine: build "
                         "the CUDA library first")
      self.layouts.append(layout)
      self.arrays.append(arrays)
      router = jax.random.normal(jax.random.fold_in(lk, 1 << 20), (h, experts), jnp.float32)
      routers.append((router / math.sqrt(h) * 4).astype(jnp.bfloat16))
    self.backend = self.layouts[0].backend
    self.routers = jax.device_put(jnp.stack(routers), NamedSharding(self.mesh, P()))
    self._fns = {}

  def forward(self, dispatch_mode: str, capacity_factor: float):
    import jax
    import jax.numpy as jnp
    from jax_moeq import sharding as sh
    key = (dispatch_mode, capacity_factor)
    if key not in self._fns:
      layouts, routing = self.layouts, self.routing

      def run(x, routers, arrays):
        for l, layout in enumerate(layouts):
          logits = jnp.dot(x, routers[l], preferred_element_type=jnp.float32)
          y = sh.moe_sharded(x, logits, layout, arrays[l], routing,
                             capacity_factor=capacity_factor, dispatch=dispatch_mode)
          y = y.astype(jnp.float32)
          x = (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
               ).astype(jnp.bfloat16)
        return x

      self._fns[key] = jax.jit(run)
    return self._fns[key]

  def tokens(self, per_gpu: int, dispatch_mode: str):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    x = jax.random.normal(jax.random.key(per_gpu), (self.n * per_gpu, self.hidden), jnp.float32)
    del dispatch_mode  # every dispatch takes the tokens split, as data-parallel attention leaves them
    return jax.device_put(x.astype(jnp.bfloat16), NamedSharding(self.mesh, P("ep")))

  def first_layer_counts(self, x):
    """[n, n] pairs of source GPU s (its T tokens) bound for GPU d, for the first layer."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    logits = jnp.dot(x, self.routers[0], preferred_element_type=jnp.float32)
    _, ids = self.routing.select(logits)
    ids = np.asarray(jax.device_get(ids))
    per = self.experts // self.n
    src = np.repeat(np.arange(ids.shape[0]) // (ids.shape[0] // self.n), ids.shape[1])
    counts = np.zeros((self.n, self.n), np.int64)
    np.add.at(counts, (src, ids.reshape(-1) // per), 1)
    return counts


def exchange_bytes(n: int, t: int, k: int, h: int, dispatch_mode: str, factor: float,
                   counts) -> float:
  """Bytes per GPU per layer through the collectives (module docstring)."""
  from jax_moeq import sharding as sh
  if n == 1:
    return 0.0
  if dispatch_mode == "replicated":
    gather = (n - 1) / n * n * t * h * 2
    scatter = sh.replicated_scatters(n * t, n)
    return gather + (1 if scatter else 2) * (n - 1) / n * n * t * h * 4
  cap = sh.a2a_capacity(t, k, n, factor)
  rounds = int(max(1, (counts.max() + cap - 1) // cap))
  if dispatch_mode == "all_to_all":
    return rounds * (2 * n * cap * h * 2 + n * cap * 8)
  return float((2 * counts.sum(axis=1) * h * 2 + counts.sum(axis=1) * 8).mean())


def nccl_seconds(trace_dir: str) -> float | None:
  """Seconds of the GPU events whose name holds "nccl" in the perfetto trace under trace_dir
  (events of processes named after a GPU device when the trace names them); None if none."""
  files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
  if not files:
    return None
  with gzip.open(files[0], "rt") as f:
    events = json.load(f).get("traceEvents", [])
  gpu_pids = {e.get("pid") for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
  picked = [float(e.get("dur", 0)) for e in events
            if e.get("ph") == "X" and "nccl" in str(e.get("name", "")).lower()
            and (not gpu_pids or e.get("pid") in gpu_pids)]
  return sum(picked) * 1e-6 if picked else None


def _row_line(r: dict) -> str:
  """One markdown row; "~" marks GB/s over the layer time (no profile)."""
  coll = r["collective_us"]
  share = "-" if coll is None else f"{coll:.1f} ({100 * coll / r['layer_us']:.1f} %)"
  mark = "" if r["gbps_over"] == "collectives" else "~"
  eff = "-" if r["weak_scaling"] is None else f"{100 * r['weak_scaling']:.1f} %"
  return (f"| {r['shape']} | {r['gpus']} | {r['tokens_per_gpu']} | {r['dispatch']} | "
          f"{r['backend']} | {r['layer_us']:.1f} | {share} | {r['bytes_per_gpu'] / 1e6:.2f} | "
          f"{mark}{r['gbps']:.1f} | {eff} |")


def main(argv=None) -> int:
  args = _parse(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _timing
  _timing.use_source_tree_if_not_installed()
  import jax
  env = environment()
  print(f"# EP GPU bench: scheme {args.scheme}, jax {env['jax']} (jaxlib {env['jaxlib']}), "
        f"NCCL {env['nccl']}, NCCL env {env['nccl_env']}")
  for line in env.get("gpus", []):
    print(f"# GPU {line}")
  if env.get("topology"):
    print("# " + env["topology"].replace("\n", "\n# "))
  gpus = jax.devices(args.platform)
  backend = "reference" if args.platform == "cpu" else "auto"
  counts = [n for n in (int(v) for v in args.gpus.split(",")) if n <= len(gpus)]
  token_list = [int(v) for v in args.tokens.split(",")]
  dispatches = [d for d in args.dispatch.split(",") if d]
  for d in dispatches:
    if d not in DISPATCHES:
      raise SystemExit(f"--dispatch {d!r} is not one of {DISPATCHES}")
  started = time.time()
  rows, results = [], {"environment": env, "args": vars(args), "rows": []}

  def over_budget() -> bool:
    return args.budget_seconds > 0 and time.time() - started > args.budget_seconds

  def time_stack(stack, per_gpu, d):
    fn = stack.forward(d, args.capacity_factor)
    x = stack.tokens(per_gpu, d)
    t, _ = _timing.median_time(lambda i: fn(x, stack.routers, stack.arrays), warmup=2,
                               target_seconds=args.target_seconds)
    return t, x, fn

  for shape_name in args.shapes.split(","):
    shape = SHAPES[shape_name]
    for n in counts:
      if over_budget():
        break
      _timing.progress(f"{shape_name}: building {args.layers} layers on {n} GPU(s)")
      try:
        stack = Stack(shape, args.scheme, gpus[:n], shape["experts"], args.layers, seed=0,
                      backend=backend)
      except Exception as e:  # pylint: disable=broad-except  (e.g. out of memory)
        print(f"| {shape_name} | {n} | - | - | building failed: {type(e).__name__}: "
              f"{str(e)[:200]} |", flush=True)
        continue
      base_stack, baselines = None, {}
      for per_gpu in token_list:
        for d in (["replicated"] if n == 1 else dispatches):
          if over_budget():
            break
          _timing.progress(f"{shape_name} n={n} T={per_gpu} {d}")
          try:
            t, x, fn = time_stack(stack, per_gpu, d)
          except Exception as e:  # pylint: disable=broad-except
            print(f"| {shape_name} | {n} | {per_gpu} | {d} | failed: {type(e).__name__}: "
                  f"{str(e)[:200]} |", flush=True)
            continue
          layer_s = t / args.layers
          coll = None
          if args.profile and n > 1:
            with tempfile.TemporaryDirectory() as trace_dir:
              with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(3):
                  jax.block_until_ready(fn(x, stack.routers, stack.arrays))
              total = nccl_seconds(trace_dir)
            if total is not None:
              coll = total / (3 * n * args.layers)
          nbytes = exchange_bytes(n, per_gpu, shape["top_k"], shape["hidden"], d,
                                  args.capacity_factor, stack.first_layer_counts(x))
          eff = None
          if n > 1 and not args.no_baseline:
            try:
              if base_stack is None:  # 1 GPU holding E/n experts: the same pairs per expert
                base_stack = Stack(shape, args.scheme, gpus[:1], shape["experts"] // n,
                                   args.layers, seed=1, backend=backend)
              if per_gpu not in baselines:
                baselines[per_gpu] = time_stack(base_stack, per_gpu,
                                                "replicated")[0] / args.layers
              eff = baselines[per_gpu] / layer_s
            except Exception as e:  # pylint: disable=broad-except
              _timing.progress(f"baseline failed: {type(e).__name__}: {str(e)[:200]}")
          gbps = (nbytes / coll / 1e9) if coll else (nbytes / layer_s / 1e9)
          row = dict(shape=shape_name, gpus=n, tokens_per_gpu=per_gpu, dispatch=d,
                     backend=stack.backend, layer_us=layer_s * 1e6,
                     collective_us=None if coll is None else coll * 1e6,
                     bytes_per_gpu=nbytes, gbps=gbps, gbps_over="collectives" if coll else "layer",
                     weak_scaling=eff)
          results["rows"].append(row)
          rows.append(row)
          print(_row_line(row), flush=True)
          if args.json:
            with open(args.json, "w") as f:
              json.dump(results, f, indent=1)
      del stack, base_stack
  print("\n| shape | GPUs | T/GPU | dispatch | backend | layer us | collectives us (share) | "
        "MB/GPU | GB/s | weak scaling |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for row in rows:
    print(_row_line(row))
  return 0


if __name__ == "__main__":
  sys.exit(main())
