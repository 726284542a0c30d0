"""CPU W4A8 dense linear (SPEC §12) vs the same-scheme jnp reference `reference.linear_w4a8`.

Tolerances (SPEC §9): relative Frobenius error <= 1e-4 in float32 (the kernel sums groups in
another order, folds the zero point per row and fuses multiply-adds on x86, ~1e-7, plus rare
int8 rounding flips), <= 1e-2 in bfloat16/float16 (one rounding of the output: a flip of it
moves an element by at most one ulp, 2^-8 relative in bf16).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import _ffi, reference
from jax_moeq.ops import w4a8_cpu, w4a8_linear_cpu

pytestmark = pytest.mark.skipif(
    not _ffi.cpu_library_available(), reason="jax_moeq CPU library not built"
)

ISAS = _ffi.cpu_module().available_isas() if _ffi.cpu_library_available() else ["portable"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
GROUP_SIZES = [32, 64, 128, -1]
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
# Leading axes of x: M rows (0 to 200), and a 2-D batch.
LEADS = [(1,), (3,), (17,), (200,), (2, 5), (0,)]


def make_weights(rng, n, k, group_size, *, bias):
  """Fresh random int4 weights with realistic scales (outputs O(1) for unit-normal inputs)."""
  if group_size == -1:
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (n, 1)) / (8 * np.sqrt(k)), jnp.float32)
  else:
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (n, k // group_size)) / (8 * np.sqrt(k)),
                        jnp.bfloat16)
  return dict(
      q=jnp.asarray(rng.integers(-8, 8, (n, k)), jnp.int8),
      scale=scale,
      bias=jnp.asarray(rng.standard_normal(n) * 0.5, jnp.float32) if bias else None,
  )


def packed(w, group_size):
  return w4a8_linear_cpu.pack_w4a8_linear(w["q"], w["scale"], group_size, w["bias"])


def run_kernel(x, w_packed, n, group_size, *, poison=True):
  """The op under jit, writing into a NaN-filled buffer: unwritten elements stay NaN."""
  kwargs = dict(in_features=x.shape[-1], out_features=n, group_size=group_size)
  if not poison:
    return jax.jit(lambda a, w: w4a8_linear_cpu.w4a8_linear(a, w, **kwargs))(x, w_packed)
  buf = jnp.full((*x.shape[:-1], n), jnp.nan, x.dtype)
  return jax.jit(lambda a, w, o: w4a8_linear_cpu.w4a8_linear(a, w, out_buffer=o, **kwargs))(
      x, w_packed, buf)


def run_reference(x, w, group_size):
  f = jax.jit(reference.linear_w4a8, static_argnums=3)
  return f(x, w["q"], w["scale"], group_size, w["bias"])


def rel_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def check_case(seed, *, lead, n, k, group_size, dtype, bias):
  rng = np.random.default_rng(seed)
  w = make_weights(rng, n, k, group_size, bias=bias)
  x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
  got = run_kernel(x, packed(w, group_size), n, group_size)
  assert got.dtype == dtype and got.shape == (*lead, n)
  if x.size == 0:
    return
  assert np.isfinite(np.asarray(got, np.float32)).all(), "kernel left unwritten (NaN) elements"
  want = run_reference(x, w, group_size)
  assert want.dtype == dtype and np.linalg.norm(np.asarray(want, np.float64)) > 0
  err = rel_err(got, want)
  assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]}"


# Every SIMD path x dtype x group size; the leading axes and bias cycle through their grids so
# that each value is met on every path.
_CASES = list(itertools.product(DTYPES, GROUP_SIZES))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", range(len(_CASES)))
def test_kernel_matches_reference(isa, case, monkeypatch):
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", isa)
  dtype, group_size = _CASES[case]
  n, k = (96, 256) if case % 2 else (48, 384)
  for j, lead in enumerate(LEADS):
    check_case(100 * case + j, lead=lead, n=n, k=k, group_size=group_size, dtype=dtype,
               bias=bool((case + j) % 2))


@pytest.mark.parametrize(
    "lead,n,k,group_size,dtype",
    [
        ((1,), 2048, 2048, 128, jnp.bfloat16),   # decode: one row, many tiles per thread
        ((5,), 512, 4096, 64, jnp.float32),
        ((33,), 1024, 1024, -1, jnp.float16),
        ((2, 3), 160, 8192, 32, jnp.bfloat16),
    ],
)
def test_kernel_large_dims(lead, n, k, group_size, dtype):
  check_case(7, lead=lead, n=n, k=k, group_size=group_size, dtype=dtype, bias=True)


def test_rows_run_in_chunks():
  """Rows beyond one chunk's scratch budget run in several chunks, with the same results."""
  n, k, g, rows = 32768, 16, -1, 600
  chunk = _ffi.cpu_module().w4a8_linear_chunk_rows(rows, k, n, g, "bfloat16")
  assert chunk < rows, chunk  # several chunks at this shape
  check_case(8, lead=(rows,), n=n, k=k, group_size=g, dtype=jnp.bfloat16, bias=True)


