"""Property-based tests (hypothesis) of every CPU-runnable op against its jnp reference.

Profiles (tests/conftest.py): `ci` by default, `long` with HYPOTHESIS_PROFILE=long. Each property
runs `examples(fraction)` of the profile's max_examples: the fused op compiles the jnp reference
for every new shape (1-3 s), the packers cost milliseconds.

ISA paths: the handler reads JAX_MOEQ_CPU_ISA on every call (csrc/cpu/cpu_isa.cc `SelectIsa`),
so every example of a kernel property runs on every path this CPU has, switched within the
process (`on_each_isa`); `test_isa_path_runs` reports the paths the CPU lacks as skipped.

Inputs: fresh random data from a seed hypothesis draws (shapes, dtypes and flags shrink; the
values are numpy draws), never all zeros: int4 weights uniform in [-8, 7], scales
U(0.5, 1.5) / (8 sqrt(K)) (outputs O(1) for unit-normal inputs, as a trained layer's), x normal
times a drawn scale, router weights U(0.05, 1). Shapes: E 1..64, top-k 1..min(E, 8) (ids
distinct per row, or with duplicates), T 0..300, H and I every multiple of 16 and of the group
size up to MAX_FEATURES, under budgets that bound weight bytes and GEMM work per example.
The kernel tests pack with `np_pack_gemm`, written here from docs/design.md, and
`test_w4a8_packer_matches_layout` checks the library's packer against it byte for byte.

Tolerances (SPEC §9): kernel vs the same-scheme reference, relative Frobenius error <= 1e-4 in
float32 and <= 1e-2 in bfloat16 / float16 (the paths sum groups in another order and fold the
zero point per row, which flips rare int8 roundings); in float32 a few tokens whose output one
such flip moves by up to 1e-2 are allowed besides (`check_close`: with few tokens one flip
exceeds the whole-tensor 1e-4). The REFERENCE backend runs the very function it is compared
with: equal. Packers and loaders: exact.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_moeq import _ffi, reference, routing
from jax_moeq.fused_moe import fused_moe
from jax_moeq.ops import w4a8_cpu
from jax_moeq.quant import int4
from jax_moeq.weights import (
    FloatMoEWeights, Int4MoEWeights, W4A8PackedWeights, pack_w4a8, unpack_w4a8,
)

pytestmark = pytest.mark.skipif(not _ffi.cpu_library_available(),
                                reason="jax_moeq CPU library not built")

ALL_ISAS = ("portable", "avx2", "avx512_vnni", "amx_int8", "neon_i8mm", "neon_dotprod")
ISAS = tuple(_ffi.cpu_module().available_isas()) if _ffi.cpu_library_available() else ()
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
GROUP_SIZES = (32, 64, 128, -1)
TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 1e-2,
             jnp.dtype(jnp.float16): 1e-2}
MAX_E, MAX_K, MAX_T = 64, 8, 300
MAX_FEATURES = 2048  # H and I
WEIGHT_BUDGET = 1 << 24  # int4 values per example: E * 3 * H * I
WORK_BUDGET = 1 << 28  # multiply-adds per example: T * K * 3 * H * I
ACTIVATIONS = {"silu": 2, "swigluoai": 1, "swiglustep": 0}


def examples(fraction: float) -> settings:
  """This property's example count: `fraction` of the profile's max_examples (at least 2)."""
  return settings(max_examples=max(2, round(settings.default.max_examples * fraction)))


# ------------------------------------------------------------------ ISA paths
@contextlib.contextmanager
def forced_isa(isa: str):
  """Runs the CPU kernel on `isa` (JAX_MOEQ_CPU_ISA is read on every call)."""
  old = os.environ.get("JAX_MOEQ_CPU_ISA")
  os.environ["JAX_MOEQ_CPU_ISA"] = isa
  try:
    yield
  finally:
    if old is None:
      del os.environ["JAX_MOEQ_CPU_ISA"]
    else:
      os.environ["JAX_MOEQ_CPU_ISA"] = old


def on_each_isa(fn) -> dict[str, np.ndarray]:
  """{isa: np.asarray(fn())} for every path this CPU has (results fetched inside the switch)."""
  out = {}
  for isa in ISAS:
    with forced_isa(isa):
      out[isa] = np.asarray(jax.block_until_ready(fn()))
  return out


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_isa_path_runs(isa):
  """Every path the CPU has is selectable (the properties below run on each); the others are
  reported here as skipped."""
  if isa not in ISAS:
    pytest.skip(f"this CPU lacks the {isa} path (has {', '.join(ISAS)}): not exercised here")
  with forced_isa(isa):
    assert _ffi.cpu_module().selected_isa() == isa


# ------------------------------------------------------------------ helpers
def rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def bits(a) -> np.ndarray:
  """The raw bits of a float array (bit-identity, -0.0 and NaN payloads included)."""
  a = np.ascontiguousarray(np.asarray(a))
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def np_pack_gemm(q, scale, bias, group_size: int) -> np.ndarray:
  """docs/design.md's W4A8 layout, written independently of ops/w4a8_cpu.py (numpy).

  q [E, N, K] int4-as-int8, scale [E, N, G], bias [E, N] or None -> uint8 [E, bytes]. row_corr is
  formed in float64 and rounded once.
  """
  q = np.asarray(q)
  e, n, k = q.shape
  g = k if group_size == -1 else group_size
  groups, tiles = k // g, n // 16
  nib = (q.astype(np.int16) + 8).astype(np.uint8)
  t = nib.reshape(e, tiles, 16, groups, g // 8, 2, 4)  # [e, nt, r, gi, kb, half, j]
  byte = t[..., 0, :] | (t[..., 1, :] << 4)  # [e, nt, r, gi, kb, j]: low nibble k0+j, high k0+4+j
  blocks = byte.transpose(0, 1, 3, 4, 2, 5).reshape(e, tiles, groups, (g // 8) * 64)
  sw = np.asarray(scale, np.float32).reshape(e, tiles, 16, groups).transpose(0, 1, 3, 2)
  sw_bytes = np.ascontiguousarray(sw).view(np.uint8).reshape(e, tiles, groups, 64)
  body = np.concatenate([blocks, sw_bytes], axis=-1).reshape(e, -1)
  sums = q.astype(np.int64).reshape(e, n, groups, g).sum(-1)
  row_corr = (np.asarray(scale, np.float64).reshape(e, n, groups) * sums).sum(-1)
  b = np.zeros((e, n), np.float32) if bias is None else np.asarray(bias, np.float32)
  tail = np.concatenate([row_corr.astype(np.float32), b], axis=-1)
  return np.concatenate([body, np.ascontiguousarray(tail).view(np.uint8)], axis=-1)


def int4_values(rng, shape) -> np.ndarray:
  return rng.integers(-8, 8, shape).astype(np.int8)


def weight_scales(rng, e, n, k, group_size):
  """Realistic symmetric scales: bf16 group-wise, f32 channel-wise (SPEC §2)."""
  g = k if group_size == -1 else group_size
  s = rng.uniform(0.5, 1.5, (e, n, k // g)) / (8 * np.sqrt(k))
  return s.astype(np.float32 if group_size == -1 else ml_dtypes.bfloat16)


def routing_ids(rng, t, e, k, duplicates: bool) -> np.ndarray:
  if not duplicates:
    return np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
  ids = rng.integers(0, e, (t, k)).astype(np.int32)
  if k >= 2 and t:
    rows = rng.random(t) < 0.5
    ids[rows, 1] = ids[rows, 0]  # half the rows repeat an expert for sure
  return ids


# ------------------------------------------------------------------ problems
class Problem:
  """One fused-MoE call: numpy arrays and the static arguments."""

  def __init__(self, *, t, e, k, h, i, group_size, dtype, kind, bias, on_input, duplicates,
               x_scale, seed):
    rng = np.random.default_rng(seed)
    self.t, self.e, self.k, self.h, self.i = t, e, k, h, i
    self.group_size, self.dtype, self.kind, self.on_input = group_size, dtype, kind, on_input
    self.x = (rng.standard_normal((t, h)) * x_scale).astype(jnp.dtype(dtype))
    self.ids = routing_ids(rng, t, e, k, duplicates)
    self.tw = rng.uniform(0.05, 1.0, (t, k)).astype(np.float32)
    self.w13_q = int4_values(rng, (e, 2 * i, h))
    self.w2_q = int4_values(rng, (e, h, i))
    self.w13_scale = weight_scales(rng, e, 2 * i, h, group_size)
    self.w2_scale = weight_scales(rng, e, h, i, group_size)
    self.w13_bias = (rng.standard_normal((e, 2 * i)) * 0.5).astype(np.float32) if bias else None
    self.w2_bias = (rng.standard_normal((e, h)) * 0.5).astype(np.float32) if bias else None
    self.w13_packed = np_pack_gemm(self.w13_q, self.w13_scale, self.w13_bias, group_size)
    self.w2_packed = np_pack_gemm(self.w2_q, self.w2_scale, self.w2_bias, group_size)

  def __repr__(self):
    return (f"Problem(T={self.t}, E={self.e}, K={self.k}, H={self.h}, I={self.i}, "
            f"g={self.group_size}, {jnp.dtype(self.dtype).name}, kind={self.kind}, "
            f"bias={self.w13_bias is not None}, on_input={self.on_input})")

  def static(self):
    return dict(H=self.h, I=self.i, I2=2 * self.i, group_size=self.group_size,
                apply_router_weight_on_input=self.on_input, activation_kind=self.kind)

  def kernel(self, x=None, ids=None, tw=None):
    """The op, eagerly (validation included)."""
    return w4a8_cpu.dynamic_4bit_int_moe(
        self.x if x is None else x, self.ids if ids is None else ids,
        self.tw if tw is None else tw, self.w13_packed, self.w2_packed, **self.static())

  def kernel_jit(self):
    """The op under jit: (x, ids, tw) -> out; ids are data."""
    static = self.static()
    return jax.jit(lambda x, ids, tw, w13, w2: w4a8_cpu.dynamic_4bit_int_moe(
        x, ids, tw, w13, w2, **static))

  def reference(self, x=None, ids=None, tw=None):
    return _REF_W4A8(self.x if x is None else x, self.ids if ids is None else ids,
                     self.tw if tw is None else tw, self.w13_q, self.w13_scale, self.w2_q,
                     self.w2_scale, self.group_size, w13_bias=self.w13_bias,
                     w2_bias=self.w2_bias, apply_router_weight_on_input=self.on_input,
                     activation_kind=self.kind)


_REF_W4A8 = jax.jit(reference.fused_moe_w4a8, static_argnums=7,
                    static_argnames=("apply_router_weight_on_input", "activation_kind"))
# The jnp packers under jit: one compilation per shape (eagerly, every primitive compiles for
# every new shape, ~50x slower here). Same integer operations either way.
_quantize_int4 = jax.jit(int4.quantize_int4, static_argnums=1)
_dequantize_int4 = jax.jit(int4.dequantize_int4, static_argnums=2)
_pack_nibbles = jax.jit(int4.pack_int4_nibbles)
_unpack_nibbles = jax.jit(int4.unpack_int4_nibbles)
_pack_ct, _unpack_ct = jax.jit(int4.pack_uint4b8_ct), jax.jit(int4.unpack_uint4b8_ct)
_pack_gptq, _unpack_gptq = jax.jit(int4.pack_uint4b8_gptq), jax.jit(int4.unpack_uint4b8_gptq)
_to_signed = jax.jit(int4.uint4b8_to_signed_int4)
_convert_w4a8 = jax.jit(w4a8_cpu.convert_to_w4a8_int8_moe_format, static_argnums=4)
_pack_w4a8, _unpack_w4a8 = jax.jit(pack_w4a8), jax.jit(unpack_w4a8)


@st.composite
def moe_shapes(draw, *, max_t=MAX_T, min_t=0, group_sizes=GROUP_SIZES, max_features=MAX_FEATURES):
  """(T, E, K, H, I, group_size) within the budgets; every allowed multiple of H and I."""
  g = draw(st.sampled_from(group_sizes))
  unit = 16 if g == -1 else g  # multiples of 16 and of the group
  h = unit * draw(st.integers(1, max_features // unit))
  i = unit * draw(st.integers(1, max(1, min(max_features, WEIGHT_BUDGET // (3 * h)) // unit)))
  e = draw(st.integers(1, max(1, min(MAX_E, WEIGHT_BUDGET // (3 * h * i)))))
  k = draw(st.integers(1, min(e, MAX_K)))
  t = draw(st.integers(min_t, max(min_t, min(max_t, WORK_BUDGET // (3 * h * i * k)))))
  return t, e, k, h, i, g


@st.composite
def problems(draw, **shape_kwargs):
  t, e, k, h, i, g = draw(moe_shapes(**shape_kwargs))
  return Problem(t=t, e=e, k=k, h=h, i=i, group_size=g, dtype=draw(st.sampled_from(DTYPES)),
                 kind=draw(st.sampled_from((0, 1, 2))), bias=draw(st.booleans()),
                 on_input=draw(st.booleans()), duplicates=draw(st.booleans()),
                 x_scale=draw(st.sampled_from((0.05, 1.0, 6.0))),
                 seed=draw(st.integers(0, 2**32 - 1)))


# float32, few tokens: one int8 rounding flip of one activation (the kernel's float32 GEMM1
# output differs from the reference's in the last ulp and lands on the other side of a .5) moves
# that token's output by about step / (sqrt(I) * rms) ~ 1e-3 (seen: 1.3e-3, T=73, I=768), which
# the whole-tensor 1e-4 of SPEC §9 cannot absorb when there are few tokens, though SPEC §9 names
# such flips as the allowed difference. So in float32 a few rows (FLIP_ROWS) may exceed 1e-4, up
# to FLIP_ROW_BOUND each, if the other rows together stay within 1e-4.
FLIP_ROW_BOUND = 1e-2


def flip_rows(n: int) -> int:
  return max(2, n // 50)


def check_close(got, want, dtype, what: str) -> None:
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == jnp.dtype(dtype), f"{what}: dtype {got.dtype}"
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  if got.size == 0:
    return
  assert np.isfinite(got.astype(np.float32)).all(), f"{what}: non-finite outputs"
  tol = TOLERANCE[jnp.dtype(dtype)]
  err = rel_err(got, want)
  if err <= tol:
    return
  assert jnp.dtype(dtype) == jnp.float32, f"{what}: relative error {err:.3g} > {tol}"
  g, w = got.astype(np.float64).reshape(-1, got.shape[-1]), want.astype(np.float64).reshape(
      -1, want.shape[-1])
  diff, norm = np.linalg.norm(g - w, axis=1), np.linalg.norm(w, axis=1)
  rows = np.divide(diff, norm, out=np.where(diff > 0, np.inf, 0.0), where=norm > 0)
  bad = rows > tol
  assert bad.sum() <= flip_rows(len(rows)) and rows[bad].max() <= FLIP_ROW_BOUND, (
      f"{what}: relative error {err:.3g} > {tol}; rows above it: {np.flatnonzero(bad)} "
      f"(errors {np.sort(rows[bad])[-4:]}), more or larger than int8 rounding flips explain")
  rest = rel_err(g[~bad], w[~bad]) if (~bad).any() else 0.0
  assert rest <= tol, f"{what}: relative error {rest:.3g} > {tol} outside the flipped rows"


# ------------------------------------------------------------------ the fused CPU op
@examples(0.25)
@given(p=problems())
def test_kernel_matches_reference(p):
  """dynamic_4bit_int_moe on every ISA path vs reference.fused_moe_w4a8 (SPEC §4, §9)."""
  want = np.asarray(p.reference())
  for isa, got in on_each_isa(p.kernel).items():
    check_close(got, want, p.dtype, f"{isa} {p}")


BAD_IDS = st.one_of(st.integers(-2**31, -1), st.integers(0, 2**31 - 1))


@examples(0.08)
@given(p=problems(min_t=1, max_t=64), data=st.data())
def test_out_of_range_ids(p, data):
  """Concrete out-of-range ids raise (op and reference); under jit (ids are data) their pairs
  contribute nothing, on every path: as the reference, and exactly as a zero router weight
  when the weight scales the output."""
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
  bad = rng.random(p.ids.shape) < data.draw(st.sampled_from((0.0, 0.2, 1.0)), label="p_bad")
  bad[rng.integers(p.t), rng.integers(p.k)] = True
  values = np.array([data.draw(BAD_IDS.map(lambda v, e=p.e: v if v < 0 else e + v % (2**31 - e)),
                               label="bad id") for _ in range(int(bad.sum()))], np.int32)
  assert ((values < 0) | (values >= p.e)).all()
  ids = p.ids.copy()
  ids[bad] = values
  with pytest.raises(ValueError, match="expert id out of range"):
    p.kernel(ids=ids)
  with pytest.raises(ValueError, match="expert id out of range"):
    reference.fused_moe_w4a8(p.x, ids, p.tw, p.w13_q, p.w13_scale, p.w2_q, p.w2_scale,
                             p.group_size)
  want = np.asarray(p.reference(ids=ids))
  f = p.kernel_jit()
  got = on_each_isa(lambda: f(p.x, ids, p.tw, p.w13_packed, p.w2_packed))
  all_bad = bad.all(axis=1)
  for isa, out in got.items():
    assert (out[all_bad] == 0).all(), f"{isa}: a token with no expert in range is not zero"
    if (~all_bad).any():
      check_close(out[~all_bad], want[~all_bad], p.dtype, f"{isa} {p}")
    if not p.on_input:
      with forced_isa(isa):
        zero_weight = np.asarray(f(p.x, np.where(bad, 0, p.ids),
                                   np.where(bad, 0, p.tw).astype(np.float32), p.w13_packed,
                                   p.w2_packed))
      np.testing.assert_array_equal(out.astype(np.float32), zero_weight.astype(np.float32),
                                    err_msg=f"{isa} {p}")


POISON = st.sampled_from((np.nan, np.inf, -np.inf))


@examples(0.08)
@given(p=problems(min_t=1, max_t=48, max_features=512), data=st.data())
def test_non_finite_rows_are_isolated(p, data):
  """A NaN / Inf in some tokens' activations: those tokens' outputs are NaN in every element
  (op docstring), every other token's output is bit-identical to the run without it, on every
  path (the int8 activation quantization is per row); the reference agrees on both counts."""
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
  rows = rng.random(p.t) < 0.3
  rows[rng.integers(p.t)] = True
  x = p.x.copy()
  for r in np.flatnonzero(rows):
    cols = rng.choice(p.h, data.draw(st.integers(1, p.h), label="poisoned"), replace=False)
    x[r, cols] = data.draw(POISON, label="value")
  clean = on_each_isa(p.kernel)
  poisoned = on_each_isa(lambda: p.kernel(x=x))
  for isa in ISAS:
    assert np.isnan(poisoned[isa][rows].astype(np.float32)).all(), f"{isa} {p}"
    np.testing.assert_array_equal(bits(poisoned[isa][~rows]), bits(clean[isa][~rows]),
                                  err_msg=f"{isa} {p}: a non-finite row changed another row")
  ref_clean, ref_poisoned = np.asarray(p.reference()), np.asarray(p.reference(x=x))
  assert np.isnan(ref_poisoned[rows].astype(np.float32)).all()
  np.testing.assert_array_equal(bits(ref_poisoned[~rows]), bits(ref_clean[~rows]))


# ------------------------------------------------------------------ fused_moe, every scheme
def float_experts(rng, e, h, i, bias):
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  return FloatMoEWeights(
      f32(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)),
      f32(rng.standard_normal((e, h, i)) / np.sqrt(i)),
      f32(rng.standard_normal((e, 2 * i)) * 0.1) if bias else None,
      f32(rng.standard_normal((e, h)) * 0.1) if bias else None)


def int4_experts(rng, e, h, i, group_size, bias) -> Int4MoEWeights:
  f32 = lambda v: None if v is None else jnp.asarray(v, jnp.float32)
  return Int4MoEWeights(
      jnp.asarray(int4_values(rng, (e, 2 * i, h))),
      jnp.asarray(weight_scales(rng, e, 2 * i, h, group_size)),
      jnp.asarray(int4_values(rng, (e, h, i))),
      jnp.asarray(weight_scales(rng, e, h, i, group_size)), group_size,
      f32(rng.standard_normal((e, 2 * i)) * 0.5 if bias else None),
      f32(rng.standard_normal((e, h)) * 0.5 if bias else None))


SCHEMES = ("unquantized", "w4a8_int8", "w4a8_packed", "wna16", "mxint4")


@examples(0.1)
@given(scheme=st.sampled_from(SCHEMES), data=st.data())
def test_fused_moe_every_scheme(scheme, data):
  """fused_moe on the CPU for every scheme vs the scheme's reference on the same routing:
  unquantized (XLA experts vs fused_moe_float), w4a8_int8 from int4 and from packed weights (the
  CPU kernel, every path), wna16 / mxint4 on the REFERENCE backend (equal to their references)
  and, with activation quantization allowed, on the CPU kernel (vs fused_moe_w4a8)."""
  groups = (32,) if scheme == "mxint4" else GROUP_SIZES
  t, e, k, h, i, g = data.draw(moe_shapes(max_t=48, group_sizes=groups, max_features=256),
                               label="shape")
  dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
  acts = ("silu", "swiglustep") if scheme == "mxint4" else tuple(ACTIVATIONS)
  activation = data.draw(st.sampled_from(acts), label="activation")
  renormalize = data.draw(st.booleans(), label="renormalize")
  on_input = scheme != "mxint4" and data.draw(st.booleans(), label="on_input")
  bias = scheme != "mxint4" and data.draw(st.booleans(), label="bias")
  quantize_acts = scheme in ("wna16", "mxint4") and data.draw(st.booleans(), label="act_quant")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
  x = jnp.asarray(rng.standard_normal((t, h)), dtype)
  logits = jnp.asarray(rng.standard_normal((t, e)) * 2, jnp.float32)
  if scheme == "unquantized":
    w = float_experts(rng, e, h, i, bias)
  else:
    w = int4_experts(rng, e, h, i, g, bias)
  call_w = pack_w4a8(w) if scheme == "w4a8_packed" else w
  run = jax.jit(functools.partial(
      fused_moe, top_k=k, scheme=None if scheme == "w4a8_packed" else scheme,
      activation=activation, renormalize=renormalize, apply_router_weight_on_input=on_input,
      allow_activation_quantization=quantize_acts))
  wts, ids = routing.select_experts(logits, k, renormalize=renormalize)
  kind = ACTIVATIONS[activation]
  ref_args = dict(w13_bias=None if scheme == "mxint4" else w.w13_bias,
                  w2_bias=None if scheme == "mxint4" else w.w2_bias,
                  apply_router_weight_on_input=on_input, activation_kind=kind)
  if scheme == "unquantized":
    got = run(x, logits, call_w)
    want = reference.fused_moe_float(x, ids, wts, w.w13, w.w2, **ref_args)
    check_close(got, want, dtype, f"{scheme} {activation}")
  elif scheme in ("w4a8_int8", "w4a8_packed") or quantize_acts:
    want = reference.fused_moe_w4a8(x, ids, wts, w.w13_q, w.w13_scale, w.w2_q, w.w2_scale, g,
                                    **ref_args)
    for isa, got in on_each_isa(lambda: run(x, logits, call_w)).items():
      check_close(got, want, dtype, f"{isa} {scheme} {activation}")
  elif scheme == "wna16":
    want = reference.fused_moe_wna16(x, ids, wts, w.w13_q, w.w13_scale, w.w2_q, w.w2_scale, g,
                                     **ref_args)
    np.testing.assert_array_equal(np.asarray(run(x, logits, call_w), np.float32),
                                  np.asarray(want, np.float32))
  else:
    method = (routing.RoutingMethodType.Renormalize if renormalize
              else routing.RoutingMethodType.Default)
    want = reference.fused_moe_mxint4(x, logits, w.w13_q, w.w13_scale, w.w2_q, w.w2_scale,
                                      top_k=k, routing_method=method)
    if kind != 2:  # the MxInt4 reference runs SiLU; SWIGLUSTEP is the same function (SPEC §4)
      assert kind == 0
    np.testing.assert_array_equal(np.asarray(run(x, logits, call_w), np.float32),
                                  np.asarray(want, np.float32))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_moe_zero_tokens(scheme):
  """No tokens in, no tokens out, on every scheme's CPU backend (the XLA float experts raised
  ZeroDivisionError: a reshape to (0, k, -1))."""
  rng = np.random.default_rng(0)
  e, h, i = 4, 64, 32
  w = float_experts(rng, e, h, i, False) if scheme == "unquantized" else int4_experts(
      rng, e, h, i, 32, False)
  x, logits = jnp.zeros((0, h), jnp.bfloat16), jnp.zeros((0, e), jnp.float32)
  out = fused_moe(x, logits, pack_w4a8(w) if scheme == "w4a8_packed" else w, top_k=2,
                  scheme=None if scheme == "w4a8_packed" else scheme)
  assert out.shape == (0, h) and out.dtype == jnp.bfloat16


def test_jit_with_closed_over_int4_weights():
  """Weights closed over by a jitted function are concrete arrays inside a trace: the packer's
  int4 range check must not trace them (it raised ConcretizationTypeError)."""
  rng = np.random.default_rng(3)
  w = int4_experts(rng, 4, 64, 32, 32, True)
  x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
  logits = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
  eager = fused_moe(x, logits, w, top_k=2)
  traced = jax.jit(lambda x, logits: fused_moe(x, logits, w, top_k=2))(x, logits)
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(eager))
  packed = jax.jit(lambda: pack_w4a8(w))()
  np.testing.assert_array_equal(np.asarray(packed.w13_packed),
                                np.asarray(pack_w4a8(w).w13_packed))


# ------------------------------------------------------------------ packers and their inverses
@st.composite
def int4_weights(draw, max_lead=2, max_out=32, max_in=256):
  """(w float32 [..., out, in], group_size): realistic weights, some groups all zero."""
  g = draw(st.sampled_from(GROUP_SIZES))
  unit = 8 if g == -1 else g
  k = unit * draw(st.integers(1, max(1, max_in // unit)))
  out = draw(st.integers(1, max_out))
  lead = tuple(draw(st.lists(st.integers(1, 3), max_size=max_lead)))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  w = rng.standard_normal(lead + (out, k)) * draw(st.sampled_from((1e-3, 0.05, 1.0, 30.0)))
  if draw(st.booleans()):  # zero some groups (scale 1, q 0)
    gsz = k if g == -1 else g
    groups = w.reshape(*lead, out, k // gsz, gsz)
    groups[rng.random(groups.shape[:-1]) < 0.3] = 0
  return w.astype(np.float32), g


@examples(0.3)
@given(wg=int4_weights())
def test_quantize_dequantize_int4(wg):
  """quantize_int4 is SPEC §2's rule exactly (scale absmax / 7.5 in its storage dtype, q the
  half-even rounding of w / scale clamped to [-8, 7], zero groups scale 1 and q 0);
  dequantize_int4 is q * scale; the error is at most half a step (0.53 where q clamps to 7 and
  the bf16 scale was rounded down)."""
  w, g = wg
  q, scale = _quantize_int4(jnp.asarray(w), g)
  q, scale = np.asarray(q), np.asarray(scale)
  k = w.shape[-1]
  gsz = k if g == -1 else g
  assert q.dtype == np.int8 and q.shape == w.shape
  assert scale.dtype == (np.float32 if g == -1 else ml_dtypes.bfloat16)
  assert scale.shape == w.shape[:-1] + (k // gsz,)
  groups = w.reshape(*w.shape[:-1], k // gsz, gsz)
  absmax = np.abs(groups).max(-1)
  want_scale = np.where(absmax == 0, np.float32(1), absmax / np.float32(7.5)).astype(scale.dtype)
  np.testing.assert_array_equal(scale.astype(np.float32), want_scale.astype(np.float32))
  s = scale.astype(np.float32)[..., None]
  want_q = np.clip(np.rint(groups / s), -8, 7).reshape(w.shape)
  np.testing.assert_array_equal(q, want_q)
  deq = np.asarray(_dequantize_int4(jnp.asarray(q), jnp.asarray(scale), g))
  np.testing.assert_array_equal(deq, (q.reshape(groups.shape) * s).reshape(w.shape))
  # Half a step, except where q clamps to 7: the bf16 scale may be rounded down by up to
  # 2^-8, leaving w / scale up to 7.5 / (1 - 2^-8), 0.53 steps above 7.
  err = np.abs(deq - w).reshape(groups.shape)
  assert (err <= s * (0.5 + 7.5 * 2.0**-8 / (1 - 2.0**-8)) * (1 + 2.0**-20)).all()


@st.composite
def int4_arrays(draw, even=2, min_dims=1):
  lead = tuple(draw(st.lists(st.integers(1, 4), min_size=min_dims - 1, max_size=2)))
  n = even * draw(st.integers(1, 32))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  return int4_values(rng, lead + (n,))


@examples(0.3)
@given(q=int4_arrays(even=2))
def test_nibble_pack_unpack(q):
  """pack_int4_nibbles: value + 8, even index in the low nibble (SPEC §2); unpack inverts it."""
  packed = np.asarray(_pack_nibbles(jnp.asarray(q)))
  assert packed.dtype == np.uint8 and packed.shape == q.shape[:-1] + (q.shape[-1] // 2,)
  u = (q.astype(np.int16) + 8).astype(np.uint8)
  np.testing.assert_array_equal(packed, u[..., 0::2] | (u[..., 1::2] << 4))
  np.testing.assert_array_equal(np.asarray(_unpack_nibbles(jnp.asarray(packed))), q)


@examples(0.3)
@given(q=int4_arrays(even=8, min_dims=2))
def test_uint4b8_orientations(q):
  """uint4b8 (SPEC §2): nibble j of word r holds element 8r + j + 8. compressed-tensors packs
  [out, in] along in, GPTQ gives [in/8, out]; both invert, agree with the loaders' numpy
  packers, and XOR 0x88888888 gives the two's-complement nibbles (MxInt4's signed bytes)."""
  jq = jnp.asarray(q)
  ct = np.asarray(_pack_ct(jq))
  gptq = np.asarray(_pack_gptq(jq))
  assert ct.dtype == np.int32 and ct.shape == q.shape[:-1] + (q.shape[-1] // 8,)
  np.testing.assert_array_equal(gptq, np.swapaxes(ct, -1, -2))
  words = ct.view(np.uint32).astype(np.uint64)
  for j in range(8):
    np.testing.assert_array_equal((words >> (4 * j)) & 0xF, q[..., j::8].astype(np.int64) + 8)
  np.testing.assert_array_equal(np.asarray(_unpack_ct(jnp.asarray(ct))), q)
  np.testing.assert_array_equal(np.asarray(_unpack_gptq(jnp.asarray(gptq))), q)
  from jax_moeq.loaders import int4_format
  np.testing.assert_array_equal(int4_format.pack_uint4b8(q, axis=-1), ct)
  np.testing.assert_array_equal(int4_format.pack_uint4b8(np.swapaxes(q, -1, -2), axis=-2), gptq)
  signed = np.asarray(_to_signed(jnp.asarray(ct)))
  as_bytes = np.ascontiguousarray(signed).view("<u1").reshape(*q.shape[:-1], -1)
  np.testing.assert_array_equal(as_bytes, int4_format.pack_signed_nibbles(q))


@st.composite
def w4a8_experts(draw):
  t, e, k, h, i, g = draw(moe_shapes(max_t=0, max_features=256))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  bias = draw(st.booleans())
  return dict(
      e=e, h=h, i=i, g=g,
      w13_q=int4_values(rng, (e, 2 * i, h)), w2_q=int4_values(rng, (e, h, i)),
      w13_scale=weight_scales(rng, e, 2 * i, h, g), w2_scale=weight_scales(rng, e, h, i, g),
      w13_bias=(rng.standard_normal((e, 2 * i)) * 0.5).astype(np.float32) if bias else None,
      w2_bias=(rng.standard_normal((e, h)) * 0.5).astype(np.float32) if bias else None)


def _split_row_corr(packed, n, k, g):
  """(everything but row_corr, row_corr f32 [E, N]) of one packed GEMM."""
  packed = np.asarray(packed)
  start = w4a8_cpu.w4a8_packed_bytes(n, k, g) - 8 * n
  rest = np.concatenate([packed[:, :start], packed[:, start + 4 * n:]], axis=1)
  return rest, np.ascontiguousarray(packed[:, start:start + 4 * n]).view(np.float32)


@examples(0.1)
@given(w=w4a8_experts())
def test_w4a8_packer_matches_layout(w):
  """convert_to_w4a8_int8_moe_format writes docs/design.md's layout byte for byte (row_corr, a
  float32 sum of G products, to 2 ulp of the float64 value); unpack_w4a8_gemm (numpy) and
  pack_w4a8 / unpack_w4a8 (jnp) invert it; the native library agrees on the sizes."""
  e, h, i, g = w["e"], w["h"], w["i"], w["g"]
  j = lambda v: None if v is None else jnp.asarray(v)
  p13, p2, *rest = _convert_w4a8(
      j(w["w13_q"]), j(w["w2_q"]), j(w["w13_scale"]), j(w["w2_scale"]), g, j(w["w13_bias"]),
      j(w["w2_bias"]))
  assert all(r.size == 0 for r in rest)
  for name, packed, n, k in (("w13", p13, 2 * i, h), ("w2", p2, h, i)):
    q, s, b = w[f"{name}_q"], w[f"{name}_scale"], w[f"{name}_bias"]
    nbytes = w4a8_cpu.w4a8_packed_bytes(n, k, g)
    assert packed.shape == (e, nbytes) and packed.dtype == jnp.uint8
    assert _ffi.cpu_module().w4a8_packed_bytes(n, k, g) == nbytes
    mine = np_pack_gemm(q, s, b, g)
    got_rest, got_corr = _split_row_corr(packed, n, k, g)
    want_rest, want_corr = _split_row_corr(mine, n, k, g)
    np.testing.assert_array_equal(got_rest, want_rest, err_msg=name)
    groups = k // (k if g == -1 else g)
    bound = np.abs(np.asarray(s, np.float64)).reshape(e, n, groups).sum(-1) * (k // groups) * 8
    assert (np.abs(got_corr.astype(np.float64) - want_corr) <= 2 * bound * 2.0**-24).all()
    uq, us, _, ub = w4a8_cpu.unpack_w4a8_gemm(packed, n, k, g)
    np.testing.assert_array_equal(uq, q)
    np.testing.assert_array_equal(us, np.asarray(s, np.float32))
    np.testing.assert_array_equal(ub, np.zeros((e, n), np.float32) if b is None else b)
  canon = Int4MoEWeights(j(w["w13_q"]), j(w["w13_scale"]), j(w["w2_q"]), j(w["w2_scale"]), g,
                         j(w["w13_bias"]), j(w["w2_bias"]))
  packed = _pack_w4a8(canon)
  assert isinstance(packed, W4A8PackedWeights)
  np.testing.assert_array_equal(np.asarray(packed.w13_packed), np.asarray(p13))
  np.testing.assert_array_equal(np.asarray(packed.w2_packed), np.asarray(p2))
  back = _unpack_w4a8(packed)
  for name in ("w13", "w2"):
    np.testing.assert_array_equal(np.asarray(getattr(back, f"{name}_q")), w[f"{name}_q"])
    np.testing.assert_array_equal(np.asarray(getattr(back, f"{name}_scale")),
                                  np.asarray(w[f"{name}_scale"], np.float32))
    b = w[f"{name}_bias"]
    np.testing.assert_array_equal(np.asarray(getattr(back, f"{name}_bias")),
                                  np.zeros_like(np.asarray(getattr(back, f"{name}_bias")))
                                  if b is None else b)


# ------------------------------------------------------------------ loaders
@examples(1.0)
@given(q=int4_arrays(even=8), axis_seed=st.integers(0, 10))
def test_loader_int4_formats_round_trip(q, axis_seed):
  """loaders.int4_format: uint4b8 along any axis (multiple of 8), signed nibbles and the
  gate/up interleave are inverted exactly by their unpackers."""
  from jax_moeq.loaders import int4_format as f
  axes = [a for a in range(q.ndim) if q.shape[a] % 8 == 0]
  axis = axes[axis_seed % len(axes)]
  packed = f.pack_uint4b8(q, axis=axis)
  assert packed.dtype == np.int32 and packed.shape[axis] == q.shape[axis] // 8
  np.testing.assert_array_equal(f.unpack_uint4b8(packed, axis=axis), q)
  np.testing.assert_array_equal(f.unpack_signed_nibbles(f.pack_signed_nibbles(q)), q)
  ax = axis_seed % q.ndim
  if q.shape[ax] % 2 == 0:
    halves = f.deinterleave_gate_up(q, axis=ax)
    np.testing.assert_array_equal(f.interleave_gate_up(halves, axis=ax), q)
    n = q.shape[ax]
    np.testing.assert_array_equal(np.take(halves, range(n // 2), axis=ax),
                                  np.take(q, range(0, n, 2), axis=ax))


@contextlib.contextmanager
def in_memory_dir():
  """A temporary directory in memory (/dev/shm) where there is one."""
  where = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
  with tempfile.TemporaryDirectory(dir=where) as d:
    yield d


@examples(0.3)
@given(storage=st.sampled_from(("compressed-tensors", "gptq", "gptq_act_order", "mxint4")),
       out=st.integers(1, 8).map(lambda v: 8 * v), data=st.data())
def test_read_linear_dequantizes_packed_tensors_exactly(storage, out, data):
  """read_linear on one layer written (in memory) by our jnp packers (compressed-tensors
  uint4b8, GPTQ with and without act-order, MxInt4 signed nibbles) is q * scale[g_idx], formed
  exactly and rounded once to float32."""
  from safetensors.numpy import save_file
  from jax_moeq.loaders import CheckpointQuantConfig, SafetensorsDir, int4_format, read_linear
  g = 32 if storage == "mxint4" else data.draw(st.sampled_from(GROUP_SIZES), label="group")
  unit = 8 if g == -1 else g
  k = unit * data.draw(st.integers(1, 256 // unit), label="k/unit")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
  q = int4_values(rng, (out, k))
  gsz = k if g == -1 else g
  scale = (rng.uniform(0.5, 1.5, (out, k // gsz)) / 50).astype(
      np.float32 if g == -1 else ml_dtypes.bfloat16)
  g_idx = np.arange(k) // gsz
  if storage == "gptq_act_order":
    g_idx = rng.permutation(g_idx)
  bias = (rng.standard_normal(out) * 0.1).astype(np.float32) if data.draw(st.booleans()) else None
  p = "model.layers.0.self_attn.q_proj"
  if storage.startswith("gptq"):
    tensors = {f"{p}.qweight": np.asarray(_pack_gptq(jnp.asarray(q))),
               f"{p}.scales": np.ascontiguousarray(scale.T),
               f"{p}.qzeros": int4_format.pack_uint4b8(
                   np.full((k // gsz, out), -1, np.int8), axis=-1),  # zero 8 stored as 7 (v1)
               f"{p}.g_idx": g_idx.astype(np.int32)}
    qcfg = CheckpointQuantConfig(quant_method="gptq", group_size=g,
                                 act_order=storage == "gptq_act_order")
  else:
    packed = (int4_format.pack_signed_nibbles(q) if storage == "mxint4"
              else np.asarray(_pack_ct(jnp.asarray(q))))
    tensors = {f"{p}.weight_packed": packed, f"{p}.weight_scale": scale,
               f"{p}.weight_shape": np.asarray([out, k], np.int64)}
    qcfg = CheckpointQuantConfig(quant_method=storage, group_size=g)
  if bias is not None:
    tensors[f"{p}.bias"] = bias
  with in_memory_dir() as d:
    save_file(tensors, os.path.join(d, "model.safetensors"))
    w, b = read_linear(SafetensorsDir(d), p, qcfg)
  want = (q.astype(np.float64) * scale.astype(np.float64)[:, g_idx]).astype(np.float32)
  assert w.dtype == np.float32
  np.testing.assert_array_equal(w, want)
  if bias is None:
    assert b is None
  else:
    np.testing.assert_array_equal(b, bias)


@examples(0.3)
@given(fmt=st.sampled_from(("compressed-tensors", "gptq", "mxint4")), data=st.data())
def test_moe_checkpoint_round_trip(fmt, data):
  """save_moe_checkpoint then load_moe_checkpoint (in memory) gives the int4 layer back."""
  from jax_moeq.loaders import MoELayerTensors, load_moe_checkpoint, save_moe_checkpoint
  g = 32 if fmt == "mxint4" else data.draw(st.sampled_from(GROUP_SIZES), label="group")
  unit = 8 if g == -1 else g
  h = unit * data.draw(st.integers(1, 256 // unit), label="h")
  i = unit * data.draw(st.integers(1, 256 // unit), label="i")
  e = data.draw(st.integers(1, 8), label="e")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
  bias = fmt != "mxint4" and data.draw(st.booleans(), label="bias")
  act_order = fmt != "mxint4" and g != -1 and data.draw(st.booleans(), label="act_order")

  def g_idx(k):
    return np.stack([rng.permutation(np.arange(k) // g) for _ in range(e)]).astype(np.int32)

  layer = MoELayerTensors(
      w13=int4_values(rng, (e, 2 * i, h)), w2=int4_values(rng, (e, h, i)),
      w13_scale=weight_scales(rng, e, 2 * i, h, g), w2_scale=weight_scales(rng, e, h, i, g),
      group_size=g, w13_g_idx=g_idx(h) if act_order else None,
      w2_g_idx=g_idx(i) if act_order else None,
      w13_bias=(rng.standard_normal((e, 2 * i))).astype(np.float32) if bias else None,
      w2_bias=(rng.standard_normal((e, h))).astype(np.float32) if bias else None)
  with in_memory_dir() as d:
    save_moe_checkpoint(d, {0: layer}, fmt=fmt, show_progress=False)
    back = load_moe_checkpoint(d, show_progress=False).layers[0]
  for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_g_idx", "w2_g_idx", "w13_bias",
               "w2_bias"):
    want, got = getattr(layer, name), getattr(back, name)
    contiguous = want is not None and name.endswith("g_idx") and (
        want == np.arange(want.shape[-1]) // g).all()
    if contiguous:
      want = None  # contiguous groups load as no act-order
    if want is None:
      assert got is None, name
      continue
    assert got is not None, name
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                  err_msg=name)
  assert back.group_size == g
