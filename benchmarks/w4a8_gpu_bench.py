"""GPU W4A8 fused MoE against our WNA16 kernel at the SPEC §10 GPU shapes (bf16 activations,
int4 group 128), measured in the same run on the same weights' sizes.

Per (shape, T): median time per layer of 8 layers (each with its own random weights and routing)
in one jitted executable, for the W4A8 op (`ops.w4a8_gpu.w4a8_gpu_moe`) and the WNA16 op
(`ops.wna16_gpu.fused_marlin_moe`, its default launch choices), and TFLOP/s (2·T·K·3·H·I; int8
operations for W4A8). Run: python3 benchmarks/w4a8_gpu_bench.py [--shapes A,B] [--tokens 1,16]
[--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
import gpu_moe_bench as gb  # noqa: E402
from jax_moeq.ops import w4a8_gpu, wna16_gpu  # noqa: E402


def random_w4a8_weights(key, e, h, i, group=gb.GROUP):
  """Random packed W4A8 weights (random nibbles, never zeros; timing ignores their meaning)."""
  k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
  bits = lambda k, shape: jax.random.bits(k, shape, jnp.uint32)
  s = lambda k, n, g: jax.random.uniform(k, (e, n // 16, g, 16), jnp.float32, 0.5, 1.5) * 1e-3
  rc = lambda k, n: jax.random.normal(k, (e, n), jnp.float32) * 1e-2
  ph = jnp.zeros((1,), jnp.float32)
  return w4a8_gpu.W4a8GpuWeights(
      w13=bits(k1, (e, 2 * i // 16, h // 128, 32, 8)), w13_scales=s(k2, 2 * i, h // group),
      w13_row_corr=rc(k5, 2 * i), w13_bias=ph,
      w2=bits(k3, (e, h // 16, i // 128, 32, 8)), w2_scales=s(k4, h, i // group),
      w2_row_corr=rc(k6, h), w2_bias=ph, hidden_size=h, intermediate_size=i, group_size=group,
      has_bias=False)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default=",".join(gb.SHAPES))
  ap.add_argument("--tokens", default=",".join(str(t) for t in gb.TOKENS))
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}", flush=True)
  rows = []
  for name in args.shapes.split(","):
    e, k, h, i = gb.SHAPES[name]
    wna16_layers = gb.layer_weights(lambda key: gb.random_weights(key, e, h, i))
    w4a8_layers = gb.layer_weights(lambda key: random_w4a8_weights(key, e, h, i))
    wna16_multi = jax.jit(lambda x, wts, ids, w: [
        wna16_gpu.fused_marlin_moe(x, wts[j], w[j], ids[j]) for j in range(gb.ROUTING_SETS)])
    w4a8_multi = jax.jit(lambda x, wts, ids, w: [
        w4a8_gpu.w4a8_gpu_moe(x, wts[j], w[j], ids[j]) for j in range(gb.ROUTING_SETS)])
    for t in (int(v) for v in args.tokens.split(",")):
      sets = gb.routing_sets(t, t, e, k)
      x = jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)
      ids_stack = jnp.stack([jnp.asarray(ids) for ids, _ in sets])
      w_stack = jnp.stack([jnp.asarray(w) for _, w in sets])
      row = dict(shape=name, T=t)
      for label, fn, layers in (("wna16", wna16_multi, wna16_layers),
                                ("w4a8", w4a8_multi, w4a8_layers)):
        try:
          sec = gb.time_calls(lambda a, b: fn(x, layers, a, b), [(ids_stack, w_stack)]
                              ) / gb.ROUTING_SETS
          row[f"{label}_us"] = sec * 1e6
          row[f"{label}_tflops"] = 2.0 * t * k * 3 * h * i / sec / 1e12
        except Exception as err:  # pylint: disable=broad-except
          print(f"{label} failed at {name} T={t}: {str(err)[:300]}", flush=True)
          row[f"{label}_us"] = None
      rows.append(row)
      print(json.dumps(row), flush=True)
    del wna16_layers, w4a8_layers
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=dev.device_kind, rows=rows), f, indent=1)
  print(f"\n{dev.device_kind}, bf16 activations, int4 group {gb.GROUP}; per layer, 8 layers "
        "(own weights and routing) in one jit")
  print(f"{'shape':18} {'T':>5} {'wna16 us':>9} {'TFLOP/s':>8} {'w4a8 us':>9} {'TOP/s':>8} "
        f"{'wna16/w4a8':>10}")
  for r in rows:
    a, b = r.get("wna16_us"), r.get("w4a8_us")
    fmt = lambda v: "failed" if v is None else f"{v:.1f}"
    print(f"{r['shape']:18} {r['T']:5d} {fmt(a):>9} {fmt(r.get('wna16_tflops')):>8} "
          f"{fmt(b):>9} {fmt(r.get('w4a8_tflops')):>8} "
          f"{'n/a' if a is None or b is None else f'{a / b:.2f}':>10}")


if __name__ == "__main__":
  main()
