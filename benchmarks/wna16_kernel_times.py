"""Runs the WNA16 op a few times on one shape for a kernel profiler (ncu) to time each kernel:
  ncu --print-summary per-kernel --metrics gpu__time_duration.sum \\
      python3 benchmarks/wna16_kernel_times.py Mixtral-8x7B 1 [registers|async_ring] [block_m]"""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
from jax_moeq.ops import wna16_gpu  # noqa: E402
import gpu_moe_bench  # noqa: E402


def main():
  name, t = sys.argv[1], int(sys.argv[2])
  mainloop = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
  block_m = int(sys.argv[4]) if len(sys.argv) > 4 else None
  e, k, h, i = gpu_moe_bench.SHAPES[name]
  weights = gpu_moe_bench.random_weights(jax.random.PRNGKey(0), e, h, i)
  x = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.float32).astype(jnp.bfloat16)
  ours = jax.jit(lambda *a: wna16_gpu.fused_marlin_moe(*a, mainloop=mainloop,
                                                              block_m=block_m))
  for ids, w in gpu_moe_bench.routing_sets(2, t, e, k)[:3]:
    jax.block_until_ready(ours(x, weights, jnp.asarray(w), jnp.asarray(ids)))


if __name__ == "__main__":
  main()
