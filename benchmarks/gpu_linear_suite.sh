#!/usr/bin/env bash
# One run on a GPU machine for the WNA16 dense linear: build the CUDA library (only: the tests
# need no CPU kernels), run tests/test_wna16_linear_gpu.py (and the MoE tests of the GEMM paths it
# shares), a compute-sanitizer memcheck of small cases, and benchmarks/gpu_linear_bench.py. Logs
# go to $OUT (or /tmp/gpu_linear_suite).
#   STAGES="build test memcheck bench" (default; "trace" adds ncu kernel times of a few calls);
#   TEST_ARGS, BENCH_ARGS (e.g. "--quick --variants"); each stage has a time limit
#   (TEST_TIMEOUT, MOE_TEST_TIMEOUT (0 skips the MoE tests), MEMCHECK_TIMEOUT, TRACE_TIMEOUT,
#   BENCH_TIMEOUT, in seconds) so that a slow stage still leaves the logs of the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_linear_suite}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test memcheck bench"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has build; then
  start=$(date +%s)
  if cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOEQ_CUDA=ON \
       -DPython_EXECUTABLE="$(command -v "$PY")" \
       -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
       >"$OUT/build.log" 2>&1 &&
     cmake --build build/gpu -j 16 --target jax_moeq_cuda >>"$OUT/build.log" 2>&1; then
    mkdir -p jax_moeq/lib && cp -f build/gpu/libjax_moeq_cuda.so jax_moeq/lib/
    summary+=("build: ok ($(( $(date +%s) - start )) s)")
  else
    tail -30 "$OUT/build.log"
    echo "build: FAILED"; exit 1
  fi
fi
[ -f jax_moeq/lib/libjax_moeq_cuda.so ] && export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,driver_version --format=csv,noheader \
  2>&1 | tee "$OUT/gpu.txt"

if has test; then
  start=$(date +%s)
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/test_wna16_linear_gpu.py ${TEST_ARGS:-} -q -rs \
    --durations=5 2>&1 | tee "$OUT/test.log" | tail -30
  summary+=("tests: $(tail -1 "$OUT/test.log") ($(( $(date +%s) - start )) s)")
  # The fused MoE's tests of the GEMM paths the dense linear shares (its row and expert lookups
  # in both GEMMs, the rounded-store epilogue), MOE_TEST_TIMEOUT=0 skips them.
  if [ "${MOE_TEST_TIMEOUT:-90}" != 0 ]; then
    start=$(date +%s)
    timeout "${MOE_TEST_TIMEOUT:-90}" "$PY" -m pytest tests/test_wna16_gpu.py -q -rs \
      -k "${MOE_TEST_SELECT:-wgmma_vs_reference or block_sizes_agree}" \
      2>&1 | tee "$OUT/test_moe.log" | tail -5
    summary+=("MoE tests: $(tail -1 "$OUT/test_moe.log") ($(( $(date +%s) - start )) s)")
  fi
fi

if has memcheck; then
  cat >/tmp/wna16_linear_memcheck_case.py <<'PYEOF'
import jax, jax.numpy as jnp
from jax_moeq.ops import wna16_linear_gpu as wl
n, k = 320, 1024  # N % 128 == 64: the wgmma GEMM's half tile
kq = jax.random.split(jax.random.PRNGKey(0), 6)
q = jax.random.randint(kq[0], (n, k), -8, 8).astype(jnp.int8)
s = jnp.full((n, k // 64), 0.01, jnp.bfloat16)
g_idx = jax.random.permutation(kq[1], jnp.arange(k) // 64).astype(jnp.int32)
z = jax.random.randint(kq[2], (n, k // 64), -8, 8)
b = jax.random.normal(kq[3], (n,))
plain = wl.pack_wna16_linear(q, s, 64)
full = wl.pack_wna16_linear(q, s, 64, g_idx=g_idx, zeros=z, bias=b)
# (rows, block_m, mainloop, split): decode with split-K, each mma.sync tile, each wgmma tile,
# rows that end inside a block.
for rows, bm, loop, split in ((1, None, None, None), (3, 8, "registers", 4), (5, 8, "async_ring", 2),
                              (7, 8, "bulk_copy", 1), (13, 16, None, 4), (30, 32, None, 1),
                              (50, 64, None, 2), (20, 32, "wgmma", 1), (40, 64, "wgmma", 1),
                              (300, 128, None, 1)):
  x = jax.random.normal(kq[4], (rows, k)).astype(jnp.bfloat16)
  for w in (plain, full):
    y = wl.wna16_linear(x, w, block_m=bm, mainloop=loop, split=split)
    print("case", rows, bm, loop, split, w.act_order, bool(jnp.isfinite(y.astype(jnp.float32)).all()))
PYEOF
  # Platform allocator: each buffer its own cudaMalloc, so overruns are visible.
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "${MEMCHECK_TIMEOUT:-150}" compute-sanitizer \
    --tool memcheck --error-exitcode 9 "$PY" /tmp/wna16_linear_memcheck_case.py \
    >"$OUT/memcheck.log" 2>&1
  rc=$?
  tail -6 "$OUT/memcheck.log"
  summary+=("memcheck: rc=$rc, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
fi

if has trace; then
  # Kernel-only durations (ncu) of a few automatic launches, three calls each, in call order:
  # what the GEMM itself takes, beside the in-harness times of the bench. $OUT/trace.log.
  cat >/tmp/wna16_linear_trace_case.py <<'PYEOF'
import sys
import jax, jax.numpy as jnp
sys.path.insert(0, "benchmarks")
from gpu_linear_bench import SHAPES, random_linear
from jax_moeq.ops import wna16_linear_gpu as wl
op = jax.jit(wl.wna16_linear)
for name, m in (("qkv_proj", 1), ("o_proj", 1), ("mlp_down", 1), ("o_proj", 16), ("qkv_proj", 64),
                ("o_proj", 256), ("lm_head", 1)):
  n, k = SHAPES[name]
  w = random_linear(jax.random.PRNGKey(0), n, k)
  x = jax.random.normal(jax.random.PRNGKey(1), (m, k)).astype(jnp.bfloat16)
  for _ in range(3):
    jax.block_until_ready(op(x, w))
  print("case", name, m, wl.choose_linear_launch(m, n, k), flush=True)
PYEOF
  timeout "${TRACE_TIMEOUT:-120}" ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    -k "regex:MoeInt4|Permute" "$PY" /tmp/wna16_linear_trace_case.py >"$OUT/trace.csv" 2>"$OUT/trace.err"
  "$PY" - "$OUT/trace.csv" <<'PYEOF' 2>&1 | tee "$OUT/trace.log"
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
for line in lines:
  if line.startswith("case"):
    print(line)
rows = [r for r in csv.reader(l for l in lines if l.startswith('"')) if len(r) > 5]
head, body = rows[0], rows[1:]
at = {k: head.index(k) for k in ("ID", "Kernel Name", "Grid Size", "Metric Value")}
for r in body:
  name = r[at["Kernel Name"]].split("(")[0].replace("jax_moeq::cuda::", "")[:70]
  print(f'{r[at["ID"]]:>4} {name:70} grid {r[at["Grid Size"]]:>16} {r[at["Metric Value"]]:>10} ns')
PYEOF
fi

if has bench; then
  timeout "${BENCH_TIMEOUT:-300}" "$PY" benchmarks/gpu_linear_bench.py --json "$OUT/bench.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -32
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
