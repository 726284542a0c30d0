"""Timing helpers shared by the benchmarks: median wall time after warm-up, a read-bandwidth
probe, progress lines on stderr, and markdown tables; and where the benchmarks import jax_moeq
from (use_source_tree_if_not_installed)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np


def use_source_tree_if_not_installed() -> None:
  """Lets a script under benchmarks/ import jax_moeq. An importable jax_moeq (the installed
  package, or the tree named by PYTHONPATH) is used as it is; only when there is none does the
  source tree above benchmarks/ go on sys.path (a dev build: scripts/dev_build.sh). Putting the
  tree first in every case would shadow an installed package with a tree whose native libraries
  may not be built."""
  if importlib.util.find_spec("jax_moeq") is None:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def progress(message: str) -> None:
  """One progress line on stderr (stdout carries the results)."""
  print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def block(value: Any) -> Any:
  """Waits for JAX arrays (any pytree); other values pass through."""
  import jax
  return jax.block_until_ready(value)


def median_time(call: Callable[[int], Any], *, warmup: int = 2, min_repeats: int = 3,
                max_repeats: int = 50, target_seconds: float = 1.0,
                budget_seconds: float | None = None,
                all_times: list[float] | None = None) -> tuple[float | None, int]:
  """Median seconds of `call(i)` (i = 0, 1, ... so callers can vary inputs between calls).

  Warm-up calls (compilation included) are not timed. Timed calls continue until
  `target_seconds` of timed work and at least `min_repeats` calls, at most `max_repeats`.
  With `budget_seconds`, gives up (returns (None, calls)) when the first timed call alone
  shows that `min_repeats` calls would not fit; a single call that fits is still reported.

  Returns:
    (median seconds or None, number of timed calls); `all_times`, if given, receives every
    timed call's seconds.
  """
  i = 0
  for _ in range(warmup):
    block(call(i))
    i += 1
  times: list[float] = []
  spent = 0.0
  while len(times) < max_repeats:
    start = time.perf_counter()
    block(call(i))
    elapsed = time.perf_counter() - start
    i += 1
    times.append(elapsed)
    spent += elapsed
    if len(times) >= min_repeats and spent >= target_seconds:
      break
    if budget_seconds is not None and spent + elapsed > budget_seconds:
      break
  if all_times is not None:
    all_times.extend(times)
  return statistics.median(times), len(times)


def read_bandwidth_gbps(nbytes: int = 1 << 30, threads: int = 2, repeats: int = 5
                        ) -> dict[str, float]:
  """Sustained read bandwidth in GB/s (1e9 B/s) of one `nbytes` array, best of `repeats`, by
  two probes: `threads` numpy uint64 sums over disjoint slices (numpy releases the GIL inside
  reductions; integer sums are not compute-bound the way float32 pairwise sums are), and a
  jitted `jnp.sum` (XLA's own threading). Returns {"numpy": .., "xla": .., "best": ..}."""
  import jax
  import jax.numpy as jnp
  data = np.ones(nbytes // 8, np.uint64)
  parts = np.array_split(data, threads)

  def numpy_pass() -> None:
    workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
    for w in workers:
      w.start()
    for w in workers:
      w.join()

  device = jnp.ones(nbytes // 4, jnp.float32)
  total = jax.jit(jnp.sum)
  total(device).block_until_ready()
  result = {}
  for name, run in (("numpy", numpy_pass), ("xla", lambda: total(device).block_until_ready())):
    best = 0.0
    for _ in range(repeats):
      start = time.perf_counter()
      run()
      best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    result[name] = best
  del data, parts, device
  result["best"] = max(result["numpy"], result["xla"])
  return result


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub markdown table; None cells print as an em dash."""
  cell = lambda v: "—" if v is None else str(v)
  lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)
