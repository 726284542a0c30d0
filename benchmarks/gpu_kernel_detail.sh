#!/usr/bin/env bash
# Why chosen kernels take their time: ncu's throughput, warp-state (stall reasons), scheduler,
# instruction-mix, memory and occupancy sections for the first N launches matching a regex, one
# log per case in $OUT, with the headline figures printed. Each case is "label|regex|N|script args":
#   OUT=/tmp/detail bash benchmarks/gpu_kernel_detail.sh \
#     "wna16_qwen3_256|MoeInt4Gemm|2|benchmarks/layer_trace.py wna16 Qwen3-30B-A3B 256" \
#     "w4a8_qwen3_4096|W4a8Wgmma|2|benchmarks/w4a8_layer_once.py Qwen3-30B-A3B 4096"
# ncu runs at its locked base clocks: read the durations relative to each other.
# SECTIONS=0: only the source counters (below).
# SOURCE=1: also ncu's per-instruction counters (SourceCounters) of the first matching launch,
# exported as $OUT/source_<label>.csv (SASS address, opcode, executed count, stall samples) and
# summed by benchmarks/sass_source_summary.py into $OUT/source_<label>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_kernel_detail}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
for spec in "$@"; do
  IFS='|' read -r label regex count args <<<"$spec"
  log="$OUT/detail_$label.log"
  if [ "${SECTIONS:-1}" = 1 ]; then
    timeout "${DETAIL_TIMEOUT:-240}" ncu --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section InstructionStats --section LaunchStats --section Occupancy \
      --page raw -k "regex:$regex" -c "$count" "$PY" $args >"$log" 2>&1
    echo "== $label (rc=$?)"
    grep -E "^  [A-Za-z_].*\(|gpu__time_duration.sum|(dram|lts|sm)__throughput.avg.pct_of_peak_sustained_elapsed|dram__bytes_read.sum.per_second|smsp__issue_active.avg.per_cycle_active|smsp__warps_(active|eligible).avg.per_cycle_active|smsp__average_warp_latency_per_inst_issued|issue_stalled_.*per_issue_active|pipe_tensor.*pct|pipe_shared.*pct|launch__(registers_per_thread|grid_size|occupancy_limit)|smsp__inst_executed.sum " \
      "$log" | sed -E 's/\(const[^)]*\)//; s/ +/ /g' | awk '$NF != "0" && $NF != "0.00"' | cut -c1-150
  fi
  if [ "${SOURCE:-0}" = 1 ]; then
    rep="$(mktemp -d)/source_$label"
    timeout "${DETAIL_TIMEOUT:-240}" ncu --section SourceCounters --import-source no \
      -k "regex:$regex" -c 1 -o "$rep" "$PY" $args >"$OUT/source_$label.log" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/source_$label.csv" \
      2>>"$OUT/source_$label.log"
    echo "== $label source counters (rc=$?, $(wc -l <"$OUT/source_$label.csv") lines)"
    rm -rf "$(dirname "$rep")"  # the report itself: the CSV holds what is used
    "$PY" benchmarks/sass_source_summary.py "$OUT/source_$label.csv" | tee "$OUT/source_$label.txt"
  fi
done
