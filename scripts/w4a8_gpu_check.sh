#!/usr/bin/env bash
# The GPU W4A8 fused MoE on a Hopper machine in one run (under 9 minutes on an H100): build the
# CUDA library into build/w4a8gpu (used through JAX_MOEQ_CUDA_LIBRARY, nothing copied into the
# package), the SASS's int8 wgmma count, tests/test_w4a8_gpu.py (+ the oracle tests), a
# compute-sanitizer memcheck of small cases, and the W4A8 vs WNA16 benchmark at the SPEC §10 GPU
# shapes. A failing step is recorded and the next one runs; a summary ends the output. Logs go to
# $OUT (default /tmp/w4a8_gpu_check).
#   STAGES="build sass test memcheck bench"  BENCH_ARGS="--tokens 1,4096"  TEST_ARGS="-k quantizer"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/w4a8_gpu_check}
mkdir -p "$OUT"
STAGES=${STAGES:-"build sass test memcheck bench"}
PY=${PYTHON:-python3}
BUILD=${BUILD_DIR:-build/w4a8gpu}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
export JAX_MOEQ_CUDA_LIBRARY=$PWD/$BUILD/libjax_moeq_cuda.so
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) s"; }

if has build; then
  if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOEQ_CUDA=ON \
       -DPython_EXECUTABLE="$(command -v "$PY")" \
       -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
       >"$OUT/build.log" 2>&1 &&
     timeout 300 cmake --build "$BUILD" -j 16 --target jax_moeq_cuda >>"$OUT/build.log" 2>&1; then
    summary+=("build: ok (at $(stamp))")
  else
    tail -30 "$OUT/build.log"
    summary+=("build: FAILED (see build.log)")
  fi
fi
if [ ! -f "$JAX_MOEQ_CUDA_LIBRARY" ]; then
  echo "no CUDA library at $JAX_MOEQ_CUDA_LIBRARY: the GPU stages cannot run"
  printf '%s\n' "${summary[@]}"; exit 1
fi

if has sass; then
  # wgmma s8 shows as IGMMA in SASS; the register report of the W4A8 kernels.
  cuobjdump --dump-sass "$JAX_MOEQ_CUDA_LIBRARY" >"$OUT/sass.txt" 2>&1
  summary+=("sass: $(grep -c 'IGMMA' "$OUT/sass.txt") IGMMA, $(grep -c 'HGMMA' "$OUT/sass.txt") HGMMA instructions")
  cuobjdump --dump-resource-usage "$JAX_MOEQ_CUDA_LIBRARY" 2>/dev/null | grep -A1 W4a8 |
    grep -oE "REG:[0-9]+|STACK:[0-9]+|SHARED:[0-9]+|LOCAL:[0-9]+" | sort | uniq -c >"$OUT/resources.txt"
fi

if has test; then
  # (test_detect_platform_and_routing_method_for expects JAX's default backend to be the CPU.)
  timeout -s INT -k 20 "${TEST_TIMEOUT:-330}" "$PY" -m pytest tests/test_w4a8_gpu.py \
    tests/test_oracle.py ${TEST_ARGS:-} -q \
    --deselect tests/test_oracle.py::test_detect_platform_and_routing_method_for -rfEs -p no:cacheprovider --durations=5 \
    >"$OUT/test.log" 2>&1
  echo "rc=$?" >>"$OUT/test.log"
  grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$OUT/test.log" | head -30
  summary+=("tests: $(grep -E 'passed|failed' "$OUT/test.log" | tail -1) ($(tail -1 "$OUT/test.log"), at $(stamp))")
fi

if has memcheck; then
  cat >"$OUT/w4a8_memcheck_case.py" <<'PYEOF'
import jax, jax.numpy as jnp
from jax_moeq.ops import w4a8_gpu
e, h, i = 8, 256, 384
ks = jax.random.split(jax.random.PRNGKey(0), 8)
for g, dt, t, on_input, bias in ((128, jnp.bfloat16, 5, False, False), (32, jnp.float32, 130, True, True),
                                 (-1, jnp.float16, 3, False, True), (64, jnp.bfloat16, 1, False, False)):
  gs = h if g == -1 else g
  q13 = jax.random.randint(ks[0], (e, 2 * i, h), -8, 8).astype(jnp.int8)
  q2 = jax.random.randint(ks[1], (e, h, i), -8, 8).astype(jnp.int8)
  sdt = jnp.float32 if g == -1 else jnp.bfloat16
  s13 = jnp.full((e, 2 * i, h // gs), 0.01, sdt)
  s2 = jnp.full((e, h, i // (i if g == -1 else g)), 0.01, sdt)
  b13 = jnp.full((e, 2 * i), 0.1) if bias else None
  b2 = jnp.full((e, h), 0.1) if bias else None
  w = w4a8_gpu.convert_to_w4a8_gpu_format(q13, q2, s13, s2, g, b13, b2)
  x = jax.random.normal(ks[2], (t, h)).astype(dt)
  ids = jax.random.randint(ks[3], (t, 2), 0, e).at[0, 1].set(99)
  y = w4a8_gpu.w4a8_gpu_moe(x, w, jnp.full((t, 2), 0.5), ids, apply_router_weight_on_input=on_input)
  print("case", g, dt.__name__, t, on_input, bias, bool(jnp.isfinite(y.astype(jnp.float32)).all()))
q, s, z = w4a8_gpu.quantize_rows_gpu(jax.random.normal(ks[4], (7, 300)))
print("quantizer", int(q.astype(jnp.int32).sum()))
PYEOF
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 compute-sanitizer --tool memcheck \
    --error-exitcode 9 "$PY" "$OUT/w4a8_memcheck_case.py" >"$OUT/memcheck.log" 2>&1
  rc=$?
  grep -E "^case|^quantizer|ERROR SUMMARY" "$OUT/memcheck.log" | tail -8
  summary+=("memcheck: rc=$rc, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) (at $(stamp))")
fi

if has bench; then
  timeout -s INT -k 20 "${BENCH_TIMEOUT:-240}" "$PY" benchmarks/w4a8_gpu_bench.py \
    --json "$OUT/bench.json" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  rc=$?
  tail -22 "$OUT/bench.log"
  summary+=("bench: rc=$rc (at $(stamp))")
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
