"""The CPU MoE kernel and a DRAM read probe in alternating blocks of one process.

On a shared VM the memory bandwidth can move by 1.5x within minutes, so a probe taken before a
benchmark can belong to another phase than the figure it divides. Here every block is the probe
(XLA's sum over a float32 array, median of three reads) followed by calls of
cpu_moe_bench.py's chained harness (layers with weights of their own, fresh routings), and each
line sets the block's weight stream against the block's probe:
  python3 benchmarks/cpu_probe_interleave.py qwen3 1 30 [--probe-mib 1024] [--calls 15]
The kernel's ISA is the library's choice (JAX_MOEQ_CPU_ISA=avx2 forces the AVX2 path).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cpu_moe_bench as cb  # noqa: E402


def median_seconds(call, repeats: int) -> float:
  """Median seconds of call(0), ..., call(repeats - 1), nothing untimed."""
  return _timing.median_time(call, warmup=0, min_repeats=repeats, max_repeats=repeats,
                             target_seconds=0.0)[0]


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("shape", choices=sorted(cb.SHAPES))
  ap.add_argument("tokens", type=int)
  ap.add_argument("blocks", type=int)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--calls", type=int, default=15, help="harness calls per block")
  ap.add_argument("--probe-mib", type=int, default=1024, help="the probe array's size")
  ap.add_argument("--group-size", type=int, default=128)
  args = ap.parse_args(argv)
  shape = cb.SHAPES[args.shape]
  h, g = shape.hidden_size, args.group_size
  expert_bytes = cb.expert_packed_bytes(shape, g)
  packed = cb.packed_layers(shape, g, args.layers, 0)
  ring = cb.routing_ring(shape, args.tokens, 64, 0)
  x = jax.random.normal(jax.random.key(args.tokens), (args.tokens, h),
                        jnp.float32).astype(jnp.bfloat16)
  call = cb.ring_call(cb.ours_stack_fn(shape, g), x, ring, packed)
  hit = cb.mean_experts_hit(ring)
  probe_array = jnp.asarray(np.random.default_rng(1).random(args.probe_mib << 18,
                                                            dtype=np.float32))
  probe = jax.jit(jnp.sum)
  jax.block_until_ready(probe(probe_array))
  jax.block_until_ready(call(0))
  print(f"- {_timing.machine_line(_timing.machine_info())}; XLA pool "
        f"{_timing.usable_cores()} threads; {shape.name} T={args.tokens}, {args.layers} layers "
        f"a call ({args.layers * shape.num_experts * expert_bytes / 1e6:.0f} MB packed); the DRAM "
        f"probe is each block's own", flush=True)
  rows = []
  for block in range(args.blocks):
    probe_gbps = probe_array.nbytes / median_seconds(lambda _: probe(probe_array), 3) / 1e9
    first = 1 + block * args.calls  # every call a fresh routing
    layer_s = median_seconds(lambda j: call(first + j), args.calls) / args.layers
    weights_gbps = hit * expert_bytes / layer_s / 1e9
    row = dict(block=block, probe_gbps=probe_gbps, layer_ms=layer_s * 1e3,
               weights_gbps=weights_gbps, dram_frac=weights_gbps / probe_gbps)
    rows.append(row)
    print(f"block {block}: probe {probe_gbps:.1f} GB/s; layer {layer_s * 1e3:.3f} ms, weights "
          f"{weights_gbps:.1f} GB/s, {100 * weights_gbps / probe_gbps:.0f} %", flush=True)
  return rows


if __name__ == "__main__":
  main()
