"""Our WNA16 fused MoE beside tokamax's int4 `ragged_dot` (Pallas, Mosaic GPU) on Hopper, in one
process and one harness: per (shape, T), 8 layers with their own weights and routing in one jit,
median time per layer (gpu_moe_bench's routing sets, weights and timing).

The tokamax layer is the usual grouped-GEMM MoE: sort the (token, slot) pairs by expert, gather
the rows, ragged_dot with int4 w13 (qwix QArray: signed int4, one bf16 scale per 128 inputs, no
zero point: the same arithmetic as our uint4b8 weights), SwiGLU, ragged_dot with int4 w2, weight
and scatter-add back to the tokens. Weights are stored [E, N, K] (the TRANS_RHS dimension numbers),
so no transpose runs per call. The Mosaic GPU kernel is the only implementation offered: a refusal
is printed, never timed as XLA's fallback.

Needs tokamax (Python >= 3.12, jax >= 0.11.1) and qwix. tokamax 0.0.17 imports
`xprof.cli.tools.get_kernel_stats_tool` for its own profiling, which no xprof on PyPI provides
yet; where it is missing, a stub that raises if called stands in (`stub_xprof_if_missing`). Run:
  python3 benchmarks/tokamax_bench.py [--shapes A,B] [--tokens 1,16] [--json PATH]
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import gpu_moe_bench as gb  # noqa: E402
from jax_moeq.ops import wna16_gpu  # noqa: E402

# Contract the rhs's last axis: weights as [E, N, K].
TRANS_RHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def stub_xprof_if_missing() -> bool:
  """Makes `from xprof.cli.tools import get_kernel_stats_tool` work, with a function that raises
  if called, when the installed xprof (or none) lacks it. Returns whether the stub was put in."""
  try:
    if hasattr(importlib.import_module("xprof.cli.tools"), "get_kernel_stats_tool"):
      return False
  except ImportError:
    pass

  def unavailable(*args, **kwargs):
    raise NotImplementedError("xprof's kernel stats are not available (stub from tokamax_bench)")

  names = ("xprof", "xprof.cli", "xprof.cli.tools")
  modules = [types.ModuleType(n) for n in names]
  modules[0].__path__ = modules[1].__path__ = []  # packages, so other submodules fail cleanly
  for parent, child, attr in ((modules[0], modules[1], "cli"), (modules[1], modules[2], "tools")):
    setattr(parent, attr, child)
  modules[2].get_kernel_stats_tool = unavailable
  sys.modules.update(zip(names, modules))
  return True


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
  return gb.grouped_gemm_moe(
      x, ids, w, w13, w2, w13.qvalue.shape[0],
      lambda a, b, sizes: tokamax.ragged_dot_general(
          a, b, sizes, ragged_dot_dimension_numbers=TRANS_RHS,
          preferred_element_type=jnp.bfloat16, implementation=[mosaic_gpu_op()]))


def main():
  args = gb.peer_argument_parser().parse_args()
  if stub_xprof_if_missing():
    print("xprof.cli.tools.get_kernel_stats_tool missing: a stub stands in (tokamax's profiling "
          "is not used here)", flush=True)
  import tokamax  # pylint: disable=import-outside-toplevel
  info = _timing.machine_info()
  machine = _timing.machine_line(info)
  hbm = gb.copy_bandwidth()
  print(f"device: {machine}; copy bandwidth {hbm / 1e12:.2f} TB/s; tokamax "
        f"{tokamax.__version__}; jax {jax.__version__}", flush=True)
  tokamax_weights = lambda key, e, h, i: (
      int4_qarray(key, e, 2 * i, h), int4_qarray(jax.random.fold_in(key, 1), e, h, i))
  rows = gb.peer_rows(
      args.shapes.split(","), [int(v) for v in args.tokens.split(",")],
      [("tokamax", tokamax_weights,
        lambda x, wts, ids, w: tokamax_layer(x, ids, w, *wts)),
       ("ours", gb.random_weights,
        lambda x, wts, ids, w: wna16_gpu.fused_marlin_moe(x, wts, w, ids))], hbm=hbm,
      gpu_time=args.gpu_time)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=info["device"], machine=info, hbm=hbm, rows=rows), f, indent=1)
  print(f"\n{machine}, copy {hbm / 1e12:.2f} TB/s, bf16 activations, int4 weights, group {gb.GROUP}; per layer, 8 "
        "layers (own weights and routing) in one jit")
  gb.print_peer_table(rows, ("tokamax", "ours"))
  for r in rows:
    print(f"{r['shape']} T={r['T']}: % of the copy rate "
          + ", ".join(f"{l} {100 * r[l + '_hbm_frac']:.0f}" for l in ("tokamax", "ours")
                      if r.get(l + "_hbm_frac") is not None))


if __name__ == "__main__":
  main()
