"""The one route from weights to kernel (`jax_moeq.dispatch`): every scheme through `fused_moe`
on CPU, the same choice from `fused_moe` and the Flax blocks, the routing options on every
scheme, explicit backends that do not fit, and the import graph.

Tolerances (SPEC §9), as in tests/test_fused_moe.py: the CPU W4A8 kernel vs the same-scheme jnp
reference, relative Frobenius error <= 1e-4 in float32 and <= 1e-2 in bfloat16. A REFERENCE
backend runs the very reference function it is compared with, on identical values: equal.
Float experts (float32 GEMMs, SPEC §4 rounding points) vs `reference.fused_moe_float`: <= 1e-5
in float32 (summation order), <= 1e-2 in bfloat16 (a y13 / y2 rounding may flip).
"""

import ast
import logging
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import _ffi, dispatch, reference, routing
from jax_moeq.fused_moe import fused_moe
from jax_moeq.oracle import base
from jax_moeq.oracle.base import RoutingOptions
from jax_moeq.routing import RoutingMethodType as RM
from jax_moeq.weights import FloatMoEWeights, Int4MoEWeights, quantize_moe_weights

needs_cpu_library = pytest.mark.skipif(not _ffi.cpu_library_available(),
                                       reason="jax_moeq CPU library not built")
on_gpu = pytest.mark.skipif(jax.default_backend() == "gpu",
                            reason="asserts the CPU oracles' choices")
E, K, H, I = 8, 2, 128, 128
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
FLOAT_TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
GROUP = {"w4a8_int8": 64, "wna16": 64, "mxint4": 32}
SILU = 2  # the SILU kernel kind, fused_moe's default activation


@pytest.fixture(autouse=True)
def _fresh_log_once():
  base._LOGGED.clear()
  yield


def rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def float_weights(seed, *, bias=False) -> FloatMoEWeights:
  rng = np.random.default_rng(seed)
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  return FloatMoEWeights(
      f32(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)),
      f32(rng.standard_normal((E, H, I)) / np.sqrt(I)),
      f32(rng.standard_normal((E, 2 * I)) * 0.1) if bias else None,
      f32(rng.standard_normal((E, H)) * 0.1) if bias else None)


def inputs(seed, t, dtype):
  rng = np.random.default_rng(seed + 1000)
  return (jnp.asarray(rng.standard_normal((t, H)), dtype),
          jnp.asarray(rng.standard_normal((t, E)) * 2, jnp.float32))


def int4(seed, scheme, *, bias=False) -> Int4MoEWeights:
  return quantize_moe_weights(float_weights(seed, bias=bias), GROUP[scheme])


def routed_reference(scheme, x, ids, wts, w, *, on_input=False):
  """The scheme's jnp reference on already-routed tokens."""
  if scheme == "unquantized":
    return reference.fused_moe_float(x, ids, wts, w.w13, w.w2, w13_bias=w.w13_bias,
                                     w2_bias=w.w2_bias, apply_router_weight_on_input=on_input,
                                     activation_kind=SILU)
  if scheme == "w4a8_int8":
    return reference.fused_moe_w4a8(x, ids, wts, w.w13_q, w.w13_scale, w.w2_q, w.w2_scale,
                                    w.group_size, w13_bias=w.w13_bias, w2_bias=w.w2_bias,
                                    apply_router_weight_on_input=on_input, activation_kind=SILU)
  # MxInt4's arithmetic is the WNA16 reference's with group 32.
  return reference.fused_moe_wna16(x, ids, wts, w.w13_q, w.w13_scale, w.w2_q, w.w2_scale,
                                   w.group_size, w13_bias=w.w13_bias, w2_bias=w.w2_bias,
                                   apply_router_weight_on_input=on_input, activation_kind=SILU)


