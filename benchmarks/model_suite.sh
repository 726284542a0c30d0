#!/usr/bin/env bash
# End-to-end model figures on a GPU machine: benchmarks/model_bench.py on a Qwen3-30B-A3B-shaped
# model; by default the float block on lax.ragged_dot, WNA16 and MxInt4 experts, and every linear
# int4 (WNA16), batch 1 and 16. VARIANTS and BATCH (model_bench.py's --variants / --batch)
# override, e.g. LAYERS=48 VARIANTS=wna16,wna16_all BATCH=1:2048,64:128.
#   BUILD=1 builds the CUDA library into the tree first (jax_moeq/lib/libjax_moeq_cuda.so);
#   BUILD=auto (default) does so when the tree holds no built library and the installed jax_moeq
#   has none either; BUILD=0 never does (model_bench.py refuses int4 variants that would fall
#   back to the jnp reference).
#   LAYERS (default 2), BENCH_ARGS pass through. JSON and logs go to $OUT (or /tmp/model_suite).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/model_suite}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda

BUILD=${BUILD:-auto}
if [ "$BUILD" = auto ]; then
  installed=$(cd /tmp && "$PY" -c 'import os, jax_moeq; print(os.path.dirname(jax_moeq.__file__))' \
              2>/dev/null)
  BUILD=1
  for lib in jax_moeq/lib/libjax_moeq_cuda.so "$installed/lib/libjax_moeq_cuda.so"; do
    [ -f "$lib" ] && BUILD=0
  done
fi
if [ "$BUILD" = 1 ]; then
  # The CUDA library alone: a GPU run needs no CPU kernels.
  if ! { cmake -S . -B build/model_suite -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOEQ_CUDA=ON \
           -DPython_EXECUTABLE="$(command -v "$PY")" \
           -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" &&
         cmake --build build/model_suite -j 16 --target jax_moeq_cuda; } >"$OUT/build.log" 2>&1
  then
    tail -30 "$OUT/build.log"; echo "build: FAILED"; exit 1
  fi
  mkdir -p jax_moeq/lib && cp -f build/model_suite/libjax_moeq_cuda.so jax_moeq/lib/
fi
# The tree's jax_moeq when it holds a built CUDA library, otherwise the installed package (an
# unbuilt tree first on PYTHONPATH would shadow it).
[ -f jax_moeq/lib/libjax_moeq_cuda.so ] && export PYTHONPATH=$PWD

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv >"$OUT/nvidia_smi.csv" 2>&1 || true
"$PY" benchmarks/model_bench.py --variants "${VARIANTS:-float_ragged_dot,wna16,mxint4,wna16_all}" \
  --batch "${BATCH:-1,16}" \
  --layers "${LAYERS:-2}" --json "$OUT/model_bench.json" ${BENCH_ARGS:-} \
  2>"$OUT/model_bench.err" | tee "$OUT/model_bench.txt"
status=${PIPESTATUS[0]}
[ "$status" = 0 ] || tail -30 "$OUT/model_bench.err"
exit "$status"
