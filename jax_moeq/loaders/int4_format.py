"""Checkpoint int4 encodings, in numpy (host-side; checkpoints never touch the device packed).

- uint4b8 int32 (SPEC §2): eight nibbles per int32, nibble j (bits 4j..4j+3) holds element 8r + j
  of the packed axis, stored as q + 8. GPTQ packs axis 0 of `[in, out]` (`qweight [in/8, out]`);
  compressed-tensors packs the last axis of `[out, in]` (`weight_packed [out, in/8]`).
- signed packed uint8 (MxInt4): two nibbles per byte along the last axis, element 2r in the low
  nibble, each the two's-complement nibble of q (q & 0xF). It is exactly the little-endian bytes of
  a uint4b8 int32 XOR 0x88.
"""

from __future__ import annotations

import numpy as np

INT4_MIN, INT4_MAX = -8, 7


def _check_int4(q: np.ndarray, name: str) -> None:
  if q.dtype != np.int8:
    raise TypeError(f"{name} must be int8 holding int4 values, got {q.dtype}")
  if q.size and (q.min() < INT4_MIN or q.max() > INT4_MAX):
    raise ValueError(f"{name} holds values in [{q.min()}, {q.max()}], outside the int4 range "
                     "[-8, 7]")


def pack_uint4b8(q: np.ndarray, axis: int = -1) -> np.ndarray:
  """int8 int4 values -> int32 with 8 nibbles (q + 8) along `axis`, which shrinks 8x."""
  q = np.asarray(q)
  _check_int4(q, "q")
  axis = axis % q.ndim
  if q.shape[axis] % 8:
    raise ValueError(f"axis {axis} of shape {q.shape} must be a multiple of 8 to pack uint4b8")
  u = np.moveaxis(q.astype(np.int32) + 8, axis, -1).astype(np.uint32)
  u = u.reshape(*u.shape[:-1], -1, 8)
  shifts = (4 * np.arange(8, dtype=np.uint32))
  packed = np.bitwise_or.reduce(u << shifts, axis=-1)
  return np.moveaxis(packed.view(np.int32), -1, axis)


def unpack_uint4b8(packed: np.ndarray, axis: int = -1) -> np.ndarray:
  """Inverse of `pack_uint4b8`: int32 -> int8 int4 values, `axis` grows 8x."""
  packed = np.asarray(packed)
  if packed.dtype not in (np.int32, np.uint32):
    raise TypeError(f"uint4b8 data must be int32, got {packed.dtype}")
  axis = axis % packed.ndim
  u = np.moveaxis(packed.view(np.uint32), axis, -1)
  shifts = (4 * np.arange(8, dtype=np.uint32))
  nibbles = (u[..., None] >> shifts) & 0xF
  q = (nibbles.astype(np.int8) - 8).reshape(*u.shape[:-1], 8 * u.shape[-1])
  return np.moveaxis(q, -1, axis)


def pack_signed_nibbles(q: np.ndarray) -> np.ndarray:
  """int8 int4 values [..., n] -> uint8 [..., n/2], two's-complement nibbles, even index low."""
  q = np.asarray(q)
  _check_int4(q, "q")
  if q.shape[-1] % 2:
    raise ValueError(f"last axis of shape {q.shape} must be even to pack nibbles")
  u = (q.astype(np.uint8) & 0xF)
  return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def unpack_signed_nibbles(packed: np.ndarray) -> np.ndarray:
  """Inverse of `pack_signed_nibbles`."""
  packed = np.asarray(packed)
  if packed.dtype != np.uint8:
    raise TypeError(f"signed packed int4 data must be uint8, got {packed.dtype}")
  lo = (packed & 0xF).astype(np.int8)
  hi = (packed >> 4).astype(np.int8)
  # Sign-extend the 4-bit two's complement.
  lo = np.where(lo > 7, lo - 16, lo).astype(np.int8)
  hi = np.where(hi > 7, hi - 16, hi).astype(np.int8)
  return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def deinterleave_gate_up(w: np.ndarray, axis: int) -> np.ndarray:
  """Interleaved gate/up rows (g0, u0, g1, u1, ...) along `axis` -> halves (g..., u...).

  Some checkpoints (GPT-OSS / swigluoai) fuse gate and up by interleaving; our w13 holds the gate
  half first, then the up half, for every activation (SPEC §5 note).
  """
  w = np.asarray(w)
  if w.shape[axis] % 2:
    raise ValueError(f"interleaved gate/up axis {axis} of shape {w.shape} must be even")
  gate = np.take(w, np.arange(0, w.shape[axis], 2), axis=axis)
  up = np.take(w, np.arange(1, w.shape[axis], 2), axis=axis)
  return np.concatenate([gate, up], axis=axis)


def interleave_gate_up(w: np.ndarray, axis: int) -> np.ndarray:
  """Inverse of `deinterleave_gate_up`: halves (g..., u...) -> (g0, u0, g1, u1, ...)."""
  w = np.asarray(w)
  gate, up = np.split(w, 2, axis=axis)
  stacked = np.stack([gate, up], axis=axis + 1 if axis >= 0 else axis)
  shape = list(w.shape)
  return stacked.reshape(shape)
