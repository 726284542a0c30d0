"""Backend selection (SPEC §6): the shared loop of `oracle.base`, the W4A8 Int8 oracle, and the
experts classes' `is_supported_config`."""

import enum
import logging

import jax
import jax.numpy as jnp
import pytest

from jax_moeq import _ffi
from jax_moeq.experts.base import MoEExperts
from jax_moeq.experts.cpu_int4 import CPUExpertsInt4
from jax_moeq.experts.reference import ReferenceExpertsW4A8
from jax_moeq.oracle import base
from jax_moeq.oracle import w4a8_int8
from jax_moeq.ops import w4a8_gpu
from jax_moeq.oracle.base import (
    FusedMoEActivationFormat, MoEActivation, MoEConfig, MoEParallelConfig, RoutingMethodType,
)
from jax_moeq.oracle.w4a8_int8 import W4A8Int8MoeBackend

needs_cpu_library = pytest.mark.skipif(not _ffi.cpu_library_available(),
                                       reason="jax_moeq CPU library not built")
G128 = base.kInt4W4A8StaticGroup128Sym


@pytest.fixture(autouse=True)
def _fresh_log_once():
  # Decisions are logged once per process; each test sees its own.
  base._LOGGED.clear()
  yield


def config(**kw) -> MoEConfig:
  defaults = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
                  platform="cpu", in_dtype=jnp.bfloat16)
  defaults.update(kw)
  return MoEConfig(**defaults)


def select(cfg, weight_key=G128, activation_key=None):
  return w4a8_int8.select_w4a8_int8_moe_backend(cfg, weight_key, activation_key)


# ------------------------------------------------------------------ auto
@needs_cpu_library
@pytest.mark.parametrize("weight_key", base.W4A8_WEIGHT_KEYS, ids=str)
@pytest.mark.parametrize("activation", ["silu", "swiglu", "swigluoai", MoEActivation.SWIGLUSTEP])
@pytest.mark.parametrize("routing_method", [RoutingMethodType.Default,
                                            RoutingMethodType.Renormalize,
                                            RoutingMethodType.RenormalizeNaive])
def test_auto_on_cpu_picks_the_kernel(weight_key, activation, routing_method, caplog):
  cfg = config(activation=activation, routing_method=routing_method)
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    backend, cls = select(cfg, weight_key)
  assert (backend, cls) == (W4A8Int8MoeBackend.CPU_INT4, CPUExpertsInt4)
  assert "Using CPU_INT4 W4A8 Int8 MoE backend" in caplog.text


@needs_cpu_library
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_auto_accepts_every_kernel_dtype_and_the_int8_activation_key(dtype):
  backend, _ = select(config(in_dtype=dtype), G128, base.kInt8DynamicTokenAsym)
  assert backend == W4A8Int8MoeBackend.CPU_INT4


# (config overrides, weight key, phrase in the reason): each keeps CPU_INT4 out.
KERNEL_MISFITS = [
    (dict(routing_method=RoutingMethodType.DeepSeekV3), G128, "routing method DeepSeekV3"),
    (dict(routing_method=RoutingMethodType.Llama4, top_k=1), G128, "routing method Llama4"),
    (dict(routing_method=RoutingMethodType.Sigmoid), G128, "routing method Sigmoid"),
    (dict(hidden_size=72), base.kInt4W4A8StaticGroupSym, "H=72 and I=128 must be multiples of 16"),
    (dict(intermediate_size=40), base.kInt4W4A8StaticGroupSym, "must be multiples of 16"),
    (dict(intermediate_size=48), base.kInt4W4A8StaticGroup32Sym,
     "group_size=32 does not divide H=256 and I=48"),
    (dict(in_dtype=jnp.float64), G128, "float64 input/output dtype"),
    (dict(parallel_config=MoEParallelConfig(ep_size=2, ep_rank=1)), G128, "ep_size=2"),
    (dict(parallel_config=MoEParallelConfig(tp_size=2)), G128, "tp_size=2"),
    (dict(has_expert_map=True), G128, "expert map"),
    (dict(router_logits_dtype=jnp.int32), G128, "router logits of dtype int32"),
    (dict(platform="cuda"), G128, "platform 'cuda'"),
]


@needs_cpu_library
@pytest.mark.parametrize("overrides, weight_key, phrase", KERNEL_MISFITS)
def test_explicit_cpu_backend_that_does_not_fit_raises_with_the_reason(overrides, weight_key,
                                                                       phrase):
  for name in ("cpu", "cpu_int4", "CPU_INT4"):
    with pytest.raises(ValueError) as err:
      select(config(moe_backend=name, **overrides), weight_key)
    message = str(err.value)
    assert message.startswith("W4A8 Int8 MoE backend CPU_INT4 does not support the deployment "
                              "configuration since ")
    assert phrase in message


