"""A Qwen3-235B-A22B-shaped model (random weights, int4 experts) on a mesh of GPUs: greedy
generation, decode and prefill tokens/s, peak memory per GPU, and the decode roofline.

`from_config(..., mesh=...)` draws each GPU's experts on that GPU (never gathered on one); the
attention, norms and embeddings are bf16 and replicated, run data-parallel over the batch when
it divides the GPUs. Shapes (SPEC §10): 94 layers, E=128, top-8, H=4096, I=1536, 64 query and 4
KV heads of 128, vocab 151936 (--layers takes fewer layers for a quick run).

Printed per batch: decode tokens/s (the second `generate` call's decode time: compiled once),
prefill tokens/s at --prompt tokens (at the smallest batch only), peak bytes in use per GPU, and the roofline beside them:
batch / (bytes one GPU reads per decode step / copy bandwidth), the bytes being the replicated
weights each GPU reads (its copy of everything but the embedding table, of which the step
gathers one row per token) plus its share of the experts the step touches (min(E, batch x K)
per layer, spread over the GPUs); copy bandwidth measured here on GPU 0 (a device-to-device
copy, bytes read and written).

    python benchmarks/ep_model_bench.py --gpus 4 --batch 1,64 --dispatch all_to_all
    python benchmarks/ep_model_bench.py --gpus 2 --layers 8 --batch 1 --prompt 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def qwen3_235b_config(layers: int, tiny: bool = False) -> dict:
  if tiny:  # smoke runs: the same structure, small
    return {**qwen3_235b_config(layers), "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "num_experts": 16,
            "moe_intermediate_size": 128, "intermediate_size": 512}
  return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
          "hidden_size": 4096, "num_hidden_layers": layers, "num_attention_heads": 64,
          "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
          "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "intermediate_size": 12288,
          "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "hidden_act": "silu",
          "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
          "max_position_embeddings": 40960}


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
  """Bytes per second of a device-to-device copy on `device`, read and written both counted."""
  import jax
  import jax.numpy as jnp
  x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), device)
  copy = jax.jit(lambda a: a + 1.0)
  jax.block_until_ready(copy(x))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(copy(x))
    times.append(time.perf_counter() - start)
  return 2 * nbytes / min(times)


def set_dispatch(model, dispatch: str) -> None:
  """Switches every sharded MoE block of `model` to `dispatch` (same weights)."""
  from flax import nnx
  from jax_moeq import sharding as sh
  from jax_moeq.models.sharded import ShardedMoE
  for _, node in nnx.iter_graph(model):
    if isinstance(node, ShardedMoE):
      sh._check_dispatch(dispatch, node.layout.expert_axis, node.layout.mesh)
      node.dispatch = dispatch


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--gpus", type=int, default=0, help="GPUs in the mesh (0: all)")
  p.add_argument("--layers", type=int, default=94)
  p.add_argument("--batch", default="1,64")
  p.add_argument("--prompt", type=int, default=2048, help="prefill prompt tokens")
  p.add_argument("--decode-prompt", type=int, default=16)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--quantization", default="wna16", choices=("wna16", "mxint4", "w4a8_int8"))
  p.add_argument("--dispatch", default="replicated,all_to_all",
                 help="comma list: each runs on the same weights (one build)")
  p.add_argument("--json", default=None)
  p.add_argument("--platform", default="gpu", help="'cpu' with --tiny: a smoke run")
  p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _timing
  _timing.use_source_tree_if_not_installed()
  import jax
  import numpy as np
  from flax import nnx
  from jax_moeq import models, sharding as sh
  gpus = jax.devices(args.platform)
  n = args.gpus or len(gpus)
  mesh = sh.make_mesh(n, 1, devices=gpus[:n])
  bw = copy_bandwidth(gpus[0])
  dispatches = args.dispatch.split(",")
  _timing.progress(f"building {args.layers} layers on {n} GPUs ({args.quantization})")
  start = time.time()
  cfg = qwen3_235b_config(args.layers, args.tiny)
  experts, vocab = cfg["num_experts"], cfg["vocab_size"]
  model = models.from_config(cfg, dtype="bfloat16",
                             quantization=args.quantization, mesh=mesh, dispatch=dispatches[0])
  build_s = time.time() - start
  replicated = expert_bytes = 0
  for leaf in jax.tree.leaves(nnx.state(model)):
    if not isinstance(leaf, jax.Array):
      continue
    if leaf.sharding.is_fully_replicated:
      replicated += leaf.nbytes
    else:
      expert_bytes += leaf.nbytes
  # A decode step gathers one row of the embedding table per token, not the table.
  embed = model.embed_tokens[...]
  replicated_read = replicated - embed.nbytes
  per_layer_expert = expert_bytes / args.layers / experts  # one expert's bytes (all its arrays)
  print(f"# {n} GPUs ({gpus[0].device_kind}), {args.layers} layers, {args.quantization}, "
        f"built in {build_s:.0f} s; replicated {replicated / 1e9:.2f} GB per GPU, "
        f"experts {expert_bytes / 1e9:.2f} GB in all; copy bandwidth {bw / 1e12:.2f} TB/s")
  rows = []
  rng = np.random.default_rng(0)
  batches = [int(v) for v in args.batch.split(",")]
  for dispatch, batch in [(d, b) for d in dispatches for b in batches]:
    set_dispatch(model, dispatch)  # a static attribute: generate compiles anew
    _timing.progress(f"{dispatch}, batch {batch}")
    row = {"gpus": n, "batch": batch, "layers": args.layers, "dispatch": dispatch}
    try:
      prompts = rng.integers(0, vocab, (batch, args.decode_prompt)).tolist()
      for _ in range(2):  # the first call compiles
        out = models.generate(model, prompts, max_new_tokens=args.new_tokens, eos_token_id=[])
      row["decode_tok_s"] = batch * (args.new_tokens - 1) / out.decode_seconds
      touched = min(experts, batch * cfg["num_experts_per_tok"]) * per_layer_expert * args.layers
      step_bytes = (replicated_read + batch * embed.shape[-1] * embed.dtype.itemsize
                    + touched / n)  # per GPU, in parallel
      row["decode_roofline_tok_s"] = batch / (step_bytes / bw)
      if batch == min(batches) and args.prompt:  # prefill at the smallest batch
        prompts = rng.integers(0, vocab, (batch, args.prompt)).tolist()
        for _ in range(2):
          out = models.generate(model, prompts, max_new_tokens=1, eos_token_id=[])
        row["prefill_tok_s"] = batch * args.prompt / out.prefill_seconds
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["peak_gb_per_gpu"] = [round((d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9,
                                    2) for d in gpus[:n]]
    rows.append(row)
    print(json.dumps(row), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows, "build_seconds": build_s, "copy_bandwidth": bw}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
