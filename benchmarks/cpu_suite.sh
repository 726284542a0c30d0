#!/usr/bin/env bash
# One run of the CPU W4A8 kernel on a many-core x86 host (the GPU machines' Xeon host: AVX-512
# VNNI + AMX-INT8): build, the ISA harness (AMX bit-exact against VNNI), the CPU kernel tests on
# every path the host has, the benchmark with ORT QMoE interleaved, and thread scaling.
#   STAGES="build check test bench scaling" (default all); OUT=/tmp/cpu_suite
#   BENCH_ARGS (default: OLMoE, T 1..512, AMX beside VNNI, time split at T=1 and 8)
#   SCALING_ARGS (default: OLMoE, T 1,128,512, threads 1,2,4,8,16)
# ORT >= 1.32 must be importable (PYTHONPATH) for the QMoE column.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cpu_suite}
mkdir -p "$OUT"
STAGES=${STAGES:-"build check test bench scaling"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
has() { [[ " $STAGES " == *" $1 "* ]]; }
summary=()

if has build; then
  start=$(date +%s)
  if JOBS=$(nproc) JAX_MOEQ_CUDA=OFF bash scripts/dev_build.sh >"$OUT/build.log" 2>&1; then
    summary+=("build: ok ($(( $(date +%s) - start )) s)")
  else
    tail -20 "$OUT/build.log"; echo "build: FAILED"; exit 1
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "from jax_moeq import _ffi; m = _ffi.cpu_module(); print('kernel paths:', m.available_isas())"

if has check; then
  "$PY" -m pytest tests/test_portability.py -k "x86 or cmake" -q -rs -p no:cacheprovider \
    2>&1 | tee "$OUT/check.log" | tail -3
  summary+=("ISA harness: $(tail -1 "$OUT/check.log")")
fi

if has test; then
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/test_w4a8_cpu.py tests/test_properties.py \
    tests/test_reliability_cpu.py -q -rs -x -p no:cacheprovider ${TEST_ARGS:-} 2>&1 |
    tee "$OUT/test.log" | tail -4
  summary+=("tests: $(tail -1 "$OUT/test.log")")
fi

if has bench; then
  # shellcheck disable=SC2086
  "$PY" benchmarks/cpu_moe_bench.py ${BENCH_ARGS:---shapes olmoe --tokens 1,8,32,64,128,256,512 \
    --isas amx_int8,avx512_vnni --time-split 1,8 --target-seconds 1.0 --plot $OUT/bench.png} \
    --out "$OUT/bench.md" \
    --json >"$OUT/bench.log" 2>&1
  summary+=("bench: exit $? ($OUT/bench.md)")
  cat "$OUT/bench.md" 2>/dev/null || tail -20 "$OUT/bench.log"
fi

if has scaling; then
  # shellcheck disable=SC2086
  "$PY" benchmarks/cpu_moe_bench.py ${SCALING_ARGS:---shapes olmoe --tokens 1,128,512 \
    --thread-scaling 1,2,4,8,16 --target-seconds 0.5} >"$OUT/scaling.md" 2>"$OUT/scaling.log"
  summary+=("scaling: exit $? ($OUT/scaling.md)")
  cat "$OUT/scaling.md"
fi
printf '%s\n' "${summary[@]}"
