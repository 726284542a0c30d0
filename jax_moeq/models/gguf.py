"""`write_gguf`: a Hugging Face `qwen3_moe` float checkpoint -> a GGUF file for llama.cpp.

The GGUF has llama.cpp's `qwen3moe` architecture: per layer `attn_norm`, `attn_q/k/v/output`,
`attn_q_norm`/`attn_k_norm` (RMSNorm over head_dim, before RoPE), `ffn_norm`, the router
`ffn_gate_inp` and the experts stacked as `ffn_gate_exps`/`ffn_up_exps` `[E, I, H]` and
`ffn_down_exps` `[E, H, I]` (numpy order; GGUF lists dimensions the other way round), plus
`token_embd`, `output_norm` and `output` (absent with tied embeddings: llama.cpp then reuses
`token_embd`). Every weight keeps Hugging Face's `[out, in]` orientation: no transposes, and no
q/k row permutation, because llama.cpp runs qwen3moe with NEOX RoPE, the rotate-half form of
transformers. llama.cpp's qwen3moe always renormalizes the top-k routing weights, so the
checkpoint must have `norm_topk_prob` true, and every layer must be an MoE layer.

Quantization (`qtype`, `quantizer`):
- quantizer "gguf": the `gguf` package's Python quantizers write every linear (embedding and LM
  head included) in `qtype` (F32, F16, BF16, Q8_0, Q4_0); the package has no Python quantizer
  for K-quants (Q4_K, Q6_K: dequantization only).
- quantizer "llama.cpp": a BF16 (bf16 checkpoints) or F32 GGUF is written next to `out_path`
  and quantized by llama.cpp's own `llama_model_quantize` (what `llama-quantize` runs; needs
  `llama-cpp-python`) to `qtype` (Q4_0, Q4_K_M, Q8_0, ...) with llama.cpp's per-tensor mix: the
  LM head in Q6_K for Q4_0 and Q4_K_M, some attn_v / ffn_down_exps in Q6_K for Q4_K_M.
- "auto": llama.cpp's quantizer for the types the gguf package cannot write, else the gguf
  package.
Norms stay F32 and the router `ffn_gate_inp` F32 (llama.cpp never quantizes it). A tensor whose
rows are not a multiple of the block size falls back to F16 (gguf quantizer).

Vocabulary: llama.cpp refuses a GGUF without one, and the checkpoint directory need not hold a
tokenizer, so the file gets a synthetic SentencePiece ("llama") vocabulary of exactly
`vocab_size` tokens, "<unk>" = 0 and "<t{id}>" for the rest: token ids keep their meaning,
and callers feed ids (`llama_cpp.Llama.eval`), never text.

Tensors are read one layer at a time (`jax_moeq.loaders.SafetensorsDir`) and streamed to the
file, so a model larger than memory converts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np

ARCH = "qwen3moe"
GGUF_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")  # the gguf package quantizes these
# llama.cpp file types (`llama_ftype`) its quantizer takes; names as `llama-quantize` spells them.
LLAMA_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
                "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14,
                "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}
QUANTIZERS = ("auto", "gguf", "llama.cpp")


def _gguf():
  try:
    import gguf
  except ImportError:
    raise ImportError("jax_moeq.models.gguf needs the `gguf` package: pip install 'gguf>=0.10' "
                      "(or jax_moeq[llama])") from None
  return gguf


def _llama_cpp():
  try:
    import llama_cpp
  except ImportError:
    raise ImportError("quantizer='llama.cpp' needs llama-cpp-python: pip install "
                      "'llama-cpp-python>=0.3' (or jax_moeq[llama]); the gguf package alone "
                      f"writes {GGUF_QTYPES}") from None
  return llama_cpp


@dataclasses.dataclass(frozen=True)
class GGUFResult:
  """What `write_gguf` wrote: the file, the quantizer used and each tensor's GGML type name."""
  path: Path
  qtype: str
  quantizer: str
  tensor_types: dict[str, str]

  @property
  def output_type(self) -> str:
    """The LM head's type ("output.weight", or the tied token embedding)."""
    return self.tensor_types.get("output.weight", self.tensor_types["token_embd.weight"])

  @property
  def token_embd_type(self) -> str:
    return self.tensor_types["token_embd.weight"]

  def type_counts(self) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in self.tensor_types.values():
      counts[t] = counts.get(t, 0) + 1
    return counts


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
  """name -> GGML type name of every tensor in a GGUF file (reads the header only)."""
  reader = _gguf().GGUFReader(str(path))
  return {t.name: t.tensor_type.name for t in reader.tensors}


