"""Sums an ncu source-page export (`ncu -i R --page source --csv --print-source sass`): executed
warp-instructions and warp-stall samples by opcode, and the hottest instructions in address
order, so that a kernel's instruction budget can be split between its loops. Run:
  python3 benchmarks/sass_source_summary.py source.csv [--top 60]
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re


def _number(text: str) -> float:
  text = text.replace(",", "").strip()
  try:
    return float(text)
  except ValueError:
    return 0.0


def read_rows(path: str) -> tuple[list[str], list[dict[str, str]]]:
  """The CSV's header and rows; ncu may print lines before the header, which names `Source`."""
  with open(path, newline="") as f:
    lines = f.read().splitlines()
  start = next((i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Source")
                or ",Source," in line), None)
  if start is None:
    raise SystemExit(f"{path}: no header with a Source column")
  reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
  return list(reader.fieldnames or []), list(reader)


def column(header: list[str], *needles: str) -> str | None:
  """The first column whose name holds every needle (case-insensitive)."""
  for name in header:
    if all(n.lower() in name.lower() for n in needles):
      return name
  return None


def opcode(source: str) -> str:
  words = source.split()
  if words and words[0].startswith("@"):
    words = words[1:]
  return words[0].rstrip(";").split(".")[0] if words else "?"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("csv")
  ap.add_argument("--top", type=int, default=60)
  args = ap.parse_args()
  header, rows = read_rows(args.csv)
  # Warp-level "Instructions Executed", not "Thread Instructions Executed".
  executed = next((h for h in header if h.lower().startswith("instructions executed")), None)
  samples = column(header, "Warp Stall Sampling", "All") or column(header, "Sampling")
  address = column(header, "Address")
  # Each reason's all-samples column; its "(Not Issued)" twin is a subset of it.
  stall_columns = [h for h in header if re.search(r"stall_|Stall Reason|smsp__pcsamp", h)
                   and h != samples and "not issued" not in h.lower()]
  print(f"columns: executed={executed!r} samples={samples!r} address={address!r}; "
        f"{len(stall_columns)} stall columns")
  total_exec = sum(_number(r.get(executed, "0")) for r in rows) if executed else 0.0
  total_samples = sum(_number(r.get(samples, "0")) for r in rows) if samples else 0.0
  by_op_exec, by_op_samples = collections.Counter(), collections.Counter()
  for r in rows:
    op = opcode(r.get("Source", ""))
    by_op_exec[op] += _number(r.get(executed, "0")) if executed else 0
    by_op_samples[op] += _number(r.get(samples, "0")) if samples else 0
  print(f"{len(rows)} instructions; {total_exec:.4g} warp-instructions executed; "
        f"{total_samples:.4g} stall samples")
  print(f"{'opcode':14} {'executed':>12} {'%':>6} {'samples':>9} {'%':>6}")
  for op, n in by_op_exec.most_common(30):
    print(f"{op:14} {n:12.4g} {100 * n / max(total_exec, 1):6.1f} {by_op_samples[op]:9.0f} "
          f"{100 * by_op_samples[op] / max(total_samples, 1):6.1f}")
  hot = sorted(rows, key=lambda r: -(_number(r.get(samples, "0")) if samples else 0))[:args.top]
  hot_ids = {id(r) for r in hot}
  print(f"\nthe {args.top} instructions with most stall samples, in address order "
        "(address, executed, samples, top stall reasons, instruction):")
  for r in rows:
    if id(r) not in hot_ids:
      continue
    reasons = sorted(((_number(r.get(c, "0")), c) for c in stall_columns), reverse=True)[:2]
    why = ", ".join(f"{c.split('(')[0].strip()[-28:]}={v:.0f}" for v, c in reasons if v > 0)
    print(f"{r.get(address, '?'):>8} {_number(r.get(executed, '0')):10.4g} "
          f"{_number(r.get(samples, '0')):7.0f}  {why:60.60}  {r.get('Source', '')[:70]}")


if __name__ == "__main__":
  main()