# ------------------------------------------------------------------ every scheme, default routing
@on_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scheme", ["unquantized", "w4a8_int8", "wna16", "mxint4"])
def test_every_scheme_through_fused_moe_matches_its_reference(scheme, dtype, caplog):
  if scheme == "w4a8_int8" and not _ffi.cpu_library_available():
    pytest.skip("jax_moeq CPU library not built")
  w = float_weights(1) if scheme == "unquantized" else int4(1, scheme)
  x, logits = inputs(2, 9, dtype)
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    out = fused_moe(x.reshape(3, 3, H), logits.reshape(3, 3, E), w, top_k=K,
                    scheme=scheme).reshape(9, H)
  backend = {"unquantized": "xla", "w4a8_int8": "cpu_int4"}.get(scheme, "reference")
  assert f"fused_moe runs {scheme} weights on backend {backend}" in caplog.text
  assert out.dtype == dtype
  if scheme == "mxint4":
    # The MxInt4 reference routes as the GPU kernel does: Renormalize is the kernel-side method
    # of softmax -> top-k -> renormalize.
    want = reference.fused_moe_mxint4(x, logits, w.w13_q, w.w13_scale, w.w2_q, w.w2_scale,
                                      top_k=K, routing_method=RM.Renormalize)
  else:
    wts, ids = routing.select_experts(logits, K, renormalize=True)
    want = routed_reference(scheme, x, ids, wts, w)
  if backend == "reference":
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  elif scheme == "unquantized":
    assert rel(out, want) <= FLOAT_TOLERANCE[dtype]
  else:
    assert rel(out, want) <= TOLERANCE[dtype]


@on_gpu
@needs_cpu_library
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scheme", ["wna16", "mxint4"])
def test_weight_only_schemes_on_the_w4a8_kernel(scheme, dtype, caplog):
  w = int4(3, scheme)
  x, logits = inputs(4, 7, dtype)
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    out = fused_moe(x, logits, w, top_k=K, scheme=scheme, allow_activation_quantization=True)
  assert "activation quantization was allowed" in caplog.text
  assert f"fused_moe runs {scheme} weights on backend cpu_int4" in caplog.text
  wts, ids = routing.select_experts(logits, K, renormalize=True)
  assert rel(out, routed_reference("w4a8_int8", x, ids, wts, w)) <= TOLERANCE[dtype]
  explicit = fused_moe(x, logits, w, top_k=K, scheme=scheme, moe_backend="cpu_int4",
                       allow_activation_quantization=True)
  np.testing.assert_array_equal(np.asarray(explicit, np.float32), np.asarray(out, np.float32))


@on_gpu
def test_weight_only_scheme_explains_the_reference_choice():
  layer = dispatch.LayerSpec(E, H, I, RoutingOptions(top_k=K), in_dtype=jnp.float32,
                             platform="cpu")
  choice = dispatch.choose_experts("wna16", layer, group_size=64)
  assert choice.name == "reference" and choice.scheme == "wna16"
  assert "no WNA16 kernel exists for platform 'cpu'" in choice.reason
  assert "allow_activation_quantization=True allows it" in choice.reason
  # Activation quantization allowed, but the W4A8 kernel does not fit (H=72): the reference,
  # with both reasons.
  odd = dispatch.LayerSpec(E, 72, 48, RoutingOptions(top_k=K), in_dtype=jnp.float32,
                           platform="cpu")
  choice = dispatch.choose_experts("wna16", odd, group_size=-1,
                                   allow_activation_quantization=True)
  assert choice.name == "reference" and choice.scheme == "wna16"
  assert "the W4A8 kernel does not fit since H=72 and I=48 must be multiples of 16" in (
      choice.reason)


