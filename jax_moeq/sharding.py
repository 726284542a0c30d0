"""Expert- and tensor-parallel MoE over a `jax.sharding.Mesh`, with the kernels running per shard.

Every scheme (W4A8 on CPU and GPU, WNA16, MxInt4, and their references) runs sharded through
`shard_experts` / `moe_sharded` (the "any experts class" section below): the scheme's oracle
chooses the experts class for one shard's share of the layer, its `prepare` converts each
device's share on that device, and each shard runs its `apply_routed` (MxInt4: `apply`, routing
inside the kernel with the rank's expert offset). `shard_quantized_moe` and the models
(`from_pretrained(mesh=...)`) use it. The W4A8-only functions (`shard_w4a8_weights`,
`w4a8_moe_sharded`) and the float helpers (`shard_float_weights`, `experts_sharded`) shard the
CPU op and plain functions directly; the dispatch machinery (`_ep_apply`, `_a2a_pair_outputs`)
below is shared by all.

Expert parallelism (EP, `expert_axis`): the E experts are split into n_ep contiguous blocks, one per
shard. Every shard sees all tokens (replicated), remaps the global expert ids to its local ids, and
sends pairs routed elsewhere to a *null expert*: an extra local expert whose int4 weights, scales'
row corrections and biases are all zero, so its output is exactly 0 for any input and any router
weight (also with `apply_router_weight_on_input`). Partial outputs are summed with `psum`.
The null expert is stored once per shard at packing time (no per-call weight copies).
Dispatch (CPU meshes): a shard first tries a compacted call on just its local (token, slot) pairs (a static
capacity of ~capacity_factor * T*K / n_ep rows, gathered from the replicated tokens, results
scatter-added back); if routing is too skewed for that capacity it runs every pair instead
(`lax.cond`), so the result never depends on the capacity, only the work does. The GPU kernels
skip ids outside [0, E) without work, so on GPU meshes a shard runs all its rows, others' pairs
masked.

Tensor parallelism (TP, `tensor_axis`): the intermediate dimension I is split into n_tp slices.
Shard j holds gate rows [jI/n, (j+1)I/n) *and* the same up rows of w13 (the gated activation pairs
gate row i with up row i, so both halves must be sliced together), and the same columns of w2.
GEMM2 then yields a partial [T, H] per shard; `psum` adds them. w2's bias is added by shard 0 only.

Both can be combined (a 2-D mesh). Partial outputs are summed in float32 and rounded once to the
activation dtype.

Token dispatch (`dispatch=`):
- "replicated" (the default): every shard sees all T tokens and the shards' partial outputs meet
  in a `psum` of T x H float32, whatever the routing. From 64 tokens per expert shard up, the
  tokens come split over the expert axis (as data-parallel attention leaves them), are
  all-gathered in bf16, and the f32 partial sums are reduce-scattered back to their shard: the
  same sums, 3/4 of the bytes of the psum (and no all-gather in front of it).
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
              capacity_factor: float | None, null_id: int | None = None) -> Array:
  """This shard's float32 [T, H] contribution: `run(x, ids, weights)` on its local experts.

  Global ids become local ids; pairs routed to other shards go to the null expert (id
  `local_experts`, or `null_id`: -1 for kernels that skip ids outside [0, E)), which contributes
  exactly 0. With a `capacity_factor`, the shard first tries
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
  ids = jnp.where(here, local, local_experts if null_id is None else null_id).astype(jnp.int32)
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
  """A sharded version of a `jax_moeq.nn.QuantizedMoE` block, on its own scheme and backend.

  Returns `fn(x[..., H], router_logits=None) -> y[..., H]`, jittable, with the block's routing
  and router; the experts run EP / TP over `mesh` on the experts class the block's oracle
  chooses for one shard (`shard_experts`: the block's canonical weights prepared per device,
  once, here), their tokens dispatched as `dispatch` says (`moe_sharded`).
  """
  _check_dispatch(dispatch, expert_axis, mesh)
  layout, arrays = shard_experts(
      block.scheme, block.spec.layer(block.dtype), block.canonical_int4(), mesh=mesh,
      expert_axis=expert_axis, tensor_axis=tensor_axis, group_size=block.group_size,
      moe_backend=block.backend,
      allow_activation_quantization=block.allow_activation_quantization)
  spec = block.spec

  def fn(x: Array, router_logits: Array | None = None) -> Array:
    tokens, logits, lead = block._flatten(x, router_logits)
    y = moe_sharded(tokens, logits, layout, arrays, spec.routing, block._correction_bias(),
                    capacity_factor=capacity_factor, dispatch=dispatch)
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


