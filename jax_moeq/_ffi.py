"""Loading of the native libraries and registration of their FFI targets.

The CPU library is a pybind11 extension (`jax_moeq._cpu_ffi`) built with the
package. The CUDA library is a plain C-ABI shared object
(`jax_moeq/lib/libjax_moeq_cuda.so`) loaded with ctypes, so it does not depend
on the Python version; it exists only where nvcc was found at build time.
Both register their handlers with XLA exactly once, on first use, and only when
their FFI contract version (xla_ffi/abi_version.h) is this package's FFI_ABI_VERSION.
The first use may come from several threads at once (a server's request threads): each
loader runs under a lock, so one thread loads and registers while the others wait for it.
JAX_MOEQ_CPU_LIBRARY (a path to a built `_cpu_ffi` extension) loads that file in place of
the package's (scripts/sanitize_cpu_tests.sh points it at a sanitizer build), as
JAX_MOEQ_CUDA_LIBRARY does for the CUDA library.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Callable, TypeVar

import jax

logger = logging.getLogger("jax_moeq")

_PKG_DIR = Path(__file__).resolve().parent
CUDA_LIBRARY_NAME = "libjax_moeq_cuda.so"
# JAX_MOEQ_FFI_ABI_VERSION of xla_ffi/abi_version.h: bump both together whenever a target's
# buffers, attributes or workspace sizes change.
FFI_ABI_VERSION = 3


class NativeLibraryError(RuntimeError):
  """A native library needed by the chosen backend is missing or broken."""


class StaleLibraryError(NativeLibraryError):
  """A native library was built from another version of jax_moeq's FFI contract."""


def _check_abi_version(what: str, version: int | None) -> None:
  if version != FFI_ABI_VERSION:
    found = "no version" if version is None else f"version {version}"
    raise StaleLibraryError(
        f"{what} was built for FFI contract {found}, this jax_moeq needs version "
        f"{FFI_ABI_VERSION}: rebuild it with the package (`pip install .` or "
        "scripts/dev_build.sh)")


_T = TypeVar("_T")
# Serializes the one-time loads and registrations (re-entrant: a loader may call another).
_LOAD_LOCK = threading.RLock()
_UNSET = object()


def _once(load: Callable[[], _T]) -> Callable[[], _T]:
  """`load()` run once per process on success, the result kept; safe for concurrent first
  calls: they wait under `_LOAD_LOCK` for the one that loads (functools.cache lets each of
  them run `load` at once). A failure is not kept: the next call tries again."""
  result = _UNSET

  @functools.wraps(load)
  def once():
    nonlocal result
    value = result  # one read: set at most once, never unset but by cache_clear
    if value is not _UNSET:
      return value
    with _LOAD_LOCK:
      if result is _UNSET:
        result = load()
      return result

  def cache_clear():
    nonlocal result
    with _LOAD_LOCK:
      result = _UNSET

  once.cache_clear = cache_clear
  return once


def _import_cpu_extension():
  override = os.environ.get("JAX_MOEQ_CPU_LIBRARY")
  if not override:
    from jax_moeq import _cpu_ffi  # pytype: disable=import-error
    return _cpu_ffi
  if not Path(override).is_file():
    raise ImportError(f"JAX_MOEQ_CPU_LIBRARY={override} is not a file")
  name = f"{__package__}._cpu_ffi"
  spec = importlib.util.spec_from_file_location(name, override)
  if spec is None or spec.loader is None:
    raise ImportError(f"JAX_MOEQ_CPU_LIBRARY={override} is not an extension module")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  sys.modules[name] = module
  return module


@_once
def cpu_module():
  """Returns the CPU extension module, with its FFI targets registered (once per process)."""
  try:
    _cpu_ffi = _import_cpu_extension()
  except ImportError as e:
    raise NativeLibraryError(
        "jax_moeq's CPU library (jax_moeq._cpu_ffi) is not built; install the "
        "package with `pip install .` (or run scripts/dev_build.sh): " + str(e)
    ) from e
  _check_abi_version("jax_moeq's CPU library (jax_moeq._cpu_ffi)",
                     getattr(_cpu_ffi, "ABI_VERSION", None))
  for name, capsule in _cpu_ffi.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  return _cpu_ffi


def _loads(load, errors: tuple[type[BaseException], ...]) -> bool:
  """Whether `load()` succeeds; a stale library (not an absent one) is logged once, as the
  oracle then falls back to another backend."""
  try:
    load()
  except StaleLibraryError as e:
    _warn_once(str(e))
    return False
  except errors:
    return False
  return True


@functools.cache
def _warn_once(message: str) -> None:
  logger.warning("%s", message)


def cpu_library_available() -> bool:
  return _loads(cpu_module, (NativeLibraryError,))


def _cuda_library_path() -> Path | None:
  override = os.environ.get("JAX_MOEQ_CUDA_LIBRARY")
  candidates = [Path(override)] if override else []
  candidates += [_PKG_DIR / "lib" / CUDA_LIBRARY_NAME, _PKG_DIR / CUDA_LIBRARY_NAME]
  for path in candidates:
    if path.is_file():
      return path
  return None


@_once
def cuda_library() -> ctypes.CDLL:
  """Returns the CUDA library, with its FFI targets registered for CUDA.

  The library exports `jax_moeq_cuda_targets(const char*** names,
  void*** handlers) -> int` listing every handler it defines.
  """
  path = _cuda_library_path()
  if path is None:
    raise NativeLibraryError(
        "jax_moeq's CUDA library (libjax_moeq_cuda.so) was not built: install "
        "on a machine with nvcc (JAX_MOEQ_CUDA=ON makes its absence an error)"
    )
  return load_cuda_library(path)


def load_cuda_library(path: Path) -> ctypes.CDLL:
  """Loads the CUDA library at `path`, checks its FFI contract version, and registers its
  handlers for CUDA (uncached: `cuda_library` is the once-per-process entry point; the
  registration runs under the loaders' lock all the same)."""
  with _LOAD_LOCK:
    return _load_cuda_library_locked(path)


def _load_cuda_library_locked(path: Path) -> ctypes.CDLL:
  lib = ctypes.CDLL(str(path))
  try:
    version_of = lib.jax_moeq_cuda_abi_version
  except AttributeError:  # built before the version existed
    version = None
  else:
    version_of.restype = ctypes.c_int
    version = int(version_of())
  _check_abi_version(f"the CUDA library {path}", version)
  names = ctypes.POINTER(ctypes.c_char_p)()
  handlers = ctypes.POINTER(ctypes.c_void_p)()
  count = lib.jax_moeq_cuda_targets(ctypes.byref(names), ctypes.byref(handlers))
  for i in range(count):
    capsule = jax.ffi.pycapsule(ctypes.cast(handlers[i], ctypes.c_void_p))
    jax.ffi.register_ffi_target(names[i].decode(), capsule, platform="CUDA")
  return lib


def cuda_library_available() -> bool:
  return _loads(cuda_library, (NativeLibraryError, OSError, AttributeError))


def cuda_handler_runs() -> int | None:
  """How many times XLA has run the CUDA ops' handlers in this process (a command buffer that
  XLA replays runs none), or None for a library built without the counter."""
  try:
    runs = cuda_library().jax_moeq_cuda_handler_runs
  except AttributeError:
    return None
  runs.restype = ctypes.c_uint64
  return int(runs())


def cuda_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the first CUDA device JAX sees, or None."""
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return None
  if not devices:
    return None
  cc = getattr(devices[0], "compute_capability", None)
  if cc is None:
    return None
  major, minor = str(cc).split(".")[:2]
  return int(major), int(minor)
