#!/usr/bin/env bash
# Builds the CPU library with AddressSanitizer + UndefinedBehaviorSanitizer (JAX_MOEQ_SANITIZE=ON)
# into build/sanitize and runs the CPU tests that reach the native code against it. Any ASan or
# UBSan report aborts the test process, and the log is searched for reports besides: a clean
# exit means zero findings.
#
#   bash scripts/sanitize_cpu_tests.sh                      # the default test files
#   bash scripts/sanitize_cpu_tests.sh tests/test_nn.py -k int4   # pytest arguments of your own
#
# The sanitized extension is loaded from the build dir (JAX_MOEQ_CPU_LIBRARY, read by
# jax_moeq/_ffi.py), so jax_moeq/_cpu_ffi*.so of the dev build is left alone. Python and jaxlib
# are not instrumented: the ASan runtime is preloaded (LD_PRELOAD) ahead of them, leak checking
# is off (CPython and XLA hold allocations until exit by design) and the link-order check is
# skipped (the runtime is preloaded, not linked first).
# Environment: PYTHON (default python3), JOBS (build jobs, default 2), SANITIZE_REPORTS (a
# directory for the test log, default build/sanitize/reports).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
BUILD=$ROOT/build/sanitize
REPORTS=${SANITIZE_REPORTS:-$BUILD/reports}

start=$(date +%s)
mkdir -p "$BUILD"
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
         -DPython_EXECUTABLE="$(command -v "$PY")" \
         -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
         -DJAX_MOEQ_CUDA=OFF -DJAX_MOEQ_SANITIZE=ON &&
       cmake --build "$BUILD" -j "${JOBS:-2}" --target _cpu_ffi; } >"$BUILD/build.log" 2>&1; then
  tail -n 40 "$BUILD/build.log" >&2
  echo "sanitize_cpu_tests: the sanitizer build failed (log: $BUILD/build.log)" >&2
  exit 2
fi
built=$(date +%s)

LIB=$(ls "$BUILD"/_cpu_ffi*.so | head -n 1)

CC=${CC:-gcc}
ASAN_LIB=$("$CC" -print-file-name=libasan.so)
UBSAN_LIB=$("$CC" -print-file-name=libubsan.so)
for lib in "$ASAN_LIB" "$UBSAN_LIB"; do
  if [ ! -e "$lib" ]; then
    echo "sanitizer runtime $lib not found (install the compiler's libasan / libubsan)" >&2
    exit 2
  fi
done
rm -rf "$REPORTS"
mkdir -p "$REPORTS"

if [ $# -eq 0 ]; then
  set -- tests/test_w4a8_cpu.py tests/test_w4a8_linear_cpu.py tests/test_fused_moe.py \
    tests/test_nn.py \
    tests/test_mxint4_cpu.py tests/test_examples.py tests/test_native_safety.py \
    tests/test_limits.py tests/test_models.py tests/test_models_int4.py \
    --deselect tests/test_examples.py::test_generate_qwen3_moe_beside_llama_cpp
  # (llama.cpp's own libraries are not built with the sanitizers: that test checks the main job's
  # llama.cpp line, not our code, which its sibling test runs here.)
fi

# Reports go to stderr: pytest runs with --capture=sys, so that what native code writes to
# fd 2 (a sanitizer report, just before the abort) reaches the log instead of pytest's capture
# file, which an aborting process never prints. (UBSan's log_path is not honoured for reports
# raised on XLA's threads with both runtimes preloaded: stderr is the one reliable channel.)
# Subprocesses that tests start inherit the preload and the sanitized library; their stderr is
# in the failing test's message.
ASAN_OPTIONS="detect_leaks=0:verify_asan_link_order=0:abort_on_error=1:halt_on_error=1"
export ASAN_OPTIONS="$ASAN_OPTIONS:detect_stack_use_after_return=0:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1"
export LD_PRELOAD="$ASAN_LIB $UBSAN_LIB${LD_PRELOAD:+ $LD_PRELOAD}"
export JAX_MOEQ_SANITIZED=1
LOG=$REPORTS/pytest.log
set +e
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" JAX_MOEQ_CPU_LIBRARY="$LIB" \
  "$PY" -m pytest -q -p no:cacheprovider --capture=sys "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
unset LD_PRELOAD
end=$(date +%s)

pattern='ERROR: AddressSanitizer|runtime error:'
pattern+='|SUMMARY: (AddressSanitizer|UndefinedBehaviorSanitizer)'
findings=$(grep -cE "$pattern" "$LOG" || true)
echo "sanitize_cpu_tests: build $((built - start)) s, tests $((end - built)) s," \
  "pytest exit $status, $findings sanitizer finding(s) (log: $LOG)"
if [ "$findings" -ne 0 ]; then
  grep -nE -A 12 "$pattern" "$LOG" | head -n 120
  exit 1
fi
exit "$status"
