"""GPU MxInt4 fused MoE (routing inside) vs `reference.fused_moe_mxint4` (SPEC §5, §8, §9).
Skipped without a CUDA GPU of compute capability >= 9.0 and our CUDA library.

Reference: same rounding points as the kernel (weights round(q·s) in bf16, f32 accumulation,
y13 / activation / weighted y2 rounded to bf16, f32 sum over k rounded once). Tolerance: rel.
Frobenius <= 2^-8, one bf16 ulp, tighter than SPEC §9's 1e-2: the differences are f32
summation order and the rare 1-ulp flips it causes at the rounding points. Routing: the GPU ids
must equal `routing.route`'s exactly (random f32 logits have no near-ties at the f32 rounding
level of the scores), and the weights agree to 1e-5 relative (expf / division rounding).
"""

import _helpers
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moeq import reference, routing
from jax_moeq.ops import _gpu_launch, mxint4_gpu
from jax_moeq.quant import int4
from jax_moeq.routing import RoutingMethodType as RM

pytestmark = pytest.mark.gpu


_REASON = _helpers.cuda_skip_reason(mxint4_gpu.is_mxint4_moe_available)
if _REASON:
  pytest.skip(_REASON, allow_module_level=True)

# Against the reference: every path dequantizes and rounds where the reference does (groups of
# 32 never take the GEMM kernels' folded loop), so only f32 summation order differs and its rare
# 1-ulp flips at rounding points: well under one bf16 ulp (measured on the H100 on 2026-11-24,
# commit d8f3247: at most 6.2e-4 over this file).
TOL = 2.0**-8
# The sum of expert-parallel ranks' outputs against the full layer: each rank rounds its partial
# sum to bf16 once, so R roundings against one (SPEC §9's bf16 bound).
RANK_SUM_TOL = 1e-2


