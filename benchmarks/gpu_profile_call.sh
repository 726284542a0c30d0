#!/usr/bin/env bash
# Short GPU runs, each stage time-boxed: build, per-kernel times (ncu) of the WNA16 op at decode
# and prefill for both GEMM main loops, the WNA16 + MxInt4 GPU tests, and a quick benchmark; for
# the wgmma prefill GEMM (block_m 128): its tests, an ncu look at its two launches (pipe use, stall
# counters, memory throughput) and a timing of the default launch beside block_m 128.
#   STAGES="build ncu test bench prefill_test prefill_ncu prefill_bench launch_ab" (default: build
#   ncu); launch_ab times decode under each LAUNCH_CONFIGS entry (comma-separated env settings,
#   e.g. of the dependent launch, csrc/cuda/dependent_launch.cuh), one process each;
#   each stage is time-boxed; logs in $OUT.
#   NCU_CASES="Mixtral-8x7B:1 Mixtral-8x7B:4096 Qwen3-30B-A3B:1" (shape:T pairs)
#   PREFILL_NCU_CASE="Mixtral-8x7B 1024"; PREFILL_TEST_K="wgmma"; BENCH_SHAPES, BENCH_TOKENS
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_profile}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
STAGES=${STAGES:-"build ncu"}
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has build; then
  STAGES=build OUT=$OUT timeout 300 bash benchmarks/gpu_suite.sh | tail -3 || exit 1
fi
# The tree's jax_moeq when it holds a built CUDA library (the build stage, scripts/dev_build.sh),
# otherwise the installed package (an unbuilt tree first on PYTHONPATH would shadow it).
[ -f jax_moeq/lib/libjax_moeq_cuda.so ] && export PYTHONPATH=$PWD
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

if has prefill_test; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_wna16_gpu.py tests/test_mxint4_gpu.py \
    -k "${PREFILL_TEST_K:-wgmma}" -q -rs -p no:cacheprovider >"$OUT/prefill_test.log" 2>&1
  echo "== prefill tests (rc=$?): $(tail -1 "$OUT/prefill_test.log")"
  grep -E "FAILED|Error" "$OUT/prefill_test.log" | head
fi

if has prefill_ncu; then
  read -r shape t <<<"${PREFILL_NCU_CASE:-Mixtral-8x7B 1024}"
  timeout 240 ncu -k regex:Wgmma -c 2 --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --page raw \
    python3 benchmarks/wna16_kernel_times.py "$shape" "$t" - 128 >"$OUT/prefill_ncu.log" 2>&1
  echo "== ncu of the wgmma GEMMs, $shape T=$t (rc=$?)"
  grep -E "MoeInt4Wgmma|gpu__time_duration.sum|issue_stalled_.*per_issue_active|issue_active.avg.per_cycle|pipe_tensor.*pct" \
    "$OUT/prefill_ncu.log" | sed -E 's/ +/ /g' | cut -c1-150 | head -60
fi

if has prefill_bench; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/gpu_moe_bench.py --no-torch \
    --shapes "${BENCH_SHAPES:-Mixtral-8x7B,Qwen3-30B-A3B}" --tokens "${BENCH_TOKENS:-64,256,4096}" \
    --alt-block-m 128 --json "$OUT/prefill_bench.json" >"$OUT/prefill_bench.log" 2>&1
  echo "== prefill bench (rc=$?)"; tail -8 "$OUT/prefill_bench.log"
fi

if has launch_ab; then
  for cfg in ${LAUNCH_CONFIGS:-"JAX_MOEQ_DEPENDENT_LAUNCH=0" "JAX_MOEQ_DEPENDENT_LAUNCH=1"}; do
    echo "== launch_ab: $cfg"
    env ${cfg//,/ } timeout 150 python3 benchmarks/gpu_moe_bench.py --no-torch \
      --shapes "${AB_SHAPES:-Mixtral-8x7B,Qwen3-30B-A3B}" --tokens "${AB_TOKENS:-1,16}" \
      >"$OUT/ab_wna16_${cfg//[=,]/_}.log" 2>&1
    grep -E "^(Mixtral|Qwen3|DeepSeek)" "$OUT/ab_wna16_${cfg//[=,]/_}.log" | cut -c1-80
    env ${cfg//,/ } timeout 150 python3 benchmarks/mxint4_bench.py --no-peers \
      --shapes "${AB_SHAPES:-Mixtral-8x7B,Qwen3-30B-A3B}" --tokens "${AB_TOKENS:-1,16}" \
      >"$OUT/ab_mxint4_${cfg//[=,]/_}.log" 2>&1
    grep -E "^(Mixtral|Qwen3|DeepSeek)" "$OUT/ab_mxint4_${cfg//[=,]/_}.log" | cut -c1-80
  done
fi
