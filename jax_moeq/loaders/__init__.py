"""Checkpoint readers and writers: safetensors + `config.json` (compressed-tensors, GPTQ, MxInt4).

`SafetensorsDir(path)` reads tensors by name from validated safetensors files (sharded or not);
`read_linear` reads one dense linear layer as float (dequantizing int4 exactly);
`discover_moe_layers` + `load_moe_layer` read MoE experts layer by layer into host-side
`MoELayerTensors` (stacked w13/w2 in our orientation); `load_moe_checkpoint(path)` reads them all;
`save_moe_checkpoint(path, layers, fmt=...)` writes them back in a checkpoint format.
`jax_moeq.nn` turns layers into modules and modules into layers.
"""

from jax_moeq.loaders.checkpoint import (
    FUSED_LAYOUTS, STORAGES, WRITE_FORMATS, ExpertsLayout, MoECheckpoint, MoELayerTensors,
    discover_moe_layers, find_moe_layout, float_linear_modules, layer_tensors,
    load_moe_checkpoint, load_moe_layer, quant_config_for, save_moe_checkpoint)
from jax_moeq.loaders.config import (
    CheckpointQuantConfig, ConfigError, MissingFieldError, MoEModelConfig, match_module_name,
    parse_model_config, parse_quantization_config, read_config_json)
from jax_moeq.loaders.int4_format import (
    deinterleave_gate_up, interleave_gate_up, pack_signed_nibbles, pack_uint4b8,
    unpack_signed_nibbles, unpack_uint4b8)
from jax_moeq.loaders.progress import Progress, track_progress
from jax_moeq.loaders.quantized import (
    Int4Projection, dequantize_int4, read_linear, read_projection, storage_format)
from jax_moeq.loaders.safetensors_io import (
    INDEX_FILE, CheckpointFormatError, SafetensorsDir, TensorInfo, TensorNotFoundError,
    read_header, read_index)
