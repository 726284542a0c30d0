"""Held-out perplexity of a causal LM over fixed windows of token ids: each window scores its
tokens 1..S-1 from the tokens before them (benchmarks/quality.py, the README main job)."""

from __future__ import annotations

import math

import numpy as np


def token_windows(ids: np.ndarray, window: int, count: int | None = None) -> np.ndarray:
  """[N, window] consecutive non-overlapping windows of `ids` (the last partial one dropped);
  the first `count` of them when given."""
  if window < 2:
    raise ValueError(f"window={window}: at least 2 tokens are needed to score one")
  n = len(ids) // window
  if count is not None:
    if count < 1:
      raise ValueError(f"count={count} must be positive")
    n = min(n, count)
  if n == 0:
    raise ValueError(f"{len(ids)} tokens make no window of {window}")
  return np.asarray(ids)[:n * window].reshape(n, window)


def window_nll(model, windows: np.ndarray, batch: int = 8) -> np.ndarray:
  """Summed next-token negative log-likelihood of each window (float64 [N])."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  @nnx.jit
  def nll(m, ids):
    logp = jax.nn.log_softmax(m(ids)[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return -picked.sum(axis=-1)

  out = []
  for i in range(0, len(windows), batch):
    chunk = windows[i:i + batch]
    pad = batch - len(chunk)  # one compiled shape: pad the last batch, drop its padding rows
    ids = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)]) if pad else chunk
    out.append(np.asarray(nll(model, jnp.asarray(ids)), np.float64)[:len(chunk)])
  return np.concatenate(out)


def perplexity(nll_per_window: np.ndarray, window: int) -> float:
  """exp of the mean negative log-likelihood over every scored token of the windows."""
  return float(math.exp(nll_per_window.sum() / (len(nll_per_window) * (window - 1))))
