#!/usr/bin/env bash
# One run on a GPU machine: build the CUDA library, run the WNA16 GPU tests, a
# compute-sanitizer memcheck of a small case, and the benchmark. Logs go to $OUT (or /tmp).
#   STAGES="build test memcheck bench" (default all; "trace" adds ncu per-kernel times, TRACE=...;
#   "stalls" one kernel's ncu stall reasons, STALL_KERNEL=... STALL_SPEC=...; "probe" launch
#   variants timed in one process each, PROBES=...);
#   BENCH_ARGS="--quick" etc.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_suite}
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
     cmake --build build/gpu -j 16 >>"$OUT/build.log" 2>&1; then
    mkdir -p jax_moeq/lib && cp -f build/gpu/libjax_moeq_cuda.so jax_moeq/lib/
    cp -f build/gpu/_cpu_ffi*.so jax_moeq/ 2>/dev/null || true
    summary+=("build: ok ($(( $(date +%s) - start )) s)")
  else
    tail -30 "$OUT/build.log"
    echo "build: FAILED"; exit 1
  fi
fi
# The tree's jax_moeq when it holds a built CUDA library (the build stage, scripts/dev_build.sh),
# otherwise the installed package (an unbuilt tree first on PYTHONPATH would shadow it).
[ -f jax_moeq/lib/libjax_moeq_cuda.so ] && export PYTHONPATH=$PWD

if has test; then
  "$PY" -m pytest tests/test_wna16_gpu.py tests/test_wna16_layout.py ${TEST_ARGS:-} -q -x -rs --durations=6 \
    2>&1 | tee "$OUT/test.log" | tail -25
  summary+=("tests: $(tail -1 "$OUT/test.log")")
fi

if has memcheck; then
  cat >/tmp/wna16_memcheck_case.py <<'PYEOF'
