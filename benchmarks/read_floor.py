"""The floor under a decode layer's time: how long XLA itself takes, in the benchmarks' harness,
just to read the int4 weight bytes that a layer of our GPU ops reads, with no math.

Per (shape, T), in-graph us per layer (8 layers, each with arrays of its own, in one jit, as
gpu_moe_bench.py times our ops):
- `read1`: one reduction over all the bytes of the experts hit (w13 and w2 together);
- `read2`: two dependent reductions, w13's bytes then w2's (a MoE layer's GEMM2 needs all of
  GEMM1's output: at least two grid-wide steps);
and the share of the device copy rate that each reaches, i.e. the best %HBM a layer timed this way
could show. Each reduction takes the previous one's scalar in (xor), so XLA neither fuses nor
reorders them. Run: python3 benchmarks/read_floor.py [--tokens 1,16] [--shapes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
from _timing import progress  # noqa: E402
from gpu_moe_bench import (ROUTING_SETS, SHAPES, copy_bandwidth,  # noqa: E402
                           mean_experts_hit, routing_sets, save_rows, time_calls)


def chained_reads(arrays_per_layer: list[list[jax.Array]]) -> jax.Array:
  """Reads every array once, one reduction after another (each depends on the previous)."""
  carry = jnp.uint32(0)
  for arrays in arrays_per_layer:
    for a in arrays:
      carry = carry + jnp.sum(a ^ carry, dtype=jnp.uint32)
  return carry


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--tokens", default="1,16")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  hbm = copy_bandwidth()
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}; copy bandwidth (read+write) {hbm / 1e12:.2f} TB/s", flush=True)
  rows = []
  for name in args.shapes.split(","):
    e, k, h, i = SHAPES[name]
    for t in (int(v) for v in args.tokens.split(",")):
      hits = mean_experts_hit(ids for ids, _ in routing_sets(t, t, e, k))
      words13 = int(round(hits * 2 * i * h / 8))  # int4: 8 per uint32
      words2 = int(round(hits * i * h / 8))
      progress(f"{name} T={t}: {hits:.2f} experts hit, {4 * (words13 + words2) / 1e6:.1f} MB")
      keys = jax.random.split(jax.random.PRNGKey(t), 2 * ROUTING_SETS)
      bits = lambda key, n: jax.random.bits(key, (n,), jnp.uint32)
      w13 = [bits(keys[2 * j], words13) for j in range(ROUTING_SETS)]
      w2 = [bits(keys[2 * j + 1], words2) for j in range(ROUTING_SETS)]
      both = [jnp.concatenate([a, b]) for a, b in zip(w13, w2)]
      read1 = jax.jit(lambda arrays: chained_reads([[a] for a in arrays]))
      read2 = jax.jit(lambda a13, a2: chained_reads([[x, y] for x, y in zip(a13, a2)]))
      t1 = time_calls(read1, [(both,)]) / ROUTING_SETS
      t2 = time_calls(read2, [(w13, w2)]) / ROUTING_SETS
      nbytes = 4 * (words13 + words2)
      row = dict(shape=name, T=t, mbytes=nbytes / 1e6, read1_us=t1 * 1e6, read2_us=t2 * 1e6,
                 read1_frac=nbytes / t1 / hbm, read2_frac=nbytes / t2 / hbm)
      rows.append(row)
      print(json.dumps(row), flush=True)
      del w13, w2, both
  save_rows(args.json, dev, hbm, rows, op="read floor")
  print(f"\n{dev.device_kind}, copy {hbm / 1e12:.2f} TB/s; in-graph us per layer, "
        "8 layers in one jit")
  print(f"{'shape':18} {'T':>5} {'MB':>6} {'read1 us':>9} {'%HBM':>5} {'read2 us':>9} {'%HBM':>5}")
  for r in rows:
    print(f"{r['shape']:18} {r['T']:5d} {r['mbytes']:6.1f} {r['read1_us']:9.1f} "
          f"{100 * r['read1_frac']:5.0f} {r['read2_us']:9.1f} {100 * r['read2_frac']:5.0f}")


if __name__ == "__main__":
  main()
