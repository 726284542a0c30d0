// FFI binding of the CPU W4A8 fused MoE: decode buffers and attributes,
// validate, dispatch into csrc/cpu. Knows nothing of the kernel's insides.
#include <string>

#include "cpu/cpu_isa.h"
#include "cpu/w4a8_moe.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_parallel.h"

namespace ffi = xla::ffi;

namespace jax_moeq::ffi_cpu {
namespace {

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_moeq_w4a8_moe_cpu: " + message);
}

// The op; `residual` (nullable) is added to the result in the kernel's combine.
ffi::Error W4A8MoeRun(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                      ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::U8> w13_packed,
                      ffi::Buffer<ffi::U8> w2_packed, ffi::Result<ffi::AnyBuffer> out,
                      int64_t hidden_size, int64_t intermediate_size, int64_t group_size,
                      bool apply_router_weight_on_input, int64_t activation_kind,
                      const ffi::AnyBuffer* residual) {
  cpu::W4A8MoeProblem p{};
  switch (x.element_type()) {
    case ffi::F32: p.dtype = cpu::ElementType::kF32; break;
    case ffi::BF16: p.dtype = cpu::ElementType::kBF16; break;
    case ffi::F16: p.dtype = cpu::ElementType::kF16; break;
    default: return Invalid("x must be float32, bfloat16 or float16");
  }
  if (out->element_type() != x.element_type()) return Invalid("output dtype differs from x");
  const auto x_dims = x.dimensions();
  const auto id_dims = topk_ids.dimensions();
  const auto w_dims = topk_weights.dimensions();
  const auto w13_dims = w13_packed.dimensions();
  const auto w2_dims = w2_packed.dimensions();
  const auto out_dims = out->dimensions();
  if (x_dims.size() != 2) return Invalid("x must be 2-D [tokens, hidden]");
  if (id_dims.size() != 2 || id_dims[0] != x_dims[0]) {
    return Invalid("topk_ids must be [tokens, top_k] with tokens matching x");
  }
  if (w_dims.size() != 2 || w_dims[0] != id_dims[0] || w_dims[1] != id_dims[1]) {
    return Invalid("topk_weights must have the shape of topk_ids");
  }
  if (w13_dims.size() != 2 || w2_dims.size() != 2) {
    return Invalid("w13_packed and w2_packed must be 2-D [experts, bytes]");
  }
  if (w13_dims[0] != w2_dims[0]) {
    return Invalid("w13_packed has " + std::to_string(w13_dims[0]) + " experts, w2_packed " +
                   std::to_string(w2_dims[0]));
  }
  if (x_dims[1] != hidden_size) {
    return Invalid("x has hidden size " + std::to_string(x_dims[1]) + ", attribute says " +
                   std::to_string(hidden_size));
  }
  if (out_dims.size() != 2 || out_dims[0] != x_dims[0] || out_dims[1] != x_dims[1]) {
    return Invalid("output must have the shape of x");
  }
  if (residual != nullptr) {
    if (residual->element_type() != x.element_type()) {
      return Invalid("residual dtype differs from x");
    }
    const auto r_dims = residual->dimensions();
    if (r_dims.size() != 2 || r_dims[0] != x_dims[0] || r_dims[1] != x_dims[1]) {
      return Invalid("residual must have the shape of x");
    }
    p.residual = residual->untyped_data();
  }
  p.x = x.untyped_data();
  p.out = out->untyped_data();
  p.topk_ids = topk_ids.typed_data();
  p.topk_weights = topk_weights.typed_data();
  p.w13_packed = w13_packed.typed_data();
  p.w2_packed = w2_packed.typed_data();
  p.tokens = x_dims[0];
  p.top_k = id_dims[1];
  p.experts = w13_dims[0];
  p.hidden = hidden_size;
  p.intermediate = intermediate_size;
  p.group_size = group_size;
  p.apply_router_weight_on_input = apply_router_weight_on_input;
  p.activation = static_cast<cpu::ActivationKind>(activation_kind);
  std::string error = cpu::ValidateW4A8MoeShapes(p, w13_dims[1], w2_dims[1]);
  if (!error.empty()) return Invalid(error);
  const cpu::Isa isa = cpu::SelectIsa(&error);
  if (!error.empty()) return Invalid(error);
  const cpu::ParallelFor parallel_for = ParallelForFromEnv(pool, &error);
  if (!error.empty()) return Invalid(error);
  error = cpu::RunW4A8Moe(p, isa, parallel_for);
  if (!error.empty()) return Invalid(error);
  return ffi::Error::Success();
}

ffi::Error W4A8MoeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                       ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::U8> w13_packed,
                       ffi::Buffer<ffi::U8> w2_packed, ffi::Result<ffi::AnyBuffer> out,
                       int64_t hidden_size, int64_t intermediate_size, int64_t group_size,
                       bool apply_router_weight_on_input, int64_t activation_kind) {
  return W4A8MoeRun(pool, x, topk_ids, topk_weights, w13_packed, w2_packed, out, hidden_size,
                    intermediate_size, group_size, apply_router_weight_on_input,
                    activation_kind, nullptr);
}

}  // namespace
}  // namespace jax_moeq::ffi_cpu

