"""Every GPU kernel variant of jax_moeq, once each, on small shapes: the workload that
scripts/sanitize_gpu.sh runs under compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

WNA16 (`fused_marlin_moe`, `batched_fused_marlin_moe`): the one-token decode path (GEMM1 unsplit
and split-K with its fused activation), the fused decode kernel, the aligned path at every
block_m of the mma.sync GEMM (8, 16, 32, 64) and main loop (registers, async ring, bulk copy),
split-K with the GEMM1 finalize, the wgmma prefill GEMM (block_m 128, T >= 256), act-order
(g_idx) on the aligned and wgmma paths, zero points and biases, expert ids outside [0, E) (the
expert-parallel drop), and the batched format (mma.sync and wgmma). MxInt4 (`mxint4_moe`): every
routing method at several tokens, DeepSeekV3 routing with groups and the correction bias at one
token (both one-token forms) and many, expert parallelism (a rank's local experts), split-K, and
the wgmma prefill. W4A8 (`w4a8_gpu_moe`): every token tile (block_m 32 at short and long K, 64,
128) with group scales and channel-wise ones, biases, the router weight on the input and ids
outside [0, E).

Inputs are made with numpy and the weights packed on the CPU backend, references computed there
too, so the GPU runs (almost) only our kernels. Every call writes into a NaN-poisoned output
(the ops' `out_init`), and the script checks that every element was written and matches the
reference (rel. Frobenius <= 1e-2).

  python scripts/gpu_kernel_variants.py            # all variants
  python scripts/gpu_kernel_variants.py --list
  python scripts/gpu_kernel_variants.py --only wna16_wgmma,mxint4_decode_deepseek
  python scripts/gpu_kernel_variants.py --no-check  # skip the references (faster)

Exit status: 0 when every variant ran and matched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_moeq import reference  # noqa: E402
from jax_moeq.ops import _gpu_launch, mxint4_gpu, w4a8_gpu, wna16_gpu  # noqa: E402
from jax_moeq.quant import int4  # noqa: E402
from jax_moeq.routing import RoutingMethodType as RM  # noqa: E402

TOL = 1e-2
CPU = jax.devices("cpu")[0]


def _gpu():
  return jax.devices("gpu")[0]


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _seed(case) -> int:
  return zlib.crc32(repr(case).encode())  # stable across processes (hash() of str is not)


def _on_cpu(fn, *args, **kwargs):
  """fn on the CPU backend, numpy arguments as CPU arrays (indexable by tracers)."""
  with jax.default_device(CPU):
    args, kwargs = jax.tree.map(
        lambda a: jax.device_put(a, CPU) if isinstance(a, np.ndarray) else a, (args, kwargs))
    return jax.device_get(fn(*args, **kwargs))


def _check_splits(case, split13, split2):
  """The variant's split-K expectations against the launch's choices (the ops choose them from
  the GPU's SM count: another GPU than the 132-SM H100 / H200 may choose otherwise). A miss is
  printed, not failed: the variant still runs, on another path."""
  for name, want, got in (("split13", case.expect_split13, split13),
                          ("split2", case.expect_split2, split2)):
    if want is not None and (got > 1) != want:
      print(f"WARN  expected {name} {'> 1' if want else '== 1'}, the launch chooses {got} on "
            f"this GPU ({_gpu_launch.num_sms()} SMs): {case} misses that path", flush=True)


def _top_k_routing(rng, t, e, k, foreign_ids):
  """(ids int32 [t, k], weights f32 [t, k]): top-k of random logits, renormalised; with
  foreign_ids, every other token's last slot names another rank's expert and token 1's first slot
  is -1 (both contribute nothing)."""
  logits = rng.normal(size=(t, e)).astype(np.float32)
  ids = np.argsort(-logits, axis=-1)[:, :k].astype(np.int32)
  w = np.take_along_axis(np.exp(logits), ids, -1)
  w = (w / w.sum(-1, keepdims=True)).astype(np.float32)
  if foreign_ids:
    ids[::2, -1] = e + 3
    if t > 1:
      ids[1, 0] = -1
  return ids, w


def _check_written(out):
  if not np.isfinite(out).all():
    raise AssertionError(f"{np.size(out) - np.isfinite(out).sum()} output elements unwritten "
                         "(NaN poison left) or not finite")


def _check_close(what, out, want) -> str:
  err = _rel(out, want)
  if err > TOL:
    raise AssertionError(f"rel. Frobenius error {err:.3e} > {TOL}")
  return f"{what} err={err:.1e}"


# ------------------------------------------------------------------ WNA16
@dataclasses.dataclass(frozen=True)
class Wna16Case:
  t: int = 5                 # tokens (standard) or max tokens per expert (batched)
  e: int = 8
  k: int = 2
  h: int = 256
  i: int = 128
  group: int = 64
  dtype: str = "bfloat16"
  act_order: bool = False
  zeros: bool = False
  bias: bool = False
  activation: int = 0
  block_m: int | None = None
  mainloop: str | None = None
  fused_decode: bool | None = None
  batched: bool = False
  foreign_ids: bool = False  # some ids outside [0, E): they contribute nothing
  expect_split13: bool | None = None  # asserts the launch's GEMM1 split-K choice
  expect_split2: bool | None = None   # ... and GEMM2's


def _wna16_gemm(rng, e, n, k, group, act_order, zeros):
  g = k if group == -1 else group
  q = rng.integers(-8, 8, (e, n, k)).astype(np.int8)
  s = (rng.uniform(0.5, 1.5, (e, k // g, n)) / (4.0 * np.sqrt(k))).astype(np.float16)
  g_idx = (np.stack([rng.permutation(np.arange(k) // g) for _ in range(e)]).astype(np.int32)
           if act_order else None)
  z = rng.integers(0, 16, (e, k // g, n)).astype(np.int32) if zeros else None
  return dict(q=q, s=s, g_idx=g_idx, z=z)


def _wna16_reference_weights(gm, dtype):
  """fused_moe_wna16's canonical arguments: q [E, N, K] (0..15 with zeros), scale [E, N, G]."""
  q = gm["q"].astype(np.int32)
  zeros = None
  if gm["z"] is not None:
    q = q + 8
    zeros = np.swapaxes(gm["z"], 1, 2)
  return dict(q=q.astype(np.int8), scale=np.swapaxes(gm["s"], 1, 2).astype(dtype), zeros=zeros,
              g_idx=gm["g_idx"])


def run_wna16(c: Wna16Case, check: bool) -> str:
  rng = np.random.default_rng(_seed(c))
  dtype = jnp.dtype(c.dtype)
  g13 = _wna16_gemm(rng, c.e, 2 * c.i, c.h, c.group, c.act_order, c.zeros)
  g2 = _wna16_gemm(rng, c.e, c.h, c.i, c.group, c.act_order, c.zeros)
  b13 = (rng.normal(size=(c.e, 2 * c.i)) * 0.1).astype(np.float32) if c.bias else None
  b2 = (rng.normal(size=(c.e, c.h)) * 0.1).astype(np.float32) if c.bias else None
  qzeros = lambda gm: (int4.pack_uint4b8_ct((gm["z"] - 8).astype(np.int8))
                       if gm["z"] is not None else None)
  weights = _on_cpu(
      wna16_gpu.convert_to_wna16_moe_kernel_format, "MARLIN", int4.pack_uint4b8_gptq(g13["q"]),
      int4.pack_uint4b8_gptq(g2["q"]), g13["s"], g2["s"], group_size=c.group,
      w13_g_idx=g13["g_idx"], w2_g_idx=g2["g_idx"], w13_qzeros=qzeros(g13),
      w2_qzeros=qzeros(g2), w13_bias=b13, w2_bias=b2, dtype=dtype)
  weights = jax.device_put(weights, _gpu())
  gpu = _gpu()
  if c.batched:
    x = rng.normal(size=(c.e, c.t, c.h)).astype(np.float32).astype(dtype)
    counts = rng.integers(0, c.t + 1, (c.e,)).astype(np.int32)
    counts[0] = c.t  # one full expert
    poison = np.full(x.shape, np.nan, dtype)
    run = jax.jit(lambda x, n, w, o: wna16_gpu.batched_fused_marlin_moe(
        x, n, w, activation_kind=c.activation, block_m=c.block_m, out_init=o,
        mainloop=c.mainloop))
    out = run(jax.device_put(x, gpu), jax.device_put(counts, gpu), weights,
              jax.device_put(poison, gpu))
    what = f"batched E={c.e} M={c.t}"
  else:
    x = rng.normal(size=(c.t, c.h)).astype(np.float32).astype(dtype)
    ids, w = _top_k_routing(rng, c.t, c.e, c.k, c.foreign_ids)
    poison = np.full(x.shape, np.nan, dtype)
    rows = c.t * c.k
    block_m, loop = _gpu_launch.choose_launch("wna16", rows / max(1, min(c.e, rows)), c.block_m,
                                              c.mainloop)
    busy = _gpu_launch.expected_busy_blocks(rows, c.e, block_m)
    split13, split2 = _gpu_launch.choose_gemm_splits(busy, c.h, c.i, block_m, rows, loop)
    _check_splits(c, split13, split2)
    run = jax.jit(lambda x, w, i, o: wna16_gpu.fused_marlin_moe(
        x, weights, w, i, activation_kind=c.activation, block_m=c.block_m, out_init=o,
        mainloop=c.mainloop, fused_decode=c.fused_decode))
    out = run(jax.device_put(x, gpu), jax.device_put(w, gpu), jax.device_put(ids, gpu),
              jax.device_put(poison, gpu))
    what = f"T={c.t} block_m={block_m} split=({split13}, {split2})"
  out = np.asarray(jax.device_get(out).astype(np.float32))
  _check_written(out)
  if not check:
    return what
  to_cpu = lambda d: {n: None if v is None else jax.device_put(v, CPU) for n, v in d.items()}
  r13 = to_cpu(_wna16_reference_weights(g13, dtype))
  r2 = to_cpu(_wna16_reference_weights(g2, dtype))
  common = dict(w13_zeros=r13["zeros"], w2_zeros=r2["zeros"], w13_g_idx=r13["g_idx"],
                w2_g_idx=r2["g_idx"], w13_bias=None if b13 is None else jax.device_put(b13, CPU),
                w2_bias=None if b2 is None else jax.device_put(b2, CPU),
                activation_kind=c.activation)
  if c.batched:
    # Row m of expert e is expert e's MLP of x[e, m] (no router weight): a top-1 call per expert.
    want = np.zeros(out.shape, np.float32)
    for ex in range(c.e):
      n = int(counts[ex])
      if n == 0:
        continue
      want[ex, :n] = np.asarray(_on_cpu(
          reference.fused_moe_wna16, x[ex, :n], np.full((n, 1), ex, np.int32),
          np.ones((n, 1), np.float32), r13["q"], r13["scale"], r2["q"], r2["scale"], c.group,
          **common)).astype(np.float32)
  else:
    # Under jit: ids are data there, and ids outside [0, E) contribute nothing (concrete ones
    # raise in the reference).
    ref = jax.jit(lambda x, ids, w: reference.fused_moe_wna16(
        x, ids, w, r13["q"], r13["scale"], r2["q"], r2["scale"], c.group, **common))
    want = np.asarray(_on_cpu(ref, x, ids, w)).astype(np.float32)
  return _check_close(what, out, want)


# ------------------------------------------------------------------ MxInt4
@dataclasses.dataclass(frozen=True)
class MxInt4Case:
  t: int = 8
  e: int = 16
  k: int = 4
  h: int = 256
  i: int = 128
  method: int = int(RM.Renormalize)
  local: int | None = None      # local experts (expert parallelism), default all
  ep_rank: int = 0
  block_m: int | None = None
  mainloop: str | None = None
  fused_decode: bool | None = None
  logits_bf16: bool = False
  expect_split13: bool | None = None
  expect_split2: bool | None = None


def _mx_routing_kwargs(c: MxInt4Case, bias):
  if c.method == RM.DeepSeekV3:
    return dict(num_expert_group=4, topk_group=2, e_score_correction_bias=bias,
                routed_scaling_factor=2.5)
  if c.method == RM.MiniMax2:
    return dict(e_score_correction_bias=bias, routed_scaling_factor=1.5)
  return {}


def run_mxint4(c: MxInt4Case, check: bool) -> str:
  rng = np.random.default_rng(_seed(c))
  local = c.e if c.local is None else c.local
  q13 = rng.integers(-8, 8, (local, 2 * c.i, c.h)).astype(np.int8)
  q2 = rng.integers(-8, 8, (local, c.h, c.i)).astype(np.int8)
  s13 = (rng.uniform(0.5, 1.5, (local, 2 * c.i, c.h // 32)) / (4.6 * np.sqrt(c.h)))
  s2 = (rng.uniform(0.5, 1.5, (local, c.h, c.i // 32)) / (4.6 * np.sqrt(c.i)))
  s13, s2 = s13.astype(jnp.bfloat16), s2.astype(jnp.bfloat16)
  prepared = _on_cpu(mxint4_gpu.prepare_static_weights_for_mxint4_moe,
                     mxint4_gpu.int8_to_signed_nibbles(q13), s13,
                     mxint4_gpu.int8_to_signed_nibbles(q2), s2)
  gpu = _gpu()
  args = [jax.device_put(prepared[n], gpu) for n in mxint4_gpu.WEIGHT_KEYS]
  x = rng.normal(size=(c.t, c.h)).astype(np.float32).astype(jnp.bfloat16)
  logits = (rng.normal(size=(c.t, c.e)) * 2.0).astype(np.float32)
  if c.logits_bf16:
    logits = logits.astype(jnp.bfloat16)
  bias = rng.uniform(-0.2, 0.2, (c.e,)).astype(np.float32)
  kw = _mx_routing_kwargs(c, bias)
  pairs = c.t * c.k
  local_pairs = pairs * local / c.e
  block_m, loop = _gpu_launch.choose_launch(
      "mxint4", local_pairs / max(1.0, min(local, local_pairs)), c.block_m, c.mainloop)
  busy = _gpu_launch.expected_busy_blocks(local_pairs, local, block_m)
  split13, split2 = _gpu_launch.choose_gemm_splits(busy, c.h, c.i, block_m, pairs, loop)
  _check_splits(c, split13, split2)
  gpu_kw = {n: (jax.device_put(v, gpu) if isinstance(v, np.ndarray) else v)
            for n, v in kw.items()}
  poison = np.full(x.shape, np.nan, jnp.bfloat16)
  run = jax.jit(lambda x, l, o, *a: mxint4_gpu.mxint4_moe(
      x, l, *a, num_experts=c.e, top_k=c.k, intermediate_size=c.i, local_num_experts=local,
      ep_rank=c.ep_rank, routing_method=c.method, block_m=c.block_m, out_init=o,
      mainloop=c.mainloop, fused_decode=c.fused_decode, **gpu_kw))
  out = run(jax.device_put(x, gpu), jax.device_put(logits, gpu), jax.device_put(poison, gpu),
            *args)
  out = np.asarray(jax.device_get(out).astype(np.float32))
  what = f"T={c.t} {RM(c.method).name} block_m={block_m} split=({split13}, {split2})"
  _check_written(out)
  if not check:
    return what
  want = np.asarray(_on_cpu(
      reference.fused_moe_mxint4, x, logits, q13, s13, q2, s2, top_k=c.k,
      routing_method=c.method, local_expert_offset=c.ep_rank * local, local_num_experts=local,
      **kw)).astype(np.float32)
  return _check_close(what, out, want)


# ------------------------------------------------------------------ W4A8
@dataclasses.dataclass(frozen=True)
class W4a8Case:
  t: int = 5
  e: int = 8
  k: int = 2
  h: int = 256
  i: int = 256
  group: int = 128
  dtype: str = "bfloat16"
  bias: bool = False
  on_input: bool = False
  activation: int = 0
  block_m: int | None = None
  foreign_ids: bool = False


def run_w4a8(c: W4a8Case, check: bool) -> str:
  rng = np.random.default_rng(_seed(c))
  dtype = jnp.dtype(c.dtype)
  g13 = c.h if c.group == -1 else c.group
  g2 = c.i if c.group == -1 else c.group
  sdt = np.float32 if c.group == -1 else jnp.bfloat16
  q13 = rng.integers(-8, 8, (c.e, 2 * c.i, c.h)).astype(np.int8)
  q2 = rng.integers(-8, 8, (c.e, c.h, c.i)).astype(np.int8)
  s13 = (rng.uniform(0.5, 1.5, (c.e, 2 * c.i, c.h // g13)) / (4.0 * np.sqrt(c.h))).astype(sdt)
  s2 = (rng.uniform(0.5, 1.5, (c.e, c.h, c.i // g2)) / (4.0 * np.sqrt(c.i))).astype(sdt)
  b13 = (rng.normal(size=(c.e, 2 * c.i)) * 0.1).astype(np.float32) if c.bias else None
  b2 = (rng.normal(size=(c.e, c.h)) * 0.1).astype(np.float32) if c.bias else None
  weights = jax.device_put(_on_cpu(w4a8_gpu.convert_to_w4a8_gpu_format, q13, q2, s13, s2,
                                   c.group, b13, b2), _gpu())
  x = rng.normal(size=(c.t, c.h)).astype(np.float32).astype(dtype)
  ids, w = _top_k_routing(rng, c.t, c.e, c.k, c.foreign_ids)
  block_m = _gpu_launch.choose_w4a8_block_m(c.t * c.k / c.e, c.block_m)
  gpu = _gpu()
  run = jax.jit(lambda x, w, i, o: w4a8_gpu.w4a8_gpu_moe(
      x, weights, w, i, activation_kind=c.activation, apply_router_weight_on_input=c.on_input,
      block_m=c.block_m, out_init=o))
  out = run(jax.device_put(x, gpu), jax.device_put(w, gpu), jax.device_put(ids, gpu),
            jax.device_put(np.full(x.shape, np.nan, dtype), gpu))
  out = np.asarray(jax.device_get(out).astype(np.float32))
  what = f"T={c.t} block_m={block_m} group={c.group}"
  _check_written(out)
  if not check:
    return what
  # Under jit (ids are data: ids outside [0, E) contribute nothing), the weights as arguments.
  ref = jax.jit(lambda x, ids, w, q13, s13, q2, s2, b13, b2: reference.fused_moe_w4a8(
      x, ids, w, q13, s13, q2, s2, c.group, w13_bias=b13, w2_bias=b2,
      apply_router_weight_on_input=c.on_input, activation_kind=c.activation))
  want = np.asarray(_on_cpu(ref, x, ids, w, q13, s13, q2, s2, b13, b2)).astype(np.float32)
  return _check_close(what, out, want)


# ------------------------------------------------------------------ the variants
VARIANTS = {
    # WNA16, one token, the general GEMM kernels: no alignment, GEMM2 finalizes (block_m 8).
    "wna16_decode": Wna16Case(t=1, mainloop="registers", expect_split13=False,
                              expect_split2=False),
    # ... GEMM1 split-K: memset workspace, the last split per unit applies the activation;
    # GEMM2 split-K: atomics into the workspace GEMM1 cleared, the last warp finalizes.
    "wna16_decode_split": Wna16Case(t=1, h=1024, i=1024, zeros=True, bias=True,
                                    mainloop="registers", expect_split13=True,
                                    expect_split2=True),
    "wna16_decode_split2": Wna16Case(t=1, i=1024, mainloop="registers", expect_split13=False,
                                     expect_split2=True),
    # WNA16, one token, the streaming kernels (the automatic choice): shared-memory sums per CTA.
    "wna16_stream": Wna16Case(t=1, h=1024, i=1024, bias=True, mainloop="stream"),
    "wna16_stream_fp16_zeros": Wna16Case(t=1, dtype="float16", group=32, zeros=True,
                                         activation=1, mainloop="stream"),
    "wna16_stream_foreign_ids": Wna16Case(t=1, foreign_ids=True, mainloop="stream"),
    "wna16_fused_decode": Wna16Case(t=1, bias=True, fused_decode=True),
    "wna16_fused_decode_fp16": Wna16Case(t=1, dtype="float16", group=32, zeros=True,
                                         activation=1, fused_decode=True),
    "wna16_decode_foreign_ids": Wna16Case(t=1, foreign_ids=True, mainloop="registers"),
    # Aligned path, every mma.sync block_m and main loop.
    "wna16_aligned_bm8_registers": Wna16Case(t=3, block_m=8, mainloop="registers"),
    # The running-address loops past a stage's end: 5 and 3 chunks (registers: stages of 4), and
    # 5 and 3 in the async ring's depth of 5.
    "wna16_aligned_bm8_registers_tail": Wna16Case(t=5, h=320, i=192, group=64, zeros=True,
                                                  bias=True, block_m=8, mainloop="registers"),
    "wna16_aligned_bm8_async_ring_tail": Wna16Case(t=5, h=320, i=192, group=-1, block_m=8,
                                                   mainloop="async_ring"),
    # The register loop's groups at fixed chunks of a stage (block_m 8): groups of 128 (2 chunks)
    # over 6 chunks (a stage, then 2 a chunk at a time) and 4; channel-wise over 12 chunks (3
    # stages a group) and 4, with zero points.
    "wna16_aligned_bm8_fixed_g128_tail": Wna16Case(t=5, h=384, i=256, group=128, block_m=8,
                                                   mainloop="registers"),
    "wna16_aligned_bm8_fixed_channelwise": Wna16Case(t=5, h=768, i=256, group=-1, zeros=True,
                                                     block_m=8, mainloop="registers"),
    "wna16_aligned_bm16_async_ring": Wna16Case(t=5, block_m=16, mainloop="async_ring",
                                               dtype="float16", zeros=True, bias=True,
                                               activation=1),
    "wna16_aligned_bm16_bulk_copy": Wna16Case(t=5, block_m=16, mainloop="bulk_copy"),
    "wna16_aligned_bm8_bulk_copy_g32": Wna16Case(t=3, block_m=8, mainloop="bulk_copy",
                                                 group=32),
    "wna16_aligned_bm32_async_ring": Wna16Case(t=40, e=4, block_m=32, mainloop="async_ring"),
    "wna16_aligned_bm32": Wna16Case(t=40, e=4, block_m=32, group=-1),
    "wna16_aligned_bm64": Wna16Case(t=70, e=4, block_m=64, activation=2),
    # Aligned, GEMM1 split-K: workspaces zeroed by the alignment launch, GEMM1 finalize kernel.
    "wna16_aligned_split": Wna16Case(t=2, h=1024, i=1024, block_m=8, bias=True,
                                     expect_split13=True, expect_split2=True),
    "wna16_aligned_foreign_ids": Wna16Case(t=6, block_m=16, foreign_ids=True),
    # Act-order: rows gathered in each expert's order, activation columns scattered.
    "wna16_act_order": Wna16Case(t=5, block_m=16, act_order=True, group=64),
    "wna16_act_order_bm8_async": Wna16Case(t=3, block_m=8, act_order=True, group=32,
                                           mainloop="async_ring", zeros=True),
    # wgmma prefill (block_m 128, T >= 256): permuted inputs, logical-order activations.
    "wna16_wgmma": Wna16Case(t=256, e=4, k=2, block_m=128, bias=True),
    "wna16_wgmma_fp16_zeros": Wna16Case(t=300, e=4, k=2, block_m=128, dtype="float16",
                                        zeros=True, group=128, activation=1),
    "wna16_wgmma_act_order": Wna16Case(t=256, e=4, k=2, block_m=128, act_order=True),
    "wna16_wgmma_i_odd_tiles": Wna16Case(t=256, e=4, k=2, h=192, i=192, block_m=128),
    # The persistent warp-specialised wgmma kernel: every token tile, act-order, odd unit counts,
    # more tiles than CTAs' first round (the stage ring across tiles), and the batched format.
    "wna16_wgmma_ws": Wna16Case(t=256, e=4, k=2, block_m=128, mainloop="wgmma_ws", bias=True),
    "wna16_wgmma_ws_bm32_zeros": Wna16Case(t=200, e=4, k=2, block_m=32, mainloop="wgmma_ws",
                                           dtype="float16", zeros=True, group=128, activation=1),
    "wna16_wgmma_ws_bm64_act_order": Wna16Case(t=256, e=4, k=2, block_m=64, mainloop="wgmma_ws",
                                               act_order=True),
    "wna16_wgmma_ws_i_odd_tiles": Wna16Case(t=256, e=4, k=2, h=192, i=192, block_m=32,
                                            mainloop="wgmma_ws"),
    "wna16_batched_wgmma_ws": Wna16Case(t=130, e=2, batched=True, block_m=64,
                                        mainloop="wgmma_ws"),
    # Batched format [E, M, H] with per-expert counts.
    "wna16_batched": Wna16Case(t=9, e=4, batched=True, bias=True),
    "wna16_batched_split": Wna16Case(t=2, e=4, h=1024, batched=True, block_m=8),
    "wna16_batched_wgmma": Wna16Case(t=130, e=2, batched=True, block_m=128),
    # MxInt4: one token (routing, then the one-token GEMMs), DeepSeekV3 groups and bias.
    "mxint4_decode": MxInt4Case(t=1, mainloop="async_ring"),
    "mxint4_decode_deepseek": MxInt4Case(t=1, method=int(RM.DeepSeekV3), mainloop="async_ring"),
    "mxint4_decode_split": MxInt4Case(t=1, h=1024, i=1024, method=int(RM.DeepSeekV3),
                                      mainloop="async_ring", expect_split13=True,
                                      expect_split2=True),
    # ... the streaming kernels after the routing launch (the automatic choice).
    "mxint4_stream_deepseek": MxInt4Case(t=1, h=1024, i=1024, method=int(RM.DeepSeekV3),
                                         mainloop="stream"),
    "mxint4_stream_ep": MxInt4Case(t=1, local=8, ep_rank=1, mainloop="stream"),
    "mxint4_fused_decode_deepseek": MxInt4Case(t=1, method=int(RM.DeepSeekV3),
                                               fused_decode=True),
    "mxint4_decode_ep": MxInt4Case(t=1, local=8, ep_rank=1, mainloop="async_ring"),
    # Many tokens: every routing method (Llama4 needs top_k 1).
    **{f"mxint4_routing_{m.name}": MxInt4Case(t=37, method=int(m), k=1 if m == RM.Llama4 else 4)
       for m in mxint4_gpu.SUPPORTED_ROUTING_METHODS},
    "mxint4_many_bf16_logits": MxInt4Case(t=37, logits_bf16=True, block_m=16,
                                          mainloop="registers"),
    "mxint4_ep": MxInt4Case(t=37, local=8, ep_rank=1, method=int(RM.DeepSeekV3)),
    "mxint4_aligned_split": MxInt4Case(t=2, h=1024, i=1024, block_m=8, expect_split13=True,
                                       expect_split2=True),
    "mxint4_bm32": MxInt4Case(t=64, e=8, k=2, block_m=32),
    "mxint4_async_ring_tail": MxInt4Case(t=9, h=320, i=192, block_m=8, mainloop="async_ring"),
    "mxint4_wgmma": MxInt4Case(t=256, e=8, k=2, block_m=128),
    "mxint4_wgmma_ep": MxInt4Case(t=256, e=8, k=4, local=4, ep_rank=1, block_m=128,
                                  method=int(RM.DeepSeekV3)),
    "mxint4_wgmma_ws": MxInt4Case(t=256, e=8, k=2, block_m=32, mainloop="wgmma_ws"),
    # W4A8: each token tile, group and channel-wise scales; a tile past N in GEMM2 (H = 384).
    "w4a8_bm32": W4a8Case(t=5, group=32, bias=True),
    "w4a8_bm32_long_k": W4a8Case(t=5, e=4, h=2176, i=2176, block_m=32),  # two CTAs per SM
    "w4a8_bm32_on_input_foreign_ids": W4a8Case(t=9, k=3, block_m=32, on_input=True,
                                               foreign_ids=True, dtype="float16"),
    "w4a8_bm64_channel": W4a8Case(t=70, e=4, h=384, block_m=64, group=-1, activation=1),
    "w4a8_bm64_f32": W4a8Case(t=40, e=4, block_m=64, group=64, dtype="float32", bias=True),
    "w4a8_bm128": W4a8Case(t=300, e=4, block_m=128, group=128, bias=True),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default=os.environ.get("VARIANTS", ""),
                      help="comma-separated variant names (default: all; env VARIANTS)")
  parser.add_argument("--list", action="store_true", help="list the variants and exit")
  parser.add_argument("--no-check", action="store_true",
                      help="skip the CPU references (only the poisoned-output check)")
  args = parser.parse_args(argv)
  if args.list:
    for name, case in VARIANTS.items():
      print(f"{name}: {case}")
    return 0
  names = [n for n in args.only.split(",") if n] or list(VARIANTS)
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    print(f"unknown variants: {unknown} (--list shows them)", file=sys.stderr)
    return 2
  if not wna16_gpu.wna16_gpu_available():
    print("no CUDA GPU of compute capability >= 9.0 with jax_moeq's CUDA library",
          file=sys.stderr)
    return 2
  failed = []
  start = time.time()
  for name in names:
    case = VARIANTS[name]
    t0 = time.time()
    try:
      run = {Wna16Case: run_wna16, MxInt4Case: run_mxint4, W4a8Case: run_w4a8}[type(case)]
      detail = run(case, not args.no_check)
      print(f"ok    {name:36s} {time.time() - t0:6.1f} s  {detail}", flush=True)
    except Exception as e:  # report every variant, then fail
      failed.append(name)
      print(f"FAIL  {name:36s} {time.time() - t0:6.1f} s  {type(e).__name__}: {e}", flush=True)
      traceback.print_exc()
  print(f"gpu_kernel_variants: {len(names) - len(failed)}/{len(names)} variants ok in "
        f"{time.time() - start:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""),
        flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
