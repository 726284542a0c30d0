"""Our WNA16 fused MoE beside tokamax's int4 `ragged_dot` (Pallas, Mosaic GPU) on Hopper, in one
process and one harness: per (shape, T), 8 layers with their own weights and routing in one jit,
median time per layer (gpu_moe_bench's routing sets, weights and timing).

The tokamax layer is the usual grouped-GEMM MoE: sort the (token, slot) pairs by expert, gather
the rows, ragged_dot with int4 w13 (qwix QArray: signed int4, one bf16 scale per 128 inputs, no
zero point: the same arithmetic as our uint4b8 weights), SwiGLU, ragged_dot with int4 w2, weight
and scatter-add back to the tokens. Weights are stored [E, N, K] (the TRANS_RHS dimension numbers),
so no transpose runs per call. The Mosaic GPU kernel is the only implementation offered: a refusal
is printed, never timed as XLA's fallback.

Needs tokamax (Python >= 3.12, jax >= 0.11.1) and qwix. Run:
  python3 benchmarks/tokamax_bench.py [--shapes A,B] [--tokens 1,16] [--json PATH]
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
import gpu_moe_bench as gb  # noqa: E402
from jax_moeq.ops import wna16_gpu  # noqa: E402

# Contract the rhs's last axis: weights as [E, N, K].
TRANS_RHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def int4_qarray(key, e, n, k, group=gb.GROUP):
  """Random signed int4 weights [e, n, k] with bf16 scales per `group` inputs (never zeros)."""
  import qwix  # pylint: disable=import-outside-toplevel
  k1, k2 = jax.random.split(key)
  q = jax.random.randint(k1, (e, n, k), -8, 8, jnp.int32).astype(jnp.int4)
  scale = (jax.random.uniform(k2, (e, n, k // group), jnp.float32, 0.5, 1.5) * 1e-2
           ).astype(jnp.bfloat16)
  return qwix.QArray(qvalue=q, scale=scale, zero_point=None, qtype=jnp.int4)


def mosaic_gpu_op():
  """tokamax's Mosaic GPU ragged dot with its own Hopper heuristic (block 64 x 64, block_k = the
  scale group, 2 stages, persistent for quantized weights), given explicitly: the heuristic reads
  the group size off the rhs's axis 1, which is N in the [E, N, K] layout used here."""
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as tk_gpu  # pylint: disable=import-outside-toplevel
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as tk_common  # pylint: disable=import-outside-toplevel
  return tk_gpu.PallasMosaicGpuRaggedDot(config=tk_common.Config(
      block_m=64, block_n=64, block_k=gb.GROUP, num_stages=2, split_k=1, persistent=True,
      grid_minor_dim=tk_common.MatmulDimension.M, grid_tile_width=1))


def tokamax_layer(x, ids, w, w13, w2):
  """One MoE layer through tokamax.ragged_dot with int4 weights (see the module docstring)."""
  import tokamax  # pylint: disable=import-outside-toplevel
  t, k = ids.shape
  e = w13.qvalue.shape[0]
  flat = ids.reshape(-1)
  order = jnp.argsort(flat)
  rows = x[order // k]
  sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  dot = lambda a, b: tokamax.ragged_dot_general(
      a, b, sizes, ragged_dot_dimension_numbers=TRANS_RHS,
      preferred_element_type=jnp.bfloat16, implementation=[mosaic_gpu_op()])
  y13 = dot(rows, w13)
  i = y13.shape[-1] // 2
  a = (jax.nn.silu(y13[:, :i].astype(jnp.float32)) * y13[:, i:]).astype(x.dtype)
  y2 = dot(a, w2).astype(jnp.float32) * w.reshape(-1)[order][:, None]
  return jnp.zeros((t, x.shape[1]), jnp.float32).at[order // k].add(y2).astype(x.dtype)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default=",".join(gb.SHAPES))
  ap.add_argument("--tokens", default=",".join(str(t) for t in gb.TOKENS))
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  import tokamax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  hbm = gb.copy_bandwidth()
  print(f"device: {dev.device_kind}; copy bandwidth {hbm / 1e12:.2f} TB/s; tokamax "
        f"{tokamax.__version__}; jax {jax.__version__}", flush=True)
  rows = []
  for name in args.shapes.split(","):
    e, k, h, i = gb.SHAPES[name]
    ours_layers = gb.layer_weights(lambda key: gb.random_weights(key, e, h, i))
    tk_layers = gb.layer_weights(
        lambda key: (int4_qarray(key, e, 2 * i, h), int4_qarray(jax.random.fold_in(key, 1), e, h, i)))
    ours_multi = jax.jit(lambda x, wts, ids, w: [
        wna16_gpu.fused_marlin_moe(x, wts[j], w[j], ids[j]) for j in range(gb.ROUTING_SETS)])
    tk_multi = jax.jit(lambda x, wts, ids, w: [
        tokamax_layer(x, ids[j], w[j], *wts[j]) for j in range(gb.ROUTING_SETS)])
    bytes_per_expert = (2 * i * h + i * h) // 2
    for t in (int(v) for v in args.tokens.split(",")):
      sets = gb.routing_sets(t, t, e, k)
      x = jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)
      ids_stack = jnp.stack([jnp.asarray(ids) for ids, _ in sets])
      w_stack = jnp.stack([jnp.asarray(w) for _, w in sets])
      hit = gb.mean_experts_hit(ids for ids, _ in sets)
      flops = 2.0 * t * k * 3 * h * i
      row = dict(shape=name, T=t, experts_hit=hit)
      for label, fn, layers in (("ours", ours_multi, ours_layers), ("tokamax", tk_multi, tk_layers)):
        try:
          sec = gb.time_calls(lambda a, b: fn(x, layers, a, b), [(ids_stack, w_stack)]
                              ) / gb.ROUTING_SETS
          row[f"{label}_us"] = sec * 1e6
          row[f"{label}_tflops"] = flops / sec / 1e12
          row[f"{label}_hbm_frac"] = hit * bytes_per_expert / sec / hbm
        except Exception as err:  # pylint: disable=broad-except
          print(f"{label} failed at {name} T={t}: {type(err).__name__}: {str(err)[:400]}",
                flush=True)
          row[f"{label}_us"] = None
      rows.append(row)
      print(json.dumps(row), flush=True)
    del ours_layers, tk_layers
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=dev.device_kind, hbm=hbm, rows=rows), f, indent=1)
  print(f"\n{dev.device_kind}, bf16 activations, int4 weights, group {gb.GROUP}; per layer, 8 "
        "layers (own weights and routing) in one jit; %HBM: int4 bytes of the experts hit / copy rate")
  print(f"{'shape':18} {'T':>5} {'ours us':>9} {'%HBM':>5} {'TFLOP/s':>8} {'tokamax us':>11} "
        f"{'%HBM':>5} {'TFLOP/s':>8} {'tokamax/ours':>12}")
  fmt = lambda v, f: "n/a" if v is None else format(v, f)
  for r in rows:
    a, b = r.get("ours_us"), r.get("tokamax_us")
    print(f"{r['shape']:18} {r['T']:5d} {fmt(a, '.1f'):>9} "
          f"{fmt(a and 100 * r['ours_hbm_frac'], '.0f'):>5} {fmt(a and r['ours_tflops'], '.1f'):>8} "
          f"{fmt(b, '.1f'):>11} {fmt(b and 100 * r['tokamax_hbm_frac'], '.0f'):>5} "
          f"{fmt(b and r['tokamax_tflops'], '.1f'):>8} {fmt(a and b and b / a, '.2f'):>12}")


if __name__ == "__main__":
  main()
