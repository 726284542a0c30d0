"""benchmarks/cpu_moe_bench.py's kt-kernel peer: skipped with its reason when kt-kernel does not
import, and, where it imports, its layers (online-quantized AMX ones, and GPTQ ones given our int4
weights) checked against the float reference on a tiny shape (kt-kernel from this environment,
$JAX_MOEQ_KTK_PATH, or .carry/ktk); the GPTQ tensors it is given checked against our unpacking."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_moeq
from jax_moeq import _ffi
from jax_moeq.quant import int4

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "cpu_moe_bench.py"
pytestmark = pytest.mark.skipif(not _ffi.cpu_library_available(), reason="CPU library not built")


def _run_bench(*extra: str) -> tuple[str, dict]:
  # The jax_moeq under test (the installed package, or a dev build's tree), not the source tree:
  # a clean clone's tree has no native library.
  package_parent = os.path.dirname(os.path.dirname(os.path.abspath(jax_moeq.__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=package_parent)
  env.pop("JAX_MOEQ_KTK_PATH", None)
  cmd = [sys.executable, str(BENCH), "--shapes", "tiny", "--tokens", "8", "--layers", "2",
         "--target-seconds", "0.05", "--threads", "1", "--json", *extra]
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  # kt-kernel's C++ prints to stdout as well: the JSON is the last line that is one.
  result = json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])
  return out.stdout, result


def _ktk_path() -> str | None:
  """'' when kt-kernel imports as installed, a folder that makes it import, or None."""
  candidates = [""] + [p for p in (os.environ.get("JAX_MOEQ_KTK_PATH"), str(ROOT / ".carry/ktk"))
                       if p and os.path.isdir(p)]
  for path in candidates:
    env = dict(os.environ, PYTHONPATH=path) if path else dict(os.environ)
    probe = subprocess.run([sys.executable, "-c", "import kt_kernel"], capture_output=True,
                           env=env, timeout=300, check=False)
    if probe.returncode == 0:
      return path
  return None


def test_ktk_peer_is_skipped_with_its_reason_when_kt_kernel_does_not_import(tmp_path):
  # A kt_kernel package that fails as a missing extension does, first on sys.path.
  (tmp_path / "kt_kernel").mkdir()
  (tmp_path / "kt_kernel" / "__init__.py").write_text(
      "raise ImportError('No .so file found for variant avx2')\n")
  stdout, result = _run_bench("--baselines", "ktk", "--ktk-path", str(tmp_path))
  assert "kt-kernel skipped: kt-kernel does not import (ImportError: No .so file found" in stdout
  assert all(not r["ktk_s"] for r in result["rows"]["tiny"])
  assert "kt-kernel AMXINT4 ms" not in stdout  # no empty peer columns


def test_ktk_peer_is_skipped_when_its_path_is_not_a_folder(tmp_path):
  stdout, result = _run_bench("--baselines", "ktk", "--ktk-path", str(tmp_path / "missing"))
  assert f"kt-kernel skipped: --ktk-path '{tmp_path / 'missing'}' is not a directory" in stdout
  assert result["rows"]["tiny"][0]["ours_s"] > 0


def test_ktk_peer_matches_the_float_reference_on_a_tiny_shape():
  path = _ktk_path()
  if path is None:
    pytest.skip("kt-kernel does not import here (pip install --no-deps kt-kernel, or set "
                "JAX_MOEQ_KTK_PATH to an unpacked copy)")
  stdout, result = _run_bench("--baselines", "ktk", "--ktk-methods",
                              "AMXINT4,AMXINT8,GPTQINT4,GPTQINT4_VNNI256",
                              *(["--ktk-path", path] if path else []))
  row = result["rows"]["tiny"][0]
  check = re.search(r"check at T=8, layer 0, .*rel\. Frobenius error (.*)", stdout)
  assert check, stdout[-3000:]
  errors = dict(re.findall(r"(ours|kt-kernel (?:AMXINT\d|GPTQINT4(?:_VNNI256)?)) (\d\.\de[-+]\d\d)",
                           check.group(1)))
  errors = {name: float(e) for name, e in errors.items()}
  assert "non-finite" not in check.group(1)
  # Ours: exact int4 weights, int8 activations: a few 1e-3 per GEMM, bf16 rounding points.
  assert errors["ours"] < 0.05, errors
  for method in ("AMXINT4", "AMXINT8", "GPTQINT4", "GPTQINT4_VNNI256"):
    if f"kt-kernel {method}" not in errors:
      assert f"kt-kernel {method} skipped" in stdout  # a build without it says so
      continue
    assert row["ktk_s"][method] > 0
  # kt-kernel requantizes per output row: int8 keeps ~0.6 % per weight (row max / 127 over
  # weights whose group scales span 3x), int4 ~10 % (row max / 7), through two GEMMs.
  if "kt-kernel AMXINT8" in errors:
    assert errors["kt-kernel AMXINT8"] < 0.05, errors
  if "kt-kernel AMXINT4" in errors:
    assert errors["kt-kernel AMXINT4"] < 0.3, errors
    # It is a real int4 requantization, not a copy of the float weights.
    assert errors["kt-kernel AMXINT4"] > errors["ours"], errors
  # Its GPTQ kernels get our int4 weights exactly: what is left is their activations' rounding,
  # no coarser than ours (int8 per row).
  for method in ("GPTQINT4", "GPTQINT4_VNNI256"):
    if f"kt-kernel {method}" in errors:
      assert errors[f"kt-kernel {method}"] < 0.05, errors


def _bench_module():
  spec = importlib.util.spec_from_file_location("cpu_moe_bench", BENCH)
  module = importlib.util.module_from_spec(spec)
  sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
  sys.path.insert(0, str(BENCH.parent))  # its sibling _timing
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(BENCH.parent))
  return sys.modules[spec.name]


def test_gptq_tensors_for_the_ktk_peer_unpack_to_the_same_int4_weights():
  """The GPTQ qweight / scales the kt-kernel peer is given read back, through the checkpoint
  loader's GPTQ unpacking, as exactly our int4 values and scales."""
  bench = _bench_module()
  rng = np.random.default_rng(0)
  q = rng.integers(-8, 8, (48, 256), dtype=np.int8)
  scale = rng.uniform(0.5, 1.5, (48, 2)).astype(ml_dtypes.bfloat16)
  qweight, scales = bench.gptq_int4(q, scale)
  assert qweight.dtype == np.int32 and qweight.shape == (32, 48)
  assert scales.dtype == np.float32 and scales.shape == (2, 48)
  np.testing.assert_array_equal(np.asarray(int4.unpack_uint4b8_gptq(jnp.asarray(qweight))), q)
  np.testing.assert_array_equal(scales, scale.astype(np.float32).T)
  # The AutoGPTQ convention, by hand: input k of output n in bits 4 (k % 8) of qweight[k // 8, n].
  n, k = 5, 77
  assert (int(qweight.view(np.uint32)[k // 8, n]) >> (4 * (k % 8))) & 0xF == int(q[n, k]) + 8
