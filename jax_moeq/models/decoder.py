"""The decoder every architecture shares, in Flax NNX, built from given arrays (no random init).

    embed_tokens -> L x [x + attn(input_layernorm(x)); x + mlp(post_attention_layernorm(x))]
                 -> norm -> lm_head

RMSNorm: `w * (x * rsqrt(mean(x^2) + eps))` computed in float32 and cast back; attention: GQA,
causal (optionally a sliding window), softmax in float32, RoPE in the rotate-half form; the MLP is
a `jax_moeq.nn.MoE` / `QuantizedMoE` block (router included) or a dense SiLU MLP. SPEC §11.

Linear layers (attention projections, dense MLPs, LM head) are float `Linear`s or int4
`jax_moeq.nn.QuantizedLinear`s (SPEC §12); q/k/v (and a dense MLP's gate/up) may be one fused
`qkv_proj` (`gate_up_proj`) whose output is split. The attention math (q/k/v after projection,
scores with float32 accumulation, probabilities, the value product) and the KV cache run in the
model's `attention_dtype`.

Two entry points: `model(input_ids)` is the plain full-sequence forward (logits [B, S, V]);
`model.forward(input_ids, cache, write_index, pad)` reads and writes a KV cache for generation.
A cache is a pytree `KVCache(k, v)` of per-layer [B, L, kv_heads, head_dim] arrays; slot j of row b
holds the token at position `j - pad[b]` (rows are left-padded by `pad[b]` slots).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moeq.models.config import DecoderConfig
from jax_moeq.nn.moe import MoE, QuantizedMoE

Array = jax.Array


class Weight(nnx.Param):
  """A float weight read from a checkpoint (or drawn for a random model)."""


class KVCache(NamedTuple):
  k: tuple[Array, ...]  # per layer [B, L, kv_heads, head_dim]
  v: tuple[Array, ...]

  @property
  def length(self) -> int:
    return self.k[0].shape[1]


class RMSNorm(nnx.Module):
  def __init__(self, weight: Array, eps: float, dtype):
    self.weight = Weight(jnp.asarray(weight, dtype))
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * xf.astype(x.dtype)


class Linear(nnx.Module):
  """y = x W^T (+ b), W [out, in] as checkpoints store it."""

  def __init__(self, weight: Array, bias: Array | None, dtype):
    self.weight = Weight(jnp.asarray(weight, dtype))
    self.bias = None if bias is None else Weight(jnp.asarray(bias, dtype))

  def __call__(self, x: Array) -> Array:
    y = jnp.einsum("...i,oi->...o", x, self.weight[...])
    return y if self.bias is None else y + self.bias[...]


def make_linear(value: Any, dtype) -> nnx.Module:
  """A module given as is (e.g. `QuantizedLinear`), or a float `Linear` of (weight, bias)."""
  if isinstance(value, nnx.Module):
    return value
  return Linear(*value, dtype)


def _split(y: Array, sizes: tuple[int, ...]) -> list[Array]:
  offsets = [sum(sizes[:i]) for i in range(1, len(sizes))]
  return jnp.split(y, offsets, axis=-1)


def rope(x: Array, positions: Array, theta: float) -> Array:
  """Rotary embedding of x [B, S, heads, d] at integer positions [B, S] (rotate-half form)."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, d/2]
  angle = jnp.concatenate([angle, angle], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angle).astype(x.dtype), jnp.sin(angle).astype(x.dtype)
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x * cos + rotated * sin