@pytest.mark.parametrize("isa", ISAS)
def test_simd_paths_agree(isa, monkeypatch):
  """All paths compute the same integers; only float summation order differs."""
  rng = np.random.default_rng(3)
  w = make_weights(rng, 64, 256, 64, bias=True)
  x = jnp.asarray(rng.standard_normal((33, 256)), jnp.float32)
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", "portable")
  base = run_kernel(x, packed(w, 64), 64, 64, poison=False)
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", isa)
  assert _ffi.cpu_module().selected_isa() == isa
  assert rel_err(run_kernel(x, packed(w, 64), 64, 64, poison=False), base) < 1e-5


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nan_row_changes_only_its_own_row(isa, dtype, monkeypatch):
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", isa)
  rng = np.random.default_rng(4)
  w = make_weights(rng, 64, 128, 32, bias=True)
  x = jnp.asarray(rng.standard_normal((9, 128)), dtype)
  clean = np.asarray(run_kernel(x, packed(w, 32), 64, 32), np.float32)
  for value in (np.nan, np.inf):
    bad = np.asarray(run_kernel(x.at[4, 17].set(value), packed(w, 32), 64, 32), np.float32)
    assert np.isnan(bad[4]).all()
    np.testing.assert_array_equal(np.delete(bad, 4, axis=0), np.delete(clean, 4, axis=0))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_same_gemm_as_the_moe(isa, dtype, monkeypatch):
  """A dense linear is `dynamic_4bit_int_moe`'s GEMM for one expert (SPEC §12), bit for bit.

  E=1, top-1 with router weight 1, and gate rows biased to >= 17 so that sigmoid(gate) is
  exactly 1 in float32: the MoE output is then round(GEMM2(round(gate · up))) with
  (gate, up) = round(GEMM1(x)), which two linear calls reproduce exactly. The same chain
  through `reference.linear_w4a8` agrees with `reference.fused_moe_w4a8`."""
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", isa)
  rng = np.random.default_rng(5)
  T, H, I, g = 21, 128, 64, 32
  w13 = make_weights(rng, 2 * I, H, g, bias=True)
  w2 = make_weights(rng, H, I, g, bias=True)
  w13["bias"] = w13["bias"].at[:I].add(40.0)  # gate pre-activations in ~[35, 45]
  x = jnp.asarray(rng.standard_normal((T, H)), dtype)
  ids = jnp.zeros((T, 1), jnp.int32)
  ones = jnp.ones((T, 1), jnp.float32)
  w13_packed, w2_packed, *_ = w4a8_cpu.convert_to_w4a8_int8_moe_format(
      w13["q"][None], w2["q"][None], w13["scale"][None], w2["scale"][None], g,
      w13["bias"][None], w2["bias"][None])
  moe = w4a8_cpu.dynamic_4bit_int_moe(x, ids, ones, w13_packed, w2_packed, H, I, 2 * I, g)

  def product(y13):
    y13 = y13.astype(jnp.float32)
    assert float(y13[:, :I].min()) >= 17.0
    return reference.round_to_dtype(y13[:, :I] * y13[:, I:], dtype).astype(dtype)

  y13 = run_kernel(x, w13_packed[0], 2 * I, g)
  chained = run_kernel(product(y13), w2_packed[0], H, g)
  np.testing.assert_array_equal(np.asarray(chained, np.float32), np.asarray(moe, np.float32))

  ref_moe = reference.fused_moe_w4a8(x, ids, ones, w13["q"][None], w13["scale"][None],
                                     w2["q"][None], w2["scale"][None], g,
                                     w13_bias=w13["bias"][None], w2_bias=w2["bias"][None])
  ref_y13 = reference.linear_w4a8(x, w13["q"], w13["scale"], g, w13["bias"])
  ref_chained = reference.linear_w4a8(product(ref_y13), w2["q"], w2["scale"], g, w2["bias"])
  # XLA may order the reference's float32 sum over groups differently in the two graphs (an
  # ulp in float32 was seen), and such an ulp can flip a later rounding: agreement, not bits.
  err = rel_err(ref_chained, ref_moe)
  assert err <= (1e-6 if dtype == jnp.float32 else TOLERANCE[dtype]), err


