"""vmap for the fused MoE ops: token sets that share the weights are one call on their tokens.

Every op here treats its tokens independently (routing, expert GEMMs and the top-k reduction
are per token), so a batch of B token sets of T tokens with the same weights is exactly one
call on B*T tokens: one launch sequence instead of B, and the weights read once.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def fold_token_batches(call: Callable[..., Any], num_token_args: int) -> Callable[..., Any]:
  """`call(*args)` with a vmap rule.

  The first `num_token_args` arguments of `call` are per-token arrays (leading axis T); the rest
  are pytrees shared by every token (the weights). Every output leaf has a leading T axis.

  Under vmap, unbatched shared arguments fold the batch into the token axis (one call on B*T
  tokens); batched shared arguments (a weight set per batch element) run the calls in sequence
  with `lax.map`.
  """

  @jax.custom_batching.custom_vmap
  def op(*args):
    return call(*args)

  @op.def_vmap
  def _rule(axis_size, in_batched, *args):
    def broadcast(a, batched):
      return a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)

    token_args = [broadcast(a, b)
                  for a, b in zip(args[:num_token_args], in_batched[:num_token_args])]
    shared, shared_batched = tuple(args[num_token_args:]), tuple(in_batched[num_token_args:])
    if any(jax.tree.leaves(shared_batched)):
      shared = jax.tree.map(broadcast, shared, shared_batched)
      out = jax.lax.map(lambda a: op(*a), (*token_args, *shared))
    else:
      b, t = token_args[0].shape[:2]
      out = op(*[a.reshape(b * t, *a.shape[2:]) for a in token_args], *shared)
      out = jax.tree.map(lambda o: o.reshape(b, t, *o.shape[1:]), out)
    return out, jax.tree.map(lambda _: True, out)

  return op
