"""Launch-shape heuristics of the GPU int4 MoE core and the scratch the ops ask XLA for (pure
Python and lowering; run everywhere)."""

import re

import pytest

import jax
import jax.numpy as jnp

from jax_moeq.ops import _gpu_launch as launch

WAVE = launch.DEFAULT_NUM_SMS * 2  # CTAs of block_m <= 32 per wave on an H100


@pytest.fixture(autouse=True)
def _h100(monkeypatch):
  monkeypatch.setattr(launch, "num_sms", lambda: launch.DEFAULT_NUM_SMS)


def _ctas(busy, units, split):
  return busy * -(-units // launch.WARPS_PER_CTA) * split


def test_block_m_follows_pairs_per_expert_then_takes_the_wgmma_gemm():
  assert [launch.choose_block_m(p) for p in (0.25, 1, 6, 6.5, 12, 24, 24.5, 48, 48.5, 500)] == [
      8, 8, 8, 32, 32, 32, 64, 64, 128, 128]


def test_wgmma_block_never_splits_k():
  assert launch.choose_split(1, 16, 224, launch.WGMMA_BLOCK_M, 0) == 1
  # The 32-token wgmma tile at one token per expert block would split on the mma.sync GEMM.
  assert launch.choose_gemm_splits(2, 4096, 14336, 32, 2, launch.MAINLOOPS["wgmma"]) == (1, 1)


def test_launch_takes_the_chosen_tile_or_the_explicit_one():
  assert launch.choose_launch("wna16", 16.0, None, None) == (32, launch.MAINLOOPS["wgmma"])
  assert launch.choose_launch("wna16", 16.0, 32, None) == (32, launch.MAINLOOPS["registers"])
  assert launch.choose_launch("mxint4", 2.0, None, None) == (8, launch.MAINLOOPS["async_ring"])
  with pytest.raises(ValueError, match="block_m must be one of"):
    launch.choose_launch("wna16", 16.0, 24, None)


def test_ctas_per_sm_follows_registers():
  assert [launch.ctas_per_sm(b) for b in (8, 16, 32, 64)] == [2, 2, 2, 1]


def test_decode_split_fills_one_wave_instead_of_spilling_into_a_second():
  # Mixtral T=1 GEMM2: 2 expert blocks x 16 CTAs, 224 chunks. The old rule picked split 9
  # (288 CTAs, 1.09 waves); the wave model must stay within one wave and use most of it.
  split = launch.choose_split(2, 4096 // 32, 14336 // 64, 8, 0)
  assert 0.75 * WAVE <= _ctas(2, 128, split) <= WAVE, split


def test_split_ties_take_more_ctas_within_one_wave_only():
  # Mixtral T=1 GEMM2: splits 7 (224 CTAs) and 8 (256) cost the same in the model; 8 fills more of
  # the wave and measured faster (H100: 80.0 vs 82.1 us per layer). GEMM1 (64 chunks): split 1
  # (224 CTAs) ties with split 2 (448 CTAs, two waves), which must not be taken.
  assert launch.choose_split(2, 4096 // 32, 14336 // 64, 8, 0) == 8
  assert launch.choose_split(2, 14336 // 16, 4096 // 64, 8, 1 << 20) == 1


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
  assert launch.mainloop_code("wgmma", 64) == 3
  assert launch.uses_wgmma(64, 3) and launch.uses_wgmma(128, 0) and not launch.uses_wgmma(64, 0)
  assert launch.mainloop_code("wgmma_ws", 32) == 4
  # A wgmma main loop asked for without a block_m takes at least its smallest tile.
  assert launch.choose_launch("wna16", 1.0, None, "wgmma_ws") == (32, 4)
  assert launch.choose_launch("mxint4", 100.0, None, "wgmma_ws") == (128, 4)
  assert launch.uses_wgmma(32, 4) and launch.uses_wgmma(128, 4)
  with pytest.raises(ValueError, match="wgmma main loop takes block_m"):
    launch.mainloop_code("wgmma", 16)
  with pytest.raises(ValueError, match="wgmma_ws main loop takes block_m"):
    launch.mainloop_code("wgmma_ws", 8)
  with pytest.raises(ValueError, match="mainloop must be one of"):
    launch.mainloop_code("pipelined")


def test_stream_mainloop_only_on_the_one_token_path():
  """mainloop="stream" (the one-token streaming kernels) is taken only where the one-token path
  runs and the kernels fit the shapes; automatic choices keep their main loop; stream never splits
  K (each CTA sums its K slices)."""
  assert launch.mainloop_code("stream", 8) == launch.STREAM_MAINLOOP == 5
  assert not launch.uses_wgmma(8, launch.STREAM_MAINLOOP)
  assert launch.choose_gemm_splits(1, 2048, 768, 8, 8, launch.STREAM_MAINLOOP) == (1, 1)
  shape = dict(top_k=8, hidden=2048, intermediate=768)
  choose = launch.choose_one_token_mainloop
  assert choose(5, "stream", one_token=True, fused=False, **shape) == 5
  # Automatic: stream on the unfused one-token path where it fits, else the given main loop.
  assert choose(0, None, one_token=True, fused=False, **shape) == 5
  assert choose(1, None, one_token=True, fused=True, **shape) == 1
  assert choose(3, None, one_token=False, fused=False, **shape) == 3
  assert choose(0, None, one_token=True, fused=False, top_k=17, hidden=2048,
                intermediate=768) == 0
  assert choose(0, "registers", one_token=True, fused=False, **shape) == 0  # asked for: kept
  with pytest.raises(ValueError, match="runs only on the one-token path"):
    choose(5, "stream", one_token=False, fused=False, **shape)
  with pytest.raises(ValueError, match="two different one-token paths"):
    choose(5, "stream", one_token=True, fused=True, **shape)
  with pytest.raises(ValueError, match="top_k in"):
    choose(5, "stream", one_token=True, fused=False, top_k=17, hidden=2048, intermediate=768)
  with pytest.raises(ValueError, match="too large"):
    choose(5, "stream", one_token=True, fused=False, top_k=8, hidden=2048, intermediate=14336)
  assert launch.stream_error(2, 4096, 14336) == ""  # Mixtral: 57 KB of activations


def test_default_mainloop_follows_measurements():
  assert launch.default_mainloop("wna16", 8) == "registers"
  assert launch.default_mainloop("mxint4", 16) == "async_ring"
  assert launch.default_mainloop("mxint4", 32) == "registers"
  # block_m 32 / 64 chosen for the pairs per expert is the wgmma GEMM's token tile; an explicit
  # block_m (pairs unknown) keeps the mma.sync loop.
  assert launch.default_mainloop("wna16", 32, 16.0) == "wgmma"
  assert launch.default_mainloop("mxint4", 32, 24.0) == "wgmma"
  assert launch.default_mainloop("wna16", 64, 30.0) == "wgmma"
  assert launch.default_mainloop("wna16", 32) == "registers"
  assert launch.default_mainloop("mxint4", 64) == "registers"


def _custom_calls(fn, *args):
  """(the custom-call lines of fn's lowered module, its whole text); no GPU needed."""
  text = jax.jit(fn).lower(*args).as_text()
  return [l for l in text.splitlines() if "stablehlo.custom_call" in l], text


def _ffi_call_line(fn, *args):
  """The (first) custom call of fn's lowered module."""
  return _custom_calls(fn, *args)[0][0]


def _result_shapes(line):
  """Result tensor shapes ("16x256") of one custom-call line."""
  return re.findall(r"tensor<([0-9x]+)x[a-z0-9]+>", line.split("->")[-1])


def _ffi_result_shapes(fn, *args):
  """Result tensor shapes of the one custom call in fn's lowered module."""
  return _result_shapes(_ffi_call_line(fn, *args))


def _wna16_weights(e, h, i, act_order):
  from jax_moeq.ops import wna16_gpu
  from jax_moeq.quant import int4
  q13 = jnp.ones((e, 2 * i, h), jnp.int8)
  q2 = jnp.ones((e, h, i), jnp.int8)
  g_idx = {}
  if act_order:
    g_idx = dict(w13_g_idx=jnp.tile(jnp.arange(h) // 64, (e, 1)).astype(jnp.int32),
                 w2_g_idx=jnp.tile(jnp.arange(i) // 64, (e, 1)).astype(jnp.int32))
  return wna16_gpu.convert_to_wna16_moe_kernel_format(
      "MARLIN", int4.pack_uint4b8_gptq(q13), int4.pack_uint4b8_gptq(q2),
      jnp.full((e, h // 64, 2 * i), 0.01, jnp.bfloat16),
      jnp.full((e, i // 64, h), 0.01, jnp.bfloat16), group_size=64, **g_idx)


def _mxint4_weights(e, h, i):
  from jax_moeq.ops import mxint4_gpu
  q13 = mxint4_gpu.int8_to_signed_nibbles(jnp.ones((e, 2 * i, h), jnp.int8))
  q2 = mxint4_gpu.int8_to_signed_nibbles(jnp.ones((e, h, i), jnp.int8))
  p = mxint4_gpu.prepare_static_weights_for_mxint4_moe(
      q13, jnp.full((e, 2 * i, h // 32), 0.01, jnp.bfloat16),
      q2, jnp.full((e, h, i // 32), 0.01, jnp.bfloat16))
  return [p[n] for n in mxint4_gpu.WEIGHT_KEYS]


@pytest.mark.parametrize("act_order,block_m,x_perm_len", [
    (False, 128, 64 * 256),       # the wgmma GEMM permutes each token's inputs once: T x H
    (True, 128, 64 * 2 * 256),    # act-order gathers per (token, k) row: T*K x H
    (True, 32, 64 * 2 * 256),
    (False, 32, 1)])              # neither: no scratch
def test_wna16_x_perm_scratch_follows_the_launch(act_order, block_m, x_perm_len):
  """The x_perm scratch the op asks XLA for (checked again by the FFI handler)."""
  from jax_moeq import _ffi
  from jax_moeq.ops import wna16_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  e, h, i, t, k = 8, 256, 128, 64, 2
  w = _wna16_weights(e, h, i, act_order)
  shapes = _ffi_result_shapes(
      lambda x, ids: wna16_gpu.fused_marlin_moe(x, w, jnp.full((t, k), 0.5), ids,
                                                block_m=block_m),
      jnp.ones((t, h), jnp.bfloat16), jnp.zeros((t, k), jnp.int32))
  assert shapes[4] == str(x_perm_len)  # out, sorted_ids, expert_ids, num_post_padded, x_perm


def test_wna16_batched_x_perm_scratch_at_block_m_128():
  from jax_moeq import _ffi
  from jax_moeq.ops import wna16_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  e, h, i, m = 8, 256, 128, 40
  w = _wna16_weights(e, h, i, False)
  shapes = _ffi_result_shapes(
      lambda x, n: wna16_gpu.batched_fused_marlin_moe(x, n, w, block_m=128),
      jnp.ones((e, m, h), jnp.bfloat16), jnp.full((e,), m, jnp.int32))
  assert shapes[4] == str(e * m * h)


@pytest.mark.parametrize("block_m,x_perm_len", [(128, 64 * 128), (32, 1)])
def test_mxint4_x_perm_scratch_follows_the_launch(block_m, x_perm_len):
  from jax_moeq import _ffi
  from jax_moeq.ops import mxint4_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  e, h, i, t, k = 8, 128, 64, 64, 2
  w = _mxint4_weights(e, h, i)
  shapes = _ffi_result_shapes(
      lambda x, logits: mxint4_gpu.mxint4_moe(x, logits, *w, num_experts=e, top_k=k,
                                              intermediate_size=i, local_num_experts=e,
                                              block_m=block_m),
      jnp.ones((t, h), jnp.bfloat16), jnp.zeros((t, e), jnp.float32))
  assert shapes[10] == str(x_perm_len)  # the last result: out ... ws2, x_perm


def test_gemm_splits_and_ws2_scratch_of_a_one_token_call():
  """The launch factors and the ws2 scratch (rows x H accumulators, then H / 32 arrival counters
  for the one-token path) that a WNA16 call asks for, as the FFI handler checks them."""
  from jax_moeq import _ffi
  from jax_moeq.ops import wna16_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  e, h, i, k = 8, 256, 1024, 2
  split13, split2 = launch.choose_gemm_splits(k, h, i, 8, k)
  assert split13 == launch.choose_split(k, i // 16, h // 64, 8, k * 2 * i * 4) == 1
  assert split2 == launch.choose_split(k, h // 32, i // 64, 8, 0) > 1
  w = _wna16_weights(e, h, i, False)
  shapes = _ffi_result_shapes(
      lambda x, ids: wna16_gpu.fused_marlin_moe(x, w, jnp.full((1, k), 0.5), ids),
      jnp.ones((1, h), jnp.bfloat16), jnp.zeros((1, k), jnp.int32))
  assert shapes[7] == str(launch.gemm2_workspace_floats(k, h)) == str(k * h + h // 32)


@pytest.mark.parametrize("t,ws13_len", [
    (1, 8 * 2 * 512 + 8 * (512 // 16)),  # one token, GEMM1 split: accumulators, then counters
    (2, 16 * 2 * 512),                   # two tokens (aligned path), GEMM1 split: accumulators
])
def test_ws13_scratch_of_a_split_gemm1(t, ws13_len):
  """The ws13 scratch a WNA16 and an MxInt4 call ask for when GEMM1 splits K (top-8, H 2048, as
  Qwen3-30B-A3B; 16 experts keep the weights small, the launch only sees the 8 busy ones): on the
  one-token path it also holds one arrival counter per pair and 16 activation columns
  (Gemm1WorkspaceFloats; the FFI handlers check the length)."""
  from jax_moeq import _ffi
  from jax_moeq.ops import mxint4_gpu, wna16_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  e, h, i, k = 16, 2048, 512, 8
  split13, _ = launch.choose_gemm_splits(launch.expected_busy_blocks(t * k, e, 8), h, i, 8, t * k)
  assert split13 > 1
  assert launch.decodes_without_alignment(t, 8) == (t == 1)
  assert launch.gemm1_workspace_floats(t * k, i, split13, t == 1) == ws13_len
  w = _wna16_weights(e, h, i, False)
  call = (lambda x, ids: wna16_gpu.fused_marlin_moe(x, w, jnp.full((t, k), 0.125), ids),
          jnp.ones((t, h), jnp.bfloat16), jnp.zeros((t, k), jnp.int32))
  shapes = _ffi_result_shapes(*call)
  assert shapes[6] == str(ws13_len)  # out, sorted_ids, expert_ids, num_post_padded, x_perm, act
  # The path is Python's decision, passed to the handler (which checks it).
  assert f"one_token = {str(t == 1).lower()}" in _ffi_call_line(*call)
  mw = _mxint4_weights(e, h, i)
  call = (lambda x, logits: mxint4_gpu.mxint4_moe(
      x, logits, *mw, num_experts=e, top_k=k, intermediate_size=i, local_num_experts=e),
          jnp.ones((t, h), jnp.bfloat16), jnp.zeros((t, e), jnp.float32))
  shapes = _ffi_result_shapes(*call)
  assert shapes[8] == str(ws13_len)  # out, ids, weights, local ids, sorted, blocks, padded, act
  assert f"one_token = {str(t == 1).lower()}" in _ffi_call_line(*call)


@pytest.mark.parametrize("with_out_init", [False, True])
def test_vmap_of_token_sets_is_one_call(with_out_init):
  """vmap over B token sets sharing the weights lowers to one custom call on B*T tokens (its
  launch choices follow the folded T: B*T = 16 tokens take the aligned path, T = 1 would not)."""
  from jax_moeq import _ffi
  from jax_moeq.ops import mxint4_gpu, wna16_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  b, t, e, h, i, k = 16, 1, 8, 256, 128, 2
  w = _wna16_weights(e, h, i, False)
  extra = (jnp.zeros((b, t, h), jnp.bfloat16),) if with_out_init else ()

  def wna16(x, ids, *o):
    return wna16_gpu.fused_marlin_moe(x, w, jnp.full((t, k), 0.5), ids,
                                      out_init=o[0] if o else None)

  calls, _ = _custom_calls(jax.vmap(wna16), jnp.ones((b, t, h), jnp.bfloat16),
                           jnp.zeros((b, t, k), jnp.int32), *extra)
  assert len(calls) == 1
  assert _result_shapes(calls[0])[0] == f"{b * t}x{h}"
  assert "one_token = false" in calls[0]
  mw = _mxint4_weights(e, h, i)

  def mxint4(x, logits, *o):
    return mxint4_gpu.mxint4_moe(x, logits, *mw, num_experts=e, top_k=k, intermediate_size=i,
                                 local_num_experts=e, out_init=o[0] if o else None)

  calls, _ = _custom_calls(jax.vmap(mxint4), jnp.ones((b, t, h), jnp.bfloat16),
                           jnp.zeros((b, t, e), jnp.float32), *extra)
  assert len(calls) == 1
  assert _result_shapes(calls[0])[0] == f"{b * t}x{h}"


def test_vmap_with_per_batch_weights_runs_in_sequence():
  """Weights mapped too (a weight set per batch element): one call of T tokens inside a loop."""
  from jax_moeq import _ffi
  from jax_moeq.ops import mxint4_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  b, t, e, h, i, k = 3, 4, 8, 256, 128, 2
  stacked = [jnp.stack([a] * b) for a in _mxint4_weights(e, h, i)]
  calls, text = _custom_calls(
      jax.vmap(lambda x, logits, *w: mxint4_gpu.mxint4_moe(
          x, logits, *w, num_experts=e, top_k=k, intermediate_size=i, local_num_experts=e)),
      jnp.ones((b, t, h), jnp.bfloat16), jnp.zeros((b, t, e), jnp.float32), *stacked)
  assert len(calls) == 1 and "stablehlo.while" in text
  assert _result_shapes(calls[0])[0] == f"{t}x{h}"


def test_vmap_of_the_batched_format_runs_in_sequence():
  from jax_moeq import _ffi
  from jax_moeq.ops import wna16_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  b, e, h, i, m = 3, 8, 256, 128, 4
  w = _wna16_weights(e, h, i, False)
  calls, text = _custom_calls(
      jax.vmap(lambda x, n: wna16_gpu.batched_fused_marlin_moe(x, n, w)),
      jnp.ones((b, e, m, h), jnp.bfloat16), jnp.full((b, e), m, jnp.int32))
  assert len(calls) == 1 and "stablehlo.while" in text
  assert _result_shapes(calls[0])[0] == f"{e}x{m}x{h}"


# The fused decode kernel's shared-memory plan (csrc/cuda/moe_int4_decode.cuh), on an H100's 132
# SMs. Hand-computed bytes for Qwen3-30B-A3B (K 8, H 2048, I 768): GEMM1 384 units -> at most 3
# per CTA (two 16 KB subtiles each); GEMM2 128 subtiles -> 1 per CTA, 8 pairs x 12 chunks.
def test_fused_decode_plan_of_the_small_expert_models():
  qwen3 = (3 * 2 * 32 * 512 + 8 * 12 * 512 + 2048 * 2 + 8 * 768 * 2 + 3 * 32 * 4 + 8 * 16 * 4
           + 4 * 8 + launch.DECODE_STATIC_SHARED_BYTES)
  assert qwen3 == 165_792 <= launch.MAX_SHARED_BYTES_PER_CTA
  assert launch.fused_decode_error(8, 2048, 768, ctas=132) == ""
  # DeepSeek-V2-Lite (K 6, H 2048, I 1408): 4 units per CTA (128 KB), GEMM2 66 KB; 219 KB.
  assert launch.fused_decode_error(6, 2048, 1408, ctas=132) == ""


def test_fused_decode_refuses_what_does_not_fit():
  # Mixtral (K 2, H 4096, I 14336): GEMM2 alone is 2 x 224 chunks per output subtile.
  assert "chunks per warp" in launch.fused_decode_error(2, 4096, 14336, ctas=132)
  assert "hidden <= 4096" in launch.fused_decode_error(8, 8192, 256, ctas=132)
  assert "shared memory" in launch.fused_decode_error(8, 4096, 512, ctas=66)


def test_fused_decode_choice():
  choose = launch.choose_fused_decode
  # Automatic never takes it (measured slower on the H100, docs/performance.md); True does.
  assert not choose(None, one_token=True, top_k=8, hidden=2048, intermediate=768)
  assert choose(True, one_token=True, top_k=8, hidden=2048, intermediate=768)
  assert not choose(False, one_token=True, top_k=8, hidden=2048, intermediate=768)
  assert not choose(None, one_token=False, top_k=8, hidden=2048, intermediate=768)
  assert not choose(None, one_token=True, top_k=2, hidden=4096, intermediate=14336)
  with pytest.raises(ValueError, match="one-token path"):
    choose(True, one_token=False, top_k=8, hidden=2048, intermediate=768)
  with pytest.raises(ValueError, match="chunks per warp"):
    choose(True, one_token=True, top_k=2, hidden=4096, intermediate=14336)


def test_deterministic_mode_takes_no_split_and_no_fused_decode(monkeypatch):
  # Mixtral T=1 splits GEMM2 (8 splits, f32 atomics in arrival order) unless deterministic.
  assert launch.choose_gemm_splits(2, 4096, 14336, 8, 2) != (1, 1)
  monkeypatch.setenv(launch.DETERMINISTIC_ENV, "1")
  assert launch.deterministic()
  assert launch.choose_gemm_splits(2, 4096, 14336, 8, 2) == (1, 1)
  with pytest.raises(ValueError, match="JAX_MOEQ_DETERMINISTIC=1"):
    launch.choose_fused_decode(True, one_token=True, top_k=8, hidden=2048, intermediate=768)
  assert not launch.choose_fused_decode(None, one_token=True, top_k=8, hidden=2048,
                                        intermediate=768)
  monkeypatch.setenv(launch.DETERMINISTIC_ENV, "0")
  assert not launch.deterministic()
  monkeypatch.setenv(launch.DETERMINISTIC_ENV, "yes")
  with pytest.raises(ValueError, match="JAX_MOEQ_DETERMINISTIC='yes'"):
    launch.deterministic()


def test_deterministic_mode_reaches_the_wna16_call(monkeypatch):
  """The split factors a traced WNA16 call passes to the FFI handler."""
  from jax_moeq import _ffi
  from jax_moeq.ops import wna16_gpu
  if not _ffi.cuda_library_available():
    pytest.skip("CUDA library not built (no nvcc at install)")
  e, h, i, k = 8, 256, 1024, 2
  w = _wna16_weights(e, h, i, False)

  def splits():
    text = jax.jit(lambda x, ids: wna16_gpu.fused_marlin_moe(
        x, w, jnp.full((1, k), 0.5), ids)).lower(
            jnp.ones((1, h), jnp.bfloat16), jnp.zeros((1, k), jnp.int32)).as_text()
    return tuple(int(v) for v in re.findall(r"split(?:13|2) = (\d+)", text))

  assert splits()[1] > 1
  monkeypatch.setenv(launch.DETERMINISTIC_ENV, "1")
  assert splits() == (1, 1)


def test_w4a8_token_tile_holds_the_expected_pairs():
  assert launch.choose_w4a8_block_m(0.1) == 32
  assert launch.choose_w4a8_block_m(launch.W4A8_TILE32_MAX_PAIRS) == 32
  assert launch.choose_w4a8_block_m(launch.W4A8_TILE32_MAX_PAIRS + 1) == 64
  assert launch.choose_w4a8_block_m(4096.0) == 64  # the 128-token tile only when asked for
  assert launch.choose_w4a8_block_m(3.0, 128) == 128  # an explicit choice stands
  with pytest.raises(ValueError, match="block_m must be one of"):
    launch.choose_w4a8_block_m(3.0, 8)


def test_max_padded_rows_bounds_the_alignment():
  # Each expert hit may leave block_m - 1 rows of padding; at least one block.
  assert launch.max_padded_rows(1, 8, 32) == 32
  assert launch.max_padded_rows(10, 4, 8) == 40  # 10 + 4 * 7 = 38, rounded up to blocks of 8
  assert launch.max_padded_rows(0, 8, 16) == 16
  assert launch.max_padded_rows(1000, 8, 128) == 2048  # 1000 + 8 * 127 = 2016
