"""Validated safetensors reading: files from strangers are hostile input.

A safetensors file is an 8-byte little-endian header length `n`, `n` bytes of JSON header
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`), then the
data section; offsets are relative to its start. We parse and check the header ourselves, with
bounded reads, before any tensor is read: the header length against the file size and
`max_header_bytes` (nothing is allocated from a claimed length), strict UTF-8 JSON (no NaN, no
runaway nesting), known dtypes, non-negative integer shapes and offsets, `prod(shape) * bits / 8 == end - begin`
for every tensor, and tensors that cover the data section exactly (no gaps, overlaps, or trailing
bytes: the rules of the reference `safetensors` library, so any file it reads we read too). Tensor
data is then read with plain positioned reads of exactly the validated byte range; nothing is
executed (no pickle).

Every problem raises `CheckpointFormatError` (a ValueError) naming the file and, where known, the
tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterator, NamedTuple

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
# The largest JSON header (and index file) we parse; nothing larger is read. Python's JSON parser
# costs time and memory in proportion (roughly 1-3 s and 0.5 GB for a well-formed 16 MiB header of
# tiny entries, depending on the machine). Real headers take ~150 bytes per tensor: a single-file
# int4 MoE of 30B parameters as transformers 5 saves it (50 GB shards), 55k-75k tensors, has
# 8-11 MB. Pass `max_header_bytes` to read larger ones.
MAX_HEADER_BYTES = 16 << 20
MAX_INDEX_BYTES = 32 << 20
_MAX_NDIM = 64  # numpy's limit

# safetensors dtype -> (bits per element, numpy dtype or None when numpy has no unpacked form).
DTYPES: dict[str, tuple[int, np.dtype | None]] = {
    "BOOL": (8, np.dtype(np.bool_)),
    "U8": (8, np.dtype("u1")), "I8": (8, np.dtype("i1")),
    "U16": (16, np.dtype("<u2")), "I16": (16, np.dtype("<i2")),
    "U32": (32, np.dtype("<u4")), "I32": (32, np.dtype("<i4")),
    "U64": (64, np.dtype("<u8")), "I64": (64, np.dtype("<i8")),
    "F16": (16, np.dtype("<f2")), "BF16": (16, np.dtype(ml_dtypes.bfloat16)),
    "F32": (32, np.dtype("<f4")), "F64": (64, np.dtype("<f8")), "C64": (64, np.dtype("<c8")),
    "F8_E4M3": (8, np.dtype(ml_dtypes.float8_e4m3fn)),
    "F8_E5M2": (8, np.dtype(ml_dtypes.float8_e5m2)),
    "F8_E8M0": (8, np.dtype(ml_dtypes.float8_e8m0fnu)),
    "F8_E4M3FNUZ": (8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
    "F8_E5M2FNUZ": (8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
    "F4": (4, None), "F6_E2M3": (6, None), "F6_E3M2": (6, None),
}


class CheckpointFormatError(ValueError):
  """A malformed or inconsistent checkpoint file; names the file and, where known, the tensor."""

  def __init__(self, message: str, *, path: str | os.PathLike | None = None,
               tensor: str | None = None):
    where = []
    if path is not None:
      where.append(str(path))
    if tensor is not None:
      where.append(f"tensor {tensor!r}")
    super().__init__(f"{': '.join(where)}: {message}" if where else message)
    self.path = None if path is None else str(path)
    self.tensor = tensor


class TensorNotFoundError(KeyError):
  """A tensor name that the checkpoint does not hold (a KeyError with a readable message)."""

  def __init__(self, message: str, *, path: str | os.PathLike | None = None,
               tensor: str | None = None):
    super().__init__(message)
    self.message = message
    self.path = None if path is None else str(path)
    self.tensor = tensor

  def __str__(self) -> str:
    return self.message


class TensorInfo(NamedTuple):
  """Where one tensor lies: its file, safetensors dtype, shape and absolute byte range."""

  file: Path
  dtype: str
  shape: tuple[int, ...]
  start: int  # absolute file offset of the first byte
  nbytes: int

  @property
  def numpy_dtype(self) -> np.dtype | None:
    return DTYPES[self.dtype][1]


# ------------------------------------------------------------------ strict JSON
def _reject_constant(name: str):
  raise ValueError(f"non-standard JSON constant {name}")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, value in pairs:
    if key in out:
      raise ValueError(f"duplicate key {key!r}")
    out[key] = value
  return out


def parse_json_bytes(data: bytes, path: str | os.PathLike, what: str, *,
                     unique_keys: bool = True) -> Any:
  """Strict JSON from `data` (UTF-8, no NaN or Infinity, and with `unique_keys` no duplicate
  keys: that check slows Python's parser 2-3x, so tensor headers skip it; their coverage check
  makes a duplicated entry harmless, as in the reference library, where the last one wins too).
  Errors name `path` and the line and column."""
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise CheckpointFormatError(f"{what} is not UTF-8 (byte {e.start}: {e.reason})",
                                path=path) from None
  try:
    hook = _unique_object if unique_keys else None
    return json.loads(text, object_pairs_hook=hook, parse_constant=_reject_constant)
  except json.JSONDecodeError as e:
    raise CheckpointFormatError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column "
                                f"{e.colno}", path=path) from None
  except RecursionError:
    raise CheckpointFormatError(f"{what} nests JSON too deeply", path=path) from None
  except ValueError as e:  # duplicate keys, constants, integers too long to convert
    raise CheckpointFormatError(f"{what} is not valid JSON: {e}", path=path) from None


def read_bounded(path: Path, limit: int, what: str) -> bytes:
  """The whole of a small file, refusing files larger than `limit` bytes before reading."""
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size > limit:
        raise CheckpointFormatError(f"{what} is {size} bytes, more than the {limit}-byte limit",
                                    path=path)
      data = f.read(limit + 1)
  except OSError as e:
    raise CheckpointFormatError(f"cannot read {what}: {e.strerror or e}", path=path) from None
  if len(data) > limit:
    raise CheckpointFormatError(f"{what} grew past the {limit}-byte limit while reading",
                                path=path)
  return data


# ------------------------------------------------------------------ header validation
def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _entry_error(path: Path, name: str, entry: Any, data_size: int) -> CheckpointFormatError:
  """Why a header entry that failed the fast check is invalid."""
  def err(msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(msg, path=path, tensor=name)

  if not isinstance(entry, dict):
    return err(f"header entry must be a JSON object, got {type(entry).__name__}")
  missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
  if missing:
    return err(f"header entry lacks {', '.join(missing)}")
  dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
  if not isinstance(dtype, str) or dtype not in DTYPES:
    return err(f"unknown dtype {_short(dtype)} (known: {', '.join(DTYPES)})")
  if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
    return err(f"shape must be a list of non-negative integers, got {_short(shape)}")
  if len(shape) > _MAX_NDIM:
    return err(f"shape has {len(shape)} dimensions, more than {_MAX_NDIM}")
  if (not isinstance(offsets, list) or len(offsets) != 2
      or not all(_is_int(o) and o >= 0 for o in offsets)):
    return err(f"data_offsets must be two non-negative integers, got {_short(offsets)}")
  begin, end = offsets
  if begin > end:
    return err(f"data_offsets {offsets} end before they begin")
  if end > data_size:
    return err(f"data_offsets {offsets} run past the end of the data section ({data_size} "
               "bytes): the file is truncated or the header is wrong")
  bits = math.prod(shape) * DTYPES[dtype][0]
  return err(f"dtype {dtype} and shape {shape} need {bits / 8:g} bytes, but data_offsets "
             f"{offsets} hold {end - begin}")


def _tensor_entry(path: Path, name: str, entry: Any, data_size: int, data_start: int) -> TensorInfo:
  # Fast path (exact types, one pass); anything unusual goes to `_entry_error` for the message.
  if type(entry) is dict:
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    spec = DTYPES.get(dtype) if type(dtype) is str else None
    if (spec is not None and type(shape) is list and len(shape) <= _MAX_NDIM
        and type(offsets) is list and len(offsets) == 2):
      begin, end = offsets
      if (type(begin) is int and type(end) is int and 0 <= begin <= end <= data_size
          and all(type(d) is int and d >= 0 for d in shape)):
        bits = math.prod(shape) * spec[0]
        if not bits % 8 and bits // 8 == end - begin:
          return TensorInfo(path, dtype, tuple(shape), data_start + begin, end - begin)
  raise _entry_error(path, name, entry, data_size)


def _short(value: Any, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def _check_coverage(path: Path, infos: dict[str, TensorInfo], data_start: int,
                    data_size: int) -> None:
  cursor, previous = 0, None
  for name, info in sorted(infos.items(), key=lambda kv: (kv[1].start, kv[1].nbytes)):
    begin = info.start - data_start
    if begin < cursor:
      raise CheckpointFormatError(f"bytes [{begin}, {begin + info.nbytes}) overlap tensor "
                                  f"{previous!r}, which ends at {cursor}", path=path, tensor=name)
    if begin > cursor:
      raise CheckpointFormatError(f"the data section has a gap [{cursor}, {begin}) before this "
                                  "tensor (safetensors files cover their data exactly)",
                                  path=path, tensor=name)
    cursor, previous = begin + info.nbytes, name
  if cursor != data_size:
    raise CheckpointFormatError(f"the tensors cover {cursor} bytes of the {data_size}-byte data "
                                "section: trailing bytes are not allowed", path=path)


def read_header(path: str | os.PathLike, *, max_header_bytes: int = MAX_HEADER_BYTES
                ) -> tuple[dict[str, TensorInfo], dict[str, str]]:
  """Parses and validates one safetensors file's header -> (tensors by name, __metadata__)."""
  path = Path(path)
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size < 8:
        raise CheckpointFormatError(f"the file is {size} bytes, too short for the 8-byte header "
                                    "length: truncated or not a safetensors file", path=path)
      (n,) = struct.unpack("<Q", f.read(8))
      if n > size - 8:
        raise CheckpointFormatError(f"the header length {n} runs past the end of the "
                                    f"{size}-byte file: truncated or not a safetensors file",
                                    path=path)
      if n > max_header_bytes:
        raise CheckpointFormatError(f"the header length {n} exceeds max_header_bytes="
                                    f"{max_header_bytes}", path=path)
      if n < 2:
        raise CheckpointFormatError(f"the header length {n} is too short for a JSON object",
                                    path=path)
      raw = f.read(n)
  except OSError as e:
    raise CheckpointFormatError(f"cannot read: {e.strerror or e}", path=path) from None
  if len(raw) != n:
    raise CheckpointFormatError(f"read {len(raw)} of the {n} header bytes: the file shrank while "
                                "being read", path=path)
  header = parse_json_bytes(raw, path, "the safetensors header", unique_keys=False)
  if not isinstance(header, dict):
    raise CheckpointFormatError(f"the header must be a JSON object, got {type(header).__name__}",
                                path=path)
  metadata = header.pop("__metadata__", None)
  if metadata is None:
    metadata = {}
  if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
    raise CheckpointFormatError(f"__metadata__ must map strings to strings, got "
                                f"{_short(metadata)}", path=path)
  data_start, data_size = 8 + n, size - 8 - n
  infos = {name: _tensor_entry(path, name, entry, data_size, data_start)
           for name, entry in header.items()}
  _check_coverage(path, infos, data_start, data_size)
  return infos, metadata


