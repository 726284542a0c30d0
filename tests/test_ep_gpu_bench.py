"""benchmarks/ep_gpu_bench.py runs end to end: a smoke run on 2 virtual CPU devices (the tiny
shape, the jnp reference experts), its table and JSON rows; the exchange-bytes formulas."""

import json
import os
import subprocess
import sys

import numpy as np

import jax_moeq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ep_gpu_bench  # noqa: E402


def test_exchange_bytes_formulas():
  counts = np.array([[10, 30], [20, 20]])  # source GPU s -> pairs bound for GPU d
  h = 64
  # replicated, 20 tokens a GPU: the bf16 all-gather of the [n T, H] tokens ((n-1)/n per GPU)
  # and a ring all-reduce of their float32 outputs (2 (n-1)/n); from 64 a GPU a reduce-scatter
  # ((n-1)/n).
  assert ep_gpu_bench.exchange_bytes(2, 20, 2, h, "replicated", 2.0, counts) == (
      20 * h * 2 + 2 * 20 * h * 4)
  assert ep_gpu_bench.exchange_bytes(2, 64, 2, h, "replicated", 2.0, counts) == (
      64 * h * 2 + 64 * h * 4)
  # all_to_all: C = ceil(2 * 20 * 2 / 2) = 40 rows per destination, one round.
  assert ep_gpu_bench.exchange_bytes(2, 20, 2, h, "all_to_all", 2.0, counts) == (
      2 * 2 * 40 * h * 2 + 2 * 40 * 8)
  # ragged: the filled rows out and back (+ id and weight), mean over the source GPUs.
  assert ep_gpu_bench.exchange_bytes(2, 20, 2, h, "ragged_all_to_all", 2.0, counts) == (
      40 * (2 * h * 2 + 8))
  assert ep_gpu_bench.exchange_bytes(1, 20, 2, h, "all_to_all", 2.0, counts) == 0.0


def test_bench_smoke_on_cpu_devices(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=2").strip()
  package_parent = os.path.dirname(os.path.dirname(os.path.abspath(jax_moeq.__file__)))
  env["PYTHONPATH"] = package_parent + os.pathsep + env.get("PYTHONPATH", "")
  out = tmp_path / "bench.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "ep_gpu_bench.py"), "--platform", "cpu",
       "--shapes", "tiny", "--gpus", "1,2", "--tokens", "4", "--dispatch",
       "replicated,all_to_all", "--layers", "2", "--target-seconds", "0.05", "--json", str(out)],
      env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(r["gpus"], r["dispatch"]) for r in rows] == [
      (1, "replicated"), (2, "replicated"), (2, "all_to_all")]
  assert all(r["layer_us"] > 0 and r["backend"] == "reference" for r in rows)
  assert rows[1]["weak_scaling"] is not None and rows[2]["bytes_per_gpu"] > 0
  assert "| tiny | 2 | 4 | all_to_all | reference |" in proc.stdout


def test_plot_series_of_the_recorded_runs():
  """docs/ep_gpu.png's series from the committed JSONs: every dispatch on 2 GPUs, the weak-
  scaling baseline below each, and the default ragged exchange far below the dense one."""
  import plot_ep_gpu  # noqa: E402
  with open(os.path.join(ROOT, "docs", "data", "ep_gpu_bench_dsv3_h200x2.json")) as f:
    layers = plot_ep_gpu.layer_series(json.load(f)["rows"])
  assert {"2 GPUs, all_to_all", "2 GPUs, replicated", "1 GPU, E/2 experts"} <= set(layers)
  base = dict(layers["1 GPU, E/2 experts"])
  for t, us in layers["2 GPUs, all_to_all"]:
    assert us > base[t] > 0, (t, us, base[t])
  with open(os.path.join(ROOT, "docs", "data", "ep_exchange_h200x2.json")) as f:
    exchange = plot_ep_gpu.exchange_series(json.load(f))
  dense = dict(exchange["all_to_all"])
  for t, gbps in exchange["ragged_all_to_all (default)"]:
    assert gbps < dense[t], (t, gbps, dense[t])


def test_plot_weak_scaling_series_of_the_4_gpu_run():
  """The weak-scaling panel from docs/data/ep_gpu_bench_h200x4.json: both shapes and both
  dispatches on 4 GPUs, efficiencies in (0, 1], and replicated ahead of all_to_all at every T
  (the recorded figures the docs quote)."""
  import plot_ep_gpu  # noqa: E402
  with open(os.path.join(ROOT, "docs", "data", "ep_gpu_bench_h200x4.json")) as f:
    scaling = plot_ep_gpu.scaling_series(json.load(f)["rows"])
  for shape in ("dsv3", "qwen235"):
    replicated = dict(scaling[f"{shape}, 4 GPUs, replicated"])
    exchange = dict(scaling[f"{shape}, 4 GPUs, all_to_all"])
    assert sorted(replicated) == sorted(exchange) == [16, 1024, 4096]
    for t, eff in exchange.items():
      assert 0 < eff < replicated[t] <= 1, (shape, t, eff, replicated[t])
