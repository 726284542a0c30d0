"""MoE layers of a model split over a `jax.sharding.Mesh` (`from_pretrained(mesh=...)`,
`from_config(mesh=...)`), on any platform and for every int4 scheme.

Expert parallelism as `jax_moeq.sharding` does it: EP rank r holds experts [r*E/n_ep,
(r+1)*E/n_ep), optionally split over I by a tensor axis. The experts run through the route of the
single-device blocks: the scheme's oracle chooses the experts class for one shard's share of the
layer, whose `prepare` converts each device's share on that device and whose `apply_routed` /
`apply` runs it (`sharding.shard_experts` / `sharding.moe_sharded`). Each process reads from the
checkpoint only the experts of its own devices' EP ranks (`local_expert_ids`); random experts
(`from_config`) are drawn on the devices that hold them, per expert from the layer's key, so the
model is the same on every mesh.

The router and every non-expert weight are replicated over the mesh. When the batch divides the
mesh, the MoE block's input and output are constrained to be split over the batch on every mesh
axis, so XLA runs attention, norms and the KV cache data-parallel (each device its rows) and only
the experts are exchanged (expert parallelism).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_moeq import sharding
from jax_moeq.models import config as config_lib
from jax_moeq.nn.moe import MoESpec, QuantizedWeight, _MoEBase
from jax_moeq.weights import Int4MoEWeights

Array = jax.Array
MESH_SCHEMES = ("w4a8_int8", "wna16", "mxint4")
# Experts drawn and quantized per chunk on their device (bounds the float32 temporaries).
_RANDOM_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """How a model's experts are split over `mesh` (arguments of `from_pretrained`)."""

  mesh: Mesh
  expert_axis: str | None
  tensor_axis: str | None
  dispatch: str
  capacity_factor: float | None
  data_parallel: bool = True

  def experts(self, num_experts: int) -> tuple[int, ...]:
    """The experts this process reads and holds."""
    return sharding.local_expert_ids(self.mesh, self.expert_axis, num_experts)


def make_plan(mesh: Mesh, cfg: config_lib.DecoderConfig, *, expert_axis: str | None,
              tensor_axis: str | None, dispatch: str, capacity_factor: float | None,
              moe_backend: str = "auto", group_size: int | None = None,
              data_parallel: bool = True) -> ShardPlan:
  """Checks the mesh options before any tensor is read; ValueError says what is unsupported
  (a mesh that does not divide E or I in whole groups, ragged_all_to_all on a CPU mesh)."""
  del moe_backend  # checked by the scheme's oracle on the shard's layer
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  sharding._check_dispatch(dispatch, expert_axis, mesh)  # refuses ragged on a CPU mesh
  sharding.check_mesh_split(mesh, expert_axis, tensor_axis, cfg.num_experts,
                            cfg.moe_intermediate_size, group_size)
  return ShardPlan(mesh, expert_axis, tensor_axis, dispatch, capacity_factor, data_parallel)


def check_mesh_scheme(scheme: str | None, quantize_to: str | None) -> None:
  """The sharded path runs int4 experts: float checkpoints need a quantization on load."""
  if scheme is None and quantize_to is None:
    raise ValueError(f"with a mesh the experts run int4: a float checkpoint needs quantization= "
                     f"one of {MESH_SCHEMES} (got None)")


class ShardedMoE(_MoEBase):
  """An int4 MoE block whose experts live on a mesh: `QuantizedMoE`'s router and routing, the
  experts run by `jax_moeq.sharding.moe_sharded` (EP / TP, replicated or all-to-all token
  dispatch) on the experts class the scheme's oracle chose for one shard. Holds each prepared
  array as a `QuantizedWeight` (a global [n_tp, n_ep, ...] array on the mesh)."""

  def __init__(self, spec: MoESpec, layout: sharding.ExpertsLayout, arrays: dict[str, Array], *,
               router_weight: Any, correction_bias: Any, dtype, param_dtype, dispatch: str,
               capacity_factor: float | None, data_parallel: bool = True):
    self.spec = spec
    self.dtype = dtype
    self._init_router(spec, dtype, param_dtype, None, router_weight, correction_bias)
    self.layout = layout
    self.sharded_names = tuple(sorted(arrays))
    for name in self.sharded_names:
      setattr(self, name, QuantizedWeight(arrays[name]))
    self.dispatch = dispatch
    self.capacity_factor = capacity_factor
    self.data_parallel = data_parallel
    self.scheme = layout.scheme
    self.group_size = layout.group_size
    self.mesh = layout.mesh

  @property
  def backend(self) -> str:
    return self.layout.describe(self.dispatch)

  def sharded_arrays(self) -> dict[str, Array]:
    return {name: getattr(self, name)[...] for name in self.sharded_names}

  def _batch_split(self, a: Array) -> Array:
    """`a` [B, ...] constrained to be split over the batch on every mesh axis (data-parallel
    attention around the experts), when B divides the mesh."""
    n = self.mesh.devices.size
    if not self.data_parallel or n == 1 or a.ndim < 2 or a.shape[0] % n:
      return a
    spec = P(tuple(self.mesh.axis_names))
    return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, spec))

  def __call__(self, x: Array, router_logits: Array | None = None) -> Array:
    x = self._batch_split(x)
    tokens, logits, lead = self._flatten(x, router_logits)
    y = sharding.moe_sharded(tokens, logits, self.layout, self.sharded_arrays(),
                             self.spec.routing, self._correction_bias(),
                             capacity_factor=self.capacity_factor, dispatch=self.dispatch)
    return self._batch_split(y.reshape(*lead, self.spec.hidden_size))


