"""CPU W4A8 fused MoE kernel vs the same-scheme jnp reference (SPEC §3-4, §9).

Tolerances (SPEC §9): relative Frobenius error <= 1e-4 in float32 (the kernel
sums groups in another order and folds the zero point per row, ~1e-6, plus rare
int8 rounding flips), <= 1e-2 in bfloat16/float16 (a flip of one bf16 rounding
of an intermediate moves it by 2^-8; such flips are rare and local).
"""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import _ffi, reference
from jax_moeq.ops import w4a8_cpu

pytestmark = pytest.mark.skipif(
    not _ffi.cpu_library_available(), reason="jax_moeq CPU library not built"
)

ISAS = _ffi.cpu_module().available_isas() if _ffi.cpu_library_available() else ["portable"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
GROUP_SIZES = [32, 64, 128, -1]
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


def make_problem(seed, *, T, E, K, H, I, group_size, dtype, bias):
  """Fresh random int4 experts, scales, routing and activations (never zeros)."""
  rng = np.random.default_rng(seed)

  def scales(n, k):
    if group_size == -1:
      return jnp.asarray(rng.uniform(0.5, 1.5, (E, n, 1)) / (8 * np.sqrt(k)), jnp.float32)
    return jnp.asarray(rng.uniform(0.5, 1.5, (E, n, k // group_size)) / (8 * np.sqrt(k)),
                       jnp.bfloat16)

  p = dict(
      x=jnp.asarray(rng.standard_normal((T, H)), dtype),
      topk_ids=jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T)]), jnp.int32),
      topk_weights=jnp.asarray(rng.uniform(0.05, 1.0, (T, K)), jnp.float32),
      w13_q=jnp.asarray(rng.integers(-8, 8, (E, 2 * I, H)), jnp.int8),
      w2_q=jnp.asarray(rng.integers(-8, 8, (E, H, I)), jnp.int8),
      w13_scale=scales(2 * I, H),
      w2_scale=scales(H, I),
      w13_bias=jnp.asarray(rng.standard_normal((E, 2 * I)) * 0.5, jnp.float32) if bias else None,
      w2_bias=jnp.asarray(rng.standard_normal((E, H)) * 0.5, jnp.float32) if bias else None,
  )
  packed = jax.jit(w4a8_cpu.convert_to_w4a8_int8_moe_format, static_argnums=4)(
      p["w13_q"], p["w2_q"], p["w13_scale"], p["w2_scale"], group_size,
      p["w13_bias"], p["w2_bias"])
  p["w13_packed"], p["w2_packed"] = packed[0], packed[1]
  return p


def run_reference(p, *, group_size, apply_router_weight_on_input, activation_kind):
  f = jax.jit(reference.fused_moe_w4a8, static_argnums=7,
              static_argnames=("apply_router_weight_on_input", "activation_kind"))
  return f(p["x"], p["topk_ids"], p["topk_weights"], p["w13_q"], p["w13_scale"], p["w2_q"],
           p["w2_scale"], group_size, w13_bias=p["w13_bias"], w2_bias=p["w2_bias"],
           apply_router_weight_on_input=apply_router_weight_on_input,
           activation_kind=activation_kind)


def run_kernel_poisoned(p, *, H, I, group_size, apply_router_weight_on_input, activation_kind):
  """Runs the kernel writing into a NaN-filled buffer: unwritten elements stay NaN."""
  poison = jnp.full(p["x"].shape, jnp.nan, p["x"].dtype)
  f = jax.jit(lambda *a: w4a8_cpu._ffi_moe(
      *a[:5], H=H, I=I, group_size=group_size,
      apply_router_weight_on_input=apply_router_weight_on_input,
      activation_kind=activation_kind, out_buffer=a[5]))
  return f(p["x"], p["topk_ids"], p["topk_weights"], p["w13_packed"], p["w2_packed"], poison)


def rel_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def check_case(seed, *, T, E, K, H, I, group_size, dtype, bias, on_input, kind):
  p = make_problem(seed, T=T, E=E, K=K, H=H, I=I, group_size=group_size, dtype=dtype, bias=bias)
  got = run_kernel_poisoned(p, H=H, I=I, group_size=group_size,
                            apply_router_weight_on_input=on_input, activation_kind=kind)
  want = run_reference(p, group_size=group_size, apply_router_weight_on_input=on_input,
                       activation_kind=kind)
  assert got.dtype == dtype and got.shape == (T, H)
  assert np.isfinite(np.asarray(got, np.float32)).all(), "kernel left unwritten (NaN) elements"
  assert np.linalg.norm(np.asarray(want, np.float64)) > 0
  err = rel_err(got, want)
  assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]}"


