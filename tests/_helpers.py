"""Small numpy helpers shared by the quantization / routing / reference tests.

Everything here is written independently of jax_moeq (numpy only, float32 where the op is
float32), so that the tests compare two implementations; `cuda_skip_reason` is the GPU test
files' module-level skip; `load_example` imports a script of examples/.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

F32 = np.float32
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
  """examples/<name>.py as a module (loaded once per process)."""
  module_name = f"example_{name}"
  if module_name not in sys.modules:
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
  return sys.modules[module_name]


def cuda_skip_reason(library_available) -> str | None:
  """Why a GPU test file cannot run here (no CUDA device for JAX, or `library_available()`
  false: our CUDA library not built or the GPU below compute capability 9.0), or None."""
  try:
    if not jax.devices("cuda"):
      return "no CUDA device visible to JAX"
  except RuntimeError:
    return "no CUDA device visible to JAX"
  if not library_available():
    return "CUDA library not built or GPU below compute capability 9.0"
  return None


def rel_err(got, want) -> float:
  """Relative Frobenius error ||got - want|| / ||want|| in float64."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def np_round(v, dtype) -> np.ndarray:
  """float32 values rounded to `dtype` (nearest even, numpy / ml_dtypes casts), as float32."""
  return np.asarray(v, F32).astype(jnp.dtype(dtype)).astype(F32)


def np_quantize_act_int8(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """SPEC §3 per-row int8 quantization of a 2-D array, numpy float32 scalar by scalar."""
  x = np.asarray(x, F32)
  rows, k = x.shape
  qa = np.zeros((rows, k), np.int8)
  scale = np.zeros(rows, F32)
  zp = np.zeros(rows, np.int32)
  for r in range(rows):
    rmin = min(F32(0), x[r].min())
    rmax = max(F32(0), x[r].max())
    if rmax == rmin:
      continue
    s = F32(rmax - rmin) / F32(255)
    inv = F32(1) / s
    min_term = F32(-128) + rmin * inv
    max_term = F32(127) + rmax * inv
    z = (F32(-128) - rmin * inv) if min_term + max_term > 0 else (F32(127) - rmax * inv)
    z = int(np.rint(min(F32(127), max(F32(-128), z))))
    q = np.rint(x[r] * inv).astype(np.int64) + z
    qa[r] = np.clip(q, -128, 127)
    scale[r] = s
    zp[r] = z
  return qa, scale, zp


def np_w4a8_linear(x, q_w, w_scale, group_size: int, bias=None) -> np.ndarray:
  """SPEC §3 GEMM: int64 sums inside a group, float64 across groups (a more exact reference)."""
  qa, s, zp = np_quantize_act_int8(np.asarray(x, F32))
  q_w = np.asarray(q_w, np.int64)
  n, k = q_w.shape
  g = k if group_size == -1 else group_size
  a = qa.astype(np.int64) - zp[:, None].astype(np.int64)
  per_group = np.einsum("mgk,ngk->mgn", a.reshape(-1, k // g, g), q_w.reshape(n, k // g, g))
  y = np.einsum("mgn,ng->mn", per_group.astype(np.float64), np.asarray(w_scale, np.float64))
  y = y * s[:, None].astype(np.float64)
  if bias is not None:
    y = y + np.asarray(bias, np.float64)
  return y


def np_sigmoid(v):
  return F32(1) / (F32(1) + np.exp(-np.asarray(v, F32)))


def np_activation(y13, kind: int) -> np.ndarray:
  y13 = np.asarray(y13, F32)
  i = y13.shape[-1] // 2
  g, u = y13[..., :i], y13[..., i:]
  if kind == 1:
    g = np.minimum(g, F32(7))
    u = np.clip(u, F32(-7), F32(7))
    return (u + F32(1)) * (g * np_sigmoid(F32(1.702) * g))
  return g * np_sigmoid(g) * u


def random_int4_experts(rng, E, I, H, group_size, *, bias=False):
  """Random int4 experts with realistic scales (outputs O(1) for unit-normal inputs)."""

  def scales(n, k):
    g = k if group_size == -1 else group_size
    s = rng.uniform(0.5, 1.5, (E, n, k // g)) / (8 * np.sqrt(k))
    return jnp.asarray(s, jnp.float32 if group_size == -1 else jnp.bfloat16)

  return dict(
      w13_q=jnp.asarray(rng.integers(-8, 8, (E, 2 * I, H)), jnp.int8),
      w13_scale=scales(2 * I, H),
      w2_q=jnp.asarray(rng.integers(-8, 8, (E, H, I)), jnp.int8),
      w2_scale=scales(H, I),
      w13_bias=jnp.asarray(rng.standard_normal((E, 2 * I)) * 0.5, jnp.float32) if bias else None,
      w2_bias=jnp.asarray(rng.standard_normal((E, H)) * 0.5, jnp.float32) if bias else None,
  )


def random_routing(rng, T, E, K):
  """Distinct experts per token and positive weights."""
  ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
  weights = rng.uniform(0.05, 1.0, (T, K)).astype(F32)
  return jnp.asarray(ids), jnp.asarray(weights)
