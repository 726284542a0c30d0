"""`SafetensorsDir` on hostile input: hand-made malformed files, sharded indexes, and fuzzing.

Each malformed file must raise `CheckpointFormatError` (a ValueError) naming the file (and the
tensor where there is one) within a second, whatever the file claims. `test_reference_library_*`
records what the `safetensors` library itself rejects, so a change there shows up here.
"""

import json
import os
import struct
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_moeq.loaders import safetensors_io
from jax_moeq.loaders.safetensors_io import (
    CheckpointFormatError, SafetensorsDir, TensorNotFoundError)

GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


def _raw(header_bytes: bytes, data: bytes = b"", length: int | None = None) -> bytes:
  n = len(header_bytes) if length is None else length
  return struct.pack("<Q", n) + header_bytes + data


def _file(tmp_path, content: bytes, name="model.safetensors"):
  path = tmp_path / name
  path.write_bytes(content)
  return path


def _st(header: dict, data: bytes, **kw) -> bytes:
  return _raw(json.dumps(header).encode(), data, **kw)


# name -> (file bytes, tensor named in the error or None, words the message must contain)
MALFORMED = {
    "empty": (b"", None, "too short"),
    "truncated_length": (b"\x10\x00\x00", None, "too short"),
    "length_past_end": (_st(GOOD, bytes(16), length=1000), None, "runs past the end"),
    "length_2^62": (_st(GOOD, bytes(16), length=1 << 62), None, "runs past the end"),
    "length_2^64-1": (_st(GOOD, bytes(16), length=(1 << 64) - 1), None, "runs past the end"),
    "length_zero": (_raw(b"", bytes(4)), None, "too short"),
    "non_json": (_raw(b"not json at all!"), None, "line 1 column 1"),
    "json_list": (_raw(b"[1, 2, 3]"), None, "must be a JSON object"),
    "deep_nesting": (_raw(b"[" * 100_000 + b"]" * 100_000), None, "nests JSON too deeply"),
    "bad_utf8": (_raw(b'{"\xff": 1}'), None, "not UTF-8"),
    "nan": (_raw(b'{"a": NaN}'), None, "NaN"),
    "huge_integer": (_raw(b'{"a": {"dtype": "U8", "shape": [1' + b"0" * 5000 + b'], '
                          b'"data_offsets": [0, 1]}}', b"\0"), None, "not valid JSON"),
    "entry_not_object": (_st({"a": 1}, b""), "a", "must be a JSON object"),
    "missing_fields": (_st({"a": {"dtype": "F32"}}, bytes(16)), "a", "lacks shape, data_offsets"),
    "unknown_dtype": (_st({"a": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
                      "a", "unknown dtype"),
    "offset_past_end": (_st(GOOD, bytes(8)), "a", "run past the end of the data section"),
    "truncated_data": (_st(GOOD, bytes(15)), "a", "truncated"),
    "overlap": (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
                "b", "overlap tensor 'a'"),
    "negative_offset": (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
                            bytes(8)), "a", "non-negative"),
    "negative_shape": (_st({"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}},
                           bytes(16)), "a", "non-negative"),
    "float_offsets": (_st({"a": {"dtype": "F32", "shape": [2, 2],
                                 "data_offsets": [0.0, 16.0]}}, bytes(16)), "a", "integers"),
    "bool_shape": (_st({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"),
                   "a", "integers"),
    "begin_after_end": (_st({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}},
                            bytes(8)), "a", "end before they begin"),
    "shape_mismatch": (_st({"a": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}},
                           bytes(16)), "a", "need 24 bytes"),
    "dtype_mismatch": (_st({"a": {"dtype": "F64", "shape": [2, 2], "data_offsets": [0, 16]}},
                           bytes(16)), "a", "need 32 bytes"),
    "huge_shape": (_st({"a": {"dtype": "F32", "shape": [1 << 62, 1 << 62],
                              "data_offsets": [0, 16]}}, bytes(16)), "a", "need"),
    "huge_consistent_claim": (_st({"a": {"dtype": "U8", "shape": [1 << 40],
                                         "data_offsets": [0, 1 << 40]}}, bytes(16)),
                              "a", "run past the end"),
    "gap": (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16)),
            "a", "gap"),
    "trailing_bytes": (_st(GOOD, bytes(32)), None, "trailing bytes"),
    "metadata_not_strings": (_st({"__metadata__": {"x": 1}, **GOOD}, bytes(16)), None,
                             "__metadata__"),
    "too_many_dims": (_st({"a": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [0, 1]}},
                          b"\0"), "a", "dimensions"),
    "sub_byte_misaligned": (_st({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}},
                                bytes(2)), "a", "need 1.5 bytes"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_raises_value_error_naming_file(tmp_path, case):
  content, tensor, words = MALFORMED[case]
  path = _file(tmp_path, content)
  t0 = time.perf_counter()
  with pytest.raises(CheckpointFormatError) as info:
    SafetensorsDir(path)
  assert time.perf_counter() - t0 < 1.0
  err = info.value
  assert isinstance(err, ValueError)
  assert str(path) in str(err) and err.path == str(path)
  assert words in str(err), str(err)
  if tensor is not None:
    assert err.tensor == tensor and repr(tensor) in str(err)
  # The directory form and the file form fail alike.
  with pytest.raises(CheckpointFormatError):
    SafetensorsDir(tmp_path)


