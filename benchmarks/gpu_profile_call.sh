#!/usr/bin/env bash
# GPU calls that fit a short lease: build, per-kernel times (ncu) of the WNA16 op at decode and
# prefill for both GEMM main loops, the WNA16 + MxInt4 GPU tests, and a quick benchmark.
#   STAGES="build ncu test bench" (default: build ncu); each stage is time-boxed; logs in $OUT.
#   NCU_CASES="Mixtral-8x7B:1 Mixtral-8x7B:4096 Qwen3-30B-A3B:1" (shape:T pairs)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_profile}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
STAGES=${STAGES:-"build ncu"}
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has build; then
  STAGES=build OUT=$OUT timeout 300 bash benchmarks/gpu_suite.sh | tail -3 || exit 1
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader

profile() {  # shape T mainloop
  local log="$OUT/ncu_$1_$2_$3.log"
  timeout 90 ncu --print-summary per-kernel --metrics gpu__time_duration.sum \
    -k "regex:Moe|Align|Finalize|Permute" python3 benchmarks/wna16_kernel_times.py "$1" "$2" "$3" \
    >"$log" 2>&1
  echo "== ncu $1 T=$2 $3 (rc=$?)"
  grep -E "^  [a-zA-Z].*\(|gpu__time_duration" "$log" | sed -E 's/\(const[^)]*\)//; s/ +/ /g' | \
    paste - - | awk '{print substr($0, 1, 170)}'
}
if has ncu; then
  for case in ${NCU_CASES:-Mixtral-8x7B:1 Mixtral-8x7B:4096 Qwen3-30B-A3B:1}; do
    shape=${case%%:*}; t=${case##*:}
    profile "$shape" "$t" registers
    [ "$t" -le 16 ] && profile "$shape" "$t" async_ring
  done
fi

if has test; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest tests/test_wna16_gpu.py tests/test_mxint4_gpu.py \
    tests/test_nn.py -k "gpu or GPU or wna16 or mxint4 or ring" -q -rs -p no:cacheprovider \
    >"$OUT/test.log" 2>&1
  echo "== tests (rc=$?): $(tail -1 "$OUT/test.log")"
  grep -E "FAILED|Error" "$OUT/test.log" | head -20
fi

if has bench; then
  timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/gpu_moe_bench.py --quick --json "$OUT/bench.json" \
    ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  echo "== bench (rc=$?)"; tail -12 "$OUT/bench.log"
fi
