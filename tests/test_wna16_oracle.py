"""WNA16 oracle selection (CPU: no GPU backend fits; explicit GPU backends raise with reasons)."""

import logging

import pytest

from jax_moeq.oracle import base, wna16
from jax_moeq.experts import marlin


def _config(**kw):
  args = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, platform="cpu")
  args.update(kw)
  return base.MoEConfig(**args)


def test_priority_on_cuda_and_cpu():
  assert wna16._get_priority_backends(_config(platform="cuda")) == [
      wna16.WNA16MoeBackend.MARLIN, wna16.WNA16MoeBackend.BATCHED_MARLIN,
      wna16.WNA16MoeBackend.REFERENCE]
  assert wna16._get_priority_backends(_config()) == [wna16.WNA16MoeBackend.REFERENCE]


def test_cpu_picks_reference_with_warning(caplog):
  with caplog.at_level(logging.WARNING, logger="jax_moeq.oracle"):
    backend, cls = wna16.select_wna16_moe_backend(_config(hidden_size=512),
                                                  base.wna16_weight_key(64), 4)
  assert backend == wna16.WNA16MoeBackend.REFERENCE
  assert cls is marlin.ReferenceExpertsWNA16


def test_explicit_marlin_on_cpu_raises_with_reason():
  with pytest.raises(ValueError, match="MARLIN does not support .* platform 'cpu'"):
    wna16.select_wna16_moe_backend(_config(moe_backend="marlin"), base.wna16_weight_key(128), 4)


def test_marlin_rejections():
  key = base.wna16_weight_key(128)
  ok, why = marlin.MarlinExperts.is_supported_config(
      _config(platform="cuda", in_dtype="float32"), key, None)
  assert not ok and "bfloat16/float16" in why
  ok, why = marlin.MarlinExperts.is_supported_config(
      _config(platform="cuda", hidden_size=96), base.wna16_weight_key(32), None)
  assert not ok and "multiples of 64" in why
  ok, why = marlin.MarlinExperts.is_supported_config(
      _config(platform="cuda"), base.kInt4W4A8StaticGroup128Sym, None)
  assert not ok and "quantization scheme" in why
  ok, why = marlin.BatchedMarlinExperts.is_supported_config(_config(platform="cuda"), key, None)
  assert not ok and "BatchedExperts" in why


def test_weight_bits_and_unknown_backend():
  with pytest.raises(ValueError, match="weight_bits=8"):
    wna16.select_wna16_moe_backend(_config(), base.wna16_weight_key(128), 8)
  with pytest.raises(ValueError, match="not supported for WNA16"):
    wna16.map_wna16_backend("triton")
  assert wna16.map_wna16_backend("BATCHED_MARLIN") == wna16.WNA16MoeBackend.BATCHED_MARLIN
