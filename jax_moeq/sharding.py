"""Expert- and tensor-parallel MoE over a `jax.sharding.Mesh`, with the kernels running per shard.

Expert parallelism (EP, `expert_axis`): the E experts are split into n_ep contiguous blocks, one per
shard. Every shard sees all tokens (replicated), remaps the global expert ids to its local ids, and
sends pairs routed elsewhere to a *null expert*: an extra local expert whose int4 weights, scales'
row corrections and biases are all zero, so its output is exactly 0 for any input and any router
weight (also with `apply_router_weight_on_input`). Partial outputs are summed with `psum`.
The null expert is stored once per shard at packing time (no per-call weight copies).
Dispatch: a shard first tries a compacted call on just its local (token, slot) pairs (a static
capacity of ~capacity_factor * T*K / n_ep rows, gathered from the replicated tokens, results
scatter-added back); if routing is too skewed for that capacity it runs every pair instead
(`lax.cond`), so the result never depends on the capacity, only the work does.

Tensor parallelism (TP, `tensor_axis`): the intermediate dimension I is split into n_tp slices.
Shard j holds gate rows [jI/n, (j+1)I/n) *and* the same up rows of w13 (the gated activation pairs
gate row i with up row i, so both halves must be sliced together), and the same columns of w2.
GEMM2 then yields a partial [T, H] per shard; `psum` adds them. w2's bias is added by shard 0 only.

Both can be combined (a 2-D mesh). Partial outputs are summed in float32 and rounded once to the
activation dtype.

Token dispatch (`dispatch=`):
- "replicated" (the default): every shard sees all T tokens and the shards' partial outputs meet
  in a `psum` of T x H float32, whatever the routing.
- "all_to_all": tokens stay sharded over the expert axis (T / n_ep per shard). Each shard routes
  its own tokens, packs its (token, slot) pairs by the shard that holds their expert into a
  [n_ep, C, H] buffer, exchanges it with `lax.all_to_all`, runs the pairs it received on its local
  experts (each pair a one-slot row: the same kernels), and returns the per-pair outputs by the
  reverse `all_to_all`; each shard then combines its tokens' top-k in slot order, with the
  rounding points of the single-device op (W4A8, EP only: bit-identical to it). C, the per-
  destination capacity, is ceil(capacity_factor * T_local * K / n_ep); pairs past C go in further
  rounds of the same exchange (all shards run max over shards of ceil(count / C) rounds), so no
  pair is dropped and the result never depends on C, only the work does. A dense `all_to_all`
  because XLA:CPU has no `ragged_all_to_all`. Per round, each shard sends and receives
  n_ep * C rows of H activations (and C ids and weights per destination): about
  capacity_factor * T_local * K * H * bytes, against the replicated dispatch's T * H * 4.
- "ragged_all_to_all": the same buffers, rounds and result as "all_to_all", but each exchange is
  a `lax.ragged_all_to_all` that sends only the filled rows of each destination's block (the
  per-destination counts travel first in a small `all_to_all`), so the wire carries the pairs
  themselves, not n_ep * C rows. For backends whose XLA implements it (GPU, TPU); on a CPU mesh
  it is refused with a ValueError (XLA:CPU answers UNIMPLEMENTED).

Rounding: EP keeps the single-device arithmetic of every (token, expert) pair; only the order of
the top-k sum changes (f32 psum of per-shard partial sums), so results match to float32
reassociation (and to the bf16 rounding of partial sums in bf16). TP changes one rounding point of
the W4A8 scheme: each shard quantizes its slice of the GEMM2 input (the activation row) to int8
with its own dynamic scale (a finer grid than one scale for the whole row), so a TP result equals
the same-scheme computation on the sliced weights, and differs from the unsharded result by int8
activation-rounding noise (see tests/test_sharding.py for the bound).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_moeq import reference
from jax_moeq.experts.cpu_int4 import w4a8_scales
from jax_moeq.ops import w4a8_cpu
from jax_moeq.weights import fold_w2_act_order

Array = jax.Array

_shard_map = getattr(jax, "shard_map", None)
if _shard_map is None:  # older jax
  from jax.experimental.shard_map import shard_map as _shard_map  # type: ignore


def make_mesh(expert_parallel: int = 1, tensor_parallel: int = 1, *,
              expert_axis: str = "ep", tensor_axis: str = "tp",
              devices: list | None = None) -> Mesh:
  """A (tensor_axis, expert_axis) mesh over the first tp*ep devices."""
  if expert_parallel < 1 or tensor_parallel < 1:
    raise ValueError(f"expert_parallel={expert_parallel} and tensor_parallel={tensor_parallel} must "
                     "be >= 1")
  devices = list(jax.devices() if devices is None else devices)
  n = expert_parallel * tensor_parallel
  if n > len(devices):
    raise ValueError(f"a {tensor_parallel}x{expert_parallel} mesh needs {n} devices, have "
                     f"{len(devices)}")
  grid = np.array(devices[:n], dtype=object).reshape(tensor_parallel, expert_parallel)
  return Mesh(grid, (tensor_axis, expert_axis))


def _axis_size(mesh: Mesh, axis: str | None) -> int:
  if axis is None:
    return 1
  if axis not in mesh.shape:
    raise ValueError(f"axis {axis!r} is not in the mesh axes {tuple(mesh.shape)}")
  return mesh.shape[axis]


def _check_split(mesh: Mesh, expert_axis, tensor_axis, num_experts: int, intermediate: int,
                 group_size: int | None, multiple: int) -> tuple[int, int]:
  n_ep, n_tp = _axis_size(mesh, expert_axis), _axis_size(mesh, tensor_axis)
  if expert_axis is not None and expert_axis == tensor_axis:
    raise ValueError(f"expert_axis and tensor_axis must differ, both are {expert_axis!r}")
  if num_experts % n_ep:
    raise ValueError(f"num_experts={num_experts} is not divisible by the expert axis size {n_ep}")
  if intermediate % n_tp:
    raise ValueError(f"intermediate_size={intermediate} is not divisible by the tensor axis size "
                     f"{n_tp}")
  local_i = intermediate // n_tp
  if local_i % multiple:
    raise ValueError(f"the per-shard intermediate size {local_i} must be a multiple of {multiple}")
  if group_size not in (None, -1) and local_i % group_size:
    raise ValueError(f"group_size={group_size} does not divide the per-shard intermediate size "
                     f"{local_i}")
  return n_ep, n_tp


def _tp_slices(w13, w2, w13_bias, w2_bias, n_tp: int):
  """Per-TP-shard (w13 [E, 2I/n, H], w2 [E, H, I/n], biases) with gate and up sliced together."""
  i = w13.shape[1] // 2
  li = i // n_tp
  out = []
  for j in range(n_tp):
    rows = np.concatenate([np.arange(j * li, (j + 1) * li), i + np.arange(j * li, (j + 1) * li)])
    b13 = None if w13_bias is None else w13_bias[:, rows]
    b2 = None
    if w2_bias is not None:
      b2 = w2_bias if j == 0 else jnp.zeros_like(w2_bias)
    out.append((w13[:, rows], w2[:, :, j * li:(j + 1) * li], b13, b2, rows))
  return out


def _place(a, sharding: NamedSharding) -> Array:
  """A host-computed global array on the mesh. With several processes (jax.distributed), each
  fills the shards of its own devices from its copy (every process computes the same `a`)."""
  if jax.process_count() == 1:
    return jax.device_put(a, sharding)
  host = np.asarray(a)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def process_expert_ranks(mesh: Mesh, expert_axis: str | None) -> tuple[int, ...]:
  """The positions on the expert axis of this process's devices in `mesh` (all of them in a
  single process; under jax.distributed, the ranks whose experts this process must hold)."""
  me = jax.process_index()
  mine = [index for index, d in np.ndenumerate(mesh.devices) if d.process_index == me]
  if not mine:
    raise ValueError(f"process {me} has no device in the mesh {dict(mesh.shape)}")
  if expert_axis is None:
    return (0,)
  axis = mesh.axis_names.index(expert_axis)
  return tuple(sorted({index[axis] for index in mine}))


def local_expert_ids(mesh: Mesh, expert_axis: str | None, num_experts: int) -> tuple[int, ...]:
  """The global ids of the experts this process's devices hold: EP rank r holds the contiguous
  block [r*E/n_ep, (r+1)*E/n_ep)."""
  n_ep = _axis_size(mesh, expert_axis)
  if num_experts % n_ep:
    raise ValueError(f"num_experts={num_experts} is not divisible by the expert axis size {n_ep}")
  per = num_experts // n_ep
  return tuple(e for r in process_expert_ranks(mesh, expert_axis)
               for e in range(r * per, (r + 1) * per))


def _place_blocks(blocks: dict[int, np.ndarray], n_ep: int, sharding: NamedSharding) -> Array:
  """A [n_tp, n_ep * rows, width] array on the mesh from this process's per-EP-rank blocks
  [n_tp, rows, width]: each device's shard is cut from its rank's block, so no process needs
  the blocks of ranks it does not hold."""
  n_tp, rows, width = next(iter(blocks.values())).shape

  def shard(index: tuple[slice, ...]) -> np.ndarray:
    start = index[1].start or 0
    stop = n_ep * rows if index[1].stop is None else index[1].stop
    if stop - start != rows or start % rows:
      raise ValueError(f"the expert axis shard [{start}, {stop}) is not one block of {rows} rows")
    return blocks[start // rows][index[0], :, index[2]]

  return jax.make_array_from_callback((n_tp, n_ep * rows, width), sharding, shard)


def _append_null_experts(x: Array, n_ep: int, null: Array) -> Array:
  """[E, ...] -> [n_ep * (E/n_ep + 1), ...]: each block of E/n_ep experts gets `null` appended."""
  blocks = x.reshape(n_ep, x.shape[0] // n_ep, *x.shape[1:])
  nulls = jnp.broadcast_to(null.astype(x.dtype), (n_ep, 1, *x.shape[1:]))
  return jnp.concatenate([blocks, nulls], axis=1).reshape(-1, *x.shape[1:])


# ------------------------------------------------------------------ W4A8 (CPU kernel)
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["w13_packed", "w2_packed"],
                   meta_fields=["num_experts", "hidden_size", "intermediate_size", "group_size",
                                "mesh", "expert_axis", "tensor_axis"])
@dataclasses.dataclass(frozen=True)
class ShardedW4A8Weights:
  """W4A8 packed weights laid out for a mesh.

  w13_packed: [n_tp, n_ep * (E/n_ep + 1), B13_local] uint8, sharded P(tensor_axis, expert_axis);
  the last expert of every EP block is the null expert. w2_packed likewise.
  """

  w13_packed: Array
  w2_packed: Array
  num_experts: int
  hidden_size: int
  intermediate_size: int  # global I
  group_size: int
  mesh: Mesh
  expert_axis: str | None
  tensor_axis: str | None

  @property
  def spec(self) -> P:
    return P(self.tensor_axis, self.expert_axis)


def _pack_w4a8_block(w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, group_size: int,
                     w13_bias, w2_bias, n_tp: int,
                     null_expert: bool) -> tuple[np.ndarray, np.ndarray]:
  """One EP rank's experts packed per TP slice: [n_tp, E_block (+1 null), bytes] for w13, w2."""
  i = w13_weight.shape[1] // 2
  h = w13_weight.shape[2]
  li = i // n_tp
  g13s, g2s = [], []
  for j, (w13, w2, b13, b2, rows) in enumerate(
      _tp_slices(w13_weight, w2_weight, w13_bias, w2_bias, n_tp)):
    s13 = w13_weight_scale[:, rows]
    if group_size == -1:
      s2 = w2_weight_scale  # one scale per output row: the same for every input slice
    else:
      s2 = w2_weight_scale[:, :, j * li // group_size:(j + 1) * li // group_size]
    p13, p2, *_ = w4a8_cpu.convert_to_w4a8_int8_moe_format(w13, w2, s13, s2, group_size, b13, b2)
    if null_expert:
      # The null expert: q = 0 with unit scales and no bias packs to a GEMM that returns 0.
      z13, z2, *_ = w4a8_cpu.convert_to_w4a8_int8_moe_format(
          jnp.zeros((1, 2 * li, h), jnp.int8), jnp.zeros((1, h, li), jnp.int8),
          jnp.ones((1,) + s13.shape[1:], s13.dtype), jnp.ones((1,) + s2.shape[1:], s2.dtype),
          group_size)
      p13, p2 = jnp.concatenate([p13, z13]), jnp.concatenate([p2, z2])
    g13s.append(np.asarray(p13))
    g2s.append(np.asarray(p2))
  return np.stack(g13s), np.stack(g2s)


def shard_w4a8_weights(w13_weight: Array, w2_weight: Array, w13_weight_scale: Array,
                       w2_weight_scale: Array, group_size: int, *, mesh: Mesh,
                       expert_axis: str | None = "ep", tensor_axis: str | None = None,
                       w13_bias: Array | None = None, w2_bias: Array | None = None,
                       num_experts: int | None = None) -> ShardedW4A8Weights:
  """Packs int4 MoE weights (`convert_to_w4a8_int8_moe_format`'s inputs) for sharded execution.

  Arguments as `jax_moeq.convert_to_w4a8_int8_moe_format`; `expert_axis` / `tensor_axis` name mesh
  axes (None: not split that way). Each process packs only the experts of its own devices' EP
  ranks and places them there.
  `num_experts`: None when the weights hold all E experts (every process passes the same). An
  int E when they hold only this process's experts, `local_expert_ids(mesh, expert_axis, E)` in
  that order (as `jax_moeq.models.from_pretrained(mesh=...)` reads them): no process then needs
  the others' weights.
  """
  held, i2, h = w13_weight.shape
  i = i2 // 2
  e = held if num_experts is None else int(num_experts)
  n_ep, n_tp = _check_split(mesh, expert_axis, tensor_axis, e, i, group_size,
                            w4a8_cpu.TILE_ROWS)
  per = e // n_ep
  ranks = process_expert_ranks(mesh, expert_axis)
  if num_experts is None:
    first = {r: r * per for r in ranks}  # where each rank's block starts in the given weights
  else:
    if held != len(ranks) * per:
      raise ValueError(f"the weights hold {held} experts; with num_experts={e} this process's "
                       f"EP ranks {list(ranks)} hold {len(ranks) * per}")
    first = {r: k * per for k, r in enumerate(ranks)}
  blocks13, blocks2 = {}, {}
  for r, start in first.items():
    part = lambda a: None if a is None else a[start:start + per]
    blocks13[r], blocks2[r] = _pack_w4a8_block(
        part(w13_weight), part(w2_weight), part(w13_weight_scale), part(w2_weight_scale),
        group_size, part(w13_bias), part(w2_bias), n_tp, expert_axis is not None)
  sharding = NamedSharding(mesh, P(tensor_axis, expert_axis))
  return ShardedW4A8Weights(
      _place_blocks(blocks13, n_ep, sharding), _place_blocks(blocks2, n_ep, sharding), e, h, i,
      group_size, mesh, expert_axis, tensor_axis)


def _ep_apply(run: Callable[[Array, Array, Array], Array], x: Array, topk_ids: Array,
              topk_weights: Array, local_experts: int, axis: str | None, n_ep: int,
              capacity_factor: float | None) -> Array:
  """This shard's float32 [T, H] contribution: `run(x, ids, weights)` on its local experts.

  Global ids become local ids; pairs routed to other shards go to the null expert (id
  `local_experts`), which contributes exactly 0. With a `capacity_factor`, the shard first tries
  a compacted call: its local (token, slot) pairs, at most C = ceil(capacity_factor * T*K / n_ep)
  of them, each as a one-slot row, scatter-added back to their tokens; only when more than C
  pairs are local (skewed routing) does it run every pair (`lax.cond`, so results never depend
  on the capacity: only the work does).
  """
  t, k = topk_ids.shape
  if axis is None:
    return run(x, topk_ids, topk_weights).astype(jnp.float32)
  local = topk_ids - jax.lax.axis_index(axis) * local_experts
  here = (local >= 0) & (local < local_experts)
  ids = jnp.where(here, local, local_experts).astype(jnp.int32)
  full = lambda: run(x, ids, topk_weights).astype(jnp.float32)
  pairs = t * k
  if capacity_factor is None:
    return full()
  cap = min(pairs, max(1, int(np.ceil(capacity_factor * pairs / n_ep))))
  if cap >= pairs:
    return full()

  def compact():
    order = jnp.argsort(~here.reshape(-1), stable=True)[:cap]  # local pairs first
    token = order // k
    y = run(x[token], ids.reshape(-1)[order][:, None], topk_weights.reshape(-1)[order][:, None])
    return jnp.zeros((t, y.shape[-1]), jnp.float32).at[token].add(y.astype(jnp.float32))

  return jax.lax.cond(jnp.sum(here) <= cap, compact, full)


def _combine(y: Array, out_dtype, axes: tuple[str, ...]) -> Array:
  """Sums float32 partial outputs over the mesh axes and rounds once."""
  if axes:
    y = jax.lax.psum(y, axes)
  return y.astype(out_dtype)


# ------------------------------------------------------------------ all-to-all dispatch
DISPATCHES = ("replicated", "all_to_all", "ragged_all_to_all")
_A2A_DEFAULT_CAPACITY = 2.0  # capacity_factor=None under all-to-all dispatch
# Backends whose XLA implements ragged-all-to-all; XLA:CPU answers UNIMPLEMENTED (jax 0.10).
_RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
_ragged_all_to_all = jax.lax.ragged_all_to_all


def _check_dispatch(dispatch: str, expert_axis: str | None, mesh: Mesh | None = None) -> None:
  if dispatch not in DISPATCHES:
    raise ValueError(f"dispatch={dispatch!r} is not one of {DISPATCHES}")
  if dispatch != "replicated" and expert_axis is None:
    raise ValueError(f"dispatch={dispatch!r} needs an expert axis (expert_axis=None given)")
  if dispatch == "ragged_all_to_all" and mesh is not None:
    platforms = sorted({d.platform for d in mesh.devices.flat})
    if not set(platforms) <= set(_RAGGED_PLATFORMS):
      raise ValueError(f"dispatch='ragged_all_to_all' needs a backend with ragged_all_to_all "
                       f"({', '.join(_RAGGED_PLATFORMS)}); this mesh has {platforms} devices "
                       "(XLA:CPU answers UNIMPLEMENTED): use dispatch='all_to_all'")


def a2a_capacity(tokens_per_shard: int, top_k: int, n_ep: int, capacity_factor: float) -> int:
  """Rows per destination shard per exchange round: ceil(factor * T_local * K / n_ep), in
  [1, T_local * K] (the upper end never needs a second round)."""
  if capacity_factor <= 0:
    raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
  pairs = tokens_per_shard * top_k
  return int(min(max(pairs, 1), max(1, math.ceil(capacity_factor * pairs / n_ep))))


def _a2a_pair_outputs(run: Callable[[Array, Array, Array], Array], x: Array, topk_ids: Array,
                      topk_weights: Array, local_experts: int, axis: str, n_ep: int,
                      capacity: int, tensor_axis: str | None,
                      ragged: bool = False) -> tuple[Array, Array]:
  """(y [T, K, H] in x.dtype, valid [T, K]): every (token, slot) pair of this shard's tokens run
  on the shard holding its expert; y is 0 for pairs whose id is outside [0, E).

  `run(rows [R, H], local_ids [R, 1], weights [R, 1]) -> [R, H]` computes one-slot rows on this
  shard's experts; an empty slot has id -1 and must give 0 (the kernels skip ids outside
  [0, E) under jit).

  `ragged`: the exchanges are `ragged_all_to_all`s that send only the filled rows of each
  destination's block (the dense one sends all C); the buffers and rounds are the same.
  """
  t, k = topk_ids.shape
  h = x.shape[-1]
  pairs = t * k
  ids = topk_ids.reshape(-1)
  valid = (ids >= 0) & (ids < local_experts * n_ep)
  dest = jnp.where(valid, ids // local_experts, n_ep).astype(jnp.int32)
  local = jnp.where(valid, ids % local_experts, local_experts).astype(jnp.int32)
  weights = topk_weights.reshape(-1).astype(jnp.float32)
  token = jnp.arange(pairs, dtype=jnp.int32) // k
  # Rank of each pair among the pairs bound for the same shard, in pair order.
  order = jnp.argsort(dest, stable=True)
  counts = jnp.zeros((n_ep + 1,), jnp.int32).at[dest].add(1)
  starts = jnp.cumsum(counts) - counts
  pos = jnp.zeros((pairs,), jnp.int32).at[order].set(
      jnp.arange(pairs, dtype=jnp.int32) - starts[dest[order]])
  rounds = (jnp.max(counts[:n_ep]) + capacity - 1) // capacity
  rounds = jax.lax.pmax(rounds, axis)  # every shard takes part in every exchange
  slots = n_ep * capacity

  def dense(a: Array, fill) -> Array:
    del fill  # every slot travels: the sender's empty slots are already filled
    shaped = a.reshape(n_ep, capacity, *a.shape[1:])
    return jax.lax.all_to_all(shaped, axis, 0, 0, tiled=True).reshape(a.shape)

  def ragged_exchange(sent: Array, received: Array) -> Callable[[Array, object], Array]:
    # Block d of the buffer (rows d*C ..) goes to shard d and lands in its block for this shard.
    starts = jnp.arange(n_ep, dtype=jnp.int32) * capacity
    mine = jnp.full((n_ep,), jax.lax.axis_index(axis) * capacity, jnp.int32)
    return lambda a, fill: _ragged_all_to_all(a, jnp.full_like(a, fill), starts, sent, mine,
                                              received, axis_name=axis)

  def one_round(state):
    r, y = state
    in_round = valid & (pos >= r * capacity) & (pos < (r + 1) * capacity)
    slot = jnp.where(in_round, dest * capacity + pos - r * capacity, slots)
    send_x = jnp.zeros((slots, h), x.dtype).at[slot].set(x[token], mode="drop")
    # Empty slots carry id -1: the kernels skip ids outside [0, E) (no work, output 0).
    send_id = jnp.full((slots,), -1, jnp.int32).at[slot].set(local, mode="drop")
    send_w = jnp.zeros((slots,), jnp.float32).at[slot].set(weights, mode="drop")
    forward = backward = dense
    if ragged:  # rows this round sends to each shard, and receives from each
      sent = jnp.clip(counts[:n_ep] - r * capacity, 0, capacity).astype(jnp.int32)
      received = jax.lax.all_to_all(sent, axis, 0, 0, tiled=True)
      forward, backward = ragged_exchange(sent, received), ragged_exchange(received, sent)
    got = run(forward(send_x, 0), forward(send_id[:, None], -1),
              forward(send_w[:, None], 0))
    if tensor_axis is not None:  # partial GEMM2 outputs of the tensor-parallel slices
      got = jax.lax.psum(got.astype(jnp.float32), tensor_axis).astype(x.dtype)
    back = backward(got.astype(x.dtype), 0)
    y = jnp.where(in_round[:, None], back[jnp.minimum(slot, slots - 1)], y)
    return r + 1, y

  # The carry varies over the shards like the tokens it is gathered from (shard_map's types).
  y0 = jnp.zeros_like(x[token])
  _, y = jax.lax.while_loop(lambda state: state[0] < rounds, one_round, (jnp.int32(0), y0))
  return y.reshape(t, k, h), valid.reshape(t, k)


def _a2a_apply(run, x: Array, topk_ids: Array, topk_weights: Array, local_experts: int,
               axis: str, n_ep: int, capacity_factor: float, tensor_axis: str | None,
               ragged: bool = False) -> Array:
  """This shard's tokens' outputs [T_local, H] (x.dtype) under all-to-all dispatch.

  Each pair travels with its router weight and runs as a one-slot row, so the expert's shard
  returns v = round(y2 * w) (or y2 of the weighted input, with the weight on the input) exactly
  as the op computes it; the tokens' shard then adds the v of its slots in order, rounding each
  step (SPEC §4 step 5). Only additions happen here: a product left to XLA may be fused into an
  FMA, which moved float32 results by an ulp against the op."""
  t, k = topk_ids.shape
  capacity = a2a_capacity(t, k, n_ep, capacity_factor)
  v, _ = _a2a_pair_outputs(run, x, topk_ids, topk_weights, local_experts, axis, n_ep, capacity,
                           tensor_axis, ragged)
  out = jnp.zeros((t, x.shape[-1]), jnp.float32)
  for slot in range(k):
    out = reference.round_to_dtype(out + v[:, slot].astype(jnp.float32), x.dtype)
  return out.astype(x.dtype)


def _pad_tokens(n: int, *arrays: Array) -> tuple[int, list[Array]]:
  """Pads the token axis to a multiple of n (ids -1: a padded row is routed nowhere)."""
  t = arrays[0].shape[0]
  extra = (-t) % n
  if not extra:
    return t, list(arrays)
  out = []
  for a in arrays:
    fill = -1 if jnp.issubdtype(a.dtype, jnp.integer) else 0
    out.append(jnp.concatenate([a, jnp.full((extra, *a.shape[1:]), fill, a.dtype)]))
  return t, out


def w4a8_moe_sharded(x: Array, topk_ids: Array, topk_weights: Array,
                     weights: ShardedW4A8Weights, *, apply_router_weight_on_input: bool = False,
                     activation_kind: int = 0, capacity_factor: float | None = 2.0,
                     dispatch: str = "replicated") -> Array:
  """`dynamic_4bit_int_moe` over the mesh of `weights` (EP and/or TP).

  dispatch="replicated": x [T, H], topk_ids / topk_weights [T, K] are replicated over the mesh;
  the result is too. `capacity_factor` (EP only) sizes the compacted per-shard call (see
  `_ep_apply`); None always runs every pair on every shard.
  dispatch="all_to_all": tokens are sharded over the expert axis (T padded to a multiple of its
  size) and so is the result; `capacity_factor` (default 2 when None) sizes the exchange (module
  docstring). With EP alone the result is bit-identical to the single-device op.
  dispatch="ragged_all_to_all": as "all_to_all", exchanging only the filled rows; refused on a
  CPU mesh (XLA:CPU has no ragged_all_to_all), where this kernel runs.
  """
  _check_dispatch(dispatch, weights.expert_axis, weights.mesh)
  mesh = weights.mesh
  n_ep = _axis_size(mesh, weights.expert_axis)
  n_tp = _axis_size(mesh, weights.tensor_axis)
  local_e = weights.num_experts // n_ep
  local_i = weights.intermediate_size // n_tp
  h, g = weights.hidden_size, weights.group_size
  axes = tuple(a for a in (weights.tensor_axis, weights.expert_axis) if a is not None)
  if x.ndim != 2 or x.shape[1] != h:
    raise ValueError(f"x must be [tokens, {h}], got shape {x.shape}")

  def kernel(w13, w2):
    return lambda x, ids, w: w4a8_cpu.dynamic_4bit_int_moe(
        x, ids, w, w13[0], w2[0], h, local_i, 2 * local_i, g,
        apply_router_weight_on_input=apply_router_weight_on_input,
        activation_kind=activation_kind)

  if dispatch != "replicated":
    def a2a_body(x, ids, w, w13, w2):
      return _a2a_apply(kernel(w13, w2), x, ids.astype(jnp.int32), w, local_e,
                        weights.expert_axis, n_ep,
                        _A2A_DEFAULT_CAPACITY if capacity_factor is None else capacity_factor,
                        weights.tensor_axis, dispatch == "ragged_all_to_all")

    t, (x, topk_ids, topk_weights) = _pad_tokens(n_ep, x, topk_ids, topk_weights)
    tokens = P(weights.expert_axis)
    fn = _shard_map(a2a_body, mesh=mesh,
                    in_specs=(tokens, tokens, tokens, weights.spec, weights.spec),
                    out_specs=tokens)
    return fn(x, topk_ids, topk_weights.astype(jnp.float32), weights.w13_packed,
              weights.w2_packed)[:t]

  def body(x, ids, w, w13, w2):
    y = _ep_apply(kernel(w13, w2), x, ids.astype(jnp.int32), w, local_e, weights.expert_axis,
                  n_ep, capacity_factor)
    return _combine(y, x.dtype, axes)

  fn = _shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), weights.spec, weights.spec),
                  out_specs=P())
  return fn(x, topk_ids, topk_weights.astype(jnp.float32), weights.w13_packed, weights.w2_packed)