def test_header_larger_than_the_limit_is_refused_before_reading(tmp_path):
  header = json.dumps(GOOD).encode() + b" " * 4096  # valid: JSON allows trailing whitespace
  path = _file(tmp_path, _raw(header, bytes(16)))
  assert SafetensorsDir(path).get_shape("a") == (2, 2)
  with pytest.raises(CheckpointFormatError, match="max_header_bytes"):
    SafetensorsDir(path, max_header_bytes=1024)


# What the reference library (safetensors 0.8, Rust) does with the same files: it rejects every
# header problem above when the file is opened, but with `SafetensorError`, which is not a
# ValueError and does not name the file; a shape of more than 64 dimensions passes its check and
# fails in numpy at `get_tensor`. We raise our own error for all of them from our own check.
REFERENCE_FAILS_ON_READ = {"too_many_dims"}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_reference_library_rejects_the_same_files(tmp_path, case):
  safetensors = pytest.importorskip("safetensors", reason="compares with the reference library")
  path = _file(tmp_path, MALFORMED[case][0])
  stage = "open"
  with pytest.raises(Exception) as info:  # noqa: PT011 - recording what the library raises
    with safetensors.safe_open(str(path), "numpy") as f:
      stage = "read"
      for k in f.keys():
        f.get_tensor(k)
  assert stage == ("read" if case in REFERENCE_FAILS_ON_READ else "open")
  if stage == "open":
    assert type(info.value).__name__ == "SafetensorError"
    assert not isinstance(info.value, ValueError)


# ------------------------------------------------------------------ valid files
def _all_dtypes():
  rng = np.random.default_rng(0)
  return {
      "f32": rng.normal(size=(3, 5)).astype(np.float32),
      "f16": rng.normal(size=(7,)).astype(np.float16),
      "bf16": rng.normal(size=(2, 3, 4)).astype(ml_dtypes.bfloat16),
      "f64": rng.normal(size=(1,)).astype(np.float64),
      "i32": rng.integers(-2**31, 2**31 - 1, (4, 8), dtype=np.int32),
      "i64": np.array([1 << 40, -5], np.int64),
      "u8": rng.integers(0, 255, (16,), dtype=np.uint8),
      "i8": rng.integers(-128, 127, (3, 3), dtype=np.int8),
      "bool": np.array([True, False, True]),
      "empty": np.zeros((0, 4), np.float32),
      "scalar": np.array(3.5, np.float32),
      "f8": rng.normal(size=(5,)).astype(ml_dtypes.float8_e4m3fn),
  }