@needs_cpu_library
@pytest.mark.parametrize("overrides, weight_key, phrase",
                         [m for m in KERNEL_MISFITS if "dtype" not in m[2]
                          and "divide" not in m[2] and "ep_size" not in m[2]
                          and "tp_size" not in m[2] and "expert map" not in m[2]])
def test_auto_falls_back_to_the_reference_and_says_why(overrides, weight_key, phrase, caplog):
  if overrides.get("platform") == "cuda" and w4a8_gpu.w4a8_gpu_available():
    pytest.skip("the GPU W4A8 kernel fits this config on this machine (test_w4a8_gpu.py)")
  with caplog.at_level(logging.DEBUG, logger="jax_moeq.oracle"):
    backend, cls = select(config(**overrides), weight_key)
  assert (backend, cls) == (W4A8Int8MoeBackend.REFERENCE, ReferenceExpertsW4A8)
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1
  assert "REFERENCE" in warnings[0].message and "no faster backend fits" in warnings[0].message
  if overrides.get("platform") == "cuda":
    # CPU_INT4 is not even a candidate there; CUDA_W4A8 is, and the warning gives its reason
    # (no Hopper GPU or no CUDA library on this machine).
    assert "CUDA_W4A8: " in warnings[0].message
  else:
    assert "CPU_INT4: " in warnings[0].message and phrase in warnings[0].message
    debug = [r.message for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("CPU_INT4 does not support the deployment configuration since" in m and phrase in m
               for m in debug)


def test_the_warning_is_logged_once(caplog):
  cfg = config(platform="cuda")
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    for _ in range(3):
      select(cfg)
  assert sum("REFERENCE" in r.message for r in caplog.records) == 1


def test_cuda_platform_explicit_cpu_raises():
  with pytest.raises(ValueError, match="CPU_INT4 .* since the kernel does not run on platform "
                     "'cuda'"):
    select(config(platform="gpu", moe_backend="cpu"))


# ------------------------------------------------------------------ explicit reference
@pytest.mark.parametrize("name", ["reference", "jnp", "Reference"])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_explicit_reference(name, platform, caplog):
  with caplog.at_level(logging.INFO, logger="jax_moeq.oracle"):
    backend, cls = select(config(moe_backend=name, platform=platform,
                                 routing_method=RoutingMethodType.DeepSeekV3))
  assert (backend, cls) == (W4A8Int8MoeBackend.REFERENCE, ReferenceExpertsW4A8)
  assert "was requested" in caplog.text


def test_explicit_reference_that_does_not_fit_raises():
  with pytest.raises(ValueError, match="REFERENCE does not support .* since .*GELU"):
    select(config(moe_backend="reference", activation="gelu"))


def test_unknown_backend_name_lists_the_choices():
  with pytest.raises(ValueError, match=r"moe_backend='marlin' is not supported for W4A8 Int8 MoE"
                     r"\. Expected one of \['auto', 'cpu', 'cpu_int4', 'cuda', 'cuda_w4a8', 'gpu', "
                     r"'reference', 'jnp'\]"):
    select(config(moe_backend="marlin"))
  assert w4a8_int8.map_w4a8_int8_backend("cpu") == W4A8Int8MoeBackend.CPU_INT4
  assert w4a8_int8.map_w4a8_int8_backend("jnp") == W4A8Int8MoeBackend.REFERENCE


# ------------------------------------------------------------------ nothing fits
@pytest.mark.parametrize("overrides, weight_key, phrase", [
    (dict(activation="gelu"), G128, "the GELU activation"),
    (dict(activation="relu2_no_mul"), G128, "gated (act-and-mul) activation"),
    (dict(), base.kUint4b8StaticGroup128Sym, "quantization scheme"),
    (dict(), base.kMxInt4StaticGroup32, "quantization scheme"),
    (dict(intermediate_size=48), base.kInt4W4A8StaticGroup32Sym, "does not divide"),
    (dict(parallel_config=MoEParallelConfig(use_batched_activation_format=True)), G128,
     "BatchedExperts"),
    (dict(has_expert_map=True), G128, "expert map"),
])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_nothing_fits_raises_not_implemented(overrides, weight_key, phrase, platform):
  with pytest.raises(NotImplementedError) as err:
    select(config(platform=platform, **overrides), weight_key)
  message = str(err.value)
  assert message.startswith("No W4A8 Int8 MoE backend supports the deployment configuration")
  assert "REFERENCE: " in message and phrase in message
  assert ("CPU_INT4: " in message) == (platform == "cpu")


# ------------------------------------------------------------------ experts classes directly
def test_is_supported_config_reasons_in_check_order():
  cfg = config(platform="cuda", activation="gelu")
  ok, reason = CPUExpertsInt4.is_supported_config(cfg, G128, None,
                                                  FusedMoEActivationFormat.Standard)
  assert not ok and "platform 'cuda'" in reason  # device is checked first
  ok, reason = ReferenceExpertsW4A8.is_supported_config(cfg, G128, None)
  assert not ok and "GELU" in reason
  ok, reason = ReferenceExpertsW4A8.is_supported_config(config(platform="tpu"), G128, None)
  assert ok and reason is None
  ok, reason = ReferenceExpertsW4A8.is_supported_config(config(), G128, base.kMxInt4StaticGroup32)
  assert not ok and "activation=mxint4" in reason


def test_priority_backends_by_platform():
  assert w4a8_int8._get_priority_backends(config(platform="cpu")) == [
      W4A8Int8MoeBackend.CPU_INT4, W4A8Int8MoeBackend.REFERENCE]
  assert w4a8_int8._get_priority_backends(config(platform="cuda")) == [
      W4A8Int8MoeBackend.CUDA_W4A8, W4A8Int8MoeBackend.REFERENCE]
  assert w4a8_int8._get_priority_backends(config(platform="tpu")) == [
      W4A8Int8MoeBackend.REFERENCE]
  assert w4a8_int8.backend_to_kernel_cls(W4A8Int8MoeBackend.CPU_INT4) == [CPUExpertsInt4]
  assert w4a8_int8.backend_to_kernel_cls(W4A8Int8MoeBackend.REFERENCE) == [ReferenceExpertsW4A8]


# ------------------------------------------------------------------ the generic loop
class _ToyBackend(enum.Enum):
  FAST = "FAST"
  SLOWER = "SLOWER"
  REFERENCE = "REFERENCE"


def _toy_experts(name, fits_group):
  class Toy(MoEExperts):
    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key):
      return weight_key.group_size in fits_group

    def apply_routed(self, *args, **kw):
      raise NotImplementedError

  Toy.__name__ = name
  return Toy


