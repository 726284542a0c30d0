"""Probe of the launch choices in _gpu_launch: times one op at one shape and T under forced
split-K factors (GEMM1, GEMM2), the variants alternating in rounds within one process so they
share the machine's state. An experiment, not a benchmark: it replaces choose_gemm_splits (and
decodes_without_alignment) while each variant traces. A variant is "s13.s2", or "auto" (the
library's choice), optionally followed by "/aligned": the alignment path even where one token
could skip it (decodes_without_alignment forced false), to compare the two paths in one process,
"/kernels": the one-token path as the general GEMM kernels (neither the fused decode kernel nor
the streaming kernels), or "/fused": the fused decode kernel wherever it fits (the automatic
choice does not take it). "auto" at one token is the streaming kernels where they fit.
  python3 benchmarks/launch_probe.py wna16 Mixtral-8x7B 1 1.7 1.8
  python3 benchmarks/launch_probe.py mxint4 Qwen3-30B-A3B 1 auto auto/aligned auto/fused
The ops: wna16, mxint4 and w4a8 (whose launch has none of these choices: "auto" only).

Each variant is timed two ways: "graph", 8 calls (rotating routing) in one jitted executable, per
call (wall time, as gpu_moe_bench's "us"; at small-expert T=1 the host's dispatch sets it, and
graph_gap_probe.py reads the GPU's own time); "dispatch", one jitted call at a time, back to back
(host dispatch included). Beside each, the library's handler runs per executable call
(`_ffi.cuda_handler_runs`): 0 where XLA replays its captured command buffer, one per layer where
it runs the handlers, i.e. captures or launches them anew, on every call.
LAUNCH_PROBE_LAYERS=N sets the layers per graph call (8), LAUNCH_PROBE_WEIGHT_SETS=M the weight
sets they take in turn (N), LAUNCH_PROBE_CHAIN=1 chains the layers (each takes the previous one's
output; the call returns the last), LAUNCH_PROBE_ROUTING_ARGS=0 passes the layers' routing as
slices of stacked arrays (by default each layer's is an argument of its own, as in the benchmarks),
LAUNCH_PROBE_GRAPH_ONLY=1 skips the dispatch timing.
"""

import contextlib
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
from jax_moeq import _ffi  # noqa: E402
from jax_moeq.ops import _gpu_launch, mxint4_gpu, w4a8_gpu, wna16_gpu  # noqa: E402
import gpu_moe_bench  # noqa: E402
import mxint4_bench  # noqa: E402
import w4a8_gpu_bench  # noqa: E402

ROUNDS = 5
# LAUNCH_PROBE_LAYERS=N: N layers (own weights and routing) per graph call instead of 8. A call's
# host work grows with its arguments (13 weight arrays a layer); at 8 layers and one token it can
# take longer than the GPU's work, at 32 it no longer does (docs/performance.md).
SETS = int(os.environ.get("LAUNCH_PROBE_LAYERS", gpu_moe_bench.ROUTING_SETS))
gpu_moe_bench.ROUTING_SETS = SETS  # routing_sets draws this many
# LAUNCH_PROBE_GRAPH_ONLY=1: time the graphs only. The dispatch timing between them leaves the GPU
# mostly idle (host-bound calls), and a graph timed right after it can start below full clocks.
GRAPH_ONLY = os.environ.get("LAUNCH_PROBE_GRAPH_ONLY") == "1"
# LAUNCH_PROBE_WEIGHT_SETS=M: the layers take their weights from M sets in turn (layer j from set
# j % M), each layer with its own routing, so a call's arguments stop growing with its layers.
# With 8 sets a set's experts come back only after 7 other layers' reads (colder than the L2).
WEIGHT_SETS = int(os.environ.get("LAUNCH_PROBE_WEIGHT_SETS", SETS))
# LAUNCH_PROBE_CHAIN=1: each layer takes the previous layer's output and the call returns the
# last one, as a model's layers do, instead of every layer taking x and the call returning all
# their outputs.
CHAIN = os.environ.get("LAUNCH_PROBE_CHAIN") == "1"
ROUTING_ARGS = os.environ.get("LAUNCH_PROBE_ROUTING_ARGS", "1") != "0"  # see make_op


def _layers(one, x, per_layer):
  """The graph's layers: one(x, *per_layer(j)) for every j, as a list of outputs, or (CHAIN) as a
  chain returning its last output."""
  if not CHAIN:
    return [one(x, *per_layer(j)) for j in range(SETS)]
  for j in range(SETS):
    x = one(x, *per_layer(j))
  return x


