"""The kernels as JAX ops (XLA FFI custom calls) and their weight packers."""

from jax_moeq.ops.w4a8_linear_cpu import (pack_w4a8_linear, unpack_w4a8_linear, w4a8_linear,
                                          w4a8_linear_packed_bytes)
from jax_moeq.ops.wna16_linear_gpu import (Wna16LinearWeights, pack_wna16_linear, wna16_linear,
                                           wna16_linear_gpu_available)
