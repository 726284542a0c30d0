"""Plots the GPU benchmarks' share of the int4 roofline against T, one panel per shape: ours and
its peers from the JSON that `gpu_moe_bench.py --json` (ours beside XLA's bf16 `ragged_dot`) and
`tokamax_bench.py --json` / `w4a8_gpu_bench.py --json` (ours beside a peer) write. Each figure row
is one JSON list, so a row holds one machine's run.

The roofline of a layer is max(int4 weight bytes of the experts hit / copy rate, GEMM FLOPs /
--peak-flops), the same work for every op of a row; an op's share is that time over its own. A
peer that reads other bytes (bf16 weights for `ragged_dot`) is held to the same int4 roofline,
so the plot reads as time against the best an int4 layer can do. Needs matplotlib (the `bench`
extra). Run:
  python3 benchmarks/plot_gpu_roofline.py --json wna16.json --json tokamax_a.json,tokamax_b.json \
      --out docs/gpu_roofline.png
"""

from __future__ import annotations

import argparse
import json

SHAPE_ORDER = ("Mixtral-8x7B", "Qwen3-30B-A3B", "DeepSeek-V2-Lite")


def load_row_group(paths: list[str], peak_flops: float
                   ) -> tuple[str, dict[str, dict[tuple[str, int], float]]]:
  """One figure row: the device and, per op label, {(shape, T): % of the roofline}."""
  device, series = "", {}
  for path in paths:
    with open(path) as f:
      doc = json.load(f)
    device = doc.get("device", device)
    if "copy_tbps" in doc:  # gpu_moe_bench.py: ours as `us`, XLA's ragged_dot as `ragged_us`
      copy = doc["copy_tbps"] * 1e12
      ops = {"ours (WNA16)": "us", "XLA ragged_dot (bf16)": "ragged_us"}
      for r in doc["rows"]:
        sec = r["us"] * 1e-6
        roof = max(r["tbps"] * 1e12 * sec / copy, r["tflops"] * 1e12 * sec / peak_flops)
        for label, key in ops.items():
          if r.get(key):
            series.setdefault(label, {})[(r["shape"], r["T"])] = 100 * roof / (r[key] * 1e-6)
    else:  # peer_rows: label_us, label_tflops, label_hbm_frac (bytes / time / copy rate)
      labels = sorted({k[:-3] for r in doc["rows"] for k in r if k.endswith("_us")})
      for r in doc["rows"]:
        ref = next((l for l in labels if r.get(l + "_us")), None)
        if ref is None:  # every op of this point failed
          continue
        sec = r[ref + "_us"] * 1e-6
        roof = max(r[ref + "_hbm_frac"] * sec, r[ref + "_tflops"] * 1e12 * sec / peak_flops)
        for label in labels:
          if r.get(label + "_us"):
            series.setdefault(label, {})[(r["shape"], r["T"])] = (
                100 * roof / (r[label + "_us"] * 1e-6))
  return device, series


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", action="append", required=True,
                  help="one figure row: comma-separated JSON files of one machine's run")
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
          ax.plot(ts, [points[(shape, t)] for t in ts], marker="o", label=label)
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
