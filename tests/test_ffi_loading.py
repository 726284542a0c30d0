"""Loading of the native libraries: a library built for another FFI contract version
(xla_ffi/abi_version.h) is refused with a clear error before any handler is registered."""

import os
import re
import shutil
import subprocess

import pytest

from jax_moeq import _ffi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_header_and_python_versions_agree():
  with open(os.path.join(ROOT, "xla_ffi", "abi_version.h")) as f:
    found = re.findall(r"#define JAX_MOEQ_FFI_ABI_VERSION (\d+)", f.read())
  assert found == [str(_ffi.FFI_ABI_VERSION)]


@pytest.mark.skipif(not _ffi.cpu_library_available(), reason="CPU library not built")
def test_cpu_library_has_this_version():
  assert _ffi.cpu_module().ABI_VERSION == _ffi.FFI_ABI_VERSION


def _fake_cuda_library(tmp_path, version, handler_runs=None):
  """A shared library exporting the CUDA library's registry with no targets and, unless
  `version` is None, jax_moeq_cuda_abi_version() == version; unless `handler_runs` is None,
  jax_moeq_cuda_handler_runs() == handler_runs."""
  source = ["int jax_moeq_cuda_targets(const char*** names, void*** handlers) {",
            "  *names = 0; *handlers = 0; return 0; }"]
  if version is not None:
    source.append(f"int jax_moeq_cuda_abi_version(void) {{ return {version}; }}")
  if handler_runs is not None:
    source.append("unsigned long long jax_moeq_cuda_handler_runs(void) "
                  f"{{ return {handler_runs}ULL; }}")
  c_file = tmp_path / "fake.c"
  c_file.write_text("\n".join(source) + "\n")
  so_file = tmp_path / f"libfake_{version}_{handler_runs}.so"
  subprocess.run([shutil.which("cc"), "-shared", "-fPIC", "-o", str(so_file), str(c_file)],
                 check=True, capture_output=True, timeout=120)
  return so_file


needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc)")


@needs_cc
def test_cuda_library_of_this_version_loads(tmp_path):
  lib = _ffi.load_cuda_library(_fake_cuda_library(tmp_path, _ffi.FFI_ABI_VERSION))
  assert lib.jax_moeq_cuda_abi_version() == _ffi.FFI_ABI_VERSION


@needs_cc
@pytest.mark.parametrize("version", [None, _ffi.FFI_ABI_VERSION + 1, 0])
def test_cuda_library_of_another_version_is_refused(tmp_path, version):
  path = _fake_cuda_library(tmp_path, version)
  found = "no version" if version is None else f"version {version}"
  with pytest.raises(_ffi.StaleLibraryError,
                     match=rf"{re.escape(str(path))} was built for FFI contract {found}, "
                           rf"this jax_moeq needs version {_ffi.FFI_ABI_VERSION}: rebuild"):
    _ffi.load_cuda_library(path)


@needs_cc
@pytest.mark.parametrize("handler_runs", [None, 0, 2**40 + 7])
def test_cuda_handler_runs_reads_the_counter_or_says_none(tmp_path, monkeypatch, handler_runs):
  """The handler-run counter as a Python int (all 64 bits), or None from a library built
  without it."""
  path = _fake_cuda_library(tmp_path, _ffi.FFI_ABI_VERSION, handler_runs)
  monkeypatch.setattr(_ffi, "cuda_library", lambda: _ffi.load_cuda_library(path))
  assert _ffi.cuda_handler_runs() == handler_runs


@needs_cc
def test_stale_cuda_library_means_unavailable_with_a_warning(tmp_path, monkeypatch, caplog):
  """The oracle's availability query says False (it falls back) and logs why, once."""
  path = _fake_cuda_library(tmp_path, None)
  # The cached, process-wide loader stays untouched (a GPU process may have registered the
  # real library already).
  monkeypatch.setattr(_ffi, "cuda_library", lambda: _ffi.load_cuda_library(path))
  with caplog.at_level("WARNING", logger="jax_moeq"):
    assert not _ffi.cuda_library_available()
    assert not _ffi.cuda_library_available()
  warnings = [r for r in caplog.records if "FFI contract no version" in r.getMessage()]
  assert len(warnings) == 1