def shard_quantized_moe(block, mesh: Mesh, *, expert_axis: str | None = "ep",
                        tensor_axis: str | None = None,
                        capacity_factor: float | None = 2.0,
                        dispatch: str = "replicated") -> Callable[..., Array]:
  """A sharded version of a `jax_moeq.nn.QuantizedMoE` block on the CPU W4A8 kernel.

  Returns `fn(x[..., H], router_logits=None) -> y[..., H]`, jittable, with the block's routing
  and router; the experts run EP / TP over `mesh` (weights packed and placed once, here), their
  tokens dispatched as `dispatch` says (`w4a8_moe_sharded`).
  """
  _check_dispatch(dispatch, expert_axis, mesh)
  w = block.canonical_int4()
  if w.w13_g_idx is not None:
    raise ValueError("blocks with act-order on w13 cannot run on the W4A8 kernel")
  w = w4a8_scales(fold_w2_act_order(w))  # exact; the scales as the W4A8 kernel stores them
  sharded = shard_w4a8_weights(jnp.asarray(w.w13_q), jnp.asarray(w.w2_q), w.w13_scale,
                               w.w2_scale, w.group_size, mesh=mesh, expert_axis=expert_axis,
                               tensor_axis=tensor_axis, w13_bias=w.w13_bias, w2_bias=w.w2_bias)
  spec = block.spec
  kind = {"silu": 0, "swigluoai": 1}[spec.activation]

  def fn(x: Array, router_logits: Array | None = None) -> Array:
    tokens, logits, lead = block._flatten(x, router_logits)
    topk_weights, topk_ids = block.route(logits)
    y = w4a8_moe_sharded(tokens, topk_ids, topk_weights, sharded,
                         apply_router_weight_on_input=spec.apply_router_weight_on_input,
                         activation_kind=kind, capacity_factor=capacity_factor,
                         dispatch=dispatch)
    return y.reshape(*lead, spec.hidden_size)

  return fn


