"""Portability: the CPU kernels build on AArch64 (portable path only); the CUDA kernels build
for sm_80, the extra target of a portable CUDA build."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no AArch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
def test_cpu_kernels_build_for_aarch64():
  result = subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "check_aarch64_build.sh")],
      capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "aarch64 build ok: 5 objects" in result.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler (nvcc)")
def test_cuda_kernels_build_for_sm80():
  """The portable build's sm_80 target compiles (sm_90-only instructions behind guards)."""
  result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "check_cuda_sm80_build.sh")],
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-4000:]
  n_sources = len([f for f in os.listdir(os.path.join(ROOT, "csrc", "cuda")) if f.endswith(".cu")])
  assert f"sm_80 build ok: {n_sources} objects" in result.stdout