def make_op(op: str, name: str, t: int):
  """(traceable fn(x, per-layer weights, routing), its args, per-call body, per-call args
  list). The SETS layers take their weights from WEIGHT_SETS sets in turn
  (gpu_moe_bench.layer_weights; by default one set a layer, as in the benchmarks). Weights and
  inputs are arguments, never closed over: a jit would embed them as constants."""
  if op in ("wna16", "w4a8"):
    e, k, h, i = gpu_moe_bench.SHAPES[name]
    make = gpu_moe_bench.random_weights if op == "wna16" else w4a8_gpu_bench.random_w4a8_weights
    layers = gpu_moe_bench.layer_weights(lambda key: make(key, e, h, i), WEIGHT_SETS)
    x = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.float32).astype(jnp.bfloat16)
    sets = gpu_moe_bench.routing_sets(t, t, e, k)
    # One argument a layer, as a model's router writes its own (indexing a list adds no op).
    # Stacked (LAUNCH_PROBE_ROUTING_ARGS=0), a layer's ids and weights are slices of one array,
    # and at T=1 (32 bytes a layer) the graph copies them: two copies a layer, ~2 us.
    routing = list if ROUTING_ARGS else jnp.stack
    ids = routing([jnp.asarray(s[0]) for s in sets])
    w = routing([jnp.asarray(s[1]) for s in sets])
    moe = wna16_gpu.fused_marlin_moe if op == "wna16" else w4a8_gpu.w4a8_gpu_moe
    one = lambda x, weights, w, ids: moe(x, weights, w, ids)
    multi = lambda x, wts, w, ids: _layers(one, x, lambda j: (wts[j % WEIGHT_SETS], w[j], ids[j]))
    return multi, (x, layers, w, ids), one, [(x, layers[j % WEIGHT_SETS], w[j], ids[j])
                                             for j in range(SETS)]
  e, k, h, i = mxint4_bench.SHAPES[name]
  layers = gpu_moe_bench.layer_weights(
      lambda key: [mxint4_bench.random_prepared(key, e, h, i)[n] for n in mxint4_gpu.WEIGHT_KEYS],
      WEIGHT_SETS)
  x = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.float32).astype(jnp.bfloat16)
  logits = jnp.stack([jax.random.normal(jax.random.PRNGKey(10 + s), (t, e), jnp.float32)
                      for s in range(SETS)])
  one = lambda x, logits, *weights: mxint4_gpu.mxint4_moe(
      x, logits, *weights, num_experts=e, top_k=k, intermediate_size=i, local_num_experts=e)
  multi = lambda x, logits, wts: _layers(one, x, lambda j: (logits[j], *wts[j % WEIGHT_SETS]))
  return multi, (x, logits, layers), one, [(x, logits[j], *layers[j % WEIGHT_SETS])
                                           for j in range(SETS)]


def parse_variant(text: str):
  """(split factors or None for the library's, the forced path: "", "aligned", "kernels" or
  "fused")."""
  splits, _, path = text.partition("/")
  if path not in ("", "aligned", "kernels", "fused"):
    raise ValueError(f"unknown path {path!r} in variant {text!r}: 'aligned', 'kernels' or "
                     "'fused'")
  return (None if splits == "auto" else tuple(int(v) for v in splits.split("."))), path


@contextlib.contextmanager
def forced(variant):
  """The variant's choices in force (jax.jit traces at a function's first call)."""
  splits, path = variant
  saved = (_gpu_launch.choose_gemm_splits, _gpu_launch.decodes_without_alignment,
           _gpu_launch.choose_fused_decode, _gpu_launch.choose_one_token_mainloop)
  try:
    if splits is not None:
      _gpu_launch.choose_gemm_splits = lambda *args, **kwargs: splits
    if path == "aligned":
      _gpu_launch.decodes_without_alignment = lambda *args, **kwargs: False
    if path == "kernels":
      _gpu_launch.choose_fused_decode = lambda *args, **kwargs: False
      _gpu_launch.choose_one_token_mainloop = lambda mainloop_id, *args, **kwargs: mainloop_id
    if path == "fused":
      def fused_where_it_fits(requested, *, one_token, top_k, hidden, intermediate):
        del requested
        return one_token and not _gpu_launch.fused_decode_error(top_k, hidden, intermediate)
      _gpu_launch.choose_fused_decode = fused_where_it_fits
    yield
  finally:
    (_gpu_launch.choose_gemm_splits, _gpu_launch.decodes_without_alignment,
     _gpu_launch.choose_fused_decode, _gpu_launch.choose_one_token_mainloop) = saved


def main():
  op, name, t = sys.argv[1], sys.argv[2], int(sys.argv[3])
  labels = sys.argv[4:]
  multi, multi_args, one, one_args = make_op(op, name, t)
  graph, single = {}, {}
  for label in labels:
    # New function objects, traced and compiled while the variant's choices are in force.
    graph[label] = jax.jit(lambda *a: multi(*a))
    single[label] = jax.jit(lambda *a: one(*a))
    with forced(parse_variant(label)):
      jax.block_until_ready(graph[label](*multi_args))
      jax.block_until_ready(single[label](*one_args[0]))
  times = {(label, how): [] for label in labels for how in ("graph", "dispatch")}
  runs = {key: [0, 0] for key in times}  # handler runs, executable calls
  counted_runs = _ffi.cuda_handler_runs() is not None  # (a library without the counter: None)
  for r in range(ROUNDS):
    for label in labels:
      for how, fn, args_list, per in (("graph", graph[label], [multi_args], SETS),
                                      ("dispatch", single[label], one_args, 1)):
        if how == "dispatch" and GRAPH_ONLY:
          continue
        counted = _counting(fn, runs[(label, how)])
        before = _ffi.cuda_handler_runs()
        times[(label, how)].append(
            gpu_moe_bench.time_calls(counted, args_list, min_time=0.1, reps=3) / per)
        if counted_runs:
          runs[(label, how)][0] += _ffi.cuda_handler_runs() - before
    print(f"round {r + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
  per_call = lambda key: (f"{runs[key][0] / max(1, runs[key][1]):.2f}" if counted_runs
                          else "not counted")
  us = lambda key: (f"{statistics.median(times[key]) * 1e6:.1f} us (handler runs per call "
                    f"{per_call(key)})" if times[key] else "not timed")
  for label in labels:
    print(f"{op} {name} T={t} {label}: graph {us((label, 'graph'))}, dispatch "
          f"{us((label, 'dispatch'))} (medians of {ROUNDS} rounds)", flush=True)


def _counting(fn, tally):
  """fn, counting its calls in tally[1]."""
  def call(*args):
    tally[1] += 1
    return fn(*args)
  return call


if __name__ == "__main__":
  main()
