"""Reading one (possibly int4) linear projection of a checkpoint, and dequantizing it exactly.

A projection `{prefix}` is stored in one of three ways; which one is decided per layer from the
tensors present (a checkpoint may quantize experts and attention but keep `lm_head` and router
gates float):
- float: `{prefix}.weight [..., out, in]`.
- compressed-tensors pack-quantized (also MxInt4): `{prefix}.weight_packed` (uint4b8 int32
  `[..., out, in/8]`, or signed-nibble uint8 `[..., out, in/2]`), `{prefix}.weight_scale
  [..., out, in/g]`, optional `{prefix}.weight_shape` (`[out, in]`, or `[E, out, in]` for a 3-D
  fused-experts tensor), optional `{prefix}.weight_g_idx [..., in]` (written by compressed-tensors
  before 0.10 for `actorder: group`) and `{prefix}.weight_zero_point` (must be zero).
- GPTQ: `{prefix}.qweight [in/8, out]` int32, `{prefix}.qzeros [groups, out/8]` int32 (symmetric:
  every nibble 7, or 8 for gptq_v2), `{prefix}.scales [groups, out]`, optional `{prefix}.g_idx
  [in]` (act-order / desc_act: the group of each input channel).
`{prefix}.bias` is read when present. Dequantization is `w[o, k] = q[o, k] * scale[o, g_idx[k]]`
with `g_idx[k] = k // g` when absent, formed exactly and rounded once to the requested dtype (see
`dequantize_int4`).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from jax_moeq.loaders import int4_format
from jax_moeq.loaders.config import CheckpointQuantConfig
from jax_moeq.loaders.safetensors_io import CheckpointFormatError, SafetensorsDir

FORMATS = ("float", "compressed-tensors", "gptq")
_ML_FLOATS = frozenset(np.dtype(t) for t in (
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz))


def is_float_dtype(dtype) -> bool:
  """numpy floats and ml_dtypes' (bfloat16, float8)."""
  dtype = np.dtype(dtype)
  return dtype.kind == "f" or dtype in _ML_FLOATS


@dataclasses.dataclass
class Int4Projection:
  """One projection's int4 weights: `q [..., out, in]` int8 in natural input order, `scale
  [..., out, G]` (G = in / group_size, or 1 for channel-wise, then float32), `g_idx [..., in]`
  int32 or None when groups are contiguous."""

  q: np.ndarray
  scale: np.ndarray
  group_size: int
  g_idx: np.ndarray | None = None

  def dequantize(self, dtype=np.float32) -> np.ndarray:
    return dequantize_int4(self.q, self.scale, self.group_size, g_idx=self.g_idx, dtype=dtype)


def dequantize_int4(q: np.ndarray, scale: np.ndarray, group_size: int, *,
                    g_idx: np.ndarray | None = None, dtype=np.float32) -> np.ndarray:
  """`q [..., out, in]` int4-as-int8 times `scale [..., out, G]` -> `[..., out, in]` in `dtype`.

  The product is formed exactly and rounded once to `dtype`: in float32 when the scales have at
  most 11 significant bits (bf16, fp16: |q| <= 8 adds 4), else (float32 scales) in float64.
  `g_idx [..., in]` gives each input channel's group (act-order); default `k // group_size`
  (every channel in group 0 for channel-wise, group_size -1).
  """
  q = np.asarray(q)
  scale = np.asarray(scale)
  k = q.shape[-1]
  if g_idx is None:
    g = k if group_size == -1 else group_size
    if k % g:
      raise ValueError(f"group_size={group_size} does not divide the input size {k}")
    g_idx = np.arange(k) // g
  g_idx = np.asarray(g_idx)
  if scale.shape[:-1] != q.shape[:-1] or g_idx.shape[-1] != k:
    raise ValueError(f"scale {scale.shape} / g_idx {g_idx.shape} do not fit q {q.shape}")
  exact = np.float32 if scale.dtype.itemsize <= 2 else np.float64
  s = scale.astype(exact)
  if g_idx.ndim == 1:
    per_channel = np.take(s, g_idx, axis=-1)
  else:  # one order per leading index (e.g. per expert): [..., in] -> [..., 1, in]
    per_channel = np.take_along_axis(s, np.expand_dims(g_idx, -2).astype(np.intp), axis=-1)
  w = q.astype(exact) * per_channel
  return w if w.dtype == np.dtype(dtype) else w.astype(dtype)