def _rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _experts(seed, e, h, i, packing="uint8"):
  """Random signed int4 experts with bf16 scales per 32, in seed format and canonical form."""
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  q13 = jax.random.randint(k[0], (e, 2 * i, h), -8, 8, jnp.int32).astype(jnp.int8)
  q2 = jax.random.randint(k[1], (e, h, i), -8, 8, jnp.int32).astype(jnp.int8)
  # |w| ~ 1/sqrt(in) keeps activations O(1) through both GEMMs (|q| ~ 4.6 on average).
  s13 = (jax.random.uniform(k[2], (e, 2 * i, h // 32), jnp.float32, 0.5, 1.5)
         / (4.6 * np.sqrt(h))).astype(jnp.bfloat16)
  s2 = (jax.random.uniform(k[3], (e, h, i // 32), jnp.float32, 0.5, 1.5)
        / (4.6 * np.sqrt(i))).astype(jnp.bfloat16)
  if packing == "uint8":
    g1, g2 = mxint4_gpu.int8_to_signed_nibbles(q13), mxint4_gpu.int8_to_signed_nibbles(q2)
  else:
    g1, g2 = int4.pack_uint4b8_ct(q13), int4.pack_uint4b8_ct(q2)
  prepared = mxint4_gpu.prepare_static_weights_for_mxint4_moe(g1, s13, g2, s2)
  return prepared, (q13, s13, q2, s2)


def _inputs(seed, t, e, h):
  k = jax.random.split(jax.random.PRNGKey(1000 + seed), 3)
  x = jax.random.normal(k[0], (t, h), jnp.float32).astype(jnp.bfloat16)
  logits = jax.random.normal(k[1], (t, e), jnp.float32) * 2.0
  bias = jax.random.uniform(k[2], (e,), jnp.float32, -0.2, 0.2)
  return x, logits, bias


def _routing_kwargs(method, e, k, bias):
  if method == RM.DeepSeekV3:
    groups = 8 if e % 8 == 0 and e // 8 >= 2 else 1
    return dict(num_expert_group=groups, topk_group=min(groups, max(1, -(-k // (e // groups)) + 1)),
                e_score_correction_bias=bias, routed_scaling_factor=2.5)
  if method == RM.MiniMax2:
    return dict(e_score_correction_bias=bias, routed_scaling_factor=1.5)
  return {}


def _run(prepared, x, logits, *, e, k, i, local=None, ep_rank=0, out_init=None, **kw):
  local = e if local is None else local
  sl = slice(ep_rank * local, (ep_rank + 1) * local)
  args = [prepared[n][sl] for n in mxint4_gpu.WEIGHT_KEYS]
  fn = jax.jit(lambda x, l, *a, o=None: mxint4_gpu.mxint4_moe_with_routing(
      x, l, *a, num_experts=e, top_k=k, intermediate_size=i, local_num_experts=local,
      ep_rank=ep_rank, out_init=o, **kw))
  return fn(x, logits, *args, o=out_init)


def _run_poisoned(prepared, x, logits, what="", **kw):
  """_run into a NaN-poisoned output; fails if any output element was left unwritten."""
  poison = jnp.full(x.shape, jnp.nan, jnp.bfloat16)
  out, ids, w = _run(prepared, x, logits, out_init=poison, **kw)
  assert bool(jnp.isfinite(out.astype(jnp.float32)).all()), f"{what}unwritten (NaN) outputs"
  return out, ids, w


def _reference(canon, x, logits, *, e, k, local=None, ep_rank=0, routing_method, **kw):
  local = e if local is None else local
  sl = slice(ep_rank * local, (ep_rank + 1) * local)
  q13, s13, q2, s2 = (a[sl] for a in canon)
  return reference.fused_moe_mxint4(x, logits, q13, s13, q2, s2, top_k=k,
                                    routing_method=routing_method,
                                    local_expert_offset=ep_rank * local, local_num_experts=local,
                                    **kw)


@pytest.mark.parametrize("t", [1, 16, 64, 257, 1024])
def test_matches_reference_over_tokens(t):
  e, k, h, i = 32, 4, 512, 256
  prepared, canon = _experts(t, e, h, i, packing="int32" if t % 2 else "uint8")
  x, logits, _ = _inputs(t, t, e, h)
  out, ids, w = _run_poisoned(prepared, x, logits, e=e, k=k, i=i, routing_method=RM.Renormalize)
  ref = _reference(canon, x, logits, e=e, k=k, routing_method=RM.Renormalize)
  assert _rel(out, ref) <= TOL
  ref_w, ref_ids = routing.route(logits, k, RM.Renormalize)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", [RM.Default, RM.Renormalize, RM.DeepSeekV3, RM.Llama4,
                                    RM.RenormalizeNaive, RM.TopK, RM.SigmoidRenorm,
                                    RM.MiniMax2, RM.Sigmoid])
@pytest.mark.parametrize("e", [64, 256])
@pytest.mark.parametrize("t", [1, 96])
def test_every_routing_method(method, e, t):
  """Also at T = 1, where the call takes the one-token path (no alignment; GEMM2 reads the
  routing's local ids and weights and finalizes)."""
  h, i = 256, 128
  k = 1 if method == RM.Llama4 else 6
  if t == 1:
    assert _gpu_launch.decodes_without_alignment(1, 8)
  prepared, canon = _experts(int(method) + e, e, h, i)
  x, logits, bias = _inputs(int(method), t, e, h)
  kw = _routing_kwargs(method, e, k, bias)
  out, ids, w = _run(prepared, x, logits, e=e, k=k, i=i, routing_method=method, **kw)
  ref_w, ref_ids = routing.route(logits, k, method, **kw)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-5, atol=1e-6)
  ref = _reference(canon, x, logits, e=e, k=k, routing_method=method, **kw)
  assert _rel(out, ref) <= TOL


def test_bf16_router_logits():
  e, k, h, i, t = 64, 4, 256, 128, 40
  prepared, canon = _experts(7, e, h, i)
  x, logits, _ = _inputs(7, t, e, h)
  logits = logits.astype(jnp.bfloat16)
  out, ids, _ = _run(prepared, x, logits, e=e, k=k, i=i, routing_method=RM.RenormalizeNaive)
  _, ref_ids = routing.route(logits, k, RM.RenormalizeNaive)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  ref = _reference(canon, x, logits, e=e, k=k, routing_method=RM.RenormalizeNaive)
  assert _rel(out, ref) <= TOL


@pytest.mark.parametrize("block_m", [8, 16])
@pytest.mark.parametrize("name,e,k,h,i,t", [
    ("Qwen3-30B-A3B", 128, 8, 2048, 768, 16), ("DeepSeek-V2-Lite", 64, 6, 2048, 1408, 9)])
def test_async_ring_and_registers_same_bits(name, e, k, h, i, t, block_m, monkeypatch):
  """Without split-K (deterministic mode) the async ring (MxInt4's main loop at block_m <= 16) and
  the register loop compute each output element in one warp in the same order: the same bits."""
  monkeypatch.setenv("JAX_MOEQ_DETERMINISTIC", "1")
  prepared, canon = _experts(t + e, e, h, i)
  x, logits, _ = _inputs(t + 2, t, e, h)
  ring, _, _ = _run_poisoned(prepared, x, logits, f"{name}: ", e=e, k=k, i=i,
                             routing_method=RM.Renormalize, block_m=block_m,
                             mainloop="async_ring")
  assert _rel(ring, _reference(canon, x, logits, e=e, k=k,
                               routing_method=RM.Renormalize)) <= TOL
  registers, _, _ = _run(prepared, x, logits, e=e, k=k, i=i, routing_method=RM.Renormalize,
                         block_m=block_m, mainloop="registers")
  np.testing.assert_array_equal(np.asarray(ring), np.asarray(registers))


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_ranks_sum_to_full(ranks):
  e, k, h, i, t = 64, 6, 256, 128, 50
  prepared, canon = _experts(ranks, e, h, i)
  x, logits, bias = _inputs(ranks, t, e, h)
  kw = _routing_kwargs(RM.DeepSeekV3, e, k, bias)
  full, _, _ = _run(prepared, x, logits, e=e, k=k, i=i, routing_method=RM.DeepSeekV3, **kw)
  local = e // ranks
  total = jnp.zeros((t, h), jnp.float32)
  for r in range(ranks):
    part, _, _ = _run_poisoned(prepared, x, logits, f"rank {r}: ", e=e, k=k, i=i, local=local,
                               ep_rank=r, routing_method=RM.DeepSeekV3, **kw)
    ref = _reference(canon, x, logits, e=e, k=k, local=local, ep_rank=r,
                     routing_method=RM.DeepSeekV3, **kw)
    assert _rel(part, ref) <= TOL
    total = total + part.astype(jnp.float32)
  # Each rank rounds its partial sum to bf16 once: the sum stays within bf16 tolerance.
  assert _rel(total, full) <= RANK_SUM_TOL


def test_vmap_of_token_sets_matches_separate_calls():
  """vmap folds B token sets sharing the weights into one call of B*T tokens (_token_batching):
  within one bf16 ulp per element of separate calls (other launch choices, other f32 order)."""
  e, k, h, i, b, t = 16, 2, 256, 128, 4, 3
  prepared, _ = _experts(5, e, h, i)
  inputs = [_inputs(30 + j, t, e, h) for j in range(b)]
  xs = jnp.stack([v[0] for v in inputs])
  logits = jnp.stack([v[1] for v in inputs])
  w = [prepared[n] for n in mxint4_gpu.WEIGHT_KEYS]
  op = lambda x, lg: mxint4_gpu.mxint4_moe(x, lg, *w, num_experts=e, top_k=k, intermediate_size=i,
                                            local_num_experts=e)
  got = jax.jit(jax.vmap(op))(xs, logits)
  want = jnp.stack([op(xs[j], logits[j]) for j in range(b)])
  assert got.shape == (b, t, h)
  assert _rel(got, want) <= 5e-3  # one bf16 ulp is 2^-8 relative


@pytest.mark.parametrize("launch", [{}, dict(block_m=32, mainloop="wgmma"), dict(block_m=128),
                                    dict(block_m=32, mainloop="wgmma_ws")],
                         ids=["auto", "wgmma32", "wgmma128", "wgmma_ws32"])
def test_tokens_without_a_local_expert_are_zero(launch):
  """Aligned path: a token none of whose experts is on this rank has no GEMM2 row; the finalize
  still writes its output row, as zeros (NaN-poisoned here). The wgmma tiles' GEMM2 writes
  rounded rows that another finalize sums."""
  e, k, h, i, t, ranks, rank = 64, 2, 256, 128, 32, 8, 3
  prepared, canon = _experts(7, e, h, i)
  x, logits, _ = _inputs(7, t, e, h)
  local = e // ranks
  out, ids, _ = _run_poisoned(prepared, x, logits, e=e, k=k, i=i, local=local, ep_rank=rank,
                              routing_method=RM.Renormalize, **launch)
  ids = np.asarray(ids)
  on_rank = ((ids >= rank * local) & (ids < (rank + 1) * local)).any(axis=1)
  assert on_rank.any() and not on_rank.all()  # both kinds of token occur
  assert (np.asarray(out.astype(jnp.float32))[~on_rank] == 0).all()
  ref = _reference(canon, x, logits, e=e, k=k, local=local, ep_rank=rank,
                   routing_method=RM.Renormalize)
  assert _rel(out, ref) <= TOL


@pytest.mark.parametrize("launch", [{}, dict(block_m=32, mainloop="wgmma"),
                                    dict(block_m=64, mainloop="wgmma_ws")],
                         ids=["auto", "wgmma32", "wgmma_ws64"])
def test_prefill_alignment_over_several_ctas(launch):
  """From 8192 pairs the alignment counts and places its pairs over several CTAs (here three, the
  last partial); on one EP rank half the pairs have no local expert."""
  e, k, h, i, t, ranks, rank = 64, 8, 256, 128, 1100, 2, 1
  prepared, canon = _experts(19, e, h, i)
  x, logits, _ = _inputs(19, t, e, h)
  local = e // ranks
  out, _, _ = _run_poisoned(prepared, x, logits, e=e, k=k, i=i, local=local, ep_rank=rank,
                            routing_method=RM.Renormalize, **launch)
  ref = _reference(canon, x, logits, e=e, k=k, local=local, ep_rank=rank,
                   routing_method=RM.Renormalize)
  assert _rel(out, ref) <= TOL


@pytest.mark.parametrize("name,e,k,h,i,method", [
    ("Qwen3-30B-A3B", 128, 8, 2048, 768, RM.RenormalizeNaive),
    ("DeepSeek-V2-Lite", 64, 6, 2048, 1408, RM.Default),
])
@pytest.mark.parametrize("t", [1, 64, 257])
def test_model_shapes(name, e, k, h, i, method, t):
  prepared, canon = _experts(t + e, e, h, i)
  x, logits, _ = _inputs(t, t, e, h)
  out, _, _ = _run_poisoned(prepared, x, logits, f"{name}: ", e=e, k=k, i=i,
                            routing_method=method)
  ref = _reference(canon, x, logits, e=e, k=k, routing_method=method)
  assert _rel(out, ref) <= TOL


@pytest.mark.parametrize("block_m,mainloop", [
    (8, "registers"), (16, "registers"), (32, "registers"), (64, "registers"),
    (8, "async_ring"), (16, "async_ring"), (32, "async_ring"), (8, "bulk_copy"),
    (16, "bulk_copy"), (128, "registers"), (32, "wgmma"), (64, "wgmma"), (32, "wgmma_ws"),
    (64, "wgmma_ws"), (128, "wgmma_ws")])
def test_block_sizes(block_m, mainloop):
  e, k, h, i, t = 16, 2, 256, 192, 100
  prepared, canon = _experts(block_m, e, h, i)
  x, logits, _ = _inputs(block_m, t, e, h)
  out, _, _ = _run_poisoned(prepared, x, logits, e=e, k=k, i=i, routing_method=RM.TopK,
                            block_m=block_m, mainloop=mainloop)
  ref = _reference(canon, x, logits, e=e, k=k, routing_method=RM.TopK)
  assert _rel(out, ref) <= TOL


@pytest.mark.parametrize("name,e,k,h,i,t", [
    ("Qwen3-30B-A3B", 128, 8, 2048, 768, 1024),
    ("DeepSeek-V2-Lite", 64, 6, 2048, 1408, 257),
    ("odd units", 8, 2, 320, 192, 300)])
def test_wgmma_prefill(name, e, k, h, i, t):
  """The wgmma GEMM (block_m 128) on model shapes, several 128-row blocks per expert, and on
  I/64 odd with H % 128 == 64 (idle warpgroup, second tile past N); also vs block_m 32."""
  prepared, canon = _experts(t + 3, e, h, i)
  x, logits, _ = _inputs(t + 3, t, e, h)
  out, _, _ = _run_poisoned(prepared, x, logits, f"{name}: ", e=e, k=k, i=i,
                            routing_method=RM.Renormalize, block_m=128)
  ref = _reference(canon, x, logits, e=e, k=k, routing_method=RM.Renormalize)
  assert _rel(out, ref) <= TOL
  small, _, _ = _run(prepared, x, logits, e=e, k=k, i=i, routing_method=RM.Renormalize,
                     block_m=32)
  assert _rel(out, small) <= 5e-3  # same rounding points; f32 summation order only


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("mainloop,fused_decode", [("registers", False), ("async_ring", False),
                                                   (None, True), ("stream", False)],
                         ids=["registers", "async_ring", "fused", "stream"])
@pytest.mark.parametrize("h", [256, 2048])
def test_one_token_decode_path(ranks, mainloop, fused_decode, h):
  """T = 1 takes the decode path without alignment (_gpu_launch.decodes_without_alignment): each
  pair its own block, GEMM2 (split, I = 1024) finalizes. H = 256 (4 chunks) keeps GEMM1 unsplit;
  H = 2048 splits it 8 ways, and its last split per 16 columns applies the activation. Under
  expert parallelism a rank's foreign pairs are blocks that compute nothing but still count; a
  rank may hold none of the token's experts (output 0). Against the reference per rank, the
  ranks' sum against the full layer, and the aligned path (block_m 16). fused_decode: routing,
  then the layer as one kernel (moe_int4_decode.cuh); stream: routing, then the two streaming
  kernels (moe_int4_one_token.cuh)."""
  e, k, i = 16, 4, 1024
  local = e // ranks
  split13, _ = _gpu_launch.choose_gemm_splits(min(local, k), h, i, 8, k)
  assert _gpu_launch.decodes_without_alignment(1, 8)
  assert (split13 > 1) == (h == 2048)
  prepared, canon = _experts(40 + ranks, e, h, i)
  x, logits, _ = _inputs(40 + ranks, 1, e, h)
  full, _, _ = _run(prepared, x, logits, e=e, k=k, i=i, routing_method=RM.Renormalize,
                    block_m=16)
  total = jnp.zeros((1, h), jnp.float32)
  for r in range(ranks):
    part, _, _ = _run_poisoned(prepared, x, logits, f"rank {r}: ", e=e, k=k, i=i, local=local,
                               ep_rank=r, routing_method=RM.Renormalize, block_m=8,
                               mainloop=mainloop, fused_decode=fused_decode)
    ref = _reference(canon, x, logits, e=e, k=k, local=local, ep_rank=r,
                     routing_method=RM.Renormalize)
    if float(jnp.abs(ref.astype(jnp.float32)).max()) == 0.0:  # no expert of this rank was hit
      assert bool(jnp.all(part.astype(jnp.float32) == 0.0))
    else:
      assert _rel(part, ref) <= TOL
    total = total + part.astype(jnp.float32)
  assert _rel(total, full) <= RANK_SUM_TOL  # each rank rounds its partial sum to bf16 once
  if ranks == 1:  # same products as the aligned path; the f32 atomics add in another order
    assert _rel(total, full) <= 2.0**-8


@pytest.mark.parametrize("t", [1, 16])
def test_async_ring_on_decode_shapes(t):
  """The cp.async main loop (block_m 8/16) on a Qwen3-30B-A3B-shaped layer, split-K included."""
  e, k, h, i = 128, 8, 2048, 768
  prepared, canon = _experts(t + 5, e, h, i)
  x, logits, _ = _inputs(t + 5, t, e, h)
  out, _, _ = _run_poisoned(prepared, x, logits, e=e, k=k, i=i, routing_method=RM.Renormalize,
                            mainloop="async_ring")
  ref = _reference(canon, x, logits, e=e, k=k, routing_method=RM.Renormalize)
  assert _rel(out, ref) <= TOL


def test_handler_rejects_bad_buffers():
  """The FFI handler's own checks (bypassing Python validation) return an error."""
  from jax_moeq import _ffi
  _ffi.cuda_library()
  e, k, h, i, t = 8, 2, 128, 64, 4
  prepared, _ = _experts(0, e, h, i)
  x, logits, _ = _inputs(0, t, e, h)
  results = [jax.ShapeDtypeStruct((t, h), jnp.bfloat16),
             jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.float32),
             jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((256,), jnp.int32),
             jax.ShapeDtypeStruct((32,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
             jax.ShapeDtypeStruct((t * k * i,), jnp.bfloat16),
             jax.ShapeDtypeStruct((1,), jnp.float32),
             jax.ShapeDtypeStruct((_gpu_launch.gemm2_workspace_floats(t * k, h),),
                                  jnp.float32),
             jax.ShapeDtypeStruct((1,), jnp.bfloat16)]
  call = jax.ffi.ffi_call(mxint4_gpu.FFI_TARGET, results)
  attrs = dict(top_k=np.int64(k), intermediate_size=np.int64(i), local_expert_offset=np.int64(0),
               routing_method=np.int64(3), num_expert_group=np.int64(1), topk_group=np.int64(1),
               routed_scaling_factor=np.float32(1), has_bias=False, block_m=np.int64(8),
               split13=np.int64(1), split2=np.int64(1), mainloop=np.int64(0),
               one_token=False, fused_decode=False)
  with pytest.raises(Exception, match="Llama4 routing needs top_k == 1"):
    jax.block_until_ready(call(x, logits, jnp.zeros((1,), jnp.float32),
                               *[prepared[n] for n in mxint4_gpu.WEIGHT_KEYS], **attrs))
  # The one-token path asked for at T = 4: refused (it would read one block per pair of token 0).
  attrs.update(routing_method=np.int64(1), one_token=True)
  with pytest.raises(Exception, match="one_token"):
    jax.block_until_ready(call(x, logits, jnp.zeros((1,), jnp.float32),
                               *[prepared[n] for n in mxint4_gpu.WEIGHT_KEYS], **attrs))
  # fused_decode without the one-token path: refused by the handler too.
  attrs.update(one_token=False, fused_decode=True)
  with pytest.raises(Exception, match="fused_decode needs the one_token path"):
    jax.block_until_ready(call(x, logits, jnp.zeros((1,), jnp.float32),
                               *[prepared[n] for n in mxint4_gpu.WEIGHT_KEYS], **attrs))


@pytest.mark.parametrize("method", [RM.Renormalize, RM.DeepSeekV3, RM.TopK])
@pytest.mark.parametrize("t", [1, 77])
def test_routing_op_is_the_fused_ops_routing(method, t):
  """`mxint4_routing` runs the fused op's routing kernel alone: the same bits."""
  e, k, h, i = 64, 6, 256, 128
  prepared, _ = _experts(7, e, h, i)
  x, logits, bias = _inputs(int(method) + t, t, e, h)
  kw = _routing_kwargs(method, e, k, bias)
  _, ids, w = _run(prepared, x, logits, e=e, k=k, i=i, routing_method=method, **kw)
  got_w, got_ids = jax.jit(lambda l: mxint4_gpu.mxint4_routing(
      l, top_k=k, routing_method=method, **kw))(logits)
  np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids))
  np.testing.assert_array_equal(np.asarray(got_w), np.asarray(w))
  with pytest.raises(ValueError, match="top_k"):
    mxint4_gpu.mxint4_routing(logits, top_k=0)


@pytest.mark.parametrize("t", [1, 40])
def test_one_slot_rows_equal_the_fused_ops_pairs(t, monkeypatch):
  """`HopperMxInt4Experts.apply_routed` (one slot a row, as expert parallelism's exchanged pairs
  run): the rows of a token's K pairs, summed in float32 in slot order and rounded once, give
  the fused op's output bit for bit on the general GEMM kernels; a row with id -1 gives exactly
  0. At one token the op's automatic choice, the streaming kernels, sums each output's K slices
  in another order: within a rounding of it."""
  from jax_moeq import dispatch
  from jax_moeq.oracle.base import RoutingOptions
  from jax_moeq.weights import Int4MoEWeights
  e, k, h, i = 16, 4, 512, 256
  _, (q13, s13, q2, s2) = _experts(11, e, h, i)
  routing_opts = RoutingOptions(top_k=k, renormalize=True)
  layer = dispatch.LayerSpec(e, h, i, routing_opts, in_dtype=jnp.bfloat16)
  experts = dispatch.choose_experts("mxint4", layer, group_size=32).experts
  assert experts.backend_name == "mxint4_gpu", experts
  arrays = experts.prepare(Int4MoEWeights(q13, s13, q2, s2, 32))
  x, logits, _ = _inputs(12 + t, t, e, h)
  apply = lambda x, l: experts.apply(x, l, arrays, routing_opts)
  automatic = jax.jit(apply)(x, logits)
  # The general kernels at one token too (the streaming kernels' choice undone while tracing).
  monkeypatch.setattr(_gpu_launch, "choose_one_token_mainloop",
                      lambda mainloop_id, *args, **kwargs: mainloop_id)
  want = jax.jit(apply)(x, logits)
  monkeypatch.undo()
  assert _rel(automatic, want) <= 2.0**-8
  w, ids = jax.jit(lambda l: experts.route(l, routing_opts))(logits)
  rows = jnp.repeat(x, k, axis=0)
  row_ids = ids.reshape(-1, 1).at[0, 0].set(-1)  # one dropped pair
  one = jax.jit(lambda x, i, w: experts.apply_routed(x, i, w, arrays))
  v = one(rows, row_ids, w.reshape(-1, 1))
  assert not np.asarray(v[0].astype(jnp.float32)).any()
  v = one(rows, ids.reshape(-1, 1), w.reshape(-1, 1)).reshape(t, k, h)
  got = v[:, 0].astype(jnp.float32)
  for slot in range(1, k):  # slot order, as the kernel's finalize
    got = got + v[:, slot].astype(jnp.float32)
  got = got.astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))
  with pytest.raises(NotImplementedError, match="one slot per row"):
    experts.apply_routed(x, ids, w, arrays)
