"""Concurrent first use of the native code.

A server's request threads may all make their first jax_moeq call at once. Then the library
loaders of jax_moeq/_ffi.py (import, FFI contract check, registration of the targets with XLA),
the CPU ISA dispatch (csrc/cpu/cpu_isa.cc: feature detection) and the kernel's per-thread
scratch all see concurrent first use. Each check runs in a fresh Python process (nothing loaded
yet), where 16 threads released together by a barrier make their first calls, and compares every
result with a serial call's. A C++ harness runs the kernel itself from 16 threads under
ThreadSanitizer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jax_moeq import _ffi

ROOT = Path(__file__).resolve().parent.parent
THREADS = 16

needs_cpu_library = pytest.mark.skipif(not _ffi.cpu_library_available(),
                                       reason="jax_moeq CPU library not built")


def _run_fresh(body: str, timeout: int = 600) -> str:
  """Runs _PRELUDE then `body` in a new interpreter with this process's environment (so a
  sanitizer run's JAX_MOEQ_CPU_LIBRARY and LD_PRELOAD carry over); returns its stdout, failing
  on a non-zero exit."""
  code = _PRELUDE + textwrap.dedent(body)
  env = dict(os.environ)
  # The source tree only when it holds a built library: otherwise it would shadow the installed
  # package (CI installs with pip and runs from a clean clone).
  tree = [str(ROOT)] if list((ROOT / "jax_moeq").glob("_cpu_ffi*.so")) else []
  env["PYTHONPATH"] = os.pathsep.join(tree + [env.get("PYTHONPATH", "")])
  env.setdefault("JAX_PLATFORMS", "cpu")
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT / "tests",
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
  return proc.stdout


_PRELUDE = f"""
import threading
import jax
import numpy as np
THREADS = {THREADS}
barrier = threading.Barrier(THREADS)
errors = []

def run_threads(fn):
  results = [None] * THREADS
  def worker(i):
    try:
      barrier.wait()
      results[i] = fn(i)
    except BaseException as e:  # reported by the main thread
      errors.append((i, repr(e)))
  threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  return results
"""


@needs_cpu_library
def test_loaders_register_once_under_concurrent_first_use():
  """16 threads call cpu_module() / the availability queries first: the extension is loaded
  and each target registered exactly once, and every thread gets the same module."""
  out = _run_fresh("""
  from jax_moeq import _ffi
  registered = []
  real_register = jax.ffi.register_ffi_target
  def counting_register(name, *args, **kwargs):
    registered.append(name)
    return real_register(name, *args, **kwargs)
  jax.ffi.register_ffi_target = counting_register
  # Widen the window in which unsynchronized loaders would overlap.
  real_import = _ffi._import_cpu_extension
  def slow_import():
    import time
    time.sleep(0.2)
    return real_import()
  _ffi._import_cpu_extension = slow_import

  def first_use(i):
    if i % 4 == 1:
      return _ffi.cpu_library_available()
    if i % 4 == 2:
      return _ffi.cuda_library_available() or True  # absent here: False, never an exception
    return _ffi.cpu_module()
  results = run_threads(first_use)
  modules = {id(r) for i, r in enumerate(results) if i % 4 in (0, 3)}
  assert len(modules) == 1, modules
  assert all(r is True for i, r in enumerate(results) if i % 4 in (1, 2)), results
  assert sorted(registered) == sorted(set(registered)), registered
  # The CPU targets, plus the CUDA ones where the package holds the CUDA library (each once).
  cpu = [name for name in registered if not name.endswith(("_cuda", "_cuda_into"))]
  assert set(cpu) == set(_ffi.cpu_module().registrations()), registered
  print("registrations", len(cpu))
  """)
  # The MoE, the MoE adding a residual and the dense linear, each with its aliased-output
  # ("_into") variant.
  assert "registrations 6" in out


@needs_cpu_library
def test_first_op_calls_from_16_threads_match_serial_calls():
  """16 threads make their first W4A8 call at once (library load, ISA dispatch, compilation,
  per-thread scratch), each on its own tokens and mixing dtypes and router-weight placement;
  every result equals the serial call's bit for bit (the kernel is deterministic)."""
  out = _run_fresh("""
  import jax.numpy as jnp
  from jax_moeq.ops import w4a8_cpu
  from jax_moeq import _ffi

  E, H, I, K, G = 8, 64, 32, 2, 32
  rng = np.random.default_rng(0)
  q13 = jnp.asarray(rng.integers(-8, 8, (E, 2 * I, H)), jnp.int8)
  q2 = jnp.asarray(rng.integers(-8, 8, (E, H, I)), jnp.int8)
  s13 = jnp.asarray(rng.uniform(0.5, 1.5, (E, 2 * I, H // G)) / 64, jnp.bfloat16)
  s2 = jnp.asarray(rng.uniform(0.5, 1.5, (E, H, I // G)) / 64, jnp.bfloat16)
  w13, w2 = w4a8_cpu.convert_to_w4a8_int8_moe_format(q13, q2, s13, s2, G)[:2]
  dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]

  def inputs(i):
    r = np.random.default_rng(100 + i)
    t = 1 + 7 * i  # decode-sized to prefill-sized calls
    x = jnp.asarray(r.standard_normal((t, H)), dtypes[i % 3])
    ids = jnp.asarray(np.stack([r.permutation(E)[:K] for _ in range(t)]), jnp.int32)
    w = jnp.asarray(r.uniform(0.1, 1.0, (t, K)), jnp.float32)
    return x, ids, w, bool(i % 2)

  def call(i):
    x, ids, w, on_input = inputs(i)
    out = w4a8_cpu.dynamic_4bit_int_moe(x, ids, w, w13, w2, H, I, 2 * I, G,
                                        apply_router_weight_on_input=on_input)
    return np.asarray(out.astype(jnp.float32))

  concurrent = run_threads(call)
  isas = run_threads(lambda i: _ffi.cpu_module().selected_isa())
  assert len(set(isas)) == 1, isas
  for i in range(THREADS):
    serial = call(i)
    assert concurrent[i].shape == serial.shape
    assert np.array_equal(concurrent[i], serial, equal_nan=True), i
    assert np.isfinite(serial).all()
  print("ok", isas[0])
  """)
  assert out.startswith("ok")


