"""OLMoE (`model_type: olmoe`, OLMoE-1B-7B).

Per layer: RMSNorm -> attention whose q and k projections are RMSNorm-ed as a whole (over
num_heads * head_dim, before the heads are split), then clipped to +-`clip_qkv` when set (v too),
then RoPE -> residual; RMSNorm -> MoE (`mlp.gate`, softmax, top-k, renormalized only when
`norm_topk_prob`, false in the released models) -> residual.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax_moeq.models import config as config_lib

MODEL_TYPE = "olmoe"


def config_from_json(cfg: Mapping[str, Any], generation: Mapping[str, Any] | None = None
                     ) -> config_lib.DecoderConfig:
  config_lib.check_activation(cfg)
  common = config_lib.common_fields(cfg, generation)
  clip = config_lib.read_key(cfg, ("clip_qkv",), None, kind=config_lib.NUMBER)
  return config_lib.DecoderConfig(
      model_type=MODEL_TYPE,
      num_experts=config_lib.read_key(cfg, ("num_experts", "num_local_experts"), kind=int),
      top_k=config_lib.read_key(cfg, ("num_experts_per_tok",), kind=int),
      moe_intermediate_size=config_lib.read_key(cfg, ("intermediate_size",), kind=int),
      norm_topk_prob=bool(config_lib.read_key(cfg, ("norm_topk_prob",), False, kind=bool)),
      sparse_layers=(True,) * common["num_layers"],
      qk_norm="whole",
      clip_qkv=None if clip is None else float(clip),
      **common)