# ------------------------------------------------------------------ any experts class
# The route of every scheme (W4A8 CPU / GPU, WNA16, MxInt4 and their references): the oracle
# chooses an experts class for one shard's share of the layer (E/n_ep experts, I/n_tp), each
# device's share is prepared by that class's own `prepare` on that device, and each shard runs
# the class's `apply_routed` (or, for MxInt4 under replicated dispatch, its `apply` with the
# kernel's routing and expert offset) inside `shard_map`.
#
# Replicated dispatch: pairs routed to another shard get id -1, which every experts class skips
# (SPEC §13: ids outside [0, E) contribute nothing); MxInt4 routes inside its kernel and drops
# them by its `local_expert_offset` (the rank's static offset, chosen by `lax.switch` on the
# shard's position). All-to-all dispatch: the received pairs run as one-slot rows through
# `apply_routed`; MxInt4 first routes with its kernel's own routing step (`experts.route`, the
# bits the fused op uses), and its one-slot rows run the kernel with TopK routing over logits
# that hold the pair's weight, so each pair's output is round(y2 · w) as in the fused op.
#
# Combine (all-to-all): each token's shard adds its slots' outputs as its scheme's op does: W4A8
# rounds after every slot (SPEC §4 step 5), WNA16 and MxInt4 sum in float32 and round once. With
# EP alone the results of every scheme then equal the single-device op's bit for bit wherever
# the experts class computes a pair the same in any batch (the CPU W4A8 kernel, the WNA16 and
# MxInt4 references and the GPU kernels do, measured in tests/test_sharding_experts.py; the W4A8
# reference's float32 sum over groups moves by an ulp with the batch's shape). Replicated
# dispatch sums the shards'
# partial outputs (each already rounded by its kernel) in float32 and rounds once: the same
# pairs, another grouping of the top-k sum (bound: K + 1 roundings of the activation dtype).
# TP: the shards' partial GEMM2 outputs are rounded by their kernel, summed in float32 and
# rounded once; W4A8 also quantizes each slice of GEMM2's input with its own scale.

_SCHEMES_SUM_ONCE = ("wna16", "mxint4")  # top-k combined in float32, rounded once


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
  """The static half of sharded experts: which experts class runs each shard and how.

  experts: one instance per EP rank, built by the scheme's oracle for E/n_ep experts and I/n_tp
    (they differ only in `parallel_config.ep_rank`, which MxInt4's kernel reads).
  scheme: the format the arrays are prepared in (`ExpertsChoice.scheme`).
  kernel_routing: the experts route inside (MxInt4 with a kernel-side routing method).
  """

  experts: tuple
  scheme: str
  backend: str
  num_experts: int
  hidden_size: int
  intermediate_size: int  # global I
  group_size: int | None
  mesh: Mesh
  expert_axis: str | None
  tensor_axis: str | None
  kernel_routing: bool

  @property
  def spec(self) -> P:
    return P(self.tensor_axis, self.expert_axis)

  @property
  def n_ep(self) -> int:
    return _axis_size(self.mesh, self.expert_axis)

  @property
  def n_tp(self) -> int:
    return _axis_size(self.mesh, self.tensor_axis)

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.n_ep

  def describe(self, dispatch: str) -> str:
    return f"{self.backend} (EP {self.n_ep} x TP {self.n_tp}, {dispatch} dispatch)"