def _slice_int4(w: Int4MoEWeights, start: int, stop: int) -> Int4MoEWeights:
  changes = {}
  for f in dataclasses.fields(w):
    a = getattr(w, f.name)
    if a is not None and f.name != "group_size":
      changes[f.name] = jnp.asarray(a[start:stop])
  return dataclasses.replace(w, **changes)


@functools.partial(jax.jit, static_argnames=("hidden", "intermediate", "dtype"))
def _draw_experts(key, ids, *, hidden: int, intermediate: int, dtype):
  """Experts `ids`' float weights: 0.02 * normal(fold_in(key, e)) rounded to `dtype`, in f32.
  One jitted function for every layer (the key is an argument), so a model's build compiles it
  once per device instead of once per layer and device (94-layer model: 376 compiles)."""

  def one(e):
    k13, k2 = jax.random.split(jax.random.fold_in(key, e))
    w13 = (0.02 * jax.random.normal(k13, (2 * intermediate, hidden), jnp.float32)).astype(dtype)
    w2 = (0.02 * jax.random.normal(k2, (hidden, intermediate), jnp.float32)).astype(dtype)
    return w13.astype(jnp.float32), w2.astype(jnp.float32)

  return jax.vmap(one)(ids)


def _random_experts(key, cfg: config_lib.DecoderConfig, dtype, group_size: int,
                    quantize_fn) -> Callable[[int, int], Int4MoEWeights]:
  """(start, stop) -> int4 experts [start, stop) drawn on the current default device: expert e's
  float weights are 0.02 * normal(fold_in(key, e)) in `dtype` (as `from_config`'s source draws),
  quantized in chunks, so no device draws another's experts."""
  h, i = cfg.hidden_size, cfg.moe_intermediate_size

  def block(start: int, stop: int) -> Int4MoEWeights:
    parts = []
    for s in range(start, stop, _RANDOM_CHUNK):
      ids = jnp.arange(s, min(stop, s + _RANDOM_CHUNK))
      w13, w2 = _draw_experts(key, ids, hidden=h, intermediate=i, dtype=jnp.dtype(dtype))
      parts.append(quantize_fn(w13, w2, group_size))
    return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)

  return block


def sharded_moe_block(source, index: int, cfg: config_lib.DecoderConfig, dtype, plan: ShardPlan,
                      *, scheme: str | None, quantize_to: str | None, group_size: int | None,
                      moe_backend: str, allow_activation_quantization: bool,
                      quantize_fn) -> ShardedMoE:
  """Layer `index`'s MoE block on `plan.mesh`. From a checkpoint source only this process's
  experts are read (int4 taken as stored; float quantized to `quantize_to` per device share);
  from a random source (`from_config`) each device draws its own experts."""
  e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  run_scheme = quantize_to or scheme
  check_mesh_scheme(scheme, quantize_to)
  random_draw = not hasattr(source, "ckpt")  # `loading._RandomSource` reads no checkpoint
  corr = None
  if random_draw:  # `from_config`'s random source: router drawn here, experts on their devices
    router = source.tensor(f"{cfg.moe_prefix(index)}.gate.weight", (e, h))
    weights = _random_experts(source._next(), cfg, dtype, group_size, quantize_fn)
    use_bias = False
  else:
    mine = plan.experts(e)
    layer = source.moe_layer(index, mine)
    router, corr = layer.router_weight, layer.e_score_correction_bias
    row = {g: k for k, g in enumerate(mine)}
    if layer.quantized:
      w = Int4MoEWeights.from_layer(layer)
      group_size = w.group_size
      weights = lambda start, stop: _slice_int4(w, row[start], row[start] + stop - start)
    else:
      if quantize_to is None:
        raise ValueError("float experts on a mesh need quantization=...")
      bias = lambda b: None if b is None else jnp.asarray(b, jnp.float32)

      def weights(start, stop, layer=layer):
        a, b = row[start], row[start] + stop - start
        w = quantize_fn(jnp.asarray(layer.w13[a:b], jnp.float32),
                        jnp.asarray(layer.w2[a:b], jnp.float32), group_size)
        return dataclasses.replace(
            w, w13_bias=None if layer.w13_bias is None else bias(layer.w13_bias[a:b]),
            w2_bias=None if layer.w2_bias is None else bias(layer.w2_bias[a:b]))
    use_bias = layer.w13_bias is not None
  spec = MoESpec(num_experts=e, top_k=cfg.top_k, hidden_size=h, intermediate_size=i,
                 renormalize=cfg.norm_topk_prob, use_bias=use_bias,
                 e_score_correction_bias=corr is not None)
  layout, arrays = sharding.shard_experts(
      run_scheme, spec.layer(dtype), weights, mesh=plan.mesh, expert_axis=plan.expert_axis,
      tensor_axis=plan.tensor_axis, group_size=group_size, moe_backend=moe_backend,
      allow_activation_quantization=allow_activation_quantization)
  return ShardedMoE(spec, layout, arrays, router_weight=router, correction_bias=corr,
                    dtype=dtype, param_dtype=dtype, dispatch=plan.dispatch,
                    capacity_factor=plan.capacity_factor, data_parallel=plan.data_parallel)


def replicate_on_mesh(model: nnx.Module, mesh: Mesh) -> None:
  """Places every array of `model` not already on `mesh` there, replicated (attention,
  embeddings, norms, routers, LM head), so that one `jit` runs the whole model over the mesh,
  also across processes (each process places its own copy)."""
  replicated = NamedSharding(mesh, P())

  def put(a):
    if not isinstance(a, (jax.Array, np.ndarray)):
      return a
    if isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and (
        a.sharding.mesh == mesh):
      return a
    if jax.process_count() == 1 and isinstance(a, jax.Array):
      return jax.device_put(a, replicated)
    return sharding._place(np.asarray(a), replicated)

  nnx.update(model, jax.tree.map(put, nnx.state(model)))
