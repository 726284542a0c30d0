#!/usr/bin/env bash
# Compiles the CPU kernels (portable and NEON paths) and their FFI handler for
# AArch64 with a cross compiler (Debian: g++-aarch64-linux-gnu), with the flags
# CMakeLists.txt gives them. Exit 0 when all build.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX_AARCH64:-aarch64-linux-gnu-g++}
PY=${PYTHON:-python3}
INC=$("$PY" -c 'import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), "include"))')
out=$(mktemp -d)
# Per-file -march, as in CMakeLists.txt: each NEON path only for its own ISA level.
march_for() {
  case "$1" in
    */w4a8_gemm_neon_dotprod.cc) echo "-march=armv8.2-a+dotprod" ;;
    */w4a8_gemm_neon_i8mm.cc) echo "-march=armv8.2-a+dotprod+i8mm" ;;
  esac
}
for src in csrc/cpu/w4a8_moe.cc csrc/cpu/w4a8_linear.cc csrc/cpu/cpu_isa.cc csrc/cpu/w4a8_gemm_portable.cc \
           csrc/cpu/w4a8_rows_portable.cc csrc/cpu/w4a8_gemm_neon_dotprod.cc \
           csrc/cpu/w4a8_gemm_neon_i8mm.cc xla_ffi/cpu_w4a8_moe.cc xla_ffi/cpu_w4a8_linear.cc; do
  # shellcheck disable=SC2046  # the -march flag, or nothing
  "$CXX" -std=c++17 -O2 -ffp-contract=off -fPIC -DJAX_MOEQ_AARCH64=1 $(march_for "$src") \
    -Icsrc -I. -I"$INC" -c "$src" -o "$out/$(basename "$src").o"
done
echo "aarch64 build ok: $(ls "$out" | wc -l) objects"