# ------------------------------------------------------------------ generic (float / reference)
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["arrays"],
                   meta_fields=["names", "num_experts", "intermediate_size", "mesh",
                                "expert_axis", "tensor_axis"])
@dataclasses.dataclass(frozen=True)
class ShardedExpertArrays:
  """Per-expert arrays (w13-like [E, 2I, ...], w2-like [E, H, I...], ...) laid out for a mesh as
  [n_tp, n_ep * (E/n_ep + 1), ...], the last expert of each EP block being zeros (null expert)."""

  arrays: tuple[Array, ...]
  names: tuple[str, ...]
  num_experts: int
  intermediate_size: int
  mesh: Mesh
  expert_axis: str | None
  tensor_axis: str | None


def shard_float_weights(w13: Array, w2: Array, *, mesh: Mesh, expert_axis: str | None = "ep",
                        tensor_axis: str | None = None, w13_bias: Array | None = None,
                        w2_bias: Array | None = None) -> ShardedExpertArrays:
  """Float expert weights (w13 [E, 2I, H], w2 [E, H, I]) laid out for `float_moe_sharded`."""
  e, i2, h = w13.shape
  i = i2 // 2
  n_ep, n_tp = _check_split(mesh, expert_axis, tensor_axis, e, i, None, 1)
  per_name: dict[str, list] = {}
  for a13, a2, b13, b2, _ in _tp_slices(w13, w2, w13_bias, w2_bias, n_tp):
    for name, a in (("w13", a13), ("w2", a2), ("w13_bias", b13), ("w2_bias", b2)):
      if a is None:
        continue
      if expert_axis is not None:
        a = _append_null_experts(a, n_ep, jnp.zeros(a.shape[1:], a.dtype))
      per_name.setdefault(name, []).append(a)
  sharding = NamedSharding(mesh, P(tensor_axis, expert_axis))
  names = tuple(per_name)
  arrays = tuple(_place(jnp.stack(per_name[n]), sharding) for n in names)
  return ShardedExpertArrays(arrays, names, e, i, mesh, expert_axis, tensor_axis)


