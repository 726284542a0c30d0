"""A/B of environment settings that the CPU MoE handler reads per call (JAX_MOEQ_CPU_WORKERS,
JAX_MOEQ_CPU_ISA), in one process and cpu_moe_bench.py's harness: layers
chained in one jit, each with its own weights, colder than the last-level cache, fresh routings.

The settings take turns in blocks of `--block` calls (the first call of a block is not timed: a
setting whose threads linger after a call would otherwise reach into the next block),
`--rounds` rounds. Per setting and T: median, p10 and p90 ms per layer, the ratio to the first
setting, and the kernel's stage clock (when the last thread started, idle tails). One JSON line
per T on stdout after the table.

    python benchmarks/cpu_env_ab.py --shapes olmoe --tokens 1,8 --threads 16 \\
        --settings default "JAX_MOEQ_CPU_WORKERS=14" "JAX_MOEQ_CPU_ISA=avx512_vnni"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

_timing.size_xla_pool_from_argv(sys.argv[1:])


def parse_setting(text: str) -> dict[str, str]:
  """'A=1 B=2' -> {'A': '1', 'B': '2'}; '' or 'default' -> {} (the environment as started)."""
  out = {}
  for part in text.split():
    if part == "default":
      continue
    name, sep, value = part.partition("=")
    if not sep or not name:
      raise ValueError(f"setting {text!r}: expected NAME=VALUE words")
    out[name] = value
  return out


def region_clock(call, first: int, calls: int, layers: int) -> dict[str, float]:
  """The parallel stages' stage clock over `calls` calls: µs per layer."""
  import cpu_moe_bench as bench
  taken, _ = bench.stage_times(call, first=first, calls=calls)
  per = calls * layers
  out = {}
  for name in ("experts", "gemm1", "gemm2"):
    t = taken["stages"][name]
    if t["pieces"]:
      out[f"{name}_wall_us"] = t["wall_ns"] / per / 1e3
      out[f"{name}_last_thread_in_us"] = t["late_start_ns"] / per / 1e3
      out[f"{name}_idle_tail_us"] = t["idle_tail_ns"] / max(1, t["threads"]) / 1e3
      out[f"{name}_threads"] = t["threads"] / per
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default="olmoe")
  p.add_argument("--tokens", default="1,8")
  p.add_argument("--threads", type=int, help="XLA's CPU pool (PJRT_NPROC), read at start")
  p.add_argument("--settings", nargs="+", required=True,
                 help="each a space-separated list of NAME=VALUE ('default': as started)")
  p.add_argument("--block", type=int, default=20, help="calls per block (the first untimed)")
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--group-size", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  settings = [parse_setting(s) for s in args.settings]
  _timing.use_source_tree_if_not_installed()
  import jax
  import numpy as np
  import cpu_moe_bench as bench

  info = _timing.machine_info()
  llc = _timing.last_level_cache()
  dram = _timing.read_bandwidth_gbps(nbytes=max(1 << 30, 8 * (llc[1] if llc else 0)),
                                     threads=_timing.usable_cores())
  print(f"- {_timing.machine_line(info)}; DRAM read {dram['best']:.1f} GB/s; XLA pool "
        f"{args.threads or _timing.usable_cores()} threads; date "
        f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
  header = ["shape", "T", "setting", "median ms", "p10", "p90", "vs first", "calls",
            "last thread in µs", "idle tail µs"]
  rows = []
  for name in [s for s in args.shapes.split(",") if s]:
    shape = bench.SHAPES[name]
    h, g = shape.hidden_size, args.group_size
    expert_bytes = bench.expert_packed_bytes(shape, g)
    _timing.progress(f"{shape.name}: packing {args.layers} layers")
    packed = bench.packed_layers(shape, g, args.layers, args.seed)
    stack = bench.ours_stack_fn(shape, g)
    for tokens in [int(t) for t in args.tokens.split(",") if t]:
      ring = bench.routing_ring(shape, tokens, bench.ring_size(
          shape, tokens, args.layers, expert_bytes, llc[1] if llc else None, 16), args.seed)
      x = jax.random.normal(jax.random.key(tokens), (tokens, h)).astype(jax.numpy.bfloat16)
      call = bench.ring_call(stack, x, ring, packed)
      for j in range(3):
        _timing.block(call(j))
      times = [[] for _ in settings]
      j = 3
      for r in range(args.rounds):
        for s, setting in enumerate(settings):
          with _timing.env_applied(setting):
            _timing.block(call(j))  # untimed: the previous block's threads may linger
            j += 1
            for _ in range(args.block - 1):
              start = time.perf_counter()
              _timing.block(call(j))
              times[s].append((time.perf_counter() - start) / args.layers * 1e3)
              j += 1
        _timing.progress(f"{shape.name} T={tokens}: round {r + 1}/{args.rounds}")
      clocks = []
      for setting in settings:
        with _timing.env_applied(setting):
          _timing.block(call(j))
          clocks.append(region_clock(call, j + 1, max(10, args.block), args.layers))
          j += 1 + max(10, args.block)
      base = float(np.median(times[0]))
      record = {"shape": name, "tokens": tokens, "dram_gbps": dram["best"], "settings": []}
      for text, t, clock in zip(args.settings, times, clocks):
        med = float(np.median(t))
        rows.append([shape.name, tokens, text, f"{med:.3f}", f"{np.percentile(t, 10):.3f}",
                     f"{np.percentile(t, 90):.3f}", f"{base / med:.2f}x", len(t),
                     f"{clock.get('experts_last_thread_in_us', clock.get('gemm1_last_thread_in_us', 0)):.0f}",
                     f"{clock.get('experts_idle_tail_us', clock.get('gemm1_idle_tail_us', 0)):.0f}"])
        record["settings"].append({"setting": text, "median_ms": med,
                                   "p10_ms": float(np.percentile(t, 10)),
                                   "p90_ms": float(np.percentile(t, 90)), "clock": clock})
      print(json.dumps(record), flush=True)
  print(_timing.markdown_table(header, rows), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
