"""Launch-shape heuristics of the GPU int4 MoE core (pure Python; run everywhere)."""

import pytest

from jax_moeq.ops import _gpu_launch as launch

WAVE = launch.DEFAULT_NUM_SMS * 2  # CTAs of block_m <= 32 per wave on an H100


@pytest.fixture(autouse=True)
def _h100(monkeypatch):
  monkeypatch.setattr(launch, "num_sms", lambda: launch.DEFAULT_NUM_SMS)


def _ctas(busy, units, split):
  return busy * -(-units // launch.WARPS_PER_CTA) * split


def test_block_m_follows_pairs_per_expert_then_takes_the_wgmma_gemm():
  assert [launch.choose_block_m(p) for p in (0.25, 1, 8, 8.5, 16, 17, 47.9, 48, 500)] == [
      8, 8, 8, 16, 16, 32, 32, 128, 128]


def test_wgmma_block_never_splits_k():
  assert launch.choose_split(1, 16, 224, launch.WGMMA_BLOCK_M, 0) == 1


def test_ctas_per_sm_follows_registers():
  assert [launch.ctas_per_sm(b) for b in (8, 16, 32, 64)] == [2, 2, 2, 1]


def test_decode_split_fills_one_wave_instead_of_spilling_into_a_second():
  # Mixtral T=1 GEMM2: 2 expert blocks x 16 CTAs, 224 chunks. The old rule picked split 9
  # (288 CTAs, 1.09 waves); the wave model must stay within one wave and use most of it.
  split = launch.choose_split(2, 4096 // 32, 14336 // 64, 8, 0)
  assert 0.75 * WAVE <= _ctas(2, 128, split) <= WAVE, split


def test_no_split_when_the_launch_spans_two_waves_or_the_workspace_is_too_large():
  assert launch.choose_split(256, 14336 // 16, 4096 // 64, 32, 1 << 20) == 1  # prefill
  assert launch.choose_split(1, 16, 4096, 8, launch.MAX_WORKSPACE_BYTES + 1) == 1


@pytest.mark.parametrize("busy,units,chunks,block_m", [
    (1, 16, 12, 8), (2, 896, 64, 8), (8, 48, 32, 8), (6, 64, 22, 8), (3, 128, 224, 16),
    (40, 64, 32, 32), (1, 8, 4, 64), (1, 8, 3, 8)])
def test_split_bounds(busy, units, chunks, block_m):
  split = launch.choose_split(busy, units, chunks, block_m, 0)
  assert 1 <= split <= max(1, chunks // launch.MIN_CHUNKS_PER_SPLIT)
  per_cta = -(-chunks // split)
  assert -(-chunks // per_cta) == split  # every split gets chunks


def test_expected_busy_blocks():
  assert launch.expected_busy_blocks(2, 8, 8) == 2  # Mixtral T=1: one block per expert hit
  assert launch.expected_busy_blocks(8192, 8, 32) == 256  # T=4096: pairs / block_m
  assert launch.expected_busy_blocks(0.5, 64, 8) == 1


def test_mainloop_names():
  assert launch.mainloop_code(None) == launch.MAINLOOPS[launch.DEFAULT_MAINLOOP]
  assert launch.mainloop_code("async_ring") == 1
  assert launch.mainloop_code("bulk_copy") == 2
  with pytest.raises(ValueError, match="mainloop must be one of"):
    launch.mainloop_code("pipelined")


def test_default_mainloop_follows_measurements():
  assert launch.default_mainloop("wna16", 8) == "registers"
  assert launch.default_mainloop("mxint4", 16) == "async_ring"
  assert launch.default_mainloop("mxint4", 32) == "registers"
