#!/usr/bin/env bash
# Builds the native libraries in build/dev and drops them into jax_moeq/ so
# that `PYTHONPATH=. pytest` runs without reinstalling. JAX_MOEQ_CUDA=OFF skips CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v "$PY")" \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DJAX_MOEQ_CUDA="${JAX_MOEQ_CUDA:-OFF}" >/dev/null
cmake --build build/dev -j "${JOBS:-2}" "$@"
# Copy, then rename over the old file: a process that has the old library loaded keeps its
# mapping (cp -f rewrites the same inode under it, which crashed running tests).
replace() {
  cp -f "$1" "$2.tmp.$$" && mv -f "$2.tmp.$$" "$2"
}
for lib in build/dev/_cpu_ffi*.so; do replace "$lib" "jax_moeq/$(basename "$lib")"; done
if [ -f build/dev/libjax_moeq_cuda.so ]; then
  mkdir -p jax_moeq/lib && replace build/dev/libjax_moeq_cuda.so jax_moeq/lib/libjax_moeq_cuda.so
fi
