"""Expert parallelism on GPUs, three panels: the DeepSeek-V3-shaped layer's time per dispatch
beside one GPU holding E/n experts, the weak-scaling efficiency of every shape and dispatch
against the 80 % target (benchmarks/ep_gpu_bench.py JSON), and the exchanges' GB/s per GPU
beside DeepEP's intranode figure (benchmarks/ep_exchange_gpu_bench.py JSONs, as merged in
docs/data/ep_exchange_h200x2.json).

Run: python benchmarks/plot_ep_gpu.py docs/data/ep_gpu_bench_h200x4.json \\
         docs/data/ep_exchange_h200x2.json --out docs/ep_gpu.png
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEEPEP_GBS = 150.0  # DeepEP's intranode normal kernels over NVLink, per GPU


def layer_series(rows: list[dict[str, Any]], shape: str = "dsv3"
                 ) -> dict[str, list[tuple[int, float]]]:
  """{label: [(tokens per GPU, layer us)]}: each dispatch on n GPUs, and the weak-scaling
  baseline (one GPU holding E/n experts: layer time x efficiency)."""
  out: dict[str, list[tuple[int, float]]] = {}
  for r in rows:
    if r["shape"] != shape or r["gpus"] == 1:
      continue
    out.setdefault(f"{r['gpus']} GPUs, {r['dispatch']}", []).append(
        (r["tokens_per_gpu"], r["layer_us"]))
    if r["weak_scaling"]:
      base = out.setdefault(f"1 GPU, E/{r['gpus']} experts", [])
      if all(t != r["tokens_per_gpu"] for t, _ in base):
        base.append((r["tokens_per_gpu"], r["layer_us"] * r["weak_scaling"]))
  return {k: sorted(v) for k, v in out.items()}


def scaling_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
  """{label: [(tokens per GPU, weak-scaling efficiency)]} of every shape, GPU count and dispatch."""
  out: dict[str, list[tuple[int, float]]] = {}
  for r in rows:
    if r["gpus"] > 1 and r["weak_scaling"]:
      out.setdefault(f"{r['shape']}, {r['gpus']} GPUs, {r['dispatch']}", []).append(
          (r["tokens_per_gpu"], r["weak_scaling"]))
  return {k: sorted(v) for k, v in out.items()}


def exchange_series(data: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
  """{label: [(tokens per GPU, GB/s per GPU)]} of every setting's successful rows."""
  out: dict[str, list[tuple[int, float]]] = {}
  for setting, run in data["runs"].items():
    for r in run["rows"]:
      op = r["op"]
      label = op if op != "ragged_all_to_all" else f"{op} ({setting})"
      if op != "ragged_all_to_all" and setting != "default":
        continue
      out.setdefault(label, []).append((r["tokens_per_gpu"], r["gbps"]))
  return {k: sorted(v) for k, v in out.items()}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("bench_json")
  p.add_argument("exchange_json")
  p.add_argument("--out", default="docs/ep_gpu.png")
  args = p.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(args.bench_json, encoding="utf-8") as f:
    bench = json.load(f)
  with open(args.exchange_json, encoding="utf-8") as f:
    exchange = json.load(f)
  fig, (a, c, b) = plt.subplots(1, 3, figsize=(17, 4.8))
  gpus = [d.split(",")[0] for d in bench["environment"].get("gpus", [])]
  for label, pts in layer_series(bench["rows"]).items():
    style = "k--" if label.startswith("1 GPU") else "o-"
    a.plot([t for t, _ in pts], [us / 1e3 for _, us in pts], style, label=label)
  a.set_xscale("log")
  a.set_yscale("log")
  a.set_xlabel("tokens per GPU")
  a.set_ylabel("ms per layer")
  a.set_title("DeepSeek-V3-shaped layer (E=256, top-8, H=7168, I=2048), WNA16", fontsize=9)
  a.legend(fontsize=8)
  for label, pts in scaling_series(bench["rows"]).items():
    c.plot([t for t, _ in pts], [100 * e for _, e in pts], "o-", label=label)
  c.axhline(80, color="gray", ls=":", label="target (T >= 1024)")
  c.set_xscale("log")
  c.set_ylim(0, 100)
  c.set_xlabel("tokens per GPU")
  c.set_ylabel("weak scaling, %")
  c.set_title("weak scaling: t(1 GPU, E/n experts) / t(n GPUs)", fontsize=9)
  c.legend(fontsize=7)
  for label, pts in exchange_series(exchange).items():
    b.plot([t for t, _ in pts], [g for _, g in pts], "o-", label=label)
  b.axhline(DEEPEP_GBS, color="gray", ls=":", label="DeepEP intranode (published)")
  b.set_xscale("log")
  ticks = sorted({t for pts in exchange_series(exchange).values() for t, _ in pts})
  b.set_xticks(ticks, [str(t) for t in ticks])
  b.minorticks_off()
  b.set_xlabel("tokens per GPU (x8 pairs, rows of 7168 bf16)")
  b.set_ylabel("GB/s per GPU")
  b.set_title(f"exchanges alone (psum: bus bandwidth)\n{exchange.get('machine', '')}",
              fontsize=9)
  b.legend(fontsize=8)
  fig.suptitle(f"{bench.get('machine', ', '.join(sorted(set(gpus))))} "
               f"{bench.get('date', '')}", fontsize=9)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