# Every SIMD path x dtype x group size x activation kind; the other axes
# (T, E, K, bias, router weight on input) cycle through their grids so that
# each value is met on every path.
_T = [1, 2, 7, 16, 64, 257]
_EK = [(1, 1), (4, 2), (8, 4), (64, 8), (8, 2), (4, 4)]
_CASES = list(itertools.product(DTYPES, GROUP_SIZES, [0, 1, 2]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", range(len(_CASES)))
def test_kernel_matches_reference(isa, case, monkeypatch):
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", isa)
  dtype, group_size, kind = _CASES[case]
  E, K = _EK[case % len(_EK)]
  T = _T[(case + len(isa)) % len(_T)]
  if isa == "portable":  # scalar path: keep its shapes small
    T = min(T, 16)
  H, I = (128, 256) if case % 2 else (256, 128)
  check_case(1000 + case, T=T, E=E, K=K, H=H, I=I, group_size=group_size, dtype=dtype,
             bias=bool(case % 3 == 1), on_input=bool(case % 4 == 2), kind=kind)


@pytest.mark.parametrize(
    "T,E,K,H,I,group_size,dtype",
    [
        (16, 8, 2, 1024, 256, 128, jnp.bfloat16),
        (7, 4, 4, 256, 1024, 64, jnp.float32),
        (64, 8, 2, 1024, 1024, -1, jnp.float16),
        (257, 64, 8, 128, 128, 32, jnp.bfloat16),
        (3, 64, 1, 1024, 128, 32, jnp.float32),
    ],
)
def test_kernel_large_dims(T, E, K, H, I, group_size, dtype):
  check_case(7, T=T, E=E, K=K, H=H, I=I, group_size=group_size, dtype=dtype, bias=True,
             on_input=False, kind=0)


@pytest.mark.parametrize("isa", ISAS)
def test_simd_paths_agree(isa, monkeypatch):
  """All paths compute the same integers; only float summation order differs."""
  p = make_problem(3, T=33, E=8, K=2, H=256, I=128, group_size=64, dtype=jnp.float32, bias=True)
  args = (p["x"], p["topk_ids"], p["topk_weights"], p["w13_packed"], p["w2_packed"], 256, 128,
          256, 64)
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", "portable")
  base = w4a8_cpu.dynamic_4bit_int_moe(*args)
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", isa)
  assert w4a8_cpu._ffi.cpu_module().selected_isa() == isa
  assert rel_err(w4a8_cpu.dynamic_4bit_int_moe(*args), base) < 1e-5


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,on_input", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_decode_region_matches_staged_path(isa, dtype, on_input, monkeypatch):
  """Calls of at most 64 routed pairs run GEMM1, activation, GEMM2 and the combine (per GEMM2
  column range) as one region; larger calls run them as stages. Tokens are independent, so 4
  tokens alone (32 pairs, one of them out of range) equal, bit for bit, the same 4 tokens at the
  head of a 12-token call (96 pairs)."""
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", isa)
  H, I, E, K = 256, 128, 16, 8
  p = make_problem(21, T=12, E=E, K=K, H=H, I=I, group_size=64, dtype=dtype, bias=True)
  ids = p["topk_ids"].at[1, 3].set(E + 5)
  f = jax.jit(lambda x, i, w: w4a8_cpu._ffi_moe(
      x, i, w, p["w13_packed"], p["w2_packed"], H=H, I=I, group_size=64,
      apply_router_weight_on_input=on_input, activation_kind=0))
  staged = np.asarray(f(p["x"], ids, p["topk_weights"]), np.float32)
  region = np.asarray(f(p["x"][:4], ids[:4], p["topk_weights"][:4]), np.float32)
  assert np.isfinite(region).all()
  np.testing.assert_array_equal(region, staged[:4])


def test_matches_unquantized_moe_within_quantization_noise():
  """Kernel on quantize_int4'd float experts vs the float MoE: int4 weights
  (~1/15 of the group range per step) and int8 activations leave ~10 % noise
  per GEMM (SPEC §9); a wrong layout or scale would give ~100 %."""
  from jax_moeq.quant import int4
  rng = np.random.default_rng(11)
  E, K, T, H, I = 8, 2, 32, 256, 128
  w13 = jnp.asarray(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(I), jnp.float32)
  q13, s13 = int4.quantize_int4(w13, 64)
  q2, s2 = int4.quantize_int4(w2, 64)
  w13_packed, w2_packed, *_ = w4a8_cpu.convert_to_w4a8_int8_moe_format(q13, q2, s13, s2, 64)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1, (T, K)), jnp.float32)
  got = w4a8_cpu.dynamic_4bit_int_moe(x, ids, weights, w13_packed, w2_packed, H, I, 2 * I, 64)
  want = reference.fused_moe_float(x, ids, weights, w13, w2)
  assert rel_err(got, want) < 0.25


