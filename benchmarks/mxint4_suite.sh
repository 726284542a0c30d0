#!/usr/bin/env bash
# One run on a GPU machine for MxInt4: build the CUDA library (plain nvcc, all cores), run
# the MxInt4 tests, a compute-sanitizer memcheck of a small case, and the benchmark.
#   STAGES="build test memcheck bench" (default all); TEST_ARGS, BENCH_ARGS pass through.
# Logs go to $OUT (or /tmp/mxint4_suite).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mxint4_suite}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test memcheck bench"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has build; then
  start=$(date +%s)
  inc=$("$PY" -c 'import jax; print(jax.ffi.include_dir())')
  obj=build/mxint4_suite && mkdir -p "$obj" jax_moeq/lib
  flags=(-gencode=arch=compute_90a,code=sm_90a -O3 --expt-relaxed-constexpr -std=c++17
         -Xcompiler -fPIC -Icsrc -I.)
  pids=()
  for f in csrc/cuda/*.cu; do
    nvcc "${flags[@]}" -c "$f" -o "$obj/$(basename "$f").o" >"$obj/$(basename "$f").log" 2>&1 &
    pids+=($!)
  done
  for f in xla_ffi/cuda_*.cc; do
    nvcc -std=c++17 -O2 -Xcompiler -fPIC -I"$inc" -Icsrc -I. -c "$f" \
      -o "$obj/$(basename "$f").o" >"$obj/$(basename "$f").log" 2>&1 &
    pids+=($!)
  done
  ok=1
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  if [ $ok = 1 ] && nvcc -shared -cudart static -o jax_moeq/lib/libjax_moeq_cuda.so "$obj"/*.o \
       >"$obj/link.log" 2>&1; then
    summary+=("build: ok ($(( $(date +%s) - start )) s)")
  else
    cat "$obj"/*.log | grep -iE "error" | head -30
    echo "build: FAILED"; exit 1
  fi
fi
# The tree's jax_moeq when it holds a built CUDA library (the build stage, scripts/dev_build.sh),
# otherwise the installed package (an unbuilt tree first on PYTHONPATH would shadow it).
[ -f jax_moeq/lib/libjax_moeq_cuda.so ] && export PYTHONPATH=$PWD

if has test; then
  "$PY" -m pytest tests/test_mxint4_gpu.py ${TEST_ARGS:-} -q -rs -p no:cacheprovider \
    2>&1 | tee "$OUT/test.log" | tail -40
  summary+=("tests: $(tail -1 "$OUT/test.log")")
fi

if has memcheck; then
  cat >/tmp/mxint4_memcheck_case.py <<'PYEOF'
import jax, jax.numpy as jnp
from jax_moeq.ops import mxint4_gpu
from jax_moeq.routing import RoutingMethodType as RM
e, h, i, t, k = 16, 128, 64, 5, 4
kq = jax.random.split(jax.random.PRNGKey(0), 6)
def weights(hidden):
  """The kernel's weight arrays of random int4 experts of this hidden size."""
  nib = lambda key, shape: mxint4_gpu.int8_to_signed_nibbles(
      jax.random.randint(key, shape, -8, 8).astype(jnp.int8))
  p = mxint4_gpu.prepare_static_weights_for_mxint4_moe(
      nib(kq[0], (e, 2 * i, hidden)), jnp.full((e, 2 * i, hidden // 32), 0.01, jnp.bfloat16),
      nib(kq[1], (e, hidden, i)), jnp.full((e, hidden, i // 32), 0.01, jnp.bfloat16))
  return [p[n] for n in mxint4_gpu.WEIGHT_KEYS]
w = weights(h)
x = jax.random.normal(kq[2], (t, h)).astype(jnp.bfloat16)
logits = jax.random.normal(kq[3], (t, e))
bias = jax.random.normal(kq[4], (e,)) * 0.1
for method, kw, local, rank in ((RM.Renormalize, {}, e, 0), (RM.DeepSeekV3, dict(
    num_expert_group=4, topk_group=2, e_score_correction_bias=bias), e, 0),
    (RM.Default, {}, e // 2, 1)):
  y = mxint4_gpu.mxint4_moe(x, logits, *[a[rank * local:(rank + 1) * local] for a in w],
                            num_experts=e, top_k=k, intermediate_size=i, local_num_experts=local,
                            ep_rank=rank, routing_method=method, **kw)
  print("case", method.name, bool(jnp.isfinite(y.astype(jnp.float32)).all()))
y = mxint4_gpu.mxint4_moe(x, logits, *w, num_experts=e, top_k=k, intermediate_size=i,
                          local_num_experts=e, routing_method=RM.Renormalize, block_m=128)
print("case wgmma", bool(jnp.isfinite(y.astype(jnp.float32)).all()))
# One token (the decode path without alignment; GEMM2 finalizes), whole layer, EP rank 1 of 4,
# and DeepSeekV3's grouped routing.
for method, kw, local, rank in ((RM.Renormalize, {}, e, 0), (RM.Renormalize, {}, e // 4, 1), (
    RM.DeepSeekV3, dict(num_expert_group=4, topk_group=2, e_score_correction_bias=bias), e, 0)):
  y = mxint4_gpu.mxint4_moe(x[:1], logits[:1], *[a[rank * local:(rank + 1) * local] for a in w],
                            num_experts=e, top_k=k, intermediate_size=i, local_num_experts=local,
                            ep_rank=rank, routing_method=method, **kw)
  print("case one token", method.name, local, rank,
        bool(jnp.isfinite(y.astype(jnp.float32)).all()))
# One token with GEMM1 split (H = 2048: 8 ways; ws13's memset and GEMM1's fused activation).
hs = 2048
wsplit = weights(hs)
xs = jax.random.normal(kq[2], (1, hs)).astype(jnp.bfloat16)
for local, rank in ((e, 0), (e // 4, 1)):
  y = mxint4_gpu.mxint4_moe(xs, logits[:1], *[a[rank * local:(rank + 1) * local] for a in wsplit],
                            num_experts=e, top_k=k, intermediate_size=i, local_num_experts=local,
                            ep_rank=rank, routing_method=RM.Renormalize)
  print("case one token, GEMM1 split", local, rank, bool(jnp.isfinite(y.astype(jnp.float32)).all()))
PYEOF
  # Platform allocator: each buffer its own cudaMalloc, so overruns are visible.
  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$PY" /tmp/mxint4_memcheck_case.py >"$OUT/memcheck.log" 2>&1
  rc=$?
  tail -6 "$OUT/memcheck.log"
  summary+=("memcheck: rc=$rc, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
fi

if has bench; then
  "$PY" benchmarks/mxint4_bench.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log" | tail -25
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
