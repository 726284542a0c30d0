"""MoE layers of a model split over a `jax.sharding.Mesh` (`from_pretrained(mesh=...)`).

Expert parallelism as `jax_moeq.sharding` does it: EP rank r holds experts [r*E/n_ep,
(r+1)*E/n_ep). Each process reads from the checkpoint only the experts of its own devices' EP
ranks (`local_expert_ids`), packs them for the CPU W4A8 kernel and places them on those devices;
no process holds the others. The router and every non-expert weight are replicated over the mesh.
Each MoE layer then runs `w4a8_moe_sharded` with the chosen token dispatch inside the model's
`jit`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_moeq import sharding
from jax_moeq.experts.cpu_int4 import w4a8_scales
from jax_moeq.models import config as config_lib
from jax_moeq.nn.moe import MoESpec, QuantizedWeight, _MoEBase
from jax_moeq.ops import w4a8_cpu
from jax_moeq.weights import Int4MoEWeights, fold_w2_act_order

Array = jax.Array
MESH_BACKENDS = ("auto", "cpu_int4")  # the sharded path runs the CPU W4A8 kernel only


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """How a model's experts are split over `mesh` (arguments of `from_pretrained`)."""

  mesh: Mesh
  expert_axis: str | None
  tensor_axis: str | None
  dispatch: str
  capacity_factor: float | None

  def experts(self, num_experts: int) -> tuple[int, ...]:
    """The experts this process reads and holds."""
    return sharding.local_expert_ids(self.mesh, self.expert_axis, num_experts)