_TOY_CLASSES = {
    _ToyBackend.FAST: [_toy_experts("FastA", (32,)), _toy_experts("FastB", (64,))],
    _ToyBackend.SLOWER: [_toy_experts("Slower", (64, 128))],
    _ToyBackend.REFERENCE: [_toy_experts("Ref", (32, 64, 128, -1))],
}


def _toy_select(cfg, group_size):
  mapping = {"fast": _ToyBackend.FAST, "slower": _ToyBackend.SLOWER,
             "reference": _ToyBackend.REFERENCE}
  return base.select_backend(
      "Toy", cfg, base.w4a8_weight_key(group_size), None, list(_ToyBackend),
      lambda b: _TOY_CLASSES[b], lambda name: base.map_backend_name("Toy", name, mapping))


def test_generic_select_tries_classes_then_backends_in_order(caplog):
  assert _toy_select(config(), 32) == (_ToyBackend.FAST, _TOY_CLASSES[_ToyBackend.FAST][0])
  assert _toy_select(config(), 64) == (_ToyBackend.FAST, _TOY_CLASSES[_ToyBackend.FAST][1])
  assert _toy_select(config(), 128) == (_ToyBackend.SLOWER, _TOY_CLASSES[_ToyBackend.SLOWER][0])
  with caplog.at_level(logging.DEBUG, logger="jax_moeq.oracle"):
    assert _toy_select(config(), -1)[0] == _ToyBackend.REFERENCE
  assert "Toy MoE backend FAST does not support" in caplog.text
  assert "Toy MoE backend SLOWER does not support" in caplog.text
  assert "Using the REFERENCE (pure jax.numpy) Toy MoE backend" in caplog.text
  with pytest.raises(ValueError, match="Toy MoE backend SLOWER .* since .*int4_w4a8_group32_sym"):
    _toy_select(config(moe_backend="slower"), 32)
  with pytest.raises(ValueError, match=r"Expected one of \['auto', 'fast', 'slower', 'reference'\]"):
    _toy_select(config(moe_backend="fastest"), 32)


