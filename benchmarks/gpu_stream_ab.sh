#!/usr/bin/env bash
# The one-token streaming kernels on the device in one call: compute-sanitizer over their variants
# and the stream / one-token / handler GPU tests (beside each other), then in-process A/B of the
# launch forms (launch_probe.py) and per-kernel ncu times. Results under $OUT.
#   OUT=/tmp/s bash benchmarks/gpu_stream_ab.sh
# Environment: STAGES (default "check ab ncu"; "gap" times graph_gap_probe.py), AB_VARIANTS
# (default "auto auto/kernels"), AB_CASES (op:shape pairs), NCU_VARIANTS, GAP_* (the gap stage).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_stream_ab}
mkdir -p "$OUT"
STAGES=${STAGES:-"check ab ncu"}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,driver_version --format=csv,noheader
start=$(date +%s)
if [[ " $STAGES " == *" check "* ]]; then
  OUT=$OUT/san BUILD=0 TOOL_TIMEOUT=${TOOL_TIMEOUT:-240} VARIANTS=${SAN_VARIANTS:-wna16_stream,wna16_stream_fp16_zeros,wna16_stream_foreign_ids,mxint4_stream_deepseek,mxint4_stream_ep,wna16_fused_decode,wna16_fused_decode_fp16,mxint4_fused_decode_deepseek} \
    bash scripts/sanitize_gpu.sh >"$OUT/sanitize.txt" 2>&1 &
  san=$!
  OUT=$OUT SHARDS=${SHARDS:-3} FILES="tests/test_wna16_gpu.py tests/test_mxint4_gpu.py tests/test_gpu_launch.py" \
    TEST_ARGS=${TEST_ARGS:-'-k "stream or one_token or handler or out_of_range or odd"'} TEST_TIMEOUT=240 \
    bash benchmarks/gpu_tests.sh
  wait $san
  tail -6 "$OUT/sanitize.txt"
  echo "check: $(( $(date +%s) - start )) s"
fi
if [[ " $STAGES " == *" ab "* ]]; then
  for case in ${AB_CASES:-wna16:Qwen3-30B-A3B wna16:DeepSeek-V2-Lite mxint4:Qwen3-30B-A3B}; do
    timeout 150 python3 benchmarks/launch_probe.py "${case%%:*}" "${case#*:}" 1 \
      ${AB_VARIANTS:-auto auto/kernels} 2>/dev/null | tee -a "$OUT/ab.txt"
  done
  echo "ab: $(( $(date +%s) - start )) s"
fi
if [[ " $STAGES " == *" gap "* ]]; then
  # Where the graph's time goes (graph_gap_probe.py), one process per library in turn: GAP_LIBS
  # (paths under the tree; the first the tree's build), GAP_CASES, GAP_VARIANTS, GAP_ROUNDS.
  # 32 chained layers a call over 8 weight sets: enough GPU work a call that the host's dispatch
  # no longer sets the wall time (docs/gpu_notes.md, "Measuring on the GPU").
  for r in $(seq "${GAP_ROUNDS:-2}"); do
    for case in ${GAP_CASES:-wna16:Qwen3-30B-A3B wna16:DeepSeek-V2-Lite}; do
      for lib in ${GAP_LIBS:-jax_moeq/lib/libjax_moeq_cuda.so}; do
        echo "== round $r: $lib" | tee -a "$OUT/gap.txt"
        JAX_MOEQ_CUDA_LIBRARY=$PWD/$lib LAUNCH_PROBE_CHAIN=1 LAUNCH_PROBE_LAYERS=${GAP_LAYERS:-32} \
          LAUNCH_PROBE_WEIGHT_SETS=8 \
          timeout 150 python3 benchmarks/graph_gap_probe.py "${case%%:*}" "${case#*:}" 1 \
          ${GAP_VARIANTS:-auto} 2>/dev/null | tee -a "$OUT/gap.txt"
      done
    done
  done
  echo "gap: $(( $(date +%s) - start )) s"
fi
if [[ " $STAGES " == *" ncu "* ]]; then
  for v in ${NCU_VARIANTS:-auto}; do
    f=$OUT/ncu_${v//[^a-z0-9]/_}.csv
    timeout 150 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
      --csv -k "regex:OneToken" python3 benchmarks/layer_trace.py wna16 Qwen3-30B-A3B 1 "$v" \
      >"$f" 2>"$OUT/ncu.log"
    echo "ncu wna16 Qwen3 T=1 $v:"; python3 benchmarks/layer_trace.py --summary "$f"
  done
  echo "ncu: $(( $(date +%s) - start )) s"
fi
