#!/usr/bin/env bash
# compute-sanitizer over every GPU kernel variant (scripts/gpu_kernel_variants.py): memcheck,
# racecheck, synccheck and initcheck, one process each. Needs an sm_90 GPU (H100 / H200) and nvcc
# for the build. Each tool's report goes to $OUT/<tool>.log (the workload's own output to
# $OUT/<tool>.stdout); the last lines are one summary per tool:
#   memcheck: ERROR SUMMARY: 0 errors (exit 0, 95 s)
#
#   OUT=/tmp/sanitize_gpu bash scripts/sanitize_gpu.sh
# Environment:
#   OUT          report directory (default /tmp/sanitize_gpu)
#   TOOLS        default "memcheck racecheck synccheck initcheck"; "" builds only
#   PARALLEL     1 (default): the tools run at once, as four processes on the one GPU (each
#                takes < 1 GB); 0: one after another
#   TOOL_TIMEOUT seconds per tool (default 450): a tool still running then is stopped and its
#                summary says so
#   VARIANTS     comma-separated subset of the workload's variants (--list shows them)
#   BUILD        0 skips the build (the CUDA library already in jax_moeq/lib)
#   PLAIN        0 skips the workload's uninstrumented run
#   PRINT_LIMIT  findings printed per tool (default 2000); the summary names their kernels
#   SANITIZER_ARGS extra compute-sanitizer arguments, e.g. a kernel-name filter
#   COMPUTE_SANITIZER the binary (default: on PATH, else under /usr/local/cuda*/bin)
# Exit status: 0 when every tool ran to its end and reported 0 errors, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sanitize_gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# TOOLS="" runs none (a build only).
TOOLS=${TOOLS-"memcheck racecheck synccheck initcheck"}
PARALLEL=${PARALLEL:-1}
TOOL_TIMEOUT=${TOOL_TIMEOUT:-450}
start=$(date +%s)

find_sanitizer() {
  if [ -n "${COMPUTE_SANITIZER:-}" ]; then echo "$COMPUTE_SANITIZER"; return; fi
  if command -v compute-sanitizer >/dev/null 2>&1; then command -v compute-sanitizer; return; fi
  for dir in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer $(ls -d /usr/local/cuda-*/bin \
      2>/dev/null | sort -rV); do
    if [ -x "$dir/compute-sanitizer" ]; then echo "$dir/compute-sanitizer"; return; fi
  done
  # pip's nvidia-cuda-sanitizer-api wheel, if a JAX CUDA wheel set brought it
  "$PY" - <<'PYEOF' 2>/dev/null
import glob, os, site
for base in site.getsitepackages():
  for path in glob.glob(os.path.join(base, "nvidia", "**", "compute-sanitizer"), recursive=True):
    if os.access(path, os.X_OK) and os.path.isfile(path):
      print(path)
      raise SystemExit
PYEOF
}
SANITIZER=$(find_sanitizer)
if [ -z "$SANITIZER" ]; then
  echo "compute-sanitizer not found (PATH, /usr/local/cuda*/bin); set COMPUTE_SANITIZER" >&2
  exit 2
fi
echo "compute-sanitizer: $SANITIZER ($("$SANITIZER" --version 2>/dev/null | tail -n 1))"

if [ "${BUILD:-1}" != 0 ]; then
  # Line info makes the reports name file:line; otherwise the release build.
  if ! { cmake -S . -B build/sanitize_gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
           -DJAX_MOEQ_CUDA=ON -DCMAKE_CUDA_FLAGS=-lineinfo \
           -DPython_EXECUTABLE="$(command -v "$PY")" \
           -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" &&
         cmake --build build/sanitize_gpu -j "${JOBS:-16}"; } >"$OUT/build.log" 2>&1; then
    tail -n 30 "$OUT/build.log" >&2
    echo "build failed: $OUT/build.log" >&2
    exit 2
  fi
  cp -f build/sanitize_gpu/_cpu_ffi*.so jax_moeq/
  mkdir -p jax_moeq/lib && cp -f build/sanitize_gpu/libjax_moeq_cuda.so jax_moeq/lib/
  echo "built in $(( $(date +%s) - start )) s"
