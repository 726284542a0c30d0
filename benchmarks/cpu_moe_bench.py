"""CPU W4A8 fused MoE benchmark (SPEC §10 CPU shapes), with the weights as cold as in a model.

For each shape and token count T it times `dynamic_4bit_int_moe` (jitted, int4 weights packed
by `convert_to_w4a8_int8_moe_format`, bf16 activations) and, interleaved call by call in the same
process, ONNX Runtime's `com.microsoft.QMoE` (int4, block_size 128, accuracy_level 4 = int8
activations, SwiGLU with interleaved gate/up; spinning threads off, the same thread count).

Cold caches and in-graph time: a model runs its layers back to back in one graph, and its other
layers evict a layer's experts before it runs again. So one call of either contender runs
`--layers` MoE layers, each with its own weights (default: at least 4, and enough that their
packed experts are at least twice the last-level cache) and routing, chained through a residual
(x <- x + moe(x)): ours in one jitted function (the add in the kernel's combine, `residual=`, as
the models run it), ORT's as one graph of QMoE and Add nodes. Per-call
costs (Python, the runtime's dispatch) are shared by the layers, as in a model. Every call draws
fresh routings. Printed per T:

- median time per layer (call time / layers), ours and ORT's, and their ratio;
- weight bytes read: packed bytes (nibbles, scales, row corrections, biases) of the distinct
  experts the call's routing hits, divided by the time, and that rate as a fraction of the
  machine's DRAM read bandwidth (measured here on an array 8x the last-level cache);
- int8 GOP/s: 2·T·K·(2I·H + H·I) / time.

KTransformers' kt-kernel (`--baselines ktk`, on by default, skipped with the reason printed when
it does not import): its AMXINT4 / AMXINT8 experts (`--ktk-methods`), quantized by its own online
quantizer from the same float weights (ours: q·scale in bf16), `--layers` layers chained through
the same residual with their own weights and the same routings, on a kt-kernel worker pool of one
thread fewer (its caller spins in `sync()` on the remaining core; `--ktk-threads` sets it),
interleaved call by call with ours. kt-kernel picks its build by the CPU flags
(AMX on Sapphire Rapids and later, else AVX-512, else AVX2; `--ktk-variant` overrides); its AVX2
build has no online int4/int8 quantizer. Its GPTQ kernels (GPTQINT4: AVX2; GPTQINT4_VNNI256:
AVX-VNNI, 256-bit, packed), in every build, take our int4 experts written as symmetric GPTQ
tensors (`gptq_int4`: the same weights exactly, group size ours). It is driven
through its extension (`CPUInfer.submit` / `sync` of `forward_task`), as its `KTMoEWrapper.forward`
does on its synchronous path: the wrapper itself needs pinned host buffers (torch without an
accelerator refuses `pin_memory`) and, on its default path, a CUDA stream that it hands to
`cudaLaunchHostFunc`; with no CUDA device that launch fails unchecked and `forward` returns
zeros, and with one the MoE runs on the driver's callback thread after `forward` has returned
(`KT_FORCE_SYNC_SUBMIT=1` makes the wrapper submit and wait on the host, the stream ignored). Its
output on layer 0 is checked against the float reference (`reference.fused_moe_float` on the same
bf16 weights), ours beside it. `--ktk-path DIR` (or JAX_MOEQ_KTK_PATH) puts a folder holding
kt_kernel, kt_kernel.libs and gguf first on sys.path (kt-kernel pins a torch version; unpacked with
--no-deps it runs on the torch already installed).

Optional peers (`--baselines`): the jnp reference of the scheme and unquantized bf16 in XLA
(`ragged_dot` or a dense einsum, whichever is faster), on one layer (its bf16 weights alone are
4x ours), each time-boxed (`--baseline-budget`).

XLA's intra-op pool, which the kernel runs on, is sized once per process (PJRT_NPROC), so
`--threads N` sets it before JAX starts, and `--thread-scaling 1,2,4,...` runs one process per
count (counts above the usable cores are skipped) and prints a table. `--plot PATH` draws time
against T (ours and the peers) and the DRAM fraction (needs matplotlib).

    python benchmarks/cpu_moe_bench.py --quick                 # OLMoE, T in {1, 8, 128}
    python benchmarks/cpu_moe_bench.py                         # every shape, T 1..512
    python benchmarks/cpu_moe_bench.py --shapes olmoe --tokens 1,8,128,512 --plot cpu.png
    python benchmarks/cpu_moe_bench.py --shapes olmoe --tokens 1,128 --thread-scaling 1,2,4,8,16
    python benchmarks/cpu_moe_bench.py --shapes olmoe --tokens 1,8,128 --baselines ort,ktk \
        --ktk-path .carry/ktk --ktk-methods AMXINT4,AMXINT8
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, sibling benchmarks
import _timing  # noqa: E402

_timing.size_xla_pool_from_argv(sys.argv[1:])

_timing.use_source_tree_if_not_installed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from _timing import markdown_table, median_time, progress, read_bandwidth_gbps  # noqa: E402


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
    "qwen3": Shape("Qwen3-30B-A3B", 128, 8, 2048, 768),
    "dsv2lite": Shape("DeepSeek-V2-Lite", 64, 6, 2048, 1408),  # routed experts only
    # One DeepSeek-V3 layer's routed experts: ~5.6 GB of int4, the hybrid-inference case.
    "dsv3": Shape("DeepSeek-V3", 256, 8, 7168, 2048),
    "tiny": Shape("tiny", 8, 2, 256, 256),  # a smoke test of the script, not a figure
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
def _moe_layer(shape: Shape, group_size: int):
  """One layer, not jitted: (x, ids, w, w13_packed, w2_packed, residual=None) -> moe(x), plus
  the residual when given (added by the kernel)."""
  from jax_moeq.ops.w4a8_cpu import dynamic_4bit_int_moe
  h, i = shape.hidden_size, shape.intermediate_size
  return lambda x, ids, w, p13, p2, residual=None: dynamic_4bit_int_moe(
      x, ids, w, p13, p2, h, i, 2 * i, group_size, residual=residual)


def ours_fn(shape: Shape, group_size: int):
  """One layer, jitted: (x, ids, w, w13_packed, w2_packed) -> moe(x)."""
  return jax.jit(_moe_layer(shape, group_size))


def ours_stack_fn(shape: Shape, group_size: int, xla_residual: bool = False):
  """Layers chained in one jitted function: (x, [ids], [w], [(w13_packed, w2_packed)]) -> x
  after x <- x + moe_l(x) for every layer l: the add in the kernel's combine (`residual=`, as the
  models run it), or as an XLA op after each call (`xla_residual`)."""
  layer = _moe_layer(shape, group_size)

  def stack(x, ids, w, packed):
    for l, (p13, p2) in enumerate(packed):
      if xla_residual:
        x = x + layer(x, ids[l], w[l], p13, p2)
      else:
        x = layer(x, ids[l], w[l], p13, p2, residual=x)
    return x
  return jax.jit(stack)


def packed_layers(shape: Shape, group_size: int, layers: int, seed: int) -> list:
  """`layers` layers of random experts (seeds seed, seed + 1, ...), packed for ours, their
  unpacked weights dropped."""
  stacks = [Experts(shape, group_size, seed + l) for l in range(layers)]
  packed = [e.packed() for e in stacks]
  for e in stacks:
    e.drop()
  return packed


def ring_call(stack, x, ring, packed):
  """call(j) of `ours_stack_fn`'s stack over `packed`'s layers: call j runs layer l on routing
  (j * layers + l) % len(ring), so every call takes fresh routings."""
  layers = len(packed)
  pick = lambda j, l: ring[(j * layers + l) % len(ring)]
  return lambda j: stack(x, [pick(j, l)[0] for l in range(layers)],
                         [pick(j, l)[1] for l in range(layers)], packed)


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


ORT_GRAPH_BYTES = 1_800_000_000  # a serialized ONNX model must stay under protobuf's 2 GB
ORT_BLOCK_SIZE = 128  # QMoE's int4 block (group) size


def _ort_layer_bytes(shape: Shape, block_size: int = ORT_BLOCK_SIZE) -> int:
  """Bytes of one QMoE layer's initializers: int4 nibbles and float32 block scales."""
  h, i = shape.hidden_size, shape.intermediate_size
  return shape.num_experts * (3 * h * i // 2 + 3 * h * i // block_size * 4)


def _ort_initializer(array: np.ndarray, name: str, external_dir: str | None):
  """A TensorProto of `array`; with `external_dir`, its bytes go to a file there and the proto
  only names it (ONNX external data), so that one layer of more than 2 GB (DeepSeek-V3's
  routed experts) still makes a model that protobuf can hold."""
  from onnx import TensorProto, helper, numpy_helper
  if external_dir is None:
    return numpy_helper.from_array(array, name)
  location = f"{name}.bin"
  array = np.ascontiguousarray(array)
  array.tofile(os.path.join(external_dir, location))
  # onnx.external_data_helper.set_external_data wants the bytes in raw_data first, which is
  # what protobuf cannot hold here; the entries are written directly.
  proto = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                      dims=array.shape, data_location=TensorProto.EXTERNAL)
  for key, value in (("location", location), ("offset", "0"), ("length", str(array.nbytes))):
    entry = proto.external_data.add()
    entry.key, entry.value = key, value
  return proto