def check_mesh_split(mesh: Mesh, expert_axis: str | None, tensor_axis: str | None,
                     num_experts: int, intermediate_size: int, group_size: int | None
                     ) -> tuple[int, int]:
  """(n_ep, n_tp); ValueError naming the axis and the sizes when the mesh cannot split the layer:
  E over the expert axis, I over the tensor axis in whole groups of `group_size`."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  n_ep, n_tp = _axis_size(mesh, expert_axis), _axis_size(mesh, tensor_axis)
  if expert_axis is not None and expert_axis == tensor_axis:
    raise ValueError(f"expert_axis and tensor_axis must differ, both are {expert_axis!r}")
  if num_experts % n_ep:
    raise ValueError(f"num_experts={num_experts} is not divisible by the expert axis size "
                     f"{n_ep} (mesh axis {expert_axis!r})")
  if intermediate_size % n_tp:
    raise ValueError(f"intermediate_size={intermediate_size} is not divisible by the tensor axis "
                     f"size {n_tp} (mesh axis {tensor_axis!r})")
  local_i = intermediate_size // n_tp
  if group_size not in (None, -1) and local_i % group_size:
    raise ValueError(f"group_size={group_size} does not divide the per-shard intermediate size "
                     f"{local_i} (intermediate_size={intermediate_size} over the tensor axis "
                     f"{tensor_axis!r} of size {n_tp}): TP splits I in whole groups")
  return n_ep, n_tp


def _local_layer(layer, n_ep: int, n_tp: int):
  """The `dispatch.LayerSpec` of one shard: E/n_ep experts, I/n_tp, top-k at most E/n_ep."""
  local_e = layer.num_experts // n_ep
  routing = layer.routing
  if routing.top_k > local_e:  # one shard's experts only bound the config, not the routing
    routing = dataclasses.replace(routing, top_k=local_e)
  return dataclasses.replace(layer, num_experts=local_e,
                             intermediate_size=layer.intermediate_size // n_tp, routing=routing)


def _with_rank(experts, ep_rank: int, n_ep: int):
  """The same experts class and quant config on a config for EP rank `ep_rank`."""
  from jax_moeq.oracle.base import MoEParallelConfig
  cfg = dataclasses.replace(experts.moe_config,
                            parallel_config=MoEParallelConfig(ep_size=n_ep, ep_rank=ep_rank))
  return type(experts)(cfg, experts.quant_config)


def _expert_rows(w, start: int, stop: int):
  """The weights container (`Int4MoEWeights` / `FloatMoEWeights`) of experts [start, stop)."""
  changes = {}
  for f in dataclasses.fields(w):
    a = getattr(w, f.name)
    if a is not None and f.name != "group_size":
      changes[f.name] = a[start:stop]
  return dataclasses.replace(w, **changes)


def _tp_slice(w, j: int, n_tp: int):
  """Slice j of n_tp of an `Int4MoEWeights` over I: gate and up rows of w13 (and their scales and
  bias) together, w2's columns and their scale groups; w2's bias on slice 0 only."""
  if n_tp == 1:
    return w
  if w.w2_g_idx is not None:
    w = fold_w2_act_order(w)  # exact: w2's act-order becomes a permutation of w13's rows
  i = w.w2_q.shape[-1]
  li = i // n_tp
  rows = np.concatenate([np.arange(j * li, (j + 1) * li), i + np.arange(j * li, (j + 1) * li)])
  if w.group_size == -1:
    s2 = w.w2_scale  # one scale per output row: the same for every input slice
  else:
    per = li // w.group_size
    s2 = w.w2_scale[:, :, j * per:(j + 1) * per]
  b2 = w.w2_bias
  if b2 is not None and j:
    b2 = jnp.zeros_like(b2)
  return dataclasses.replace(
      w, w13_q=w.w13_q[:, rows], w13_scale=w.w13_scale[:, rows],
      w13_bias=None if w.w13_bias is None else w.w13_bias[:, rows],
      w2_q=w.w2_q[:, :, j * li:(j + 1) * li], w2_scale=s2, w2_bias=b2)


def _mesh_positions(mesh: Mesh, expert_axis: str | None, tensor_axis: str | None):
  """(device, tp position, ep position) of this process's devices in `mesh`."""
  names = mesh.axis_names
  out = []
  for index, d in np.ndenumerate(mesh.devices):
    if d.process_index != jax.process_index():
      continue
    j = 0 if tensor_axis is None else index[names.index(tensor_axis)]
    r = 0 if expert_axis is None else index[names.index(expert_axis)]
    out.append((d, j, r))
  if not out:
    raise ValueError(f"process {jax.process_index()} has no device in the mesh "
                     f"{dict(mesh.shape)}")
  return out


