"""Plots the GPU benchmarks' share of the int4 roofline against T, one panel per shape: our ops
and their peers from the JSON that `gpu_moe_bench.py --json` (WNA16 beside XLA's bf16
`ragged_dot` and torch's grouped GEMM), `mxint4_bench.py --json`, `w4a8_gpu_bench.py --json` and
`tokamax_bench.py --json` write (benchmarks/gpu_table.sh runs them all). Each figure row is one
JSON list, so a row holds one machine's run.

The roofline of a layer is max(int4 weight bytes of the experts hit / copy rate, GEMM FLOPs /
--peak-flops), the same work for every op of a row; an op's share is that time over its own. A
peer that reads other bytes (bf16 weights for `ragged_dot`) is held to the same int4 roofline,
so the plot reads as time against the best an int4 layer can do. Needs matplotlib (the `bench`
extra). Run:
  python3 benchmarks/plot_gpu_roofline.py \
      --json wna16.json,mxint4.json,w4a8.json,tokamax_a.json,tokamax_b.json --out docs/gpu_roofline.png
"""

from __future__ import annotations

import argparse
import json

SHAPE_ORDER = ("Mixtral-8x7B", "Qwen3-30B-A3B", "DeepSeek-V2-Lite")


# The label of each timed op, by the key of its figure in the JSON rows. WNA16 is timed in every
# file (each peer beside it); the first file of a row that has a point keeps it.
PEER_LABELS = {"wna16": "ours WNA16", "ours": "ours WNA16", "w4a8": "ours W4A8",
               "tokamax": "tokamax ragged_dot (int4)"}
MOE_BENCH_PEERS = {"ragged_us": "XLA ragged_dot (bf16)", "torch_us": "torch _grouped_mm (bf16)"}


def _roofline_seconds(r: dict, copy: float, peak_flops: float) -> float:
  """A gpu_moe_bench row's roofline time: max(int4 bytes of the experts hit / copy rate, FLOPs /
  peak), from the row's own rates and time."""
  sec = r["us"] * 1e-6
  return max(r["tbps"] * 1e12 * sec / copy, r["tflops"] * 1e12 * sec / peak_flops)


def load_row_group(specs: list[str], peak_flops: float
                   ) -> tuple[str, dict[str, dict[tuple[str, int], float]]]:
  """One figure row: the device and, per op label, {(shape, T): % of the roofline}.

  specs: JSON paths, of gpu_moe_bench.py / mxint4_bench.py (the op in `us`, named by the file's
  `op`, WNA16 by default; a spec "NAME=path" names it) or of a peer benchmark (`<op>_us` keys).
  Every op of a point is held to one roofline: that of the first gpu_moe_bench-format file with
  the point, else the peer file's own int4 bytes (`<op>_hbm_frac`)."""
  device, series, roof = "", {}, {}
  docs = []
  for spec in specs:
    name, _, path = spec.rpartition("=")
    with open(path) as f:
      docs.append((name, json.load(f)))
  for name, doc in docs:  # the rooflines first, from the files that carry the byte rates
    if "copy_tbps" in doc:
      for r in doc["rows"]:
        roof.setdefault((r["shape"], r["T"]),
                        _roofline_seconds(r, doc["copy_tbps"] * 1e12, peak_flops))

  def add(label, point, seconds):
    if seconds and point in roof:
      series.setdefault(label, {}).setdefault(point, 100 * roof[point] / seconds)

  for name, doc in docs:
    device = doc.get("device", device)
    if "copy_tbps" in doc:
      op = name or doc.get("op", "WNA16")
      for r in doc["rows"]:
        point = (r["shape"], r["T"])
        add(f"ours {op}", point, r["us"] * 1e-6)
        for key, label in MOE_BENCH_PEERS.items():
          add(label, point, (r.get(key) or 0) * 1e-6)
      continue
    labels = sorted({k[:-3] for r in doc["rows"] for k in r if k.endswith("_us")})
    for r in doc["rows"]:
      point = (r["shape"], r["T"])
      if point not in roof:  # no gpu_moe_bench file with this point: the peer file's own bytes
        ref = next((l for l in labels if r.get(l + "_us") and r.get(l + "_hbm_frac")), None)
        if ref is None:
          continue
        sec = r[ref + "_us"] * 1e-6
        roof[point] = max(r[ref + "_hbm_frac"] * sec, r[ref + "_tflops"] * 1e12 * sec / peak_flops)
      for op in labels:
        add(PEER_LABELS.get(op, op), point, (r.get(op + "_us") or 0) * 1e-6)
  return device, series


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", action="append", required=True,
                  help="one figure row: comma-separated JSON files of one machine's run "
                       "(NAME=path names the op of a gpu_moe_bench-format file)")
  ap.add_argument("--peak-flops", type=float, default=700e12)
  ap.add_argument("--target", type=float, default=80.0, help="a dashed line at this share")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  groups = [load_row_group(spec.split(","), args.peak_flops) for spec in args.json]
  fig, axes = plt.subplots(len(groups), len(SHAPE_ORDER), figsize=(13, 3.6 * len(groups)),
                           squeeze=False, sharey=True)
  for row, (device, series) in enumerate(groups):
    for col, shape in enumerate(SHAPE_ORDER):
      ax = axes[row][col]
      for label, points in series.items():
        ts = sorted(t for s, t in points if s == shape)
        if ts:
          ax.plot(ts, [points[(shape, t)] for t in ts], marker="o", label=label,
                  linestyle="-" if label.startswith("ours") else "--")
      ax.axhline(args.target, color="gray", linestyle="--", linewidth=0.8)
      ax.set_xscale("log", base=2)
      ax.set_ylim(0, 100)
      ax.grid(True, which="both", alpha=0.3)
      ax.set_title(f"{shape} ({device})", fontsize=9)
      ax.set_xlabel("tokens T")
      if col == 0:
        ax.set_ylabel("% of the int4 roofline")
    axes[row][0].legend(fontsize=8, loc="upper right")
  fig.suptitle("int4 MoE layer: time at the roofline max(int4 bytes / copy rate, "
               f"FLOPs / {args.peak_flops / 1e12:.0f} TFLOP/s) over each op's time", fontsize=10)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