def ort_layers(shape: Shape, layers: int, seed: int, threads: int) -> tuple[list | None, str]:
  """ORT sessions, each with the range of layers it holds, that together run `layers` QMoE layers
  chained as ours are: as few graphs as fit in ORT_GRAPH_BYTES each (one for the small-expert
  shapes), run one after another on the previous one's output; or (None, why)."""
  per_graph = max(1, ORT_GRAPH_BYTES // _ort_layer_bytes(shape))
  sessions, why = [], ""
  for first in range(0, layers, per_graph):
    held = range(first, min(layers, first + per_graph))
    session, why = ort_session(shape, seed, threads, held)
    if session is None:
      return None, why
    sessions.append((session, held))
  return sessions, f"{why}, {len(sessions)} graph(s)"


def ort_session(shape: Shape, seed: int, threads: int, layers: range,
                block_size: int = ORT_BLOCK_SIZE):
  """An ORT session of QMoE layers `layers` chained as ours are (x <- x + QMoE_l(x), inputs
  "input" and "router_probs_<l>"), each on random int4 weights of its own (gate/up interleaved,
  as swiglu_fusion=1 wants), with `threads` intra-op threads that sleep when idle (spinning ones
  would steal the cores from our kernel between calls); or (None, why) when onnxruntime / onnx
  is missing or refuses the model."""
  try:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
  except ImportError as e:
    return None, f"onnxruntime/onnx not installed ({e.name}); `pip install .[bench]`"
  e, k, h, i = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
  # Held until the session is made: ORT reads external data then.
  external = (tempfile.TemporaryDirectory(prefix="ort_qmoe_")
              if _ort_layer_bytes(shape, block_size) * len(layers) > ORT_GRAPH_BYTES else None)
  inits, nodes, x = [], [], "input"
  for l in layers:
    rng = np.random.default_rng((seed + l, 7))
    # Random bytes are random int4 pairs in any nibble order; zero point defaults to 8.
    fc1 = rng.integers(0, 256, (e, 2 * i, h // 2), dtype=np.uint8)
    fc2 = rng.integers(0, 256, (e, h, i // 2), dtype=np.uint8)
    s1 = (rng.uniform(0.5, 1.5, (e, 2 * i, h // block_size)) / (8 * np.sqrt(h))).astype(np.float32)
    s2 = (rng.uniform(0.5, 1.5, (e, h, i // block_size)) / (8 * np.sqrt(i))).astype(np.float32)
    names = [f"fc1_w_{l}", f"fc1_s_{l}", f"fc2_w_{l}", f"fc2_s_{l}"]
    inits += [_ort_initializer(a, n, external and external.name)
              for a, n in zip((fc1, s1, fc2, s2), names)]
    del fc1, fc2
    nodes.append(helper.make_node(
        "QMoE", [x, f"router_probs_{l}", names[0], names[1], "", names[2], names[3]],
        [f"moe_{l}"], domain="com.microsoft", k=k, activation_type="swiglu", swiglu_fusion=1,
        expert_weight_bits=4, block_size=block_size, accuracy_level=4,
        normalize_routing_weights=1, activation_alpha=1.0, activation_beta=0.0))
    out = "output" if l == layers[-1] else f"x_{l + 1}"
    nodes.append(helper.make_node("Add", [x, f"moe_{l}"], [out]))
    x = out
  graph = helper.make_graph(
      nodes, "qmoe_layers",
      [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["T", h])] +
      [helper.make_tensor_value_info(f"router_probs_{l}", TensorProto.FLOAT, ["T", e])
       for l in layers],
      [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["T", h])], inits)
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                  helper.make_opsetid("com.microsoft", 1)])
  options = ort.SessionOptions()
  options.intra_op_num_threads = threads
  options.inter_op_num_threads = 1
  options.add_session_config_entry("session.intra_op.allow_spinning", "0")
  options.add_session_config_entry("session.inter_op.allow_spinning", "0")
  try:
    if external is None:
      source = model.SerializeToString()
    else:
      source = os.path.join(external.name, "model.onnx")
      onnx.save_model(model, source)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    session.run(None, {"input": np.ones((1, h), np.float32),
                       **{f"router_probs_{l}": np.ones((1, e), np.float32)
                          for l in layers}})
  except Exception as err:  # ORT raises its own exception types
    return None, f"onnxruntime {ort.__version__} refused QMoE: {str(err).splitlines()[0][:200]}"
  finally:
    if external is not None:
      external.cleanup()  # the session holds its own copy of the weights
  return session, f"onnxruntime {ort.__version__}" + (", weights as external data" if external else "")


# kt-kernel's methods: AMXINT4 / AMXINT8 quantized online from bf16 (its AMX and AVX-512 builds);
# GPTQINT4 (its AVX2 GPTQ kernel) and GPTQINT4_VNNI256 (its AVX-VNNI 256-bit packed GPTQ kernel)
# load symmetric GPTQ int4 experts written from ours exactly (every build has them).
KTK_METHODS = ("AMXINT4", "AMXINT8", "GPTQINT4", "GPTQINT4_VNNI256")
KTK_CLASSES = {"AMXINT4": "AMXInt4_MOE", "AMXINT8": "AMXInt8_MOE",
               "GPTQINT4": "AVX2GPTQInt4_MOE", "GPTQINT4_VNNI256": "AVXVNNI256GPTQInt4Packed_MOE"}
KTK_GPTQ_METHODS = ("GPTQINT4", "GPTQINT4_VNNI256")
KTK_M_STEP = 32  # its token buffers are sized in steps of this many rows
# Its workers spin for 50 ms after a job before they sleep (measured here: 1-2 cores busy for
# 40-50 ms after a call, then none); the harness waits this long, untimed, after each of its calls.
KTK_SPIN_SECONDS = 0.06


def ktk_import(path: str | None, variant: str | None):
  """(kt_kernel, None) or (None, why): kt-kernel imported from `path` (first on sys.path) or from
  wherever Python finds it, with its build chosen by the CPU flags or by `variant`."""
  if path:
    if not os.path.isdir(path):
      return None, f"--ktk-path {path!r} is not a directory"
    sys.path.insert(0, os.path.abspath(path))
  if variant:
    os.environ["KT_KERNEL_CPU_VARIANT"] = variant
  try:
    import kt_kernel
  except Exception as err:  # ImportError, or its loader's RuntimeError / OSError
    return None, (f"kt-kernel does not import ({type(err).__name__}: "
                  f"{str(err).splitlines()[0][:200] if str(err) else ''}); `pip install --no-deps "
                  "kt-kernel` (it pins its own torch) or pass --ktk-path")
  return kt_kernel, None


def _cpulist(text: str) -> set[int]:
  """CPUs of a sysfs cpulist ("0-3,8,10-11")."""
  cpus: set[int] = set()
  for part in text.strip().split(","):
    if part:
      lo, _, hi = part.partition("-")
      cpus.update(range(int(lo), int(hi or lo) + 1))
  return cpus


def ktk_numa_node() -> int:
  """The NUMA node holding most of this process's CPUs (kt-kernel binds its workers to the cores
  of the node it is given); 0 where sysfs does not say."""
  try:
    allowed = os.sched_getaffinity(0)
    nodes = {}
    for entry in os.listdir("/sys/devices/system/node"):
      if entry.startswith("node") and entry[4:].isdigit():
        with open(f"/sys/devices/system/node/{entry}/cpulist") as f:
          nodes[int(entry[4:])] = len(_cpulist(f.read()) & allowed)
    return max(nodes, key=lambda n: (nodes[n], -n)) if nodes else 0
  except (OSError, ValueError):
    return 0


def _torch_bf16(a: np.ndarray):
  """A torch bf16 tensor sharing an ml_dtypes bf16 array's bytes (made contiguous first)."""
  import torch
  a = np.array(a, copy=True, order="C")  # writable and contiguous: torch refuses read-only arrays
  return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


@functools.cache
def _gptq_packer():
  """The checkpoint loader's GPTQ packing (int4 [out, in] -> qweight int32 [in / 8, out]), jitted
  once per process."""
  from jax_moeq.quant import int4
  return jax.jit(int4.pack_uint4b8_gptq)


def gptq_int4(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """One projection's int4 values q [out, in] in [-8, 7] and scales [out, in / group] as
  symmetric GPTQ tensors (the AutoGPTQ layout): qweight int32 [in / 8, out], input k in bits
  4 (k % 8) of row k // 8 as q + 8; scales float32 [in / group, out]. Exact: q · scale is the
  same weight. Both writable numpy arrays (torch refuses read-only ones)."""
  qweight = np.array(_gptq_packer()(q), copy=True)
  return qweight, np.ascontiguousarray(scale.astype(np.float32).T)


class KtkLayers:
  """kt-kernel experts of `layers` layers for each method, on one worker pool of `threads` threads:
  quantized by kt-kernel from the layers' bf16 weights (AMXINT4 / AMXINT8; gate = w13[:, :I],
  up = w13[:, I:]), or our int4 experts exactly as GPTQ tensors (GPTQ methods)."""

  def __init__(self, kt_kernel, shape: Shape, stacks: list[Experts], methods: list[str],
               threads: int, max_tokens: int):
    import torch
    ext = kt_kernel.kt_kernel_ext
    self.torch = torch
    self.shape = shape
    self.variant = str(kt_kernel.__cpu_variant__)
    self.version = str(getattr(kt_kernel, "__version__", "?"))
    config = ext.WorkerPoolConfig()
    config.subpool_count = 1
    self.numa_node = ktk_numa_node()
    config.subpool_numa_map = [self.numa_node]
    config.subpool_thread_count = [threads]
    self.cpu_infer = ext.CPUInfer(config)
    # Token buffers hold max_len rows; longer calls would overrun them.
    self.max_len = KTK_M_STEP * max(1, math.ceil(max_tokens / KTK_M_STEP))
    self.gpu_mask = torch.zeros(shape.num_experts, dtype=torch.bool)  # every expert on the CPU
    self.expert_map = torch.arange(shape.num_experts, dtype=torch.int64)
    self.skipped: dict[str, str] = {}
    self.methods: dict[str, list] = {}
    flags = _timing.cpu_model_and_flags()[1]
    if not methods:  # its fastest kernels here: AMX / AVX-512 online-quantized, else GPTQ
      online = [m for m in KTK_METHODS
                if m not in KTK_GPTQ_METHODS and getattr(ext.moe, KTK_CLASSES[m], None)]
      methods = online or list(KTK_GPTQ_METHODS)
    for method in methods:
      if getattr(ext.moe, KTK_CLASSES[method], None) is None:
        self.skipped[method] = (f"kt-kernel's {self.variant} build has no {KTK_CLASSES[method]} "
                                "(its AVX2 build quantizes no int4/int8 experts online)")
      elif method == "GPTQINT4_VNNI256" and "avx_vnni" not in flags:
        self.skipped[method] = "this CPU has no AVX-VNNI (avx_vnni), which its kernel needs"
      elif method in KTK_GPTQ_METHODS and stacks and stacks[0].group_size <= 0:
        self.skipped[method] = ("its GPTQ loader takes one group size for both projections; "
                                "channel-wise groups differ (H against I)")
      else:
        self.methods[method] = []
    i = shape.intermediate_size
    online = [m for m in self.methods if m not in KTK_GPTQ_METHODS]
    gptq = [m for m in self.methods if m in KTK_GPTQ_METHODS]
    for layer, experts in enumerate(stacks if online else []):
      had_bf16 = experts._bf16 is not None
      w13, w2 = (np.asarray(a) for a in experts.bf16())
      gate, up, down = _torch_bf16(w13[:, :i]), _torch_bf16(w13[:, i:]), _torch_bf16(w2)
      del w13, w2
      for method in online:
        self.methods[method].append(self._load(ext, cls_name=KTK_CLASSES[method], layer=layer,
                                               gate=gate, up=up, down=down))
      del gate, up, down
      if not had_bf16:
        experts._bf16 = None
    for layer, experts in enumerate(stacks if gptq else []):
      for method in gptq:
        self.methods[method].append(self._load_gptq(ext, KTK_CLASSES[method], layer, experts))

  def _config(self, ext, layer: int):
    """A layer's MOEConfig: every expert on the CPU, this pool, buffers of max_len rows, nothing
    saved to or loaded from disk."""
    s = self.shape
    config = ext.moe.MOEConfig(s.num_experts, s.top_k, s.hidden_size, s.intermediate_size,
                               self.gpu_mask.data_ptr())
    config.layer_idx = layer
    config.pool = self.cpu_infer.backend_
    config.max_len = self.max_len
    config.save, config.load = False, False
    return config

  def _loaded(self, moe):
    """`moe` after its weights are loaded (its load task run on the pool and waited for)."""
    self.cpu_infer.submit(moe.load_weights_task(self.expert_map.data_ptr()))
    self.cpu_infer.sync()
    return moe

  def _load(self, ext, *, cls_name: str, layer: int, gate, up, down):
    """One layer's experts, quantized from bf16 by kt-kernel (nothing written to disk)."""
    config = self._config(ext, layer)
    config.gate_proj, config.up_proj, config.down_proj = (
        gate.data_ptr(), up.data_ptr(), down.data_ptr())
    return self._loaded(getattr(ext.moe, cls_name)(config))

  def _load_gptq(self, ext, cls_name: str, layer: int, experts: Experts):
    """One layer's experts handed to kt-kernel as symmetric GPTQ int4 tensors (per expert: gate,
    up, down qweight and float32 scales), converted from ours exactly; kt-kernel repacks them
    into its own buffers while loading, so they are freed after."""
    torch = self.torch
    s = self.shape
    i = s.intermediate_size
    had_q = experts._q is not None
    q13, s13, q2, s2 = experts.unpacked()
    tensors = {"gate": [], "up": [], "down": []}
    scales = {"gate": [], "up": [], "down": []}
    for e in range(s.num_experts):
      for name, q, sc in (("gate", q13[e, :i], s13[e, :i]), ("up", q13[e, i:], s13[e, i:]),
                          ("down", q2[e], s2[e])):
        qweight, scale = gptq_int4(q, sc)
        tensors[name].append(torch.from_numpy(qweight))
        scales[name].append(torch.from_numpy(scale))
    if not had_q:
      experts._q = None
    config = self._config(ext, layer)
    config.gate_projs = [[t.data_ptr() for t in tensors["gate"]]]
    config.up_projs = [[t.data_ptr() for t in tensors["up"]]]
    config.down_projs = [[t.data_ptr() for t in tensors["down"]]]
    config.gate_scales = [[t.data_ptr() for t in scales["gate"]]]
    config.up_scales = [[t.data_ptr() for t in scales["up"]]]
    config.down_scales = [[t.data_ptr() for t in scales["down"]]]
    config.quant_config.bits = 4
    config.quant_config.group_size = experts.group_size
    config.quant_config.zero_point = False
    moe = self._loaded(getattr(ext.moe, cls_name)(config))
    del tensors, scales  # kept alive until the load task has copied them
    return moe

  def feeds(self, routings: list) -> list:
    """(topk_ids int64, topk_weights f32) torch tensors of each routing (ids, w, logits)."""
    torch = self.torch
    return [(torch.from_numpy(np.asarray(ids).astype(np.int64)),
             torch.from_numpy(np.asarray(w, np.float32).copy())) for ids, w, _ in routings]

  def caller(self, method: str, x: np.ndarray, feeds: list, layers: int):
    """call(j): every layer l on feeds[(j * layers + l) % len(feeds)], chained as ours are
    (x <- x + moe_l(x), bf16), each layer submitted and waited for; returns x."""
    torch = self.torch
    moes = self.methods[method][:layers]
    tokens = x.shape[0]
    if tokens > self.max_len:
      raise ValueError(f"kt-kernel peer: T={tokens} exceeds its buffers' {self.max_len} rows")
    x0 = _torch_bf16(x)
    y = torch.empty_like(x0)
    out = torch.empty_like(x0)
    qlen = torch.tensor([tokens], dtype=torch.int32)
    k = self.shape.top_k

    def call(j):
      y.copy_(x0)
      for l, moe in enumerate(moes):
        ids, w = feeds[(j * layers + l) % len(feeds)]
        self.cpu_infer.submit(moe.forward_task(qlen.data_ptr(), k, ids.data_ptr(), w.data_ptr(),
                                               y.data_ptr(), out.data_ptr(), False))
        self.cpu_infer.sync()
        y.add_(out)
      return y
    return call

  def one_layer(self, method: str, x: np.ndarray, ids, w) -> np.ndarray:
    """Layer 0 alone on one routing, as float32 numpy."""
    torch = self.torch
    x0 = _torch_bf16(x)
    out = torch.full_like(x0, float("nan"))  # poisoned: a row the kernel skips shows
    (ids_t, w_t), = self.feeds([(ids, w, None)])
    qlen = torch.tensor([x.shape[0]], dtype=torch.int32)
    self.cpu_infer.submit(self.methods[method][0].forward_task(
        qlen.data_ptr(), self.shape.top_k, ids_t.data_ptr(), w_t.data_ptr(), x0.data_ptr(),
        out.data_ptr(), False))
    self.cpu_infer.sync()
    return out.float().numpy()


def ktk_peer(shape: Shape, stacks: list[Experts], args, notes: list[str]) -> KtkLayers | None:
  """kt-kernel's layers for this shape, or None with the reason in `notes` (and printed)."""
  kt_kernel, why = ktk_import(args.ktk_path, args.ktk_variant)
  if kt_kernel is None:
    notes.append(f"kt-kernel skipped: {why}")
    progress(f"kt-kernel skipped: {why}")
    return None
  # Its caller spins in CPUInfer.sync() while the pool works: a pool as large as the core count
  # oversubscribes them, and every layer then waits out two 4 ms scheduler ticks (measured on the
  # 2-core VM and the 16-core Xeon: 8-9 ms a layer at T=1 whatever the experts).
  threads = args.ktk_threads or max(1, args.threads_used - 1)
  progress(f"{shape.name}: kt-kernel loading {len(stacks)} layers "
           f"({','.join(args.ktk_methods) or 'its default methods'}, {threads} threads)")
  start = time.perf_counter()
  try:
    ktk = KtkLayers(kt_kernel, shape, stacks, args.ktk_methods, threads, max(args.tokens))
  except Exception as err:  # its extension raises RuntimeError on shapes it refuses
    why = f"kt-kernel refused {shape.name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    notes.append(why)
    progress(why)
    return None
  for method, why in ktk.skipped.items():
    notes.append(f"kt-kernel {method} skipped: {why}")
    progress(f"kt-kernel {method} skipped: {why}")
  if not ktk.methods:
    return None
  online = [m for m in ktk.methods if m not in KTK_GPTQ_METHODS]
  gptq = [m for m in ktk.methods if m in KTK_GPTQ_METHODS]
  how = "; ".join(
      ([f"{', '.join(online)} quantized by its online quantizer from the bf16 weights"]
       if online else [])
      + ([f"{', '.join(gptq)} given our int4 experts as exact symmetric GPTQ tensors"]
         if gptq else []))
  notes.append(f"kt-kernel {ktk.version} ({ktk.variant} build): {how}, loaded in "
               f"{time.perf_counter() - start:.0f} s; {len(stacks)} layers chained as ours, one "
               f"worker pool of {threads} threads on NUMA node {ktk.numa_node}, each layer "
               "submitted and waited for (CPUInfer.submit / sync, the caller spinning); after "
               "each of its calls the "
               f"harness rests {KTK_SPIN_SECONDS * 1e3:.0f} ms, untimed, while its workers spin "
               "down (they spin 50 ms after a job), so they take no core from the next contender")
  return ktk


def ktk_accuracy(shape: Shape, experts: Experts, ktk: KtkLayers, ours, packed, x, routing,
                 tokens: int) -> str:
  """Layer 0 on one routing, ours and kt-kernel's against the float reference on the same bf16
  weights (fused_moe_float: float32 GEMMs, bf16 rounding points)."""
  from jax_moeq import reference
  ids, w, _ = routing
  had_bf16 = experts._bf16 is not None
  w13, w2 = experts.bf16()
  want = np.asarray(jax.jit(reference.fused_moe_float)(x, ids, w, w13, w2).astype(jnp.float32))
  del w13, w2
  if not had_bf16:
    experts._bf16 = None
  errors = {"ours": np.asarray(ours(x, ids, w, *packed).astype(jnp.float32))}
  for method in ktk.methods:
    errors[f"kt-kernel {method}"] = ktk.one_layer(method, np.asarray(x), ids, w)
  norm = np.linalg.norm(want)
  parts = []
  for name, got in errors.items():
    bad = int(np.count_nonzero(~np.isfinite(got)))
    parts.append(f"{name} {np.linalg.norm(np.nan_to_num(got) - want) / norm:.1e}"
                 + (f" ({bad} non-finite)" if bad else ""))
  return (f"check at T={tokens}, layer 0, against the float reference on the same bf16 weights "
          "(fused_moe_float): rel. Frobenius error " + ", ".join(parts))


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


MIN_LAYERS = 4  # layers per call share its fixed costs, as in a model


def expert_packed_bytes(shape: Shape, group_size: int) -> int:
  """Bytes of one packed expert (w13 and w2) in our layout."""
  from jax_moeq.ops.w4a8_cpu import w4a8_packed_bytes
  h, i = shape.hidden_size, shape.intermediate_size
  return w4a8_packed_bytes(2 * i, h, group_size) + w4a8_packed_bytes(h, i, group_size)


def mean_experts_hit(ring) -> float:
  """Distinct experts a layer reads, averaged over the ring's routings."""
  return float(np.mean([len(np.unique(np.asarray(r[0]))) for r in ring]))


def ring_size(shape: Shape, tokens: int, layers: int, expert_bytes: int, llc_bytes: int | None,
              minimum: int) -> int:
  """Routings to cycle through, a multiple of `layers`: layer l of call j takes routing
  (j * layers + l) % size, so a (layer, routing) pair comes back every size / layers calls. The
  calls in between must read at least twice the last-level cache (the experts they hit), or a
  layer would find its experts still cached at small T."""
  e, k = shape.num_experts, shape.top_k
  hit_bytes = e * (1 - (1 - k / e) ** tokens) * expert_bytes  # expected distinct experts hit
  calls_between = math.ceil(2 * llc_bytes / (layers * hit_bytes)) if llc_bytes else 0
  return layers * max(math.ceil(minimum / layers), calls_between + 1)


def default_layers(layer_bytes: int, llc_bytes: int | None) -> int:
  """Layers whose packed experts together hold at least twice the last-level cache
  (>= MIN_LAYERS)."""
  if not llc_bytes:
    return MIN_LAYERS
  return max(MIN_LAYERS, math.ceil(2 * llc_bytes / layer_bytes))


def interleaved_times(calls: list, *, warmup: int, target_seconds: float, min_repeats: int,
                      max_repeats: int, rest_after: list[float] | None = None
                      ) -> list[list[float]]:
  """Seconds of each of `calls` (callables of the call index j), called in turn j = 0, 1, ...
  so that every contender sees the same machine state; warm-up rounds are not timed. After call
  c the loop sleeps rest_after[c] seconds, untimed (a pool whose threads spin on after a job
  would otherwise take the cores from the next contender)."""
  rest_after = rest_after or [0.0] * len(calls)
  for j in range(warmup):
    for c, call in enumerate(calls):
      _timing.block(call(j))
      if rest_after[c]:
        time.sleep(rest_after[c])
  times: list[list[float]] = [[] for _ in calls]
  spent, j = 0.0, warmup
  while j - warmup < max_repeats:
    for c, call in enumerate(calls):
      start = time.perf_counter()
      _timing.block(call(j))
      elapsed = time.perf_counter() - start
      times[c].append(elapsed)
      spent += elapsed
      if rest_after[c]:
        time.sleep(rest_after[c])
    j += 1
    if j - warmup >= min_repeats and spent >= target_seconds:
      break
  return times


@dataclasses.dataclass
class Row:
  """One T of one shape: what the table, the JSON and the plot print."""
  tokens: int
  ours_s: float
  ours_best_s: float
  calls: int
  weight_gbps: float
  dram_fraction: float
  gops: float
  ort_s: float | None = None
  ref_s: float | None = None
  xla_s: float | None = None
  xla_name: str | None = None
  load: float = 0.0
  isa_s: dict[str, float] = dataclasses.field(default_factory=dict)  # --isas: path -> median s
  ktk_s: dict[str, float] = dataclasses.field(default_factory=dict)  # kt-kernel method -> median s


def bench_shape(shape: Shape, args, dram_gbps: float, llc_bytes: int | None
                ) -> tuple[str, list[str], list[Row]]:
  notes: list[str] = []
  h, i, g = shape.hidden_size, shape.intermediate_size, args.group_size
  expert_bytes = expert_packed_bytes(shape, g)
  layer_bytes = shape.num_experts * expert_bytes
  layers = args.layers or default_layers(layer_bytes, llc_bytes)
  progress(f"{shape.name}: packing {layers} layers of {shape.num_experts} experts "
           f"({layer_bytes / 1e6:.0f} MB packed per layer)")
  start = time.perf_counter()
  stacks = [Experts(shape, g, args.seed + layer) for layer in range(layers)]
  packed = [e.packed() for e in stacks]
  for e in stacks[1:]:
    e.drop()  # the packed arrays stay referenced in `packed`; layer 0 keeps its int8 for peers
  progress(f"{shape.name}: packed in {time.perf_counter() - start:.1f} s")
  notes.append(f"{layers} layers per call, {layers * layer_bytes / 1e6:.0f} MB of packed experts "
               f"in all (last-level cache {llc_bytes / 2**20 if llc_bytes else 0:.0f} MiB)")
  ours = ours_fn(shape, g)  # one layer: the reference check
  ours_stack = ours_stack_fn(shape, g)
  baselines = set(args.baselines)
  sessions = None
  if "ort" in baselines:
    progress(f"{shape.name}: building ORT graphs of {layers} QMoE layers "
             f"({args.threads_used} threads)")
    sessions, why = ort_layers(shape, layers, args.seed, args.threads_used)
    if sessions is None:
      notes.append(f"ORT QMoE skipped: {why}")
    else:
      notes.append(f"ORT: {why} of QMoE + Add layers (own weights), {args.threads_used} "
                   "intra-op threads, spinning off")
  ktk = None
  if "ktk" in baselines:
    ktk = ktk_peer(shape, stacks, args, notes)
  budgets = {name: Budget(args.baseline_budget) for name in ("ref", "ragged", "dense")}
  reference = reference_fn(g) if "ref" in baselines else None
  ragged, dense = (ragged_fn(), dense_fn()) if "xla" in baselines else (None, None)
  rows: list[Row] = []
  ref_weights = None
  for tokens in args.tokens:
    ring = routing_ring(shape, tokens, ring_size(shape, tokens, layers, expert_bytes, llc_bytes,
                                                 args.ring), args.seed)
    x = jax.random.normal(jax.random.key(tokens), (tokens, h), jnp.float32).astype(jnp.bfloat16)
    x32 = np.asarray(x.astype(jnp.float32))
    pick = lambda j, l: ring[(j * layers + l) % len(ring)]  # the peers' routings, as ours
    ours_call = ring_call(ours_stack, x, ring, packed)
    calls = [ours_call]
    # Other kernel paths, each call under its JAX_MOEQ_CPU_ISA (read by the handler per call).
    for isa in args.isas[1:]:
      calls.append(lambda j, isa=isa: _with_isa(isa, lambda: ours_call(j)))
    if sessions is not None:
      # Per session, per call index: its layers' router inputs (built once, outside the timing).
      router_feeds = [[{f"router_probs_{l}": pick(j, l)[2] for l in held}
                       for j in range(len(ring))] for _, held in sessions]

      def ort_call(j):
        y = x32
        for (session, _), feeds in zip(sessions, router_feeds):
          y = session.run(None, {"input": y, **feeds[j % len(ring)]})[0]
        return y
      calls.append(ort_call)
    ktk_methods = list(ktk.methods) if ktk is not None else []
    if ktk_methods:
      ktk_feeds = ktk.feeds(ring)  # built once, outside the timed calls
      x_np = np.asarray(x)
      for method in ktk_methods:
        calls.append(ktk.caller(method, x_np, ktk_feeds, layers))
    load = os.getloadavg()[0]
    rest_after = [0.0] * (len(calls) - len(ktk_methods)) + [KTK_SPIN_SECONDS] * len(ktk_methods)
    times = interleaved_times(calls, warmup=2, target_seconds=args.target_seconds,
                              min_repeats=5, max_repeats=400, rest_after=rest_after)
    times = [[t / layers for t in ts] for ts in times]  # per layer
    seconds = float(np.median(times[0]))
    hit = mean_experts_hit(ring)
    gbps = hit * expert_bytes / seconds / 1e9
    row = Row(tokens, seconds, min(times[0]), len(times[0]), gbps, gbps / dram_gbps,
              int8_ops(shape, tokens) / seconds / 1e9, load=load)
    for c, isa in enumerate(args.isas[1:], start=1):
      row.isa_s[isa] = float(np.median(times[c]))
    if sessions is not None:
      row.ort_s = float(np.median(times[len(args.isas[1:]) + 1]))
    for c, method in enumerate(ktk_methods, start=len(calls) - len(ktk_methods)):
      row.ktk_s[method] = float(np.median(times[c]))
    if args.time_split and tokens in args.time_split:
      notes.append(f"T={tokens}: " + time_split(ours_call, calls=max(50, 200 // layers),
                                                layers=layers, threads=args.threads_used))
    progress(f"{shape.name}: T={tokens} ours {seconds * 1e3:.2f} ms ({len(times[0])} calls), "
             f"{gbps:.1f} GB/s ({100 * row.dram_fraction:.0f} % of DRAM), {row.gops:.0f} GOP/s"
             + (f"; ORT {row.ort_s * 1e3:.2f} ms" if row.ort_s else "")
             + "".join(f"; kt-kernel {m} {t * 1e3:.2f} ms" for m, t in row.ktk_s.items()))
    if ktk_methods and tokens == min(args.tokens, key=lambda t: abs(t - 8)):
      notes.append(ktk_accuracy(shape, stacks[0], ktk, ours, packed[0], x, ring[0], tokens))
    if reference is not None:
      if ref_weights is None:
        ref_weights = tuple(jnp.asarray(a) for a in stacks[0].unpacked())
      if tokens == min(args.tokens, key=lambda t: abs(t - 8)):
        ids, w, _ = ring[0]  # layer 0 alone
        want = np.asarray(reference(x, ids, w, *ref_weights).astype(jnp.float32))
        got = np.asarray(ours(x, ids, w, *packed[0]).astype(jnp.float32))
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        notes.append(f"check at T={tokens}: kernel vs jnp reference rel. Frobenius error {err:.1e} "
                     "(bf16)")
      row.ref_s = time_baseline("jnp reference", budgets["ref"], tokens,
                                lambda j: reference(x, pick(j, 0)[0], pick(j, 0)[1], *ref_weights),
                                args)
    if ragged is not None:
      w13, w2 = stacks[0].bf16()
      r_s = time_baseline("bf16 ragged_dot", budgets["ragged"], tokens,
                          lambda j: ragged(x, pick(j, 0)[0], pick(j, 0)[1], w13, w2), args)
      d_s = time_baseline("bf16 dense einsum", budgets["dense"], tokens,
                          lambda j: dense(x, pick(j, 0)[0], pick(j, 0)[1], w13, w2), args)
      candidates = [(t, n) for t, n in ((r_s, "ragged_dot"), (d_s, "einsum")) if t is not None]
      if candidates:
        row.xla_s, row.xla_name = min(candidates)
    rows.append(row)
  for e in stacks:
    e.drop()
  ktk_cols = list(ktk.methods) if ktk is not None else []
  header = ["T", "load", "ours ms", "ours best ms", "weights GB/s", "% DRAM", "int8 GOP/s",
            *[f"{isa} ms" for isa in args.isas[1:]],
            "ORT QMoE ms", "vs ORT", *[f"kt-kernel {m} ms (vs ours)" for m in ktk_cols],
            "jnp ref ms", "vs ref", "bf16 XLA ms", "vs XLA"]
  table = [[r.tokens, f"{r.load:.1f}", fmt_ms(r.ours_s), fmt_ms(r.ours_best_s),
            f"{r.weight_gbps:.1f}", f"{100 * r.dram_fraction:.0f}", f"{r.gops:.0f}",
            *[f"{fmt_ms(r.isa_s[isa])} ({r.ours_s / r.isa_s[isa]:.2f}x)" for isa in args.isas[1:]],
            fmt_ms(r.ort_s), ratio(r.ort_s, r.ours_s),
            *[None if m not in r.ktk_s else f"{fmt_ms(r.ktk_s[m])} ({ratio(r.ktk_s[m], r.ours_s)})"
              for m in ktk_cols],
            fmt_ms(r.ref_s), ratio(r.ref_s, r.ours_s),
            None if r.xla_s is None else f"{fmt_ms(r.xla_s)} ({r.xla_name})",
            ratio(r.xla_s, r.ours_s)] for r in rows]
  title = (f"### {shape.name} (E={shape.num_experts}, top-{shape.top_k}, H={h}, I={i}, "
           f"group {g}; {expert_bytes / 1e6:.2f} MB packed per expert)")
  return title + "\n\n" + markdown_table(header, table), notes, rows


def _with_isa(isa: str, call):
  """call() with JAX_MOEQ_CPU_ISA=isa, the variable restored after."""
  with _timing.env_applied({"JAX_MOEQ_CPU_ISA": isa}):
    return _timing.block(call())


def stage_times(call, *, first: int, calls: int) -> tuple[dict, float]:
  """The kernel's stage clock over call(first) .. call(first + calls - 1) (its sums, as
  `w4a8_moe_profile_take` gives them), and the calls' wall seconds."""
  from jax_moeq import _ffi
  module = _ffi.cpu_module()
  module.w4a8_moe_profile(True)
  try:
    module.w4a8_moe_profile_take()
    start = time.perf_counter()
    for j in range(first, first + calls):
      _timing.block(call(j))
    wall = time.perf_counter() - start
  finally:
    module.w4a8_moe_profile(False)
  return module.w4a8_moe_profile_take(), wall


def time_split(call, *, calls: int, layers: int, threads: int) -> str:
  """Where a layer's time goes, from the kernel's own stage clock (µs per layer, mean over
  `calls` calls of `layers` layers): each stage's wall time and, for the parallel ones, the
  launch-to-first-piece dispatch, the mean busy time per thread, the last-piece-to-return
  join, the threads that ran pieces, when the last of them started its first piece, and each
  one's mean idle time between its last piece and the stage's last. What is left of a stage's
  wall time is imbalance (threads idle while others finish)."""
  _timing.block(call(0))
  taken, wall = stage_times(call, first=0, calls=calls)
  wall /= calls * layers
  us = lambda ns: ns / (calls * layers) / 1e3
  parts, kernel = [], 0.0
  for name, t in taken["stages"].items():
    kernel += us(t["wall_ns"])
    if t["pieces"]:
      busy = us(t["busy_ns"]) / threads
      ran = t.get("threads", 0) / (calls * layers)  # absent from libraries before a1b739f
      tail = t.get("idle_tail_ns", 0) / max(1, t.get("threads", 0)) / 1e3
      spread = (f" on {ran:.1f} threads, last thread in at {us(t['late_start_ns']):.0f}, idle "
                f"tail/thread {tail:.0f}") if ran else ""
      parts.append(f"{name} {us(t['wall_ns']):.0f} (dispatch {us(t['dispatch_ns']):.0f}, busy/thread "
                   f"{busy:.0f}, join {us(t['join_ns']):.0f}, {t['pieces'] / (calls * layers):.0f} "
                   f"pieces{spread})")
    else:
      parts.append(f"{name} {us(t['wall_ns']):.0f}")
  return (f"time split (µs per layer, {threads} threads, {calls} calls of {layers} layers): layer "
          f"{wall * 1e6:.0f}, kernel {kernel:.0f}, outside the kernel {wall * 1e6 - kernel:.0f}; "
          + "; ".join(parts))


def machine_lines(threads: int, dram: dict[str, float], llc: tuple[int, int] | None) -> list[str]:
  from jax_moeq import _ffi
  module = _ffi.cpu_module()
  model, flags = _timing.cpu_model_and_flags()
  isa = "+".join(f for f in _timing.ISA_FLAGS if f in flags) or "none of " + "/".join(
      _timing.ISA_FLAGS[:3])
  llc_text = f"L{llc[0]} {llc[1] / 2**20:.0f} MiB" if llc else "LLC unknown"
  return [
      f"- machine: {model}, {_timing.usable_cores()} usable cores, {isa}, {llc_text}; "
      f"kernel ISA {module.selected_isa()} (available {list(module.available_isas())})",
      f"- threads: {threads} (XLA's intra-op pool, PJRT_NPROC; ORT's intra-op threads the same; "
      "kt-kernel's worker pool in its note)",
      f"- DRAM read bandwidth ({dram['nbytes'] / 2**30:.1f} GiB array, {dram['threads']} threads): "
      f"{dram['best']:.1f} GB/s (" + ", ".join(f"{k} {dram[k]:.1f}" for k in ("native", "numpy", "xla")
                                   if k in dram) + ")",
  ]


def plot(results: dict[str, list[Row]], path: str, title: str) -> None:
  """Time against T (ours, ORT, bf16 XLA) and our DRAM fraction, one column per shape."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker
  except ImportError:
    progress("--plot needs matplotlib (pip install matplotlib); no plot written")
    return
  fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 7), squeeze=False)
  for col, (name, rows) in enumerate(results.items()):
    t = [r.tokens for r in rows]
    ax = axes[0][col]
    ax.plot(t, [r.ours_s * 1e3 for r in rows], "o-",
            label="jax_moeq W4A8" + (f" ({os.environ['JAX_MOEQ_CPU_ISA']})"
                                     if rows and rows[0].isa_s else ""))
    for isa in (rows[0].isa_s if rows else {}):
      ax.plot(t, [r.isa_s[isa] * 1e3 for r in rows], "o:", label=f"jax_moeq W4A8 ({isa})")
    for attr, label in (("ort_s", "ORT QMoE (int4, accuracy_level 4)"), ("xla_s", "bf16 XLA")):
      pts = [(r.tokens, getattr(r, attr) * 1e3) for r in rows if getattr(r, attr)]
      if pts:
        ax.plot(*zip(*pts), "s--", label=label)
    for method in dict.fromkeys(m for r in rows for m in r.ktk_s):
      pts = [(r.tokens, r.ktk_s[method] * 1e3) for r in rows if method in r.ktk_s]
      ax.plot(*zip(*pts), "^--", label=f"kt-kernel {method}")
    ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="ms per layer", title=name)
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1][col]
    ax.plot(t, [100 * r.dram_fraction for r in rows], "o-")
    ax.axhline(85, color="gray", ls=":", label="85 % target")
    ax.set(xscale="log", xlabel="tokens T", ylabel="% of DRAM read bandwidth (weights hit)")
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  progress(f"plot written to {path}")


def _without_option(argv: list[str], name: str) -> list[str]:
  """argv without `name VALUE` / `name=VALUE` (other arguments kept, whatever their values)."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg == name:
      skip = True
    elif not arg.startswith(name + "="):
      out.append(arg)
  return out


def thread_scaling(args, argv: list[str]) -> str:
  """One process per thread count (XLA's pool is sized at start), each printing JSON rows."""
  cores = _timing.usable_cores()
  counts = [n for n in args.thread_scaling if n <= cores]
  skipped = [n for n in args.thread_scaling if n > cores]
  rows, dram = [], []
  for n in counts:
    progress(f"thread scaling: {n} thread(s)")
    child = _without_option(argv, "--thread-scaling")
    cmd = [sys.executable, os.path.abspath(__file__), *child, "--threads", str(n), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
      raise SystemExit(f"thread scaling at {n} threads failed:\n{out.stderr[-2000:]}")
    # The last JSON line: kt-kernel's C++ prints to stdout as well, up to its exit.
    result = json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])
    dram.append(result["dram_gbps"])
    for shape, shape_rows in result["rows"].items():
      for r in shape_rows:
        rows.append([n, shape, r["tokens"], fmt_ms(r["ours_s"]), f"{r['weight_gbps']:.1f}",
                     f"{100 * r['dram_fraction']:.0f}", f"{r['gops']:.0f}", fmt_ms(r["ort_s"]),
                     ratio(r["ort_s"], r["ours_s"])])
  header = ["threads", "shape", "T", "ours ms", "weights GB/s", "% DRAM", "int8 GOP/s",
            "ORT ms", "vs ORT"]
  model, _ = _timing.cpu_model_and_flags()
  text = (f"### Thread scaling\n\n- {model}, {cores} usable cores; DRAM read bandwidth (all "
          f"cores) {min(dram, default=0):.1f}-{max(dram, default=0):.1f} GB/s over the runs; "
          f"% DRAM is of each run's own reading\n\n" + markdown_table(header, rows))
  if skipped:
    text += f"\n\n- not run: {skipped} threads (this machine has {cores} usable cores)"
  return text


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="olmoe,qwen,mixtral",
                      help=f"comma-separated subset of {list(SHAPES)}")
  parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                      help="comma-separated token counts T")
  parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128, -1))
  parser.add_argument("--layers", type=int, default=0,
                      help="layers per call, each with its own weights (default: at least "
                           f"{MIN_LAYERS}, and packed experts >= 2x the last-level cache)")
  parser.add_argument("--threads", type=int,
                      help="XLA intra-op threads (PJRT_NPROC) and ORT's (default: usable cores)")
  parser.add_argument("--thread-scaling", default="",
                      help="comma-separated thread counts, one process each (e.g. 1,2,4,8,16)")
  parser.add_argument("--baselines", default="ort,ktk",
                      help="comma-separated subset of ort,ktk,ref,xla (empty for none; ort and "
                           "ktk are skipped with the reason printed when not installed)")
  parser.add_argument("--ktk-methods", default="",
                      help=f"kt-kernel methods timed (subset of {','.join(KTK_METHODS)}; default: "
                           "AMXINT4,AMXINT8 where its build has them, else its GPTQ kernels)")
  parser.add_argument("--ktk-path", default=os.environ.get("JAX_MOEQ_KTK_PATH"),
                      help="folder holding kt_kernel, kt_kernel.libs and gguf, put first on "
                           "sys.path (default: $JAX_MOEQ_KTK_PATH, else wherever Python finds it)")
  parser.add_argument("--ktk-variant",
                      choices=("amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base",
                               "avx2"),
                      help="kt-kernel build to load (default: its own pick from the CPU flags)")
  parser.add_argument("--ktk-threads", type=int,
                      help="kt-kernel worker pool threads (default: --threads less one: its "
                           "caller spins in sync() beside them)")
  parser.add_argument("--baseline-budget", type=float, default=30.0,
                      help="seconds per ref/xla baseline per shape (T values over it left out)")
  parser.add_argument("--target-seconds", type=float, default=2.0,
                      help="timed seconds per T (all contenders, interleaved)")
  parser.add_argument("--ring", type=int, default=16,
                      help="routings cycled between calls, at least (more when the calls between "
                           "two uses of one would read less than twice the last-level cache)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true",
                      help="OLMoE only, T in {1, 8, 128}, short timings and budgets")
  parser.add_argument("--out", help="also write the markdown report to this file")
  parser.add_argument("--plot", help="write a PNG of time and DRAM fraction against T")
  parser.add_argument("--json", action="store_true", help="end with one JSON line of the rows")
  parser.add_argument("--isas", default="",
                      help="comma-separated kernel paths (JAX_MOEQ_CPU_ISA names): the first is "
                           "'ours', the others timed interleaved beside it (e.g. "
                           "amx_int8,avx512_vnni)")
  parser.add_argument("--time-split", default="",
                      help="comma-separated T values whose kernel time is split by stage "
                           "(dispatch, busy, join; the kernel's stage clock)")
  parser.add_argument("--replot", default="",
                      help="comma-separated JSON files of earlier runs (--json's line): write "
                           "--plot from their rows, shapes side by side, and time nothing")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser.parse_args(argv)
  if args.replot:
    if not args.plot:
      parser.error("--replot needs --plot PATH")
    results, dram = {}, []
    for path in args.replot.split(","):
      with open(path) as f:
        run = json.load(f)
      dram.append(run["dram_gbps"])
      for shape, rows in run["rows"].items():
        results[shape] = [Row(**r) for r in rows]
    plot(results, args.plot, f"{run['threads']} threads; DRAM read "
         f"{min(dram):.0f}-{max(dram):.0f} GB/s over the runs")
    return 0
  if args.quick:
    args.shapes, args.tokens = "olmoe", "1,8,128"
    args.target_seconds, args.baseline_budget = 0.6, 10.0
  args.shapes = [s for s in args.shapes.split(",") if s]
  for s in args.shapes:
    if s not in SHAPES:
      parser.error(f"unknown shape {s!r}; expected some of {list(SHAPES)}")
  args.tokens = [int(t) for t in args.tokens.split(",") if t]
  args.baselines = [b for b in args.baselines.split(",") if b]
  for b in args.baselines:
    if b not in ("ref", "xla", "ort", "ktk"):
      parser.error(f"unknown baseline {b!r}; expected some of ort,ktk,ref,xla")
  args.ktk_methods = [m for m in args.ktk_methods.split(",") if m]
  for m in args.ktk_methods:
    if m not in KTK_METHODS:
      parser.error(f"--ktk-methods: unknown method {m!r}; expected some of {list(KTK_METHODS)}")
  args.thread_scaling = [int(n) for n in args.thread_scaling.split(",") if n]
  args.time_split = [int(t) for t in args.time_split.split(",") if t]
  args.isas = [i for i in args.isas.split(",") if i]
  if args.isas:
    from jax_moeq import _ffi
    available = list(_ffi.cpu_module().available_isas())
    for isa in args.isas:
      if isa not in available:
        parser.error(f"--isas: {isa!r} is not available here ({available})")
    os.environ["JAX_MOEQ_CPU_ISA"] = args.isas[0]
  if args.thread_scaling:
    print(thread_scaling(args, argv))
    return 0
  args.threads_used = args.threads or _timing.usable_cores()
  if args.threads and args.threads > _timing.usable_cores():
    progress(f"--threads {args.threads} exceeds the {_timing.usable_cores()} usable cores")

  llc = _timing.last_level_cache()
  llc_bytes = llc[1] if llc else None
  # DRAM, not cache: an array 8x the last-level cache (at least 1 GiB).
  nbytes = max(1 << 30, 8 * (llc_bytes or 0))
  # The machine's bandwidth, read with every usable core whatever --threads says: the fraction
  # is of what the memory system can deliver.
  probe_threads = _timing.usable_cores()
  progress(f"measuring DRAM read bandwidth ({nbytes / 2**30:.1f} GiB, {probe_threads} threads)")
  dram = read_bandwidth_gbps(nbytes=nbytes, threads=probe_threads)
  dram["threads"] = probe_threads
  dram["nbytes"] = nbytes
  started = time.strftime("%Y-%m-%d %H:%M")
  lines = [
      "## CPU W4A8 fused MoE benchmark", "",
      f"- date: {started}; jax {jax.__version__}",
      f"- command: `python benchmarks/cpu_moe_bench.py {' '.join(argv)}`",
      *machine_lines(args.threads_used, dram, llc),
      "- activations bf16 (ORT: float32, its CPU QMoE input type); times are per layer: medians "
      "over calls of all the layers, divided by the layers (\"best\": the fastest call); GB/s, "
      "% DRAM and GOP/s use the median; ratios are peer median / ours; \"load\": 1-minute load "
      "average before the T was timed; \"—\": not measured",
      "",
  ]
  results: dict[str, list[Row]] = {}
  for name in args.shapes:
    table, notes, rows = bench_shape(SHAPES[name], args, dram["best"], llc_bytes)
    results[SHAPES[name].name] = rows
    lines += [table, ""] + [f"- {n}" for n in notes] + [""]
  report = "\n".join(lines)
  print(report)
  if args.out:
    with open(args.out, "w") as f:
      f.write(report + "\n")
  if args.plot:
    model, _ = _timing.cpu_model_and_flags()
    plot(results, args.plot, f"{model}, {args.threads_used} threads, {started}; DRAM "
                             f"{dram['best']:.1f} GB/s")
  if args.json:
    print(json.dumps({"dram_gbps": dram["best"], "threads": args.threads_used,
                      "rows": {k: [dataclasses.asdict(r) for r in v] for k, v in results.items()}}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
