"""`generate`: KV-cache decoding with one jitted prefill and one jitted decode loop.

The prefill runs the (left-padded) prompts through the model, filling a KV cache of
S + max_new_tokens slots, and samples the first token. The decode loop is a `lax.while_loop`
that feeds one token per row per step and stops when every row has produced an EOS token or
`max_new_tokens` are out. After its EOS a row emits `pad_token_id`. Sampling: greedy at
temperature 0, else softmax(logits / temperature) restricted to the top-p nucleus.

Both steps are compiled once per (model structure, batch, prompt length, max_new_tokens,
sampling settings) and kept; `GenerateOutput` reports compile, prefill and decode wall times.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moeq.models.decoder import KVCache, MoECausalLM

Array = jax.Array


class GenerateOutput(NamedTuple):
  tokens: Array  # [B, max_new_tokens] int32; pad_token_id after a row's EOS
  num_tokens: Array  # [B] int32: tokens each row generated, its EOS included
  compile_seconds: float  # 0 when the compiled steps were reused
  prefill_seconds: float  # prompt through the model and the first token sampled
  decode_seconds: float  # the remaining tokens


def sample_tokens(logits: Array, rng: Array | None, temperature: float, top_p: float) -> Array:
  """Next tokens [B] from logits [B, V]: argmax at temperature 0, else nucleus sampling."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly better tokens
    kept = before < top_p  # always keeps the best token
    threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _prefill(graphdef, state, input_ids, pad, rng, *, cache_len: int, temperature: float,
             top_p: float):
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(input_ids.shape[0], cache_len)
  logits, cache = model.forward(input_ids, cache, 0, pad, last_only=True)
  rng, key = jax.random.split(rng)
  return sample_tokens(logits[:, -1], key, temperature, top_p), cache, rng


def _decode(graphdef, state, cache: KVCache, first: Array, pad: Array, rng, *, prompt_len: int,
            max_new_tokens: int, eos: tuple[int, ...], pad_id: int, temperature: float,
            top_p: float):
  model = nnx.merge(graphdef, state)
  b = first.shape[0]
  eos_ids = jnp.asarray(eos if eos else (-1,), jnp.int32)
  tokens = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = jnp.isin(first, eos_ids)
  count = jnp.ones((b,), jnp.int32)

  def cond(carry):
    step, _, _, done, _, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    step, tokens, cache, done, count, rng = carry
    previous = jax.lax.dynamic_slice_in_dim(tokens, step - 1, 1, axis=1)
    logits, cache = model.forward(previous, cache, prompt_len + step - 1, pad)
    rng, key = jax.random.split(rng)
    token = sample_tokens(logits[:, 0], key, temperature, top_p)
    token = jnp.where(done, pad_id, token)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], step, axis=1)
    count = count + (~done).astype(jnp.int32)
    done = done | jnp.isin(token, eos_ids)
    return step + 1, tokens, cache, done, count, rng

  carry = (jnp.ones((), jnp.int32), tokens, cache, done, count, rng)
  _, tokens, cache, _, count, _ = jax.lax.while_loop(cond, body, carry)
  return tokens, count, cache  # the cache is returned so that its donated buffers are reused


_PREFILL = jax.jit(_prefill, static_argnums=(0,),
                   static_argnames=("cache_len", "temperature", "top_p"))
_DECODE = jax.jit(_decode, static_argnums=(0,), donate_argnums=(2,),
                  static_argnames=("prompt_len", "max_new_tokens", "eos", "pad_id",
                                   "temperature", "top_p"))
_COMPILED: dict[Any, tuple[Any, Any]] = {}