def make_plan(mesh: Mesh, cfg: config_lib.DecoderConfig, *, expert_axis: str | None,
              tensor_axis: str | None, dispatch: str, capacity_factor: float | None,
              moe_backend: str, group_size: int | None) -> ShardPlan:
  """Checks the mesh options before any tensor is read; ValueError says what is unsupported."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  platforms = sorted({d.platform for d in mesh.devices.flat})
  if platforms != ["cpu"]:
    raise ValueError(f"from_pretrained(mesh=...) runs the experts on the CPU W4A8 kernel "
                     f"(jax_moeq.sharding.w4a8_moe_sharded); this mesh has {platforms} devices. "
                     "Sharded GPU experts are only available through "
                     "jax_moeq.sharding.experts_sharded")
  if moe_backend not in MESH_BACKENDS:
    raise ValueError(f"moe_backend={moe_backend!r}: with a mesh the experts run on the CPU W4A8 "
                     f"kernel; pass one of {MESH_BACKENDS}")
  sharding._check_dispatch(dispatch, expert_axis, mesh)  # refuses ragged on a CPU mesh
  sharding._check_split(mesh, expert_axis, tensor_axis, cfg.num_experts,
                        cfg.moe_intermediate_size, group_size, w4a8_cpu.TILE_ROWS)
  return ShardPlan(mesh, expert_axis, tensor_axis, dispatch, capacity_factor)


def check_w4a8(scheme: str | None, quantize_to: str | None, allow: bool) -> None:
  """The sharded path needs experts on the W4A8 kernel: float experts quantized to w4a8_int8 on
  load, or int4 experts whose activations may be quantized to int8."""
  if scheme is None and quantize_to != "w4a8_int8":
    raise ValueError(f"with a mesh the experts run on the CPU W4A8 kernel: a float checkpoint "
                     f"needs quantization='w4a8_int8' (got {quantize_to!r})")
  if scheme is not None and scheme != "w4a8_int8" and not allow:
    raise ValueError(f"with a mesh the experts run on the CPU W4A8 kernel: this checkpoint's "
                     f"{scheme} experts need quantization='w4a8_int8' (or "
                     "allow_activation_quantization=True) to run there")


class ShardedQuantizedMoE(_MoEBase):
  """A W4A8 MoE block whose experts live on a mesh: `QuantizedMoE`'s router and routing, with
  the experts run by `jax_moeq.sharding.w4a8_moe_sharded` (EP / TP, replicated or all-to-all
  token dispatch). Holds the packed shards as `QuantizedWeight`s (global arrays on the mesh)."""

  def __init__(self, spec: MoESpec, weights: sharding.ShardedW4A8Weights, *,
               router_weight: Any, correction_bias: Any, dtype, param_dtype, dispatch: str,
               capacity_factor: float | None):
    self.spec = spec
    self.dtype = dtype
    self._init_router(spec, dtype, param_dtype, None, router_weight, correction_bias)
    self.w13_packed = QuantizedWeight(weights.w13_packed)
    self.w2_packed = QuantizedWeight(weights.w2_packed)
    self.group_size = weights.group_size
    self.mesh = weights.mesh
    self.expert_axis = weights.expert_axis
    self.tensor_axis = weights.tensor_axis
    self.dispatch = dispatch
    self.capacity_factor = capacity_factor
    self.scheme = "w4a8_int8"
    n_ep = sharding._axis_size(weights.mesh, weights.expert_axis)
    n_tp = sharding._axis_size(weights.mesh, weights.tensor_axis)
    self.backend = f"cpu_int4 (EP {n_ep} x TP {n_tp}, {dispatch} dispatch)"

  def sharded_weights(self) -> sharding.ShardedW4A8Weights:
    spec = self.spec
    return sharding.ShardedW4A8Weights(
        self.w13_packed[...], self.w2_packed[...], spec.num_experts, spec.hidden_size,
        spec.intermediate_size, self.group_size, self.mesh, self.expert_axis, self.tensor_axis)

  def __call__(self, x: Array, router_logits: Array | None = None) -> Array:
    tokens, logits, lead = self._flatten(x, router_logits)
    topk_weights, topk_ids = self.route(logits)
    y = sharding.w4a8_moe_sharded(
        tokens, topk_ids, topk_weights, self.sharded_weights(),
        apply_router_weight_on_input=self.spec.apply_router_weight_on_input,
        activation_kind={"silu": 0, "swigluoai": 1}[self.spec.activation],
        capacity_factor=self.capacity_factor, dispatch=self.dispatch)
    return y.reshape(*lead, self.spec.hidden_size)


def sharded_moe_block(layer, cfg: config_lib.DecoderConfig, dtype, plan: ShardPlan, *,
                      quantize_to: str | None, group_size: int | None,
                      quantize_fn) -> ShardedQuantizedMoE:
  """The block of one layer whose `layer` (a `MoELayerTensors`) holds only this process's experts
  (`plan.experts`): float ones are quantized here (`quantize_fn`, per expert, so the same values
  as quantizing all of them), int4 ones are taken as stored."""
  e = cfg.num_experts
  if layer.quantized:
    w = Int4MoEWeights.from_layer(layer)
    if w.w13_g_idx is not None:
      raise ValueError("these experts use act-order on w13 (a per-expert permutation of the "
                       "hidden input), which the W4A8 kernel cannot apply: they cannot run on a "
                       "mesh")
    g = w.group_size
  else:
    if quantize_to != "w4a8_int8":
      raise ValueError(f"float experts on a mesh need quantization='w4a8_int8', got "
                       f"{quantize_to!r}")
    w = quantize_fn(jnp.asarray(layer.w13, jnp.float32), jnp.asarray(layer.w2, jnp.float32),
                    group_size)
    bias = lambda b: None if b is None else jnp.asarray(b, jnp.float32)
    w = dataclasses.replace(w, w13_bias=bias(layer.w13_bias), w2_bias=bias(layer.w2_bias))
    g = group_size
  w = w4a8_scales(fold_w2_act_order(w))  # exact; the scales as the W4A8 kernel stores them
  weights = sharding.shard_w4a8_weights(
      w.w13_q, w.w2_q, w.w13_scale, w.w2_scale, g, mesh=plan.mesh,
      expert_axis=plan.expert_axis, tensor_axis=plan.tensor_axis, w13_bias=w.w13_bias,
      w2_bias=w.w2_bias, num_experts=e)
  corr = layer.e_score_correction_bias
  spec = MoESpec(num_experts=e, top_k=cfg.top_k, hidden_size=cfg.hidden_size,
                 intermediate_size=cfg.moe_intermediate_size, renormalize=cfg.norm_topk_prob,
                 use_bias=w.w13_bias is not None, e_score_correction_bias=corr is not None)
  return ShardedQuantizedMoE(spec, weights, router_weight=layer.router_weight,
                             correction_bias=corr, dtype=dtype, param_dtype=dtype,
                             dispatch=plan.dispatch, capacity_factor=plan.capacity_factor)


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
    return sharding._place(np.asarray(a), replicated)

  nnx.update(model, jax.tree.map(put, nnx.state(model)))
