"""Runs launch_probe's 8-layer graph of one op, shape and T a few times, for a per-kernel trace
under Nsight Compute (kernels serialized, so each duration is the kernel alone):
  ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      -k "regex:Align|Finalize|MoeInt4|MxInt4|Permute|DecodeLayer|W4a8" \
      python3 benchmarks/layer_trace.py wna16 Qwen3-30B-A3B 16 [variant] > /tmp/ncu.csv
  python3 benchmarks/layer_trace.py --summary /tmp/ncu.csv
The summary keeps the last call's kernels (warm) and prints each kernel's mean duration and the
sum per layer, in us, to set against the benchmark's in-graph time per layer.
"""

import csv
import os
import statistics
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()
import launch_probe  # noqa: E402

CALLS = 3
LAYERS = launch_probe.SETS


def summarize(path: str):
  with open(path, newline="") as f:
    lines = f.read().splitlines()
  header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
  if header is None:  # ncu wrote no kernel table: it failed or traced nothing
    sys.exit(f"no ncu kernel table in {path} (see the ncu log beside it)")
  rows = [r for r in csv.DictReader(lines[header:])
          if r["Metric Name"] == "gpu__time_duration.sum"]
  rows = rows[-len(rows) // CALLS:]
  unit = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
  names = [r["Kernel Name"].split("(")[0].split("::")[-1] for r in rows]
  values = [float(r["Metric Value"].replace(",", "")) * unit[r["Metric Unit"]] for r in rows]
  per_layer = len(rows) // LAYERS
  for j in range(per_layer):  # the j-th kernel of every layer
    durations = values[j::per_layer]
    print(f"{names[j][:60]:60s} mean {statistics.mean(durations):8.2f} us "
          f"(min {min(durations):.2f}, max {max(durations):.2f})")
  print(f"kernels per layer: {sum(values) / LAYERS:.1f} us")


def main():
  if sys.argv[1] == "--summary":
    summarize(sys.argv[2])
    return
  op, name, t = sys.argv[1], sys.argv[2], int(sys.argv[3])
  variant = sys.argv[4] if len(sys.argv) > 4 else "auto"  # a launch_probe variant, e.g. auto/fused
  multi, multi_args, _, _ = launch_probe.make_op(op, name, t)
  graph = jax.jit(lambda *a: multi(*a))
  with launch_probe.forced(launch_probe.parse_variant(variant)):
    for _ in range(CALLS):
      jax.block_until_ready(graph(*multi_args))


if __name__ == "__main__":
  main()