def test_jit_and_vmap():
  rng = np.random.default_rng(6)
  n, k, g = 64, 128, 64
  w = make_weights(rng, n, k, g, bias=True)
  wp = packed(w, g)
  xs = jnp.asarray(rng.standard_normal((3, 4, k)), jnp.bfloat16)
  op = lambda x: w4a8_linear_cpu.w4a8_linear(x, wp, in_features=k, out_features=n,
                                             group_size=g)
  eager = op(xs)
  np.testing.assert_array_equal(np.asarray(jax.jit(op)(xs), np.float32),
                                np.asarray(eager, np.float32))
  batched = jax.jit(jax.vmap(op))(xs)
  nested = jax.vmap(jax.vmap(op))(xs[:, :, None])
  assert batched.shape == (3, 4, n) and nested.shape == (3, 4, 1, n)
  for b in range(3):
    np.testing.assert_array_equal(np.asarray(batched[b], np.float32),
                                  np.asarray(op(xs[b]), np.float32))
  np.testing.assert_array_equal(np.asarray(nested[:, :, 0], np.float32),
                                np.asarray(eager, np.float32))
  # Weights batched too: a sequential map over the weight sets.
  ws = jnp.stack([wp, packed(make_weights(rng, n, k, g, bias=False), g)])
  per_weights = jax.vmap(lambda x, w_: w4a8_linear_cpu.w4a8_linear(
      x, w_, in_features=k, out_features=n, group_size=g))(xs[:2], ws)
  for b in range(2):
    want = w4a8_linear_cpu.w4a8_linear(xs[b], ws[b], in_features=k, out_features=n,
                                       group_size=g)
    np.testing.assert_array_equal(np.asarray(per_weights[b], np.float32),
                                  np.asarray(want, np.float32))