# ------------------------------------------------------------------ small types
def test_activation_from_str_and_kernel_kind():
  assert MoEActivation.from_str("silu") is MoEActivation.SILU
  assert MoEActivation.from_str("SwiGLU") is MoEActivation.SWIGLUSTEP
  assert MoEActivation.from_str("swiglu_oai") is MoEActivation.SWIGLUOAI
  assert MoEActivation.from_str("swigluoai") is MoEActivation.SWIGLUOAI
  assert [a.kernel_kind for a in (MoEActivation.SWIGLUSTEP, MoEActivation.SWIGLUOAI,
                                  MoEActivation.SILU)] == [0, 1, 2]
  with pytest.raises(ValueError, match="activation='tanh' is not one of"):
    MoEActivation.from_str("tanh")
  with pytest.raises(TypeError, match="activation must be a str"):
    MoEActivation.from_str(3)
  with pytest.raises(ValueError, match="GELU has no kernel activation kind"):
    MoEActivation.GELU.kernel_kind
  assert not MoEActivation.RELU2_NO_MUL.is_act_and_mul and MoEActivation.SILU.is_act_and_mul


def test_quant_keys():
  assert [base.w4a8_weight_key(g) for g in (32, 64, 128, -1)] == list(base.W4A8_WEIGHT_KEYS)
  assert base.kInt4W4A8StaticGroupSym.group_size == -1
  assert base.kInt4W4A8StaticGroupSym.scale_dtype == "float32"
  assert base.kInt4W4A8StaticGroup64Sym.scale_dtype == "bfloat16"
  assert base.kInt4W4A8StaticGroupSym is base.kInt4W4A8StaticChannelSym
  assert base.wna16_weight_key(128) == base.kUint4b8StaticGroup128Sym
  assert base.wna16_weight_key(-1, has_zero_points=True) == base.kUint4StaticChannelZp
  assert base.kUint4StaticGroup32Zp.has_zero_points
  assert not base.kUint4b8StaticGroup32Sym.has_zero_points
  assert base.kMxInt4StaticGroup32.group_size == 32
  assert len(set(base.W4A8_WEIGHT_KEYS + base.WNA16_WEIGHT_KEYS + base.MXINT4_WEIGHT_KEYS)) == 13
  with pytest.raises(ValueError, match="group_size=16 is not one of"):
    base.w4a8_weight_key(16)


def test_quant_config():
  make = w4a8_int8.make_w4a8_int8_moe_quant_config
  assert make().group_size == -1 and make((-1, 1)).group_size == -1
  assert make((1, 64)).group_size == 64
  assert make((1, 64)).weight_key == base.kInt4W4A8StaticGroup64Sym
  assert make().activation_quant == "int8_dynamic_token"
  with pytest.raises(ValueError, match="block_shape must be"):
    make((2, 64))
  with pytest.raises(ValueError, match="group_size=48 is not one of"):
    make((1, 48))


def test_moe_config_normalizes_and_validates():
  a = config(activation="silu", routing_method=4, in_dtype="bfloat16", moe_backend=" CPU ")
  b = config(activation=MoEActivation.SILU, routing_method=RoutingMethodType.RenormalizeNaive)
  assert a.activation is MoEActivation.SILU and a.moe_backend == "cpu"
  assert a.routing_method is RoutingMethodType.RenormalizeNaive
  assert hash(b) == hash(config(activation="silu", routing_method=4))
  assert a.moe_parallel_config == a.parallel_config == MoEParallelConfig()
  assert a.activation_format == FusedMoEActivationFormat.Standard
  assert config(platform=None).platform == base.normalize_platform(jax.default_backend())
  with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
    config(top_k=9)
  with pytest.raises(ValueError, match="hidden_size must be a positive int"):
    config(hidden_size=0)
  with pytest.raises(ValueError, match="routing_method=42 is not a RoutingMethodType"):
    config(routing_method=42)
  with pytest.raises(ValueError, match="platform='npu' is not one of"):
    config(platform="npu")
  with pytest.raises(ValueError, match=r"ep_rank=2 must be in \[0, ep_size=2\)"):
    MoEParallelConfig(ep_size=2, ep_rank=2)


def test_detect_platform_and_routing_method_for():
  # A concrete array says where it lives, whatever JAX's default backend is (a GPU host too).
  on_cpu = jax.device_put(jnp.ones(3), jax.devices("cpu")[0])
  assert base.detect_platform(on_cpu) == "cpu"
  assert base.detect_platform(jnp.ones(3)) == base.normalize_platform(jax.default_backend())
  seen = []
  jax.jit(lambda v: seen.append(base.detect_platform(v)) or v)(jnp.ones(3))
  assert seen == [base.normalize_platform(jax.default_backend())]
  rm = base.routing_method_for
  assert rm(renormalize=True) == RoutingMethodType.RenormalizeNaive
  assert rm(renormalize=False) == RoutingMethodType.Default
  assert rm(renormalize=True, scoring_func="sigmoid") == RoutingMethodType.SigmoidRenorm
  assert rm(renormalize=False, use_grouped_topk=True) == RoutingMethodType.DeepSeekV3
  with pytest.raises(ValueError, match="scoring_func='relu'"):
    rm(renormalize=True, scoring_func="relu")
