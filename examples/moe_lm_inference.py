"""A small MoE decoder LM with int4 MoE blocks: jitted prefill and decode, float vs quantized.

The model (random, seeded weights): token embedding, `--layers` decoder blocks of RMSNorm ->
causal self-attention with RoPE and a KV cache -> RMSNorm -> MoE block, then a final norm and an
LM head. The float model uses `jax_moeq.nn.MoE`; the quantized copy replaces every MoE block by
`jax_moeq.nn.QuantizedMoE.from_float(...)` (W4A8 on the CPU kernel by default) and keeps every
other weight. Both generate greedily from the same prompts with a `jax.jit`-compiled prefill and a
`jax.jit`-compiled decode loop (`lax.scan` over steps); the script prints tokens/s for both and the
difference of their logits on the prompts.

Run: python examples/moe_lm_inference.py [--steps 32 --scheme w4a8_int8 --layers 2 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moeq.nn import MoE, QuantizedMoE


@dataclasses.dataclass(frozen=True)
class LMConfig:
  vocab_size: int = 1024
  hidden_size: int = 512
  num_layers: int = 2
  num_heads: int = 8
  head_dim: int = 64
  num_experts: int = 16
  top_k: int = 2
  intermediate_size: int = 512  # per expert
  max_len: int = 128
  dtype: str = "bfloat16"


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotary embedding of x [B, S, heads, d] at positions [B, S] (or [S])."""
  d = x.shape[-1]
  freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  angle = positions.astype(jnp.float32)[..., None] * freq  # [.., S, d/2]
  sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention reading and writing a [B, max_len, heads, d] KV cache."""

  def __init__(self, cfg: LMConfig, dtype, rngs: nnx.Rngs):
    h, n, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.q, self.k, self.v, self.o = lin(h, n * d), lin(h, n * d), lin(h, n * d), lin(n * d, h)
    self.num_heads, self.head_dim = n, d

  def __call__(self, x, cache_k, cache_v, pos):
    b, s, _ = x.shape
    split = lambda t: t.reshape(b, s, self.num_heads, self.head_dim)
    positions = pos + jnp.arange(s)
    q = _rope(split(self.q(x)), positions)
    k = _rope(split(self.k(x)), positions)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, pos, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, split(self.v(x)).astype(cache_v.dtype),
                                           (0, pos, 0, 0))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, cache_k,
                        preferred_element_type=jnp.float32) / np.sqrt(self.head_dim)
    visible = jnp.arange(cache_k.shape[1])[None, :] <= positions[:, None]  # causal, filled slots
    scores = jnp.where(visible[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, cache_v).reshape(b, s, -1)
    return self.o(out), cache_k, cache_v


class DecoderBlock(nnx.Module):

  def __init__(self, cfg: LMConfig, dtype, rngs: nnx.Rngs):
    # Parameters are stored in the compute dtype, as a bf16 checkpoint would be.
    self.attn_norm = nnx.RMSNorm(cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.attn = Attention(cfg, dtype, rngs)
    self.moe_norm = nnx.RMSNorm(cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.moe = MoE(cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size,
                   dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, x, cache_k, cache_v, pos):
    a, cache_k, cache_v = self.attn(self.attn_norm(x), cache_k, cache_v, pos)
    x = x + a
    return x + self.moe(self.moe_norm(x)), cache_k, cache_v


class MoELM(nnx.Module):

  def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                           rngs=rngs)
    self.blocks = nnx.List([DecoderBlock(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
    self.norm = nnx.RMSNorm(cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype,
                              param_dtype=dtype, rngs=rngs)

  def init_cache(self, batch: int):
    c = self.cfg
    shape = (batch, c.max_len, c.num_heads, c.head_dim)
    return [(jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype)) for _ in range(c.num_layers)]

  def __call__(self, tokens, cache, pos):
    """tokens [B, S] at positions pos..pos+S-1 -> (logits [B, S, V] f32, new cache)."""
    x = self.embed(tokens)
    new_cache = []
    for block, (ck, cv) in zip(self.blocks, cache):
      x, ck, cv = block(x, ck, cv, pos)
      new_cache.append((ck, cv))
    return self.lm_head(self.norm(x)).astype(jnp.float32), new_cache


def quantize_model(model: MoELM, *, scheme: str, group_size: int,
                   allow_activation_quantization: bool = False) -> MoELM:
  """A copy of `model` whose MoE blocks are `QuantizedMoE` (every other weight shared)."""
  qmodel = nnx.clone(model)
  for block in qmodel.blocks:
    block.moe = QuantizedMoE.from_float(
        block.moe, scheme=scheme, group_size=group_size,
        allow_activation_quantization=allow_activation_quantization)
  return qmodel


def make_generate(model: MoELM, steps: int):
  """Jitted (prefill, decode) for greedy generation of `steps` tokens after a prompt."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def prefill(state, prompt):
    m = nnx.merge(graphdef, state)
    logits, cache = m(prompt, m.init_cache(prompt.shape[0]), 0)
    return logits, cache

  @jax.jit
  def decode(state, cache, first_token, pos):
    m = nnx.merge(graphdef, state)

    def step(carry, _):
      cache, token, pos = carry
      logits, cache = m(token[:, None], cache, pos)
      nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
      return (cache, nxt, pos + 1), nxt

    _, tokens = jax.lax.scan(step, (cache, first_token, pos), None, length=steps)
    return tokens.T  # [B, steps]

  return state, prefill, decode


