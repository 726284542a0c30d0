// FFI binding of the GPU WNA16 dense linear: decode buffers and attributes, validate, enqueue the
// launcher of csrc/cuda on XLA's stream.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda/wna16_linear.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda_handler_checks.h"

namespace ffi = xla::ffi;

namespace jax_moeq::ffi_cuda {
namespace {

const TargetChecks kChecks("jax_moeq_wna16_linear_cuda");

ffi::Error Wna16LinearImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer bias,
                           ffi::AnyBuffer perm, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> x_perm, ffi::Result<ffi::AnyBuffer> ws,
                           int64_t in_features, int64_t out_features, int64_t groups,
                           int64_t block_m, int64_t split, int64_t mainloop, bool has_zeros,
                           bool has_bias, bool act_order) {
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.IntAttr("block_m", block_m));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.IntAttr("split", split));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.IntAttr("mainloop", mainloop));
  cuda::Wna16LinearProblem p;
  const char* dtype_name = nullptr;
  switch (x.element_type()) {
    case ffi::BF16: p.dtype = cuda::HalfKind::kBF16; dtype_name = "bfloat16 (x's dtype)"; break;
    case ffi::F16: p.dtype = cuda::HalfKind::kF16; dtype_name = "float16 (x's dtype)"; break;
    default: return kChecks.Invalid("x must be bfloat16 or float16");
  }
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] != in_features) {
    return kChecks.Invalid("x must be [rows, in_features = " + std::to_string(in_features) +
                           "], got " + Dims(xd));
  }
  p.rows = xd[0];
  p.in_features = in_features;
  p.out_features = out_features;
  p.groups = groups;
  p.block_m = static_cast<int>(block_m);
  p.split = static_cast<int>(split);
  p.mainloop = static_cast<int>(mainloop);
  p.has_zeros = has_zeros;
  p.has_bias = has_bias;
  p.act_order = act_order;
  if (std::string err = cuda::ValidateWna16LinearProblem(p); !err.empty()) {
    return kChecks.Invalid(err);
  }

  const int64_t N = out_features, K = in_features, M = p.rows;
  const ffi::DataType dt = x.element_type();
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Buffer("weights", w, ffi::U32, "uint32", {N / 16, K / 64, 32, 4}));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Buffer("scales", scales, dt, dtype_name, {groups, N / 16, 16}));
  if (has_zeros) {
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Buffer("zeros", zeros, dt, dtype_name, {groups, N / 16, 16}));
  }
  if (has_bias) JAX_MOEQ_RETURN_IF_ERROR(kChecks.Buffer("bias", bias, ffi::F32, "float32", {N}));
  if (act_order) JAX_MOEQ_RETURN_IF_ERROR(kChecks.Buffer("perm", perm, ffi::S32, "int32", {K}));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Buffer("output", *out, dt, dtype_name, {M, N}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Scratch("x_perm", *x_perm, dt, cuda::Wna16LinearPermutedRows(p) * K));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Scratch("ws", *ws, ffi::F32, cuda::Wna16LinearWsFloats(p)));

  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.scales = scales.untyped_data();
  p.zeros = zeros.untyped_data();
  p.bias = static_cast<const float*>(bias.untyped_data());
  p.perm = static_cast<const int32_t*>(perm.untyped_data());
  p.out = out->untyped_data();
  p.x_perm = x_perm->untyped_data();
  p.ws = static_cast<float*>(ws->untyped_data());
  if (std::string err = cuda::RunWna16Linear(p, stream); !err.empty()) {
    return kChecks.Internal(err);
  }
  return ffi::Error::Success();
}

// Argument list shared by the plain handler and the one whose output is aliased to an extra
// input (tests poison that input to prove full writes).
auto BindArgs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()   // x [M, K]
      .Arg<ffi::AnyBuffer>()   // weights [N/16, K/64, 32, 4] uint32
      .Arg<ffi::AnyBuffer>()   // scales [G, N/16, 16]
      .Arg<ffi::AnyBuffer>()   // zeros (has_zeros) | placeholder
      .Arg<ffi::AnyBuffer>()   // bias [N] f32 (has_bias) | placeholder
      .Arg<ffi::AnyBuffer>();  // perm [K] int32 (act_order) | placeholder
}

template <typename Binding>
auto BindResultsAndAttrs(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::AnyBuffer>()  // out [M, N]
      .template Ret<ffi::AnyBuffer>()  // x_perm
      .template Ret<ffi::AnyBuffer>()  // ws
      .template Attr<int64_t>("in_features")
      .template Attr<int64_t>("out_features")
      .template Attr<int64_t>("groups")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("split")
      .template Attr<int64_t>("mainloop")
      .template Attr<bool>("has_zeros")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("act_order");
}

ffi::Error Wna16LinearIntoImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer bias,
                               ffi::AnyBuffer perm, ffi::AnyBuffer /*aliased out*/,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> x_perm,
                               ffi::Result<ffi::AnyBuffer> ws, int64_t in_features,
                               int64_t out_features, int64_t groups, int64_t block_m,
                               int64_t split, int64_t mainloop, bool has_zeros, bool has_bias,
                               bool act_order) {
  return Wna16LinearImpl(stream, x, w, scales, zeros, bias, perm, out, x_perm, ws, in_features,
                         out_features, groups, block_m, split, mainloop, has_zeros, has_bias,
                         act_order);
}

}  // namespace
}  // namespace jax_moeq::ffi_cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMoeqWna16LinearCuda, jax_moeq::ffi_cuda::Wna16LinearImpl,
    jax_moeq::ffi_cuda::BindResultsAndAttrs(jax_moeq::ffi_cuda::BindArgs()),
    {ffi::Traits::kCmdBufferCompatible});  // stream-ordered, no host sync: graph-capturable
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMoeqWna16LinearCudaInto, jax_moeq::ffi_cuda::Wna16LinearIntoImpl,
    jax_moeq::ffi_cuda::BindResultsAndAttrs(jax_moeq::ffi_cuda::BindArgs().Arg<ffi::AnyBuffer>()),
    {ffi::Traits::kCmdBufferCompatible});
