// FFI binding of the CPU W4A8 dense linear: decode buffers and attributes, validate, dispatch
// into csrc/cpu. Knows nothing of the kernel's insides.
#include <string>

#include "cpu/cpu_isa.h"
#include "cpu/w4a8_linear.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_parallel.h"

namespace ffi = xla::ffi;

namespace jax_moeq::ffi_cpu {
namespace {

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_moeq_w4a8_linear_cpu: " + message);
}

ffi::Error W4A8LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w_packed,
                          ffi::Result<ffi::AnyBuffer> out, int64_t in_features,
                          int64_t out_features, int64_t group_size) {
  cpu::W4A8LinearProblem p{};
  switch (x.element_type()) {
    case ffi::F32: p.dtype = cpu::ElementType::kF32; break;
    case ffi::BF16: p.dtype = cpu::ElementType::kBF16; break;
    case ffi::F16: p.dtype = cpu::ElementType::kF16; break;
    default: return Invalid("x must be float32, bfloat16 or float16");
  }
  if (w_packed.element_type() != ffi::U8) return Invalid("w_packed must be uint8");
  if (out->element_type() != x.element_type()) return Invalid("output dtype differs from x");
  const auto x_dims = x.dimensions();
  const auto w_dims = w_packed.dimensions();
  const auto out_dims = out->dimensions();
  if (x_dims.size() != 2) {
    return Invalid("x must be 2-D [rows, in_features], got rank " +
                   std::to_string(x_dims.size()));
  }
  if (w_dims.size() != 1) {
    return Invalid("w_packed must be 1-D [bytes], got rank " + std::to_string(w_dims.size()));
  }
  if (x_dims[1] != in_features) {
    return Invalid("x has in_features " + std::to_string(x_dims[1]) + ", attribute says " +
                   std::to_string(in_features));
  }
  if (out_dims.size() != 2 || out_dims[0] != x_dims[0] || out_dims[1] != out_features) {
    return Invalid("output must be [rows, out_features] = [" + std::to_string(x_dims[0]) +
                   ", " + std::to_string(out_features) + "]");
  }
  p.x = x.untyped_data();
  p.out = out->untyped_data();
  p.w_packed = static_cast<const uint8_t*>(w_packed.untyped_data());
  p.rows = x_dims[0];
  p.in_features = in_features;
  p.out_features = out_features;
  p.group_size = group_size;
  std::string error = cpu::ValidateW4A8LinearShapes(p, w_dims[0]);
  if (!error.empty()) return Invalid(error);
  const cpu::Isa isa = cpu::SelectIsa(&error);
  if (!error.empty()) return Invalid(error);
  const cpu::ParallelFor parallel_for = ParallelForFromEnv(pool, &error);
  if (!error.empty()) return Invalid(error);
  error = cpu::RunW4A8Linear(p, isa, parallel_for);
  if (!error.empty()) return Invalid(error);
  return ffi::Error::Success();
}

// The same op writing into a caller-provided buffer (aliased to the output): tests pass a
// NaN-filled one to prove every element is written.
ffi::Error W4A8LinearIntoImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w_packed,
                              ffi::AnyBuffer /*aliased out*/, ffi::Result<ffi::AnyBuffer> out,
                              int64_t in_features, int64_t out_features, int64_t group_size) {
  return W4A8LinearImpl(pool, x, w_packed, out, in_features, out_features, group_size);
}

auto BindInputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()    // x [M, K]
      .Arg<ffi::AnyBuffer>();   // w_packed [B] u8 (checked in the handler, with a message)
}

template <typename Binding>
auto BindAttrs(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::AnyBuffer>()   // out [M, N]
      .template Attr<int64_t>("in_features")
      .template Attr<int64_t>("out_features")
      .template Attr<int64_t>("group_size");
}

}  // namespace
}  // namespace jax_moeq::ffi_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeqW4A8LinearCpu, jax_moeq::ffi_cpu::W4A8LinearImpl,
                              jax_moeq::ffi_cpu::BindAttrs(jax_moeq::ffi_cpu::BindInputs()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMoeqW4A8LinearCpuInto, jax_moeq::ffi_cpu::W4A8LinearIntoImpl,
    jax_moeq::ffi_cpu::BindAttrs(jax_moeq::ffi_cpu::BindInputs().Arg<ffi::AnyBuffer>()));
