"""Whether a GPU scheme's per-token results depend on the batch around the token, on one GPU:
the MoE block (router GEMM included) on 4 rows against each row alone (bit-identical or not),
and greedy decoding of the trained tiny model at batch 4 against each prompt alone, with and
without JAX_MOEQ_DETERMINISTIC=1 (read at trace time: each setting traces anew).

Data-parallel attention gives each GPU of a mesh its own group of sequences, so a model on n GPUs
reproduces one GPU's tokens only where the per-token results do not depend on the batch.

    python scripts/batch_invariance_gpu.py
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moeq import models
from jax_moeq.nn.moe import QuantizedMoE

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                     "tiny_qwen3_moe")
PROMPTS = [[5, 6, 7], [1, 2, 3], [200, 4, 9], [9, 9, 9]]


def main() -> int:
  for deterministic in ("0", "1"):
    os.environ["JAX_MOEQ_DETERMINISTIC"] = deterministic
    for quantization in ("wna16", "mxint4", "w4a8_int8"):
      model = models.from_pretrained(MODEL, quantization=quantization, dtype=jnp.bfloat16,
                                     show_progress=False)
      gen = lambda p: np.asarray(models.generate(model, p, max_new_tokens=12,
                                                 eos_token_id=[]).tokens)
      whole = gen(PROMPTS)
      alone = np.concatenate([gen([p]) for p in PROMPTS])
      same = bool(np.array_equal(whole, alone))
      step = "-" if same else int(np.argmax(np.any(whole != alone, 0)))
      print(f"deterministic={deterministic} {quantization} ({model.moe_backends()}): greedy "
            f"batch 4 == each alone: {same}; first differing position {step}", flush=True)
      # The first MoE block alone on random hidden states: 4 rows at once against each row.
      mlp = next(node for _, node in nnx.iter_graph(model) if isinstance(node, QuantizedMoE))
      x = jax.random.normal(jax.random.key(0), (4, 1, mlp.spec.hidden_size), jnp.float32
                            ).astype(jnp.bfloat16)
      f = jax.jit(lambda m, x: m(x))
      rows = np.asarray(f(mlp, x.reshape(1, 4, -1)).astype(jnp.float32))[0]
      each = np.concatenate([np.asarray(f(mlp, x[i:i + 1]).astype(jnp.float32))[0]
                             for i in range(4)])
      print(f"  MoE block: 4 rows == each row alone: {bool(np.array_equal(rows, each))}, "
            f"max |diff| {float(np.abs(rows - each).max()):.3e}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