def test_reads_what_safetensors_numpy_writes(tmp_path):
  st_numpy = pytest.importorskip("safetensors.numpy")
  tensors = _all_dtypes()
  st_numpy.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  ckpt = SafetensorsDir(tmp_path)
  assert sorted(ckpt.keys()) == sorted(tensors) and len(ckpt) == len(tensors)
  for name, want in tensors.items():
    assert ckpt.get_shape(name) == want.shape
    assert ckpt.get_dtype(name) == want.dtype
    got = ckpt.get(name)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert got.flags.writeable


def test_reads_what_safetensors_torch_writes_like_the_library(tmp_path):
  torch = pytest.importorskip("torch", reason="torch writes bf16 as safetensors BF16")
  st_torch = pytest.importorskip("safetensors.torch")
  from safetensors import safe_open
  tensors = {"w": torch.randn(8, 16, dtype=torch.bfloat16), "q": torch.randint(-9, 9, (4, 2),
                                                                              dtype=torch.int32),
             "s": torch.randn(3, dtype=torch.float16), "shape": torch.tensor([4, 16])}
  st_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
  ckpt = SafetensorsDir(tmp_path / "model.safetensors")
  with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
    for name in tensors:
      want = f.get_tensor(name)
      got = ckpt.get(name)
      assert got.dtype == want.dtype and got.shape == want.shape, name
      assert got.tobytes() == want.tobytes()


def test_shape_and_dtype_without_reading_data(tmp_path, monkeypatch):
  st_numpy = pytest.importorskip("safetensors.numpy")
  st_numpy.save_file({"x": np.ones((3, 4), ml_dtypes.bfloat16)}, str(tmp_path / "m.safetensors"))
  ckpt = SafetensorsDir(tmp_path)
  monkeypatch.setattr(safetensors_io, "read_tensor", None)  # any data read would fail
  assert ckpt.get_shape("x") == (3, 4)
  assert ckpt.get_dtype("x") == np.dtype(ml_dtypes.bfloat16)
  assert ckpt.info("x").dtype == "BF16" and ckpt.file_of("x") == tmp_path / "m.safetensors"


def test_missing_tensor_error_names_key_and_checkpoint(tmp_path):
  _file(tmp_path, _st(GOOD, bytes(16)))
  ckpt = SafetensorsDir(tmp_path)
  with pytest.raises(KeyError) as info:
    ckpt.get("model.nope")
  assert isinstance(info.value, TensorNotFoundError)
  assert "'model.nope'" in str(info.value) and str(tmp_path) in str(info.value)
  with pytest.raises(KeyError, match="model.nope"):
    ckpt.get_shape("model.nope")
  assert ckpt.get_optional("model.nope") is None


def test_file_truncated_after_opening(tmp_path):
  path = _file(tmp_path, _st(GOOD, np.arange(4, dtype=np.float32).tobytes()))
  ckpt = SafetensorsDir(path)
  np.testing.assert_array_equal(ckpt.get("a"), np.arange(4, dtype=np.float32).reshape(2, 2))
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 4)
  with pytest.raises(CheckpointFormatError, match="truncated after it was opened") as info:
    ckpt.get("a")
  assert info.value.tensor == "a" and str(path) in str(info.value)


