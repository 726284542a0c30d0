"""GPU WNA16 fused MoE benchmark (SPEC §10 GPU shapes): our kernel vs jax.lax.ragged_dot bf16
and torch._grouped_mm bf16 (when torch imports), measured in the same run.

Per (shape, T): median time of the whole MoE layer (routing ids given; 8 layers, each with its
own weights and routing, in one jitted executable, and separately one dispatch per layer;
ragged_dot one dispatch per layer, see ragged_time), effective bandwidth on
the int4 weight bytes of the experts hit (scales excluded), TFLOP/s (2·T·K·3·H·I), and ratios.
Routing is rotated over several random sets so that repeated calls do not replay one L2-resident
set of experts. Run: python3 benchmarks/gpu_moe_bench.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
from jax_moeq.ops import wna16_gpu  # noqa: E402

SHAPES = {  # name: (E, K, H, I)
    "Mixtral-8x7B": (8, 2, 4096, 14336),
    "Qwen3-30B-A3B": (128, 8, 2048, 768),
    "DeepSeek-V2-Lite": (64, 6, 2048, 1408),
}
TOKENS = (1, 16, 64, 256, 1024, 4096)
ROUTING_SETS = 8
GROUP = 128


def random_weights(key, e, h, i, dtype=jnp.bfloat16):
  """Random packed int4 weights (timing does not depend on their meaning; never zeros)."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  bits = lambda k, shape: jax.random.bits(k, shape, jnp.uint32)
  s = lambda k, g, n: (jax.random.uniform(k, (e, g, n // 16, 16), jnp.float32, 0.5, 1.5) * 1e-2
                       ).astype(dtype)
  ph = lambda dt: jnp.zeros((1,), dt)
  return wna16_gpu.Wna16MoeWeights(
      w13=bits(k1, (e, 2 * i // 16, h // 64, 32, 4)), w13_scales=s(k2, h // GROUP, 2 * i),
      w13_zeros=ph(dtype), w13_bias=ph(jnp.float32),
      w2=bits(k3, (e, h // 16, i // 64, 32, 4)), w2_scales=s(k4, i // GROUP, h),
      w2_zeros=ph(dtype), w2_bias=ph(jnp.float32), w13_perm=ph(jnp.int32),
      w2_inv_perm=ph(jnp.int32), hidden_size=h, intermediate_size=i, group_size13=GROUP,
      group_size2=GROUP, has_zeros=False, has_bias=False, act_order=False)


def layer_weights(make, layers=ROUTING_SETS):
  """`layers` weight sets from make(key), one per layer timed in one executable."""
  return [make(jax.random.fold_in(jax.random.PRNGKey(0), j)) for j in range(layers)]


def routing_sets(seed, t, e, k):
  rng = np.random.default_rng(seed)
  sets = []
  for _ in range(ROUTING_SETS):
    logits = rng.standard_normal((t, e)).astype(np.float32)
    ids = np.argsort(-logits, axis=-1)[:, :k].astype(np.int32)
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    sets.append((ids, w / w.sum(-1, keepdims=True)))
  return sets


def mean_experts_hit(id_sets) -> float:
  """Mean number of distinct experts over routing sets of top-k ids (the experts whose weights a
  layer reads: the bytes behind the benchmarks' bandwidth figures)."""
  return statistics.mean(len(np.unique(np.asarray(ids))) for ids in id_sets)


def int4_expert_bytes(h: int, i: int, group: int) -> int:
  """Bytes of one expert's int4 weights (w13 and w2) and their 2-byte scales, one a `group`
  inputs: what a layer reads per expert it hits, behind the % of the copy rate."""
  return 3 * h * i // 2 + 2 * (2 * i * (h // group) + h * (i // group))


def time_calls(fn, args_list, min_time=0.2, reps=5):
  """Median per-call seconds: back-to-back async calls (rotating inputs), one sync per rep."""
  out = fn(*args_list[0])
  jax.block_until_ready(out)
  for a in args_list:
    jax.block_until_ready(fn(*a))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args_list[1 % len(args_list)]))
  one = max(time.perf_counter() - t0, 1e-5)
  n = int(min(500, max(len(args_list), min_time / one)))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for j in range(n):  # one stream: the last result is ready only after all the others
      out = fn(*args_list[j % len(args_list)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / n)
  return statistics.median(times)


def peer_argument_parser() -> argparse.ArgumentParser:
  """The options of the benchmarks that time ops side by side with peer_rows."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--tokens", default=",".join(str(t) for t in TOKENS))
  ap.add_argument("--json", default=None)
  ap.add_argument("--gpu-time", action="store_true",
                  help="also time each op by the GPU's own timestamps (label_gpu_us)")
  return ap


def peer_rows(shapes, tokens, peers, hbm=None, gpu_time=False) -> list[dict]:
  """Ops timed side by side in one process and one harness. peers: (label, make(key, e, h, i) ->
  one layer's weights, layer(x, weights, ids, w) -> y). Per (shape, T): each op's median seconds
  per layer over ROUTING_SETS layers (own weights and routing) in one jit, as `label_us`,
  `label_tflops` (2·T·K·3·H·I) and, given the copy rate hbm, `label_hbm_frac` (int4 bytes of the
  experts hit / time / hbm); with gpu_time, `label_gpu_us`, the time per layer by the GPU's
  timestamps (_timing.gpu_span_per_call; None without GPU events). An op that raises is printed
  and its time left None."""
  rows = []
  for name in shapes:
    e, k, h, i = SHAPES[name]
    timed = []
    for label, make, layer in peers:
      layers = layer_weights(lambda key, make=make: make(key, e, h, i))
      multi = jax.jit(lambda x, wts, ids, w, layer=layer: [
          layer(x, wts[j], ids[j], w[j]) for j in range(ROUTING_SETS)])
      timed.append((label, multi, layers))
    bytes_per_expert = (2 * i * h + i * h) // 2
    for t in tokens:
      sets = routing_sets(t, t, e, k)
      x = jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)
      # One argument a layer, as a model's router writes its own: slices of one stacked array
      # would add two copies a layer to the graph (~2 us at T=1, docs/performance.md).
      ids_layers = [jnp.asarray(ids) for ids, _ in sets]
      w_layers = [jnp.asarray(w) for _, w in sets]
      hit = mean_experts_hit(ids for ids, _ in sets)
      row = dict(shape=name, T=t, experts_hit=hit)
      for label, multi, layers in timed:
        try:
          sec = time_calls(lambda a, b, multi=multi, layers=layers: multi(x, layers, a, b),
                           [(ids_layers, w_layers)]) / ROUTING_SETS
          row[f"{label}_us"] = sec * 1e6
          row[f"{label}_tflops"] = 2.0 * t * k * 3 * h * i / sec / 1e12
          if hbm:
            row[f"{label}_hbm_frac"] = hit * bytes_per_expert / sec / hbm
          if gpu_time:
            row[f"{label}_gpu_us"] = gpu_us_per_layer(
                True, lambda multi=multi, layers=layers: multi(x, layers, ids_layers, w_layers),
                ROUTING_SETS)
        except Exception as err:  # pylint: disable=broad-except
          print(f"{label} failed at {name} T={t}: {type(err).__name__}: {str(err)[:400]}",
                flush=True)
          row[f"{label}_us"] = None
      rows.append(row)
      print(json.dumps(row), flush=True)
    del timed
  return rows


def print_peer_table(rows, labels) -> None:
  """One line per (shape, T): each op's us and TFLOP/s, each op's GPU us where a row has it
  (--gpu-time), then the first op's time over the second's."""
  fmt = lambda v, f: "n/a" if v is None else format(v, f)
  gpu = [l for l in labels if any(r.get(l + "_gpu_us") is not None for r in rows)]
  head = "".join(f" {l + ' us':>11} {'TFLOP/s':>8}" for l in labels)
  head += "".join(f" {l + ' GPU us':>14}" for l in gpu)
  print(f"{'shape':18} {'T':>5}{head} {labels[0] + '/' + labels[1]:>14}")
  for r in rows:
    cells = "".join(f" {fmt(r.get(l + '_us'), '.1f'):>11} {fmt(r.get(l + '_tflops'), '.1f'):>8}"
                    for l in labels)
    cells += "".join(f" {fmt(r.get(l + '_gpu_us'), '.1f'):>14}" for l in gpu)
    a, b = r.get(f"{labels[0]}_us"), r.get(f"{labels[1]}_us")
    print(f"{r['shape']:18} {r['T']:5d}{cells} {fmt(a and b and a / b, '.2f'):>14}")


def ragged_time(ragged, x, call_args, w13, w2):
  """Seconds per layer of the jitted ragged_dot MoE, one dispatch per layer. Not several layers in
  one jit as our op is timed: there they share one weight set, and XLA then reads it once for
  all of them (H100, Mixtral T=1: 127.5 us per "layer" against 931 us per dispatch, which reads
  every expert's 2.8 GB of bf16 weights; benchmarks/ragged_check.py). A model's layers have
  weights of their own. At ~1 ms per call the host dispatch is a small part."""
  return time_calls(lambda *a: ragged(x, *a, w13, w2), call_args, min_time=0.1, reps=3)


def grouped_gemm_moe(x, ids, w, w13, w2, experts, dot):
  """The grouped-GEMM MoE of the peers: (token, slot) pairs sorted by expert, rows gathered,
  dot(rows, w13, group_sizes), SwiGLU in f32, dot(act, w2, group_sizes), weighted and
  scatter-added back to the tokens in f32."""
  t, k = ids.shape
  flat = ids.reshape(-1)
  order = jnp.argsort(flat)
  rows = x[order // k]
  sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
  y13 = dot(rows, w13, sizes).astype(x.dtype)
  i = y13.shape[-1] // 2
  a = (jax.nn.silu(y13[:, :i].astype(jnp.float32)) * y13[:, i:]).astype(x.dtype)
  y2 = dot(a, w2, sizes).astype(jnp.float32) * w.reshape(-1)[order][:, None]
  return jnp.zeros((t, x.shape[1]), jnp.float32).at[order // k].add(y2).astype(x.dtype)


def ragged_moe(x, ids, w, w13, w2):
  """bf16 MoE through jax.lax.ragged_dot (sorted pairs), the JAX baseline."""
  return grouped_gemm_moe(
      x, ids, w, w13, w2, w13.shape[0],
      lambda a, b, sizes: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32))


def torch_bench(e, k, h, i, t, sets, min_time=0.2):
  import torch
  dev = "cuda"
  w13 = torch.randn(e, h, 2 * i, device=dev, dtype=torch.bfloat16) * 0.02
  w2 = torch.randn(e, i, h, device=dev, dtype=torch.bfloat16) * 0.02
  x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
  tsets = [(torch.from_numpy(ids).to(dev), torch.from_numpy(w).to(dev)) for ids, w in sets]
  w13t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # column-major B as _grouped_mm likes
  w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)

  def moe(ids, w):
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    rows = x[order // k]
    offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
    y13 = torch._grouped_mm(rows, w13t, offs=offs)
    a = torch.nn.functional.silu(y13[:, :i]) * y13[:, i:]
    y2 = torch._grouped_mm(a, w2t, offs=offs).float() * w.reshape(-1)[order][:, None]
    out = torch.zeros(t, h, device=dev, dtype=torch.float32)
    out.index_add_(0, order // k, y2)
    return out.to(torch.bfloat16)

  for ids, w in tsets:
    moe(ids, w)
  torch.cuda.synchronize()
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record(); moe(*tsets[0]); end.record(); torch.cuda.synchronize()
  one = max(start.elapsed_time(end) / 1e3, 1e-5)
  n = int(min(500, max(len(tsets), min_time / one)))
  times = []
  for _ in range(5):
    start.record()
    for j in range(n):
      moe(*tsets[j % len(tsets)])
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / n)
  del w13, w2, w13t, w2t
  torch.cuda.empty_cache()
  return statistics.median(times)


def copy_bandwidth():
  x = jax.random.normal(jax.random.PRNGKey(0), (1 << 27,), jnp.float32)  # 512 MiB
  f = jax.jit(lambda a: a * 1.0001)
  sec = time_calls(f, [(x,)], min_time=0.3)
  return 2 * x.nbytes / sec


def save_rows(path: str | None, dev, hbm: float, rows: list[dict], op: str = "WNA16") -> None:
  """Writes a run's rows, the op timed as `us`, the device and its copy rate as JSON to `path`
  (nothing without one)."""
  if path:
    with open(path, "w") as f:
      json.dump(dict(device=dev.device_kind, copy_tbps=hbm / 1e12, op=op, rows=rows), f, indent=1)


def argument_parser() -> argparse.ArgumentParser:
  """The options both GPU MoE benchmarks take (this one and mxint4_bench.py)."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="T in {1, 64, 4096} only")
  ap.add_argument("--json", default=None)
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--tokens", default=None, help="comma-separated T values (overrides --quick)")
  ap.add_argument("--gpu-time", action="store_true",
                  help="also time our in-graph layers by the GPU's own timestamps (a profiler "
                       "trace: the span from a call's first kernel to its last, per layer), "
                       "beside the wall time, which the host's dispatch sets at small T")
  ap.add_argument("--alt-kw", default=None,
                  help='the alternative as op keywords in JSON, e.g. \'{"fused_decode": false}\' '
                       "(the one-token path as separate kernels); overrides the other --alt options; "
                       "'none': no alternative")
  return ap


def alternative(args, kw: dict) -> tuple[dict | None, str | None]:
  """The launch timed beside the default and its name: --alt-kw's JSON, none for 'none', else
  the script's own `kw` (named k=v, ...)."""
  if args.alt_kw == "none":
    return None, None
  if args.alt_kw:
    return json.loads(args.alt_kw), args.alt_kw
  return kw, ", ".join(f"{k}={v!r}" for k, v in kw.items())


def gpu_us_per_layer(enabled: bool, call, layers: int) -> float | None:
  """If enabled (--gpu-time), the GPU's time per layer of call() (a graph of `layers` layers), in
  us, from a profiler trace (_timing.gpu_span_per_call); else None."""
  if not enabled:
    return None
  span = _timing.gpu_span_per_call(call, ())
  return None if span is None else span / layers * 1e6


def start(args) -> tuple[bool, float, tuple[int, ...]]:
  """(torch usable, copy bandwidth in B/s, the T values) of a run; prints the device line."""
  try:
    import torch  # noqa: F401
    have_torch = not args.no_torch and torch.cuda.is_available()
  except Exception:  # pylint: disable=broad-except
    have_torch = False
  hbm = copy_bandwidth()
  print(f"device: {jax.devices()[0].device_kind}; copy bandwidth (read+write) "
        f"{hbm / 1e12:.2f} TB/s; torch: {'yes' if have_torch else 'no'}", flush=True)
  tokens = (1, 64, 4096) if args.quick else TOKENS
  if args.tokens:
    tokens = tuple(int(v) for v in args.tokens.split(","))
  return have_torch, hbm, tokens


def main():
  ap = argument_parser()
  ap.add_argument("--alt-mainloop", default="bulk_copy",
                  help="a second GEMM main loop timed beside the default (see _gpu_launch.MAINLOOPS)")
  ap.add_argument("--alt-block-m", type=int, default=None,
                  help="time the alternative with this block_m (e.g. 128: the wgmma GEMM) and the "
                       "default main loop instead of --alt-mainloop")
  args = ap.parse_args()
  have_torch, hbm, tokens = start(args)
  dev = jax.devices()[0]
  alt_kw, alt_name = alternative(
      args, dict(block_m=args.alt_block_m) if args.alt_block_m else dict(mainloop=args.alt_mainloop))
  rows = []
  for name in args.shapes.split(","):
    e, k, h, i = SHAPES[name]
    # Each of the 8 layers timed together has weights of its own, as in a model: with one set a
    # layer could find the previous layer's experts in L2 (19 MB of Qwen3 experts at T=1 fit).
    layers = layer_weights(lambda key: random_weights(key, e, h, i))
    kw = jax.random.split(jax.random.PRNGKey(1))
    w13_bf = (jax.random.normal(kw[0], (e, h, 2 * i), jnp.bfloat16) * 0.02)
    w2_bf = (jax.random.normal(kw[1], (e, i, h), jnp.bfloat16) * 0.02)
    bytes_per_expert = (2 * i * h + i * h) // 2
    ours = jax.jit(wna16_gpu.fused_marlin_moe)
    ours_multi = jax.jit(lambda x, wts, ids, w: [
        wna16_gpu.fused_marlin_moe(x, wts[j], w[j], ids[j]) for j in range(ROUTING_SETS)])
    # Another launch (--alt-block-m or --alt-mainloop), timed beside the default.
    alt_multi = jax.jit(lambda x, wts, ids, w: [
        wna16_gpu.fused_marlin_moe(x, wts[j], w[j], ids[j], **alt_kw)
        for j in range(ROUTING_SETS)])
    ragged = jax.jit(ragged_moe)
    for t in tokens:
      sets = routing_sets(t, t, e, k)
      x = jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)
      dsets = [(jnp.asarray(ids), jnp.asarray(w)) for ids, w in sets]
      experts_hit = mean_experts_hit(ids for ids, _ in sets)
      # In-graph time: all routing sets' layers in one executable (as inside a model, where
      # XLA launches back to back); the single-dispatch time includes host overhead.
      # Each layer's routing is its own argument (a stacked array's slices are copies: above).
      ids_layers = [d[0] for d in dsets]
      w_layers = [d[1] for d in dsets]
      t_ours = time_calls(lambda a, b: ours_multi(x, layers, a, b), [(ids_layers, w_layers)]
                          ) / ROUTING_SETS
      t_ours_1 = time_calls(lambda ids, w, wts: ours(x, wts, w, ids),
                            [(ids, w, layers[j]) for j, (ids, w) in enumerate(dsets)])
      t_alt = None if alt_kw is None else time_calls(
          lambda a, b: alt_multi(x, layers, a, b), [(ids_layers, w_layers)]) / ROUTING_SETS
      gpu_us = gpu_us_per_layer(args.gpu_time, lambda: ours_multi(x, layers, ids_layers, w_layers),
                                ROUTING_SETS)
      t_ragged = ragged_time(ragged, x, dsets, w13_bf, w2_bf)
      t_torch = None
      if have_torch:
        try:
          t_torch = torch_bench(e, k, h, i, t, sets)
        except Exception as err:  # pylint: disable=broad-except
          print(f"torch._grouped_mm failed at {name} T={t}: {err}", flush=True)
          have_torch = False
      flops = 2.0 * t * k * 3 * h * i
      row = dict(shape=name, T=t, us=t_ours * 1e6, us_single_dispatch=t_ours_1 * 1e6,
                 gpu_us=gpu_us, alt=alt_name, alt_us=None if t_alt is None else t_alt * 1e6,
                 tbps=experts_hit * bytes_per_expert / t_ours / 1e12,
                 hbm_frac=experts_hit * bytes_per_expert / t_ours / hbm,
                 tflops=flops / t_ours / 1e12, ragged_us=t_ragged * 1e6,
                 x_ragged=t_ragged / t_ours,
                 torch_us=None if t_torch is None else t_torch * 1e6,
                 x_torch=None if t_torch is None else t_torch / t_ours)
      rows.append(row)
      print(json.dumps(row), flush=True)
    del layers, w13_bf, w2_bf
  save_rows(args.json, dev, hbm, rows)
  print(f"\n{dev.device_kind}, copy {hbm / 1e12:.2f} TB/s, bf16 activations, int4 group {GROUP}")
  print("us: per layer, 8 layers (own weights and routing) in one jit; us1: one jit dispatch per call;"
        f" alt us: as us, {alt_name}; ragged us: one dispatch per layer (see ragged_time); "
        "GPU us: us by the GPU's timestamps (--gpu-time)")
  print(f"{'shape':18} {'T':>5} {'us':>9} {'us1':>8} {'alt us':>8} {'TB/s':>6} {'%HBM':>5} {'TFLOP/s':>8} "
        f"{'ragged us':>10} {'x ragged':>8} {'torch us':>9} {'x torch':>7} {'GPU us':>8}")
  fmt = lambda v, f: "n/a" if v is None else format(v, f)
  for r in rows:
    print(f"{r['shape']:18} {r['T']:5d} {r['us']:9.1f} {r['us_single_dispatch']:8.1f} "
          f"{fmt(r['alt_us'], '.1f'):>8} "
          f"{r['tbps']:6.2f} {100 * r['hbm_frac']:5.0f} "
          f"{r['tflops']:8.1f} {r['ragged_us']:10.1f} {r['x_ragged']:8.1f} "
          f"{fmt(r['torch_us'], '.1f'):>9} {fmt(r['x_torch'], '.2f'):>7} "
          f"{fmt(r['gpu_us'], '.1f'):>8}")


if __name__ == "__main__":
  main()