# ------------------------------------------------------------------ the checkpoint side
def _read_config(checkpoint_dir: Path):
  from jax_moeq.models import loading
  cfg_json = loading.read_json(checkpoint_dir / "config.json")
  if cfg_json.get("model_type") != "qwen3_moe":
    raise ValueError(f"{checkpoint_dir / 'config.json'}: model_type="
                     f"{cfg_json.get('model_type')!r}; write_gguf converts qwen3_moe checkpoints")
  if cfg_json.get("quantization_config"):
    raise ValueError(f"{checkpoint_dir / 'config.json'}: the checkpoint is quantized "
                     f"({cfg_json['quantization_config'].get('quant_method', '?')}); write_gguf "
                     "converts float checkpoints")
  generation = loading.read_json(checkpoint_dir / "generation_config.json", required=False)
  cfg = loading.decoder_config(cfg_json, generation, source=str(checkpoint_dir / "config.json"))
  if not all(cfg.sparse_layers):
    dense = [i for i, s in enumerate(cfg.sparse_layers) if not s]
    raise ValueError(f"{checkpoint_dir}: layers {dense} are dense MLPs (mlp_only_layers / "
                     "decoder_sparse_step); llama.cpp's qwen3moe has an MoE block in every layer")
  if not cfg.norm_topk_prob:
    raise ValueError(f"{checkpoint_dir}: norm_topk_prob is false; llama.cpp's qwen3moe always "
                     "renormalizes the top-k routing weights")
  if cfg.sliding_window is not None:
    raise ValueError(f"{checkpoint_dir}: use_sliding_window is set; llama.cpp's qwen3moe has no "
                     "sliding window")
  if cfg.attention_bias:
    raise ValueError(f"{checkpoint_dir}: attention_bias is set; qwen3moe has no attention biases")
  return cfg