def run(model: MoELM, prompt: jax.Array, steps: int, repeats: int = 2) -> dict:
  """Compiles, then times prefill and decode (best of `repeats`)."""
  state, prefill, decode = make_generate(model, steps)
  logits, cache = jax.block_until_ready(prefill(state, prompt))  # compile + run
  first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
  pos = jnp.int32(prompt.shape[1])
  jax.block_until_ready(decode(state, cache, first, pos))  # compile
  t_prefill = t_decode = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    logits, cache = jax.block_until_ready(prefill(state, prompt))
    t1 = time.perf_counter()
    tokens = jax.block_until_ready(decode(state, cache, first, pos))
    t2 = time.perf_counter()
    t_prefill, t_decode = min(t_prefill, t1 - t0), min(t_decode, t2 - t1)
  b = prompt.shape[0]
  return {"logits": logits, "tokens": np.asarray(tokens),
          "prefill_tok_s": b * prompt.shape[1] / t_prefill, "decode_tok_s": b * steps / t_decode}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=32, help="decode steps")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--experts", type=int, default=16)
  p.add_argument("--top-k", type=int, default=2)
  p.add_argument("--intermediate", type=int, default=512)
  p.add_argument("--vocab", type=int, default=1024)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--scheme", default="w4a8_int8", choices=("w4a8_int8", "wna16", "mxint4"))
  p.add_argument("--group-size", type=int, default=128)
  p.add_argument("--allow-activation-quantization", action="store_true",
                 help="let wna16/mxint4 weights run on the CPU W4A8 kernel")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("-v", "--verbose", action="store_true", help="log the backend choices")
  args = p.parse_args(argv)
  if args.verbose:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
  if args.prompt_len + args.steps > 4096:
    p.error("--prompt-len + --steps must be <= 4096")
  group_size = 32 if args.scheme == "mxint4" else args.group_size
  cfg = LMConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                 num_heads=args.heads, head_dim=args.hidden // args.heads,
                 num_experts=args.experts, top_k=args.top_k,
                 intermediate_size=args.intermediate, max_len=args.prompt_len + args.steps,
                 dtype=args.dtype)
  model = MoELM(cfg, nnx.Rngs(args.seed))
  qmodel = quantize_model(model, scheme=args.scheme, group_size=group_size,
                          allow_activation_quantization=args.allow_activation_quantization)
  prompt = jax.random.randint(jax.random.key(args.seed + 1), (args.batch, args.prompt_len), 0,
                              cfg.vocab_size, jnp.int32)
  backends = sorted({b.moe.backend for b in qmodel.blocks})
  print(f"model: {cfg.num_layers} layers, H={cfg.hidden_size}, E={cfg.num_experts}, "
        f"top-{cfg.top_k}, I={cfg.intermediate_size}, {cfg.dtype}; batch {args.batch}, prompt "
        f"{args.prompt_len}, {args.steps} decode steps; jax {jax.__version__} on "
        f"{jax.default_backend()}")
  print(f"quantized MoE: scheme={args.scheme}, group_size={group_size}, backend={','.join(backends)}")
  f = run(model, prompt, args.steps, args.repeats)
  q = run(qmodel, prompt, args.steps, args.repeats)
  lf, lq = np.asarray(f["logits"], np.float64), np.asarray(q["logits"], np.float64)
  max_diff = float(np.abs(lf - lq).max())
  rel = float(np.linalg.norm(lf - lq) / np.linalg.norm(lf))
  top1 = float((lf.argmax(-1) == lq.argmax(-1)).mean())
  agree = float((f["tokens"] == q["tokens"]).mean())
  print(f"{'':10s}{'prefill tok/s':>15s}{'decode tok/s':>15s}")
  print(f"{'float':10s}{f['prefill_tok_s']:15.1f}{f['decode_tok_s']:15.1f}")
  print(f"{'quantized':10s}{q['prefill_tok_s']:15.1f}{q['decode_tok_s']:15.1f}")
  print(f"decode speed-up (quantized / float): {q['decode_tok_s'] / f['decode_tok_s']:.2f}x")
  print(f"prompt logits, quantized vs float: max |diff| {max_diff:.4f}, relative (Frobenius) "
        f"{rel:.4f}, top-1 agreement {top1:.3f}; greedy tokens equal: {agree:.3f}")
  return {"float": f, "quantized": q, "max_abs_diff": max_diff, "rel_diff": rel,
          "top1_agreement": top1, "backends": backends}


if __name__ == "__main__":
  main()
