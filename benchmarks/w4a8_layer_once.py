"""One W4A8 GPU layer call at a SPEC §10 shape (for ncu): python3 benchmarks/w4a8_layer_once.py
SHAPE T [calls]."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
import gpu_moe_bench as gb  # noqa: E402
import w4a8_gpu_bench as wb  # noqa: E402
from jax_moeq.ops import w4a8_gpu  # noqa: E402

name, t = sys.argv[1], int(sys.argv[2])
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 2
e, k, h, i = gb.SHAPES[name]
w = wb.random_w4a8_weights(jax.random.PRNGKey(0), e, h, i)
ids, wts = gb.routing_sets(t, t, e, k)[0]
x = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.float32).astype(jnp.bfloat16)
f = jax.jit(w4a8_gpu.w4a8_gpu_moe)
for _ in range(calls):
  y = f(x, w, jnp.asarray(wts), jnp.asarray(ids))
jax.block_until_ready(y)
print("done", name, t)
