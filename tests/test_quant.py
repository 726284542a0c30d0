"""jax_moeq.quant.int4 vs independent numpy versions (SPEC §2): bit-exact, as every step is exact
or a single rounding (f32 -> bf16 scale, then round-half-even of w / scale)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq.quant import int4

GROUP_SIZES = [32, 64, 128, -1]


def np_quantize_int4(w, group_size):
  w = np.asarray(w, np.float32)
  k = w.shape[-1]
  g = k if group_size == -1 else group_size
  groups = w.reshape(*w.shape[:-1], k // g, g)
  absmax = np.abs(groups).max(-1)
  scale = np.where(absmax == 0, np.float32(1), absmax / np.float32(7.5)).astype(np.float32)
  if group_size != -1:
    scale = scale.astype(jnp.bfloat16)
  q = np.clip(np.rint(groups / scale.astype(np.float32)[..., None]), -8, 7)
  return q.astype(np.int8).reshape(w.shape), scale


def np_pack_uint4b8_rows(q):
  """[..., n] int4 -> [..., n/8] int32: nibble j of word r = q[8r + j] + 8 (python ints)."""
  q = np.asarray(q, np.int64)
  words = np.zeros((*q.shape[:-1], q.shape[-1] // 8), np.int64)
  for j in range(8):
    words |= (q[..., j::8] + 8) << (4 * j)
  return words.astype(np.uint32).view(np.int32)


def random_weights(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def random_q(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(-8, 8, shape), jnp.int8)


# ------------------------------------------------------------------ group size
@pytest.mark.parametrize("group_size,k,want", [(32, 64, 32), (64, 128, 64), (128, 256, 128),
                                               (-1, 96, 96)])
def test_validate_group_size(group_size, k, want):
  assert int4.validate_group_size(group_size, k) == want


@pytest.mark.parametrize("group_size,k,match", [(48, 96, "group_size=48 is not one of"),
                                                (16, 64, "group_size=16"),
                                                (128, 192, "does not divide the input size 192")])
def test_validate_group_size_rejects(group_size, k, match):
  with pytest.raises(ValueError, match=match):
    int4.validate_group_size(group_size, k)
  with pytest.raises(ValueError, match="w13_group"):
    int4.validate_group_size(group_size, k, name="w13_group")


# ------------------------------------------------------------------ quantize / dequantize
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_matches_numpy(group_size, dtype):
  w = random_weights(1, (3, 16, 256), dtype) * 0.1
  w = w.at[1, 2, :128].set(0)  # all-zero groups: scale 1, q 0
  q, scale = jax.jit(int4.quantize_int4, static_argnums=1)(w, group_size)
  q_np, scale_np = np_quantize_int4(w, group_size)
  g = 256 if group_size == -1 else group_size
  assert q.dtype == jnp.int8 and q.shape == w.shape
  assert scale.shape == (3, 16, 256 // g)
  assert scale.dtype == (jnp.float32 if group_size == -1 else jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(q), q_np)
  np.testing.assert_array_equal(np.asarray(scale, np.float32), np.asarray(scale_np, np.float32))
  if group_size != -1:
    np.testing.assert_array_equal(np.asarray(scale[1, 2, :128 // g], np.float32), 1)
    np.testing.assert_array_equal(np.asarray(q[1, 2, :128]), 0)
  assert int(q.min()) >= -8 and int(q.max()) <= 7


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_quantization_error_bound(group_size):
  """|w - deq| <= (7.5 / (1 - 2^-8) - 7) * s ~= 0.529 s: w / s_stored reaches at most
  7.5 / (1 - 2^-8) (a bf16 scale is within 2^-8 relative of absmax / 7.5), clamped to 7."""
  w = random_weights(2, (32, 512))
  q, scale = int4.quantize_int4(w, group_size)
  deq = int4.dequantize_int4(q, scale, group_size)
  g = 512 if group_size == -1 else group_size
  s = np.repeat(np.asarray(scale, np.float32), g, axis=-1)
  bound = (7.5 / (1 - 2.0**-8) - 7) * s * (1 + 1e-6)
  assert np.all(np.abs(np.asarray(deq) - np.asarray(w)) <= bound)
  # q is the best fit for the stored scale away from the clamp.
  inside = np.abs(np.asarray(w) / s) < 7.0
  assert np.all(np.abs(np.asarray(deq) - np.asarray(w))[inside] <= 0.5 * s[inside] * (1 + 1e-6))


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_dequantize_matches_numpy(group_size):
  q = random_q(3, (2, 8, 128))
  g = 128 if group_size == -1 else group_size
  scale = jnp.asarray(np.random.default_rng(4).uniform(0.01, 0.1, (2, 8, 128 // g)),
                      jnp.float32 if group_size == -1 else jnp.bfloat16)
  for dtype in (jnp.float32, jnp.bfloat16):
    deq = int4.dequantize_int4(q, scale, group_size, dtype)
    assert deq.dtype == dtype
    want = (np.asarray(q, np.float32).reshape(2, 8, 128 // g, g)
            * np.asarray(scale, np.float32)[..., None]).reshape(2, 8, 128)
    np.testing.assert_array_equal(np.asarray(deq, np.float32),
                                  want.astype(jnp.dtype(dtype)).astype(np.float32))


def test_quantize_rejects_bad_input():
  with pytest.raises(ValueError, match="at least 2-D"):
    int4.quantize_int4(jnp.ones(64), 32)
  with pytest.raises(TypeError, match="floating point"):
    int4.quantize_int4(jnp.ones((4, 64), jnp.int32), 32)
  with pytest.raises(ValueError, match="group_size=48"):
    int4.quantize_int4(jnp.ones((4, 96)), 48)
  with pytest.raises(ValueError, match="does not divide"):
    int4.dequantize_int4(jnp.ones((4, 96), jnp.int8), jnp.ones((4, 1)), 64)


# ------------------------------------------------------------------ nibbles
def test_nibbles_layout_and_round_trip():
  q = random_q(5, (3, 4, 64))
  packed = jax.jit(int4.pack_int4_nibbles)(q)
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 4, 32)
  qn = np.asarray(q, np.int32)
  want = (qn[..., 0::2] + 8) | ((qn[..., 1::2] + 8) << 4)
  np.testing.assert_array_equal(np.asarray(packed), want.astype(np.uint8))
  back = jax.jit(int4.unpack_int4_nibbles)(packed)
  assert back.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(back), np.asarray(q))
  # Every byte decodes and re-encodes to itself.
  all_bytes = jnp.arange(256, dtype=jnp.uint8)[None]
  np.testing.assert_array_equal(
      np.asarray(int4.pack_int4_nibbles(int4.unpack_int4_nibbles(all_bytes))), np.arange(256)[None])


def test_nibbles_reject_bad_input():
  with pytest.raises(ValueError, match="must be even"):
    int4.pack_int4_nibbles(jnp.ones((2, 3), jnp.int8))
  with pytest.raises(TypeError, match="uint8"):
    int4.unpack_int4_nibbles(jnp.ones((2, 3), jnp.int8))


# ------------------------------------------------------------------ uint4b8
def test_uint4b8_ct_layout_and_round_trip():
  q = random_q(6, (2, 16, 64))
  q = q.at[0, 0, 7].set(7)  # top nibble 15: the int32 sign bit is set
  packed = jax.jit(int4.pack_uint4b8_ct)(q)
  assert packed.dtype == jnp.int32 and packed.shape == (2, 16, 8)
  np.testing.assert_array_equal(np.asarray(packed), np_pack_uint4b8_rows(q))
  assert int(packed[0, 0, 0]) < 0
  np.testing.assert_array_equal(np.asarray(jax.jit(int4.unpack_uint4b8_ct)(packed)), np.asarray(q))


def test_uint4b8_gptq_layout_and_round_trip():
  q = random_q(7, (3, 24, 128))  # [E, out, in]
  packed = jax.jit(int4.pack_uint4b8_gptq)(q)
  assert packed.dtype == jnp.int32 and packed.shape == (3, 16, 24)  # [E, in/8, out]
  want = np.swapaxes(np_pack_uint4b8_rows(q), -1, -2)
  np.testing.assert_array_equal(np.asarray(packed), want)
  np.testing.assert_array_equal(np.asarray(jax.jit(int4.unpack_uint4b8_gptq)(packed)),
                                np.asarray(q))


def test_uint4b8_to_signed_int4():
  q = random_q(8, (4, 64))
  words = int4.pack_uint4b8_ct(q)
  signed = np.asarray(jax.jit(int4.uint4b8_to_signed_int4)(words)).view(np.uint32)
  assert np.asarray(int4.uint4b8_to_signed_int4(words)).dtype == np.int32
  qn = np.asarray(q, np.int64)
  for j in range(8):
    np.testing.assert_array_equal((signed >> (4 * j)) & 0xF, qn[:, j::8] & 0xF)


def test_uint4b8_rejects_bad_input():
  with pytest.raises(ValueError, match="multiple of 8"):
    int4.pack_uint4b8_ct(jnp.ones((2, 12), jnp.int8))
  with pytest.raises(TypeError, match="int32"):
    int4.unpack_uint4b8_ct(jnp.ones((2, 12), jnp.int8))
