"""Trains a tiny Qwen3-MoE on the Python standard library's own documentation and writes it as a
transformers checkpoint (the model in examples/tiny_qwen3_moe/).

Corpus: text that ships with every CPython: `pydoc_data.topics` (the language reference's help
topics) and the docstrings of the standard library's modules, classes and functions, read from the
sources with `ast` (nothing is imported; test packages, idlelib, lib2to3 and site-packages are left
out). A function's docstring follows its signature (`def name(args):`), so the text reads like
Python documentation. Each topic and each module is one document, assigned to a split by the first
byte of the SHA-256 of its name (below 13: held out, ~5 %; 13-25: validation; else train), so the
split depends on the names only, not on the order or the Python build. The held-out documents are
written to `heldout.txt` (joined by `<|endoftext|>`); nothing of them is used for the tokenizer or
the model.

Tokenizer: a byte-level BPE trained with `tokenizers` on the training documents (vocabulary 4096,
`<|endoftext|>` as id 0, the separator and end-of-sequence token).

Model: `Qwen3MoeForCausalLM` from transformers, 4 layers, hidden 256, 4 query heads and 2 KV heads
of 64, 16 experts (top-2, renormalized, moe_intermediate_size 128), vocabulary 4096, 512
positions. H = 256 and I = 128 are multiples of 128, so every int4 scheme and group size of
jax_moeq applies (groups of 32, 64, 128 and channel-wise; MxInt4's 32). The loss is the next-token
cross-entropy plus the architecture's load-balancing loss over the router logits
(`output_router_logits=True`, `router_aux_loss_coef`), as transformers computes it. AdamW
(weight decay 0.1), linear warm-up, cosine decay to 0.1x; batches of 32 windows of 256 tokens
drawn at random offsets of the concatenated training stream; bf16 autocast on a GPU. A third
split (another ~5 % of the documents) is the validation set: its loss is measured every
`--eval-every` steps and the best step's weights are saved, in bfloat16 (18.4 MB).

The shipped checkpoint (2026-11-26): corpus and tokenizer built by Python 3.11.7 on the 2-core
AMD EPYC (`--prepare-only --out DIR`: 613,774 train, 20,507 validation and 40,637 held-out
tokens), then 600 steps (4.9 M tokens, 8 epochs) on one NVIDIA H200 with `--data-dir DIR`
(torch 2.11, transformers 5.17; `--shard-mb 12`, the shards joined into one file by transformers
5.24's `save_pretrained` here): 25 s of training at 199 k tokens/s. Validation loss 4.049 at
the last step (train loss ~2.6), held-out loss 4.210 (perplexity 67.4). A 1500-step schedule
overfits: its validation loss bottomed at 4.17 (step 400) and rose to 5.38. The same steps on
the 2-core CPU run at ~520 tokens/s (measured beside other jobs): the 600 steps take about 2.6
hours there (`--device cpu`, or `--steps 0 --minutes M` to fit a budget).

Run: python examples/train_tiny_moe.py [--out examples/tiny_qwen3_moe] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
HELD_OUT_BELOW = 13  # first SHA-256 byte < 13: 13 / 256 ~ 5 % of the documents held out
_SKIPPED_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


# ------------------------------------------------------------------ corpus
def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  return f"def {node.name}({ast.unparse(node.args)}):"


def module_text(source: str) -> str:
  """The docstrings of a module, its classes and functions, each under its signature."""
  tree = ast.parse(source)
  parts = []
  doc = ast.get_docstring(tree)
  if doc:
    parts.append(doc)
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      doc = ast.get_docstring(node)
      if not doc:
        continue
      head = f"class {node.name}:" if isinstance(node, ast.ClassDef) else _signature(node)
      body = "\n".join("    " + line if line else "" for line in doc.splitlines())
      parts.append(f'{head}\n    """{body.lstrip()}"""')
  return "\n\n".join(parts)


def stdlib_documents() -> dict[str, str]:
  """name -> text of every pydoc topic ("topic:NAME") and stdlib module ("module:a/b.py")."""
  import pydoc_data.topics
  docs = {f"topic:{name}": text.strip() for name, text in sorted(pydoc_data.topics.topics.items())}
  root = Path(sysconfig.get_paths()["stdlib"])
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root)
    if _SKIPPED_DIRS & set(rel.parts):
      continue
    try:
      text = module_text(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
      continue
    if len(text) >= 200:
      docs[f"module:{rel.as_posix()}"] = text
  return docs


def split_of(name: str) -> str:
  """"held_out" (first SHA-256 byte < 13, ~5 %), "validation" (13..25, ~5 %) or "train"."""
  first = hashlib.sha256(name.encode()).digest()[0]
  return "held_out" if first < HELD_OUT_BELOW else (
      "validation" if first < 2 * HELD_OUT_BELOW else "train")


def split_documents(docs: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
  """(train, validation, held-out) texts, each in name order."""
  by_split: dict[str, list[str]] = {"train": [], "validation": [], "held_out": []}
  for name, text in sorted(docs.items()):
    by_split[split_of(name)].append(text)
  return by_split["train"], by_split["validation"], by_split["held_out"]


# ------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return tok


def token_stream(tok, texts: list[str]) -> np.ndarray:
  """All texts' ids, each followed by the end-of-text id, as one int64 array."""
  eos = tok.token_to_id(EOS)
  ids: list[int] = []
  for enc in tok.encode_batch(texts):
    ids.extend(enc.ids)
    ids.append(eos)
  return np.asarray(ids, np.int64)


