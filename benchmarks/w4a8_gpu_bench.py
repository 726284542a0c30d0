"""GPU W4A8 fused MoE against our WNA16 kernel at the SPEC §10 GPU shapes (bf16 activations,
int4 group 128), measured in the same run on the same weights' sizes.

Per (shape, T): median time per layer of 8 layers (each with its own random weights and routing)
in one jitted executable, for the W4A8 op (`ops.w4a8_gpu.w4a8_gpu_moe`) and the WNA16 op
(`ops.wna16_gpu.fused_marlin_moe`, its default launch choices), and TFLOP/s (2·T·K·3·H·I; int8
operations for W4A8). `--block-ms 128,64,32` adds the W4A8 op at each forced token tile
(`w4a8_bm128`, ...) beside its automatic choice, in the same run. Run:
python3 benchmarks/w4a8_gpu_bench.py [--shapes A,B] [--tokens 1,16] [--block-ms 128,64,32]
[--json PATH]
"""

from __future__ import annotations

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
  ap = gb.peer_argument_parser()
  ap.add_argument("--block-ms", default="",
                  help="also time W4A8 at these forced block_m values (comma-separated)")
  args = ap.parse_args()
  block_ms = [int(v) for v in args.block_ms.split(",") if v]
  info = _timing.machine_info()
  machine = _timing.machine_line(info)
  print(f"device: {machine}", flush=True)
  rows = gb.peer_rows(
      args.shapes.split(","), [int(v) for v in args.tokens.split(",")],
      [("wna16", gb.random_weights,
        lambda x, wts, ids, w: wna16_gpu.fused_marlin_moe(x, wts, w, ids)),
       ("w4a8", random_w4a8_weights,
        lambda x, wts, ids, w: w4a8_gpu.w4a8_gpu_moe(x, wts, w, ids))] +
      [(f"w4a8_bm{bm}", random_w4a8_weights,
        lambda x, wts, ids, w, bm=bm: w4a8_gpu.w4a8_gpu_moe(x, wts, w, ids, block_m=bm))
       for bm in block_ms], gpu_time=args.gpu_time)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=info["device"], machine=info, rows=rows), f, indent=1)
  print(f"\n{machine}, bf16 activations, int4 group {gb.GROUP}; per layer, 8 layers "
        "(own weights and routing) in one jit; W4A8's TFLOP/s count int8 operations")
  gb.print_peer_table(rows, ("wna16", "w4a8"))
  for bm in block_ms:
    print(f"\nW4A8 at block_m {bm} beside the automatic choice")
    gb.print_peer_table(rows, (f"w4a8_bm{bm}", "w4a8"))


if __name__ == "__main__":
  main()
