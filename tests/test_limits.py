"""Sizes past 32 bits and impossible shapes.

- Python-side refusals: the ops' validation raises ValueError naming the argument for shapes the
  kernels cannot take, checked on abstract shapes (jax.eval_shape of jax.ShapeDtypeStruct), so
  nothing of that size is ever allocated; shapes they can take, however large, trace.
- Handler-side refusals: the CPU FFI target called directly through jax.ffi.ffi_call, bypassing
  the Python checks, with inconsistent attributes and buffers: an InvalidArgument error naming the
  problem, never a crash (scripts/sanitize_cpu_tests.sh runs these under ASan + UBSan).
- A long prefill on the CPU op (T = 65536): the tokens run in chunks, the scratch stays within the
  kernel's budget, and sampled rows match the reference and a separate call on those rows alone.
- GPU ops without a GPU: their workspaces at T = 16384 (the FFI call's result shapes) follow the
  documented formulas and stay linear in T * K.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import _ffi, reference
from jax_moeq.ops import _gpu_launch, mxint4_gpu, w4a8_cpu, wna16_gpu

S = jax.ShapeDtypeStruct
needs_cpu_library = pytest.mark.skipif(not _ffi.cpu_library_available(),
                                       reason="jax_moeq CPU library not built")


# ------------------------------------------------------------------ CPU op, Python side
def _cpu_op_shapes(t, k, e, h, i, g=32, dtype=jnp.float32):
  return (S((t, h), dtype), S((t, k), jnp.int32), S((t, k), jnp.float32),
          S((e, w4a8_cpu.w4a8_packed_bytes(2 * i, h, g)), jnp.uint8),
          S((e, w4a8_cpu.w4a8_packed_bytes(h, i, g)), jnp.uint8))


def _eval_cpu_op(t, k, e, h, i, g=32, **kw):
  return jax.eval_shape(
      lambda *a: w4a8_cpu.dynamic_4bit_int_moe(*a, h, i, 2 * i, g, **kw),
      *_cpu_op_shapes(t, k, e, h, i, g))


@pytest.mark.parametrize("h, i, name", [(1 << 21, 64, "H"), (64, 1 << 21, "I"),
                                        ((1 << 20) + 16, 64, "H")])
def test_cpu_op_refuses_features_past_the_int32_dot_limit(h, i, name):
  with pytest.raises(ValueError, match=rf"^{name}=\d+ must be in \[1, 1048576\]"):
    _eval_cpu_op(4, 2, 8, h, i, g=-1)


def test_cpu_op_refuses_top_k_past_the_int32_slot_limit():
  with pytest.raises(ValueError, match=r"top_k=16777217, more than 16777216"):
    _eval_cpu_op(1, (1 << 24) + 1, 8, 64, 64)


def test_cpu_packer_refuses_inputs_past_the_limit():
  q13 = S((2, 32, 1 << 21), jnp.int8)
  q2 = S((2, 1 << 21, 16), jnp.int8)
  s13 = S((2, 32, 1), jnp.float32)
  s2 = S((2, 1 << 21, 1), jnp.float32)
  with pytest.raises(ValueError, match=r"w13 shape .*: in=2097152 exceeds the kernel's 1048576"):
    jax.eval_shape(lambda *a: w4a8_cpu.convert_to_w4a8_int8_moe_format(*a, -1), q13, q2, s13, s2)


@needs_cpu_library
@pytest.mark.parametrize("t, k", [(1 << 31, 8), (1 << 33, 1), (3, (1 << 24))])
def test_cpu_op_traces_token_and_slot_counts_past_32_bits(t, k):
  """T * K past 2^31 is no limit: the kernel runs chunks of tokens (int32 slots per chunk)."""
  out = _eval_cpu_op(t, k, 8, 64, 64)
  assert out.shape == (t, 64) and out.dtype == jnp.float32


@needs_cpu_library
def test_packed_sizes_are_exact_past_32_bits():
  """Bytes per expert, native (int64) and Python, for GEMMs whose N * K passes 2^32."""
  m = _ffi.cpu_module()
  for n, k, g in [(1 << 16, 1 << 20, -1), (1 << 21, 1 << 20, 32), (2 * 18432, 7168, 128)]:
    want = n * k // 2 + 4 * n * (1 if g == -1 else k // g) + 8 * n
    assert m.w4a8_packed_bytes(n, k, g) == want == w4a8_cpu.w4a8_packed_bytes(n, k, g)
    assert want > 1 << 31 or n * k < 1 << 31


# ------------------------------------------------------------------ CPU handler, bypassed checks
def _raw_call(x, ids, w, w13, w2, *, hidden, inter, group=32, on_input=False, kind=0,
              out_shape=None, out_dtype=None):
  """The CPU FFI target with no Python validation in front of it."""
  _ffi.cpu_module()
  out = S(out_shape or x.shape, out_dtype or x.dtype)
  call = jax.ffi.ffi_call(w4a8_cpu.FFI_TARGET, out)
  return jax.block_until_ready(call(
      x, ids, w, w13, w2, hidden_size=np.int64(hidden), intermediate_size=np.int64(inter),
      group_size=np.int64(group), apply_router_weight_on_input=on_input,
      activation_kind=np.int64(kind)))


def _small_operands(t=3, k=2, e=4, h=32, i=32, g=32, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((t, h)), dtype)
  ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
  w = jnp.full((t, k), 0.5, jnp.float32)
  w13 = jnp.zeros((e, w4a8_cpu.w4a8_packed_bytes(2 * i, h, g)), jnp.uint8)
  w2 = jnp.zeros((e, w4a8_cpu.w4a8_packed_bytes(h, i, g)), jnp.uint8)
  return x, ids, w, w13, w2


def _expect_invalid(match, **kw):
  args = _small_operands(**{k: kw.pop(k) for k in list(kw) if k in ("t", "k", "e", "dtype")})
  replace = kw.pop("replace", {})
  args = tuple(replace.get(n, a) for n, a in zip(("x", "ids", "w", "w13", "w2"), args))
  kw.setdefault("hidden", 32)
  kw.setdefault("inter", 32)
  with pytest.raises(Exception, match=r"INVALID_ARGUMENT.*jax_moeq_w4a8_moe_cpu: .*" + match):
    _raw_call(*args, **kw)


@needs_cpu_library
def test_handler_runs_the_small_operands():
  out = _raw_call(*_small_operands(), hidden=32, inter=32)
  assert out.shape == (3, 32) and bool(jnp.isfinite(out).all())


@needs_cpu_library
@pytest.mark.parametrize("case, kw, match", [
    ("hidden attr", dict(hidden=48), r"x has hidden size 32, attribute says 48"),
    ("inter not /16", dict(inter=40), r"intermediate size 40 is not a multiple of 16"),
    ("inter huge", dict(inter=1 << 62), r"must be at most 1048576"),
    ("hidden huge", dict(hidden=(1 << 62) + 32, replace={}), r"x has hidden size|at most"),
    ("inter negative", dict(inter=-(1 << 40)), r"must be positive"),
    ("inter packs past int64", dict(inter=(1 << 61) + 16), r"must be at most 1048576"),
    ("group", dict(group=48), r"group_size 48 is not one of 32, 64, 128, -1"),
    ("group does not divide", dict(group=64), r"group_size 64 does not divide|bytes per expert"),
    ("activation", dict(kind=7), r"activation_kind 7 is not 0, 1 or 2"),
    ("activation huge", dict(kind=1 << 40), r"activation_kind \d+ is not 0, 1 or 2"),
    ("w13 bytes", dict(replace=dict(w13=jnp.zeros((4, 100), jnp.uint8))),
     r"w13_packed has 100 bytes per expert, expected"),
    ("w2 bytes", dict(replace=dict(w2=jnp.zeros((4, 7), jnp.uint8))),
     r"w2_packed has 7 bytes per expert"),
    ("experts differ", dict(replace=dict(w2=jnp.zeros((5, w4a8_cpu.w4a8_packed_bytes(32, 32, 32)),
                                                      jnp.uint8))),
     r"w13_packed has 4 experts, w2_packed 5"),
    ("x rank", dict(replace=dict(x=jnp.zeros((3, 32, 1), jnp.float32))),
     r"x must be 2-D"),
    ("x dtype", dict(replace=dict(x=jnp.zeros((3, 32), jnp.int32))),
     r"x must be float32, bfloat16 or float16"),
    ("ids rows", dict(replace=dict(ids=jnp.zeros((2, 2), jnp.int32))),
     r"topk_ids must be \[tokens, top_k\]"),
    ("weights shape", dict(replace=dict(w=jnp.zeros((3, 3), jnp.float32))),
     r"topk_weights must have the shape of topk_ids"),
    ("weights 1-D", dict(replace=dict(w13=jnp.zeros((4,), jnp.uint8))),
     r"must be 2-D \[experts, bytes\]"),
    ("out shape", dict(out_shape=(3, 16)), r"output must have the shape of x"),
    ("out dtype", dict(out_dtype=jnp.bfloat16), r"output dtype differs from x"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_handler_refuses_inconsistent_calls(case, kw, match):
  _expect_invalid(match, **kw)


@needs_cpu_library
def test_handler_never_reads_past_the_weights_for_out_of_range_ids():
  """Ids are data: for ids outside [0, E), extreme ones included, the handler either refuses
  the call naming the id (InvalidArgument) or lets those pairs add nothing; it never indexes
  the weights with them (the sanitizer run checks the reads)."""
  x, ids, w, w13, w2 = _small_operands()
  bad = jnp.array([[-1, 1 << 30], [4, 0], [2**31 - 1, -2**31]], jnp.int32)
  try:
    out = _raw_call(x, bad, w, w13, w2, hidden=32, inter=32)
  except Exception as e:  # noqa: BLE001 - XLA's runtime error type varies across versions
    assert re.search(r"INVALID_ARGUMENT.*expert id out of range: topk_ids\[0, 0\] = -1",
                     str(e)), e
    return
  only_valid = _raw_call(x[1:2], bad[1:2, 1:], w[1:2, 1:], w13, w2, hidden=32, inter=32)
  np.testing.assert_array_equal(np.asarray(out[0]), 0)
  np.testing.assert_array_equal(np.asarray(out[2]), 0)
  np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(only_valid[0]))


# ------------------------------------------------------------------ a long prefill on the CPU
@needs_cpu_library
def test_cpu_op_65536_tokens_runs_in_bounded_scratch():
  t, e, k, h, i, g = 65536, 16, 8, 64, 64, 32
  m = _ffi.cpu_module()
  chunk = m.w4a8_moe_chunk_tokens(t, k, h, i, g)
  assert 0 < chunk < t, chunk  # this call runs in chunks
  rng = np.random.default_rng(1)
  q13 = jnp.asarray(rng.integers(-8, 8, (e, 2 * i, h)), jnp.int8)
  q2 = jnp.asarray(rng.integers(-8, 8, (e, h, i)), jnp.int8)
  s13 = jnp.asarray(rng.uniform(0.5, 1.5, (e, 2 * i, h // g)) / (8 * np.sqrt(h)), jnp.bfloat16)
  s2 = jnp.asarray(rng.uniform(0.5, 1.5, (e, h, i // g)) / (8 * np.sqrt(i)), jnp.bfloat16)
  w13, w2 = w4a8_cpu.convert_to_w4a8_int8_moe_format(q13, q2, s13, s2, g)[:2]
  x = rng.standard_normal((t, h)).astype(np.float32)
  ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
  w = rng.uniform(0.05, 1.0, (t, k)).astype(np.float32)
  out = np.asarray(w4a8_cpu.dynamic_4bit_int_moe(x, ids, w, w13, w2, h, i, 2 * i, g))
  assert out.shape == (t, h) and np.isfinite(out).all()
  budget = m.w4a8_moe_scratch_budget_bytes()
  high_water = m.w4a8_moe_scratch_high_water()
  # Per token ~7 KB here: unchunked, the call would hold ~460 MB of scratch.
  assert 0 < high_water <= budget + 8 * (e + 1), (high_water, budget)
  # Sampled rows, the chunk boundaries among them: the jnp reference, and a call on those rows
  # alone (one chunk), bit for bit: chunking is exact.
  rows = np.unique(np.concatenate([
      rng.choice(t, 192, replace=False), [0, chunk - 1, chunk, min(t - 1, 2 * chunk), t - 1]]))
  sample = np.asarray(w4a8_cpu.dynamic_4bit_int_moe(x[rows], ids[rows], w[rows], w13, w2, h, i,
                                                    2 * i, g))
  np.testing.assert_array_equal(out[rows], sample)
  want = np.asarray(jax.jit(reference.fused_moe_w4a8, static_argnums=7)(
      x[rows], ids[rows], w[rows], q13, s13, q2, s2, g))
  err = np.linalg.norm(out[rows] - want) / np.linalg.norm(want)
  assert err <= 1e-4, err


@needs_cpu_library
def test_chunks_are_balanced_and_bounded():
  m = _ffi.cpu_module()
  budget = m.w4a8_moe_scratch_budget_bytes()
  for t, k, h, i, g, on_input in [(65536, 8, 64, 64, 32, False), (10**6, 8, 2048, 768, 128, True),
                                  (5, 2, 64, 64, 32, False), (100000, 1, 16, 16, -1, False)]:
    chunk = m.w4a8_moe_chunk_tokens(t, k, h, i, g, on_input)
    assert 1 <= chunk <= t
    chunks = -(-t // chunk)
    assert chunks * chunk - t < chunk  # no sliver: the chunks are within one token of equal
    if chunks > 1:  # the per-token estimate (w4a8_moe.cc) times the chunk fits the budget
      assert chunk >= 64
  assert m.w4a8_moe_chunk_tokens(0, 8, 64, 64, 32) == 1


# ------------------------------------------------------------------ GPU ops, without a GPU
def _wna16_weights(e, h, i, group=128, dtype=jnp.bfloat16):
  return wna16_gpu.Wna16MoeWeights(
      w13=S((e, 2 * i // 16, h // 64, 32, 4), jnp.uint32),
      w13_scales=S((e, h // group, 2 * i // 16, 16), dtype), w13_zeros=S((1,), dtype),
      w13_bias=S((1,), jnp.float32), w2=S((e, h // 16, i // 64, 32, 4), jnp.uint32),
      w2_scales=S((e, i // group, h // 16, 16), dtype), w2_zeros=S((1,), dtype),
      w2_bias=S((1,), jnp.float32), w13_perm=S((1,), jnp.int32), w2_inv_perm=S((1,), jnp.int32),
      hidden_size=h, intermediate_size=i, group_size13=group, group_size2=group, has_zeros=False,
      has_bias=False, act_order=False)


def _eval_wna16(t, k, e, h, i, **kw):
  weights = _wna16_weights(e, h, i)
  return jax.eval_shape(lambda x, w, ids, wt: wna16_gpu.fused_marlin_moe(x, wt, w, ids, **kw),
                        S((t, h), jnp.bfloat16), S((t, k), jnp.float32), S((t, k), jnp.int32),
                        weights)


def test_wna16_refuses_rows_past_32_bit_indexing():
  # 65536 tokens x 8 x 4096 = 2^31 elements of GEMM2's f32 rows.
  with pytest.raises(ValueError, match=r"T \* K \(topk_ids' tokens x top_k\) = 524288 rows of "
                                       r"max\(H, 2I\) = 4096 elements reach 2\^31"):
    _eval_wna16(65536, 8, 64, 4096, 1024)


def test_wna16_batched_refuses_rows_past_32_bit_indexing():
  weights = _wna16_weights(256, 4096, 1024)
  with pytest.raises(ValueError, match=r"E \* M .* = 524288 rows"):
    jax.eval_shape(lambda x, n, w: wna16_gpu.batched_fused_marlin_moe(x, n, w),
                   S((256, 2048, 4096), jnp.bfloat16), S((256,), jnp.int32), weights)


def test_mxint4_refuses_rows_past_32_bit_indexing():
  e, h, i, t, k = 64, 7168, 2048, 65536, 8
  args = (S((t, h), jnp.bfloat16), S((t, e), jnp.float32),
          S((e, 2 * i // 16, h // 64, 32, 4), jnp.uint32), S((e, h // 32, 2 * i // 16, 16),
                                                            jnp.bfloat16),
          S((e, h // 16, i // 64, 32, 4), jnp.uint32), S((e, i // 32, h // 16, 16), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"T \* K \(x's tokens x top_k\) = 524288 rows"):
    jax.eval_shape(lambda *a: mxint4_gpu.mxint4_moe(
        *a, num_experts=e, top_k=k, intermediate_size=i, local_num_experts=e), *args)


@pytest.fixture
def captured_gpu_calls(monkeypatch):
  """The GPU ops' FFI calls, recorded (target, result shapes, attributes) instead of run: their
  Python side (validation, launch choices, workspace sizes) runs without a GPU."""
  calls = []

  def fake_ffi_call(target, results, **kw):
    def call(*operands, **attrs):
      calls.append((target, list(results), attrs))
      return [jnp.zeros(r.shape, r.dtype) for r in results]
    return call

  monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
  monkeypatch.setattr(_ffi, "cuda_library", lambda: None)
  monkeypatch.setattr(_gpu_launch, "num_sms", lambda: 132)
  return calls


@pytest.mark.parametrize("name, e, k, h, i", [("Qwen3-30B-A3B", 128, 8, 2048, 768),
                                               ("Mixtral-8x7B", 8, 2, 4096, 14336),
                                               ("DeepSeek-V3 (EP shard)", 32, 8, 7168, 2048)])
def test_gpu_workspace_at_16384_tokens_is_linear_in_pairs(captured_gpu_calls, name, e, k, h, i):
  """The scratch results of one T = 16384 call (prefill), WNA16 and MxInt4, against the
  formulas: R = T * K pair rows; sorted_ids <= R + min(R, E) (block_m - 1) rounded up to block_m
  (int32); expert_ids that / block_m; act R * I (x's dtype); ws13 R * 2I f32 only when GEMM1 is
  split (else 1); ws2 R * H + H / 32 f32; x_perm T * H at block_m 128 (R * H with act-order),
  else 1. So at most ~ R * (4 H + 2 I + 8 I) + 2 T H bytes: linear, no term in T^2 or E * T."""
  t = 16384
  rows = t * k
  _eval_wna16(t, k, e, h, i)
  args = (S((t, h), jnp.bfloat16), S((t, e), jnp.float32),
          S((e, 2 * i // 16, h // 64, 32, 4), jnp.uint32), S((e, h // 32, 2 * i // 16, 16),
                                                            jnp.bfloat16),
          S((e, h // 16, i // 64, 32, 4), jnp.uint32), S((e, i // 32, h // 16, 16), jnp.bfloat16))
  jax.eval_shape(lambda *a: mxint4_gpu.mxint4_moe(
      *a, num_experts=e, top_k=k, intermediate_size=i, local_num_experts=e), *args)
  assert [c[0] for c in captured_gpu_calls] == [wna16_gpu.FFI_TARGET, mxint4_gpu.FFI_TARGET]
  for target, results, attrs in captured_gpu_calls:
    block_m, split13 = int(attrs["block_m"]), int(attrs["split13"])
    sizes = {}
    if target == wna16_gpu.FFI_TARGET:
      names = ["out", "sorted_ids", "expert_ids", "num_post_padded", "x_perm", "act", "ws13",
               "ws2"]
    else:
      names = ["out", "topk_ids", "topk_weights", "local_ids", "sorted_ids", "expert_ids",
               "num_post_padded", "act", "ws13", "ws2", "x_perm"]
    for n, r in zip(names, results):
      sizes[n] = (int(np.prod(r.shape)), jnp.dtype(r.dtype).itemsize)
    padded = -(-(rows + min(rows, e) * (block_m - 1)) // block_m) * block_m
    assert sizes["sorted_ids"] == (padded, 4)
    assert sizes["expert_ids"] == (padded // block_m, 4)
    assert sizes["act"] == (rows * i, 2)
    assert sizes["ws13"] == ((rows * 2 * i, 4) if split13 > 1 else (1, 4))
    assert sizes["ws2"] == (rows * h + h // 32, 4)
    assert sizes["x_perm"] == ((t * h, 2) if block_m == 128 else (1, 2))
    scratch = sum(n * b for key, (n, b) in sizes.items()
                  if key not in ("out", "topk_ids", "topk_weights", "local_ids"))
    bound = rows * (4 * h + 2 * i + 8 * i) + 2 * t * h + 4 * (2 * padded + 1)
    assert scratch <= bound, (target, scratch, bound)
    assert scratch < 6 << 30, (name, target, scratch)  # H100 80 GB: a fraction
