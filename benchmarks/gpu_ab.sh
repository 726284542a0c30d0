#!/usr/bin/env bash
# A/B of two builds of the CUDA library in one run on a GPU: the working tree and a baseline source
# tree (e.g. `git archive HEAD csrc xla_ffi cmake CMakeLists.txt | tar -x -C .ab/base`, carried to
# the device). Builds both, then runs CMD once per library (JAX_MOEQ_CUDA_LIBRARY), alternating
# ROUNDS times, so the two timings share the machine's state. Only the library is swapped, so both
# trees must share the FFI contract (xla_ffi/abi_version.h; a baseline of another version is
# refused on load): to compare across a contract change, run both whole trees instead.
#   BASE=.ab/base CMD="python3 benchmarks/gpu_moe_bench.py --no-torch --tokens 4096" ROUNDS=1
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_ab}
BASE=${BASE:-.ab/base}
ROUNDS=${ROUNDS:-1}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
STAGES=build OUT=$OUT bash benchmarks/gpu_suite.sh | tail -2 || exit 1
pyb=$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')
if ! { cmake -S "$BASE" -B build/ab_base -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOEQ_CUDA=ON \
         -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$pyb" >"$OUT/build_base.log" 2>&1 &&
       cmake --build build/ab_base -j 16 --target jax_moeq_cuda >>"$OUT/build_base.log" 2>&1; }; then
  tail -20 "$OUT/build_base.log"; echo "baseline build FAILED"; exit 1
fi
echo "baseline build: ok"
for r in $(seq "$ROUNDS"); do
  for which in base new; do
    lib=$PWD/jax_moeq/lib/libjax_moeq_cuda.so
    [ "$which" = base ] && lib=$PWD/build/ab_base/libjax_moeq_cuda.so
    echo "== round $r: $which"
    JAX_MOEQ_CUDA_LIBRARY=$lib timeout "${AB_TIMEOUT:-300}" bash -c "$CMD" >"$OUT/ab_${which}_$r.log" 2>&1
    echo "(rc=$?)"; grep -E "^(Mixtral|Qwen3|DeepSeek|wna16 |mxint4 )" "$OUT/ab_${which}_$r.log" | cut -c1-140
  done
done
