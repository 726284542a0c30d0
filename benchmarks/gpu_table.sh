#!/usr/bin/env bash
# The GPU targets' table in one or two runs on one GPU machine: WNA16 beside XLA's bf16
# ragged_dot and torch's grouped GEMM, W4A8 beside WNA16, MxInt4, and tokamax's int4 ragged_dot
# beside WNA16, at T in $TOKENS on the three benchmark shapes. JSON per part in $OUT (the input
# of benchmarks/plot_gpu_roofline.py), the log in $OUT/table.log. Every part's rows also carry
# the in-graph time by the GPU's timestamps beside the wall time (--gpu-time: gpu_us, or
# <op>_gpu_us in the side-by-side parts).
#   PARTS="wna16 w4a8 mxint4" OUT=... bash benchmarks/gpu_table.sh
#   PARTS=tokamax TOKAMAX_SHAPES=Qwen3-30B-A3B WHEELS=.carry/tkw OUT=... bash benchmarks/gpu_table.sh
# Expects the CUDA library built (gpu_suite.sh STAGES=build) or installed; tokamax and its
# dependencies come from $WHEELS when the machine has none (benchmarks/_host_wheels.sh). The
# wheels of the 2026-11-27 run (`pip download --no-deps --python-version 3.12 --only-binary=:all:
# --platform manylinux2014_x86_64 --platform any ...`): tokamax 0.0.17, qwix 0.1.8, einshape 1.0,
# immutabledict 4.3.1, tensorboardx 2.6.5, pydantic 2.14.4, pydantic-core 2.50.5,
# typing-extensions 4.16.0, typing-inspection 0.4.5, annotated-types 0.8.0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_table}
PY=${PYTHON:-python3}
PARTS=${PARTS:-"wna16 w4a8 mxint4"}
TOKENS=${TOKENS:-1,16,64,256,1024,4096}
SHAPES=${SHAPES:-Mixtral-8x7B,Qwen3-30B-A3B,DeepSeek-V2-Lite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -f jax_moeq/lib/libjax_moeq_cuda.so ] && export PYTHONPATH=$PWD
. benchmarks/_host_wheels.sh
log="$OUT/table.log"
{
  date -u
  git log -1 --format='tree %h %s' 2>/dev/null
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv
} | tee -a "$log"
has() { [[ " $PARTS " == *" $1 "* ]]; }
run() {  # label, command...
  local label=$1 start
  shift
  start=$(date +%s)
  echo "== $label: $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log" | grep -vE '^\{' | tail -40
  echo "== $label: $(($(date +%s) - start)) s" | tee -a "$log"
}
has wna16 && run wna16 "$PY" benchmarks/gpu_moe_bench.py --alt-kw none --gpu-time \
  --shapes "$SHAPES" --tokens "$TOKENS" --json "$OUT/wna16.json"
has w4a8 && run w4a8 "$PY" benchmarks/w4a8_gpu_bench.py --gpu-time --shapes "$SHAPES" \
  --tokens "$TOKENS" --json "$OUT/w4a8.json"
has mxint4 && run mxint4 "$PY" benchmarks/mxint4_bench.py --no-peers --alt-kw none --gpu-time \
  --shapes "$SHAPES" --tokens "$TOKENS" --json "$OUT/mxint4.json"
if has tokamax; then
  if ! "$PY" -c "import tokamax, qwix" 2>/dev/null; then
    use_wheels "${WHEELS:?tokamax is not installed: WHEELS=<folder of its wheels>}" /tmp/tokamax_site ||
      { echo "tokamax wheels did not install" | tee -a "$log"; exit 1; }
  fi
  IFS=, read -ra tk_shapes <<<"${TOKAMAX_SHAPES:-$SHAPES}"
  for shape in "${tk_shapes[@]}"; do
    run "tokamax $shape" "$PY" benchmarks/tokamax_bench.py --gpu-time --shapes "$shape" \
      --tokens "$TOKENS" --json "$OUT/tokamax_$shape.json"
  done
fi
