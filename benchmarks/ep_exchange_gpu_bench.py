"""The exchanges expert parallelism runs on, alone, on the local GPUs: `lax.all_to_all` of
[n, C, H] bf16 buffers, `lax.ragged_all_to_all` of the same rows (exact counts, no padding) and
a float32 `psum` (NCCL all-reduce, the bus-bandwidth anchor), one `shard_map` per jit, one
process driving every GPU.

Rows of --hidden bf16 (default 7168, DeepSeek-V3), T x K pairs per GPU spread evenly over the
GPUs. Printed per T: microseconds per call (median) and GB/s per GPU (bytes a GPU sends, its own
share included, over the time); the psum's figure is bus bandwidth (2 (n-1)/n of the buffer).
XLA chooses the ragged exchange's implementation from XLA_FLAGS, read once per process:
multi_gpu_suite.sh runs this script once per setting, e.g.
    XLA_FLAGS=--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false
    XLA_FLAGS=--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true

    python benchmarks/ep_exchange_gpu_bench.py --tokens 128,1024,4096 --json /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", default="128,1024,4096", help="tokens per GPU")
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--hidden", type=int, default=7168)
  p.add_argument("--label", default=os.environ.get("XLA_FLAGS", "") or "default")
  p.add_argument("--target-seconds", type=float, default=0.3)
  p.add_argument("--json", default=None)
  p.add_argument("--platform", default="gpu")
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _timing
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jax_moeq import sharding as sh
  devices = jax.devices(args.platform)
  n = len(devices)
  mesh = jax.sharding.Mesh(devices, ("ep",))
  h, k = args.hidden, args.top_k
  print(f"# exchanges on {n} x {devices[0].device_kind}, jax {jax.__version__}, "
        f"XLA_FLAGS {args.label!r}, H={h}, K={k}")
  print("| T/GPU | op | us | GB/s per GPU |")
  print("| --- | --- | --- | --- |")
  rows = []
  for t in (int(v) for v in args.tokens.split(",")):
    pairs = t * k
    cap = -(-pairs // n)  # rows per destination: the pairs spread evenly
    x = jax.device_put(jnp.ones((n * n * cap, h), jnp.bfloat16), NamedSharding(mesh, P("ep")))
    red = jax.device_put(jnp.ones((n * t, h), jnp.float32), NamedSharding(mesh, P("ep")))

    def dense(a):
      return jax.lax.all_to_all(a.reshape(n, cap, h), "ep", 0, 0, tiled=True).reshape(-1, h)

    def ragged(a):
      sizes = jnp.full((n,), cap, jnp.int32)
      offsets = jnp.arange(n, dtype=jnp.int32) * cap
      return sh._ragged_all_to_all(a, jnp.zeros_like(a), offsets, sizes, offsets, sizes,
                                   axis_name="ep")

    def psum(a):
      return jax.lax.psum(a, "ep")

    cases = (("all_to_all", dense, x, n * cap * h * 2),
             ("ragged_all_to_all", ragged, x, n * cap * h * 2),
             ("psum f32 (bus)", psum, red, 2 * (n - 1) / n * t * h * 4))
    for name, body, operand, nbytes in cases:
      fn = jax.jit(sh._shard_map_unchecked(body, mesh=mesh, in_specs=P("ep"),
                                           out_specs=P("ep")))
      try:
        sec, _ = _timing.median_time(lambda i: fn(operand), warmup=2,
                                     target_seconds=args.target_seconds)
      except Exception as e:  # pylint: disable=broad-except
        print(f"| {t} | {name} | failed: {type(e).__name__}: {str(e)[:160]} | |", flush=True)
        continue
      row = dict(tokens_per_gpu=t, op=name, us=sec * 1e6, gbps=nbytes / sec / 1e9, gpus=n,
                 label=args.label)
      rows.append(row)
      print(f"| {t} | {name} | {row['us']:.1f} | {row['gbps']:.1f} |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"label": args.label, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
