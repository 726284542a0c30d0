"""GPU W4A8 fused MoE (SPEC §3-4): the packer and the oracle's choice on any machine; the kernel
against `reference.fused_moe_w4a8` (computed on the CPU device) where a Hopper GPU and our CUDA
library are present (those tests skip elsewhere, with the reason).

Tolerances (SPEC §9): rel. Frobenius <= 1e-4 in float32, <= 1e-2 in bf16/fp16. Why not bit
identity: the kernel sums the groups of a row in its own order and applies the activation's zero
point through row_corr (scale · (Σ_g sw·dot_g − zp·row_corr) instead of Σ_g sw·(dot_g − zp·Σq)),
so f32 values differ by rounding, which can move an int8 rounding or a rounding to the dtype by one
step in rare elements. The activation quantizer alone is compared bit for bit.
"""

import logging

import _helpers
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moeq import _ffi, reference
from jax_moeq.experts.w4a8_gpu import W4A8GpuExperts
from jax_moeq.oracle import base, w4a8_int8
from jax_moeq.oracle.base import MoEConfig, RoutingMethodType
from jax_moeq.oracle.w4a8_int8 import W4A8Int8MoeBackend
from jax_moeq.ops import w4a8_cpu, w4a8_gpu
from jax_moeq.weights import Int4MoEWeights