def _read_bytes(file: Path, start: int, nbytes: int, name: str) -> np.ndarray:
  """Exactly `nbytes` bytes at absolute offset `start` of `file` (the one place tensor data is
  read, so that a test can see which byte ranges a load touched)."""
  buf = np.empty(nbytes, np.uint8)
  try:
    with open(file, "rb") as f:
      f.seek(start)
      got = f.readinto(memoryview(buf)) if nbytes else 0
  except OSError as e:
    raise CheckpointFormatError(f"cannot read: {e.strerror or e}", path=file,
                                tensor=name) from None
  if got != nbytes:
    raise CheckpointFormatError(f"read {got} of {nbytes} bytes: the file was truncated after "
                                "it was opened", path=file, tensor=name)
  return buf


def _numpy_dtype(info: TensorInfo, name: str) -> np.dtype:
  dtype = info.numpy_dtype
  if dtype is None:
    raise CheckpointFormatError(f"dtype {info.dtype} is packed below a byte and has no numpy form",
                                path=info.file, tensor=name)
  return dtype


def read_tensor(info: TensorInfo, name: str) -> np.ndarray:
  """Reads exactly the validated byte range of one tensor into a fresh (writable) array."""
  dtype = _numpy_dtype(info, name)
  return _read_bytes(info.file, info.start, info.nbytes, name).view(dtype).reshape(info.shape)


