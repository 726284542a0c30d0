"""CPU tests of the WNA16 GPU packer: layout round trips, GPTQ ingest, and a numpy model of the
kernel's m16n8k16 fragment reads (int4_mma_core.cuh) over the packed bytes."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moeq.ops import wna16_gpu
from jax_moeq.quant import int4


def _rng(seed):
  return np.random.default_rng(seed)


def test_tile_pack_round_trip():
  u = _rng(0).integers(0, 16, size=(3, 48, 192), dtype=np.uint8)
  words = wna16_gpu.pack_int4_tiles(jnp.asarray(u))
  assert words.shape == (3, 3, 3, 32, 4) and words.dtype == jnp.uint32
  np.testing.assert_array_equal(np.asarray(wna16_gpu.unpack_int4_tiles(words)), u)


def test_tile_pack_jits():
  u = _rng(1).integers(0, 16, size=(2, 32, 128), dtype=np.uint8)
  eager = wna16_gpu.pack_int4_tiles(jnp.asarray(u))
  jitted = jax.jit(wna16_gpu.pack_int4_tiles)(jnp.asarray(u))
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_row_pairs_round_trip():
  s = _rng(2).standard_normal((2, 3, 64)).astype(np.float32)
  packed = wna16_gpu.pack_row_pairs(jnp.asarray(s))
  assert packed.shape == (2, 3, 4, 16)
  # Word g of a subtile holds rows g (low half) and g + 8 (high half).
  np.testing.assert_array_equal(np.asarray(packed)[0, 0, 1, 2 * 5:2 * 5 + 2], s[0, 0, [16 + 5, 16 + 13]])
  np.testing.assert_array_equal(np.asarray(wna16_gpu.unpack_row_pairs(packed)), s)


def _fragment_model(words, x, n_out, k_in):
  """y[n, tok] from packed words the way one warp's lanes feed mma.m16n8k16 (swap AB).

  Follows the PTX fragment layout: A reg i of lane (g, t) holds row g + 8*(i & 1), logical
  columns 2t + 8*(i >> 1) + {0, 1}; B regs 0/1 of lane (g, t) hold logical rows 2t + {0,1} and
  2t + 8 + {0,1} of column (token) g. The lane reads physical inputs k0 + 16t + [0, 16) of its
  token as words; word 2s / 2s+1 feed step s.
  """
  nt_count, kc_count = n_out // 16, k_in // 64
  tokens = x.shape[0]
  y = np.zeros((n_out, tokens), np.float64)
  for nt in range(nt_count):
    for kc in range(kc_count):
      for tile in range(0, tokens, 8):
        for s in range(4):
          a = np.zeros((16, 16))
          b = np.zeros((16, 8))
          for lane in range(32):
            g, t = lane // 4, lane % 4
            word = int(words[nt, kc, lane, s])
            for i in range(4):
              lo = (word >> (4 * i)) & 0xF
              hi = (word >> (4 * (i + 4))) & 0xF
              row = g + 8 * (i & 1)
              col = 2 * t + 8 * (i >> 1)
              a[row, col], a[row, col + 1] = lo - 8, hi - 8
            tok = tile + g
            if tok < tokens:
              base = kc * 64 + 16 * t
              words_x = x[tok, base:base + 16]  # 8 words of 2 elements
              b[2 * t:2 * t + 2, g] = words_x[4 * s:4 * s + 2]       # word 2s
              b[2 * t + 8:2 * t + 10, g] = words_x[4 * s + 2:4 * s + 4]  # word 2s + 1
          part = a @ b
          cols = min(8, tokens - tile)
          y[nt * 16:nt * 16 + 16, tile:tile + cols] += part[:, :cols]
  return y


def test_fragment_model_matches_matmul():
  rng = _rng(3)
  n_out, k_in, tokens = 32, 128, 5
  q = rng.integers(-8, 8, size=(1, n_out, k_in)).astype(np.int8)
  words = np.asarray(wna16_gpu.pack_int4_tiles(jnp.asarray((q + 8).astype(np.uint8))))[0]
  x = rng.standard_normal((tokens, k_in))
  want = q[0].astype(np.float64) @ x.T
  np.testing.assert_allclose(_fragment_model(words, x, n_out, k_in), want, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_ingest(group_size, act_order):
  rng = _rng(4)
  e, h, i = 2, 256, 128
  q13 = rng.integers(-8, 8, size=(e, 2 * i, h)).astype(np.int8)
  q2 = rng.integers(-8, 8, size=(e, h, i)).astype(np.int8)
  g13 = h if group_size == -1 else group_size
  g2 = i if group_size == -1 else group_size
  s13 = rng.uniform(0.5, 2, size=(e, h // g13, 2 * i)).astype(np.float16)
  s2 = rng.uniform(0.5, 2, size=(e, i // g2, h)).astype(np.float16)
  kw = {}
  if act_order:
    kw["w13_g_idx"] = np.stack([rng.permutation(np.arange(h) // g13) for _ in range(e)])
    kw["w2_g_idx"] = np.stack([rng.permutation(np.arange(i) // g2) for _ in range(e)])
  weights = wna16_gpu.convert_to_wna16_moe_kernel_format(
      "MARLIN", int4.pack_uint4b8_gptq(jnp.asarray(q13)), int4.pack_uint4b8_gptq(jnp.asarray(q2)),
      jnp.asarray(s13), jnp.asarray(s2), group_size=group_size, dtype=jnp.bfloat16, **kw)
  assert weights.act_order == act_order and weights.w13_scales.dtype == jnp.bfloat16
  u13 = np.asarray(wna16_gpu.unpack_int4_tiles(weights.w13)).astype(np.int32) - 8
  u2 = np.asarray(wna16_gpu.unpack_int4_tiles(weights.w2)).astype(np.int32) - 8
  if act_order:
    perm13 = np.asarray(weights.w13_perm)
    np.testing.assert_array_equal(u13, np.take_along_axis(q13, perm13[:, None, :], -1))
    # Sorted channels are grouped: the group of sorted channel j is j // group.
    np.testing.assert_array_equal(np.take_along_axis(kw["w13_g_idx"], perm13, -1),
                                  np.broadcast_to(np.arange(h) // g13, (e, h)))
    inv2 = np.asarray(weights.w2_inv_perm)
    np.testing.assert_array_equal(np.take_along_axis(u2, inv2[:, None, :], -1), q2)
  else:
    np.testing.assert_array_equal(u13, q13)
    np.testing.assert_array_equal(u2, q2)
  np.testing.assert_array_equal(
      np.asarray(wna16_gpu.unpack_row_pairs(weights.w13_scales)).astype(np.float32),
      s13.astype(np.float32).astype(jnp.bfloat16).astype(np.float32))


def test_gptq_ingest_zeros_and_bias():
  rng = _rng(5)
  e, h, i, g = 1, 64, 64, 32
  q13 = rng.integers(-8, 8, size=(e, 2 * i, h)).astype(np.int8)
  q2 = rng.integers(-8, 8, size=(e, h, i)).astype(np.int8)
  z13 = rng.integers(0, 16, size=(e, h // g, 2 * i)).astype(np.int8)
  z2 = rng.integers(0, 16, size=(e, i // g, h)).astype(np.int8)
  pack_z = lambda z: int4.pack_uint4b8_ct(jnp.asarray(z - 8))  # nibble j of word c = column 8c+j
  weights = wna16_gpu.convert_to_wna16_moe_kernel_format(
      "BATCHED_MARLIN", int4.pack_uint4b8_gptq(jnp.asarray(q13)),
      int4.pack_uint4b8_gptq(jnp.asarray(q2)), jnp.ones((e, h // g, 2 * i), jnp.float16),
      jnp.ones((e, i // g, h), jnp.float16), group_size=g, w13_qzeros=pack_z(z13),
      w2_qzeros=pack_z(z2), w13_bias=rng.standard_normal((e, 2 * i)),
      w2_bias=rng.standard_normal((e, h)))
  assert weights.has_zeros and weights.has_bias and weights.w13_bias.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(wna16_gpu.unpack_row_pairs(weights.w13_zeros)), z13)
  np.testing.assert_array_equal(np.asarray(wna16_gpu.unpack_row_pairs(weights.w2_zeros)), z2)


def test_bad_inputs():
  q = jnp.zeros((1, 8, 128), jnp.int32)
  s = jnp.ones((1, 2, 128), jnp.float16)
  with pytest.raises(ValueError, match="backend"):
    wna16_gpu.convert_to_wna16_moe_kernel_format("TRITON", q, q, s, s, group_size=32)
  with pytest.raises(ValueError, match="group_size"):
    wna16_gpu.convert_to_wna16_moe_kernel_format("MARLIN", q, q, s, s, group_size=48)
  with pytest.raises(ValueError, match="w13_scales"):
    wna16_gpu.convert_to_wna16_moe_kernel_format("MARLIN", q, q, s, s, group_size=64)
  with pytest.raises(TypeError, match="qweight"):
    wna16_gpu.convert_to_wna16_moe_kernel_format("MARLIN", q.astype(jnp.float32), q, s, s,
                                                 group_size=32)
  with pytest.raises(ValueError, match="together"):
    wna16_gpu.convert_to_wna16_moe_kernel_format("MARLIN", q, q, s, s, group_size=32,
                                                 w13_g_idx=jnp.zeros((1, 64), jnp.int32))
