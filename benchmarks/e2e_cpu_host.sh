#!/usr/bin/env bash
# benchmarks/e2e_cpu_bench.py on a many-core host in one call: builds the CPU library for this
# Python (the CUDA library is not needed), then runs the benchmark with JAX on the CPU. llama.cpp
# comes from an installed llama-cpp-python, or from SITE (a folder holding the llama_cpp, gguf and
# diskcache packages copied from an environment where pip built them: llama_cpp loads its
# libraries with ctypes, so one build serves any Python 3). Logs and JSON go to $OUT.
#   BENCH_ARGS="--layers 4 --threads 16 --repeats 1" (passed through), SITE=.carry/site
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/e2e_cpu_host}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
if ! ls jax_moeq/_cpu_ffi*.so >/dev/null 2>&1; then
  if ! PYTHON=$PY JOBS=$(nproc) JAX_MOEQ_CUDA=OFF bash scripts/dev_build.sh >"$OUT/build.log" 2>&1
  then
    tail -30 "$OUT/build.log"; echo "build: FAILED"; exit 1
  fi
fi
export PYTHONPATH=$PWD${SITE:+:$PWD/$SITE}
lscpu | grep -E "Model name|^CPU\(s\)|L3" | tee "$OUT/lscpu.txt"
"$PY" benchmarks/e2e_cpu_bench.py --workdir "${WORKDIR:-/tmp/e2e_cpu_host_work}" \
  --json "$OUT/e2e_cpu.json" ${BENCH_ARGS:-} 2>"$OUT/e2e_cpu.err" | tee "$OUT/e2e_cpu.txt"
status=${PIPESTATUS[0]}
[ "$status" = 0 ] || tail -30 "$OUT/e2e_cpu.err"
exit "$status"