def test_packing_round_trip():
  p = make_problem(5, T=1, E=3, K=1, H=128, I=64, group_size=32, dtype=jnp.float32, bias=True)
  q, scale, row_corr, bias = w4a8_cpu.unpack_w4a8_gemm(p["w13_packed"], 128, 128, 32)
  np.testing.assert_array_equal(q, np.asarray(p["w13_q"]))
  np.testing.assert_array_equal(scale, np.asarray(p["w13_scale"], np.float32))
  np.testing.assert_array_equal(bias, np.asarray(p["w13_bias"]))
  group_sums = np.asarray(p["w13_q"], np.int64).reshape(3, 128, 4, 32).sum(-1)
  np.testing.assert_allclose(row_corr, (scale * group_sums).sum(-1), rtol=1e-6, atol=1e-6)
  assert p["w13_packed"].shape == (3, w4a8_cpu.w4a8_packed_bytes(128, 128, 32))
  channel = make_problem(5, T=1, E=2, K=1, H=128, I=64, group_size=-1, dtype=jnp.float32,
                         bias=False)
  q, scale, _, bias = w4a8_cpu.unpack_w4a8_gemm(channel["w2_packed"], 128, 64, -1)
  np.testing.assert_array_equal(q, np.asarray(channel["w2_q"]))
  np.testing.assert_array_equal(scale, np.asarray(channel["w2_scale"]))
  np.testing.assert_array_equal(bias, 0)


def _args(p, H, I, group_size):
  return (p["x"], p["topk_ids"], p["topk_weights"], p["w13_packed"], p["w2_packed"], H, I,
          2 * I, group_size)


def test_jit_vmap_and_int64_ids():
  H, I, g = 128, 128, 32
  batch = [make_problem(20 + b, T=5, E=4, K=2, H=H, I=I, group_size=g, dtype=jnp.bfloat16,
                        bias=False) for b in range(3)]
  shared = batch[0]
  xs = jnp.stack([b["x"] for b in batch])
  ids = jnp.stack([b["topk_ids"] for b in batch])
  ws = jnp.stack([b["topk_weights"] for b in batch])
  op = lambda x, i, w: w4a8_cpu.dynamic_4bit_int_moe(
      x, i, w, shared["w13_packed"], shared["w2_packed"], H, I, 2 * I, g)
  got = jax.jit(jax.vmap(op))(xs, ids, ws)
  for b in range(3):
    want = op(xs[b], ids[b], ws[b])
    np.testing.assert_array_equal(np.asarray(got[b], np.float32), np.asarray(want, np.float32))
  # Weights batched too: a sequential map over the batch.
  w13s = jnp.stack([b["w13_packed"] for b in batch])
  w2s = jnp.stack([b["w2_packed"] for b in batch])
  per_expert_set = jax.vmap(lambda x, i, w, a, c: w4a8_cpu.dynamic_4bit_int_moe(
      x, i, w, a, c, H, I, 2 * I, g))(xs, ids, ws, w13s, w2s)
  for b in range(3):
    want = w4a8_cpu.dynamic_4bit_int_moe(*_args(batch[b], H, I, g))
    np.testing.assert_array_equal(np.asarray(per_expert_set[b], np.float32),
                                  np.asarray(want, np.float32))
  # int64 ids (numpy) are accepted and cast.
  np_ids = np.asarray(shared["topk_ids"]).astype(np.int64)
  out = w4a8_cpu.dynamic_4bit_int_moe(shared["x"], np_ids, shared["topk_weights"],
                                      shared["w13_packed"], shared["w2_packed"], H, I, 2 * I, g)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(op(shared["x"], shared["topk_ids"],
                                              shared["topk_weights"]), np.float32))


