"""Command line: generate text with a Hugging Face MoE checkpoint on jax_moeq's MoE kernels.

    python -m jax_moeq.generate --model PATH --prompt "Hello" --max-new-tokens 32 \
        [--quantization w4a8_int8] [--backend auto|cpu_int4|reference|marlin|mxint4_gpu] \
        [--quantize-linears] [--lm-head-quantization int4] [--attention-dtype bfloat16]

Prompts are tokenized with the checkpoint's `tokenizer.json` (the `tokenizers` package) when
present; `--prompt-ids 1,2,3` passes token ids directly. Prints the text (or the ids), the
backend chosen per scheme for the experts and for the dense linears, the time to first token and
the decode rate.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

_BACKENDS = ("auto", "cpu_int4", "cpu", "reference", "jnp", "marlin", "mxint4_gpu",
             "hopper_mxint4")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
  from jax_moeq.models import QUANTIZATIONS
  p = argparse.ArgumentParser(prog="python -m jax_moeq.generate", description=__doc__.split("\n")[0])
  p.add_argument("--model", required=True, help="checkpoint directory (config.json, safetensors)")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="text (needs tokenizer.json in the checkpoint)")
  src.add_argument("--prompt-ids", help="comma-separated token ids")
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                 help="quantize float experts to this scheme while loading")
  p.add_argument("--group-size", type=int, default=None)
  p.add_argument("--backend", default="auto", choices=_BACKENDS, help="MoE backend")
  p.add_argument("--allow-activation-quantization", action="store_true",
                 help="let weight-only int4 experts run on the CPU W4A8 kernel")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
  p.add_argument("--quantize-linears", action="store_true",
                 help="also quantize float attention / dense MLP linears to int4 while loading "
                      "(needs --quantization on a float checkpoint)")
  p.add_argument("--lm-head-quantization", default=None, choices=("int4",),
                 help="int4 LM head (W4A8 on a CPU, WNA16 on a GPU)")
  p.add_argument("--attention-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                 help="KV cache and attention math (default: bfloat16 when a linear is int4)")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch", type=int, default=1, help="repeat the prompt over a batch")
  p.add_argument("--quiet", action="store_true", help="no progress bar or backend log")
  return p.parse_args(argv)


def _tokenizer(model_dir: Path):
  path = model_dir / "tokenizer.json"
  if not path.exists():
    return None
  try:
    from tokenizers import Tokenizer
  except ImportError:
    return None
  return Tokenizer.from_file(str(path))


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
  if args.prompt_ids is not None:
    try:
      ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
      raise SystemExit(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
  else:
    if tokenizer is None:
      raise SystemExit(f"{args.model} has no tokenizer.json (or the `tokenizers` package is "
                       "missing): pass --prompt-ids")
    ids = tokenizer.encode(args.prompt).ids
  if not ids:
    raise SystemExit("the prompt has no tokens")
  return ids


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = _parse_args(argv)
  if not args.quiet:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
  import jax
  from jax_moeq import models
  model_dir = Path(args.model)
  tokenizer = _tokenizer(model_dir) if model_dir.is_dir() else None
  ids = _prompt_ids(args, tokenizer)
  model = models.from_pretrained(model_dir, dtype=args.dtype, quantization=args.quantization,
                                 moe_backend=args.backend, group_size=args.group_size,
                                 allow_activation_quantization=args.allow_activation_quantization
                                 or None, show_progress=not args.quiet,
                                 quantize_linears=args.quantize_linears,
                                 lm_head_quantization=args.lm_head_quantization,
                                 attention_dtype=args.attention_dtype)
  out = models.generate(model, [ids] * args.batch, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p,
                        rng=jax.random.key(args.seed))
  tokens = np.asarray(out.tokens)
  counts = np.asarray(out.num_tokens)
  new = tokens[0, :counts[0]].tolist()
  text = tokenizer.decode(new) if tokenizer is not None else None
  decoded = int(counts.sum()) - args.batch  # tokens after each row's first
  decode_rate = decoded / out.decode_seconds if out.decode_seconds > 0 and decoded > 0 else 0.0
  print(f"model: {model.config.model_type}, {model.config.num_layers} layers, dtype "
        f"{model.dtype}, on {jax.default_backend()}")
  for scheme, backend in model.moe_backends().items():
    print(f"MoE backend ({scheme}): {backend}")
  for scheme, backend in model.linear_backends().items():
    print(f"linear backend ({scheme}): {backend}")
  print(f"attention dtype: {model.attention_dtype}")
  print(f"prompt: {len(ids)} tokens; generated {counts.tolist()} tokens")
  if text is not None:
    print(f"text: {text}")
  print(f"ids: {new}")
  print(f"compile: {out.compile_seconds:.2f} s; time to first token: "
        f"{1e3 * out.prefill_seconds:.1f} ms; decode: {decode_rate:.1f} tok/s "
        f"(batch {args.batch})")
  return {"ids": new, "text": text, "tokens": tokens, "decode_tok_s": decode_rate,
          "ttft_s": out.prefill_seconds, "backends": model.moe_backends(),
          "linear_backends": model.linear_backends()}


if __name__ == "__main__":
  main(sys.argv[1:])