def test_packing_round_trip():
  rng = np.random.default_rng(7)
  n, k = 48, 256
  for g, bias in ((32, True), (-1, False)):
    w = make_weights(rng, n, k, g, bias=bias)
    wp = packed(w, g)
    assert wp.shape == (w4a8_linear_cpu.w4a8_linear_packed_bytes(n, k, g),)
    assert wp.shape[0] == _ffi.cpu_module().w4a8_packed_bytes(n, k, g)
    q, scale, row_corr, b = w4a8_linear_cpu.unpack_w4a8_linear(wp, n, k, g)
    np.testing.assert_array_equal(q, np.asarray(w["q"]))
    np.testing.assert_array_equal(scale, np.asarray(w["scale"], np.float32))
    np.testing.assert_array_equal(b, 0 if w["bias"] is None else np.asarray(w["bias"]))
    sums = np.asarray(w["q"], np.int64).reshape(n, scale.shape[1], -1).sum(-1)
    np.testing.assert_allclose(row_corr, (scale * sums).sum(-1), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def small():
  rng = np.random.default_rng(9)
  w = make_weights(rng, 64, 128, 32, bias=False)
  return dict(x=jnp.asarray(rng.standard_normal((4, 128)), jnp.float32), w_packed=packed(w, 32))


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: {**a, "w_packed": a["w_packed"][:-4]}, ValueError,
         "w_packed has 5628 bytes; .* needs 5632"),
        (lambda a: {**a, "w_packed": a["w_packed"][None]}, ValueError, "1-D uint8"),
        (lambda a: {**a, "w_packed": a["w_packed"].astype(jnp.int8)}, ValueError, "uint8"),
        (lambda a: {**a, "group_size": 48}, ValueError, "group_size=48 is not supported"),
        (lambda a: {**a, "x": a["x"][:, :96], "in_features": 96, "group_size": 64}, ValueError,
         "group_size=64 does not divide the input size 96"),
        (lambda a: {**a, "out_features": 40}, ValueError, "out_features=40 must be a multiple"),
        (lambda a: {**a, "in_features": 120, "x": a["x"][:, :120]}, ValueError,
         "in_features=120 must be a multiple"),
        (lambda a: {**a, "in_features": 256}, ValueError, "x has last axis 128"),
        (lambda a: {**a, "x": a["x"].astype(jnp.int32)}, TypeError, "x must be float32"),
        (lambda a: {**a, "x": a["x"][0, 0]}, ValueError, "x must have at least one axis"),
        (lambda a: {**a, "out_buffer": jnp.zeros((4, 32), jnp.float32)}, ValueError,
         "out_buffer must be"),
    ],
)
def test_bad_input_raises(small, change, error, match):
  args = dict(x=small["x"], w_packed=small["w_packed"], in_features=128, out_features=64,
              group_size=32)
  args = change(args)
  with pytest.raises(error, match=match):
    w4a8_linear_cpu.w4a8_linear(**args)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "w_packed": a["w_packed"][:-4]}, "w_packed has 5628 bytes, expected 5632"),
        (lambda a: {**a, "group_size": 48}, "group_size 48 is not one of"),
        (lambda a: {**a, "x": a["x"][:, :96], "in_features": 96, "group_size": 64},
         "group_size 64 does not divide in_features 96"),
        (lambda a: {**a, "out_features": 40}, "out_features 40 is not a multiple of 16"),
        (lambda a: {**a, "in_features": 256}, "x has in_features 128, attribute says 256"),
        (lambda a: {**a, "x": a["x"].astype(jnp.int32)}, "x must be float32, bfloat16 or float16"),
        (lambda a: {**a, "x": a["x"][0, 0]}, "x must be 2-D"),
        (lambda a: {**a, "x": a["x"][None]}, "x must be 2-D"),
        (lambda a: {**a, "w_packed": jax.lax.bitcast_convert_type(a["w_packed"], jnp.int8)},
         "w_packed must be uint8"),
        (lambda a: {**a, "w_packed": a["w_packed"][None]}, "w_packed must be 1-D"),
    ],
)
def test_handler_validates(small, change, match):
  """The FFI handler checks on its own (the bare custom call: Python validation bypassed)."""
  args = change(dict(x=small["x"], w_packed=small["w_packed"], in_features=128,
                     out_features=64, group_size=32))
  with pytest.raises(Exception, match="jax_moeq_w4a8_linear_cpu: " + match):
    jax.block_until_ready(w4a8_linear_cpu._ffi_linear(**args))


def test_packer_rejects_bad_weights():
  q = jnp.ones((64, 128), jnp.int8)
  s = jnp.ones((64, 4), jnp.bfloat16)
  with pytest.raises(ValueError, match="outside the int4 range"):
    w4a8_linear_cpu.pack_w4a8_linear(q + 8, s, 32)
  with pytest.raises(TypeError, match="int8"):
    w4a8_linear_cpu.pack_w4a8_linear(q.astype(jnp.int32), s, 32)
  with pytest.raises(ValueError, match="q must be 2-D"):
    w4a8_linear_cpu.pack_w4a8_linear(q[None], s, 32)
  with pytest.raises(ValueError, match="scale must have shape"):
    w4a8_linear_cpu.pack_w4a8_linear(q, s[:, :2], 32)
  with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
    w4a8_linear_cpu.pack_w4a8_linear(q, s, 32, jnp.ones(32))
  with pytest.raises(ValueError, match="out_features=40 must be a multiple of 16"):
    w4a8_linear_cpu.pack_w4a8_linear(q[:40], s[:40], 32)
  with pytest.raises(ValueError, match="group_size=16 is not supported"):
    w4a8_linear_cpu.pack_w4a8_linear(q, s, 16)


def test_unknown_isa_is_an_error(small, monkeypatch):
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", "sse9")
  with pytest.raises(Exception, match="JAX_MOEQ_CPU_ISA='sse9'"):
    jax.block_until_ready(w4a8_linear_cpu.w4a8_linear(
        small["x"], small["w_packed"], in_features=128, out_features=64, group_size=32))
