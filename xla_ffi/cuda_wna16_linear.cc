// FFI binding of the GPU WNA16 dense linear: decode buffers and attributes, validate, enqueue the
// launcher of csrc/cuda on XLA's stream.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda/wna16_linear.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda_handler_binding.h"
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
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.IntAttrs({{"block_m", block_m}, {"split", split}, {"mainloop", mainloop}}));
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
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.InvalidUnlessEmpty(cuda::ValidateWna16LinearProblem(p)));

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
  return kChecks.InternalUnlessEmpty(cuda::RunWna16Linear(p, stream));
}

// The inputs of the plain handler and of its "_into" twin, in order: x [M, K];
// weights [N/16, K/64, 32, 4] uint32; scales [G, N/16, 16]; zeros (has_zeros) | placeholder;
// bias [N] f32 (has_bias) | placeholder; perm [K] int32 (act_order) | placeholder.
auto BindArgs() { return AddInputs<6>(BindStream()); }

template <typename Binding>
auto BindResultsAndAttrs(Binding binding) {
  // Results, in order: out [M, N], x_perm, ws.
  return AddResults<3>(std::move(binding))
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

}  // namespace
}  // namespace jax_moeq::ffi_cuda

JAX_MOEQ_DEFINE_CUDA_HANDLER_PAIR(JaxMoeqWna16LinearCuda, JaxMoeqWna16LinearCudaInto,
                                  jax_moeq::ffi_cuda::Wna16LinearImpl,
                                  jax_moeq::ffi_cuda::BindArgs,
                                  jax_moeq::ffi_cuda::BindResultsAndAttrs);