def shard_experts(scheme: str, layer, weights, *, mesh: Mesh, expert_axis: str | None = "ep",
                  tensor_axis: str | None = None, group_size: int | None = None,
                  moe_backend: str = "auto", allow_activation_quantization: bool = False,
                  num_experts: int | None = None
                  ) -> tuple[ExpertsLayout, dict[str, Array]]:
  """Prepares int4 MoE weights for `moe_sharded` on any scheme's experts class.

  Args:
    scheme: "w4a8_int8", "wna16" or "mxint4" (`jax_moeq.dispatch.SCHEMES`).
    layer: the layer's `jax_moeq.dispatch.LayerSpec` (global E, H, I, routing, dtype).
    weights: `Int4MoEWeights` of all E experts, or of this process's experts only
      (`local_expert_ids` order, with `num_experts=E`), or a callable `(start, stop) ->
      Int4MoEWeights` of experts [start, stop) that is called on each device that holds them
      (under `jax.default_device`), so that weights made there (random ones) never leave it.
    mesh, expert_axis, tensor_axis: the mesh and its EP / TP axis names (None: not split).
    group_size, moe_backend, allow_activation_quantization: as `dispatch.choose_experts`.

  Returns:
    (layout, arrays): arrays maps each prepared name to a global [n_tp, n_ep, *shape] array,
    sharded P(tensor_axis, expert_axis), whose shard on each device is that device's share
    prepared by the experts class on that device.
  """
  from jax_moeq import dispatch
  e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
  n_ep, n_tp = check_mesh_split(mesh, expert_axis, tensor_axis, e, i, group_size)
  per = e // n_ep
  choice = dispatch.choose_experts(scheme, _local_layer(layer, n_ep, n_tp),
                                   group_size=group_size, moe_backend=moe_backend,
                                   allow_activation_quantization=allow_activation_quantization)
  base = choice.experts
  kernel_routing = choice.scheme == "mxint4" and (
      base.moe_config.routing_method.name != "Unspecified")
  experts = (tuple(_with_rank(base, r, n_ep) for r in range(n_ep)) if kernel_routing
             else (base,) * n_ep)
  layout = ExpertsLayout(experts, choice.scheme, choice.name, e, h, i, group_size, mesh,
                         expert_axis, tensor_axis, kernel_routing)

  ranks = process_expert_ranks(mesh, expert_axis)
  if callable(weights):
    block = lambda r, a, b: weights(r * per + a, r * per + b)
  else:
    held = weights.w13_q.shape[0]
    if num_experts is None:
      if held != e:
        raise ValueError(f"the weights hold {held} experts, the layer has {e}")
      first = {r: r * per for r in ranks}
    else:
      if int(num_experts) != e:
        raise ValueError(f"num_experts={num_experts} but the layer has {e} experts")
      if held != len(ranks) * per:
        raise ValueError(f"the weights hold {held} experts; with num_experts={e} this process's "
                         f"EP ranks {list(ranks)} hold {len(ranks) * per}")
      first = {r: k * per for k, r in enumerate(ranks)}
    block = lambda r, a, b: _expert_rows(weights, first[r] + a, first[r] + b)

  shards: dict[str, list[Array]] = {}
  shapes: dict[str, tuple] = {}
  for device, j, r in _mesh_positions(mesh, expert_axis, tensor_axis):
    with jax.default_device(device):
      arrays = _prepare_in_chunks(
          lambda a, b: experts[r].prepare(
              _tp_slice(jax.device_put(block(r, a, b), device), j, n_tp)), per)
      for name, a in arrays.items():
        a = jax.device_put(jnp.asarray(a)[None, None], device)
        if shapes.setdefault(name, a.shape) != a.shape:
          raise ValueError(f"prepared array {name!r} has shape {a.shape[2:]} on one shard and "
                           f"{shapes[name][2:]} on another")
        shards.setdefault(name, []).append(a)
  sharding = NamedSharding(mesh, layout.spec)
  out = {name: jax.make_array_from_single_device_arrays(
      (n_tp, n_ep) + shapes[name][2:], sharding, parts) for name, parts in shards.items()}
  return layout, out


