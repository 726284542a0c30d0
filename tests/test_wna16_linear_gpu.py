"""GPU WNA16 dense linear (jax_moeq.ops.wna16_linear_gpu) against jax_moeq.reference.linear_wna16
(SPEC §12, §9). The kernel tests are marked `gpu` and skipped without a CUDA GPU of compute
capability >= 9.0 and our CUDA library; the packer's layout, the launch rule and the Python-side
errors need no GPU.

Tolerances (relative Frobenius error against the reference, which dequantizes each weight to x's
dtype as round((q - z) · s), accumulates in f32 and rounds once):
- 1e-2 in bf16/fp16 (SPEC §9) for the mma.sync GEMM at block_m 8/16 with groups of >= 64: it
  folds a group's scale after the sums (q·s unrounded, ~5e-3 off in bf16, as in the MoE tests);
- one ulp of the dtype (2^-8 bf16, 2^-11 fp16) for the wgmma GEMM, which rounds where the
  reference does: only the f32 summation order differs (split-K on the mma.sync GEMM changes that
  order too, by the order of the splits' atomic adds), moving a rounding point for the rare
  value it straddles.
"""

import zlib

import _helpers
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moeq import reference
from jax_moeq.ops import _gpu_launch
from jax_moeq.ops import wna16_gpu
from jax_moeq.ops import wna16_linear_gpu as wl

_REASON = _helpers.cuda_skip_reason(wl.wna16_linear_gpu_available)
gpu = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

TOL = 1e-2
DTYPES = (jnp.bfloat16, jnp.float16)
GROUPS = (32, 64, 128, -1)
ROWS = (1, 5, 16, 64, 300, 2048)
# (bias, zeros, act_order)
FLAG_SETS = tuple((b, z, a) for a in (False, True) for z in (False, True) for b in (False, True))


def _ulp_tol(dtype) -> float:
  return 2.0**-8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0**-11


def _key(*parts) -> jax.Array:
  """A fresh key per case (never the same inputs for two cases)."""
  return jax.random.PRNGKey(zlib.crc32(repr(parts).encode()))


