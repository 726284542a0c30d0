#!/usr/bin/env bash
# One short GPU call: build, per-kernel times (ncu) of the WNA16 op at decode and prefill, then
# the WNA16 + MxInt4 GPU tests. Each stage is time-boxed; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_profile}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
STAGES=build OUT=$OUT timeout 300 bash benchmarks/gpu_suite.sh | tail -3 || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
profile() {  # name T
  timeout 90 ncu --print-summary per-kernel --metrics gpu__time_duration.sum \
    -k "regex:Moe|Align|Finalize|Permute" python3 benchmarks/wna16_kernel_times.py "$1" "$2" \
    >"$OUT/ncu_$1_$2.log" 2>&1
  echo "== ncu $1 T=$2 (rc=$?)"
  grep -E "^  [A-Za-z_].*\(|gpu__time_duration.sum" "$OUT/ncu_$1_$2.log" | \
    sed -E 's/ +/ /g' | paste - - | awk '{print substr($0, 1, 160)}'
}
profile Mixtral-8x7B 1
profile Mixtral-8x7B 4096
profile Qwen3-30B-A3B 1
timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/test_wna16_gpu.py tests/test_mxint4_gpu.py \
  tests/test_nn.py -k "gpu or GPU or wna16 or mxint4" -q -rs -p no:cacheprovider -x \
  >"$OUT/test.log" 2>&1
echo "== tests (rc=$?): $(tail -1 "$OUT/test.log")"
