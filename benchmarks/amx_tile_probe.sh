#!/usr/bin/env bash
# Builds benchmarks/amx_tile_probe.cc and runs it (an AMX host): the tile unit's rate under each
# load pattern, at one thread and THREADS (default 16). Output on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-g++}
BIN=${BIN:-/tmp/amx_tile_probe}
$CXX -O3 -std=c++17 -march=x86-64-v2 -mavx512f -mavx512bw -mavx512dq -mamx-tile -mamx-int8 \
  -Icsrc -DJAX_MOEQ_X86 -pthread -o "$BIN" benchmarks/amx_tile_probe.cc csrc/cpu/cpu_isa.cc
lscpu | grep -E "Model name|^CPU\(s\)|L2|L3"
"$BIN" "${THREADS:-16}"
