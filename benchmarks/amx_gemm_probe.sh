#!/usr/bin/env bash
# Builds benchmarks/amx_gemm_probe.cc with the CPU GEMMs it times and runs it (an AMX host).
#   THREADS=16 (the second thread count; the first is 1). Output on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-g++}
BIN=${BIN:-/tmp/amx_gemm_probe}
F="-O3 -std=c++17 -march=x86-64-v2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma"
$CXX $F -mamx-tile -mamx-int8 -Icsrc -DJAX_MOEQ_X86 -pthread -o "$BIN" benchmarks/amx_gemm_probe.cc \
  csrc/cpu/w4a8_gemm_amx.cc csrc/cpu/w4a8_gemm_avx512vnni.cc csrc/cpu/w4a8_gemm_avx2.cc \
  csrc/cpu/w4a8_gemm_portable.cc csrc/cpu/cpu_isa.cc
lscpu | grep -E "Model name|^CPU\(s\)|L2|L3"
"$BIN" "${THREADS:-16}"
