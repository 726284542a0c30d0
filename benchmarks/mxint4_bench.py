"""GPU MxInt4 fused MoE benchmark (SPEC §10 GPU shapes), in the format of gpu_moe_bench.py.

Per (shape, T): median time of the whole MoE layer with routing INCLUDED in the timed call
(router logits in, Renormalize top-k on the GPU): 8 layers, each with its own weights and
logits, in one jitted executable as in gpu_moe_bench.py, and one dispatch per layer. Effective
bandwidth on the weight bytes of the experts hit (int4 weights plus their bf16 scales per 32),
TFLOP/s (2·T·K·3·H·I), and ratios vs jax.lax.ragged_dot bf16 (routing by jax.lax.top_k inside
the same jit, one dispatch per layer) and torch._grouped_mm bf16 (ids given, when torch
imports), measured in the same run.
Run: python3 benchmarks/mxint4_bench.py [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
from jax_moeq.ops import mxint4_gpu  # noqa: E402
from jax_moeq.routing import RoutingMethodType  # noqa: E402
import gpu_moe_bench as peers  # noqa: E402  (ragged_dot / torch baselines, timing)

SHAPES = peers.SHAPES
LOGIT_SETS = 8


def random_prepared(key, e, h, i):
  """Random prepared MxInt4 weights (timing does not depend on their meaning; never zeros)."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  bits = lambda k, shape: jax.random.bits(k, shape, jnp.uint32)
  s = lambda k, g, n: (jax.random.uniform(k, (e, g, n // 16, 16), jnp.float32, 0.5, 1.5) * 1e-2
                       ).astype(jnp.bfloat16)
  return dict(gemm1_weights=bits(k1, (e, 2 * i // 16, h // 64, 32, 4)),
              gemm1_scales=s(k2, h // 32, 2 * i),
              gemm2_weights=bits(k3, (e, h // 16, i // 64, 32, 4)),
              gemm2_scales=s(k4, i // 32, h))


def logit_sets(seed, t, e, k):
  rng = np.random.default_rng(seed)
  sets = []
  for _ in range(LOGIT_SETS):
    logits = rng.standard_normal((t, e)).astype(np.float32)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k].astype(np.int32)
    chosen = np.take_along_axis(logits, ids, -1)
    w = np.exp(chosen - chosen.max(-1, keepdims=True))
    sets.append((logits, ids, (w / w.sum(-1, keepdims=True)).astype(np.float32)))
  return sets


def main():
  ap = peers.argument_parser()
  ap.add_argument("--no-peers", action="store_true", help="skip ragged_dot / torch")
  ap.add_argument("--alt-block-m", type=int, default=None,
                  help="time the 'alt' column with this block_m (e.g. 128: the wgmma GEMM) "
                       "instead of mainloop='async_ring'")
  args = ap.parse_args()
  have_torch, hbm, tokens = peers.start(args)
  dev = jax.devices()[0]
  if args.no_peers:
    have_torch = False
  alt_kw, alt_name = peers.alternative(
      args, dict(block_m=args.alt_block_m) if args.alt_block_m else dict(mainloop="async_ring"))
  rows = []
  for name in args.shapes.split(","):
    e, k, h, i = SHAPES[name]
    # One weight set per layer timed together, as in a model (gpu_moe_bench.layer_weights).
    layers = peers.layer_weights(lambda key: [random_prepared(key, e, h, i)[n]
                                              for n in mxint4_gpu.WEIGHT_KEYS], LOGIT_SETS)
    kw = jax.random.split(jax.random.PRNGKey(1))
    w13_bf = jax.random.normal(kw[0], (e, h, 2 * i), jnp.bfloat16) * 0.02
    w2_bf = jax.random.normal(kw[1], (e, i, h), jnp.bfloat16) * 0.02
    bytes_per_expert = peers.int4_expert_bytes(h, i, 32)

    def moe(x, logits, *w, **kw):
      return mxint4_gpu.mxint4_moe(x, logits, *w, num_experts=e, top_k=k, intermediate_size=i,
                                   local_num_experts=e,
                                   routing_method=RoutingMethodType.Renormalize, **kw)

    def ragged_routed(x, logits, w13, w2):
      chosen, ids = jax.lax.top_k(logits, k)
      return peers.ragged_moe(x, ids, jax.nn.softmax(chosen, axis=-1), w13, w2)

    # In-graph time: the logit sets' layers in one executable (as inside a model, where XLA
    # launches back to back); the single-dispatch time includes host overhead.
    ours = jax.jit(moe)
    ours_multi = jax.jit(lambda x, ls, wts: [moe(x, ls[j], *wts[j]) for j in range(LOGIT_SETS)])
    alt_multi = jax.jit(lambda x, ls, wts: [moe(x, ls[j], *wts[j], **alt_kw)  # the alternative
                                            for j in range(LOGIT_SETS)])
    ragged = jax.jit(ragged_routed)
    for t in tokens:
      sets = logit_sets(t, t, e, k)
      x = jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)
      dlogits = [(jnp.asarray(l),) for l, _, _ in sets]
      stacked = jnp.stack([l for (l,) in dlogits])
      experts_hit = peers.mean_experts_hit(ids for _, ids, _ in sets)
      t_ours = peers.time_calls(lambda ls: ours_multi(x, ls, layers), [(stacked,)]) / LOGIT_SETS
      t_ours_1 = peers.time_calls(lambda l, wts: ours(x, l, *wts),
                                  [(l, layers[j]) for j, (l,) in enumerate(dlogits)])
      t_alt = None if alt_kw is None else peers.time_calls(
          lambda ls: alt_multi(x, ls, layers), [(stacked,)]) / LOGIT_SETS
      gpu_us = peers.gpu_us_per_layer(args.gpu_time, lambda: ours_multi(x, stacked, layers),
                                      LOGIT_SETS)
      t_ragged = None if args.no_peers else peers.ragged_time(ragged, x, dlogits, w13_bf, w2_bf)
      t_torch = None
      if have_torch:
        try:
          t_torch = peers.torch_bench(e, k, h, i, t, [(ids, w) for _, ids, w in sets])
        except Exception as err:  # pylint: disable=broad-except
          print(f"torch._grouped_mm failed at {name} T={t}: {err}", flush=True)
          have_torch = False
      flops = 2.0 * t * k * 3 * h * i
      row = dict(shape=name, T=t, us=t_ours * 1e6, us_single_dispatch=t_ours_1 * 1e6,
                 gpu_us=gpu_us, alt=alt_name, alt_us=None if t_alt is None else t_alt * 1e6,
                 tbps=experts_hit * bytes_per_expert / t_ours / 1e12,
                 hbm_frac=experts_hit * bytes_per_expert / t_ours / hbm,
                 tflops=flops / t_ours / 1e12,
                 ragged_us=None if t_ragged is None else t_ragged * 1e6,
                 x_ragged=None if t_ragged is None else t_ragged / t_ours,
                 torch_us=None if t_torch is None else t_torch * 1e6,
                 x_torch=None if t_torch is None else t_torch / t_ours)
      rows.append(row)
      print(json.dumps(row), flush=True)
    del layers, w13_bf, w2_bf
  peers.save_rows(args.json, dev, hbm, rows, op="MxInt4")
  print(f"\nMxInt4 (int4, bf16 scales per 32, routing in the call): {dev.device_kind}, copy "
        f"{hbm / 1e12:.2f} TB/s; TB/s counts int4 weights + scales of the experts hit")
  print(f"us: per layer, {LOGIT_SETS} layers (own weights and logits) in one jit; us1: one jit dispatch "
        f"per call; alt us: as us, {alt_name}; ragged us: one dispatch per layer (see "
        "gpu_moe_bench.ragged_time); TB/s, %HBM, TFLOP/s from us; GPU us: us by the GPU's "
        "timestamps (--gpu-time)")
  print(f"{'shape':18} {'T':>5} {'us':>9} {'us1':>8} {'alt us':>8} {'TB/s':>6} {'%HBM':>5} {'TFLOP/s':>8} "
        f"{'ragged us':>10} {'x ragged':>8} {'torch us':>9} {'x torch':>7} {'GPU us':>8}")
  fmt = lambda v, f: "n/a" if v is None else format(v, f)
  for r in rows:
    print(f"{r['shape']:18} {r['T']:5d} {r['us']:9.1f} {r['us_single_dispatch']:8.1f} "
          f"{fmt(r['alt_us'], '.1f'):>8} {r['tbps']:6.2f} "
          f"{100 * r['hbm_frac']:5.0f} {r['tflops']:8.1f} {fmt(r['ragged_us'], '.1f'):>10} "
          f"{fmt(r['x_ragged'], '.1f'):>8} {fmt(r['torch_us'], '.1f'):>9} "
          f"{fmt(r['x_torch'], '.2f'):>7} {fmt(r['gpu_us'], '.1f'):>8}")


if __name__ == "__main__":
  main()