namespace jax_moeq::ffi_cpu {
namespace {

// The same op writing into a caller-provided buffer (aliased to the output):
// tests pass a NaN-filled one to prove every element is written.
ffi::Error W4A8MoeIntoImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                           ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::U8> w13_packed,
                           ffi::Buffer<ffi::U8> w2_packed, ffi::AnyBuffer /*aliased out*/,
                           ffi::Result<ffi::AnyBuffer> out, int64_t hidden_size,
                           int64_t intermediate_size, int64_t group_size,
                           bool apply_router_weight_on_input, int64_t activation_kind) {
  return W4A8MoeImpl(pool, x, topk_ids, topk_weights, w13_packed, w2_packed, out, hidden_size,
                     intermediate_size, group_size, apply_router_weight_on_input,
                     activation_kind);
}

// out = residual + moe(x), the residual added in the combine (plain and aliased forms).
ffi::Error W4A8MoeResidualImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::F32> topk_weights,
                               ffi::Buffer<ffi::U8> w13_packed, ffi::Buffer<ffi::U8> w2_packed,
                               ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> out,
                               int64_t hidden_size, int64_t intermediate_size, int64_t group_size,
                               bool apply_router_weight_on_input, int64_t activation_kind) {
  return W4A8MoeRun(pool, x, topk_ids, topk_weights, w13_packed, w2_packed, out, hidden_size,
                    intermediate_size, group_size, apply_router_weight_on_input, activation_kind,
                    &residual);
}

ffi::Error W4A8MoeResidualIntoImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
    ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::U8> w13_packed,
    ffi::Buffer<ffi::U8> w2_packed, ffi::AnyBuffer residual, ffi::AnyBuffer /*aliased out*/,
    ffi::Result<ffi::AnyBuffer> out, int64_t hidden_size, int64_t intermediate_size,
    int64_t group_size, bool apply_router_weight_on_input, int64_t activation_kind) {
  return W4A8MoeRun(pool, x, topk_ids, topk_weights, w13_packed, w2_packed, out, hidden_size,
                    intermediate_size, group_size, apply_router_weight_on_input, activation_kind,
                    &residual);
}

auto BindInputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()            // x [T, H]
      .Arg<ffi::Buffer<ffi::S32>>()     // topk_ids [T, K]
      .Arg<ffi::Buffer<ffi::F32>>()     // topk_weights [T, K]
      .Arg<ffi::Buffer<ffi::U8>>()      // w13_packed [E, B13]
      .Arg<ffi::Buffer<ffi::U8>>();     // w2_packed [E, B2]
}

template <typename Binding>
auto BindAttrs(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::AnyBuffer>()   // out [T, H]
      .template Attr<int64_t>("hidden_size")
      .template Attr<int64_t>("intermediate_size")
      .template Attr<int64_t>("group_size")
      .template Attr<bool>("apply_router_weight_on_input")
      .template Attr<int64_t>("activation_kind");
}

}  // namespace
}  // namespace jax_moeq::ffi_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeqW4A8MoeCpu, jax_moeq::ffi_cpu::W4A8MoeImpl,
                              jax_moeq::ffi_cpu::BindAttrs(jax_moeq::ffi_cpu::BindInputs()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMoeqW4A8MoeCpuInto, jax_moeq::ffi_cpu::W4A8MoeIntoImpl,
    jax_moeq::ffi_cpu::BindAttrs(jax_moeq::ffi_cpu::BindInputs().Arg<ffi::AnyBuffer>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMoeqW4A8MoeResidualCpu, jax_moeq::ffi_cpu::W4A8MoeResidualImpl,
    jax_moeq::ffi_cpu::BindAttrs(jax_moeq::ffi_cpu::BindInputs().Arg<ffi::AnyBuffer>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMoeqW4A8MoeResidualCpuInto, jax_moeq::ffi_cpu::W4A8MoeResidualIntoImpl,
    jax_moeq::ffi_cpu::BindAttrs(
        jax_moeq::ffi_cpu::BindInputs().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()));
