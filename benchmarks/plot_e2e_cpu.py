"""Bar chart of benchmarks/e2e_cpu_bench.py JSON files: decode and prompt tokens/s of each engine
(llama.cpp and jax_moeq variants), one panel pair per file (machine).

Run: python benchmarks/plot_e2e_cpu.py docs/data/e2e_cpu_*.json --out docs/e2e_cpu.png
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def load_rows(path: str) -> tuple[str, list[dict[str, Any]]]:
  """(title, rows) of one benchmark JSON: the machine line and its layer count, every row."""
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  layers = data["config"]["num_hidden_layers"]
  parts = data["machine_line"].split(", kernel")[0].split(", ")
  machine = ", ".join(p for p in parts if not p.startswith("avx"))  # CPU, cores, LLC
  return f"{machine}\n{layers} layers, {data['threads']} threads", data["rows"]


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("files", nargs="+")
  p.add_argument("--out", default="e2e_cpu.png")
  args = p.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = [load_rows(f) for f in args.files]
  fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.2 * len(panels)), squeeze=False)
  for (title, rows), pair in zip(panels, axes):
    names = [r["variant"] for r in rows]
    colors = ["tab:gray" if n.startswith("llama") else "tab:blue" for n in names]
    for ax, key, label in ((pair[0], "decode_tok_s", "batch-1 decode tok/s (median)"),
                           (pair[1], "prefill_tok_s", "prompt tok/s (median)")):
      values = [r[key] for r in rows]
      ax.barh(names, values, color=colors)
      for y, v in enumerate(values):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
      ax.set_xlabel(label)
      ax.set_title(title, fontsize=8)
      ax.invert_yaxis()
      ax.margins(x=0.15)
  fig.suptitle("Qwen3-30B-A3B-shaped model, same weights: llama.cpp (gray) and jax_moeq (blue)",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])
