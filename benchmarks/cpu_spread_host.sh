#!/usr/bin/env bash
# The spread of CPU MoE timings between processes, on a many-core host: the machine's topology,
# then PROCS fresh processes of benchmarks/cpu_spread_probe.py (per-call times beside where the
# kernel's threads ran), then optionally the chained-harness thread scaling of
# cpu_moe_bench.py. Builds the CPU library for the host's Python first when it is missing.
#   PROCS=6 PROBE_ARGS="--shape olmoe --tokens 512 --threads 16 --calls 40"
#   VARIANTS: space-separated environment settings, each run in turn in every round (e.g.
#   "JAX_MOEQ_CPU_WORKERS= JAX_MOEQ_CPU_WORKERS=15"); TOKENS: a list run in turn (default: the
#   probe's own)
#   SCALING=1 SCALING_ARGS="--shapes olmoe --tokens 1,8,128,512 --thread-scaling 1,2,4,8,16"
#   WHEELS=dir: a directory of wheels (ORT >= 1.32) installed with --no-deps into a scratch
#   target put on PYTHONPATH, for the scaling run's ORT column.
#   LIMIT: seconds for everything (default 560); OUT=/tmp/cpu_spread
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cpu_spread}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-560}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
left() { echo $(( LIMIT - SECONDS )); }
{
  lscpu
  echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
  echo "THP defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null)"
  echo "governor: $(cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null)"
  echo "siblings of cpu0: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>/dev/null)"
  nproc; uptime
} >"$OUT/machine.txt" 2>&1
grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node|L3|THP|governor|siblings" "$OUT/machine.txt"
if ! "$PY" -c "from jax_moeq import _ffi; _ffi.cpu_module()" >/dev/null 2>&1; then
  JOBS=$(nproc) JAX_MOEQ_CUDA=OFF bash scripts/dev_build.sh >"$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; echo "build: FAILED"; exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for p in $(seq 1 "${PROCS:-6}"); do
  for variant in ${VARIANTS:-JAX_MOEQ_CPU_WORKERS=}; do
    for t in ${TOKENS:-default}; do
      [ "$(left)" -gt 40 ] || break 3
      tok=(); [ "$t" = default ] || tok=(--tokens "$t")
      # shellcheck disable=SC2086
      env "$variant" timeout "$(left)" "$PY" benchmarks/cpu_spread_probe.py ${PROBE_ARGS:---shape \
        olmoe --tokens 512 --threads 16 --calls 40} "${tok[@]}" 2>>"$OUT/probe.err" >"$OUT/probe.txt"
      grep "^{" "$OUT/probe.txt" >>"$OUT/probe.jsonl"
      grep "^# " "$OUT/probe.txt" || tail -3 "$OUT/probe.err"
    done
  done
done
if [ "${SCALING:-0}" = 1 ] && [ "$(left)" -gt 90 ]; then
  if [ -n "${WHEELS:-}" ]; then
    . benchmarks/_host_wheels.sh
    use_wheels "$WHEELS" /tmp/spread_site >"$OUT/wheels.log" 2>&1 || echo "wheels: FAILED"
  fi
  # shellcheck disable=SC2086
  timeout "$(left)" "$PY" benchmarks/cpu_moe_bench.py ${SCALING_ARGS:---shapes olmoe \
    --tokens 1,8,128,512 --thread-scaling 1,2,4,8,16 --target-seconds 0.5} \
    >"$OUT/scaling.md" 2>"$OUT/scaling.log"
  echo "scaling: exit $?"; cat "$OUT/scaling.md"
fi