# ------------------------------------------------------------------ routing options
ROUTINGS = {
    "grouped_sigmoid_bias": dict(scoring_func="sigmoid", use_grouped_topk=True,
                                 num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
    "no_renormalize": dict(renormalize=False),
    "sigmoid": dict(scoring_func="sigmoid"),
    "scaled_softmax": dict(routed_scaling_factor=1.5),
}


@on_gpu
@pytest.mark.parametrize("route", sorted(ROUTINGS))
@pytest.mark.parametrize("scheme", ["unquantized", "w4a8_int8", "wna16", "mxint4"])
def test_routing_options_on_every_scheme(scheme, route):
  if scheme == "w4a8_int8" and not _ffi.cpu_library_available():
    pytest.skip("jax_moeq CPU library not built")
  w = float_weights(5) if scheme == "unquantized" else int4(5, scheme)
  x, logits = inputs(6, 11, jnp.float32)
  opts = dict(ROUTINGS[route])
  bias = None
  if opts.get("use_grouped_topk"):
    bias = jnp.asarray(np.random.default_rng(7).standard_normal(E) * 0.1, jnp.float32)
  out = fused_moe(x, logits, w, top_k=K, scheme=scheme, e_score_correction_bias=bias, **opts)
  wts, ids = routing.select_experts(logits, K, renormalize=opts.pop("renormalize", True),
                                    e_score_correction_bias=bias, **opts)
  want = routed_reference(scheme, x, ids, wts, w)
  tolerance = FLOAT_TOLERANCE if scheme == "unquantized" else TOLERANCE
  assert rel(out, want) <= tolerance[jnp.float32]


@on_gpu
@pytest.mark.parametrize("scheme", ["unquantized", "w4a8_int8", "wna16"])
def test_router_weight_on_input_and_biases(scheme):
  if scheme == "w4a8_int8" and not _ffi.cpu_library_available():
    pytest.skip("jax_moeq CPU library not built")
  w = float_weights(8, bias=True) if scheme == "unquantized" else int4(8, scheme, bias=True)
  x, logits = inputs(9, 6, jnp.bfloat16)
  out = fused_moe(x, logits, w, top_k=K, scheme=scheme, renormalize=False,
                  apply_router_weight_on_input=True)
  wts, ids = routing.select_experts(logits, K, renormalize=False)
  want = routed_reference(scheme, x, ids, wts, w, on_input=True)
  tolerance = FLOAT_TOLERANCE if scheme == "unquantized" else TOLERANCE
  assert rel(out, want) <= tolerance[jnp.bfloat16]


def test_kernel_routing_methods():
  ro = lambda **kw: RoutingOptions(top_k=2, **kw)
  assert ro().kernel_routing_method == RM.Renormalize
  assert ro().routing_method == RM.RenormalizeNaive
  assert ro(renormalize=False).kernel_routing_method == RM.Default
  assert ro(routed_scaling_factor=2.0).kernel_routing_method is None
  assert ro(scoring_func="sigmoid").kernel_routing_method is None
  grouped = dict(scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=4, topk_group=2)
  assert ro(**grouped, has_correction_bias=True).kernel_routing_method == RM.DeepSeekV3
  assert ro(**grouped).kernel_routing_method is None  # no bias: the group score differs
  assert ro(**grouped, has_correction_bias=True, renormalize=False).kernel_routing_method is None
  with pytest.raises(ValueError, match="only used with use_grouped_topk=True"):
    ro(has_correction_bias=True)
  with pytest.raises(TypeError, match="top_k must be an int"):
    RoutingOptions(top_k=2.0)
  with pytest.raises(ValueError, match="must be an \\[E\\] array"):
    ro(**grouped, has_correction_bias=True).select(jnp.ones((3, 8)))


# ------------------------------------------------------------------ explicit backends and errors
def test_explicit_backends_that_do_not_fit_raise_with_the_reason():
  w = int4(10, "wna16")
  m = int4(10, "mxint4")
  x, logits = inputs(11, 3, jnp.bfloat16)
  run = lambda weights, **kw: fused_moe(x, logits, weights, top_k=K, **kw)
  if jax.default_backend() == "cpu":
    with pytest.raises(ValueError, match="WNA16 MoE backend MARLIN .* platform 'cpu'"):
      run(w, scheme="wna16", moe_backend="marlin")
    with pytest.raises(ValueError, match="MxInt4 MoE backend HOPPER_MXINT4 .* platform 'cpu'"):
      run(m, scheme="mxint4", moe_backend="mxint4_gpu")
  with pytest.raises(ValueError, match="allow_activation_quantization=True"):
    run(w, scheme="wna16", moe_backend="cpu_int4")
  with pytest.raises(ValueError, match="moe_backend='marlin' is not supported for W4A8 Int8"):
    run(w, moe_backend="marlin")
  with pytest.raises(ValueError, match="scheme='mxint4' uses group_size=32"):
    run(w, scheme="mxint4")
  with pytest.raises(ValueError, match="scheme='wna16' does not apply to FloatMoEWeights"):
    run(float_weights(10), scheme="wna16")
  with pytest.raises(ValueError, match="scheme='int3' does not apply to Int4MoEWeights"):
    run(w, scheme="int3")
  with pytest.raises(NotImplementedError, match="MxInt4 experts have no biases"):
    run(int4(10, "mxint4", bias=True), scheme="mxint4")
  with pytest.raises(ValueError, match="float_impl='dense' applies to unquantized weights"):
    dispatch.choose_experts("wna16", dispatch.LayerSpec(E, H, I, RoutingOptions(top_k=K)),
                            group_size=64, float_impl="dense")


@on_gpu
def test_weight_only_schemes_under_jit():
  for scheme in ("wna16", "mxint4"):
    w = int4(12, scheme)
    x, logits = inputs(13, 5, jnp.bfloat16)
    run = jax.jit(lambda x, l, w: fused_moe(x, l, w, top_k=K, scheme=scheme))
    np.testing.assert_array_equal(np.asarray(run(x, logits, w), np.float32),
                                  np.asarray(fused_moe(x, logits, w, top_k=K, scheme=scheme),
                                             np.float32))


# ------------------------------------------------------------------ blocks and fused_moe agree
@pytest.mark.parametrize("scheme", ["unquantized", "w4a8_int8", "wna16", "mxint4"])
def test_blocks_and_fused_moe_choose_and_compute_alike(scheme):
  if scheme == "w4a8_int8" and not _ffi.cpu_library_available():
    pytest.skip("jax_moeq CPU library not built")
  from jax_moeq.nn import MoE, QuantizedMoE
  x, logits = inputs(14, 6, jnp.float32)
  if scheme == "unquantized":
    w = float_weights(15, bias=True)
    block = MoE(E, K, H, I, use_bias=True, router=False, dtype=jnp.float32, weights=w)
    backend = "xla"
  else:
    w = int4(15, scheme)
    block = QuantizedMoE(E, K, H, I, router=False, dtype=jnp.float32, scheme=scheme,
                         group_size=GROUP[scheme], weights=w)
    backend = block.backend
  layer = dispatch.LayerSpec(E, H, I, RoutingOptions(top_k=K), has_bias=scheme == "unquantized",
                             in_dtype=jnp.float32)
  choice = dispatch.choose_experts(scheme, layer, group_size=GROUP.get(scheme))
  assert choice.name == backend == block.experts.backend_name
  np.testing.assert_array_equal(np.asarray(block(x, router_logits=logits)),
                                np.asarray(fused_moe(x, logits, w, top_k=K, scheme=scheme)))


# ------------------------------------------------------------------ the import graph
MY_PACKAGES = ("jax_moeq.nn", "jax_moeq.experts", "jax_moeq.oracle")
MY_MODULES = ("jax_moeq.dispatch", "jax_moeq.fused_moe", "jax_moeq.weights", "jax_moeq.sharding")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
  """Every jax_moeq module `path` imports, at any depth (function-level imports included)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        out.add(sub if sub in modules else node.module)
  # The root package's __init__ re-exports everything; importing a submodule is not a cycle.
  return {m for m in out if m in modules and m != "jax_moeq"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycle_through_the_dispatch_modules():
  paths = {_module_name(p): p for p in (ROOT / "jax_moeq").rglob("*.py")}
  graph = {m: _imports(p, set(paths)) for m, p in paths.items()}
  mine = lambda m: m in MY_MODULES or m.startswith(MY_PACKAGES)
  cycles = [c for c in _cycles(graph) if any(mine(m) for m in c)]
  assert not cycles, f"import cycles: {cycles}"
  assert "jax_moeq.nn._backends" not in paths and "jax_moeq.nn._oracle_bridge" not in paths
  # The blocks reach the kernels through the dispatch only.
  assert "jax_moeq.dispatch" in graph["jax_moeq.nn.moe"]
  assert "jax_moeq.dispatch" in graph["jax_moeq.fused_moe"]


@pytest.mark.parametrize("module", ["jax_moeq.nn.moe", "jax_moeq.experts.mxint4",
                                    "jax_moeq.oracle.wna16"])
def test_modules_import_first_in_a_fresh_interpreter(module):
  code = f"import {module}, jax_moeq.dispatch as d; assert d.choose_experts"
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                               "PATH": "/usr/bin:/bin"}, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]


# ------------------------------------------------------------------ GPU backends (Hopper)
def _gpu_ready() -> bool:
  if jax.default_backend() != "gpu":
    return False
  cc = _ffi.cuda_compute_capability()
  return cc is not None and cc >= (9, 0) and _ffi.cuda_library_available()


needs_hopper = pytest.mark.skipif(not _gpu_ready(),
                                  reason="needs a Hopper GPU and jax_moeq's CUDA library")
GH, GI = 256, 256  # multiples of 64, as the GPU kernels need


def gpu_case(seed, group_size, t=7):
  rng = np.random.default_rng(seed)
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.float32)
  w = quantize_moe_weights(FloatMoEWeights(f32(E, 2 * GI, GH), f32(E, GH, GI)), group_size)
  x = jnp.asarray(rng.standard_normal((t, GH)), jnp.bfloat16)
  logits = jnp.asarray(rng.standard_normal((t, E)) * 2, jnp.float32)
  return w, x, logits


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("scheme,group_size,act_order", [("wna16", 128, False),
                                                         ("wna16", -1, False),
                                                         ("wna16", 64, True),
                                                         ("mxint4", 32, False)])
def test_gpu_fused_moe_matches_reference(scheme, group_size, act_order, caplog):
  w, x, logits = gpu_case(20, group_size)
  if act_order:  # a GPTQ desc_act layer: random per-expert input orders on both GEMMs
    r = np.random.default_rng(21)
    perm = lambda k: jnp.asarray(np.stack([r.permutation(np.arange(k) // group_size)
                                           for _ in range(E)]), jnp.int32)
    w = Int4MoEWeights(w.w13_q, w.w13_scale, w.w2_q, w.w2_scale, group_size,
                       w13_g_idx=perm(GH), w2_g_idx=perm(GI))
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    out = jax.jit(lambda x, l, w: fused_moe(x, l, w, top_k=K, scheme=scheme))(x, logits, w)
  backend = {"wna16": "marlin", "mxint4": "mxint4_gpu"}[scheme]
  assert f"fused_moe runs {scheme} weights on backend {backend}" in caplog.text
  want = fused_moe(x, logits, w, top_k=K, scheme=scheme, moe_backend="reference")
  assert out.shape == x.shape and out.dtype == jnp.bfloat16
  assert rel(out, want) <= TOLERANCE[jnp.bfloat16]


@pytest.mark.gpu
@needs_hopper
def test_gpu_mxint4_grouped_routing_with_correction_bias():
  """DeepSeek-V3 routing (grouped sigmoid, correction bias, renormalized, scaled) is the
  kernel's DeepSeekV3 method: fused_moe and the block pass the bias to the kernel."""
  from jax_moeq.nn import QuantizedMoE
  w, x, logits = gpu_case(22, 32)
  bias = jnp.asarray(np.random.default_rng(23).standard_normal(E) * 0.1, jnp.float32)
  route = dict(scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=4, topk_group=2,
               routed_scaling_factor=2.5)
  out = fused_moe(x, logits, w, top_k=K, scheme="mxint4", e_score_correction_bias=bias, **route)
  want = fused_moe(x, logits, w, top_k=K, scheme="mxint4", e_score_correction_bias=bias,
                   moe_backend="reference", **route)
  assert rel(out, want) <= TOLERANCE[jnp.bfloat16]
  block = QuantizedMoE(E, K, GH, GI, router=False, scheme="mxint4", group_size=32,
                       e_score_correction_bias=True, correction_bias=bias, weights=w, **route)
  assert block.backend == "mxint4_gpu", block.backend_reason
  np.testing.assert_array_equal(np.asarray(block(x, router_logits=logits), np.float32),
                                np.asarray(out, np.float32))


@pytest.mark.gpu
@needs_hopper
def test_gpu_mxint4_routing_without_a_kernel_method_runs_the_reference():
  w, x, logits = gpu_case(24, 32)
  out = fused_moe(x, logits, w, top_k=K, scheme="mxint4", scoring_func="sigmoid")
  wts, ids = routing.select_experts(logits, K, renormalize=True, scoring_func="sigmoid")
  np.testing.assert_array_equal(
      np.asarray(out, np.float32),
      np.asarray(routed_reference("mxint4", x, ids, wts, w), np.float32))
  with pytest.raises(ValueError, match="HOPPER_MXINT4 .* no kernel-side routing method"):
    fused_moe(x, logits, w, top_k=K, scheme="mxint4", scoring_func="sigmoid",
              moe_backend="mxint4_gpu")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("biases", ["both", "w13_only"])
def test_gpu_marlin_with_biases(biases):
  w, x, logits = gpu_case(25, 64)
  r = np.random.default_rng(26)
  b13 = jnp.asarray(r.standard_normal((E, 2 * GI)) * 0.1, jnp.float32)
  b2 = jnp.asarray(r.standard_normal((E, GH)) * 0.1, jnp.float32) if biases == "both" else None
  w = Int4MoEWeights(w.w13_q, w.w13_scale, w.w2_q, w.w2_scale, 64, b13, b2)
  layer = dispatch.LayerSpec(E, GH, GI, RoutingOptions(top_k=K), has_bias=True)
  assert dispatch.choose_experts("wna16", layer, group_size=64).name == "marlin"
  out = fused_moe(x, logits, w, top_k=K, scheme="wna16")
  want = fused_moe(x, logits, w, top_k=K, scheme="wna16", moe_backend="reference")
  assert rel(out, want) <= TOLERANCE[jnp.bfloat16]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("scheme,group_size,act_order", [("wna16", 128, False),
                                                         ("wna16", -1, False),
                                                         ("wna16", 64, True),
                                                         ("mxint4", 32, False)])
def test_gpu_blocks_match_reference(scheme, group_size, act_order):
  """The Flax blocks on the GPU kernels vs the same blocks on the reference (tests/test_nn.py
  holds the blocks' CPU suite, skipped on GPU machines)."""
  from flax import nnx
  from jax_moeq.nn import MoE, QuantizedMoE, moe_from_checkpoint_layer
  h, i = GH, GI
  moe = MoE(E, K, h, i, dtype=jnp.bfloat16, rngs=nnx.Rngs(50))
  if act_order:
    # A GPTQ desc_act layer: random per-expert input orders on both GEMMs.
    layer = QuantizedMoE.from_float(moe, scheme="wna16", group_size=group_size,
                                    moe_backend="reference").canonical_int4().to_layer()
    r = np.random.default_rng(51)
    layer.w13_g_idx = np.stack([r.permutation(np.arange(h) // group_size) for _ in range(E)])
    layer.w2_g_idx = np.stack([r.permutation(np.arange(i) // group_size) for _ in range(E)])
    layer.router_weight = np.asarray(moe.router.kernel[...]).T
    fast = moe_from_checkpoint_layer(layer, K, scheme=scheme, dtype=jnp.bfloat16)
    slow = moe_from_checkpoint_layer(layer, K, scheme=scheme, moe_backend="reference",
                                     dtype=jnp.bfloat16)
  else:
    fast = QuantizedMoE.from_float(moe, scheme=scheme, group_size=group_size)
    slow = QuantizedMoE.from_float(moe, scheme=scheme, group_size=group_size,
                                   moe_backend="reference")
  assert fast.backend == {"wna16": "marlin", "mxint4": "mxint4_gpu"}[scheme], fast.backend_reason
  assert slow.backend == "reference"
  x = jax.random.normal(jax.random.key(52), (3, 7, h), jnp.bfloat16)
  y = nnx.jit(lambda m, x: m(x))(fast, x)
  assert y.shape == x.shape and y.dtype == jnp.bfloat16
  assert rel(y, slow(x)) <= TOLERANCE[jnp.bfloat16]  # SPEC §9 bf16, same scheme


@pytest.mark.parametrize("impl", ["auto", "gather", "dense", "ragged_dot"])
def test_float_experts_on_zero_tokens(impl):
  w = float_weights(27)
  x, logits = jnp.zeros((0, H), jnp.bfloat16), jnp.zeros((0, E), jnp.float32)
  layer = dispatch.LayerSpec(E, H, I, RoutingOptions(top_k=K), in_dtype=jnp.bfloat16)
  experts = dispatch.choose_experts("unquantized", layer, float_impl=impl).experts
  out = experts.apply(x, logits, experts.prepare(w), layer.routing)
  assert out.shape == (0, H) and out.dtype == jnp.bfloat16
  assert fused_moe(x, logits, w, top_k=K).shape == (0, H)