def _as_batch(input_ids, attention_mask, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(ids [B, S] int32, left padding per row [B]) from an array or a list of token lists."""
  if isinstance(input_ids, Sequence) and input_ids and isinstance(input_ids[0], Sequence):
    if attention_mask is not None:
      raise ValueError("attention_mask is only taken with a rectangular input_ids array")
    rows = [list(r) for r in input_ids]
    if any(not r for r in rows):
      raise ValueError("every prompt needs at least one token")
    s = max(len(r) for r in rows)
    ids = np.array([[pad_id] * (s - len(r)) + r for r in rows], np.int64)
    return ids.astype(np.int32), np.array([s - len(r) for r in rows], np.int32)
  ids = np.asarray(input_ids)
  if ids.ndim == 1:
    ids = ids[None]
  if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"input_ids must be integer [batch, seq] with seq >= 1, got {ids.dtype}"
                     f"{ids.shape}")
  if attention_mask is None:
    return ids.astype(np.int32), np.zeros(ids.shape[0], np.int32)
  mask = np.asarray(attention_mask)
  if mask.shape != ids.shape:
    raise ValueError(f"attention_mask {mask.shape} must have input_ids' shape {ids.shape}")
  mask = mask.astype(bool)
  pad = ids.shape[1] - mask.sum(axis=1)
  # Left padding only: each row is zeros, then ones (at least one).
  want = np.arange(ids.shape[1])[None, :] >= pad[:, None]
  if not np.array_equal(mask, want) or np.any(pad == ids.shape[1]):
    raise ValueError("attention_mask must be left padding (0s, then 1s, at least one 1 per row)")
  return ids.astype(np.int32), pad.astype(np.int32)


def _token_ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  values = [value] if isinstance(value, (int, np.integer)) else list(value)
  return tuple(int(v) for v in values)


def generate(model: MoECausalLM, input_ids, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
             rng: Array | None = None, attention_mask=None,
             pad_token_id: int | None = None) -> GenerateOutput:
  """Generates up to `max_new_tokens` tokens after each prompt.

  Args:
    model: a `MoECausalLM` (`from_pretrained` / `from_config`).
    input_ids: [B, S] integer prompts (left-padded, with `attention_mask`), or a list of token
      lists of different lengths (left-padded here).
    max_new_tokens: >= 1.
    temperature: 0 for greedy decoding, else the softmax temperature.
    top_p: nucleus sampling mass (1 keeps every token).
    eos_token_id: id(s) that end a row (default: the checkpoint's generation config).
    rng: a `jax.random.key` for sampling (default key 0).
    attention_mask: [B, S], 1 for tokens and 0 for left padding.
    pad_token_id: emitted after a row's EOS (default: the checkpoint's, else the first EOS id,
      else 0).

  Returns: `GenerateOutput`.
  """
  if not isinstance(model, MoECausalLM):
    raise TypeError(f"model must be a MoECausalLM, got {type(model).__name__}")
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  temperature, top_p = float(temperature), float(top_p)
  if not temperature >= 0.0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  cfg = model.config
  gen = model.generation_config
  eos = _token_ids(eos_token_id if eos_token_id is not None
                   else gen.get("eos_token_id", cfg.eos_token_id))
  if pad_token_id is None:
    pad_token_id = gen.get("pad_token_id", cfg.pad_token_id)
  if pad_token_id is None:
    pad_token_id = eos[0] if eos else 0
  ids, pad = _as_batch(input_ids, attention_mask, int(pad_token_id))
  if ids.min() < 0 or ids.max() >= cfg.vocab_size:
    raise ValueError(f"input_ids hold ids in [{ids.min()}, {ids.max()}], outside the vocabulary "
                     f"[0, {cfg.vocab_size})")
  if rng is None:
    rng = jax.random.key(0)
  b, s = ids.shape
  graphdef, state = nnx.split(model)
  prefill_kw = dict(cache_len=s + int(max_new_tokens), temperature=temperature, top_p=top_p)
  decode_kw = dict(prompt_len=s, max_new_tokens=int(max_new_tokens), eos=eos,
                   pad_id=int(pad_token_id), temperature=temperature, top_p=top_p)
  ids, pad = jnp.asarray(ids), jnp.asarray(pad)
  key = (graphdef, jax.tree_util.tree_structure(state),
         tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(state)), b, s,
         tuple(sorted(prefill_kw.items())), tuple(sorted(decode_kw.items())))
  t0 = time.perf_counter()
  compiled = _COMPILED.get(key)
  if compiled is None:
    prefill = _PREFILL.lower(graphdef, state, ids, pad, rng, **prefill_kw).compile()
    shapes = jax.eval_shape(
        lambda st, i, p, r: _prefill(graphdef, st, i, p, r, **prefill_kw), state, ids, pad, rng)
    # Decode takes prefill's outputs as they come: on a mesh XLA may split the KV cache along
    # any axis (its positions when the batch does not divide the mesh).
    first, cache, rng_out = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
        prefill.output_shardings)
    decode = _DECODE.lower(graphdef, state, cache, first, pad, rng_out, **decode_kw).compile()
    compiled = _COMPILED[key] = (prefill, decode)
  compile_seconds = time.perf_counter() - t0
  prefill, decode = compiled
  t1 = time.perf_counter()
  first, cache, rng = prefill(state, ids, pad, rng)
  first.block_until_ready()
  t2 = time.perf_counter()
  tokens, count, _ = decode(state, cache, first, pad, rng)
  tokens.block_until_ready()
  t3 = time.perf_counter()
  return GenerateOutput(tokens, count, compile_seconds, t2 - t1, t3 - t2)
