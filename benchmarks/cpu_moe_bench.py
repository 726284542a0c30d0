"""CPU W4A8 fused MoE benchmark (SPEC §10 CPU shapes).

For each shape and token count T it times `dynamic_4bit_int_moe` (jitted, int4 weights packed
by `convert_to_w4a8_int8_moe_format`, bf16 activations) and prints:

- median time per call (routing precomputed; a ring of random top-k routings, a different one
  each call, so the experts' weights come from memory, not from cache);
- effective weight bandwidth: packed bytes (nibbles, scales, row corrections, biases) of the
  distinct experts the call's routing hits, divided by the time;
- int8 GOP/s: 2·T·K·(2I·H + H·I) / time;
- speed-ups (baseline time / ours) against
  (a) the jnp reference of the same scheme (`reference.fused_moe_w4a8`, jitted),
  (b) unquantized bf16 in XLA: `reference.fused_moe_ragged_dot` and a dense per-expert einsum
      (every expert on every token, routed outputs kept), whichever is faster at that T,
  (c) ONNX Runtime `com.microsoft.QMoE` (int4, block_size 128, accuracy_level 4 = int8
      activations, SwiGLU with interleaved gate/up) when onnxruntime and onnx import.
  Baselines are time-boxed per shape (`--baseline-budget`): T values they cannot finish in
  the budget are left out and marked "—".

It also measures the machine's read bandwidth (1 GiB array sum, 2 threads) and prints the
fraction reached at T=1.

    python benchmarks/cpu_moe_bench.py                  # all shapes, ~10 minutes
    python benchmarks/cpu_moe_bench.py --quick          # OLMoE, T in {1, 8, 128}
    python benchmarks/cpu_moe_bench.py --shapes olmoe --tokens 1,512 --out results.md
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.use_source_tree_if_not_installed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from _timing import (  # noqa: E402
    markdown_table, median_time, progress, read_bandwidth_gbps)


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  num_experts: int
  top_k: int
  hidden_size: int
  intermediate_size: int


SHAPES = {
    "olmoe": Shape("OLMoE-1B-7B", 64, 8, 2048, 1024),
    "qwen": Shape("Qwen1.5-MoE-A2.7B", 60, 4, 2048, 1408),
    "mixtral": Shape("Mixtral-8x7B", 8, 2, 4096, 14336),
}
DEFAULT_TOKENS = (1, 8, 32, 128, 512)


# ------------------------------------------------------------------ inputs
@dataclasses.dataclass
class Experts:
  """Random int4 experts in the forms the contenders need (built lazily, one expert at a time
  so that no float32 copy of a whole layer ever exists)."""

  shape: Shape
  group_size: int
  seed: int
  _q: tuple | None = None
  _packed: tuple | None = None
  _bf16: tuple | None = None

  def _expert_q(self, e: int):
    s = self.shape
    rng = np.random.default_rng((self.seed, e))
    q13 = rng.integers(-8, 8, (2 * s.intermediate_size, s.hidden_size), dtype=np.int8)
    q2 = rng.integers(-8, 8, (s.hidden_size, s.intermediate_size), dtype=np.int8)
    g13 = s.hidden_size if self.group_size == -1 else self.group_size
    g2 = s.intermediate_size if self.group_size == -1 else self.group_size
    sdt = np.float32 if self.group_size == -1 else ml_dtypes.bfloat16
    # Scales ~ 1/(8 sqrt(K)) keep every GEMM output O(1), as trained weights do.
    s13 = (rng.uniform(0.5, 1.5, (q13.shape[0], s.hidden_size // g13))
           / (8 * np.sqrt(s.hidden_size))).astype(sdt)
    s2 = (rng.uniform(0.5, 1.5, (q2.shape[0], s.intermediate_size // g2))
          / (8 * np.sqrt(s.intermediate_size))).astype(sdt)
    return q13, s13, q2, s2

  def unpacked(self):
    """(w13_q, w13_scale, w2_q, w2_scale) as numpy, whole layer (int8 + small scales)."""
    if self._q is None:
      parts = [self._expert_q(e) for e in range(self.shape.num_experts)]
      self._q = tuple(np.stack([p[j] for p in parts]) for j in range(4))
    return self._q

  def packed(self):
    """(w13_packed, w2_packed) device arrays, packed expert by expert with the library packer."""
    if self._packed is None:
      from jax_moeq.ops.w4a8_cpu import convert_to_w4a8_int8_moe_format
      pack = jax.jit(functools.partial(convert_to_w4a8_int8_moe_format, group_size=self.group_size))
      w13, w2 = [], []
      for e in range(self.shape.num_experts):
        if self._q is not None:
          q13, s13, q2, s2 = (a[e] for a in self._q)
        else:
          q13, s13, q2, s2 = self._expert_q(e)
        p13, p2, *_ = pack(q13[None], q2[None], s13[None], s2[None])
        w13.append(np.asarray(p13))
        w2.append(np.asarray(p2))
      self._packed = (jnp.asarray(np.concatenate(w13)), jnp.asarray(np.concatenate(w2)))
    return self._packed

  def bf16(self):
    """Dequantized (q · scale) bf16 weights (w13, w2) as device arrays."""
    if self._bf16 is None:
      def dequant(q, s):
        g = q.shape[1] // s.shape[1]
        w = q.astype(np.float32).reshape(q.shape[0], s.shape[1], g)
        w = w * s.astype(np.float32)[..., None]
        return w.reshape(q.shape).astype(ml_dtypes.bfloat16)
      s = self.shape
      w13 = np.empty((s.num_experts, 2 * s.intermediate_size, s.hidden_size), ml_dtypes.bfloat16)
      w2 = np.empty((s.num_experts, s.hidden_size, s.intermediate_size), ml_dtypes.bfloat16)
      for e in range(s.num_experts):
        if self._q is not None:
          q13, s13, q2, s2 = (a[e] for a in self._q)
        else:
          q13, s13, q2, s2 = self._expert_q(e)
        w13[e], w2[e] = dequant(q13, s13), dequant(q2, s2)
      self._bf16 = (jax.device_put(w13), jax.device_put(w2))
      del w13, w2
    return self._bf16

  def drop(self):
    self._q = self._packed = self._bf16 = None


def routing_ring(shape: Shape, tokens: int, ring: int, seed: int):
  """`ring` random routings: distinct experts per token, weights normalized; plus the router
  logits that produce them under softmax → top-k (for ORT, which routes itself)."""
  rng = np.random.default_rng((seed, tokens))
  out = []
  for _ in range(ring):
    logits = rng.standard_normal((tokens, shape.num_experts)).astype(np.float32)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :shape.top_k].astype(np.int32)
    chosen = np.take_along_axis(logits, ids, axis=1)
    w = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    out.append((jnp.asarray(ids), jnp.asarray(w), logits))
  return out


# ------------------------------------------------------------------ contenders
def ours_fn(shape: Shape, group_size: int):
  from jax_moeq.ops.w4a8_cpu import dynamic_4bit_int_moe
  h, i = shape.hidden_size, shape.intermediate_size
  return jax.jit(lambda x, ids, w, p13, p2: dynamic_4bit_int_moe(x, ids, w, p13, p2, h, i, 2 * i,
                                                                  group_size))


def reference_fn(group_size: int):
  from jax_moeq import reference
  return jax.jit(lambda x, ids, w, q13, s13, q2, s2: reference.fused_moe_w4a8(
      x, ids, w, q13, s13, q2, s2, group_size))


def ragged_fn():
  from jax_moeq import reference
  return jax.jit(lambda x, ids, w, w13, w2: reference.fused_moe_ragged_dot(x, ids, w, w13, w2))


def _dense_moe(x, ids, w, w13, w2):
  """Every expert on every token in bf16 (f32 accumulation), routed outputs kept."""
  dtype = x.dtype
  y13 = jnp.einsum("th,eih->tei", x, w13, preferred_element_type=jnp.float32).astype(dtype)
  i = y13.shape[-1] // 2
  g, u = y13[..., :i].astype(jnp.float32), y13[..., i:].astype(jnp.float32)
  act = (jax.nn.silu(g) * u).astype(dtype)
  y = jnp.einsum("tei,ehi->teh", act, w2, preferred_element_type=jnp.float32)
  picked = jnp.take_along_axis(y, ids[..., None], axis=1)  # [T, K, H]
  return jnp.sum(picked * w[..., None], axis=1).astype(dtype)


def dense_fn():
  return jax.jit(_dense_moe)


def ort_session(shape: Shape, seed: int, block_size: int = 128):
  """An ORT QMoE session on random int4 weights (gate/up interleaved, as swiglu_fusion=1
  wants), or (None, why) when onnxruntime / onnx is missing or refuses the model."""
  try:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
  except ImportError as e:
    return None, f"onnxruntime/onnx not installed ({e.name}); `pip install .[bench]`"
  e, k, h, i = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
  rng = np.random.default_rng((seed, 7))
  # Random bytes are random int4 pairs in any nibble order; zero point defaults to 8.
  fc1 = rng.integers(0, 256, (e, 2 * i, h // 2), dtype=np.uint8)
  fc2 = rng.integers(0, 256, (e, h, i // 2), dtype=np.uint8)
  s1 = (rng.uniform(0.5, 1.5, (e, 2 * i, h // block_size)) / (8 * np.sqrt(h))).astype(np.float32)
  s2 = (rng.uniform(0.5, 1.5, (e, h, i // block_size)) / (8 * np.sqrt(i))).astype(np.float32)
  inits = [numpy_helper.from_array(a, n) for a, n in
           ((fc1, "fc1_w"), (s1, "fc1_s"), (fc2, "fc2_w"), (s2, "fc2_s"))]
  node = helper.make_node(
      "QMoE", ["input", "router_probs", "fc1_w", "fc1_s", "", "fc2_w", "fc2_s"], ["output"],
      domain="com.microsoft", k=k, activation_type="swiglu", swiglu_fusion=1,
      expert_weight_bits=4, block_size=block_size, accuracy_level=4,
      normalize_routing_weights=1, activation_alpha=1.0, activation_beta=0.0)
  graph = helper.make_graph(
      [node], "qmoe",
      [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["T", h]),
       helper.make_tensor_value_info("router_probs", TensorProto.FLOAT, ["T", e])],
      [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["T", h])], inits)
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                  helper.make_opsetid("com.microsoft", 1)])
  options = ort.SessionOptions()
  options.intra_op_num_threads = os.cpu_count() or 1
  options.inter_op_num_threads = 1
  try:
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    session.run(None, {"input": np.ones((1, h), np.float32),
                       "router_probs": np.ones((1, e), np.float32)})
  except Exception as err:  # ORT raises its own exception types
    return None, f"onnxruntime {ort.__version__} refused QMoE: {str(err).splitlines()[0][:200]}"
  return session, f"onnxruntime {ort.__version__}"


# ------------------------------------------------------------------ measurement
def int8_ops(shape: Shape, tokens: int) -> float:
  h, i = shape.hidden_size, shape.intermediate_size
  return 2.0 * tokens * shape.top_k * (2 * i * h + h * i)


class Budget:
  """Seconds left for one baseline on one shape, and whether the next T is predicted to fit.

  The prediction scales the last time per call by (T / T_last)^a, with a the growth exponent
  of the last two measurements (0.5 until there are two; clamped to [0.25, 1.5])."""

  def __init__(self, seconds: float):
    self.left = seconds
    self.history: list[tuple[int, float]] = []  # (T, seconds per call)

  def predict(self, tokens: int) -> float:
    t_last, s_last = self.history[-1]
    exponent = 0.5
    if len(self.history) >= 2:
      (t0, s0), (t1, s1) = self.history[-2:]
      if t1 != t0 and s0 > 0 and s1 > 0:
        exponent = min(1.5, max(0.25, np.log(s1 / s0) / np.log(t1 / t0)))
    return s_last * max(1.0, tokens / t_last) ** exponent

  def fits(self, tokens: int, calls: int) -> bool:
    if not self.history:
      return self.left > 0
    return calls * self.predict(tokens) <= self.left

  def spend(self, tokens: int, seconds_per_call: float, wall: float) -> None:
    self.left -= wall
    self.history.append((tokens, seconds_per_call))


def time_baseline(name: str, budget: Budget, tokens: int, call, args) -> float | None:
  if not budget.fits(tokens, calls=2):  # warm-up (compiles) + one timed call
    progress(f"  {name}: T={tokens} skipped (over the baseline budget)")
    return None
  start = time.perf_counter()
  seconds, calls = median_time(call, warmup=1, min_repeats=2, max_repeats=10,
                               target_seconds=args.target_seconds / 2,
                               budget_seconds=max(budget.left, 0.0))
  wall = time.perf_counter() - start
  budget.spend(tokens, seconds, wall)
  progress(f"  {name}: T={tokens} {seconds * 1e3:.1f} ms ({calls} calls, {wall:.1f} s)")
  return seconds


def fmt_ms(seconds: float | None) -> str | None:
  if seconds is None:
    return None
  ms = seconds * 1e3
  return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def ratio(baseline: float | None, ours: float) -> str | None:
  return None if baseline is None else f"{baseline / ours:.1f}×"


def bench_shape(shape: Shape, args, bandwidth: float) -> tuple[str, list[str]]:
  from jax_moeq.ops.w4a8_cpu import w4a8_packed_bytes
  notes = []
  h, i, g = shape.hidden_size, shape.intermediate_size, args.group_size
  expert_bytes = w4a8_packed_bytes(2 * i, h, g) + w4a8_packed_bytes(h, i, g)
  experts = Experts(shape, g, args.seed)
  progress(f"{shape.name}: packing {shape.num_experts} experts "
           f"({shape.num_experts * expert_bytes / 1e9:.2f} GB packed)")
  start = time.perf_counter()
  p13, p2 = experts.packed()
  progress(f"{shape.name}: packed in {time.perf_counter() - start:.1f} s")
  ours = ours_fn(shape, g)
  baselines = set(args.baselines)
  budgets = {name: Budget(args.baseline_budget) for name in ("ref", "ragged", "dense", "ort")}
  reference = reference_fn(g) if "ref" in baselines else None
  ragged, dense = (ragged_fn(), dense_fn()) if "xla" in baselines else (None, None)
  session = None
  if "ort" in baselines:
    progress(f"{shape.name}: building the ORT QMoE session")
    session, why = ort_session(shape, args.seed)
    notes.append(f"ORT: {why}" if session is not None else f"ORT QMoE skipped: {why}")
  rows = []
  t1_fraction = None
  ref_weights = None
  for tokens in args.tokens:
    ring = routing_ring(shape, tokens, args.ring, args.seed)
    key = jax.random.key(tokens)
    x = (jax.random.normal(key, (tokens, h), jnp.float32)).astype(jnp.bfloat16)
    x32 = np.asarray(x.astype(jnp.float32))
    pick = lambda j: ring[j % len(ring)]
    load = os.getloadavg()[0]
    times: list[float] = []
    seconds, calls = median_time(lambda j: ours(x, pick(j)[0], pick(j)[1], p13, p2),
                                 warmup=2, min_repeats=5, max_repeats=200,
                                 target_seconds=args.target_seconds, all_times=times)
    hit = np.mean([len(np.unique(np.asarray(r[0]))) for r in ring])
    gbps = hit * expert_bytes / seconds / 1e9
    gops = int8_ops(shape, tokens) / seconds / 1e9
    progress(f"{shape.name}: T={tokens} ours {seconds * 1e3:.2f} ms ({calls} calls), "
             f"{gbps:.1f} GB/s, {gops:.0f} GOP/s")
    if tokens == 1:
      # Re-probe next to the T=1 timing: on a shared machine the bandwidth moves with the load.
      bandwidth = read_bandwidth_gbps(threads=2)["best"]
      t1_fraction = gbps / bandwidth

    ref_s = None
    if reference is not None:
      if ref_weights is None:
        ref_weights = tuple(jnp.asarray(a) for a in experts.unpacked())
      dev = ref_weights
      if tokens == min(args.tokens, key=lambda t: abs(t - 8)):
        ids, w, _ = ring[0]
        want = np.asarray(reference(x, ids, w, *dev).astype(jnp.float32))
        got = np.asarray(ours(x, ids, w, p13, p2).astype(jnp.float32))
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        notes.append(f"check at T={tokens}: kernel vs jnp reference rel. Frobenius error {err:.1e} "
                     "(bf16)")
      ref_s = time_baseline("jnp reference", budgets["ref"], tokens,
                            lambda j: reference(x, pick(j)[0], pick(j)[1], *dev), args)
    xla_s, xla_name = None, None
    if ragged is not None:
      w13, w2 = experts.bf16()
      r_s = time_baseline("bf16 ragged_dot", budgets["ragged"], tokens,
                          lambda j: ragged(x, pick(j)[0], pick(j)[1], w13, w2), args)
      d_s = time_baseline("bf16 dense einsum", budgets["dense"], tokens,
                          lambda j: dense(x, pick(j)[0], pick(j)[1], w13, w2), args)
      candidates = [(s, n) for s, n in ((r_s, "ragged_dot"), (d_s, "einsum")) if s is not None]
      if candidates:
        xla_s, xla_name = min(candidates)
    ort_s = None
    if session is not None:
      feeds = [{"input": x32, "router_probs": r[2]} for r in ring]
      ort_s = time_baseline("ORT QMoE", budgets["ort"], tokens,
                            lambda j: session.run(None, feeds[j % len(feeds)]), args)
    xla_cell = None if xla_s is None else f"{fmt_ms(xla_s)} ({xla_name})"
    rows.append([tokens, f"{load:.1f}", fmt_ms(seconds), fmt_ms(min(times)), f"{gbps:.1f}",
                 f"{gops:.0f}", fmt_ms(ref_s), ratio(ref_s, seconds), xla_cell,
                 ratio(xla_s, seconds), fmt_ms(ort_s), ratio(ort_s, seconds)])
  experts.drop()
  del ref_weights
  header = ["T", "load", "ours ms", "ours best ms", "weights GB/s", "int8 GOP/s", "jnp ref ms",
            "vs ref", "bf16 XLA ms", "vs XLA", "ORT QMoE ms", "vs ORT"]
  title = (f"### {shape.name} (E={shape.num_experts}, top-{shape.top_k}, H={h}, I={i}, "
           f"group {g}; {expert_bytes / 1e6:.2f} MB packed per expert)")
  if t1_fraction is not None:
    notes.append(f"T=1 reaches {100 * t1_fraction:.0f} % of the read bandwidth measured right "
                 f"after it ({bandwidth:.1f} GB/s)")
  return title + "\n\n" + markdown_table(header, rows), notes


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default=",".join(SHAPES),
                      help=f"comma-separated subset of {list(SHAPES)}")
  parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                      help="comma-separated token counts T")
  parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128, -1))
  parser.add_argument("--baselines", default="ref,xla,ort",
                      help="comma-separated subset of ref,xla,ort (empty for none)")
  parser.add_argument("--baseline-budget", type=float, default=30.0,
                      help="seconds per baseline per shape (T values that do not fit are left out)")
  parser.add_argument("--target-seconds", type=float, default=1.0,
                      help="timed seconds per measurement of our kernel")
  parser.add_argument("--ring", type=int, default=16, help="routings cycled between calls")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true",
                      help="OLMoE only, T in {1, 8, 128}, short timings and budgets")
  parser.add_argument("--out", help="also write the markdown report to this file")
  args = parser.parse_args(argv)
  if args.quick:
    args.shapes, args.tokens = "olmoe", "1,8,128"
    args.target_seconds, args.baseline_budget = 0.3, 10.0
  args.shapes = [s for s in args.shapes.split(",") if s]
  for s in args.shapes:
    if s not in SHAPES:
      parser.error(f"unknown shape {s!r}; expected some of {list(SHAPES)}")
  args.tokens = [int(t) for t in args.tokens.split(",") if t]
  args.baselines = [b for b in args.baselines.split(",") if b]
  for b in args.baselines:
    if b not in ("ref", "xla", "ort"):
      parser.error(f"unknown baseline {b!r}; expected some of ref,xla,ort")

  command = sys.argv[1:] if argv is None else list(argv)
  from jax_moeq import _ffi
  module = _ffi.cpu_module()
  progress("measuring read bandwidth (1 GiB, 2 threads)")
  bw = read_bandwidth_gbps(threads=2)
  started = time.strftime("%Y-%m-%d %H:%M")
  lines = [
      "## CPU W4A8 fused MoE benchmark", "",
      f"- date: {started}; machine: {platform.machine()}, {os.cpu_count()} cores, kernel ISA "
      f"{module.selected_isa()} (available {module.available_isas()}); jax {jax.__version__}",
      f"- command: `python benchmarks/cpu_moe_bench.py {' '.join(command)}`",
      f"- read bandwidth (1 GiB sum, 2 threads): {bw['best']:.1f} GB/s (numpy {bw['numpy']:.1f}, "
      f"XLA {bw['xla']:.1f})",
      "- activations bf16 (ORT: float32, its CPU QMoE input type); times are medians (\"best\": "
      "the fastest call); GB/s and GOP/s use the median; ratios are baseline median / ours; "
      "\"load\": 1-minute load average when our kernel was timed (2 cores; other processes slow "
      "every contender); \"—\": not measured (baseline over its time budget, or absent)",
      "",
  ]
  for name in args.shapes:
    table, notes = bench_shape(SHAPES[name], args, bw["best"])
    lines += [table, ""] + [f"- {n}" for n in notes] + [""]
  report = "\n".join(lines)
  print(report)
  if args.out:
    with open(args.out, "w") as f:
      f.write(report + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