_PREPARE_CHUNK = 16  # experts drawn and prepared at a time on a device


def _prepare_in_chunks(prepare: Callable[[int, int], dict[str, Array]], count: int
                       ) -> dict[str, Array]:
  """`prepare(start, stop)` of experts [0, count) in chunks of `_PREPARE_CHUNK`, concatenated:
  a shard's conversion temporaries (int32 codes, transposes) stay those of one chunk, not of all
  its experts (256 DeepSeek-V3 experts are 5.6 GB of int4 a layer). Every experts class
  prepares each expert on its own; arrays without an expert axis (placeholders of absent parts)
  are equal in every chunk and kept once."""
  if count <= _PREPARE_CHUNK:
    return dict(prepare(0, count))
  parts: dict[str, list[Array]] = {}
  sizes = []
  for start in range(0, count, _PREPARE_CHUNK):
    stop = min(count, start + _PREPARE_CHUNK)
    sizes.append(stop - start)
    for name, a in prepare(start, stop).items():
      parts.setdefault(name, []).append(jnp.asarray(a))
  out = {}
  for name, arrays in parts.items():
    if all(a.ndim and a.shape[0] == n for a, n in zip(arrays, sizes)):
      out[name] = jnp.concatenate(arrays)
    elif all(a.shape == arrays[0].shape for a in arrays):
      out[name] = arrays[0]
    else:
      raise ValueError(f"prepared array {name!r} has no expert axis and differs between chunks "
                       f"of experts: {[a.shape for a in arrays]}")
  return out


def _shard_map_unchecked(f, *, mesh: Mesh, in_specs, out_specs):
  """`shard_map` without the varying-axes check: the experts classes' jnp code (`lax.cond`,
  `lax.map` over blocks) mixes per-shard and constant values, which the check refuses."""
  try:
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  except TypeError:  # older jax
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _local(arrays: dict[str, Array]) -> dict[str, Array]:
  return {name: a[0, 0] for name, a in arrays.items()}


def _rank_switch(axis: str | None, n_ep: int, branch: Callable[[int], Array]) -> Array:
  """`branch(r)` of this shard's EP rank r (each branch a static rank: the kernels' offsets)."""
  if axis is None or n_ep == 1:
    return branch(0)
  return jax.lax.switch(jax.lax.axis_index(axis), [functools.partial(branch, r)
                                                    for r in range(n_ep)])


def _combine_slots(v: Array, scheme: str, dtype) -> Array:
  """[T, K, H] per-pair outputs -> [T, H] as the scheme's op adds its top-k."""
  # Slot by slot, as the kernels' finalize adds them (a reduce op may reassociate).
  out = jnp.zeros((v.shape[0], v.shape[-1]), jnp.float32)
  for slot in range(v.shape[1]):
    out = out + v[:, slot].astype(jnp.float32)
    if scheme not in _SCHEMES_SUM_ONCE:
      out = reference.round_to_dtype(out, dtype)
  return reference.round_to_dtype(out, dtype).astype(dtype)


# Replicated dispatch at or above this many tokens per expert shard splits the tokens over the
# expert axis around the experts (all-gather in, reduce-scatter of the f32 sums out: 3/4 of a
# psum's bytes, and the input arrives split as data-parallel attention leaves it). Below it one
# psum: at decode sizes each collective's latency, not its bytes, is the cost.
_SCATTER_MIN_TOKENS_PER_SHARD = 64


def _on_gpus(mesh: Mesh) -> bool:
  return all(d.platform in ("gpu", "cuda", "rocm") for d in mesh.devices.flat)


def replicated_scatters(tokens: int, n_ep: int) -> bool:
  """Whether replicated dispatch of `tokens` over n_ep expert shards takes the all-gather /
  reduce-scatter form (else one psum)."""
  return n_ep > 1 and tokens >= _SCATTER_MIN_TOKENS_PER_SHARD * n_ep


def _routed_rows_fn(layout: ExpertsLayout, arrays: dict[str, Array]
                    ) -> Callable[[Array, Array, Array], Array]:
  """run(rows [R, H], local ids [R, 1], weights [R, 1]) -> [R, H]: one-slot rows on this shard's
  experts (id -1: nothing)."""
  local = _local(arrays)
  return lambda x, ids, w: layout.experts[0].apply_routed(x, ids, w, local)


