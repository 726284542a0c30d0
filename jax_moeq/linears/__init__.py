"""Dense int4 linear layers (SPEC §12): the canonical `Int4LinearWeights`, round-to-nearest
`quantize_linear`, `concat_linears` (fused q/k/v, gate/up), and the implementation classes the
linear oracle (`jax_moeq.oracle.linear`) chooses between."""

from jax_moeq.linears.kernels import (
    CPUW4A8Linear, LinearKernel, MarlinLinear, ReferenceW4A8Linear, ReferenceWNA16Linear)
from jax_moeq.linears.weights import (
    Int4LinearWeights, concat_linears, dequantize_linear, quantize_linear,
    validate_linear_weights)

__all__ = ["CPUW4A8Linear", "Int4LinearWeights", "LinearKernel", "MarlinLinear",
           "ReferenceW4A8Linear", "ReferenceWNA16Linear", "concat_linears", "dequantize_linear",
           "quantize_linear", "validate_linear_weights"]
