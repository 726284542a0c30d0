"""Probe of _gpu_launch.choose_split: times one op at one shape and T under forced split-K factors
(GEMM1, GEMM2), the variants alternating in rounds within one process so they share the machine's
state. An experiment, not a benchmark: it replaces choose_split while each variant traces.
  python3 benchmarks/split_probe.py wna16 Mixtral-8x7B 1 1,7 1,8
  python3 benchmarks/split_probe.py mxint4 Mixtral-8x7B 1 1,7 1,8
"""

import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from jax_moeq.ops import _gpu_launch, mxint4_gpu, wna16_gpu  # noqa: E402
import gpu_moe_bench  # noqa: E402
import mxint4_bench  # noqa: E402

ROUNDS = 5


def forced_splits(split13: int, split2: int):
  """A stand-in for choose_split that answers GEMM1's call, then GEMM2's (the ops' order)."""
  answers = iter((split13, split2))
  return lambda *args, **kwargs: next(answers)


def make_op(op: str, name: str, t: int):
  """(traceable fn(*call_args), list of call_args) for the op at the shape and T. Weights and
  inputs are arguments, never closed over: a jit would embed them as constants."""
  if op == "wna16":
    e, k, h, i = gpu_moe_bench.SHAPES[name]
    weights = gpu_moe_bench.random_weights(jax.random.PRNGKey(0), e, h, i)
    x = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.float32).astype(jnp.bfloat16)
    calls = [(x, weights, jnp.asarray(w), jnp.asarray(ids))
             for ids, w in gpu_moe_bench.routing_sets(t, t, e, k)]
    return (lambda x, weights, w, ids: wna16_gpu.fused_marlin_moe(x, weights, w, ids)), calls
  e, k, h, i = mxint4_bench.SHAPES[name]
  prepared = mxint4_bench.random_prepared(jax.random.PRNGKey(0), e, h, i)
  weights = [prepared[n] for n in mxint4_gpu.WEIGHT_KEYS]
  x = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.float32).astype(jnp.bfloat16)
  calls = [(x, jax.random.normal(jax.random.PRNGKey(10 + s), (t, e), jnp.float32), *weights)
           for s in range(8)]
  return (lambda x, logits, *weights: mxint4_gpu.mxint4_moe(
      x, logits, *weights, num_experts=e, top_k=k, intermediate_size=i,
      local_num_experts=e)), calls


def main():
  op, name, t = sys.argv[1], sys.argv[2], int(sys.argv[3])
  variants = [tuple(int(v) for v in arg.split(",")) for arg in sys.argv[4:]]
  body, calls = make_op(op, name, t)
  compiled = {}
  original = _gpu_launch.choose_split
  try:
    for v in variants:
      _gpu_launch.choose_split = forced_splits(*v)
      fn = jax.jit(lambda *a: body(*a))  # a new function object: traced with these splits
      jax.block_until_ready(fn(*calls[0]))
      compiled[v] = fn
  finally:
    _gpu_launch.choose_split = original
  times = {v: [] for v in variants}
  for r in range(ROUNDS):
    for v in variants:
      times[v].append(gpu_moe_bench.time_calls(compiled[v], calls, min_time=0.1, reps=3))
    print(f"round {r + 1}/{ROUNDS} done", flush=True)
  for v in variants:
    print(f"{op} {name} T={t} split13={v[0]} split2={v[1]}: "
          f"{statistics.median(times[v]) * 1e6:.1f} us (median of {ROUNDS} rounds)", flush=True)


if __name__ == "__main__":
  main()
