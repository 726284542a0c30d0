"""benchmarks/cpu_moe_bench.py's kt-kernel peer: skipped with its reason when kt-kernel does not
import, and, where it imports, its online-quantized layers checked against the float reference on
a tiny shape (kt-kernel from this environment, $JAX_MOEQ_KTK_PATH, or .carry/ktk)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax_moeq
from jax_moeq import _ffi

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
  stdout, result = _run_bench("--baselines", "ktk", *(["--ktk-path", path] if path else []))
  row = result["rows"]["tiny"][0]
  check = re.search(r"check at T=8, layer 0, .*rel\. Frobenius error (.*)", stdout)
  assert check, stdout[-3000:]
  errors = dict(re.findall(r"(ours|kt-kernel AMXINT\d) (\d\.\de[-+]\d\d)", check.group(1)))
  errors = {name: float(e) for name, e in errors.items()}
  assert "non-finite" not in check.group(1)
  # Ours: exact int4 weights, int8 activations: a few 1e-3 per GEMM, bf16 rounding points.
  assert errors["ours"] < 0.05, errors
  for method in ("AMXINT4", "AMXINT8"):
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