# ------------------------------------------------------------------ model
def model_config(vocab_size: int, eos_id: int) -> dict:
  return {"vocab_size": vocab_size, "hidden_size": 256, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 16,
          "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
          "mlp_only_layers": [], "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
          "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
          # Switch / Mixtral's 0.01 rather than Qwen3's 0.001: 16 experts trained for minutes
          # collapse onto a few without a firmer push towards balance.
          "router_aux_loss_coef": 0.01, "output_router_logits": True,
          "use_sliding_window": False, "sliding_window": None,
          "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id}


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
  if step < warmup:
    return peak * (step + 1) / warmup
  frac = min(1.0, (step - warmup) / max(1, total - warmup))
  return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def held_out_loss(model, stream: np.ndarray, seq: int, windows: int) -> float:
  """Mean next-token cross-entropy (no router loss) over the first `windows` consecutive
  windows of `seq` tokens."""
  import torch
  n = min(windows, (len(stream) - 1) // seq)
  device = next(model.parameters()).device
  x = torch.from_numpy(stream[:n * seq].reshape(n, seq)).to(device)
  model.eval()
  total, count = 0.0, 0
  with torch.no_grad():
    for i in range(0, n, 16):
      logits = model(input_ids=x[i:i + 16]).logits.float()
      target = x[i:i + 16, 1:]
      total += float(torch.nn.functional.cross_entropy(
          logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
      count += target.numel()
  model.train()
  return total / count


def sample(model, tok, prompt: str, new_tokens: int, temperature: float, seed: int) -> str:
  import torch
  device = next(model.parameters()).device
  ids = torch.tensor([tok.encode(prompt).ids], device=device)
  gen = torch.Generator().manual_seed(seed)
  model.eval()
  with torch.no_grad():
    for _ in range(new_tokens):
      logits = model(input_ids=ids[:, -256:]).logits[0, -1].float()
      if temperature == 0:
        nxt = int(logits.argmax())
      else:
        nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1).cpu(), 1,
                                    generator=gen))
      ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], 1)
  model.train()
  return tok.decode(ids[0].tolist())


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=str(Path(__file__).parent / "tiny_qwen3_moe"))
  p.add_argument("--data-dir", help="read the token ids and tokenizer written by --prepare-only "
                 "here instead of building them (another Python's stdlib gives other text)")
  p.add_argument("--prepare-only", action="store_true",
                 help="write the tokenizer, heldout.txt and ids.npz to --out, then stop")
  p.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
  p.add_argument("--steps", type=int, default=600, help="0: fit the schedule to --minutes")
  p.add_argument("--minutes", type=float, default=22.0,
                 help="with --steps 0: the step count is fixed from the first 20 steps' speed")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--warmup", type=int, default=100)
  p.add_argument("--eval-every", type=int, default=50,
                 help="steps between validation losses; the best step's weights are saved")
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--shard-mb", type=int, default=0,
                 help="save the weights in shards of at most this many MB (0: one file)")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def _cuda_available() -> bool:
  try:
    import torch
  except ImportError:
    return False
  return torch.cuda.is_available()


def prepare(out: Path, vocab: int):
  """Builds the corpus and tokenizer; writes tokenizer files, heldout.txt and ids.npz to `out`;
  returns (tokenizer, train ids, validation ids, held-out ids)."""
  import transformers
  start = time.perf_counter()
  docs = stdlib_documents()
  train_docs, val_docs, held_docs = split_documents(docs)
  print(f"Python {sys.version.split()[0]}: {len(docs)} documents: {len(train_docs)} train "
        f"({sum(map(len, train_docs)) / 1e6:.2f} M chars), {len(val_docs)} validation, "
        f"{len(held_docs)} held out ({sum(map(len, held_docs)) / 1e6:.2f} M chars)", flush=True)
  tok = train_tokenizer(train_docs, vocab)
  ids = {name: token_stream(tok, d) for name, d in
         (("train", train_docs), ("validation", val_docs), ("held_out", held_docs))}
  print(f"tokenizer: vocab {tok.get_vocab_size()}; tokens: "
        + ", ".join(f"{len(v)} {k}" for k, v in ids.items())
        + f" ({time.perf_counter() - start:.0f} s)", flush=True)
  out.mkdir(parents=True, exist_ok=True)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
  fast.save_pretrained(out)
  (out / "heldout.txt").write_text(EOS.join(held_docs), encoding="utf-8")
  np.savez(out / "ids.npz", **ids)
  return tok, ids["train"], ids["validation"], ids["held_out"]


