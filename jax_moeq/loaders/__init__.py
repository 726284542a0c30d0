"""Checkpoint readers and writers: safetensors + `config.json` (compressed-tensors, GPTQ, MxInt4).

`load_moe_checkpoint(path)` reads every MoE layer into host-side `MoELayerTensors` (stacked w13/w2 in
our orientation); `save_moe_checkpoint(path, layers, fmt=...)` writes them back in a checkpoint
format. `jax_moeq.nn` turns layers into modules and modules into layers.
"""

from jax_moeq.loaders.checkpoint import (
    WRITE_FORMATS, MoECheckpoint, MoELayerTensors, SafetensorsDir, discover_moe_layers,
    layer_tensors, load_moe_checkpoint, load_moe_layer, quant_config_for, save_moe_checkpoint)
from jax_moeq.loaders.config import (
    CheckpointQuantConfig, MoEModelConfig, parse_model_config, parse_quantization_config,
    read_config_json)
from jax_moeq.loaders.int4_format import (
    deinterleave_gate_up, interleave_gate_up, pack_signed_nibbles, pack_uint4b8,
    unpack_signed_nibbles, unpack_uint4b8)
from jax_moeq.loaders.progress import Progress, track_progress
