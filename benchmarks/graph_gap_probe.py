"""Probe of where a graph call's time goes: the GPU's kernels, or the host between them. Times
launch_probe's multi-layer graph (one op, one shape and T, each variant traced under its launch
choices) three ways, in one process:
  wall     back-to-back calls with one sync at the end, per layer (launch_probe's "graph");
  enqueue  the same calls' host time until the last call returned (before the sync), per layer;
           and, beside it, the median time a call takes to return when the previous one has
           finished (no buffers of a call in flight);
  gpu      from a profiler trace of such calls: the kernels' summed time per layer, the span from
           a call's first kernel start to its last kernel end, and the idle time between calls.
wall ~ enqueue > gpu says the host's dispatch sets the figure; wall ~ gpu says the kernels do.
  python3 benchmarks/graph_gap_probe.py wna16 Qwen3-30B-A3B 1 auto auto/kernels
An experiment, not a benchmark.
"""

import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import launch_probe  # noqa: E402  (sets up the source tree, the ops and SETS)

CALLS = int(os.environ.get("GRAPH_GAP_CALLS", "200"))
TRACED_CALLS = int(os.environ.get("GRAPH_GAP_TRACED_CALLS", "40"))
ROUNDS = 3
# GRAPH_GAP_HOST_EVENTS=N: also print the N host runtime events with the most time per call.
HOST_EVENTS = int(os.environ.get("GRAPH_GAP_HOST_EVENTS", "0"))
# GRAPH_GAP_LIST_EVENTS=1: also print one call's GPU events (name, start, duration).
LIST_EVENTS = os.environ.get("GRAPH_GAP_LIST_EVENTS") == "1"


def wall_and_enqueue(fn, args, calls: int) -> tuple[float, float]:
  """(seconds per call until the last result is ready, seconds per call until the last call
  returned to the host)."""
  t0 = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  t1 = time.perf_counter()
  jax.block_until_ready(out)
  t2 = time.perf_counter()
  return (t2 - t0) / calls, (t1 - t0) / calls


def enqueue_when_idle(fn, args, calls: int) -> float:
  """Median seconds a call takes to return to the host when the GPU has finished the previous
  call (each call waited for before the next): the host's work a call needs, without the buffers
  of a call still in flight."""
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    out = fn(*args)
    times.append(time.perf_counter() - t0)
    jax.block_until_ready(out)
  return statistics.median(times)


def gpu_events(fn, args, calls: int) -> list[tuple[int, int]]:
  """(start_ns, end_ns) of the GPU events of `calls` back-to-back calls."""
  return _timing.profiled_calls(fn, args, calls)[0]


def main():
  op, name, t = sys.argv[1], sys.argv[2], int(sys.argv[3])
  labels = sys.argv[4:]
  multi, multi_args, _, _ = launch_probe.make_op(op, name, t)
  graph = {}
  for label in labels:
    graph[label] = jax.jit(lambda *a: multi(*a))
    with launch_probe.forced(launch_probe.parse_variant(label)):
      jax.block_until_ready(graph[label](*multi_args))
  layers = launch_probe.SETS
  per_call_events = {}  # the graph's GPU events a call, from the traced runs
  rows = {label: {"wall": [], "enqueue": [], "idle_enqueue": [], "kernels": [], "span": [],
                  "idle": []}
          for label in labels}
  for r in range(ROUNDS):
    for label in labels:
      fn, row = graph[label], rows[label]
      for _ in range(3):
        jax.block_until_ready(fn(*multi_args))
      wall, enqueue = wall_and_enqueue(fn, multi_args, CALLS)
      row["wall"].append(wall / layers)
      row["enqueue"].append(enqueue / layers)
      row["idle_enqueue"].append(enqueue_when_idle(fn, multi_args, CALLS // 4) / layers)
      events = gpu_events(fn, multi_args, TRACED_CALLS)
      calls = _timing.calls_in_trace(events, TRACED_CALLS)
      if calls is None:
        raise SystemExit(f"{label}: {len(events)} GPU events over {TRACED_CALLS} calls, not a "
                         "whole number a call")
      per_call_events[label] = len(calls[0])
      row["kernels"].append(statistics.median(
          sum(e - s for s, e in c) for c in calls) / layers * 1e-9)
      row["span"].append(statistics.median(c[-1][1] - c[0][0] for c in calls) / layers * 1e-9)
      row["idle"].append(statistics.median(
          b[0][0] - a[-1][1] for a, b in zip(calls, calls[1:])) * 1e-9)
    print(f"round {r + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
  if LIST_EVENTS:
    for label in labels:
      events, _ = _timing.profiled_calls(graph[label], multi_args, 4, names=True)
      last = events[-(len(events) // 4):]
      print(f"{label}: the last of 4 traced calls, its GPU events (start us from the first, us):")
      for start, end, event in last:
        print(f"  {(start - last[0][0]) / 1e3:8.2f} {(end - start) / 1e3:7.2f}  {event[:100]}")
  if HOST_EVENTS:
    for label in labels:
      _, host = _timing.profiled_calls(graph[label], multi_args, TRACED_CALLS)
      print(f"{label}: host runtime events, us per call (the {HOST_EVENTS} largest; nested "
            "events count in their parents too):")
      for event, ns in host.most_common(HOST_EVENTS):
        print(f"  {ns / TRACED_CALLS / 1e3:9.1f}  {event[:110]}")
  for label in labels:
    med = {k: statistics.median(v) * 1e6 for k, v in rows[label].items()}
    print(f"{op} {name} T={t} {label}: {per_call_events[label]} GPU events a call; per layer "
          f"wall {med['wall']:.1f} us, enqueue {med['enqueue']:.1f} us (after a finished call "
          f"{med['idle_enqueue']:.1f} us), kernels "
          f"{med['kernels']:.1f} us, first-to-last span {med['span']:.1f} us; GPU idle between "
          f"calls {med['idle']:.1f} us (medians of {ROUNDS} rounds)", flush=True)


if __name__ == "__main__":
  main()
