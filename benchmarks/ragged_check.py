"""jax.lax.ragged_dot bf16 MoE layer (gpu_moe_bench.ragged_moe) timed per dispatch and as 8 layers
in one jit sharing one weight set, to show why the benchmarks time it per dispatch.
  python3 benchmarks/ragged_check.py [SHAPE] [T,...]"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
import gpu_moe_bench as g  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "Mixtral-8x7B"
e, k, h, i = g.SHAPES[name]
kw = jax.random.split(jax.random.PRNGKey(1))
w13 = jax.random.normal(kw[0], (e, h, 2 * i), jnp.bfloat16) * 0.02
w2 = jax.random.normal(kw[1], (e, i, h), jnp.bfloat16) * 0.02
one = jax.jit(g.ragged_moe)
multi = jax.jit(lambda x, ids, w, a, b: [g.ragged_moe(x, ids[j], w[j], a, b)
                                         for j in range(g.ROUTING_SETS)])
for t in (int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1,16").split(",")):
  sets = g.routing_sets(t, t, e, k)
  x = jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)
  d = [(jnp.asarray(ids), jnp.asarray(w)) for ids, w in sets]
  ids_s, w_s = jnp.stack([a for a, _ in d]), jnp.stack([b for _, b in d])
  t1 = g.time_calls(lambda ids, w: one(x, ids, w, w13, w2), d, min_time=0.1, reps=3)
  t8 = g.time_calls(lambda a, b: multi(x, a, b, w13, w2), [(ids_s, w_s)], min_time=0.1,
                    reps=3) / g.ROUTING_SETS
  print(f"ragged_dot {name} T={t}: per dispatch {t1 * 1e6:.1f} us, "
        f"8 layers sharing weights in one jit {t8 * 1e6:.1f} us per layer", flush=True)
