"""Qwen3-MoE (`model_type: qwen3_moe`, the Qwen3-30B-A3B family).

Per layer: RMSNorm -> GQA attention with an RMSNorm over head_dim on every q and k head before
RoPE -> residual; RMSNorm -> MoE (`mlp.gate` router, softmax over all experts, top-k, divided by
the top-k sum when `norm_topk_prob`) or, for layers in `mlp_only_layers` or off the
`decoder_sparse_step` grid, a dense SiLU MLP of `intermediate_size` -> residual.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax_moeq.models import config as config_lib

MODEL_TYPE = "qwen3_moe"


def config_from_json(cfg: Mapping[str, Any], generation: Mapping[str, Any] | None = None
                     ) -> config_lib.DecoderConfig:
  config_lib.check_activation(cfg)
  common = config_lib.common_fields(cfg, generation)
  num_layers = common["num_layers"]
  num_experts = config_lib.read_key(cfg, ("num_experts", "num_local_experts"), kind=int)
  step = config_lib.read_key(cfg, ("decoder_sparse_step",), 1, kind=int)
  if step < 1:
    raise config_lib.ConfigError(f"config.json: decoder_sparse_step={step} must be >= 1")
  dense_only = config_lib.read_key(cfg, ("mlp_only_layers",), [], kind=list)
  if not all(isinstance(i, int) for i in dense_only):
    raise config_lib.ConfigError(f"config.json: mlp_only_layers={dense_only!r} must list "
                                 "layer indices")
  sparse = tuple(i not in dense_only and num_experts > 0 and (i + 1) % step == 0
                 for i in range(num_layers))
  window = None
  if config_lib.read_key(cfg, ("use_sliding_window",), False, kind=bool):
    window = config_lib.read_key(cfg, ("sliding_window",), None, kind=int)
  return config_lib.DecoderConfig(
      model_type=MODEL_TYPE,
      num_experts=num_experts,
      top_k=config_lib.read_key(cfg, ("num_experts_per_tok",), kind=int),
      moe_intermediate_size=config_lib.read_key(cfg, ("moe_intermediate_size",), kind=int),
      intermediate_size=config_lib.read_key(cfg, ("intermediate_size",), None, kind=int),
      norm_topk_prob=bool(config_lib.read_key(cfg, ("norm_topk_prob",), False, kind=bool)),
      sparse_layers=sparse,
      qk_norm="per_head",
      sliding_window=window,
      **common)