def _route(layout: ExpertsLayout, logits: Array, routing, correction_bias) -> tuple[Array, Array]:
  """(topk_weights, topk_ids) as the experts' own routing computes them (MxInt4: the kernel's
  routing step, so the pairs carry the bits the fused op would use)."""
  if not layout.kernel_routing:
    return routing.select(logits, correction_bias)
  return layout.experts[0].route(logits, routing, correction_bias)


def moe_sharded(x: Array, router_logits: Array, layout: ExpertsLayout, arrays: dict[str, Array],
                routing, correction_bias: Array | None = None, *,
                capacity_factor: float | None = 2.0, dispatch: str = "replicated") -> Array:
  """The experts of `shard_experts` over their mesh, from router logits: x [T, H] and
  router_logits [T, E] -> [T, H] in x.dtype, replicated over the mesh.

  `routing`: the layer's `RoutingOptions`; `correction_bias` its [E] bias (DeepSeek-V3). Routed
  experts (every scheme but kernel-routing MxInt4) take `routing.select`'s pairs
  (`moe_sharded_routed`); MxInt4 routes inside its kernel on each shard.
  dispatch="replicated": every shard sees all T tokens; pairs of other shards are skipped; the
  shards' partial outputs are summed (`capacity_factor` sizes the compacted per-shard call of
  routed experts, as `w4a8_moe_sharded`; MxInt4 runs its kernel on all tokens).
  dispatch="all_to_all" / "ragged_all_to_all": tokens split over the expert axis (T padded to a
  multiple of its size), pairs exchanged in rounds of a fixed capacity (module docstring);
  ragged is refused on a CPU mesh.
  """
  _check_dispatch(dispatch, layout.expert_axis, layout.mesh)
  h, e = layout.hidden_size, layout.num_experts
  if x.ndim != 2 or x.shape[1] != h:
    raise ValueError(f"x must be [tokens, {h}], got shape {x.shape}")
  if router_logits.shape != (x.shape[0], e):
    raise ValueError(f"router_logits must be [tokens, {e}] = {(x.shape[0], e)}, got shape "
                     f"{router_logits.shape}")
  if not layout.kernel_routing:
    weights, ids = routing.select(router_logits, correction_bias)
    return moe_sharded_routed(x, ids, weights, layout, arrays, capacity_factor=capacity_factor,
                              dispatch=dispatch)
  bias = () if correction_bias is None else (jnp.asarray(correction_bias, jnp.float32),)
  return _run_sharded(layout, arrays, dispatch, capacity_factor, x, router_logits, *bias,
                      routing=routing)


def moe_sharded_routed(x: Array, topk_ids: Array, topk_weights: Array, layout: ExpertsLayout,
                       arrays: dict[str, Array], *, capacity_factor: float | None = 2.0,
                       dispatch: str = "replicated") -> Array:
  """`moe_sharded` on already-routed tokens: topk_ids / topk_weights [T, K] (global ids; ids
  outside [0, E) contribute nothing). Not for kernel-routing (MxInt4) layouts."""
  _check_dispatch(dispatch, layout.expert_axis, layout.mesh)
  if layout.kernel_routing:
    raise ValueError(f"the {layout.backend} experts route inside their kernel: call moe_sharded "
                     "with router logits")
  h = layout.hidden_size
  if x.ndim != 2 or x.shape[1] != h:
    raise ValueError(f"x must be [tokens, {h}], got shape {x.shape}")
  if topk_ids.ndim != 2 or topk_ids.shape != topk_weights.shape or (
      topk_ids.shape[0] != x.shape[0]):
    raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both "
                     f"be [tokens={x.shape[0]}, K]")
  return _run_sharded(layout, arrays, dispatch, capacity_factor, x,
                      topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32))