def test_sub_byte_dtype_has_shape_but_no_numpy_form(tmp_path):
  path = _file(tmp_path, _st({"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}},
                             bytes(2)))
  ckpt = SafetensorsDir(path)
  assert ckpt.get_shape("a") == (4,)
  with pytest.raises(CheckpointFormatError, match="F4"):
    ckpt.get("a")


# ------------------------------------------------------------------ sharded indexes
def _shard(tmp_path, name, tensors):
  header, data, off = {}, b"", 0
  for key, arr in tensors.items():
    raw = np.ascontiguousarray(arr, np.float32).tobytes()
    header[key] = {"dtype": "F32", "shape": list(np.shape(arr)),
                   "data_offsets": [off, off + len(raw)]}
    data += raw
    off += len(raw)
  (tmp_path / name).write_bytes(_st(header, data))


def _index(tmp_path, content):
  text = content if isinstance(content, str) else json.dumps(content)
  (tmp_path / safetensors_io.INDEX_FILE).write_text(text)


def test_sharded_index_reads_across_shards(tmp_path):
  _shard(tmp_path, "a.safetensors", {"x": np.ones(2), "y": np.zeros(3)})
  _shard(tmp_path, "b.safetensors", {"z": np.full(1, 7.0)})
  _index(tmp_path, {"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "a.safetensors",
                                                   "z": "b.safetensors"}})
  ckpt = SafetensorsDir(tmp_path)
  assert sorted(ckpt.keys()) == ["x", "y", "z"]
  np.testing.assert_array_equal(ckpt.get("z"), [7.0])
  assert ckpt.file_of("z") == tmp_path / "b.safetensors"
  # The index file itself may be given.
  assert sorted(SafetensorsDir(tmp_path / safetensors_io.INDEX_FILE).keys()) == ["x", "y", "z"]


@pytest.mark.parametrize("content,words", [
    ("{not json", "line 1 column 2"),
    ("[]", "must be a JSON object"),
    ({"metadata": {}}, "'weight_map' must be a JSON object"),
    ({"weight_map": ["a.safetensors"]}, "'weight_map' must be a JSON object"),
    ({"weight_map": {"x": 3}}, "must be a file name"),
    ({"weight_map": {"x": "../a.safetensors"}}, "outside the checkpoint directory"),
    ({"weight_map": {"x": "/etc/passwd"}}, "outside the checkpoint directory"),
    ({"weight_map": {"x": "sub/../../a.safetensors"}}, "outside the checkpoint directory"),
    ({"weight_map": {"x": "..\\a.safetensors"}}, "outside the checkpoint directory"),
    ({"weight_map": {"x": "C:\\a.safetensors"}}, "outside the checkpoint directory"),
    ({"weight_map": {"x": "missing.safetensors"}}, "does not exist"),
    ('{"weight_map": {"x": "a.safetensors", "x": "b.safetensors"}}', "duplicate key 'x'"),
])
def test_bad_index_names_the_index_file(tmp_path, content, words):
  _shard(tmp_path, "a.safetensors", {"x": np.ones(2)})
  _shard(tmp_path, "b.safetensors", {"w": np.ones(2)})
  _index(tmp_path, content)
  with pytest.raises(CheckpointFormatError) as info:
    SafetensorsDir(tmp_path)
  assert words in str(info.value) and safetensors_io.INDEX_FILE in str(info.value)