def storage_format(ckpt: SafetensorsDir, prefix: str) -> str:
  """"float", "compressed-tensors" or "gptq": how `{prefix}` is stored, from its tensor names."""
  found = [fmt for fmt, suffix in (("float", "weight"), ("compressed-tensors", "weight_packed"),
                                   ("gptq", "qweight")) if f"{prefix}.{suffix}" in ckpt]
  if len(found) > 1:
    raise CheckpointFormatError(f"{prefix!r} is stored twice ({' and '.join(found)}): "
                                f"{', '.join(f'{prefix}.{s}' for s in _suffixes(found))}",
                                path=ckpt.path)
  if not found:
    raise CheckpointFormatError(f"no weight for {prefix!r}: expected {prefix}.weight (float), "
                                f"{prefix}.weight_packed (compressed-tensors) or {prefix}.qweight "
                                "(GPTQ)", path=ckpt.path)
  return found[0]


def _suffixes(formats: list[str]) -> list[str]:
  return [{"float": "weight", "compressed-tensors": "weight_packed", "gptq": "qweight"}[f]
          for f in formats]


def _fail(ckpt: SafetensorsDir, name: str, message: str) -> CheckpointFormatError:
  return CheckpointFormatError(message, path=ckpt.file_of(name) if name in ckpt else ckpt.path,
                               tensor=name)


def _read_part(ckpt: SafetensorsDir, name: str, rows: tuple[int, int] | None) -> np.ndarray:
  """The tensor, or with `rows` the experts [start, stop) of a tensor with an expert axis (2-D
  and up: weights [E, out, in], scales, biases [E, out], g_idx [E, in]), reading only their
  bytes. 1-D tensors (weight_shape, a g_idx shared by all experts) are read whole."""
  if rows is None or len(ckpt.get_shape(name)) < 2:
    return ckpt.get(name)
  return ckpt.get_rows(name, *rows)


