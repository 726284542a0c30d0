"""Convert and run an int4 MoE checkpoint directory (safetensors + config.json).

Without --path, the script first makes one: a few random float MoE layers, quantized with
`QuantizedMoE.from_float`, written with our writer in --format (compressed-tensors W4A8-int or
W4A16, GPTQ, or MxInt4). It then loads the directory with `jax_moeq.loaders.load_moe_checkpoint`,
builds one `QuantizedMoE` per layer (the scheme follows the checkpoint's quantization_config),
runs the stack of blocks (residual MoE layers) under `jax.jit`, and, when it wrote the checkpoint
itself, checks the loaded blocks against the blocks it exported.

Run: python examples/convert_checkpoint.py [--path DIR] [--format compressed-tensors-w4a8]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moeq.loaders import MoEModelConfig, load_moe_checkpoint, save_moe_checkpoint
from jax_moeq.nn import MoE, QuantizedMoE, layer_from_module, moe_from_checkpoint_layer

# --format -> (writer format, activation bits, block scheme before export, group size)
FORMATS = {
    "compressed-tensors-w4a8": ("compressed-tensors", 8, "w4a8_int8", 128),
    "compressed-tensors-w4a16": ("compressed-tensors", None, "wna16", 128),
    "gptq": ("gptq", None, "wna16", 128),
    "mxint4": ("mxint4", None, "mxint4", 32),
}


def write_example_checkpoint(path: Path, fmt: str, *, layers: int, experts: int, top_k: int,
                             hidden: int, intermediate: int, seed: int,
                             allow_activation_quantization: bool = False) -> list[QuantizedMoE]:
  """Writes random quantized MoE layers to `path`; returns the exported blocks."""
  writer_fmt, act_bits, scheme, group_size = FORMATS[fmt]
  rngs = nnx.Rngs(seed)
  blocks = []
  for _ in range(layers):
    moe = MoE(experts, top_k, hidden, intermediate, dtype=jnp.float32, rngs=rngs)
    blocks.append(QuantizedMoE.from_float(
        moe, scheme=scheme, group_size=group_size,
        allow_activation_quantization=allow_activation_quantization))
  config = MoEModelConfig(num_experts=experts, top_k=top_k, hidden_size=hidden,
                          intermediate_size=intermediate, num_layers=layers)
  save_moe_checkpoint(path, {i: layer_from_module(b) for i, b in enumerate(blocks)},
                      fmt=writer_fmt, activation_bits=act_bits, model_config=config)
  return blocks


def load_blocks(path: Path, *, allow_activation_quantization: bool = False,
                dtype=jnp.float32) -> tuple[list[QuantizedMoE], object]:
  """Loads a checkpoint directory into one block per MoE layer."""
  ckpt = load_moe_checkpoint(path)
  if ckpt.model_config is None:
    raise ValueError(f"{path}/config.json has no MoE shape (num_experts, num_experts_per_tok, ...)")
  blocks = [moe_from_checkpoint_layer(layer, ckpt.model_config.top_k,
                                      model_config=ckpt.model_config,
                                      scheme=ckpt.quant_config.scheme,
                                      allow_activation_quantization=allow_activation_quantization,
                                      dtype=dtype)
            for _, layer in sorted(ckpt.layers.items())]
  return blocks, ckpt


def make_stack(blocks):
  """A jitted residual stack of MoE blocks: x <- x + block(x)."""
  graphdef, state = nnx.split(nnx.List(blocks))

  @jax.jit
  def forward(state, x):
    for block in nnx.merge(graphdef, state):
      x = x + block(x)
    return x

  return state, forward


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--path", type=Path, help="an existing checkpoint directory to load and run")
  p.add_argument("--out", type=Path, help="where to write the example checkpoint (default: temp)")
  p.add_argument("--format", default="compressed-tensors-w4a8", choices=sorted(FORMATS))
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--experts", type=int, default=16)
  p.add_argument("--top-k", type=int, default=2)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--intermediate", type=int, default=512)
  p.add_argument("--tokens", type=int, default=16)
  p.add_argument("--allow-activation-quantization", action="store_true")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("-v", "--verbose", action="store_true")
  args = p.parse_args(argv)
  if args.verbose:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

  exported = None
  with tempfile.TemporaryDirectory() as tmp:
    path = args.path
    if path is None:
      path = args.out or Path(tmp) / "moe-checkpoint"
      exported = write_example_checkpoint(
          path, args.format, layers=args.layers, experts=args.experts, top_k=args.top_k,
          hidden=args.hidden, intermediate=args.intermediate, seed=args.seed,
          allow_activation_quantization=args.allow_activation_quantization)
      size = sum(f.stat().st_size for f in Path(path).iterdir())
      print(f"wrote {args.format} checkpoint: {path} ({size / 2**20:.1f} MiB)")
    t0 = time.perf_counter()
    blocks, ckpt = load_blocks(path, allow_activation_quantization=args.allow_activation_quantization)
    print(f"loaded {len(blocks)} MoE layers ({ckpt.quant_config.quant_method}, scheme "
          f"{ckpt.quant_config.scheme}, group_size {ckpt.quant_config.group_size}) in "
          f"{time.perf_counter() - t0:.2f}s; backends: {sorted({b.backend for b in blocks})}")
    h = blocks[0].spec.hidden_size
    x = jax.random.normal(jax.random.key(args.seed + 1), (args.tokens, h), jnp.float32)
    state, forward = make_stack(blocks)
    y = np.asarray(jax.block_until_ready(forward(state, x)))
    t0 = time.perf_counter()
    jax.block_until_ready(forward(state, x))
    dt = time.perf_counter() - t0
    print(f"ran {args.tokens} tokens through the stack: output norm {np.linalg.norm(y):.4f}, "
          f"{args.tokens / dt:.0f} tokens/s")
    result = {"output": y, "blocks": blocks}
    if exported is not None:
      ref_state, ref_forward = make_stack(exported)
      want = np.asarray(ref_forward(ref_state, x))
      diff = float(np.abs(want - y).max())
      print(f"loaded vs exported blocks: max |diff| {diff:.3g}")
      result["max_abs_diff_vs_exported"] = diff
  return result


if __name__ == "__main__":
  main()
