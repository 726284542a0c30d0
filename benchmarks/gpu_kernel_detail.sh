#!/usr/bin/env bash
# Why chosen kernels take their time: ncu's throughput, warp-state (stall reasons), scheduler,
# instruction-mix, memory and occupancy sections for the first N launches matching a regex, one
# log per case in $OUT, with the headline figures printed. Each case is "label|regex|N|script args":
#   OUT=/tmp/detail bash benchmarks/gpu_kernel_detail.sh \
#     "wna16_qwen3_256|MoeInt4Gemm|2|benchmarks/layer_trace.py wna16 Qwen3-30B-A3B 256" \
#     "w4a8_qwen3_4096|W4a8Wgmma|2|benchmarks/w4a8_layer_once.py Qwen3-30B-A3B 4096"
# ncu runs at its locked base clocks: read the durations relative to each other.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_kernel_detail}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
for spec in "$@"; do
  IFS='|' read -r label regex count args <<<"$spec"
  log="$OUT/detail_$label.log"
  timeout "${DETAIL_TIMEOUT:-240}" ncu --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section InstructionStats --section LaunchStats --section Occupancy \
    --page raw -k "regex:$regex" -c "$count" "$PY" $args >"$log" 2>&1
  echo "== $label (rc=$?)"
  grep -E "^  [A-Za-z_].*\(|gpu__time_duration.sum|(dram|lts|sm)__throughput.avg.pct_of_peak_sustained_elapsed|dram__bytes_read.sum.per_second|smsp__issue_active.avg.per_cycle_active|smsp__warps_(active|eligible).avg.per_cycle_active|smsp__average_warp_latency_per_inst_issued|issue_stalled_.*per_issue_active|pipe_tensor.*pct|pipe_shared.*pct|launch__(registers_per_thread|grid_size|occupancy_limit)|smsp__inst_executed.sum " \
    "$log" | sed -E 's/\(const[^)]*\)//; s/ +/ /g' | awk '$NF != "0" && $NF != "0.00"' | cut -c1-150
done