@needs_cpu_library
def test_isa_choice_under_concurrent_first_use():
  """The ISA list (detected once) and the choice are the same from every thread, also when the
  module's queries are the first native calls of the process."""
  out = _run_fresh("""
  from jax_moeq import _ffi
  m = _ffi.cpu_module()
  got = run_threads(lambda i: (tuple(m.available_isas()), m.selected_isa()))
  assert len(set(got)) == 1, got
  print("isas", got[0])
  """)
  assert "portable" in out


# ------------------------------------------------------------------ C++ harness (ThreadSanitizer)
_CPU_SOURCES = {
    "cpu_isa.cc": [],
    "w4a8_moe.cc": [],
    "w4a8_gemm_portable.cc": [],
    "w4a8_rows_portable.cc": [],
    "w4a8_gemm_avx2.cc": ["-mavx2", "-mfma", "-mf16c"],
    "w4a8_rows_avx2.cc": ["-mavx2", "-mfma", "-mf16c"],
    "w4a8_gemm_avx512vnni.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                                "-mavx512vnni", "-mfma", "-mf16c"],
    "w4a8_rows_avx512.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                            "-mavx512vnni", "-mfma", "-mf16c"],
    "w4a8_gemm_amx.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                         "-mfma", "-mamx-tile", "-mamx-int8"],
}

