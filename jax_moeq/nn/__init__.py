"""Flax MoE blocks: `MoE` (float) and the drop-in `QuantizedMoE` (NNX); the int4 dense layer
`QuantizedLinear`; linen wrappers in `jax_moeq.nn.linen`; checkpoint bridges
`moe_from_checkpoint_layer` / `layer_from_module`."""

from jax_moeq.nn.moe import MoE, MoESpec, QuantizedMoE, QuantizedWeight
from jax_moeq.nn.linear import QuantizedLinear
from jax_moeq.nn.convert import layer_from_module, moe_from_checkpoint_layer
