"""Hugging Face MoE language models on jax_moeq's MoE blocks: load, run under `jit`, generate.

    from jax_moeq import models
    model = models.from_pretrained("path/to/Qwen3-30B-A3B", quantization="w4a8_int8")
    logits = model(input_ids)                       # [B, S] int32 -> [B, S, vocab] float32
    out = models.generate(model, input_ids, max_new_tokens=32)
    # Every linear int4 too (attention, dense MLPs; LM head), attention in bf16:
    model = models.from_pretrained(path, quantization="w4a8_int8", quantize_linears=True,
                                   lm_head_quantization="int4")

Architectures (`config.json` `model_type`): qwen3_moe, mixtral, olmoe; one module each
(`qwen3_moe.py`, ...) turns its config into a `DecoderConfig` for the shared decoder
(`decoder.py`); `loading.ARCHITECTURES` maps the model type to it.
"""

from jax_moeq.models.config import ConfigError, DecoderConfig
from jax_moeq.models.decoder import KVCache, MoECausalLM
from jax_moeq.models.generation import GenerateOutput, generate, sample_tokens
from jax_moeq.models.loading import (
    ARCHITECTURES, LM_HEAD_QUANTIZATIONS, QUANTIZATIONS, decoder_config, from_config,
    from_pretrained, linear_group_size)

__all__ = ["ARCHITECTURES", "ConfigError", "DecoderConfig", "GenerateOutput", "KVCache",
           "LM_HEAD_QUANTIZATIONS", "MoECausalLM", "QUANTIZATIONS", "decoder_config",
           "from_config", "from_pretrained", "generate", "linear_group_size", "sample_tokens"]