def read_tensor_rows(info: TensorInfo, name: str, start: int, stop: int) -> np.ndarray:
  """Rows [start, stop) of a tensor's leading axis, reading only their bytes (rows are
  contiguous in a row-major tensor): e.g. some experts of a stacked [E, out, in] tensor."""
  dtype = _numpy_dtype(info, name)
  if not info.shape:
    raise CheckpointFormatError("is a scalar: it has no rows to read", path=info.file,
                                tensor=name)
  rows = info.shape[0]
  if not 0 <= start <= stop <= rows:
    raise ValueError(f"{info.file}: tensor {name!r}: rows [{start}, {stop}) are outside its "
                     f"{rows} rows")
  row_bytes = info.nbytes // rows if rows else 0
  data = _read_bytes(info.file, info.start + start * row_bytes, (stop - start) * row_bytes, name)
  return data.view(dtype).reshape((stop - start,) + info.shape[1:])


# ------------------------------------------------------------------ sharded index
def _shard_path(directory: Path, index_path: Path, tensor: str, name: Any) -> Path:
  if not isinstance(name, str) or not name:
    raise CheckpointFormatError(f"weight_map[{tensor!r}] must be a file name, got {_short(name)}",
                                path=index_path)
  pure = PurePosixPath(name.replace("\\", "/"))
  if (pure.is_absolute() or PureWindowsPath(name).drive or ".." in pure.parts
      or "\0" in name):
    raise CheckpointFormatError(f"weight_map[{tensor!r}] = {name!r} points outside the "
                                "checkpoint directory", path=index_path)
  return directory.joinpath(*pure.parts)


