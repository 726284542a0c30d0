#!/usr/bin/env bash
# Expert parallelism on a multi-GPU machine, in one call: build the CUDA library, run the
# multi-GPU tests (every GPU scheme's sharded experts against one GPU), the whole-model greedy
# checks (1 vs 2 vs all GPUs in one process; one process per GPU under jax.distributed), and
# benchmarks/ep_gpu_bench.py. Logs and JSON go to $OUT (or /tmp/multi_gpu_suite).
#   STAGES="build test model bench" (default); "exchange" times the exchanges alone under each
#     of XLA's ragged_all_to_all implementations (benchmarks/ep_exchange_gpu_bench.py); "big" adds benchmarks/ep_model_bench.py, the
#     Qwen3-235B-A22B-shaped model from from_config(mesh=...) on all GPUs (MODEL_ARGS, default
#     "--layers 94 --batch 1,64 --dispatch all_to_all": decode and prefill tokens/s, peak memory
#     per GPU, decode roofline);
#   BENCH_ARGS: ep_gpu_bench.py's arguments (default: both shapes, 1 and all GPUs, T per GPU
#     16 / 1024 / 4096, the three dispatches, 8 layers, NCCL kernels profiled);
#   BENCH_XLA_FLAGS: XLA_FLAGS of the bench's process only (e.g. XLA's ragged_all_to_all
#     decomposer, see the exchange stage);
#   Stages run in the order test, model, exchange, big, bench;
#   LIMIT: seconds the whole run may take (default 570: a device call's 600 s, less a margin);
#     each stage gets what is left, the bench stops starting configurations in time.
# Stage times on 4 H200s (2026-11-26): test ~200 s, model ~220 s, big at 16 layers ~180 s (94
# layers: ~210 s of build alone on 2 GPUs), bench (2 shapes x T 16/1024/4096 x 2 dispatches, 4
# layers, profiled) ~220 s: plan two stages per call.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the others: /work/.library/device/KINDS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/multi_gpu_suite}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test model bench"}
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-570}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }
left() { echo $(( LIMIT - SECONDS )); }

{
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,clocks.mem,memory.total,power.draw \
    --format=csv
  nvidia-smi topo -m
  env | grep -E '^(NCCL|NVSHMEM|TORCH_SYMM)' | sort
  "$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
} >"$OUT/machine.txt" 2>&1
head -20 "$OUT/machine.txt"

if has build; then
  start=$SECONDS
  # The CUDA library alone (as model_suite.sh): the GPU runs need no CPU kernels.
  if timeout "$(left)" bash -c '
       cmake -S . -B build/multi_gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOEQ_CUDA=ON \
         -DPython_EXECUTABLE="$(command -v "'"$PY"'")" \
         -Dpybind11_DIR="$("'"$PY"'" -c "import pybind11; print(pybind11.get_cmake_dir())")" &&
       cmake --build build/multi_gpu -j "$(nproc)" --target jax_moeq_cuda' >"$OUT/build.log" 2>&1
  then
    mkdir -p jax_moeq/lib && cp -f build/multi_gpu/libjax_moeq_cuda.so jax_moeq/lib/
    summary+=("build: ok ($(( SECONDS - start )) s)")
  else
    tail -30 "$OUT/build.log"
    echo "build: FAILED"; exit 1
  fi
fi
# The tree's jax_moeq when it holds a built CUDA library, otherwise the installed package.
[ -f jax_moeq/lib/libjax_moeq_cuda.so ] && export PYTHONPATH=$PWD

if has test; then
  start=$SECONDS
  timeout "$(left)" "$PY" -m pytest -m gpu -q -rs -s --durations=5 \
    tests/test_sharding_experts.py tests/test_sharding.py >"$OUT/test.log" 2>&1
  summary+=("tests (sharded experts, ragged dispatch): $(tail -1 "$OUT/test.log") ($(( SECONDS - start )) s)")
  # The MxInt4 routing step and one-slot rows that its exchanged pairs run on.
  timeout "$(left)" "$PY" -m pytest -m gpu -q -rs tests/test_mxint4_gpu.py \
    -k "routing_op or one_slot" >"$OUT/test_mxint4.log" 2>&1
  summary+=("tests (MxInt4 routing op, one-slot rows): $(tail -1 "$OUT/test_mxint4.log")")
  grep -E "rel .* bit-identical" "$OUT/test.log" >"$OUT/test_cases.txt" || true
  tail -5 "$OUT/test.log"
fi

if has model; then
  start=$SECONDS
  timeout "$(left)" "$PY" -m pytest -m gpu -q -rs -s --durations=5 \
    tests/test_sharded_loading.py tests/test_multiprocess.py >"$OUT/model.log" 2>&1
  summary+=("whole-model greedy checks: $(tail -1 "$OUT/model.log") ($(( SECONDS - start )) s)")
  grep -E "greedy tokens equal" "$OUT/model.log" || true
  tail -5 "$OUT/model.log"
fi

if has exchange; then
  # The exchanges alone under each of XLA's ragged_all_to_all implementations (one process each:
  # XLA reads its flags once). An XLA without a flag aborts at start: that line says so.
  for flags in "" --xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false \
               --xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true; do
    [ "$(left)" -gt 60 ] || break
    tag=${flags:-default}; tag=${tag##*--xla_gpu_unsupported_}
    XLA_FLAGS="$flags" timeout 120 "$PY" benchmarks/ep_exchange_gpu_bench.py \
      --label="${flags:-default}" --json "$OUT/exchange_${tag%%=*}.json" \
      >"$OUT/exchange_${tag%%=*}.txt" 2>&1
    echo "exchange ${flags:-default}: exit $?"; tail -12 "$OUT/exchange_${tag%%=*}.txt"
  done
  summary+=("exchange: $(ls "$OUT"/exchange_*.json 2>/dev/null | wc -l) settings")
fi

if has big; then
  start=$SECONDS
  # shellcheck disable=SC2086
  timeout "$(left)" "$PY" benchmarks/ep_model_bench.py \
    ${MODEL_ARGS:---layers 94 --batch 1,64 --dispatch all_to_all} --json "$OUT/ep_model_bench.json" \
    2>"$OUT/ep_model_bench.err" | tee "$OUT/ep_model_bench.txt"
  summary+=("big model: exit ${PIPESTATUS[0]} ($(( SECONDS - start )) s)")
  tail -5 "$OUT/ep_model_bench.err"
fi

if has bench; then
  budget=$(( $(left) - 90 ))  # the configuration under way when the budget runs out finishes
  if [ "$budget" -gt 30 ]; then
    n=$("$PY" -c 'import jax; print(len(jax.devices("gpu")))' 2>/dev/null || echo 1)
    # shellcheck disable=SC2086
    XLA_FLAGS="${BENCH_XLA_FLAGS:-${XLA_FLAGS:-}}" timeout "$(left)" "$PY" benchmarks/ep_gpu_bench.py \
      ${BENCH_ARGS:---shapes dsv3,qwen235 --gpus 1,$n --tokens 16,1024,4096 \
        --dispatch all_to_all,ragged_all_to_all,replicated --layers 8 --profile} \
      --budget-seconds "$budget" --json "$OUT/ep_gpu_bench.json" \
      2>"$OUT/ep_gpu_bench.err" | tee "$OUT/ep_gpu_bench.txt"
    summary+=("bench: exit ${PIPESTATUS[0]}, $(grep -c '^| ' "$OUT/ep_gpu_bench.txt") rows")
    tail -5 "$OUT/ep_gpu_bench.err"
  else
    summary+=("bench: skipped (${budget} s left)")
  fi
fi

printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
