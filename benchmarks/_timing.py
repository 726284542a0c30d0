"""Timing helpers shared by the benchmarks: median wall time after warm-up, a read-bandwidth
probe, the CPU's model, ISA flags and last-level cache, progress lines on stderr, and markdown
tables; the machine in one line (machine_info, machine_line: CPU, or GPU and its clocks); where
the benchmarks import jax_moeq from (use_source_tree_if_not_installed); and environment settings
applied for a while (env_applied: the CPU handlers read theirs per call)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np


def size_xla_pool_from_argv(argv: list[str]) -> int | None:
  """`--threads N` of a benchmark's arguments, set as XLA's CPU pool size (PJRT_NPROC): read
  before JAX starts, since XLA sizes the pool when its client is created. Returns N or None."""
  import argparse
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--threads", type=int)
  known, _ = parser.parse_known_args(argv)
  if known.threads is not None:
    os.environ["PJRT_NPROC"] = str(known.threads)
  return known.threads


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
  """Sustained read bandwidth in GB/s (1e9 B/s) of one `nbytes` array over `repeats` passes, by
  up to three probes: `threads` numpy uint64 sums over disjoint slices (numpy releases the GIL
  inside reductions), a jitted `jnp.sum` (XLA's own threading), and the CPU library's native
  probe when it is built. Each probe's figure is the median of its passes (on a shared virtual
  machine a single pass now and then reads ~1.5x faster than the rest). Returns {"numpy": ..,
  "xla": .., ["native": ..,] "best": ..}, "best" being the figure to use: the fastest probe.
  No one probe is fastest everywhere: on the 16-core Xeon host XLA's vectorised sum read 126 GB/s
  where the native probe's scalar loads reached 63, on the 2-core AMD EPYC numpy's threads beat
  both (2026-11-25); a fraction of the slower figure would overstate what the kernel reaches."""
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
    rates = []
    for _ in range(repeats):
      start = time.perf_counter()
      run()
      rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    result[name] = float(np.median(rates))
  del data, parts, device
  # The CPU library's probe: plain loads with independent sums (numpy's uint64 sum is bound by
  # its adds on one core: 17 GB/s where the loads alone give 29, AMD EPYC, 2026-11-25).
  try:
    from jax_moeq import _ffi
    result["native"] = float(_ffi.cpu_module().read_bandwidth_gbps(nbytes, threads,
                                                                    max(repeats, 7)))
  except (ImportError, AttributeError, RuntimeError):
    pass
  result["best"] = max(result.values())
  return result


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub markdown table; None cells print as an em dash."""
  cell = lambda v: "—" if v is None else str(v)
  lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


# ISA features worth naming beside a CPU figure (x86 /proc/cpuinfo flags, AArch64 Features).
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8",
             "amx_bf16", "asimddp", "i8mm", "sve")


def cpu_model_and_flags() -> tuple[str, set[str]]:
  """(model name, feature flags) from /proc/cpuinfo ("flags" on x86, "Features" on AArch64)."""
  model, flags = platform.processor() or platform.machine(), set()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
          model = value.strip()
        elif key in ("flags", "Features"):
          flags = set(value.split())
        if flags and model:
          break
  except OSError:
    pass
  return model, flags


def last_level_cache() -> tuple[int, int] | None:
  """(level, bytes) of cpu0's highest cache level from sysfs, or None where sysfs lacks it.
  On CPUs whose L3 is split between core complexes this is one complex's share."""
  best: tuple[int, int] | None = None
  for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
    try:
      level = int((index / "level").read_text())
      size = (index / "size").read_text().strip()
    except (OSError, ValueError):
      continue
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    if best is None or level > best[0]:
      best = (level, nbytes)
  return best


def usable_cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _nvidia_smi() -> dict[str, str] | None:
  fields = "name,clocks.sm,clocks.max.sm,clocks.mem,driver_version"
  try:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  first = out.strip().splitlines()[0] if out.strip() else ""
  values = [v.strip() for v in first.split(",")]
  return dict(zip(fields.split(","), values)) if len(values) == 5 else None


def _kernel_isa() -> str | None:
  try:
    from jax_moeq import _ffi
    return str(_ffi.cpu_module().selected_isa())
  except Exception:  # the CPU library is optional for GPU runs
    return None


