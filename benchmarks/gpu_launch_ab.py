"""Launch choices of the WNA16 and MxInt4 ops side by side, by the GPU's own time, at decode batch
sizes: 8 layers (own weights and routing) in one jit per launch, the launches alternating in
rounds within one process so that they share the machine's state.
  python3 benchmarks/gpu_launch_ab.py --ops wna16,mxint4 --shapes Qwen3-30B-A3B \
      --tokens 4,16 --launches auto,registers,async_ring --rounds 3
A launch is "auto" (the op's own choice) or a main loop's name at block_m 8. Prints, per (op,
shape, T, launch), the median over rounds of the GPU span per layer (_timing.gpu_span_per_call: a
call's first kernel start to its last kernel end, / 8) and what that is as a share of the copy
rate over the bytes of the experts the layer hits (int4 weights and their scales), the roofline
the GPU targets are stated against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
import gpu_moe_bench as peers  # noqa: E402
import mxint4_bench  # noqa: E402
from jax_moeq.ops import _gpu_launch, mxint4_gpu, wna16_gpu  # noqa: E402
from jax_moeq.routing import RoutingMethodType  # noqa: E402

LAYERS = peers.ROUTING_SETS


def launch_kwargs(name: str) -> dict:
  """The op's keywords of a launch: {} for "auto", else that main loop at block_m 8 (ValueError
  for a name that is neither)."""
  if name == "auto":
    return {}
  _gpu_launch.mainloop_code(name, 8)
  return dict(block_m=8, mainloop=name)


def wna16_case(e, k, h, i, t):
  """(layer graph of a launch's keywords, bytes a layer reads)."""
  layers = peers.layer_weights(lambda key: peers.random_weights(key, e, h, i))
  sets = peers.routing_sets(t, t, e, k)
  x = jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)
  ids = [jnp.asarray(s[0]) for s in sets]
  w = [jnp.asarray(s[1]) for s in sets]
  per_expert = peers.int4_expert_bytes(h, i, peers.GROUP)

  def graph(kw):  # the weights are arguments: closed over, they would become constants
    fn = jax.jit(lambda x, wts, ids, w: [wna16_gpu.fused_marlin_moe(x, wts[j], w[j], ids[j], **kw)
                                         for j in range(LAYERS)])
    return lambda: fn(x, layers, ids, w)

  return graph, peers.mean_experts_hit(s[0] for s in sets) * per_expert


def mxint4_case(e, k, h, i, t):
  layers = peers.layer_weights(lambda key: [mxint4_bench.random_prepared(key, e, h, i)[n]
                                            for n in mxint4_gpu.WEIGHT_KEYS], LAYERS)
  sets = mxint4_bench.logit_sets(t, t, e, k)
  x = jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)
  logits = [jnp.asarray(s[0]) for s in sets]
  per_expert = peers.int4_expert_bytes(h, i, 32)

  def graph(kw):
    def layer(x, l, wts):
      return mxint4_gpu.mxint4_moe(x, l, *wts, num_experts=e, top_k=k, intermediate_size=i,
                                   local_num_experts=e,
                                   routing_method=RoutingMethodType.Renormalize, **kw)
    fn = jax.jit(lambda x, ls, wts: [layer(x, ls[j], wts[j]) for j in range(LAYERS)])
    return lambda: fn(x, logits, layers)

  return graph, peers.mean_experts_hit(s[1] for s in sets) * per_expert


def kernel_times(call, calls: int = 12) -> str:
  """Median us per layer of each kernel (by name, shortened) over `calls` traced calls."""
  jax.block_until_ready(call())
  events, _ = _timing.profiled_calls(call, (), calls, names=True)
  per_name: dict[str, float] = {}
  for start, end, name in events:
    short = name.split("(")[0].split("<")[0].replace("jax_moeq::cuda::", "")[-40:]
    per_name[short] = per_name.get(short, 0.0) + (end - start) / 1e3
  return ", ".join(f"{n} {v / calls / LAYERS:.1f}" for n, v in sorted(per_name.items()))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--ops", default="wna16,mxint4")
  ap.add_argument("--shapes", default="Qwen3-30B-A3B,DeepSeek-V2-Lite")
  ap.add_argument("--tokens", default="2,4,8,16,32")
  ap.add_argument("--launches", default="auto,registers,async_ring")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--json", default=None)
  ap.add_argument("--kernels", action="store_true",
                  help="also print each launch's kernels: median us per layer of each kernel name")
  args = ap.parse_args()
  hbm = peers.copy_bandwidth()
  info = _timing.machine_info()
  print(f"{_timing.machine_line(info)}; copy rate {hbm / 1e12:.2f} TB/s", flush=True)
  rows = []
  for op in args.ops.split(","):
    for shape in args.shapes.split(","):
      e, k, h, i = peers.SHAPES[shape]
      for t in (int(v) for v in args.tokens.split(",")):
        graph, nbytes = (wna16_case if op == "wna16" else mxint4_case)(e, k, h, i, t)
        _timing.progress(f"{op} {shape} T={t}")
        calls = {name: graph(launch_kwargs(name)) for name in args.launches.split(",")}
        spans = {name: [] for name in calls}
        for _ in range(args.rounds):
          for name, call in calls.items():
            span = _timing.gpu_span_per_call(call, ())
            spans[name].append(float("nan") if span is None else span / LAYERS * 1e6)
        if args.kernels:
          for name, call in calls.items():
            print(f"kernels {op} {shape} T={t} {name}: {kernel_times(call)}", flush=True)
        for name, us in spans.items():
          med = statistics.median(us)
          row = dict(op=op, shape=shape, T=t, launch=name, gpu_us=med, rounds=us,
                     roofline_pct=100 * nbytes / hbm / (med * 1e-6))
          rows.append(row)
          print(json.dumps(row), flush=True)
  print(f"\n{'op':7} {'shape':17} {'T':>4} " + " ".join(f"{n:>20}" for n in calls))
  for j in range(0, len(rows), len(calls)):
    group = rows[j:j + len(calls)]
    cells = " ".join(f"{r['gpu_us']:9.1f} us {r['roofline_pct']:5.0f} %" for r in group)
    print(f"{group[0]['op']:7} {group[0]['shape']:17} {group[0]['T']:4d} {cells}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(machine=info, copy_tbps=hbm / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