def read_index(index_path: str | os.PathLike, *, max_bytes: int = MAX_INDEX_BYTES
               ) -> dict[str, Path]:
  """Validates `model.safetensors.index.json` -> {tensor name: shard path inside its directory}."""
  index_path = Path(index_path)
  data = parse_json_bytes(read_bounded(index_path, max_bytes, "the index"), index_path,
                          "the index")
  if not isinstance(data, dict):
    raise CheckpointFormatError(f"the index must be a JSON object, got {type(data).__name__}",
                                path=index_path)
  weight_map = data.get("weight_map")
  if not isinstance(weight_map, dict):
    raise CheckpointFormatError(f"'weight_map' must be a JSON object mapping tensor names to "
                                f"shard files, got {_short(weight_map)}", path=index_path)
  directory = index_path.parent
  out = {name: _shard_path(directory, index_path, name, shard)
         for name, shard in weight_map.items()}
  for shard in sorted(set(out.values())):
    if not shard.is_file():
      raise CheckpointFormatError(f"shard {shard.name!r} listed in the index does not exist in "
                                  f"{directory}", path=index_path)
  return out


# ------------------------------------------------------------------ checkpoint directory
class SafetensorsDir:
  """Name -> tensor access over a checkpoint's safetensors files (lazy, per tensor, validated).

  `path` is a directory with `model.safetensors.index.json` (sharded), or with `*.safetensors`
  files, or one `.safetensors` file, or an index file. Every file's header is validated when the
  directory is opened; `get_shape` / `get_dtype` read no tensor data.
  """

  def __init__(self, path: str | os.PathLike, *, max_header_bytes: int = MAX_HEADER_BYTES):
    self.path = Path(path)
    self.max_header_bytes = max_header_bytes
    index: dict[str, Path] | None = None
    self.index_path: Path | None = None
    if self.path.is_file() and self.path.name.endswith(".json"):
      self.index_path = self.path
    elif self.path.is_dir() and (self.path / INDEX_FILE).is_file():
      self.index_path = self.path / INDEX_FILE
    if self.index_path is not None:
      index = read_index(self.index_path)
      files = sorted(set(index.values()))
    elif self.path.is_file():
      files = [self.path]
    elif self.path.is_dir():
      files = sorted(p for p in self.path.glob("*.safetensors") if p.is_file())
    else:
      raise FileNotFoundError(f"{self.path} does not exist")
    if not files:
      raise FileNotFoundError(f"no .safetensors files in {self.path}")
    self._info: dict[str, TensorInfo] = {}
    for file in files:
      infos, _ = read_header(file, max_header_bytes=max_header_bytes)
      for name, info in infos.items():
        if name in self._info:
          raise CheckpointFormatError(f"is in two shards: {self._info[name].file} and {file}",
                                      path=self.path, tensor=name)
        self._info[name] = info
    if index is not None:
      self._check_index(index)

  def _check_index(self, index: dict[str, Path]) -> None:
    for name, shard in index.items():
      info = self._info.get(name)
      if info is None:
        raise CheckpointFormatError(f"the index {self.index_path} places it in {shard}, which "
                                    "does not hold it", tensor=name)
      if info.file != shard:
        raise CheckpointFormatError(f"the index {self.index_path} places it in {shard}, but it is "
                                    f"in {info.file}", tensor=name)

  # -- names
  def keys(self) -> list[str]:
    return list(self._info)

  def __contains__(self, name: object) -> bool:
    return name in self._info

  def __len__(self) -> int:
    return len(self._info)

  def __iter__(self) -> Iterator[str]:
    return iter(self._info)

  @property
  def files(self) -> list[Path]:
    return sorted({info.file for info in self._info.values()})

  # -- metadata without data
  def info(self, name: str) -> TensorInfo:
    info = self._info.get(name)
    if info is None:
      raise TensorNotFoundError(f"tensor {name!r} is not in the checkpoint {self.path}",
                                path=self.path, tensor=name)
    return info

  def file_of(self, name: str) -> Path:
    return self.info(name).file

  def get_shape(self, name: str) -> tuple[int, ...]:
    return self.info(name).shape

  def get_dtype(self, name: str) -> np.dtype:
    """The numpy dtype `get(name)` returns (ml_dtypes for bfloat16 / float8)."""
    info = self.info(name)
    if info.numpy_dtype is None:
      raise CheckpointFormatError(f"dtype {info.dtype} has no numpy form", path=info.file,
                                  tensor=name)
    return info.numpy_dtype

  # -- data
  def get(self, name: str) -> np.ndarray:
    return read_tensor(self.info(name), name)

  def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the tensor's leading axis; only their bytes are read."""
    return read_tensor_rows(self.info(name), name, start, stop)

  def get_optional(self, name: str) -> np.ndarray | None:
    return self.get(name) if name in self else None

  def where(self, name: str) -> str:
    """`file: tensor 'name'` for error messages."""
    info = self._info.get(name)
    return f"{info.file if info else self.path}: tensor {name!r}"