def test_zero_tokens():
  p = make_problem(2, T=4, E=4, K=2, H=128, I=64, group_size=64, dtype=jnp.float32, bias=False)
  out = w4a8_cpu.dynamic_4bit_int_moe(p["x"][:0], p["topk_ids"][:0], p["topk_weights"][:0],
                                      p["w13_packed"], p["w2_packed"], 128, 64, 128, 64)
  assert out.shape == (0, 128)


# ------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def small():
  return make_problem(9, T=4, E=4, K=2, H=128, I=64, group_size=32, dtype=jnp.float32, bias=False)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: {**a, "x": a["x"][None]}, ValueError, "x must be 2-D"),
        (lambda a: {**a, "x": a["x"].astype(jnp.int32)}, TypeError, "x must be float32"),
        (lambda a: {**a, "topk_ids": a["topk_ids"][:, :1]}, ValueError, "topk_weights shape"),
        (lambda a: {**a, "topk_ids": a["topk_ids"][:2]}, ValueError, "topk_ids must be"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].astype(jnp.float32)}, TypeError, "int32"),
        (lambda a: {**a, "I2": 100}, ValueError, "I2=100 must equal 2"),
        (lambda a: {**a, "H": 256}, ValueError, "hidden size"),
        (lambda a: {**a, "group_size": 48}, ValueError, "group_size=48 is not supported"),
        (lambda a: {**a, "group_size": 128}, ValueError, "does not divide"),
        (lambda a: {**a, "group_size": 64}, ValueError, "bytes per expert"),
        (lambda a: {**a, "activation_kind": 3}, ValueError, "activation_kind=3"),
        (lambda a: {**a, "w2_packed": a["w2_packed"][:3]}, ValueError, "experts"),
        (lambda a: {**a, "w13_packed": a["w13_packed"].astype(jnp.int8)}, ValueError, "uint8"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].at[1, 1].set(4)}, ValueError,
         "expert id out of range"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].at[0, 0].set(-1)}, ValueError,
         "expert id out of range"),
    ],
)
def test_bad_input_raises(small, change, error, match):
  args = dict(x=small["x"], topk_ids=small["topk_ids"], topk_weights=small["topk_weights"],
              w13_packed=small["w13_packed"], w2_packed=small["w2_packed"], H=128, I=64, I2=128,
              group_size=32, activation_kind=0)
  with pytest.raises(error, match=match):
    w4a8_cpu.dynamic_4bit_int_moe(**change(args))


def test_out_of_range_id_under_jit_contributes_nothing(small):
  """Ids are data under jit: a pair whose id is outside [0, E) adds nothing to its token (as in
  the reference and the GPU kernels); the same pair with a valid id and weight 0 is the same."""
  f = jax.jit(w4a8_cpu.dynamic_4bit_int_moe, static_argnums=(5, 6, 7, 8))
  args = (small["w13_packed"], small["w2_packed"], 128, 64, 128, 32)
  bad = small["topk_ids"].at[2, 0].set(17)
  got = f(small["x"], bad, small["topk_weights"], *args)
  zero_weight = small["topk_weights"].at[2, 0].set(0.0)
  want = f(small["x"], small["topk_ids"], zero_weight, *args)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "attrs,match",
    [
        (dict(group_size=48), "group_size 48 is not one of"),
        (dict(group_size=64), "bytes per expert"),
        (dict(I=40), "intermediate size 40 is not a multiple of 16"),
        (dict(H=256), "x has hidden size 128"),
        (dict(activation_kind=5), "activation_kind 5"),
    ],
)
def test_handler_validates_attributes(small, attrs, match):
  """The FFI handler checks on its own (Python validation bypassed)."""
  kwargs = dict(H=128, I=64, group_size=32, apply_router_weight_on_input=False,
                activation_kind=0)
  kwargs.update(attrs)
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(w4a8_cpu._ffi_moe(small["x"], small["topk_ids"], small["topk_weights"],
                                            small["w13_packed"], small["w2_packed"], **kwargs))


