"""GPU WNA16 dense linear benchmark: `wna16_linear` (int4 weights, group 128, bf16 activations)
against XLA's bf16 `x @ W.T`, measured in the same run, on Qwen3-30B-A3B's dense shapes.

Per (shape, M): median seconds per linear, over one jitted executable that applies the op to
`sets` distinct weight sets in turn (each its own weights, together more than 4x the L2, so that
every call streams its weights from HBM, as a model's layers do); TFLOP/s (2·M·N·K) and, for
M <= 16, the share of the HBM roofline: the bytes a call must move (int4 weights, scales, x, y)
over the time, against the copy bandwidth measured in the same run (as gpu_moe_bench.py), and
the read floor of this harness: XLA alone summing the same int4 weight bytes, timed the same way
(as read_floor.py does for the MoE; small calls pay XLA's per-op cost in both).
`--variants` times launch overrides beside the automatic choice (block_m / mainloop / split).
Run: python3 benchmarks/gpu_linear_bench.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402
import gpu_moe_bench  # noqa: E402  (time_calls, copy_bandwidth)

_timing.use_source_tree_if_not_installed()
from jax_moeq.ops import wna16_linear_gpu as wl  # noqa: E402

# name: (N, K). Qwen3-30B-A3B (hidden 2048, 32 query / 4 KV heads of 128, vocab 151936); its
# layers are all MoE, so the dense MLP is Qwen3-1.7B's (hidden 2048, intermediate 6144).
SHAPES = {
    "qkv_proj": (4096 + 512 + 512, 2048),
    "o_proj": (2048, 4096),
    "lm_head": (151936, 2048),
    "mlp_gate_up": (2 * 6144, 2048),
    "mlp_down": (2048, 6144),
}
ROWS = (1, 16, 64, 256, 2048)
GROUP = 128
L2_BYTES = 50 << 20  # H100 (H200: 60 MB); read off the device where it says
# Launch overrides timed with --variants, per M: (label, keywords of wna16_linear); the rule
# they checked is in wna16_linear_gpu.py (choose_linear_launch).
VARIANTS = {
    16: [("b16", dict(block_m=16)), ("wg32", dict(block_m=32, mainloop="wgmma"))],
    64: [("b32", dict(block_m=32)), ("wg64", dict(block_m=64, mainloop="wgmma"))],
    256: [("wg64", dict(block_m=64, mainloop="wgmma")), ("wg128", dict(block_m=128))],
    2048: [("wg64", dict(block_m=64, mainloop="wgmma")), ("wg128", dict(block_m=128))],
}


def l2_bytes() -> int:
  try:
    import torch
    return int(torch.cuda.get_device_properties(0).L2_cache_size)
  except Exception:  # pylint: disable=broad-except
    return L2_BYTES


def weight_sets(nbytes: int, l2: int, cap: int = 32) -> int:
  """Distinct weight sets whose bytes together exceed 4x the L2 (at least 2)."""
  return max(2, min(cap, math.ceil(4 * l2 / nbytes)))


def random_linear(key, n, k, dtype=jnp.bfloat16) -> wl.Wna16LinearWeights:
  """Random packed int4 weights (timing does not depend on their meaning; never zeros)."""
  kw, ks = jax.random.split(key)
  scales = (jax.random.uniform(ks, (k // GROUP, n // 16, 16), jnp.float32, 0.5, 1.5) * 1e-2
            ).astype(dtype)
  ph = lambda dt: jnp.zeros((1,), dt)
  return wl.Wna16LinearWeights(
      weights=jax.random.bits(kw, (n // 16, k // 64, 32, 4), jnp.uint32), scales=scales,
      zeros=ph(dtype), bias=ph(jnp.float32), perm=ph(jnp.int32), in_features=k,
      out_features=n, group_size=GROUP, has_zeros=False, has_bias=False, act_order=False)


def int4_bytes(m, n, k) -> int:
  """Bytes one call must move: int4 weights, bf16 scales, bf16 x and y."""
  return n * k // 2 + n * (k // GROUP) * 2 + 2 * m * k + 2 * m * n


def time_sets(op, x, sets) -> float:
  """Median seconds per call of op(x, w) over the weight sets, all in one executable."""
  multi = jax.jit(lambda x, ws: [op(x, w) for w in ws])
  return gpu_moe_bench.time_calls(lambda: multi(x, sets), [()], min_time=0.2) / len(sets)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="M in {1, 64, 2048} only")
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--rows", default=None, help="comma-separated M values")
  ap.add_argument("--variants", action="store_true", help="also time the launch overrides")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  info = _timing.machine_info()
  hbm = gpu_moe_bench.copy_bandwidth()
  l2 = l2_bytes()
  print(f"GPU: {_timing.machine_line(info)}; copy bandwidth (read+write) {hbm / 1e12:.2f} TB/s; "
        f"L2 {l2 >> 20} MiB", flush=True)
  rows_list = (1, 64, 2048) if args.quick else ROWS
  if args.rows:
    rows_list = tuple(int(v) for v in args.rows.split(","))
  results = []
  for name in args.shapes.split(","):
    n, k = SHAPES[name]
    n_int4 = weight_sets(n * k // 2, l2)
    n_bf16 = weight_sets(n * k * 2, l2)
    ours = [random_linear(jax.random.PRNGKey(j), n, k) for j in range(n_int4)]
    dense = [(jax.random.normal(jax.random.PRNGKey(100 + j), (n, k), jnp.float32) * 0.02
              ).astype(jnp.bfloat16) for j in range(n_bf16)]
    read_us = None
    try:  # the harness's read floor: XLA reading the int4 weight bytes, same sets, same timing
      read_us = time_sets(lambda x, w: jnp.sum(w.weights, dtype=jnp.uint32), None, ours) * 1e6
    except Exception as err:  # pylint: disable=broad-except
      print(f"read floor failed at {name}: {str(err)[:200]}", flush=True)
    for m in rows_list:
      x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)
      launch = wl.choose_linear_launch(m, n, k)
      row = dict(shape=name, N=n, K=k, M=m, launch=launch, sets_int4=n_int4, sets_bf16=n_bf16,
                 read_floor_us=read_us)
      try:
        sec = time_sets(wl.wna16_linear, x, ours)
        row["us"] = sec * 1e6
        row["tflops"] = 2.0 * m * n * k / sec / 1e12
        row["hbm_frac"] = int4_bytes(m, n, k) / sec / hbm
      except Exception as err:  # pylint: disable=broad-except
        print(f"wna16_linear failed at {name} M={m}: {type(err).__name__}: {str(err)[:400]}",
              flush=True)
        row["us"] = None
      try:
        sec = time_sets(lambda x, w: x @ w.T, x, dense)
        row["xla_us"] = sec * 1e6
        row["xla_hbm_frac"] = (n * k * 2 + 2 * m * (k + n)) / sec / hbm
      except Exception as err:  # pylint: disable=broad-except
        print(f"XLA failed at {name} M={m}: {type(err).__name__}: {str(err)[:200]}", flush=True)
        row["xla_us"] = None
      if args.variants:
        for label, kw in VARIANTS.get(m, []):
          try:
            op = lambda x, w, kw=kw: wl.wna16_linear(x, w, **kw)
            row[f"v_{label}_us"] = time_sets(op, x, ours) * 1e6
          except Exception as err:  # pylint: disable=broad-except
            print(f"variant {label} failed at {name} M={m}: {str(err)[:200]}", flush=True)
      results.append(row)
      print(json.dumps(row), flush=True)
    del ours, dense
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(machine=info, copy_tbps=hbm / 1e12, rows=results), f, indent=1)
  print(f"\n{_timing.machine_line(info)}, copy {hbm / 1e12:.2f} TB/s; int4 group {GROUP}, bf16 "
        "activations; us per linear, weight sets cycled past the L2")
  fmt = lambda v, f: "n/a" if v is None else format(v, f)
  print("%HBM (M <= 16): bytes moved / time / copy rate; read us: XLA summing the int4 weight "
        "bytes in the same harness")
  print(f"{'shape':12} {'N':>6} {'K':>5} {'M':>5} {'launch':>13} {'us':>8} {'TFLOP/s':>8} "
        f"{'%HBM':>5} {'read us':>7} {'xla us':>8} {'xla/ours':>8} variants")
  for r in results:
    ratio = r["xla_us"] / r["us"] if r.get("us") and r.get("xla_us") else None
    hbm_cell = fmt(100 * r["hbm_frac"], ".0f") if r["M"] <= 16 and r.get("us") else ""
    var = " ".join(f"{key[2:-3]}={v:.1f}" for key, v in r.items() if key.startswith("v_"))
    print(f"{r['shape']:12} {r['N']:6d} {r['K']:5d} {r['M']:5d} {str(r['launch']):>13} "
          f"{fmt(r.get('us'), '.1f'):>8} {fmt(r.get('tflops'), '.1f'):>8} {hbm_cell:>5} "
          f"{fmt(r['read_floor_us'], '.1f') if r['M'] <= 16 else '':>7} "
          f"{fmt(r.get('xla_us'), '.1f'):>8} {fmt(ratio, '.2f'):>8} {var}")


if __name__ == "__main__":
  main()