def _make_linear(key, n, k, group_size, *, bias=False, zeros=False, act_order=False):
  """Random int4 linear tensors in the packer's input form (scales representable in bf16 and
  fp16, so that storing them in either dtype changes nothing)."""
  kq, ks, kz, kg, kb = jax.random.split(key, 5)
  g = k if group_size == -1 else group_size
  q = jax.random.randint(kq, (n, k), -8, 8, jnp.int32).astype(jnp.int8)
  # |w| ~ 1/sqrt(k) keeps outputs O(1).
  s = (jax.random.uniform(ks, (n, k // g), jnp.float32, 0.5, 1.5) / (4.0 * np.sqrt(k)))
  s = s.astype(jnp.bfloat16)
  if group_size == -1:
    s = s.astype(jnp.float32)  # channel-wise scales are f32 (SPEC §2)
  return dict(
      q=q, scale=s, group_size=group_size,
      zeros=jax.random.randint(kz, (n, k // g), -8, 8, jnp.int32) if zeros else None,
      g_idx=(jax.random.permutation(kg, jnp.arange(k) // g).astype(jnp.int32) if act_order
             else None),
      bias=jax.random.normal(kb, (n,), jnp.float32) if bias else None)


def _pack(t, dtype):
  return wl.pack_wna16_linear(t["q"], t["scale"], t["group_size"], g_idx=t["g_idx"],
                              zeros=t["zeros"], bias=t["bias"], dtype=dtype)


_linear_wna16 = jax.jit(reference.linear_wna16, static_argnames=("group_size",))


def _reference(x, t):
  return _linear_wna16(x, t["q"], t["scale"], group_size=t["group_size"], g_idx=t["g_idx"],
                       zeros=t["zeros"], bias=t["bias"])


def _check(y, want, tol):
  y = np.asarray(y.astype(jnp.float32))
  assert np.isfinite(y).all(), "output has non-finite values (unwritten or overflowed)"
  err = _helpers.rel_err(y, want.astype(jnp.float32))
  assert err <= tol, f"relative error {err:.2e} > {tol:.1e}"
  return err


def _tol_for(rows, n, k, dtype, **launch):
  block_m, mainloop_id, _ = wl.choose_linear_launch(rows, n, k, **launch)
  return _ulp_tol(dtype) if _gpu_launch.uses_wgmma(block_m, mainloop_id) else TOL


# ------------------------------------------------------------------ no GPU needed
def test_pack_layout_round_trip():
  n, k, g = 192, 256, 64
  t = _make_linear(_key("layout"), n, k, g, bias=True, zeros=True, act_order=True)
  w = wl.pack_wna16_linear(t["q"], t["scale"], g, g_idx=t["g_idx"], zeros=t["zeros"],
                           bias=t["bias"], dtype=jnp.float16)
  assert (w.in_features, w.out_features, w.group_size) == (k, n, g)
  assert w.has_zeros and w.has_bias and w.act_order and w.dtype == jnp.float16
  assert w.weights.shape == (n // 16, k // 64, 32, 4) and w.weights.dtype == jnp.uint32
  assert w.scales.shape == (k // g, n // 16, 16)
  perm = np.asarray(w.perm)
  np.testing.assert_array_equal(np.sort(perm), np.arange(k))
  # Sorted channels are grouped: position j holds a channel of group j // g.
  np.testing.assert_array_equal(np.asarray(t["g_idx"])[perm], np.arange(k) // g)
  nibbles = np.asarray(wna16_gpu.unpack_int4_tiles(w.weights[None]))[0].astype(np.int32)
  np.testing.assert_array_equal(nibbles - 8, np.asarray(t["q"], np.int32)[:, perm])
  scales = np.asarray(wna16_gpu.unpack_row_pairs(w.scales[None])[0], np.float32)
  np.testing.assert_array_equal(scales.T, np.asarray(t["scale"], np.float32))
  zeros = np.asarray(wna16_gpu.unpack_row_pairs(w.zeros[None])[0], np.float32)
  np.testing.assert_array_equal(zeros.T, np.asarray(t["zeros"], np.float32) + 8)
  np.testing.assert_array_equal(np.asarray(w.bias), np.asarray(t["bias"]))


def test_pack_under_jit_matches_eager():
  t = _make_linear(_key("jit pack"), 128, 128, 32, bias=True)
  eager = wl.pack_wna16_linear(t["q"], t["scale"], 32, bias=t["bias"])
  traced = jax.jit(lambda q, s, b: wl.pack_wna16_linear(q, s, 32, bias=b))(t["q"], t["scale"],
                                                                           t["bias"])
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(traced)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("change, error, match", [
    (dict(q=jnp.zeros((96, 128), jnp.int8)), ValueError, "multiples of 64"),
    (dict(q=jnp.zeros((128, 128), jnp.int32)), TypeError, "int8"),
    (dict(q=jnp.full((128, 128), 9, jnp.int8)), ValueError, r"\[-8, 7\]"),
    (dict(scale=jnp.ones((128, 3), jnp.bfloat16)), ValueError, "scale must be"),
    (dict(group_size=48), ValueError, "group_size"),
    (dict(zeros=jnp.zeros((128, 2), jnp.int32)), ValueError, "zeros must be"),
    (dict(zeros=jnp.zeros((128, 4), jnp.float32)), TypeError, "zeros must be integer"),
    (dict(g_idx=jnp.zeros((128,), jnp.int32)), ValueError, "exactly group_size"),
    (dict(g_idx=jnp.arange(64, dtype=jnp.int32)), ValueError, "g_idx must be"),
    (dict(bias=jnp.zeros((64,), jnp.float32)), ValueError, "bias must be"),
    (dict(dtype=jnp.float32), TypeError, "dtype"),
])
def test_pack_rejects_bad_input(change, error, match):
  args = dict(q=jnp.zeros((128, 128), jnp.int8), scale=jnp.ones((128, 4), jnp.bfloat16),
              group_size=32, zeros=None, g_idx=None, bias=None, dtype=jnp.bfloat16)
  args.update(change)
  with pytest.raises(error, match=match):
    wl.pack_wna16_linear(args["q"], args["scale"], args["group_size"], g_idx=args["g_idx"],
                         zeros=args["zeros"], bias=args["bias"], dtype=args["dtype"])


def test_op_rejects_bad_input_in_python():
  t = _make_linear(_key("errors"), 128, 128, 32)
  w = _pack(t, jnp.bfloat16)
  with pytest.raises(TypeError, match="bfloat16 or float16"):
    wl.wna16_linear(jnp.ones((2, 128), jnp.float32), w)
  with pytest.raises(ValueError, match="in_features = 128"):
    wl.wna16_linear(jnp.ones((2, 64), jnp.bfloat16), w)
  with pytest.raises(ValueError, match="in_features = 128"):
    wl.wna16_linear(jnp.ones((), jnp.bfloat16), w)
  with pytest.raises(TypeError, match="Wna16LinearWeights"):
    wl.wna16_linear(jnp.ones((2, 128), jnp.bfloat16), {"weights": w.weights})
  with pytest.raises(ValueError, match="out_init"):
    wl.wna16_linear(jnp.ones((2, 128), jnp.bfloat16), w, out_init=jnp.ones((2, 64), jnp.bfloat16))


def test_launch_rule(monkeypatch):
  monkeypatch.delenv(_gpu_launch.DETERMINISTIC_ENV, raising=False)
  wgmma = _gpu_launch.MAINLOOPS["wgmma"]
  # Decode: one 8-row block streams the weights once, split over K to fill the GPU.
  block_m, loop, split = wl.choose_linear_launch(1, 2048, 4096)
  assert (block_m, loop) == (8, 0) and split > 1
  # The LM head fills the GPU without a split: none.
  assert wl.choose_linear_launch(1, 151936, 2048)[2] == 1
  # Prefill: the wgmma GEMM's 128-row tile, never split; its 64-row tile where the 128-row launch
  # would hold too few CTAs.
  assert wl.choose_linear_launch(2048, 5120, 2048) == (128, wgmma, 1)
  assert wl.choose_linear_launch(256, 2048, 4096) == (64, wgmma, 1)
  assert wl.choose_linear_launch(256, 151936, 2048) == (128, wgmma, 1)
  assert wl.choose_linear_launch(256, 12288, 2048) == (128, wgmma, 1)  # 96 CTAs
  assert wl.choose_linear_launch(256, 5120, 2048) == (64, wgmma, 1)  # 40 CTAs at 128 rows
  # 64 rows: the wgmma 64-row tile on N = 5120 (20 CTAs), mma.sync with split-K on N = 2048.
  assert wl.choose_linear_launch(64, 5120, 2048) == (64, wgmma, 1)
  block_m, loop, split = wl.choose_linear_launch(64, 2048, 4096)
  assert (block_m, loop) == (32, 0) and split > 1
  # A few rows on small N: the mma.sync GEMM with split-K (the wgmma launch would idle SMs).
  block_m, loop, split = wl.choose_linear_launch(16, 2048, 4096)
  assert (block_m, loop) == (16, 0) and split > 1
  # ... on the LM head's N the wgmma tile fills the GPU.
  assert wl.choose_linear_launch(16, 151936, 2048) == (32, wgmma, 1)
  monkeypatch.setenv(_gpu_launch.DETERMINISTIC_ENV, "1")
  assert wl.choose_linear_launch(1, 2048, 4096)[2] == 1
  with pytest.raises(ValueError, match="does not split K"):
    wl.choose_linear_launch(300, 2048, 4096, block_m=128, split=2)
  with pytest.raises(ValueError, match="block_m"):
    wl.choose_linear_launch(3, 2048, 4096, block_m=12)
  with pytest.raises(ValueError, match="wgmma main loop"):
    wl.choose_linear_launch(3, 2048, 4096, block_m=8, mainloop="wgmma")


# ------------------------------------------------------------------ kernel vs reference
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_matches_reference(dtype, group_size, rows):
  n, k = 320, 512  # N % 128 == 64: the wgmma GEMM's half tile
  flags = FLAG_SETS[(GROUPS.index(group_size) * len(ROWS) + ROWS.index(rows)) % len(FLAG_SETS)]
  bias, zeros, act_order = flags
  t = _make_linear(_key("ref", dtype, group_size, rows), n, k, group_size, bias=bias,
                   zeros=zeros, act_order=act_order)
  x = jax.random.normal(_key("x", dtype, group_size, rows), (rows, k), jnp.float32).astype(dtype)
  y = jax.jit(wl.wna16_linear)(x, _pack(t, dtype))
  assert y.shape == (rows, n) and y.dtype == dtype
  _check(y, _reference(x, t), _tol_for(rows, n, k, dtype))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 300))
@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "bias%d-zeros%d-actorder%d" % f)
def test_flags(flags, rows):
  """Every combination of bias, zero points and act-order on the decode (mma.sync, split-K) and
  prefill (wgmma) paths; bf16 and fp16 alternate over the combinations."""
  bias, zeros, act_order = flags
  dtype = DTYPES[FLAG_SETS.index(flags) % 2]
  n, k, g = 256, 1024, 128
  t = _make_linear(_key("flags", dtype, flags, rows), n, k, g, bias=bias, zeros=zeros,
                   act_order=act_order)
  x = jax.random.normal(_key("xf", dtype, flags, rows), (rows, k), jnp.float32).astype(dtype)
  _check(wl.wna16_linear(x, _pack(t, dtype)), _reference(x, t), _tol_for(rows, n, k, dtype))


# (rows, block_m, mainloop, split): every GEMM main loop and tile, unsplit and split over K.
LAUNCHES = (
    (1, 8, "registers", 1), (1, 8, "registers", 8), (5, 8, "async_ring", 4),
    (7, 8, "bulk_copy", 2), (13, 16, "registers", 8), (16, 16, "async_ring", 1),
    (9, 16, "bulk_copy", 4), (30, 32, "registers", 4), (32, 32, "async_ring", 1),
    (60, 64, "registers", 4), (64, 64, "registers", 1), (20, 32, "wgmma", 1),
    (40, 64, "wgmma", 1), (200, 128, None, 1), (129, 128, "wgmma", 1),
    (20, 32, "wgmma_ws", 1), (40, 64, "wgmma_ws", 1), (300, 128, "wgmma_ws", 1),
)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("group_size", (32, 128))
@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda l: "M%d-b%d-%s-s%d" % (l[0], l[1], l[2],
                                                                               l[3]))
def test_every_launch(launch, group_size):
  rows, block_m, mainloop, split = launch
  n, k, dtype = 320, 2048, jnp.bfloat16
  t = _make_linear(_key("launch", launch, group_size), n, k, group_size, bias=True)
  x = jax.random.normal(_key("xl", launch, group_size), (rows, k), jnp.float32).astype(dtype)
  y = wl.wna16_linear(x, _pack(t, dtype), block_m=block_m, mainloop=mainloop, split=split)
  tol = _tol_for(rows, n, k, dtype, block_m=block_m, mainloop=mainloop, split=split)
  _check(y, _reference(x, t), tol)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("launch", [(1, None, None, None), (1, 8, "registers", 8),
                                    (16, 16, "registers", 1), (20, 32, "wgmma", 1),
                                    (300, 128, None, 1)],
                         ids=lambda l: "M%d-b%s-s%s" % (l[0], l[1], l[3]))
def test_poisoned_output_is_fully_written(launch):
  rows, block_m, mainloop, split = launch
  n, k = 320, 1024
  t = _make_linear(_key("poison", launch), n, k, 64, bias=True, zeros=True)
  x = jax.random.normal(_key("xp", launch), (rows, k), jnp.float32).astype(jnp.bfloat16)
  poison = jnp.full((rows, n), jnp.nan, jnp.bfloat16)
  y = wl.wna16_linear(x, _pack(t, jnp.bfloat16), block_m=block_m, mainloop=mainloop,
                      split=split, out_init=poison)
  _check(y, _reference(x, t), _tol_for(rows, n, k, jnp.bfloat16, block_m=block_m,
                                       mainloop=mainloop, split=split))


@gpu
@pytest.mark.gpu
def test_leading_dims_jit_and_vmap():
  n, k = 256, 512
  t = _make_linear(_key("vmap"), n, k, 64, bias=True)
  w = _pack(t, jnp.float16)
  x = jax.random.normal(_key("xv"), (4, 3, k), jnp.float32).astype(jnp.float16)
  flat = wl.wna16_linear(x.reshape(12, k), w)
  y = jax.jit(wl.wna16_linear)(x, w)
  assert y.shape == (4, 3, n)
  np.testing.assert_array_equal(np.asarray(y.reshape(12, n)), np.asarray(flat))
  yv = jax.jit(jax.vmap(wl.wna16_linear, in_axes=(0, None)))(x, w)
  np.testing.assert_array_equal(np.asarray(yv), np.asarray(y))
  _check(y, _reference(x, t), TOL)
  # M = 0 rows: an empty result, no launch.
  assert wl.wna16_linear(jnp.zeros((0, k), jnp.float16), w).shape == (0, n)


@gpu
@pytest.mark.gpu
def test_deterministic_mode_is_bit_identical(monkeypatch):
  monkeypatch.setenv(_gpu_launch.DETERMINISTIC_ENV, "1")
  n, k = 2048, 4096
  t = _make_linear(_key("det"), n, k, 128)
  w = _pack(t, jnp.bfloat16)
  x = jax.random.normal(_key("xd"), (2, k), jnp.float32).astype(jnp.bfloat16)
  assert wl.choose_linear_launch(2, n, k)[2] == 1
  first = np.asarray(jax.jit(wl.wna16_linear)(x, w))
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(wl.wna16_linear(x, w)), first)
  _check(jnp.asarray(first), _reference(x, t), TOL)


def _bare_call(x, w, *, scales=None, out_shape=None, **attrs):
  """The FFI target called directly (no Python checks), so the handler's own check fires."""
  n, k = w.out_features, w.in_features
  m = x.shape[0]
  kw = dict(in_features=np.int64(k), out_features=np.int64(n),
            groups=np.int64(k // w.group_size), block_m=np.int64(8), split=np.int64(1),
            mainloop=np.int64(0), has_zeros=False, has_bias=False, act_order=False)
  kw.update(attrs)
  results = [jax.ShapeDtypeStruct(out_shape or (m, n), x.dtype),
             jax.ShapeDtypeStruct((m * k,), x.dtype), jax.ShapeDtypeStruct((m * n + n,),
                                                                           jnp.float32)]
  call = jax.ffi.ffi_call(wl.FFI_TARGET, results)
  return call(x, w.weights, w.scales if scales is None else scales, w.zeros, w.bias, w.perm,
              **kw)[0]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case, match", [
    (dict(block_m=np.int64(12)), "block_m must be"),
    (dict(block_m=np.int64(128), split=np.int64(2)), "does not split K"),
    (dict(block_m=np.int64(1 << 33)), "out of range"),
    (dict(in_features=np.int64(192)), "x must be"),
    (dict(out_features=np.int64(192)), "weights has shape"),
    (dict(groups=np.int64(3)), "scale groups"),
    (dict(has_bias=True), "bias has shape"),
    (dict(act_order=True), "perm has shape"),
    (dict(scales="f16"), "scales must be bfloat16"),
    (dict(out_shape=(2, 64)), "output has shape"),
    (dict(x="f32"), "x must be bfloat16 or float16"),
])
def test_handler_rejects_bad_input(case, match):
  t = _make_linear(_key("handler"), 128, 128, 32)
  w = _pack(t, jnp.bfloat16)
  x = jnp.ones((2, 128), jnp.bfloat16)
  case = dict(case)
  if case.pop("x", None) == "f32":
    x = x.astype(jnp.float32)
  scales = w.scales.astype(jnp.float16) if case.pop("scales", None) == "f16" else None
  out_shape = case.pop("out_shape", None)
  with pytest.raises(Exception, match="jax_moeq_wna16_linear_cuda: .*" + match):
    jax.block_until_ready(_bare_call(x, w, scales=scales, out_shape=out_shape, **case))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows, n, k", [(1, 2048, 4096), (3, 5120, 2048), (64, 2048, 4096),
                                        (300, 5120, 2048)])
def test_model_shapes(rows, n, k):
  """Qwen3-30B-A3B's o_proj and fused q/k/v at decode and prefill (split-K up to 16 ways). Last
  in the file: the largest inputs (packing and the f32 reference at these sizes)."""
  t = _make_linear(_key("model", rows, n, k), n, k, 128, bias=True)
  x = jax.random.normal(_key("xm", rows, n), (rows, k), jnp.float32).astype(jnp.bfloat16)
  _check(wl.wna16_linear(x, _pack(t, jnp.bfloat16)), _reference(x, t),
         _tol_for(rows, n, k, jnp.bfloat16))
