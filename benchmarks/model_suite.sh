#!/usr/bin/env bash
# End-to-end model figures on a GPU machine: benchmarks/model_bench.py with the float block on
# lax.ragged_dot, WNA16 and MxInt4 experts, batch 1 and 16, on a Qwen3-30B-A3B-shaped model.
#   BUILD=1 builds the CUDA library into the tree first (scripts/dev_build.sh with CUDA on);
#   without it the tree is used when it holds a built library, else the installed package.
#   LAYERS (default 2), BENCH_ARGS pass through. JSON and logs go to $OUT (or /tmp/model_suite).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/model_suite}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda

if [ "${BUILD:-0}" = 1 ]; then
  if ! JAX_MOEQ_CUDA=ON JOBS=16 scripts/dev_build.sh >"$OUT/build.log" 2>&1; then
    tail -30 "$OUT/build.log"; echo "build: FAILED"; exit 1
  fi
fi
# The tree's jax_moeq when it holds a built CUDA library, otherwise the installed package (an
# unbuilt tree first on PYTHONPATH would shadow it).
[ -f jax_moeq/lib/libjax_moeq_cuda.so ] && export PYTHONPATH=$PWD

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv >"$OUT/nvidia_smi.csv" 2>&1 || true
"$PY" benchmarks/model_bench.py --variants float_ragged_dot,wna16,mxint4 --batch 1,16 \
  --layers "${LAYERS:-2}" --json "$OUT/model_bench.json" ${BENCH_ARGS:-} \
  2>"$OUT/model_bench.err" | tee "$OUT/model_bench.txt"
status=${PIPESTATUS[0]}
[ "$status" = 0 ] || tail -30 "$OUT/model_bench.err"
exit "$status"
