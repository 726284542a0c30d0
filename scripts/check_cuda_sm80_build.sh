#!/usr/bin/env bash
# Compiles the CUDA kernels for sm_80, the extra target of a portable build
# (JAX_MOEQ_CUDA_EXTRA_ARCHS=80): sm_90-only instructions must stay behind their guards
# (JAX_MOEQ_BEFORE_SM90, JAX_MOEQ_HAS_WGMMA). Exit 0 when all build.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
pids=()
for src in csrc/cuda/*.cu; do
  "$NVCC" -gencode=arch=compute_80,code=sm_80 -O1 --expt-relaxed-constexpr -std=c++17 -Icsrc -I. \
    -c "$src" -o "$out/$(basename "$src").o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
echo "sm_80 build ok: $(ls "$out" | wc -l) objects"