def machine_info() -> dict[str, Any]:
  """CPU model, cores, ISA flags, LLC; the accelerator and its clocks (nvidia-smi) when present."""
  import jax
  cpu, flags = cpu_model_and_flags()
  llc = last_level_cache()
  info: dict[str, Any] = {
      "cpu": cpu, "cores": usable_cores(),
      "isa": [f for f in ISA_FLAGS if f in flags],
      "llc": None if llc is None else f"L{llc[0]} {llc[1] >> 20} MiB",
      "kernel_isa": _kernel_isa(), "platform": jax.default_backend(),
      "device": jax.devices()[0].device_kind, "jax": jax.__version__}
  if info["platform"] == "gpu":
    info["nvidia_smi"] = _nvidia_smi()
  return info


def machine_line(info: dict[str, Any]) -> str:
  """One short line naming the machine, printed beside every figure."""
  if info["platform"] == "gpu":
    smi = info.get("nvidia_smi") or {}
    clocks = (f", SM {smi['clocks.sm']} (max {smi['clocks.max.sm']}), mem {smi['clocks.mem']}"
              if smi else "")
    return f"{smi.get('name', info['device'])}{clocks}"
  isa = "+".join(f for f in info["isa"] if f != "avx512f") or "no avx2"
  return (f"{info['cpu']}, {info['cores']} cores, {isa}, {info['llc'] or 'LLC ?'}, kernel "
          f"{info['kernel_isa']}")


@contextlib.contextmanager
def env_applied(setting: dict[str, str]) -> Iterator[None]:
  """The process environment with `setting` applied, the old values restored on exit."""
  saved = {k: os.environ.get(k) for k in setting}
  os.environ.update(setting)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def profiled_calls(fn: Callable[..., Any], args: Sequence[Any], calls: int,
                   names: bool = False) -> tuple[list[tuple], dict[str, int]]:
  """`calls` back-to-back calls of fn(*args) under `jax.profiler`: (start_ns, end_ns) of every
  GPU stream event (kernels, copies), sorted (with `names`, (start_ns, end_ns, name)), and the
  host's runtime events as {name: total ns} (the Python line left out). Without a GPU the first
  list is empty."""
  import collections
  import glob
  import tempfile

  import jax
  from jax.profiler import ProfileData
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    data = ProfileData.from_file(path)
  events: list[tuple] = []
  host: collections.Counter = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if plane.name.startswith("/device:GPU") and line.name.startswith("Stream"):
        events.extend((int(e.start_ns), int(e.start_ns + e.duration_ns)) + ((e.name,) if names
                      else ()) for e in line.events)
      elif plane.name == "/host:CPU" and line.name != "python":
        for e in line.events:
          host[e.name] += int(e.duration_ns)
  return sorted(events), host


def split_calls(events: Sequence[tuple[int, int]], per_call: int
                ) -> list[Sequence[tuple[int, int]]]:
  """Events grouped by call, `per_call` each (a graph's events are the same every call); a
  trailing partial call is left out."""
  return [events[i:i + per_call] for i in range(0, len(events) - per_call + 1, per_call)]


def calls_in_trace(events: Sequence[tuple[int, int]], calls: int
                   ) -> list[Sequence[tuple[int, int]]] | None:
  """The GPU events of `calls` back-to-back traced calls grouped by call, the first two left out
  (the trace starts them cold); None when there are none, or when they do not divide into the
  calls evenly."""
  if not events or len(events) % calls:
    return None
  return split_calls(events, len(events) // calls)[2:]


def gpu_span_per_call(fn: Callable[..., Any], args: Sequence[Any], calls: int = 24
                      ) -> float | None:
  """Median seconds from a call's first GPU event start to its last event end, over `calls`
  back-to-back calls (the first two left out: the trace starts them cold). The GPU's own time
  for a call's work, without the host's dispatch, which sets the wall time of calls whose GPU
  work is short (docs/gpu_notes.md, "Measuring on the GPU"). None without GPU events, or when
  the events do not divide into the calls evenly."""
  import jax
  jax.block_until_ready(fn(*args))
  grouped = calls_in_trace(profiled_calls(fn, args, calls)[0], calls)
  if not grouped:
    return None
  return statistics.median(c[-1][1] - c[0][0] for c in grouped) * 1e-9
