"""The residual add of a chained MoE layer, in the kernel's combine or as an XLA op after it.

x <- x + moe_l(x) over `--layers` layers in one jit (cpu_moe_bench.py's chain: weights colder
than the LLC, fresh routings every call), both forms in one process, taking turns in blocks of
`--block` calls (the first of each block untimed), `--rounds` rounds. Prints µs per layer per
form and the per-round difference (xla - kernel), with the machine.

    python benchmarks/cpu_residual_ab.py --shapes olmoe,qwen3 --tokens 1,8 --rounds 12
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="olmoe,qwen3")
  ap.add_argument("--tokens", default="1,8")
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=12)
  ap.add_argument("--block", type=int, default=20)
  args = ap.parse_args()
  import jax.numpy as jnp
  import _timing
  import cpu_moe_bench as bench
  llc = _timing.last_level_cache()
  dram = _timing.read_bandwidth_gbps(nbytes=max(1 << 30, 8 * (llc[1] if llc else 0)),
                                     threads=_timing.usable_cores())
  print(f"{_timing.machine_line(_timing.machine_info())}; DRAM read "
        f"{max(v for v in dram.values() if isinstance(v, float)):.1f} GB/s", flush=True)
  for name in args.shapes.split(","):
    shape = bench.SHAPES[name]
    packed = bench.packed_layers(shape, 128, args.layers, seed=0)
    for tokens in map(int, args.tokens.split(",")):
      ring = bench.routing_ring(shape, tokens, 16, seed=1)
      x = jnp.asarray(np.random.default_rng(2).standard_normal((tokens, shape.hidden_size)) * 0.1,
                      jnp.bfloat16)
      forms = {f: bench.ring_call(bench.ours_stack_fn(shape, 128, xla_residual=f == "xla"), x,
                                  ring, packed) for f in ("kernel", "xla")}
      per_round = {f: [] for f in forms}
      j = 0
      for _ in range(args.rounds):
        for f, call in forms.items():
          _timing.block(call(j))
          times = []
          for _ in range(args.block):
            j += 1
            start = time.perf_counter()
            _timing.block(call(j))
            times.append(time.perf_counter() - start)
          per_round[f].append(np.median(times) / args.layers * 1e6)
      k, xl = np.asarray(per_round["kernel"]), np.asarray(per_round["xla"])
      d = xl - k
      print(f"{shape.name} T={tokens}: residual in the kernel {np.median(k):.1f} us/layer, "
            f"as an XLA op {np.median(xl):.1f}; xla - kernel per round: median {np.median(d):.1f}"
            f" us, mean {d.mean():.1f} +- {d.std(ddof=1) / np.sqrt(len(d)):.1f} "
            f"({args.rounds} rounds of {args.block} calls)", flush=True)


if __name__ == "__main__":
  main()