def load_prepared(data_dir: Path):
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
  ids = np.load(data_dir / "ids.npz")
  return tok, ids["train"], ids["validation"], ids["held_out"]


def main(argv: list[str] | None = None) -> dict:
  import shutil

  import torch
  import transformers
  args = _parse_args(argv)
  out = Path(args.out)
  if args.data_dir:
    tok, train_ids, val_ids, held_ids = load_prepared(Path(args.data_dir))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "heldout.txt"):
      shutil.copy(Path(args.data_dir) / name, out / name)
  else:
    tok, train_ids, val_ids, held_ids = prepare(out, args.vocab)
  if args.prepare_only:
    return {}
  (out / "ids.npz").unlink(missing_ok=True)
  torch.set_num_threads(args.threads)
  torch.manual_seed(args.seed)
  device = torch.device(args.device)
  cfg = transformers.Qwen3MoeConfig(**model_config(tok.get_vocab_size(), tok.token_to_id(EOS)))
  model = transformers.Qwen3MoeForCausalLM(cfg).float().to(device)
  model.train()
  params = sum(p.numel() for p in model.parameters())
  print(f"model: {params / 1e6:.2f} M parameters on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        flush=True)
  decay = [p for p in model.parameters() if p.ndim >= 2]
  no_decay = [p for p in model.parameters() if p.ndim < 2]
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, betas=(0.9, 0.95))
  # bf16 matmuls on the GPU (f32 master weights and optimizer state); f32 on the CPU.
  autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
  rng = np.random.default_rng(args.seed)
  tokens_per_step = args.batch * args.seq
  total = args.steps or 10**9
  log: list[dict] = []
  best = (math.inf, 0, None)
  train_start = time.perf_counter()
  step = 0
  while step < total:
    offsets = rng.integers(0, len(train_ids) - args.seq - 1, args.batch)
    x = torch.from_numpy(np.stack([train_ids[o:o + args.seq] for o in offsets])).to(device)
    for group in opt.param_groups:
      group["lr"] = learning_rate(step, total, args.lr, args.warmup)
    with autocast:
      result = model(input_ids=x, labels=x)
    opt.zero_grad(set_to_none=True)
    result.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    step += 1
    if step == 20 and not args.steps:  # fix the schedule's length from the measured speed
      elapsed = time.perf_counter() - train_start
      total = max(100, int(args.minutes * 60 / (elapsed / step)))
      print(f"{elapsed / step:.3f} s/step: training {total} steps", flush=True)
    if step % 25 == 0 or step == total:
      elapsed = time.perf_counter() - train_start
      aux = float(result.aux_loss.detach())
      row = {"step": step, "loss": round(float(result.loss.detach())
                                         - cfg.router_aux_loss_coef * aux, 4),
             "aux": round(aux, 4), "tok_s": round(step * tokens_per_step / elapsed),
             "s": round(elapsed)}
      if step % args.eval_every == 0 or step == total:
        with autocast:
          row["validation"] = round(held_out_loss(model, val_ids, args.seq, 64), 4)
        if row["validation"] < best[0]:
          best = (row["validation"], step,
                  {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
      log.append(row)
      print(json.dumps(row), flush=True)
  train_s = time.perf_counter() - train_start
  print(f"best validation loss {best[0]:.4f} at step {best[1]} of {step}", flush=True)
  model.load_state_dict(best[2])
  with autocast:
    held = held_out_loss(model, held_ids, args.seq, 10**6)

  model.config.output_router_logits = False
  save_kw = {"max_shard_size": f"{args.shard_mb}MB"} if args.shard_mb else {}
  model.to(torch.bfloat16).save_pretrained(out, **save_kw)
  model.float()
  samples = {p: {"greedy": sample(model, tok, p, 48, 0.0, 0),
                 "t0.8": sample(model, tok, p, 48, 0.8, 0)}
             for p in ("def read(self, size=-1):\n    \"\"\"", "The for statement")}
  for p, s in samples.items():
    print(f"--- {p!r}\ngreedy: {s['greedy']!r}\nt=0.8:  {s['t0.8']!r}")
  summary = {"steps": step, "best_step": best[1], "train_seconds": round(train_s),
             "tokens": step * tokens_per_step, "tok_s": round(step * tokens_per_step / train_s),
             "final": log[-1], "best_validation_loss": best[0], "held_out_loss": round(held, 4),
             "train_tokens": int(len(train_ids)), "held_out_tokens": int(len(held_ids)),
             "parameters": params, "device": str(device), "python": sys.version.split()[0],
             "torch": torch.__version__, "transformers": transformers.__version__}
  (out / "training_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
  print(json.dumps(summary))
  return summary


if __name__ == "__main__":
  main(sys.argv[1:])
