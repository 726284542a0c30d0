#!/usr/bin/env bash
# A/B of the CPU W4A8 kernel on a many-core host (the GPU machines' Xeon), in one call: builds
# this tree and a copy of it with the files under $AB_OLD laid over it (the same relative paths:
# e.g. csrc/cpu/w4a8_moe.cc as it was), checks the new build's ISA paths bit-exact (AMX against
# VNNI), then runs benchmarks/cpu_moe_bench.py alternately on each build, $AB_ROUNDS rounds
# (separate processes: one library per process), with BENCH_ARGS. Logs to $OUT.
#   AB_OLD=.carry/ab_old AB_ROUNDS=3 BENCH_ARGS="--shapes olmoe --tokens 1,8,128,512 ..."
#   EXTRA: a command run last with the new build on PYTHONPATH (e.g. the kt-kernel peer run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cpu_ab}
AB_OLD=${AB_OLD:-.carry/ab_old}
ROUNDS=${AB_ROUNDS:-3}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
old=/tmp/ab_old_tree
rm -rf "$old" && mkdir -p "$old"
cp -r CMakeLists.txt cmake csrc xla_ffi scripts jax_moeq benchmarks pyproject.toml "$old"/
(cd "$AB_OLD" && find . -type f) | while read -r f; do cp "$AB_OLD/$f" "$old/$f"; done
rm -f "$old"/jax_moeq/_cpu_ffi*.so
start=$(date +%s)
JOBS=$(nproc) JAX_MOEQ_CUDA=OFF bash scripts/dev_build.sh >"$OUT/build_new.log" 2>&1 &
(cd "$old" && JOBS=$(nproc) JAX_MOEQ_CUDA=OFF bash scripts/dev_build.sh >"$OUT/build_old.log" 2>&1) &
wait
echo "builds: $(( $(date +%s) - start )) s"
ls "$old"/jax_moeq/_cpu_ffi*.so jax_moeq/_cpu_ffi*.so || { tail -20 "$OUT"/build_*.log; exit 1; }
PYTHONPATH=$PWD timeout 120 "$PY" -m pytest tests/test_portability.py -k x86 -q -p no:cacheprovider \
  2>&1 | tail -2
ARGS=${BENCH_ARGS:---shapes olmoe --tokens 1,8,128,512 --baselines= --target-seconds 0.5}
for r in $(seq 1 "$ROUNDS"); do
  for v in old new; do
    tree=$PWD; [ "$v" = old ] && tree=$old
    # shellcheck disable=SC2086
    PYTHONPATH=$tree "$PY" benchmarks/cpu_moe_bench.py $ARGS >"$OUT/${v}_$r.md" 2>"$OUT/${v}_$r.err"
    echo "$v round $r: $(grep -E '^\| [0-9]+ \|' "$OUT/${v}_$r.md" | awk -F'|' '{printf "T=%s %s ms;", $2, $4}')"
  done
done
if [ -n "${EXTRA:-}" ]; then PYTHONPATH=$PWD bash -c "$EXTRA"; fi