def test_index_claims_tensor_its_shard_lacks(tmp_path):
  _shard(tmp_path, "a.safetensors", {"x": np.ones(2)})
  _shard(tmp_path, "b.safetensors", {"y": np.ones(2)})
  _index(tmp_path, {"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}})
  with pytest.raises(CheckpointFormatError) as info:
    SafetensorsDir(tmp_path)
  msg = str(info.value)
  assert "'y'" in msg and safetensors_io.INDEX_FILE in msg and "a.safetensors" in msg
  # b.safetensors is not in the index, so y is nowhere among the listed shards.
  assert "does not hold it" in msg


def test_index_names_wrong_shard(tmp_path):
  _shard(tmp_path, "a.safetensors", {"x": np.ones(2)})
  _shard(tmp_path, "b.safetensors", {"y": np.ones(2)})
  _index(tmp_path, {"weight_map": {"x": "b.safetensors", "y": "a.safetensors"}})
  with pytest.raises(CheckpointFormatError,
                     match="'x'.*b.safetensors, but it is in .*a.safetensors"):
    SafetensorsDir(tmp_path)


def test_tensor_in_two_shards_names_both_files(tmp_path):
  _shard(tmp_path, "a.safetensors", {"x": np.ones(2)})
  _shard(tmp_path, "b.safetensors", {"x": np.zeros(2), "w": np.zeros(1)})
  _index(tmp_path, {"weight_map": {"x": "a.safetensors", "w": "b.safetensors"}})
  with pytest.raises(CheckpointFormatError) as info:
    SafetensorsDir(tmp_path)
  msg = str(info.value)
  assert "two shards" in msg and "a.safetensors" in msg and "b.safetensors" in msg
  # Without an index, every *.safetensors file is read: the same conflict.
  (tmp_path / safetensors_io.INDEX_FILE).unlink()
  with pytest.raises(CheckpointFormatError, match="two shards"):
    SafetensorsDir(tmp_path)


def test_shard_in_a_subdirectory_is_allowed(tmp_path):
  (tmp_path / "sub").mkdir()
  _shard(tmp_path, "sub/a.safetensors", {"x": np.ones(2)})
  _index(tmp_path, {"weight_map": {"x": "sub/a.safetensors"}})
  np.testing.assert_array_equal(SafetensorsDir(tmp_path).get("x"), [1.0, 1.0])


def test_missing_path_and_empty_directory(tmp_path):
  with pytest.raises(FileNotFoundError):
    SafetensorsDir(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="no .safetensors"):
    SafetensorsDir(tmp_path)


# ------------------------------------------------------------------ fuzzing
def _valid_file() -> bytes:
  header = {"__metadata__": {"format": "pt"},
            "w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]},
            "s": {"dtype": "I32", "shape": [3], "data_offsets": [64, 76]},
            "e": {"dtype": "F32", "shape": [0], "data_offsets": [76, 76]}}
  return _st(header, bytes(range(76)))


VALID = _valid_file()


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1,
                max_size=6),
       st.one_of(st.none(), st.integers(0, len(VALID))))
def test_mutated_files_either_read_like_the_library_or_raise_value_error(tmp_path, edits, cut):
  content = bytearray(VALID)
  for pos, byte in edits:
    content[pos] = byte
  if cut is not None:
    content = content[:cut]
  path = tmp_path / "fuzz.safetensors"
  path.write_bytes(bytes(content))
  t0 = time.perf_counter()
  try:
    ckpt = SafetensorsDir(path)
    ours = {k: ckpt.get(k) for k in ckpt.keys() if ckpt.info(k).numpy_dtype is not None}
  except CheckpointFormatError as e:
    assert str(path) in str(e)
    ours = None
  assert time.perf_counter() - t0 < 1.0
  try:
    from safetensors import safe_open
  except ImportError:
    return
  try:
    with safe_open(str(path), "numpy") as f:
      theirs = {k: f.get_tensor(k) for k in f.keys() if k in (ours or {})}
  except Exception:  # noqa: BLE001
    theirs = None
  # Same verdict as the reference library, and the same bytes when both read the file.
  assert (ours is None) == (theirs is None)
  for k in ours or {}:
    assert ours[k].shape == theirs[k].shape and ours[k].tobytes() == theirs[k].tobytes()


_ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "U8", "I32", "F64", "BOOL", "F4", "I64"]),
    "shape": st.lists(st.integers(-1, 6), max_size=3),
    "data_offsets": st.lists(st.integers(-1, 80), min_size=2, max_size=2),
})


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), _ENTRY, max_size=3),
       st.integers(0, 80))
def test_generated_headers_get_the_reference_verdict(tmp_path, header, data_len):
  path = tmp_path / "gen.safetensors"
  path.write_bytes(_st(header, bytes(data_len)))
  try:
    ckpt = SafetensorsDir(path)
    ours = {k: ckpt.get(k) for k in ckpt.keys() if ckpt.info(k).numpy_dtype is not None}
  except CheckpointFormatError as e:
    assert str(path) in str(e)
    ours = None
  safetensors = pytest.importorskip("safetensors")
  try:
    with safetensors.safe_open(str(path), "numpy") as f:
      theirs = {k: f.get_tensor(k) for k in f.keys() if k in (ours or {})}
  except Exception:  # noqa: BLE001
    theirs = None
  assert (ours is None) == (theirs is None), (header, data_len)
  for k in ours or {}:
    assert ours[k].shape == theirs[k].shape and ours[k].tobytes() == theirs[k].tobytes()
