#!/usr/bin/env bash
# Compiles the CPU kernels and their FFI handler for AArch64 (portable path)
# with a cross compiler (Debian: g++-aarch64-linux-gnu). Exit 0 when all build.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX_AARCH64:-aarch64-linux-gnu-g++}
PY=${PYTHON:-python3}
INC=$("$PY" -c 'import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), "include"))')
out=$(mktemp -d)
for src in csrc/cpu/w4a8_moe.cc csrc/cpu/cpu_isa.cc csrc/cpu/w4a8_gemm_portable.cc \
           csrc/cpu/w4a8_rows_portable.cc xla_ffi/cpu_w4a8_moe.cc; do
  "$CXX" -std=c++17 -O2 -ffp-contract=off -fPIC -Icsrc -I. -I"$INC" -c "$src" -o "$out/$(basename "$src").o"
done
echo "aarch64 build ok: $(ls "$out" | wc -l) objects"