def _get(ckpt: SafetensorsDir, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
  """A tensor that the storage requires: its absence is a format error, not a KeyError."""
  if name not in ckpt:
    owner = name.rsplit(".", 1)[0]
    raise CheckpointFormatError(f"is missing: {owner!r} is stored int4 and needs it",
                                path=ckpt.path, tensor=name)
  return _read_part(ckpt, name, rows)


def _integer(ckpt: SafetensorsDir, name: str, kinds: str = "iu",
             rows: tuple[int, int] | None = None) -> np.ndarray:
  a = _get(ckpt, name, rows)
  if a.dtype.kind not in kinds:
    raise _fail(ckpt, name, f"must hold integers, has dtype {a.dtype}")
  return a


def _float_tensor(ckpt: SafetensorsDir, name: str,
                  rows: tuple[int, int] | None = None) -> np.ndarray:
  a = _get(ckpt, name, rows)
  if not is_float_dtype(a.dtype):
    raise _fail(ckpt, name, f"must be floating point, has dtype {a.dtype}")
  return a


def _read_compressed(ckpt: SafetensorsDir, p: str, rows: tuple[int, int] | None = None):
  name = f"{p}.weight_packed"
  packed = _read_part(ckpt, name, rows)
  if packed.ndim < 2:
    raise _fail(ckpt, name, f"must be [..., out, in/8], has shape {packed.shape}")
  if packed.dtype == np.uint8:
    q = int4_format.unpack_signed_nibbles(packed)  # MxInt4 signed-nibble bytes [..., out, in/2]
    per_word = 2
  elif packed.dtype in (np.int32, np.uint32):
    q = int4_format.unpack_uint4b8(packed, axis=-1)  # [..., out, in/8] -> [..., out, in]
    per_word = 8
  else:
    raise _fail(ckpt, name, f"must be int32 (uint4b8) or uint8 (signed nibbles), has dtype "
                            f"{packed.dtype}")
  shape_name = f"{p}.weight_shape"
  if shape_name in ckpt:
    shape = _integer(ckpt, shape_name).reshape(-1)
    want = list(q.shape)
    want[:-1] = ckpt.get_shape(name)[:-1]  # the whole tensor's, also when only rows are read
    if (shape.size != q.ndim or list(shape[:-1]) != want[:-1]
        or not want[-1] - per_word < int(shape[-1]) <= want[-1]):
      raise _fail(ckpt, shape_name, f"{shape.tolist()} does not fit weight_packed "
                                    f"{list(packed.shape)} ({packed.dtype})")
    q = q[..., :int(shape[-1])]
  zp_name = f"{p}.weight_zero_point"
  if zp_name in ckpt and np.any(_integer(ckpt, zp_name, rows=rows) != 0):
    raise _fail(ckpt, zp_name, "holds non-zero zero points: asymmetric int4 weights are not "
                               "supported")
  scale = _float_tensor(ckpt, f"{p}.weight_scale", rows)
  g_name = f"{p}.weight_g_idx"
  g_idx = _integer(ckpt, g_name, rows=rows) if g_name in ckpt else None
  return q, scale, g_idx


def _read_gptq(ckpt: SafetensorsDir, p: str, qcfg: CheckpointQuantConfig):
  name = f"{p}.qweight"
  qweight = _integer(ckpt, name)  # [in/8, out]
  if qweight.ndim != 2 or qweight.dtype.itemsize != 4:
    raise _fail(ckpt, name, f"must be a 2-D int32 [in/8, out], has shape {qweight.shape} "
                            f"{qweight.dtype}")
  q = int4_format.unpack_uint4b8(qweight.view(np.int32), axis=0).T  # -> [out, in]
  scales = _float_tensor(ckpt, f"{p}.scales")
  if scales.ndim != 2:
    raise _fail(ckpt, f"{p}.scales", f"must be [groups, out], has shape {scales.shape}")
  scale = scales.T  # [in/g, out] -> [out, in/g]
  z_name = f"{p}.qzeros"
  if z_name in ckpt:
    qzeros = _integer(ckpt, z_name)
    if qzeros.shape != (scales.shape[0], -(-q.shape[0] // 8)) or qzeros.dtype.itemsize != 4:
      raise _fail(ckpt, z_name, f"must be int32 [{scales.shape[0]}, {-(-q.shape[0] // 8)}], has "
                                f"shape {qzeros.shape} {qzeros.dtype}")
    # Symmetric GPTQ stores zero 8 as 8 - 1 = 7 (v1) or 8 (gptq_v2) in every nibble.
    want = 8 if qcfg.gptq_v2_zeros else 7
    z = int4_format.unpack_uint4b8(qzeros.view(np.int32), axis=-1)[:, :q.shape[0]] + 8
    if np.any(z != want):
      raise _fail(ckpt, z_name, f"holds zero points other than {want}: asymmetric GPTQ weights "
                                "are not supported (sym must be true)")
  g_name = f"{p}.g_idx"
  g_idx = _integer(ckpt, g_name) if g_name in ckpt else None
  return np.ascontiguousarray(q), np.ascontiguousarray(scale), g_idx


def _group_size(ckpt: SafetensorsDir, p: str, fmt: str, k: int, groups: int,
                qcfg: CheckpointQuantConfig) -> int:
  """The group size of a projection with `k` inputs and `groups` scale columns, checked against
  the config."""
  scale_name = f"{p}.{'weight_scale' if fmt == 'compressed-tensors' else 'scales'}"
  if qcfg.group_size is None:
    raise _fail(ckpt, scale_name, "is an int4 tensor, but config.json has no quantization_config")
  want = 1 if qcfg.group_size == -1 else k // qcfg.group_size
  if qcfg.group_size != -1 and k % qcfg.group_size:
    raise _fail(ckpt, scale_name, f"group_size={qcfg.group_size} does not divide the input size "
                                  f"{k}")
  if groups != want:
    raise _fail(ckpt, scale_name, f"has {groups} groups per row, expected {want} for input size "
                                  f"{k} and group_size={qcfg.group_size}")
  return qcfg.group_size


def _check_g_idx(ckpt: SafetensorsDir, name: str, g_idx: np.ndarray, lead: tuple[int, ...],
                 k: int, groups: int) -> np.ndarray | None:
  g_idx = np.asarray(g_idx)
  if g_idx.shape not in ((k,), lead + (k,)):
    raise _fail(ckpt, name, f"must have shape [{k}] or {list(lead + (k,))}, has {g_idx.shape}")
  if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
    raise _fail(ckpt, name, f"holds groups outside [0, {groups})")
  g_idx = np.broadcast_to(g_idx.astype(np.int32), lead + (k,))
  flat = g_idx.reshape(-1, k)
  counts = np.stack([np.bincount(row, minlength=groups) for row in flat])
  if np.any(counts != k // groups):
    raise _fail(ckpt, name, f"does not assign {k // groups} input channels to every group")
  if np.array_equal(flat, np.broadcast_to(np.arange(k) // (k // groups), flat.shape)):
    return None  # contiguous groups: no act-order
  return np.ascontiguousarray(g_idx)


def read_projection(ckpt: SafetensorsDir, prefix: str, qcfg: CheckpointQuantConfig, *,
                    rows: tuple[int, int] | None = None
                    ) -> tuple[np.ndarray | Int4Projection, np.ndarray | None]:
  """One projection as stored: (float weight `[..., out, in]` or `Int4Projection`, bias or None).

  The storage is decided from the tensors present (`storage_format`); int4 tensors must agree with
  `qcfg` (method and group size). Shapes, dtypes and g_idx are validated; errors name the tensor
  and its file. `rows=(start, stop)`: of a 3-D (stacked experts) projection, only experts
  [start, stop), reading only their bytes.
  """
  fmt = storage_format(ckpt, prefix)
  if rows is not None:
    lead = ckpt.get_shape(f"{prefix}.{_suffixes([fmt])[0]}")
    if fmt == "gptq" or len(lead) != 3:
      raise _fail(ckpt, f"{prefix}.{_suffixes([fmt])[0]}",
                  f"has shape {list(lead)}: reading some experts needs a 3-D [E, out, in] "
                  f"{'float' if fmt == 'float' else 'compressed-tensors'} tensor")
  bias_name = f"{prefix}.bias"
  bias = _float_tensor(ckpt, bias_name, rows) if bias_name in ckpt else None
  if fmt == "float":
    name = f"{prefix}.weight"
    if f"{prefix}.weight_scale" in ckpt:
      raise _fail(ckpt, name, f"comes with {prefix}.weight_scale: quantized float/int8 weights "
                              "(e.g. FP8, naive-quantized) are not supported")
    w = _float_tensor(ckpt, name, rows)
    if w.ndim < 2:
      raise _fail(ckpt, name, f"must be [..., out, in], has shape {w.shape}")
    _check_bias(ckpt, bias_name, bias, w.shape[:-1])
    return w, bias
  if qcfg.quantized and qcfg.quant_method == "gptq" and fmt != "gptq":
    raise _fail(ckpt, f"{prefix}.weight_packed", "is compressed-tensors packed, but config.json "
                                                 "says GPTQ")
  if qcfg.quantized and qcfg.quant_method != "gptq" and fmt == "gptq":
    raise _fail(ckpt, f"{prefix}.qweight", f"is GPTQ packed, but config.json says "
                                           f"{qcfg.quant_method}")
  if fmt == "gptq":
    q, scale, g_idx = _read_gptq(ckpt, prefix, qcfg)
    g_name = f"{prefix}.g_idx"
  else:
    q, scale, g_idx = _read_compressed(ckpt, prefix, rows)
    g_name = f"{prefix}.weight_g_idx"
  scale_name = f"{prefix}.{'scales' if fmt == 'gptq' else 'weight_scale'}"
  if scale.ndim != q.ndim or scale.shape[:-1] != q.shape[:-1] or scale.shape[-1] < 1:
    raise _fail(ckpt, scale_name, f"has shape {scale.shape}, which does not fit the weight "
                                  f"{list(q.shape)} ([..., out, groups] expected)")
  k, groups = q.shape[-1], scale.shape[-1]
  group_size = _group_size(ckpt, prefix, fmt, k, groups, qcfg)
  if group_size == -1:
    scale = scale.astype(np.float32)
  if g_idx is not None:
    g_idx = _check_g_idx(ckpt, g_name, g_idx, q.shape[:-2], k, groups)
  _check_bias(ckpt, bias_name, bias, q.shape[:-1])
  return Int4Projection(q, np.ascontiguousarray(scale), group_size, g_idx), bias


def _check_bias(ckpt: SafetensorsDir, name: str, bias: np.ndarray | None,
                shape: tuple[int, ...]) -> None:
  if bias is not None and bias.shape != tuple(shape):
    raise _fail(ckpt, name, f"has shape {bias.shape}, expected {tuple(shape)}")


def read_linear(ckpt: SafetensorsDir, prefix: str, qcfg: CheckpointQuantConfig, *,
                dtype=np.float32) -> tuple[np.ndarray, np.ndarray | None]:
  """One dense linear layer as float: `(weight [out, in], bias [out] or None)` in `dtype`.

  `prefix` names the module, e.g. "model.layers.0.self_attn.q_proj" (tensors `{prefix}.weight`,
  or `.weight_packed`/`.weight_scale`, or `.qweight`/`.scales`/...). int4 layers are dequantized
  exactly (see `dequantize_int4`, honouring act-order g_idx). A layer that config.json's
  compressed-tensors `ignore` list names must be stored float.
  """
  w, bias = read_projection(ckpt, prefix, qcfg)
  if isinstance(w, Int4Projection):
    if qcfg.is_ignored(prefix):
      raise CheckpointFormatError(f"{prefix!r} is int4 in the checkpoint, but config.json's "
                                  "quantization_config.ignore lists it as unquantized",
                                  path=ckpt.path)
    w = w.dequantize(dtype)
  else:
    w = w.astype(dtype)
  if w.ndim != 2:
    raise CheckpointFormatError(f"{prefix!r} is not a 2-D linear layer (weight shape {w.shape})",
                                path=ckpt.path)
  return w, None if bias is None else bias.astype(dtype)

