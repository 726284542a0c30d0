#!/usr/bin/env bash
# benchmarks/cpu_moe_bench.py with KTransformers' kt-kernel beside ours (and ORT where installed) on
# a many-core host in one call. kt-kernel comes from KTK (default .carry/ktk): a folder holding the
# kt_kernel package (its AMX and AVX2 extension builds for this host's Python), kt_kernel.libs and
# gguf, unpacked from the wheels without their dependencies, so the host's own torch serves it.
# Builds the CPU library for this Python when it is missing. Report, JSON, plot and logs go to $OUT.
#   THREADS=16 TOKENS=1,8,128,512 SHAPES=olmoe METHODS=AMXINT4,AMXINT8 BENCH_ARGS=... (passed on);
#   PROBE=0 skips benchmarks/ktk_stream_probe.py (its wrapper's forward with a CUDA stream, first).
#   Shapes: olmoe, qwen3 (Qwen3-30B-A3B), dsv2lite, dsv3 (one DeepSeek-V3 layer, ~5.6 GB of int4:
#   run it alone with BENCH_ARGS="--layers 2", each contender holding its own copies).
#   kt-kernel's pool is THREADS - 1 unless BENCH_ARGS sets --ktk-threads (its caller spins).
#   WHEELS=folder installs the wheels in it (no deps) ahead of the host's packages, e.g. an
#   onnxruntime >= 1.32 for the QMoE peer when the host's is older.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cpu_ktk_host}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
KTK=${KTK:-.carry/ktk}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
if ! ls jax_moeq/_cpu_ffi*.so >/dev/null 2>&1; then
  if ! PYTHON=$PY JOBS=$(nproc) JAX_MOEQ_CUDA=OFF bash scripts/dev_build.sh >"$OUT/build.log" 2>&1
  then
    tail -30 "$OUT/build.log"; echo "build: FAILED"; exit 1
  fi
fi
if [ -n "${WHEELS:-}" ]; then
  . benchmarks/_host_wheels.sh
  use_wheels "$WHEELS" /tmp/cpu_ktk_site || { echo "wheels: FAILED"; exit 1; }
fi
export PYTHONPATH=$PWD:$PWD/$KTK${PYTHONPATH:+:$PYTHONPATH}
lscpu | grep -E "Model name|^CPU\(s\)|L3|NUMA node\(s\)" | tee "$OUT/lscpu.txt"
"$PY" -c 'import importlib.metadata as m, sys, torch
try: ort = m.version("onnxruntime")
except m.PackageNotFoundError: ort = "absent"
print("python", sys.version.split()[0], "torch", torch.__version__, "onnxruntime", ort)' \
  | tee "$OUT/versions.txt"
# How its KTMoEWrapper.forward behaves with a CUDA stream (one child process per way of calling it).
if [ "${PROBE:-1}" = 1 ]; then
  timeout 400 "$PY" benchmarks/ktk_stream_probe.py --threads "${THREADS:-16}" \
    --ways queue,wrapper_sync,wrapper_stream,wrapper_gpu 2>&1 | tee "$OUT/ktk_stream_probe.txt"
fi
"$PY" benchmarks/cpu_moe_bench.py --shapes "${SHAPES:-olmoe}" --tokens "${TOKENS:-1,8,128,512}" \
  --threads "${THREADS:-16}" --baselines ort,ktk --ktk-methods "${METHODS:-AMXINT4,AMXINT8}" \
  --ktk-path "$KTK" --out "$OUT/cpu_ktk.md" --plot "$OUT/cpu_ktk.png" --json ${BENCH_ARGS:-} \
  2>"$OUT/cpu_ktk.err" >"$OUT/cpu_ktk.txt"
status=$?
# kt-kernel's C++ prints to stdout too: the report is the .md, the JSON its one line.
[ -f "$OUT/cpu_ktk.md" ] && cat "$OUT/cpu_ktk.md"
grep '^{"dram_gbps"' "$OUT/cpu_ktk.txt" | tail -1 >"$OUT/cpu_ktk.json"
[ "$status" = 0 ] || { echo "bench: exit $status"; tail -30 "$OUT/cpu_ktk.err"; }
exit "$status"