def test_unknown_isa_is_an_error(small, monkeypatch):
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", "sse9")
  with pytest.raises(Exception, match="JAX_MOEQ_CPU_ISA='sse9'"):
    jax.block_until_ready(w4a8_cpu.dynamic_4bit_int_moe(
        small["x"], small["topk_ids"], small["topk_weights"], small["w13_packed"],
        small["w2_packed"], 128, 64, 128, 32))


def _cpu_flags() -> set[str]:
  try:
    with open("/proc/cpuinfo") as f:
      return next((set(l.split(":", 1)[1].split()) for l in f if l.startswith("flags")), set())
  except OSError:
    return set()


def test_amx_is_chosen_only_where_usable(small, monkeypatch):
  """AMX-INT8 comes first where CPUID has it and the OS grants the tile state; forced where it
  is not usable, the call fails with the reason (it is never executed: that would be SIGILL)."""
  isas = _ffi.cpu_module().available_isas()
  if "amx_int8" in isas:
    assert isas[0] == "amx_int8" and "avx512_vnni" in isas
    assert {"amx_tile", "amx_int8"} <= _cpu_flags()
    return
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", "amx_int8")
  with pytest.raises(Exception, match="JAX_MOEQ_CPU_ISA='amx_int8' is not supported by this CPU"):
    jax.block_until_ready(w4a8_cpu.dynamic_4bit_int_moe(
        small["x"], small["topk_ids"], small["topk_weights"], small["w13_packed"],
        small["w2_packed"], 128, 64, 128, 32))


def test_packer_rejects_bad_weights():
  q13 = jnp.zeros((2, 64, 128), jnp.int8) + 1
  q2 = jnp.zeros((2, 128, 32), jnp.int8) + 1
  s13 = jnp.ones((2, 64, 4), jnp.bfloat16)
  s2 = jnp.ones((2, 128, 1), jnp.bfloat16)
  with pytest.raises(ValueError, match="w2_scale must have shape"):
    w4a8_cpu.convert_to_w4a8_int8_moe_format(q13, q2, s13, jnp.ones((2, 128, 2)), 32)
  with pytest.raises(ValueError, match="outside the int4 range"):
    w4a8_cpu.convert_to_w4a8_int8_moe_format(q13 + 9, q2, s13, jnp.ones((2, 128, 1)), 32)
  with pytest.raises(TypeError, match="int8"):
    w4a8_cpu.convert_to_w4a8_int8_moe_format(q13.astype(jnp.int32), q2, s13, s2, 32)
  with pytest.raises(ValueError, match="group_size=16"):
    w4a8_cpu.convert_to_w4a8_int8_moe_format(q13, q2, s13, s2, 16)


def test_stage_clock_reports_the_decode_region():
  """The stage clock (benchmarks' --time-split) over decode-sized calls: the experts region ran
  pieces on at least one thread and at most the pool's, its last thread started after the
  launch and within the stage, and the idle tails fit the stage; no combine stage of its own."""
  module = _ffi.cpu_module()
  p = make_problem(31, T=4, E=16, K=4, H=256, I=128, group_size=64, dtype=jnp.bfloat16,
                   bias=False)
  f = jax.jit(lambda x, i, w: w4a8_cpu._ffi_moe(
      x, i, w, p["w13_packed"], p["w2_packed"], H=256, I=128, group_size=64,
      apply_router_weight_on_input=False, activation_kind=0))
  jax.block_until_ready(f(p["x"], p["topk_ids"], p["topk_weights"]))
  calls = 5
  module.w4a8_moe_profile(True)
  try:
    module.w4a8_moe_profile_take()
    for _ in range(calls):
      jax.block_until_ready(f(p["x"], p["topk_ids"], p["topk_weights"]))
  finally:
    module.w4a8_moe_profile(False)
  taken = module.w4a8_moe_profile_take()
  assert taken["chunks"] == calls
  experts = taken["stages"]["experts"]
  assert experts["pieces"] >= calls
  pool_bound = max(os.cpu_count() or 1, int(os.environ.get("PJRT_NPROC", "0") or 0))
  assert calls <= experts["threads"] <= calls * pool_bound
  assert 0 <= experts["late_start_ns"] <= experts["wall_ns"]
  assert 0 <= experts["idle_tail_ns"] <= experts["threads"] * experts["wall_ns"]
  assert experts["busy_ns"] > 0
  assert taken["stages"]["combine"]["pieces"] == 0


