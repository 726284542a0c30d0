"""Runs the MxInt4 op a few times on one shape for a kernel profiler (ncu) to time each kernel:
  ncu --print-summary per-kernel --metrics gpu__time_duration.sum \\
      python3 benchmarks/mxint4_kernel_times.py Qwen3-30B-A3B 1"""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
from jax_moeq.ops import mxint4_gpu  # noqa: E402
import mxint4_bench  # noqa: E402


def main():
  name, t = sys.argv[1], int(sys.argv[2])
  e, k, h, i = mxint4_bench.SHAPES[name]
  prepared = mxint4_bench.random_prepared(jax.random.PRNGKey(0), e, h, i)
  weights = [prepared[n] for n in mxint4_gpu.WEIGHT_KEYS]
  x = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.float32).astype(jnp.bfloat16)
  ours = jax.jit(lambda x, l, *w: mxint4_gpu.mxint4_moe(
      x, l, *w, num_experts=e, top_k=k, intermediate_size=i, local_num_experts=e))
  for s in range(3):
    logits = jax.random.normal(jax.random.PRNGKey(10 + s), (t, e), jnp.float32)
    jax.block_until_ready(ours(x, logits, *weights))


if __name__ == "__main__":
  main()