_REASON = _helpers.cuda_skip_reason(w4a8_gpu.w4a8_gpu_available)
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
G128 = base.kInt4W4A8StaticGroup128Sym
TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 1e-2,
       jnp.dtype(jnp.float16): 1e-2}


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _experts(key, e, h, i, group_size, bias=False):
  """Random int4 experts with W4A8-scheme scales (bf16 group-wise, f32 channel-wise)."""
  k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
  g13 = h if group_size == -1 else group_size
  g2 = i if group_size == -1 else group_size
  sdt = jnp.float32 if group_size == -1 else jnp.bfloat16
  q13 = jax.random.randint(k1, (e, 2 * i, h), -8, 8).astype(jnp.int8)
  q2 = jax.random.randint(k2, (e, h, i), -8, 8).astype(jnp.int8)
  # |w| ~ 1/sqrt(in) keeps activations O(1) through both GEMMs.
  s13 = (jax.random.uniform(k3, (e, 2 * i, h // g13), jnp.float32, 0.5, 1.5) /
         (4.0 * np.sqrt(h))).astype(sdt)
  s2 = (jax.random.uniform(k4, (e, h, i // g2), jnp.float32, 0.5, 1.5) /
        (4.0 * np.sqrt(i))).astype(sdt)
  b13 = jax.random.normal(k5, (e, 2 * i), jnp.float32) * 0.1 if bias else None
  b2 = jax.random.normal(k6, (e, h), jnp.float32) * 0.1 if bias else None
  return Int4MoEWeights(q13, s13, q2, s2, group_size, b13, b2)


# ------------------------------------------------------------------ packer (any machine)
def _layout_position(n, k):
  """(nt, kc, lane, word, bit) of weight [n, k] in the packed layout, from the formula of
  csrc/cuda/w4a8_moe.h (independent of the packer's reshapes)."""
  nt, r = divmod(n, 16)
  h, g = divmod(r, 8)
  kc, kk = divmod(k, 128)
  s, rest = divmod(kk, 32)
  j, rest = divmod(rest, 16)
  t, b = divmod(rest, 4)
  return nt, kc, 4 * g + t, 2 * s + j, 8 * b + 4 * h


@pytest.mark.parametrize("n, k", [(16, 128), (64, 256), (48, 384)])
def test_packed_weights_follow_the_documented_layout(n, k):
  rng = np.random.default_rng(n * k)
  q = rng.integers(-8, 8, size=(2, n, k)).astype(np.int8)
  words = np.asarray(w4a8_gpu.pack_w4a8_gpu_weights(jnp.asarray(q)))
  assert words.shape == (2, n // 16, k // 128, 32, 8) and words.dtype == np.uint32
  for e in range(2):
    for nn in rng.integers(0, n, 40):
      for kk in rng.integers(0, k, 40):
        nt, kc, lane, word, bit = _layout_position(int(nn), int(kk))
        nib = (int(words[e, nt, kc, lane, word]) >> bit) & 0xF
        assert (nib - 16 if nib >= 8 else nib) == q[e, nn, kk]
  np.testing.assert_array_equal(np.asarray(w4a8_gpu.unpack_w4a8_gpu_weights(words)), q)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_pack_round_trip_and_row_corr_match_the_cpu_layout(group_size):
  w = _experts(jax.random.PRNGKey(group_size + 100), 3, 256, 128, group_size, bias=True)
  packed = w4a8_gpu.convert_to_w4a8_gpu_format(w.w13_q, w.w2_q, w.w13_scale, w.w2_scale,
                                                group_size, w.w13_bias, w.w2_bias)
  q13, s13, q2, s2 = w4a8_gpu.canonical_from_w4a8_gpu(packed)
  np.testing.assert_array_equal(np.asarray(q13), np.asarray(w.w13_q))
  np.testing.assert_array_equal(np.asarray(q2), np.asarray(w.w2_q))
  np.testing.assert_array_equal(np.asarray(s13), np.asarray(w.w13_scale, np.float32))
  np.testing.assert_array_equal(np.asarray(s2), np.asarray(w.w2_scale, np.float32))
  # The packed scales are sw / 16 (the kernel's int8 weights are 16 q), exactly.
  np.testing.assert_array_equal(np.asarray(w4a8_gpu.unpack_w4a8_gpu_scales(packed.w13_scales)),
                                np.asarray(packed.w13_scales).reshape(3, 16, -1, 8, 2)
                                .transpose(0, 1, 4, 3, 2).reshape(3, 256, -1) * 16)
  # row_corr as the CPU packer writes it (same f32 arithmetic).
  cpu13, cpu2, *_ = w4a8_cpu.convert_to_w4a8_int8_moe_format(
      w.w13_q, w.w2_q, w.w13_scale, w.w2_scale, group_size, w.w13_bias, w.w2_bias)
  _, _, rc13, b13 = w4a8_cpu.unpack_w4a8_gemm(cpu13, 256, 256, group_size)
  _, _, rc2, _ = w4a8_cpu.unpack_w4a8_gemm(cpu2, 256, 128, group_size)
  np.testing.assert_array_equal(np.asarray(packed.w13_row_corr), rc13)
  np.testing.assert_array_equal(np.asarray(packed.w2_row_corr), rc2)
  np.testing.assert_array_equal(np.asarray(packed.w13_bias), b13)
  assert packed.has_bias and packed.hidden_size == 256 and packed.intermediate_size == 128


def test_packer_refuses_shapes_the_kernel_cannot_run():
  w = _experts(jax.random.PRNGKey(1), 2, 192, 128, 64)
  with pytest.raises(ValueError, match="in % 128 == 0"):
    w4a8_gpu.convert_to_w4a8_gpu_format(w.w13_q, w.w2_q, w.w13_scale, w.w2_scale, 64)
  bad = jnp.full((2, 256, 256), 9, jnp.int8)
  w = _experts(jax.random.PRNGKey(2), 2, 256, 128, 64)
  with pytest.raises(ValueError, match="outside the int4 range"):
    w4a8_gpu.convert_to_w4a8_gpu_format(bad, w.w2_q, w.w13_scale, w.w2_scale, 64)


@pytest.mark.parametrize("group_size", [64, -1])
def test_experts_prepare_and_canonical_round_trip(group_size):
  w = _experts(jax.random.PRNGKey(7), 2, 256, 128, group_size, bias=True)
  cfg = MoEConfig(num_experts=2, top_k=1, hidden_size=256, intermediate_size=128,
                  platform="cuda", has_bias=True)
  experts = W4A8GpuExperts(cfg, w4a8_int8.make_w4a8_int8_moe_quant_config(
      None if group_size == -1 else (1, group_size)))
  arrays = experts.prepare(w)
  assert sorted(arrays) == sorted(w4a8_gpu.ARRAY_NAMES)
  back = experts.canonical(arrays)
  for name in ("w13_q", "w13_scale", "w2_q", "w2_scale", "w13_bias", "w2_bias"):
    np.testing.assert_array_equal(np.asarray(getattr(back, name)), np.asarray(getattr(w, name)))
  assert back.w13_scale.dtype == (jnp.float32 if group_size == -1 else jnp.bfloat16)


def test_op_validates_its_inputs_before_any_launch():
  w = _experts(jax.random.PRNGKey(3), 4, 256, 128, 128)
  kw = w4a8_gpu.convert_to_w4a8_gpu_format(w.w13_q, w.w2_q, w.w13_scale, w.w2_scale, 128)
  x = jnp.ones((3, 256), jnp.bfloat16)
  ids = jnp.zeros((3, 2), jnp.int32)
  wts = jnp.ones((3, 2), jnp.float32)
  with pytest.raises(TypeError, match="W4a8GpuWeights"):
    w4a8_gpu.w4a8_gpu_moe(x, {"w13": 1}, wts, ids)
  with pytest.raises(ValueError, match="hidden size 128"):
    w4a8_gpu.w4a8_gpu_moe(jnp.ones((3, 128), jnp.bfloat16), kw, wts, ids)
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    w4a8_gpu.w4a8_gpu_moe(x.astype(jnp.int32), kw, wts, ids)
  with pytest.raises(ValueError, match="topk_ids must be"):
    w4a8_gpu.w4a8_gpu_moe(x, kw, wts, ids[:2])
  with pytest.raises(ValueError, match="topk_weights shape"):
    w4a8_gpu.w4a8_gpu_moe(x, kw, wts[:, :1], ids)
  with pytest.raises(ValueError, match="activation_kind"):
    w4a8_gpu.w4a8_gpu_moe(x, kw, wts, ids, activation_kind=3)
  with pytest.raises(ValueError, match="block_m must be one of"):
    w4a8_gpu.w4a8_gpu_moe(x, kw, wts, ids, block_m=16)


# ------------------------------------------------------------------ oracle (any machine)
@pytest.fixture(autouse=True)
def _fresh_log_once():
  base.log_once.cache_clear() if hasattr(base.log_once, "cache_clear") else None
  yield


def _config(**kw):
  defaults = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
                  platform="cuda", in_dtype=jnp.bfloat16)
  defaults.update(kw)
  return MoEConfig(**defaults)


def _fake_gpu(monkeypatch, cc, library=True):
  monkeypatch.setattr(_ffi, "cuda_compute_capability", lambda: cc)
  monkeypatch.setattr(_ffi, "cuda_library_available", lambda: library)


@pytest.mark.parametrize("weight_key", base.W4A8_WEIGHT_KEYS, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_oracle_picks_the_gpu_kernel_on_hopper(monkeypatch, weight_key, dtype):
  _fake_gpu(monkeypatch, (9, 0))
  backend, cls = w4a8_int8.select_w4a8_int8_moe_backend(_config(in_dtype=dtype), weight_key)
  assert (backend, cls) == (W4A8Int8MoeBackend.CUDA_W4A8, W4A8GpuExperts)
  backend, cls = w4a8_int8.select_w4a8_int8_moe_backend(_config(platform="gpu"), weight_key)
  assert backend in (W4A8Int8MoeBackend.CUDA_W4A8, W4A8Int8MoeBackend.REFERENCE)


@pytest.mark.parametrize("cc, library, phrase", [
    ((10, 0), True, "compute capability 10.0; the W4A8 kernel is built for sm_90a"),
    ((8, 0), True, "compute capability 8.0"),
    ((9, 0), False, "CUDA library"),
    (None, True, "no CUDA GPU"),
])
def test_oracle_refuses_other_gpus_with_the_reason(monkeypatch, caplog, cc, library, phrase):
  _fake_gpu(monkeypatch, cc, library)
  with pytest.raises(ValueError) as err:
    w4a8_int8.select_w4a8_int8_moe_backend(_config(moe_backend="cuda_w4a8"), G128)
  assert str(err.value).startswith("W4A8 Int8 MoE backend CUDA_W4A8 does not support the "
                                   "deployment configuration since ")
  assert phrase in str(err.value)
  with caplog.at_level(logging.WARNING, logger="jax_moeq.oracle"):
    backend, _ = w4a8_int8.select_w4a8_int8_moe_backend(_config(), G128)
  assert backend == W4A8Int8MoeBackend.REFERENCE


@pytest.mark.parametrize("overrides, weight_key, phrase", [
    (dict(hidden_size=192), G128, "multiples of 128"),
    (dict(intermediate_size=64), base.kInt4W4A8StaticGroup32Sym, "multiples of 128"),
    (dict(in_dtype=jnp.float64), G128, "float64"),
    (dict(routing_method=RoutingMethodType.DeepSeekV3), G128, "routing method DeepSeekV3"),
    (dict(num_experts=5000, top_k=2), G128, "at most 4096 experts"),
    (dict(platform="cpu"), G128, "platform 'cpu'"),
])
def test_oracle_names_shape_misfits(monkeypatch, overrides, weight_key, phrase):
  _fake_gpu(monkeypatch, (9, 0))
  with pytest.raises(ValueError, match="CUDA_W4A8 does not support") as err:
    w4a8_int8.select_w4a8_int8_moe_backend(_config(moe_backend="gpu", **overrides), weight_key)
  assert phrase in str(err.value)


# ------------------------------------------------------------------ the kernel (Hopper only)
def _on_cpu(fn, *args):
  cpu = jax.devices("cpu")[0]
  return fn(*jax.device_put(args, cpu))


def _reference(x, ids, wts, w, activation_kind, on_input):
  fn = jax.jit(lambda x, ids, wts, q13, s13, q2, s2, b13, b2: reference.fused_moe_w4a8(
      x, ids, wts, q13, s13, q2, s2, w.group_size, w13_bias=b13, w2_bias=b2,
      apply_router_weight_on_input=on_input, activation_kind=activation_kind))
  return np.asarray(_on_cpu(fn, x, ids, wts, w.w13_q, w.w13_scale, w.w2_q, w.w2_scale,
                            w.w13_bias, w.w2_bias).astype(jnp.float32))


def _routing(key, t, e, k):
  kl, kw = jax.random.split(key)
  ids = jax.vmap(lambda kk: jax.random.permutation(kk, e)[:k])(jax.random.split(kl, t))
  wts = jax.random.uniform(kw, (t, k), jnp.float32, 0.1, 1.0)
  return ids.astype(jnp.int32), wts


def _run_case(seed, *, t, e=8, k=2, h=256, i=256, group_size=128, dtype=jnp.bfloat16,
              activation_kind=0, bias=False, on_input=False, poison=True, ids=None,
              block_m=None):
  key = jax.random.PRNGKey(seed)
  kw, kx, kr = jax.random.split(key, 3)
  w = _experts(kw, e, h, i, group_size, bias)
  x = jax.random.normal(kx, (t, h), jnp.float32).astype(dtype)
  r_ids, wts = _routing(kr, t, e, k)
  ids = r_ids if ids is None else ids
  packed = w4a8_gpu.convert_to_w4a8_gpu_format(w.w13_q, w.w2_q, w.w13_scale, w.w2_scale,
                                                group_size, w.w13_bias, w.w2_bias)
  out_init = jnp.full((t, h), jnp.nan, dtype) if poison else None
  y = w4a8_gpu.w4a8_gpu_moe(x, packed, wts, ids, activation_kind=activation_kind,
                            apply_router_weight_on_input=on_input, block_m=block_m,
                            out_init=out_init)
  y = np.asarray(y.astype(jnp.float32))
  ref = _reference(x, ids, wts, w, activation_kind, on_input)
  assert np.isfinite(y).all(), "unwritten (poisoned) or non-finite outputs"
  err = _rel(y, ref)
  assert err <= TOL[jnp.dtype(dtype)], f"rel. error {err:.3g}"
  return y, ref, err


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_vs_reference_dtypes_and_groups(dtype, group_size):
  _run_case(group_size + 3, t=37, dtype=dtype, group_size=group_size)


@needs_gpu
@pytest.mark.parametrize("activation_kind", [0, 1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("on_input", [False, True])
def test_vs_reference_activation_bias_weight_on_input(activation_kind, bias, on_input):
  _run_case(10 * activation_kind + 2 * bias + on_input, t=21, dtype=jnp.float32,
            activation_kind=activation_kind, bias=bias, on_input=on_input, group_size=64)


@needs_gpu
@pytest.mark.parametrize("t", [1, 2, 7, 128, 129, 1000, 3000])
def test_vs_reference_token_counts(t):
  _run_case(t, t=t, e=16, k=4, h=256, i=384, dtype=jnp.bfloat16, group_size=128)


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("t", [5, 200])
def test_every_token_tile_gives_the_same_bits(t, group_size, dtype):
  # The token tile changes which CTA computes a pair, never the arithmetic of an output: each
  # result is bit-identical across block_m, and each is within the reference's tolerance.
  # T = 5 leaves most of a block padding; T = 200 x 4 / 8 = 100 pairs per expert spans blocks.
  outs = [_run_case(40 + t + group_size, t=t, e=8, k=4, h=384, i=256, dtype=dtype,
                    group_size=group_size, bias=True, block_m=bm)[0] for bm in (32, 64, 128)]
  np.testing.assert_array_equal(outs[0], outs[1])
  np.testing.assert_array_equal(outs[0], outs[2])


@needs_gpu
def test_long_k_token_tiles_give_the_same_bits():
  # K = 2176 (17 chunks of 128) in both GEMMs: the 32-token tile runs two CTAs per SM there and
  # three at K <= 2048 (the other tests); both forms agree with the 64-token tile bit for bit.
  outs = [_run_case(77, t=5, e=4, k=2, h=2176, i=2176, dtype=jnp.bfloat16, group_size=128,
                    block_m=bm)[0] for bm in (32, 64)]
  np.testing.assert_array_equal(outs[0], outs[1])


@needs_gpu
def test_model_like_shape_f32():
  # Several expert blocks per expert and several N tiles in both GEMMs (GEMM2's N % 128 == 0,
  # GEMM1's 64-column tiles), K spanning many chunks.
  _run_case(5, t=300, e=4, k=2, h=1024, i=768, dtype=jnp.float32, group_size=32)


@needs_gpu
def test_hidden_not_a_multiple_of_the_gemm2_tile():
  # H % 128 == 0 but H / 64 odd is impossible; H = 384: three 128-row tiles. I = 640.
  _run_case(6, t=50, e=4, k=2, h=384, i=640, dtype=jnp.bfloat16, group_size=-1)


@needs_gpu
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("t", [33, 2800])  # 2800 x 3 pairs: the alignment spans three CTAs
def test_out_of_range_ids_contribute_nothing(on_input, t):
  e, k = 8, 3
  ids, _ = _routing(jax.random.PRNGKey(9), t, e, k)
  ids = ids.at[0, 1].set(-1).at[3, 0].set(e).at[4].set(jnp.array([99, -5, 1000]))
  y, _, _ = _run_case(9, t=t, e=e, k=k, ids=ids, on_input=on_input, dtype=jnp.float32)
  assert np.all(y[4] == 0.0)  # a token without a valid expert


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
# Warp per row with the row held in registers (768 bf16: 3 pieces a lane; 2048 f32 and 4096 bf16:
# all 16) or read twice (4096 f32); CTA per row (1001: odd; 5000: long).
@pytest.mark.parametrize("cols", [768, 1000, 1001, 2048, 4096, 5000])
def test_quantizer_matches_the_reference_bit_for_bit(dtype, cols):
  rng = np.random.default_rng(cols)
  rows = rng.standard_normal((64, cols)).astype(np.float32) * rng.uniform(0.01, 100, (64, 1))
  rows[1] = 0.0                       # empty row: scale 0, zp 0
  rows[2] = np.abs(rows[2])           # positive only: zp -128
  rows[3] = -np.abs(rows[3])          # negative only: zp 127
  rows[4] = 3.0                       # constant
  rows[5, 17] = np.nan                # non-finite row: scale NaN, q 0
  rows[6, 3] = np.inf
  rows[7] *= 1e-30                    # tiny range
  x = jnp.asarray(rows).astype(dtype)
  q, scale, zp = w4a8_gpu.quantize_rows_gpu(x)
  rq, rscale, rzp = _on_cpu(jax.jit(reference.quantize_activations_int8), x)
  np.testing.assert_array_equal(np.asarray(q), np.asarray(rq))
  np.testing.assert_array_equal(np.asarray(zp), np.asarray(rzp))
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(rscale))


@needs_gpu
@pytest.mark.parametrize("t,e,k", [(70, 8, 2), (300, 16, 4)])  # 32-token tile; 64, two blocks
def test_jit_and_repeated_calls_agree(t, e, k):
  # The alignment places an expert's pairs in its blocks in atomic order, which varies from call
  # to call; a pair's result must not depend on its row in a block.
  key = jax.random.PRNGKey(11)
  w = _experts(key, e, 256, 256, 64)
  packed = w4a8_gpu.convert_to_w4a8_gpu_format(w.w13_q, w.w2_q, w.w13_scale, w.w2_scale, 64)
  x = jax.random.normal(key, (t, 256), jnp.float32).astype(jnp.bfloat16)
  ids, wts = _routing(key, t, e, k)
  eager = w4a8_gpu.w4a8_gpu_moe(x, packed, wts, ids)
  jitted = jax.jit(w4a8_gpu.w4a8_gpu_moe)(x, packed, wts, ids)
  again = jax.jit(w4a8_gpu.w4a8_gpu_moe)(x, packed, wts, ids)
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
  np.testing.assert_array_equal(np.asarray(jitted), np.asarray(again))  # deterministic


@needs_gpu
def test_experts_class_end_to_end():
  w = _experts(jax.random.PRNGKey(12), 8, 256, 128, 128, bias=True)
  cfg = _config(has_bias=True)
  backend, cls = w4a8_int8.select_w4a8_int8_moe_backend(cfg, G128)
  assert cls is W4A8GpuExperts
  experts = cls(cfg, w4a8_int8.make_w4a8_int8_moe_quant_config((1, 128)))
  arrays = experts.prepare(w)
  x = jax.random.normal(jax.random.PRNGKey(13), (9, 256), jnp.float32).astype(jnp.bfloat16)
  logits = jax.random.normal(jax.random.PRNGKey(14), (9, 8), jnp.float32)
  y = experts.apply(x, logits, arrays)
  wts, ids = experts.default_routing().select(logits)
  ref = _reference(x, ids, wts, w, 0, False)
  assert _rel(np.asarray(y.astype(jnp.float32)), ref) <= 1e-2
