"""One WNA16 layer of a benchmark shape at T tokens with a chosen main loop (and block_m), run
twice (the second warm): the workload for ncu sections of the wgmma GEMMs
(benchmarks/gpu_kernel_detail.sh), e.g.
  python3 benchmarks/wgmma_layer_once.py Mixtral-8x7B 4096 wgmma_ws
  python3 benchmarks/wgmma_layer_once.py Qwen3-30B-A3B 256 wgmma 32
"""

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
  name, t, mainloop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
  block_m = int(sys.argv[4]) if len(sys.argv) > 4 else None
  e, k, h, i = gpu_moe_bench.SHAPES[name]
  weights = gpu_moe_bench.random_weights(jax.random.PRNGKey(0), e, h, i)
  ids, w = gpu_moe_bench.routing_sets(t, t, e, k)[0]
  x = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.float32).astype(jnp.bfloat16)
  run = jax.jit(lambda x, wts, w, ids: wna16_gpu.fused_marlin_moe(
      x, wts, w, ids, block_m=block_m, mainloop=mainloop))
  for _ in range(2):
    out = run(x, weights, jnp.asarray(w), jnp.asarray(ids))
  out.block_until_ready()
  print(f"{name} T={t} mainloop={mainloop} block_m={block_m}: done")


if __name__ == "__main__":
  main()