# ------------------------------------------------------------------ fused residual
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [5, 12])
def test_residual_equals_the_add_after_the_op(isa, dtype, T, monkeypatch):
  """`residual=r` gives r + moe(x) rounded as XLA's add in x's dtype, bit for bit: in the decode
  region (T = 5, 40 pairs) and the staged path (T = 12, 96 pairs), with a pair out of range, into
  a NaN-filled output buffer."""
  monkeypatch.setenv("JAX_MOEQ_CPU_ISA", isa)
  H, I, E, K = 256, 128, 16, 8
  p = make_problem(31, T=T, E=E, K=K, H=H, I=I, group_size=64, dtype=dtype, bias=True)
  residual = jnp.asarray(np.random.default_rng(32).standard_normal((T, H)) * 4, dtype)
  ids = p["topk_ids"].at[1, 3].set(E + 5)
  kw = dict(H=H, I=I, group_size=64, apply_router_weight_on_input=False, activation_kind=0)
  plain = jax.jit(lambda x, i, w, r: r + w4a8_cpu._ffi_moe(
      x, i, w, p["w13_packed"], p["w2_packed"], **kw))
  fused = jax.jit(lambda x, i, w, r, poison: w4a8_cpu._ffi_moe(
      x, i, w, p["w13_packed"], p["w2_packed"], residual=r, out_buffer=poison, **kw))
  poison = jnp.full((T, H), jnp.nan, dtype)
  want = np.asarray(plain(p["x"], ids, p["topk_weights"], residual), np.float32)
  got = np.asarray(fused(p["x"], ids, p["topk_weights"], residual, poison), np.float32)
  assert np.isfinite(got).all(), "kernel left unwritten (NaN) elements"
  assert np.abs(got - np.asarray(residual, np.float32)).max() > 0  # the MoE part is not lost
  np.testing.assert_array_equal(got, want)


def test_residual_alone_when_no_pair_is_routed(small):
  """Every id out of range (data under jit): no GEMM runs and the output is the residual."""
  residual = small["x"] * 3 - 1
  f = jax.jit(lambda i: w4a8_cpu.dynamic_4bit_int_moe(
      small["x"], i, small["topk_weights"], small["w13_packed"], small["w2_packed"], 128, 64, 128,
      32, residual=residual))
  got = f(jnp.full_like(small["topk_ids"], 9))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(residual))


def test_residual_under_vmap(small):
  """A batch of token sets with their residuals is one call on the folded tokens, equal to the
  sets one by one."""
  xs = jnp.stack([small["x"], small["x"][::-1]])
  rs = jnp.stack([small["x"] * 0.5, small["x"] - 2])
  ids = jnp.stack([small["topk_ids"], small["topk_ids"][::-1]])
  ws = jnp.stack([small["topk_weights"], small["topk_weights"][::-1]])
  op = lambda x, i, w, r: w4a8_cpu.dynamic_4bit_int_moe(
      x, i, w, small["w13_packed"], small["w2_packed"], 128, 64, 128, 32, residual=r)
  got = jax.jit(jax.vmap(op))(xs, ids, ws, rs)
  for b in range(2):
    np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(op(xs[b], ids[b], ws[b], rs[b])))


@pytest.mark.parametrize("residual,match", [
    (lambda x: x[:2], "residual must have x's shape"),
    (lambda x: x.astype(jnp.bfloat16), "residual must have x's shape and dtype"),
])
def test_bad_residual_raises(small, residual, match):
  with pytest.raises(ValueError, match=match):
    w4a8_cpu.dynamic_4bit_int_moe(small["x"], small["topk_ids"], small["topk_weights"],
                                  small["w13_packed"], small["w2_packed"], 128, 64, 128, 32,
                                  residual=residual(small["x"]))


@pytest.mark.parametrize("residual,match", [
    (lambda x: x[:2], "residual must have the shape of x"),
    (lambda x: x.astype(jnp.bfloat16), "residual dtype differs from x"),
])
def test_handler_validates_residual(small, residual, match):
  """The FFI handler checks the residual on its own (Python validation bypassed)."""
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(w4a8_cpu._ffi_moe(
        small["x"], small["topk_ids"], small["topk_weights"], small["w13_packed"],
        small["w2_packed"], H=128, I=64, group_size=32, apply_router_weight_on_input=False,
        activation_kind=0, residual=residual(small["x"])))
