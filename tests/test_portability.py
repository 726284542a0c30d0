"""The CPU kernels must also build on AArch64 (portable path only)."""

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