class Attention(nnx.Module):
  """GQA self-attention; q/k norms per head (Qwen3) or over the whole projection (OLMoE)."""

  def __init__(self, cfg: DecoderConfig, weights: dict[str, Any], dtype, attention_dtype=None):
    self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.rope_theta = cfg.rope_theta
    self.clip_qkv = cfg.clip_qkv
    self.qk_norm = cfg.qk_norm
    self.attention_dtype = jnp.dtype(dtype if attention_dtype is None else attention_dtype)
    if "qkv_proj" in weights:  # q, k, v rows in one GEMM
      self.qkv_proj = make_linear(weights["qkv_proj"], dtype)
      self.q_proj = self.k_proj = self.v_proj = None
    else:
      self.qkv_proj = None
      self.q_proj = make_linear(weights["q_proj"], dtype)
      self.k_proj = make_linear(weights["k_proj"], dtype)
      self.v_proj = make_linear(weights["v_proj"], dtype)
    self.o_proj = make_linear(weights["o_proj"], dtype)
    if cfg.qk_norm == "none":
      self.q_norm = self.k_norm = None
    else:
      self.q_norm = RMSNorm(weights["q_norm"], cfg.rms_norm_eps, dtype)
      self.k_norm = RMSNorm(weights["k_norm"], cfg.rms_norm_eps, dtype)

  def __call__(self, x: Array, positions: Array, mask: Array, kv: tuple[Array, Array] | None,
               write_index: Array | int) -> tuple[Array, tuple[Array, Array] | None]:
    b, s, _ = x.shape
    nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
    if self.qkv_proj is not None:
      q, k, v = _split(self.qkv_proj(x), (nh * d, nkv * d, nkv * d))
    else:
      q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if self.qk_norm == "whole":
      q, k = self.q_norm(q), self.k_norm(k)
    if self.clip_qkv is not None:
      q, k, v = (jnp.clip(t, -self.clip_qkv, self.clip_qkv) for t in (q, k, v))
    q, k, v = q.reshape(b, s, nh, d), k.reshape(b, s, nkv, d), v.reshape(b, s, nkv, d)
    if self.qk_norm == "per_head":
      q, k = self.q_norm(q), self.k_norm(k)
    adt = self.attention_dtype
    q, k, v = q.astype(adt), k.astype(adt), v.astype(adt)
    q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
    if kv is not None:
      zero = jnp.zeros((), jnp.int32)
      index = (zero, jnp.asarray(write_index, jnp.int32), zero, zero)
      k = jax.lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), index)
      v = jax.lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), index)
      kv = (k, v)
    q = q.reshape(b, s, nkv, nh // nkv, d)
    scores = jnp.einsum("bsgrd,blgd->bgrsl", q, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(adt)
    out = jnp.einsum("bgrsl,blgd->bsgrd", probs, v.astype(adt))
    return self.o_proj(out.reshape(b, s, nh * d).astype(x.dtype)), kv


class DenseMLP(nnx.Module):
  """down(silu(gate(x)) * up(x)): the non-MoE layers of Qwen3-MoE (`mlp_only_layers`)."""

  def __init__(self, weights: dict[str, Any], dtype):
    if "gate_up_proj" in weights:  # gate rows, then up rows, in one GEMM
      self.gate_up_proj = make_linear(weights["gate_up_proj"], dtype)
      self.gate_proj = self.up_proj = None
    else:
      self.gate_up_proj = None
      self.gate_proj = make_linear(weights["gate_proj"], dtype)
      self.up_proj = make_linear(weights["up_proj"], dtype)
    self.down_proj = make_linear(weights["down_proj"], dtype)

  def __call__(self, x: Array) -> Array:
    if self.gate_up_proj is not None:
      y = self.gate_up_proj(x)
      gate, up = _split(y, (y.shape[-1] // 2, y.shape[-1] // 2))
    else:
      gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: DecoderConfig, weights: dict[str, Any], mlp: nnx.Module, dtype,
               attention_dtype=None):
    self.input_layernorm = RMSNorm(weights["input_layernorm"], cfg.rms_norm_eps, dtype)
    self.self_attn = Attention(cfg, weights, dtype, attention_dtype)
    self.post_attention_layernorm = RMSNorm(weights["post_attention_layernorm"],
                                            cfg.rms_norm_eps, dtype)
    self.mlp = mlp

  def __call__(self, x, positions, mask, kv, write_index):
    h, kv = self.self_attn(self.input_layernorm(x), positions, mask, kv, write_index)
    x = x + h
    if isinstance(self.mlp, (MoE, QuantizedMoE)):  # the residual add may run inside the MoE kernel
      return self.mlp(self.post_attention_layernorm(x), residual=x), kv
    return x + self.mlp(self.post_attention_layernorm(x)).astype(x.dtype), kv


def attention_mask(q_slots: Array, num_keys: int, pad: Array, window: int | None) -> Array:
  """[B, S, L] bool: query slot i of row b sees key slot j when pad[b] <= j <= i (and i - j <
  window). Slots before pad[b] are left padding."""
  k_slots = jnp.arange(num_keys, dtype=jnp.int32)
  q = q_slots[None, :, None]
  k = k_slots[None, None, :]
  visible = (k <= q) & (k >= pad[:, None, None])
  if window is not None:
    visible &= (q - k) < window
  return visible


class MoECausalLM(nnx.Module):
  """A decoder-only MoE language model (Qwen3-MoE, Mixtral, OLMoE): see the module docstring.

  Attributes: `config` (`DecoderConfig`), `dtype` (activations and float weights),
  `attention_dtype` (attention math and KV cache), `generation_config` (dict from
  `generation_config.json`), `quantization` (how the experts were loaded: the checkpoint's
  scheme, a scheme quantized on load, or None for float). `lm_head` is a float [V, H] weight,
  an int4 `QuantizedLinear`, or None (tied to the embedding).
  """

  def __init__(self, cfg: DecoderConfig, embed: Array, layers: list[DecoderLayer], norm: Array,
               lm_head: Array | nnx.Module | None, dtype, *,
               generation_config: dict | None = None, quantization: str | None = None,
               attention_dtype=None):
    self.config = cfg
    self.dtype = jnp.dtype(dtype)
    self.attention_dtype = jnp.dtype(dtype if attention_dtype is None else attention_dtype)
    self.embed_tokens = Weight(jnp.asarray(embed, dtype))
    self.layers = nnx.List(layers)
    self.norm = RMSNorm(norm, cfg.rms_norm_eps, dtype)
    if lm_head is None or isinstance(lm_head, nnx.Module):
      self.lm_head = lm_head
    else:
      self.lm_head = Weight(jnp.asarray(lm_head, dtype))
    # Kept hashable: the attributes of an NNX module are part of its (static) graph definition.
    self._generation_items = tuple(sorted(
        (k, _frozen(v)) for k, v in (generation_config or {}).items()))
    self.quantization = quantization

  @property
  def generation_config(self) -> dict[str, Any]:
    """`generation_config.json` as read (lists as tuples)."""
    return dict(self._generation_items)

  def moe_backends(self) -> dict[str, str]:
    """{scheme: backend} of the MoE blocks ("float": "xla (<float_impl>)" for float blocks)."""
    out: dict[str, str] = {}
    for layer in self.layers:
      mlp = layer.mlp
      if hasattr(mlp, "scheme"):
        out[mlp.scheme] = mlp.backend
      elif hasattr(mlp, "spec"):
        out["float"] = f"xla ({mlp.float_impl})"
    return out

  def linear_backends(self) -> dict[str, str]:
    """{scheme: backend} of the int4 linears (attention, dense MLPs, LM head); "float": "xla"
    when some linears are float. Router gates are not counted (always float)."""
    from jax_moeq.nn.linear import QuantizedLinear
    out: dict[str, str] = {}
    for module in self._linears():
      if isinstance(module, QuantizedLinear):
        out[module.scheme] = module.backend
      else:
        out["float"] = "xla"
    return out

  def _linears(self) -> list[nnx.Module | Weight]:
    found: list[Any] = []
    for layer in self.layers:
      attn = layer.self_attn
      found += [m for m in (attn.qkv_proj, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
                if m is not None]
      if isinstance(layer.mlp, DenseMLP):
        found += [m for m in (layer.mlp.gate_up_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                              layer.mlp.down_proj) if m is not None]
    found.append(self.embed_tokens if self.lm_head is None else self.lm_head)
    return found

  def init_cache(self, batch: int, length: int) -> KVCache:
    """An empty cache in `attention_dtype`."""
    cfg = self.config
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    dt = self.attention_dtype
    zeros = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return KVCache(zeros, tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)))

  def _logits(self, x: Array) -> Array:
    h = self.norm(x)
    if isinstance(self.lm_head, nnx.Module):  # int4 head: output in the model's dtype
      return self.lm_head(h).astype(jnp.float32)
    head = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
    return jnp.einsum("bsh,vh->bsv", h, head, preferred_element_type=jnp.float32)

  def _check_ids(self, input_ids: Array) -> Array:
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise ValueError(f"input_ids must be integer [batch, seq], got {input_ids.dtype}"
                       f"{tuple(input_ids.shape)}")
    return input_ids.astype(jnp.int32)

  def __call__(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
    """Logits (float32) [B, S, vocab] of a full sequence. `attention_mask` [B, S] (1 = token,
    0 = padding) supports left padding; without it every position is a token."""
    input_ids = self._check_ids(input_ids)
    b, s = input_ids.shape
    pad = jnp.zeros((b,), jnp.int32) if attention_mask is None else left_padding(attention_mask)
    logits, _ = self.forward(input_ids, None, 0, pad)
    return logits

  def forward(self, input_ids: Array, cache: KVCache | None, write_index: Array | int,
              pad: Array, *, last_only: bool = False) -> tuple[Array, KVCache | None]:
    """Logits [B, S, V] of tokens at slots write_index .. write_index + S - 1, with a cache
    (read and written at those slots) or without one (the tokens attend to each other only).
    `last_only`: logits of the last position only ([B, 1, V]; a prefill needs no more, and the
    LM head over every prompt position costs S times as much)."""
    b, s = input_ids.shape
    q_slots = jnp.asarray(write_index, jnp.int32) + jnp.arange(s, dtype=jnp.int32)
    num_keys = s if cache is None else cache.length
    mask = attention_mask(q_slots, num_keys, pad, self.config.sliding_window)
    positions = jnp.maximum(q_slots[None, :] - pad[:, None], 0)
    x = jnp.take(self.embed_tokens[...], input_ids, axis=0)
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      x, kv = layer(x, positions, mask, kv, write_index)
      if kv is not None:
        new_k.append(kv[0])
        new_v.append(kv[1])
    new_cache = None if cache is None else KVCache(tuple(new_k), tuple(new_v))
    return self._logits(x[:, -1:] if last_only else x), new_cache


def _frozen(value: Any) -> Any:
  if isinstance(value, dict):
    return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
  if isinstance(value, list):
    return tuple(_frozen(v) for v in value)
  return value


def left_padding(attention_mask: Array) -> Array:
  """Per-row count of leading padding slots of a left-padded [B, S] 0/1 mask."""
  mask = jnp.asarray(attention_mask).astype(jnp.int32)
  if mask.ndim != 2:
    raise ValueError(f"attention_mask must be [batch, seq], got shape {mask.shape}")
  return (mask.shape[1] - jnp.sum(mask, axis=1)).astype(jnp.int32)