fi

# The workload, uninstrumented, first: a failure here is the code's, not a sanitizer finding.
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# The platform allocator: one cudaMalloc per buffer, so memcheck sees each buffer's bounds
# (the default BFC allocator carves them out of one large block, hiding overruns between them).
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
# No command buffers (CUDA graphs): every kernel is its own visible launch.
# No autotuning: XLA's autotuner compares candidate outputs with its own kernel
# (stream_executor::gpu::xla_int_comparison), which reads buffers nobody initialised; initcheck
# reported 100+ such reads, none of them in our kernels (2026-11-25).
export XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0 ${XLA_FLAGS:-}"
variant_args=()
if [ -n "${VARIANTS:-}" ]; then variant_args=(--only "$VARIANTS"); fi
t0=$(date +%s)
if [ "${PLAIN:-1}" != 0 ] && ! "$PY" scripts/gpu_kernel_variants.py "${variant_args[@]}" >"$OUT/plain.log" 2>&1; then
  tail -n 30 "$OUT/plain.log"
  echo "the workload fails without a sanitizer (see $OUT/plain.log): fix that first" >&2
  exit 1
fi
[ "${PLAIN:-1}" != 0 ] &&
  echo "workload without a sanitizer: $(tail -n 1 "$OUT/plain.log") ($(( $(date +%s) - t0 )) s)"

# Only options every compute-sanitizer since CUDA 11.x knows; no leak check (the process exits
# with XLA's buffers still allocated).
run_tool() {
  local tool=$1
  local t0=$(date +%s)
  # --no-check: the references would add XLA's CPU work only; outputs are still checked for
  # unwritten elements (NaN poison).
  timeout --signal=TERM --kill-after=30 "$TOOL_TIMEOUT" \
    "$SANITIZER" --tool "$tool" --error-exitcode 9 --print-limit "${PRINT_LIMIT:-2000}" \
    --target-processes all --log-file "$OUT/$tool.log" ${SANITIZER_ARGS:-} \
    "$PY" scripts/gpu_kernel_variants.py --no-check "${variant_args[@]}" \
    >"$OUT/$tool.stdout" 2>&1
  echo $? >"$OUT/$tool.rc"
  echo $(( $(date +%s) - t0 )) >"$OUT/$tool.seconds"
}

pids=()
for tool in $TOOLS; do
  if [ "$PARALLEL" = 1 ]; then
    run_tool "$tool" &
    pids+=($!)
  else
    run_tool "$tool"
  fi
done
for pid in "${pids[@]}"; do wait "$pid"; done

status=0
echo "---- compute-sanitizer summary ($(( $(date +%s) - start )) s in all; reports in $OUT)"
for tool in $TOOLS; do
  rc=$(cat "$OUT/$tool.rc" 2>/dev/null || echo "?")
  secs=$(cat "$OUT/$tool.seconds" 2>/dev/null || echo "?")
  # racecheck ends in "RACECHECK SUMMARY: N hazards displayed (N errors, ...)", the others in
  # "ERROR SUMMARY: N errors".
  summary=$(grep -hE "(ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazard)" "$OUT/$tool.log" 2>/dev/null | tail -n 1 |
            sed -E 's/^=+ *//')
  workload=$(grep -E "^gpu_kernel_variants:" "$OUT/$tool.stdout" 2>/dev/null | tail -n 1)
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    summary="TIMED OUT after ${TOOL_TIMEOUT} s${summary:+ (last: $summary)}"
  fi
  [ -n "$summary" ] || summary="no ERROR SUMMARY (see $OUT/$tool.log, $OUT/$tool.stdout)"
  echo "$tool: $summary (exit $rc, $secs s; ${workload:-workload did not finish})"
  # The innermost named frame of each printed finding, counted: which kernels to look at.
  grep -hE "^=+ +(Device Frame|at) " "$OUT/$tool.log" 2>/dev/null | sed -E 's/^=+ +//; s/\+0x[0-9a-f]+//' |
    sort | uniq -c | sort -rn | head -n 8 | cut -c1-200
  if [ "$rc" != 0 ] || ! echo "$summary" | grep -qE "(ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards)"; then status=1; fi
done
exit $status
