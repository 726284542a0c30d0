"""Decode tokens/s of benchmarks/model_bench.py's variants beside their roofline (weight bytes
per decode step over the memory rate), one panel per batch size.

Run: python benchmarks/plot_model_roofline.py docs/data/model_h100_l48.json --out docs/model_h100.png
     [--bandwidth-gbs 2990]  (the rate to draw the roofline at; default: the run's own)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def roofline_rows(path: str, bandwidth_gbs: float | None = None
                  ) -> tuple[str, dict[int, list[dict[str, Any]]]]:
  """(machine, {batch: [{variant, decode_tok_s, roofline_tok_s}]}) of one model_bench.py JSON;
  the roofline at `bandwidth_gbs` when given, else at the rate the run measured."""
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  by_batch: dict[int, list[dict[str, Any]]] = {}
  machine = ""
  for r in data["rows"]:
    machine = r["machine"]
    rate = (bandwidth_gbs or r["weight_bandwidth_gb_s"]) * 1e9
    step_s = r["decode_read_mb"]["total"] * 1e6 / rate
    by_batch.setdefault(r["batch"], []).append(
        {"variant": r["variant"], "decode_tok_s": r["decode_tok_s"],
         "roofline_tok_s": r["batch"] / step_s})
  return machine, by_batch


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("json")
  p.add_argument("--out", default="model_roofline.png")
  p.add_argument("--bandwidth-gbs", type=float, default=None)
  args = p.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  machine, by_batch = roofline_rows(args.json, args.bandwidth_gbs)
  fig, axes = plt.subplots(1, len(by_batch), figsize=(5 * len(by_batch), 3.2), squeeze=False)
  for ax, (batch, rows) in zip(axes[0], sorted(by_batch.items())):
    names = [r["variant"] for r in rows]
    ax.barh(names, [r["roofline_tok_s"] for r in rows], color="lightgray", label="roofline")
    ax.barh(names, [r["decode_tok_s"] for r in rows], color="tab:blue", height=0.5,
            label="measured")
    for y, r in enumerate(rows):
      ax.text(r["decode_tok_s"], y, f" {r['decode_tok_s']:.0f} "
              f"({r['decode_tok_s'] / r['roofline_tok_s']:.0%})", va="center", fontsize=8)
    ax.set_title(f"batch {batch}", fontsize=9)
    ax.set_xlabel("decode tok/s")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
  fig.suptitle(f"decode against the weight-bytes roofline: {machine}", fontsize=9)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])
