"""Why one process times a CPU MoE layer fast and the next slow: per-call times of the chained
layers (cpu_moe_bench.py's harness: layers in one jit, weights colder than the LLC, fresh
routings) beside what the kernel's threads were doing while they ran.

A sampler thread reads /proc/self/task/*/stat every `--sample-ms` during the timed calls: which
threads are runnable ('R') and on which CPU each last ran. From the samples it reports
- how many threads were runnable (the pool is `--threads`, and XLA's caller thread);
- how often two runnable threads sat on one CPU (a run queue shared: one waits);
- how often two ran on SMT siblings of one core (they share its execution units, AMX included);
and the process's involuntary context switches per call. One JSON line on stdout.

    python benchmarks/cpu_spread_probe.py --shape olmoe --tokens 512 --threads 16 --calls 40
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

_timing.size_xla_pool_from_argv(sys.argv[1:])


def core_of_cpu() -> dict[int, tuple[int, int]]:
  """cpu -> (package, core) from sysfs (empty where sysfs has no topology)."""
  out = {}
  base = "/sys/devices/system/cpu"
  for name in os.listdir(base) if os.path.isdir(base) else []:
    if not (name.startswith("cpu") and name[3:].isdigit()):
      continue
    try:
      with open(f"{base}/{name}/topology/core_id") as f:
        core = int(f.read())
      with open(f"{base}/{name}/topology/physical_package_id") as f:
        package = int(f.read())
    except OSError:
      continue
    out[int(name[3:])] = (package, core)
  return out


def runnable_threads(exclude: int) -> list[tuple[int, str]]:
  """(CPU it last ran on, thread name) of each runnable thread of this process but `exclude`.
  XLA's CPU pool threads are named tf_XLAEigen; the Python threads python."""
  out = []
  for tid in os.listdir("/proc/self/task"):
    if int(tid) == exclude:
      continue
    try:
      with open(f"/proc/self/task/{tid}/stat") as f:
        stat = f.read()
    except OSError:
      continue
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "R":
      out.append((int(fields[36]), name))  # field 39 of stat(5), 'processor'
  return out


class Sampler:
  """Samples `runnable_threads` on its own thread until stopped."""

  def __init__(self, period_s: float, cores: dict[int, tuple[int, int]]):
    self.period_s, self.cores = period_s, cores
    self.samples: list[list[tuple[int, str]]] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    me = threading.get_native_id()
    while not self._stop.is_set():
      self.samples.append(runnable_threads(me))
      time.sleep(self.period_s)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()

  def summary(self) -> dict:
    runnable, same_cpu, same_core, cpus_seen = [], 0, 0, set()
    name_total, name_max = collections.Counter(), collections.Counter()
    for sample in self.samples:
      cpus = [c for c, _ in sample]
      for name, count in collections.Counter(n for _, n in sample).items():
        name_total[name] += count
        name_max[name] = max(name_max[name], count)
      runnable.append(len(cpus))
      cpus_seen.update(cpus)
      if len(set(cpus)) < len(cpus):
        same_cpu += 1
      cores = [self.cores.get(c, (0, c)) for c in set(cpus)]
      if len(set(cores)) < len(cores):
        same_core += 1
    n = max(1, len(self.samples))
    return {"samples": len(self.samples),
            "runnable_mean": sum(runnable) / n,
            "runnable_max": max(runnable, default=0),
            "share_same_cpu": same_cpu / n,
            "share_smt_siblings": same_core / n,
            "cpus_seen": len(cpus_seen),
            "runnable_by_name": {name: {"mean": name_total[name] / n, "max": name_max[name]}
                                 for name in sorted(name_total)}}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", default="olmoe")
  p.add_argument("--tokens", type=int, default=512)
  p.add_argument("--threads", type=int, help="XLA's CPU pool (PJRT_NPROC), read at start")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--calls", type=int, default=40)
  p.add_argument("--sample-ms", type=float, default=2.0)
  p.add_argument("--group-size", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  _timing.use_source_tree_if_not_installed()
  import jax
  import numpy as np
  import cpu_moe_bench as bench

  shape = bench.SHAPES[args.shape]
  h = shape.hidden_size
  packed = bench.packed_layers(shape, args.group_size, args.layers, args.seed)
  ring = bench.routing_ring(shape, args.tokens, 16, args.seed)
  stack = bench.ours_stack_fn(shape, args.group_size)
  x = jax.random.normal(jax.random.key(0), (args.tokens, h)).astype(jax.numpy.bfloat16)
  call = bench.ring_call(stack, x, ring, packed)
  for j in range(3):
    jax.block_until_ready(call(j))
  times, faults = [], []
  before = resource.getrusage(resource.RUSAGE_SELF)
  with Sampler(args.sample_ms / 1e3, core_of_cpu()) as sampler:
    for j in range(args.calls):
      start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      start = time.perf_counter()
      jax.block_until_ready(call(j))
      times.append((time.perf_counter() - start) / args.layers)
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults)
  after = resource.getrusage(resource.RUSAGE_SELF)
  t = np.asarray(times) * 1e3
  result = {
      "shape": args.shape, "tokens": args.tokens, "threads": args.threads, "pid": os.getpid(),
      "ms_per_layer": {"median": float(np.median(t)), "min": float(t.min()),
                       "p10": float(np.percentile(t, 10)), "p90": float(np.percentile(t, 90)),
                       "max": float(t.max())},
      "calls_ms": [round(float(v), 3) for v in t],
      "calls_minor_faults": faults,  # page faults during each call (first touches of memory)
      "involuntary_switches_per_call": (after.ru_nivcsw - before.ru_nivcsw) / args.calls,
      "voluntary_switches_per_call": (after.ru_nvcsw - before.ru_nvcsw) / args.calls,
      "affinity_cpus": len(os.sched_getaffinity(0)),
      "workers_env": os.environ.get("JAX_MOEQ_CPU_WORKERS"),
      "load": os.getloadavg()[0],
      **sampler.summary()}
  print(json.dumps(result), flush=True)
  m = result["ms_per_layer"]
  print(f"# process {result['pid']} (T={args.tokens}, JAX_MOEQ_CPU_WORKERS="
        f"{result['workers_env'] or 'unset'}): median {m['median']:.2f} ms (min {m['min']:.2f}, max "
        f"{m['max']:.2f}); runnable {result['runnable_mean']:.1f} (max "
        f"{result['runnable_max']}), same CPU {100 * result['share_same_cpu']:.0f} %, SMT "
        f"siblings {100 * result['share_smt_siblings']:.0f} %, {result['cpus_seen']} CPUs, "
        f"{result['involuntary_switches_per_call']:.0f} involuntary switches a call, "
        f"{sum(faults) / len(faults):.0f} page faults a call (first call {faults[0]}, last "
        f"{faults[-1]}); runnable by "
        "name " + ", ".join(f"{k} {v['mean']:.1f} (max {v['max']})"
                            for k, v in result["runnable_by_name"].items()), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
