"""jax_moeq: int4 Mixture-of-Experts kernels for JAX (CPU W4A8, Hopper WNA16 / MxInt4)."""

__version__ = "0.1.0"

# CPU W4A8 op and packer.
from jax_moeq.ops.w4a8_cpu import convert_to_w4a8_int8_moe_format, dynamic_4bit_int_moe

# Quantization, routing, jnp reference.
from jax_moeq.quant.int4 import dequantize_int4, quantize_int4
from jax_moeq.routing import RoutingMethodType, select_experts
from jax_moeq import reference

# Weight containers, fused_moe, the dispatch, the oracles and their experts classes.
from jax_moeq.fused_moe import fused_moe
from jax_moeq.weights import (
    FloatMoEWeights, Int4MoEWeights, W4A8PackedWeights, fold_w2_act_order, pack_w4a8,
    quantize_moe_weights, unpack_w4a8,
)
from jax_moeq.dispatch import ExpertsChoice, LayerSpec, choose_experts
from jax_moeq.oracle.base import MoEActivation, MoEConfig, MoEParallelConfig, RoutingOptions
from jax_moeq.oracle.unquantized import UnquantizedMoeBackend, select_unquantized_moe_backend
from jax_moeq.experts.unquantized import ReferenceExpertsFloat, XlaFloatExperts
from jax_moeq.oracle.w4a8_int8 import (
    W4A8Int8MoeBackend, make_w4a8_int8_moe_quant_config, map_w4a8_int8_backend,
    select_w4a8_int8_moe_backend,
)
from jax_moeq.experts.cpu_int4 import CPUExpertsInt4
from jax_moeq.experts.reference import ReferenceExpertsW4A8
from jax_moeq import dispatch, experts, oracle

# GPU ops: their modules touch nothing CUDA at import time.
# GPU WNA16 (Marlin-class): the op loads the CUDA library on first call only.
from jax_moeq.ops.wna16_gpu import (
    Wna16MoeWeights, batched_fused_marlin_moe, convert_to_wna16_moe_kernel_format,
    fused_marlin_moe,
)
from jax_moeq.oracle.wna16 import WNA16MoeBackend, select_wna16_moe_backend
from jax_moeq.experts.marlin import BatchedMarlinExperts, MarlinExperts, ReferenceExpertsWNA16
# GPU MxInt4 (routing inside the kernel): the op loads the CUDA library on first call only.
from jax_moeq.ops.mxint4_gpu import (
    is_mxint4_moe_available, mxint4_moe, prepare_static_weights_for_mxint4_moe,
)
from jax_moeq.oracle.mxint4 import MxInt4MoeBackend, select_mxint4_moe_backend
from jax_moeq.experts.mxint4 import HopperMxInt4Experts, ReferenceExpertsMxInt4

# Dense int4 linears: canonical weights, the linear oracle, the Flax layer.
from jax_moeq.linears import Int4LinearWeights, concat_linears, quantize_linear
from jax_moeq.oracle.linear import LinearConfig, select_linear_backend

# Flax blocks, checkpoint loaders/writers, sharding. safetensors is imported lazily.
from jax_moeq import linears, loaders, nn, sharding
from jax_moeq.nn import QuantizedLinear
