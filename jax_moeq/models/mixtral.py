"""Mixtral (`model_type: mixtral`).

Per layer: RMSNorm -> GQA attention with RoPE (no q/k norm; a causal sliding window when
`sliding_window` is set) -> residual; RMSNorm -> `block_sparse_moe` (router `gate`, softmax, top-k,
always renormalized over the k; experts `w1` gate, `w3` up, `w2` down) -> residual.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax_moeq.models import config as config_lib

MODEL_TYPE = "mixtral"


def config_from_json(cfg: Mapping[str, Any], generation: Mapping[str, Any] | None = None
                     ) -> config_lib.DecoderConfig:
  config_lib.check_activation(cfg)
  common = config_lib.common_fields(cfg, generation)
  return config_lib.DecoderConfig(
      model_type=MODEL_TYPE,
      num_experts=config_lib.read_key(cfg, ("num_local_experts", "num_experts"), kind=int),
      top_k=config_lib.read_key(cfg, ("num_experts_per_tok",), 2, kind=int),
      # Mixtral's experts are `intermediate_size` wide; it has no dense MLP layers.
      moe_intermediate_size=config_lib.read_key(cfg, ("intermediate_size",), kind=int),
      norm_topk_prob=True,
      sparse_layers=(True,) * common["num_layers"],
      sliding_window=config_lib.read_key(cfg, ("sliding_window",), None, kind=int),
      moe_module="block_sparse_moe",
      expert_names=("w1", "w3", "w2"),
      **common)
