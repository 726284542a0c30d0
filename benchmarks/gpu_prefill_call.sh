#!/usr/bin/env bash
# One GPU call for prefill work on the wgmma GEMM (block_m 128): build, its correctness tests, an
# ncu look at the two GEMM launches (pipe use, stall reasons, memory throughput), and a timing of
# the default launch beside block_m 128 at several T. Logs in $OUT.
#   STAGES="build test ncu bench" (default all); NCU_CASE="Mixtral-8x7B 1024"; BENCH_TOKENS=...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_prefill}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
STAGES=${STAGES:-"build test ncu bench"}
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has build; then
  STAGES=build OUT=$OUT timeout 300 bash benchmarks/gpu_suite.sh | tail -1 || exit 1
fi
if has test; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_wna16_gpu.py tests/test_mxint4_gpu.py \
    -k "${TEST_K:-wgmma}" -q -rs -p no:cacheprovider >"$OUT/test.log" 2>&1
  echo "== tests (rc=$?): $(tail -1 "$OUT/test.log")"; grep -E "FAILED|Error" "$OUT/test.log" | head
fi
if has ncu; then
  read -r shape t <<<"${NCU_CASE:-Mixtral-8x7B 1024}"
  timeout 240 ncu -k regex:Wgmma -c 2 --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/wna16_kernel_times.py "$shape" "$t" - 128 >"$OUT/ncu_sections.log" 2>&1
  echo "== ncu sections $shape T=$t (rc=$?)"
  grep -E "MoeInt4Wgmma|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Stall|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|Mem Pipes Busy" \
    "$OUT/ncu_sections.log" | sed -E 's/ +/ /g' | cut -c1-150 | head -60
fi
if has bench; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/gpu_moe_bench.py --no-torch \
    --shapes "${BENCH_SHAPES:-Mixtral-8x7B,Qwen3-30B-A3B}" --tokens "${BENCH_TOKENS:-64,256,4096}" \
    --alt-block-m 128 --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1
  echo "== bench (rc=$?)"; tail -8 "$OUT/bench.log"
fi