_HARNESS = r"""
// 16 threads call the CPU W4A8 kernel at once (each its first call: ISA detection, thread-local
// scratch), on shared weights and their own tokens; results must equal a serial run's.
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu/cpu_isa.h"
#include "cpu/w4a8_layout.h"
#include "cpu/w4a8_moe.h"

using namespace jax_moeq::cpu;

// Random nibbles with valid float32 scales, row corrections and biases.
std::vector<uint8_t> PackedWeights(int64_t experts, int64_t n, int64_t k, int64_t g,
                                   std::mt19937& rng) {
  const PackedGemmShape s{n, k, g};
  std::vector<uint8_t> w(experts * s.total_bytes());
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.02f);
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  for (int64_t e = 0; e < experts; ++e) {
    uint8_t* base = w.data() + e * s.total_bytes();
    for (int64_t nt = 0; nt < n / kTileRows; ++nt) {
      for (int64_t gi = 0; gi < s.groups(); ++gi) {
        float* sc = reinterpret_cast<float*>(base + nt * s.tile_bytes() + gi * s.chunk_bytes() +
                                             g / kBlockInputs * kBlockBytes);
        for (int r = 0; r < kTileRows; ++r) sc[r] = scale(rng);
      }
    }
    float* tail = reinterpret_cast<float*>(base + s.row_corr_offset());
    for (int64_t i = 0; i < 2 * n; ++i) tail[i] = scale(rng);
  }
  return w;
}

int main() {
  const int64_t E = 8, H = 64, I = 32, K = 2, G = 32, kThreads = 16;
  std::mt19937 rng(7);
  const auto w13 = PackedWeights(E, 2 * I, H, G, rng);
  const auto w2 = PackedWeights(E, H, I, G, rng);
  struct Call {
    std::vector<float> x, weights, out;
    std::vector<int32_t> ids;
    int64_t tokens;
  };
  std::vector<Call> calls(kThreads);
  for (int64_t c = 0; c < kThreads; ++c) {
    Call& call = calls[c];
    call.tokens = 1 + 9 * c;
    std::normal_distribution<float> normal;
    std::uniform_int_distribution<int32_t> expert(0, E - 1);
    for (int64_t i = 0; i < call.tokens * H; ++i) call.x.push_back(normal(rng));
    for (int64_t i = 0; i < call.tokens * K; ++i) {
      call.ids.push_back(expert(rng));
      call.weights.push_back(0.5f);
    }
  }
  auto run = [&](Call& call, std::vector<float>& out) {
    W4A8MoeProblem p{};
    p.dtype = ElementType::kF32;
    p.x = call.x.data();
    out.assign(call.tokens * H, -1.0f);
    p.out = out.data();
    p.topk_ids = call.ids.data();
    p.topk_weights = call.weights.data();
    p.w13_packed = w13.data();
    p.w2_packed = w2.data();
    p.tokens = call.tokens;
    p.top_k = K;
    p.experts = E;
    p.hidden = H;
    p.intermediate = I;
    p.group_size = G;
    p.activation = ActivationKind::kSwigluStep;
    std::string error;
    const Isa isa = SelectIsa(&error);
    if (error.empty()) error = ValidateW4A8MoeShapes(p, W4A8PackedBytes(2 * I, H, G),
                                                     W4A8PackedBytes(H, I, G));
    // A ParallelFor that runs pieces on two threads of its own, as XLA's pool would.
    ParallelFor parallel_for{[](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
                               std::thread helper([&] { body(0, n / 2); });
                               body(n / 2, n);
                               helper.join();
                             },
                             2};
    if (error.empty()) error = RunW4A8Moe(p, isa, parallel_for);
    return error;
  };
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int64_t c = 0; c < kThreads; ++c) {
    threads.emplace_back([&, c] { errors[c] = run(calls[c], calls[c].out); });
  }
  for (auto& t : threads) t.join();
  for (int64_t c = 0; c < kThreads; ++c) {
    if (!errors[c].empty()) {
      std::printf("call %lld: %s\n", static_cast<long long>(c), errors[c].c_str());
      return 1;
    }
    std::vector<float> serial;
    const std::string error = run(calls[c], serial);
    if (!error.empty() || serial.size() != calls[c].out.size() ||
        std::memcmp(serial.data(), calls[c].out.data(), serial.size() * sizeof(float)) != 0) {
      std::printf("call %lld differs from the serial call\n", static_cast<long long>(c));
      return 1;
    }
  }
  std::printf("ok %s\n", IsaName(AvailableIsas().front()));
  return 0;
}
"""


def _cxx():
  return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _run_under_thread_sanitizer(exe: Path) -> None:
  """Runs a harness built with -fsanitize=thread: it must print "ok" and report no race (skips
  where the system cannot run ThreadSanitizer)."""
  env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
  env["TSAN_OPTIONS"] = "halt_on_error=1 exitcode=66"
  proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, env=env)
  if "unexpected memory mapping" in proc.stderr or "FATAL: ThreadSanitizer" in proc.stderr:
    pytest.skip("ThreadSanitizer cannot run on this system: " + proc.stderr.splitlines()[0])
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.startswith("ok"), proc.stdout


@pytest.mark.skipif(_cxx() is None, reason="no C++ compiler")
@pytest.mark.skipif(os.environ.get("LD_PRELOAD", "").find("asan") >= 0,
                    reason="ThreadSanitizer cannot run beside a preloaded AddressSanitizer")
