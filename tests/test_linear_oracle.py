"""The dense int4 linear oracle (`jax_moeq.oracle.linear`): selection per platform, explicit
backends, refusals with reasons, NotImplementedError when nothing fits."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from jax_moeq import _ffi
from jax_moeq.linears import (
    CPUW4A8Linear, MarlinLinear, ReferenceW4A8Linear, ReferenceWNA16Linear)
from jax_moeq.oracle import base
from jax_moeq.oracle.linear import (
    LinearConfig, W4A8LinearBackend, WNA16LinearBackend, _get_priority_backends,
    backend_to_kernel_cls, linear_weight_key, map_w4a8_linear_backend, map_wna16_linear_backend,
    select_linear_backend)

needs_cpu_kernel = pytest.mark.skipif(not _ffi.cpu_library_available(),
                                      reason="the CPU library jax_moeq._cpu_ffi is not built")


def _cfg(**kw) -> LinearConfig:
  args = dict(in_features=256, out_features=128, in_dtype=jnp.bfloat16, platform="cpu")
  args.update(kw)
  return LinearConfig(**args)


def test_priorities_per_platform():
  assert _get_priority_backends("w4a8_int8", _cfg()) == [W4A8LinearBackend.CPU_W4A8,
                                                         W4A8LinearBackend.REFERENCE]
  assert _get_priority_backends("w4a8_int8", _cfg(platform="cuda")) == [
      W4A8LinearBackend.REFERENCE]
  assert _get_priority_backends("wna16", _cfg(platform="cuda")) == [
      WNA16LinearBackend.MARLIN, WNA16LinearBackend.REFERENCE]
  assert _get_priority_backends("wna16", _cfg()) == [WNA16LinearBackend.CPU_W4A8,
                                                     WNA16LinearBackend.REFERENCE]
  assert _get_priority_backends("wna16", _cfg(platform="tpu")) == [WNA16LinearBackend.REFERENCE]
  assert backend_to_kernel_cls(WNA16LinearBackend.CPU_W4A8) == [CPUW4A8Linear]
  assert backend_to_kernel_cls(WNA16LinearBackend.MARLIN) == [MarlinLinear]
  assert backend_to_kernel_cls(W4A8LinearBackend.REFERENCE) == [ReferenceW4A8Linear]
  assert backend_to_kernel_cls(WNA16LinearBackend.REFERENCE) == [ReferenceWNA16Linear]


@needs_cpu_kernel
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_w4a8_on_cpu_picks_the_kernel(group):
  backend, cls = select_linear_backend("w4a8_int8", _cfg(), linear_weight_key("w4a8_int8", group))
  assert (backend, cls) == (W4A8LinearBackend.CPU_W4A8, CPUW4A8Linear)
  assert cls.backend_name == "cpu_w4a8"


@needs_cpu_kernel
def test_wna16_on_cpu_needs_activation_quantization_for_the_kernel(caplog, monkeypatch):
  monkeypatch.setattr(base, "_LOGGED", set())  # log_once: messages seen by earlier tests
  key = linear_weight_key("wna16", 128)
  with caplog.at_level(logging.WARNING, logger="jax_moeq.oracle"):
    backend, cls = select_linear_backend("wna16", _cfg(), key)
  assert (backend, cls) == (WNA16LinearBackend.REFERENCE, ReferenceWNA16Linear)
  # The warning says why the kernel was passed over.
  assert "REFERENCE (pure jax.numpy) WNA16 linear backend" in caplog.text
  assert "allow_activation_quantization=True" in caplog.text
  backend, cls = select_linear_backend("wna16", _cfg(allow_activation_quantization=True), key)
  assert (backend, cls) == (WNA16LinearBackend.CPU_W4A8, CPUW4A8Linear)
  # Zero points (AWQ) have no W4A8 kernel: the reference runs them.
  zp = linear_weight_key("wna16", 128, has_zero_points=True)
  backend, _ = select_linear_backend("wna16", _cfg(allow_activation_quantization=True), zp)
  assert backend == WNA16LinearBackend.REFERENCE


def test_gpu_platform_without_library_falls_back_to_reference():
  # No CUDA device here: MARLIN is rejected with its reason, the reference runs.
  backend, cls = select_linear_backend("wna16", _cfg(platform="cuda"),
                                       linear_weight_key("wna16", 64))
  if MarlinLinear.is_supported_config(_cfg(platform="cuda"),
                                      linear_weight_key("wna16", 64))[0]:
    assert backend == WNA16LinearBackend.MARLIN
  else:
    assert (backend, cls) == (WNA16LinearBackend.REFERENCE, ReferenceWNA16Linear)
  backend, _ = select_linear_backend("w4a8_int8", _cfg(platform="cuda"),
                                     linear_weight_key("w4a8_int8", 64))
  assert backend == W4A8LinearBackend.REFERENCE


@pytest.mark.parametrize("cfg, reason", [
    (dict(out_features=120), "out_features=120 and in_features=256 must be multiples of 16"),
    (dict(in_features=200), "does not divide in_features=200"),
    (dict(platform="cuda"), "does not run on platform 'cuda'"),
    (dict(in_dtype=jnp.float64), "does not support float64 activations"),
])
def test_explicit_kernel_that_does_not_fit_raises_with_the_reason(cfg, reason):
  key = linear_weight_key("w4a8_int8", 64)
  with pytest.raises(ValueError) as e:
    select_linear_backend("w4a8_int8", _cfg(backend="cpu_w4a8", **cfg), key)
  msg = str(e.value)
  assert msg.startswith("W4A8 Int8 linear backend CPU_W4A8 does not support the deployment "
                        "configuration since ")
  assert reason in msg


def test_explicit_wna16_on_the_w4a8_kernel_without_permission():
  with pytest.raises(ValueError, match="WNA16 linear backend CPU_W4A8 does not support .* "
                                       "allow_activation_quantization=True"):
    select_linear_backend("wna16", _cfg(backend="cpu"), linear_weight_key("wna16", 128))


def test_explicit_marlin_off_gpu_and_explicit_reference():
  with pytest.raises(ValueError, match="WNA16 linear backend MARLIN does not support the "
                                       "deployment configuration since the kernel does not run "
                                       "on platform 'cpu'"):
    select_linear_backend("wna16", _cfg(backend="marlin"), linear_weight_key("wna16", 128))
  assert select_linear_backend("wna16", _cfg(backend="reference"),
                               linear_weight_key("wna16", 128)) == (
                                   WNA16LinearBackend.REFERENCE, ReferenceWNA16Linear)
  assert select_linear_backend("w4a8_int8", _cfg(backend="jnp"),
                               linear_weight_key("w4a8_int8", 128)) == (
                                   W4A8LinearBackend.REFERENCE, ReferenceW4A8Linear)


def test_unknown_names_list_the_choices():
  with pytest.raises(ValueError, match=r"backend='tpu_magic' is not supported for W4A8 Int8 "
                                       r"linear\. Expected one of \['auto', 'cpu'"):
    map_w4a8_linear_backend("tpu_magic")
  with pytest.raises(ValueError, match="'marlin'"):
    map_wna16_linear_backend("nope")
  with pytest.raises(ValueError, match=r"scheme='int8' is not one of \('w4a8_int8', 'wna16'\)"):
    select_linear_backend("int8", _cfg(), None)
  with pytest.raises(ValueError, match="zero points are not supported"):
    linear_weight_key("w4a8_int8", 128, has_zero_points=True)


def test_nothing_fits_raises_not_implemented():
  # float64 activations: neither the kernel nor the reference takes them.
  with pytest.raises(NotImplementedError) as e:
    select_linear_backend("w4a8_int8", _cfg(in_dtype=jnp.float64),
                          linear_weight_key("w4a8_int8", 128))
  msg = str(e.value)
  assert msg.startswith("No W4A8 Int8 linear backend supports the deployment configuration")
  assert "CPU_W4A8:" in msg and "REFERENCE:" in msg
  # A weight key of the other scheme fits no class of this one.
  with pytest.raises(NotImplementedError, match="quantization scheme"):
    select_linear_backend("w4a8_int8", _cfg(), base.kMxInt4StaticGroup32)


def test_config_validation():
  with pytest.raises(ValueError, match="in_features must be a positive int"):
    LinearConfig(0, 16)
  with pytest.raises(ValueError, match="in_dtype must be a float dtype"):
    LinearConfig(16, 16, jnp.int8)
  with pytest.raises(TypeError, match="backend must be a str"):
    LinearConfig(16, 16, backend=3)
  assert LinearConfig(16, 16, platform="CPU", backend=" Reference ") == LinearConfig(
      16, 16, platform="cpu", backend="reference")