class _Checkpoint:
  """Float tensors of the checkpoint by name, shape-checked, and one layer's experts at a time."""

  def __init__(self, path: Path, cfg):
    from jax_moeq import loaders
    self._loaders = loaders
    self.path = path
    self.cfg = cfg
    self.ckpt = loaders.SafetensorsDir(path)
    self._layouts = loaders.discover_moe_layers(self.ckpt.keys())

  def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.ckpt:
      raise KeyError(f"{self.path}: the checkpoint has no tensor {name!r}")
    got = tuple(self.ckpt.get_shape(name))
    if got != tuple(shape):
      raise ValueError(f"{self.ckpt.where(name)} has shape {got}, expected {tuple(shape)} from "
                       "config.json")
    value = self.ckpt.get(name)
    if not jnp.issubdtype(jnp.dtype(value.dtype), jnp.floating):
      raise ValueError(f"{self.ckpt.where(name)} has dtype {value.dtype}, expected a float tensor")
    return value

  def experts(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I], router [E, H]) of layer `index`."""
    cfg = self.cfg
    layout = self._layouts.get(index)
    if layout is None:
      raise KeyError(f"{self.path}: layer {index} has no MoE expert tensors")
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    layer = self._loaders.load_moe_layer(self.ckpt, layout, self._loaders.CheckpointQuantConfig(),
                                         hidden_size=h, intermediate_size=i)
    if layer.quantized:
      raise ValueError(f"{self.path}: layer {index}'s experts are int4; write_gguf converts "
                       "float checkpoints")
    if layer.w13.shape != (e, 2 * i, h):
      raise ValueError(f"{self.path}: layer {index}'s experts have w13 {layer.w13.shape}, "
                       f"expected {(e, 2 * i, h)} from config.json")
    router = layer.router_weight
    if router is None:
      router = self.tensor(f"model.layers.{index}.mlp.gate.weight", (e, h))
    if tuple(router.shape) != (e, h):
      raise ValueError(f"{self.path}: layer {index}'s router has shape {tuple(router.shape)}, "
                       f"expected {(e, h)}")
    return layer.w13[:, :i], layer.w13[:, i:], layer.w2, router


# ------------------------------------------------------------------ the GGUF side
@dataclasses.dataclass
class _Planned:
  name: str  # GGUF tensor name, with ".weight"
  shape: tuple[int, ...]  # numpy order
  qtype: str  # GGML type name
  kind: str  # "norm", "router" or "linear"


def _tensor_plan(cfg) -> list[_Planned]:
  """Every GGUF tensor in file order (per layer: attention, then the MoE block)."""
  h, v = cfg.hidden_size, cfg.vocab_size
  nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  e, i = cfg.num_experts, cfg.moe_intermediate_size
  plan = [_Planned("token_embd.weight", (v, h), "", "linear")]
  for b in range(cfg.num_layers):
    p = f"blk.{b}."
    plan += [
        _Planned(p + "attn_norm.weight", (h,), "F32", "norm"),
        _Planned(p + "attn_q.weight", (nh * d, h), "", "linear"),
        _Planned(p + "attn_k.weight", (nkv * d, h), "", "linear"),
        _Planned(p + "attn_v.weight", (nkv * d, h), "", "linear"),
        _Planned(p + "attn_output.weight", (h, nh * d), "", "linear"),
        _Planned(p + "attn_q_norm.weight", (d,), "F32", "norm"),
        _Planned(p + "attn_k_norm.weight", (d,), "F32", "norm"),
        _Planned(p + "ffn_norm.weight", (h,), "F32", "norm"),
        _Planned(p + "ffn_gate_inp.weight", (e, h), "F32", "router"),
        _Planned(p + "ffn_gate_exps.weight", (e, i, h), "", "linear"),
        _Planned(p + "ffn_up_exps.weight", (e, i, h), "", "linear"),
        _Planned(p + "ffn_down_exps.weight", (e, h, i), "", "linear"),
    ]
  plan.append(_Planned("output_norm.weight", (h,), "F32", "norm"))
  if not cfg.tie_word_embeddings:
    plan.append(_Planned("output.weight", (v, h), "", "linear"))
  return plan


def _source_tensors(ckpt: _Checkpoint) -> Iterator[tuple[str, np.ndarray]]:
  """(GGUF name, checkpoint tensor) in `_tensor_plan`'s order, one layer's experts held at a
  time."""
  cfg = ckpt.cfg
  h, v = cfg.hidden_size, cfg.vocab_size
  nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  yield "token_embd.weight", ckpt.tensor("model.embed_tokens.weight", (v, h))
  for b in range(cfg.num_layers):
    p, hf = f"blk.{b}.", f"model.layers.{b}."
    attn = hf + "self_attn."
    yield p + "attn_norm.weight", ckpt.tensor(hf + "input_layernorm.weight", (h,))
    yield p + "attn_q.weight", ckpt.tensor(attn + "q_proj.weight", (nh * d, h))
    yield p + "attn_k.weight", ckpt.tensor(attn + "k_proj.weight", (nkv * d, h))
    yield p + "attn_v.weight", ckpt.tensor(attn + "v_proj.weight", (nkv * d, h))
    yield p + "attn_output.weight", ckpt.tensor(attn + "o_proj.weight", (h, nh * d))
    yield p + "attn_q_norm.weight", ckpt.tensor(attn + "q_norm.weight", (d,))
    yield p + "attn_k_norm.weight", ckpt.tensor(attn + "k_norm.weight", (d,))
    yield p + "ffn_norm.weight", ckpt.tensor(hf + "post_attention_layernorm.weight", (h,))
    gate, up, down, router = ckpt.experts(b)
    yield p + "ffn_gate_inp.weight", router
    yield p + "ffn_gate_exps.weight", gate
    yield p + "ffn_up_exps.weight", up
    del gate, up
    yield p + "ffn_down_exps.weight", down
    del down, router
  yield "output_norm.weight", ckpt.tensor("model.norm.weight", (h,))
  if not cfg.tie_word_embeddings:
    yield "output.weight", ckpt.tensor("lm_head.weight", (v, h))


def _linear_type(qtype: str, shape: tuple[int, ...]) -> str:
  """`qtype`, or F16 where the rows are not whole blocks of it."""
  gguf = _gguf()
  block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
  return qtype if shape[-1] % block == 0 else "F16"


def _encode(value: np.ndarray, qtype: str) -> np.ndarray:
  """The tensor's bytes in GGML type `qtype`: float32/float16 arrays, else uint8 blocks.
  Quantized 3-D expert stacks are encoded one expert at a time (bounded temporaries)."""
  gguf = _gguf()
  if qtype == "F32":
    return np.ascontiguousarray(value, dtype=np.float32)
  if qtype == "F16":
    return np.ascontiguousarray(np.asarray(value, np.float32).astype(np.float16))
  gtype = gguf.GGMLQuantizationType[qtype]
  if qtype == "BF16" and "bfloat16" in str(value.dtype):
    return np.ascontiguousarray(value).view(np.uint8)  # the checkpoint's own bits
  if value.ndim == 3:
    parts = [gguf.quants.quantize(np.asarray(value[k], np.float32), gtype)
             for k in range(value.shape[0])]
    return np.stack(parts)
  return gguf.quants.quantize(np.asarray(value, np.float32), gtype)


def _add_metadata(writer, cfg, file_type: int, name: str) -> None:
  gguf = _gguf()
  writer.add_name(name)
  writer.add_file_type(file_type)
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
  writer.add_context_length(int(cfg.max_position_embeddings or 40960))
  writer.add_embedding_length(cfg.hidden_size)
  writer.add_block_count(cfg.num_layers)
  writer.add_feed_forward_length(int(cfg.intermediate_size or cfg.moe_intermediate_size))
  writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
  writer.add_head_count(cfg.num_heads)
  writer.add_head_count_kv(cfg.num_kv_heads)
  writer.add_key_length(cfg.head_dim)
  writer.add_value_length(cfg.head_dim)
  writer.add_rope_freq_base(float(cfg.rope_theta))
  writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
  writer.add_expert_count(cfg.num_experts)
  writer.add_expert_used_count(cfg.top_k)
  writer.add_vocab_size(cfg.vocab_size)
  _add_vocabulary(writer, cfg)


def _add_vocabulary(writer, cfg) -> None:
  """A synthetic SentencePiece vocabulary of `vocab_size` tokens (module docstring)."""
  gguf = _gguf()
  v = cfg.vocab_size
  special = {0}
  bos = cfg.bos_token_id if cfg.bos_token_id is not None and 0 <= cfg.bos_token_id < v else None
  eos = next((t for t in cfg.eos_token_id if 0 <= t < v), None)
  special.update(t for t in (bos, eos) if t is not None)
  tokens = ["<unk>"] + [f"<t{k}>" for k in range(1, v)]
  types = [int(gguf.TokenType.NORMAL)] * v
  types[0] = int(gguf.TokenType.UNKNOWN)
  for t in special - {0}:
    types[t] = int(gguf.TokenType.CONTROL)
  writer.add_tokenizer_model("llama")
  writer.add_token_list(tokens)
  writer.add_token_scores([0.0] * v)
  writer.add_token_types(types)
  writer.add_unk_token_id(0)
  if bos is not None:
    writer.add_bos_token_id(bos)
  if eos is not None:
    writer.add_eos_token_id(eos)
  writer.add_add_bos_token(False)
  writer.add_add_eos_token(False)


def _write_with_gguf(ckpt: _Checkpoint, out_path: Path, qtype: str,
                     progress: Callable[[str], None] | None) -> None:
  """Streams the checkpoint into `out_path` with every linear in `qtype` (gguf quantizers)."""
  gguf = _gguf()
  cfg = ckpt.cfg
  plan = _tensor_plan(cfg)
  for t in plan:
    if t.kind == "linear":
      t.qtype = _linear_type(qtype, t.shape)
  file_type = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2}[qtype]
  writer = gguf.GGUFWriter(str(out_path), ARCH)
  try:
    _add_metadata(writer, cfg, file_type, f"{ckpt.path.name} {qtype}")
    for t in plan:
      gtype = gguf.GGMLQuantizationType[t.qtype]
      if t.qtype in ("F32", "F16"):
        dtype = np.float32 if t.qtype == "F32" else np.float16
        nbytes = int(np.prod(t.shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(t.name, t.shape, np.dtype(dtype), nbytes)
      else:
        byte_shape = gguf.quant_shape_to_byte_shape(t.shape, gtype)
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                               raw_dtype=gtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, (name, value) in zip(plan, _source_tensors(ckpt), strict=True):
      assert name == t.name, (name, t.name)  # _tensor_plan and _source_tensors list one order
      data = _encode(value, t.qtype)
      writer.write_tensor_data(data)
      if progress is not None and name.endswith("ffn_down_exps.weight"):
        progress(f"{out_path.name}: {name.split('.')[0]}.{name.split('.')[1]} written")
  finally:
    writer.close()


def _quantize_with_llama_cpp(src: Path, out_path: Path, qtype: str, threads: int) -> None:
  llama_cpp = _llama_cpp()
  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = LLAMA_FTYPES[qtype]
  params.nthread = threads
  with _native_output_to(out_path.with_suffix(".quantize.log")) as log_path:
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out_path).encode(), params)
  if rc != 0:
    tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-5:])
    raise RuntimeError(f"llama.cpp's llama_model_quantize({src} -> {out_path}, {qtype}) failed "
                       f"with code {rc}: {tail}")
  log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def _native_output_to(path: Path) -> Iterator[Path]:
  """Sends the process's stdout and stderr (llama.cpp logs a line per tensor) to `path`."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  with open(path, "wb") as f:
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    try:
      yield path
    finally:
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)