def test_cpu_kernel_from_16_threads_under_thread_sanitizer(tmp_path):
  """The kernel library itself (csrc/cpu, no Python) under ThreadSanitizer: 16 threads make
  their first calls at once, each with a ParallelFor of its own threads. No data race may be
  reported and each result equals the serial call's."""
  cxx = _cxx()
  flags = ["-std=c++17", "-O1", "-g", "-fsanitize=thread", "-ffp-contract=off",
           "-fno-math-errno", f"-I{ROOT / 'csrc'}", "-DJAX_MOEQ_X86=1"]
  x86 = os.uname().machine in ("x86_64", "AMD64", "amd64")
  sources = {k: v for k, v in _CPU_SOURCES.items() if x86 or not v}
  if not x86:
    flags.remove("-DJAX_MOEQ_X86=1")
  (tmp_path / "harness.cc").write_text(_HARNESS)
  jobs = [subprocess.Popen([cxx, *flags, *extra, "-c", str(ROOT / "csrc" / "cpu" / name), "-o",
                            str(tmp_path / (name + ".o"))], stderr=subprocess.PIPE, text=True)
          for name, extra in sources.items()]
  jobs.append(subprocess.Popen([cxx, *flags, "-c", str(tmp_path / "harness.cc"), "-o",
                                str(tmp_path / "harness.o")], stderr=subprocess.PIPE, text=True))
  for job in jobs:
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err
  exe = tmp_path / "harness"
  link = subprocess.run([cxx, "-fsanitize=thread", "-pthread", *map(str, tmp_path.glob("*.o")),
                         "-o", str(exe)], capture_output=True, text=True, timeout=300)
  assert link.returncode == 0, link.stderr
  _run_under_thread_sanitizer(exe)


_JOBS_HARNESS = r"""
// xla_ffi/cpu_jobs.h's ParallelFor on a pool of its own threads, as XLA's is: 4 callers at once,
// 400 calls each of 1-300 indices, workers spinning for later calls on every other call. Every
// index must run exactly once per call, in pieces none empty and within one index of each other,
// and ThreadSanitizer must see no race (a worker of an old call touching a job that its thread has
// restarted, a body run after its call returned).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_jobs.h"

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    ready_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void Schedule(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    ready_.notify_one();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

struct PoolRef {
  Pool* pool;
  void Schedule(std::function<void()> task) const { pool->Schedule(std::move(task)); }
};

int main() {
  Pool pool(6);
  constexpr int kCallers = 4, kCalls = 400;
  std::vector<int> failures(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int call = 0; call < kCalls; ++call) {
        const int64_t spin_us = call % 2 ? 2000 : 0;
        jax_moeq::cpu::ParallelFor parallel_for =
            jax_moeq::ffi_cpu::MakeParallelFor(PoolRef{&pool}, 5, spin_us);
        const int64_t n = 1 + (call * 37 + c * 11) % 300;
        std::vector<int> runs(n, 0);  // plain ints: two runs of one index would race
        // Each piece's size at its first index: disjoint plain writes, as `runs`, so that no lock
        // orders the pieces for ThreadSanitizer. Empty pieces are counted (relaxed: no order).
        std::vector<int64_t> piece_at(n, 0);
        std::atomic<int64_t> empty_pieces{0};
        parallel_for(n, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) runs[i] += 1;
          if (begin < end) {
            piece_at[begin] = end - begin;
          } else {
            empty_pieces.fetch_add(1, std::memory_order_relaxed);
          }
        });
        for (int64_t i = 0; i < n; ++i) failures[c] += runs[i] != 1;
        // Pieces: none empty, sizes within one of each other, at most kPiecesPerThread a thread.
        int64_t pieces = 0, smallest = n, largest = 0;
        for (int64_t size : piece_at) {
          if (size == 0) continue;
          ++pieces;
          smallest = std::min(smallest, size);
          largest = std::max(largest, size);
        }
        failures[c] += empty_pieces.load() != 0 || largest - smallest > 1 ||
                       pieces > 5 * jax_moeq::cpu::kPiecesPerThread;
      }
    });
  }
  for (auto& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    if (failures[c]) {
      std::printf("caller %d: %d failures (an index not run exactly once, uneven pieces)\n", c,
                  failures[c]);
      return 1;
    }
  }
  std::printf("ok\n");
  return 0;
}
"""


@pytest.mark.skipif(_cxx() is None, reason="no C++ compiler")
@pytest.mark.skipif(os.environ.get("LD_PRELOAD", "").find("asan") >= 0,
                    reason="ThreadSanitizer cannot run beside a preloaded AddressSanitizer")
def test_parallel_for_with_spinning_workers_under_thread_sanitizer(tmp_path):
  """The handlers' ParallelFor (xla_ffi/cpu_jobs.h: seats per call generation, workers that wait
  for later calls with JAX_MOEQ_CPU_SPIN_US) under ThreadSanitizer, on a pool of its own: 4
  callers at once, 400 calls each; every index runs once per call, in pieces none empty and
  within one index of each other, and no race is reported."""
  cxx = _cxx()
  (tmp_path / "jobs.cc").write_text(_JOBS_HARNESS)
  exe = tmp_path / "jobs"
  build = subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fsanitize=thread", "-pthread",
                          f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'xla_ffi'}", str(tmp_path / "jobs.cc"),
                          "-o", str(exe)], capture_output=True, text=True, timeout=300)
  assert build.returncode == 0, build.stderr
  _run_under_thread_sanitizer(exe)
