// The version of the contract between jax_moeq's Python and its native FFI targets: target
// names, buffer order, shapes and dtypes, attribute names and types, workspace sizes. Bump it,
// and FFI_ABI_VERSION in jax_moeq/_ffi.py with it, whenever any of these changes. A library of
// another version is refused when loaded: a stale build handed the new buffers would misread
// them (an old libjax_moeq_cuda.so under new Python crashed on the H100, 2026-11-23).
#pragma once

#define JAX_MOEQ_FFI_ABI_VERSION 3
