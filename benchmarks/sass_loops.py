"""Static instruction counts of a kernel's loops, from `cuobjdump -sass` text: each backward branch
marks a loop, and its body's instructions are counted by opcode. No GPU is needed, so a main loop
can be trimmed here and checked by its instruction count before a device run. Run:
  nvcc ... -cubin -o k.cubin k.cu && cuobjdump -sass k.cubin > k.sass
  python3 benchmarks/sass_loops.py k.sass [--kernel NAME_PART] [--min 100]
cuobjdump ships in pip's nvidia-cuda-cuobjdump wheel (bin/cuobjdump) where the CUDA toolkit has
none. Predicated-off instructions still issue, so the static count of a branch-free loop is what
a warp issues per iteration.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling benchmarks
from sass_source_summary import opcode  # noqa: E402  (`@P0 LDG.E.128 R4, ...` -> LDG)

_FUNCTION = re.compile(r"\n\s*Function : ")
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def functions(text: str) -> dict[str, list[tuple[int, str]]]:
  """Each function's instructions as (address, text), by mangled name."""
  out = {}
  for part in _FUNCTION.split(text)[1:]:
    name, _, body = part.partition("\n")
    out[name.strip()] = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match,
                                                                       body.splitlines()) if m]
  return out


def loops(instructions: list[tuple[int, str]]) -> list[tuple[int, int, collections.Counter]]:
  """(first address, branch address, opcode counts) of every backward branch's body."""
  found = []
  for address, text in instructions:
    target = _BRANCH_TARGET.search(text)
    if target and int(target.group(1), 16) < address:
      start = int(target.group(1), 16)
      body = collections.Counter(opcode(t) for a, t in instructions if start <= a <= address)
      found.append((start, address, body))
  return found


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("sass")
  ap.add_argument("--kernel", default="", help="only functions whose name contains this")
  ap.add_argument("--min", type=int, default=100, help="only loops of at least this many")
  args = ap.parse_args()
  with open(args.sass) as f:
    text = f.read()
  for name, instructions in functions(text).items():
    if args.kernel not in name:
      continue
    print(f"{name}: {len(instructions)} instructions")
    for start, end, body in loops(instructions):
      total = sum(body.values())
      if total >= args.min:
        ops = ", ".join(f"{op} {n}" for op, n in body.most_common())
        print(f"  loop {start:#x}-{end:#x}: {total}: {ops}")


if __name__ == "__main__":
  main()