def _choose_quantizer(qtype: str, quantizer: str) -> str:
  if quantizer not in QUANTIZERS:
    raise ValueError(f"quantizer={quantizer!r} is not one of {QUANTIZERS}")
  if quantizer == "auto":
    return "gguf" if qtype in GGUF_QTYPES else "llama.cpp"
  if quantizer == "gguf" and qtype not in GGUF_QTYPES:
    raise ValueError(f"qtype={qtype!r}: the gguf package has no Python quantizer for it (it "
                     f"writes {GGUF_QTYPES}); use quantizer='llama.cpp'")
  return quantizer


def write_gguf(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike, *,
               qtype: str = "Q4_0", quantizer: str = "auto", threads: int | None = None,
               progress: Callable[[str], None] | None = None) -> GGUFResult:
  """Converts a float `qwen3_moe` safetensors checkpoint directory into a GGUF for llama.cpp.

  Args:
    checkpoint_dir: `config.json` plus `model.safetensors` or a sharded
      `model.safetensors.index.json` (float weights: bf16, f16 or f32).
    out_path: the GGUF file to write (replaced if present).
    qtype: "F32", "F16", "BF16", "Q8_0", "Q4_0" (gguf package or llama.cpp), or a llama.cpp file
      type such as "Q4_K_M" (llama.cpp's quantizer only).
    quantizer: "auto", "gguf" or "llama.cpp" (module docstring).
    threads: llama.cpp quantizer threads (default: the usable cores).
    progress: called with a line per layer written.

  Returns:
    `GGUFResult`: the path, the quantizer used and every tensor's GGML type as written.
  """
  _gguf()
  checkpoint_dir, out_path = Path(checkpoint_dir), Path(out_path)
  if not checkpoint_dir.is_dir():
    raise FileNotFoundError(f"{checkpoint_dir} is not a checkpoint directory")
  if qtype not in GGUF_QTYPES and qtype not in LLAMA_FTYPES:
    known = sorted(set(GGUF_QTYPES) | set(LLAMA_FTYPES))
    raise ValueError(f"qtype={qtype!r} is not one of {known}")
  used = _choose_quantizer(qtype, quantizer)
  cfg = _read_config(checkpoint_dir)
  ckpt = _Checkpoint(checkpoint_dir, cfg)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  if used == "gguf":
    _write_with_gguf(ckpt, out_path, qtype, progress)
  else:
    _llama_cpp()  # fail before writing the full-precision intermediate file
    source_type = "BF16" if str(cfg.dtype or "") == "bfloat16" else "F32"
    fd, tmp = tempfile.mkstemp(suffix=f".{source_type}.gguf", dir=out_path.parent)
    os.close(fd)
    try:
      _write_with_gguf(ckpt, Path(tmp), source_type, progress)
      if progress is not None:
        progress(f"{out_path.name}: llama.cpp quantizing {source_type} -> {qtype}")
      cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
      _quantize_with_llama_cpp(Path(tmp), out_path, qtype, threads or cores or 1)
    finally:
      Path(tmp).unlink(missing_ok=True)
  return GGUFResult(out_path, qtype, used, tensor_types(out_path))


__all__ = ["ARCH", "GGUFResult", "GGUF_QTYPES", "LLAMA_FTYPES", "QUANTIZERS", "tensor_types",
           "write_gguf"]