def _run_sharded(layout: ExpertsLayout, arrays: dict[str, Array], dispatch: str,
                 capacity_factor: float | None, x: Array, *token_args: Array,
                 routing=None) -> Array:
  """shard_map of the experts over the mesh. token_args: (ids, weights) of routed layouts, or
  (router logits[, correction bias]) of kernel-routing ones."""
  mesh = layout.mesh
  names = tuple(sorted(arrays))
  n_ep, per = layout.n_ep, layout.local_experts
  axes = tuple(a for a in (layout.tensor_axis, layout.expert_axis) if a is not None)
  n_token_args = 2 if not layout.kernel_routing else 1

  def unpack(rest):
    """(correction bias or None, this shard's arrays by name) from the per-shard args after the
    token args."""
    bias = rest[0] if len(rest) > len(names) else None
    return bias, dict(zip(names, rest[len(rest) - len(names):]))

  def pairs(token_in, rest):
    """(weights, ids, local arrays) of this shard's tokens."""
    bias, local_arrays = unpack(rest)
    if not layout.kernel_routing:
      ids, weights = token_in
      return weights, ids, local_arrays
    weights, ids = _route(layout, token_in[0], routing, bias)
    return weights, ids.astype(jnp.int32), local_arrays

  def split_tokens(body):
    """`body` per shard with x and the per-token args split over the expert axis (T padded to
    a multiple of it), the rest of the token args replicated; [T, H] split the same way."""
    t, padded = _pad_tokens(n_ep, x, *token_args[:n_token_args])
    extra = token_args[n_token_args:]
    tokens = P(layout.expert_axis)
    fn = _shard_map_unchecked(
        body, mesh=mesh,
        in_specs=(tokens,) * (1 + n_token_args) + (P(),) * len(extra) + (layout.spec,) * len(names),
        out_specs=tokens)
    return fn(*padded, *extra, *(arrays[n] for n in names))[:t]

  if dispatch != "replicated":
    def a2a_body(x, *rest):
      weights, ids, local_arrays = pairs(rest[:n_token_args], rest[n_token_args:])
      factor = _A2A_DEFAULT_CAPACITY if capacity_factor is None else capacity_factor
      t, k = ids.shape
      v, _ = _a2a_pair_outputs(_routed_rows_fn(layout, local_arrays), x, ids, weights, per,
                               layout.expert_axis, n_ep, a2a_capacity(t, k, n_ep, factor),
                               layout.tensor_axis, dispatch == "ragged_all_to_all")
      return _combine_slots(v, layout.scheme, x.dtype)

    return split_tokens(a2a_body)

  # GPU kernels skip ids outside [0, E) at no cost, so a shard runs every row with the other
  # shards' pairs masked (`_ep_apply` without a capacity) rather than gathering one-slot rows.
  factor = None if _on_gpus(mesh) else capacity_factor
  scatter = layout.expert_axis is not None and replicated_scatters(x.shape[0], n_ep)

  def body(x, *rest):
    token_in, rest = rest[:n_token_args], rest[n_token_args:]
    if scatter:  # tokens arrive split over the expert axis: every shard runs all of them
      gather = functools.partial(jax.lax.all_gather, axis_name=layout.expert_axis, tiled=True)
      x, token_in = gather(x), tuple(gather(a) for a in token_in)
    bias, local_arrays = unpack(rest)
    if layout.kernel_routing:
      local = _local(local_arrays)
      y = _rank_switch(layout.expert_axis, n_ep, lambda r: layout.experts[r].apply(
          x, token_in[0], local, routing, bias)).astype(jnp.float32)
    else:
      ids, weights = token_in
      y = _ep_apply(_routed_rows_fn(layout, local_arrays), x, ids, weights, per,
                    layout.expert_axis, n_ep, factor, null_id=-1)
    if not scatter:
      return _combine(y, x.dtype, axes)
    if layout.tensor_axis is not None:
      y = jax.lax.psum(y, layout.tensor_axis)
    # Each shard keeps the f32 sums of its own tokens: half the bytes of a psum of all of them.
    return jax.lax.psum_scatter(y, layout.expert_axis, scatter_dimension=0,
                                tiled=True).astype(x.dtype)

  if scatter:
    return split_tokens(body)
  fn = _shard_map_unchecked(body, mesh=mesh,
                            in_specs=(P(),) * (1 + len(token_args)) + (layout.spec,) * len(names),
                            out_specs=P())
  return fn(x, *token_args, *(arrays[n] for n in names))