def experts_sharded(expert_fn: Callable[..., Array], x: Array, topk_ids: Array,
                    topk_weights: Array, weights: ShardedExpertArrays, *,
                    capacity_factor: float | None = 2.0, dispatch: str = "replicated") -> Array:
  """Runs `expert_fn(x, topk_ids, topk_weights, **local_arrays) -> [T, H]` per shard and sums.

  `expert_fn` sees local expert ids in [0, E/n_ep] (the last is the null expert, all zeros) and
  the local TP slice of every array; it must return the shard's [T, H] contribution, and it
  may be called with [C, 1] compacted pairs (see `_ep_apply`). With dispatch="all_to_all" it is
  called with one-slot rows only (each with its router weight), tokens and the result are
  sharded over the expert axis, and each token adds its slots' outputs in order, rounding each
  step (see `w4a8_moe_sharded`). dispatch="ragged_all_to_all" does the same with
  `lax.ragged_all_to_all`, sending only the filled rows (GPU / TPU meshes; refused on CPU).
  """
  _check_dispatch(dispatch, weights.expert_axis, weights.mesh)
  mesh = weights.mesh
  n_ep = _axis_size(mesh, weights.expert_axis)
  local_e = weights.num_experts // n_ep
  axes = tuple(a for a in (weights.tensor_axis, weights.expert_axis) if a is not None)
  spec = P(weights.tensor_axis, weights.expert_axis)

  if dispatch != "replicated":
    def a2a_body(x, ids, w, *arrays):
      local = {n: a[0] for n, a in zip(weights.names, arrays)}
      run = lambda x, ids, w: expert_fn(x, ids, w, **local)
      return _a2a_apply(run, x, ids.astype(jnp.int32), w, local_e, weights.expert_axis, n_ep,
                        _A2A_DEFAULT_CAPACITY if capacity_factor is None else capacity_factor,
                        weights.tensor_axis, dispatch == "ragged_all_to_all")

    t, (x, topk_ids, topk_weights) = _pad_tokens(n_ep, x, topk_ids, topk_weights)
    tokens = P(weights.expert_axis)
    fn = _shard_map(a2a_body, mesh=mesh, in_specs=(tokens,) * 3 + (spec,) * len(weights.arrays),
                    out_specs=tokens)
    return fn(x, topk_ids, topk_weights.astype(jnp.float32), *weights.arrays)[:t]

  def body(x, ids, w, *arrays):
    local = {n: a[0] for n, a in zip(weights.names, arrays)}
    run = lambda x, ids, w: expert_fn(x, ids, w, **local)
    y = _ep_apply(run, x, ids.astype(jnp.int32), w, local_e, weights.expert_axis, n_ep,
                  capacity_factor)
    return _combine(y, x.dtype, axes)

  fn = _shard_map(body, mesh=mesh, in_specs=(P(), P(), P()) + (spec,) * len(weights.arrays),
                  out_specs=P())
  return fn(x, topk_ids, topk_weights.astype(jnp.float32), *weights.arrays)