import jax, jax.numpy as jnp
from jax_moeq.ops import wna16_gpu
from jax_moeq.quant import int4
e, h, i, t, k = 8, 256, 128, 5, 2
kq = jax.random.split(jax.random.PRNGKey(0), 6)
def weights(hidden, **g_idx):
  """Random int4 experts of this hidden size in the MARLIN layout (group 64)."""
  q13 = jax.random.randint(kq[0], (e, 2 * i, hidden), -8, 8).astype(jnp.int8)
  q2 = jax.random.randint(kq[1], (e, hidden, i), -8, 8).astype(jnp.int8)
  return wna16_gpu.convert_to_wna16_moe_kernel_format(
      "MARLIN", int4.pack_uint4b8_gptq(q13), int4.pack_uint4b8_gptq(q2),
      jnp.full((e, hidden // 64, 2 * i), 0.01, jnp.bfloat16),
      jnp.full((e, i // 64, hidden), 0.01, jnp.bfloat16), group_size=64, **g_idx)
for act_order, batched, block_m, loop in (
    (False, False, None, None), (True, False, None, None), (False, True, None, None),
    (False, False, 128, None), (True, False, 128, None), (False, True, 128, None),
    (False, False, 32, "wgmma"), (True, False, 64, "wgmma"), (False, True, 32, "wgmma")):
  gi = dict(w13_g_idx=jax.random.permutation(kq[2], jnp.tile(jnp.arange(h) // 64, (e, 1)), axis=1,
                                             independent=True),
            w2_g_idx=jax.random.permutation(kq[3], jnp.tile(jnp.arange(i) // 64, (e, 1)), axis=1,
                                            independent=True)) if act_order else {}
  w = weights(h, **gi)
  if batched:
    x = jax.random.normal(kq[4], (e, 3, h)).astype(jnp.bfloat16)
    y = wna16_gpu.batched_fused_marlin_moe(x, jnp.arange(e, dtype=jnp.int32) % 4, w,
                                           block_m=block_m, mainloop=loop)
  else:
    x = jax.random.normal(kq[4], (t, h)).astype(jnp.bfloat16)
    ids = jax.random.randint(kq[5], (t, k), 0, e)
    y = wna16_gpu.fused_marlin_moe(x, w, jnp.full((t, k), 0.5), ids, block_m=block_m,
                                   mainloop=loop)
  print("case", act_order, batched, block_m, loop, bool(jnp.isfinite(y.astype(jnp.float32)).all()))
# Aligned path, token 0 without a valid pair (the finalize writes its row as zeros).
x = jax.random.normal(kq[4], (t, h)).astype(jnp.bfloat16)
ids = jax.random.randint(kq[5], (t, k), 0, e).at[0].set(99)
y = wna16_gpu.fused_marlin_moe(x, w, jnp.full((t, k), 0.5), ids)
print("case token without a valid pair", bool(jnp.isfinite(y.astype(jnp.float32)).all()))
# A prefill of 8400 pairs: the alignment over several CTAs (count and scatter launches, counts in
# GEMM2's workspace) and the wgmma GEMMs, with out-of-range ids among the pairs.
tl = 4200
xl = jax.random.normal(kq[4], (tl, h)).astype(jnp.bfloat16)
ids = jax.random.randint(kq[5], (tl, k), -2, e + 2)
y = wna16_gpu.fused_marlin_moe(xl, w, jnp.full((tl, k), 0.5), ids)
print("case multi-CTA alignment", bool(jnp.isfinite(y.astype(jnp.float32)).all()))
# One token (the decode path without alignment; GEMM2 finalizes), with a foreign expert id.
x1 = jax.random.normal(kq[4], (1, h)).astype(jnp.bfloat16)
for ids in ([[1, 6]], [[3, 99]]):
  y = wna16_gpu.fused_marlin_moe(x1, w, jnp.full((1, k), 0.5), jnp.array(ids, jnp.int32))
  print("case one token", ids, bool(jnp.isfinite(y.astype(jnp.float32)).all()))
# One token with GEMM1 split (H = 2048: 8 ways; ws13's memset and GEMM1's fused activation).
hs = 2048
ws = weights(hs)
xs = jax.random.normal(kq[4], (1, hs)).astype(jnp.bfloat16)
for ids in ([[1, 6]], [[3, 99]]):
  y = wna16_gpu.fused_marlin_moe(xs, ws, jnp.full((1, k), 0.5), jnp.array(ids, jnp.int32))
  print("case one token, GEMM1 split", ids, bool(jnp.isfinite(y.astype(jnp.float32)).all()))
# The fused decode kernel (fused_decode=True), with a foreign expert id too.
for ids in ([[1, 6]], [[3, 99]]):
  y = wna16_gpu.fused_marlin_moe(xs, ws, jnp.full((1, k), 0.5), jnp.array(ids, jnp.int32),
                                 fused_decode=True)
  print("case fused decode", ids, bool(jnp.isfinite(y.astype(jnp.float32)).all()))
PYEOF
  # Platform allocator: each buffer its own cudaMalloc, so overruns are visible.
  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$PY" /tmp/wna16_memcheck_case.py >"$OUT/memcheck.log" 2>&1
  rc=$?
  tail -6 "$OUT/memcheck.log"
  summary+=("memcheck: rc=$rc, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
fi

if has trace; then
  # Per-kernel durations under ncu (benchmarks/layer_trace.py), one line of means per kernel, also
  # in $OUT/trace.log; the raw CSVs go into one archive, $OUT/trace_csv.tgz.
  # TRACE="op shape T; ..." (default: the small-expert decode shapes).
  raw=$(mktemp -d)
  IFS=';' read -ra specs <<<"${TRACE:-wna16 Qwen3-30B-A3B 1; wna16 Qwen3-30B-A3B 16; mxint4 Qwen3-30B-A3B 1; mxint4 Qwen3-30B-A3B 16}"
  for spec in "${specs[@]}"; do
    spec=$(echo $spec)  # trims the blanks around each entry
    name=$(echo $spec | tr ' ' '_')
    timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      -k "regex:Align|Finalize|MoeInt4|MxInt4|Permute|DecodeLayer|W4a8" "$PY" benchmarks/layer_trace.py $spec \
      >"$raw/ncu_$name.csv" 2>"$raw/ncu_$name.err"
    echo "== trace $spec"
    "$PY" benchmarks/layer_trace.py --summary "$raw/ncu_$name.csv" 2>&1 | cut -c1-110
    [ "${PIPESTATUS[0]}" = 0 ] || tail -3 "$raw/ncu_$name.err"
  done 2>&1 | tee -a "$OUT/trace.log"
  tar czf "$OUT/trace_csv.tgz" -C "$raw" . && rm -rf "$raw"
fi

if has stalls; then
  # Why one kernel waits: ncu's warp-state (stall reasons), scheduler and source-counter sections
  # for the first launch of kernels matching STALL_KERNEL in one traced layer, into
  # $OUT/stalls.log. STALL_SPEC="op shape T" (default: MxInt4 routing at Qwen3 T=1).
  timeout 180 ncu --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --section LaunchStats -k "regex:${STALL_KERNEL:-MxInt4Routing}" -c 1 \
    "$PY" benchmarks/layer_trace.py ${STALL_SPEC:-mxint4 Qwen3-30B-A3B 1} >"$OUT/stalls.log" 2>&1
  grep -E "Stall|stall|Warp Cycles|Issued|Eligible|Active Warps|Duration|Registers|Grid|Block" \
    "$OUT/stalls.log" | head -40
fi

if has probe; then
  # Launch variants timed in one process each (benchmarks/launch_probe.py), one line per variant
  # into $OUT/probe.log. PROBES="op shape T variant...; ..." (default: GEMM2 split 2 against the
  # library's choice at the small-expert T=16 shape); PROBE_TIMEOUT per process.
  IFS=';' read -ra specs <<<"${PROBES:-wna16 Qwen3-30B-A3B 16 auto 1.2; mxint4 Qwen3-30B-A3B 16 auto 1.2}"
  for spec in "${specs[@]}"; do
    echo "== probe $(echo $spec)"
    timeout "${PROBE_TIMEOUT:-150}" "$PY" benchmarks/launch_probe.py $spec 2>&1 | grep -v "^round"
  done 2>&1 | tee -a "$OUT/probe.log"
fi

if has bench; then
  "$PY" benchmarks/gpu_moe_bench.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -25
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
