// FFI binding of the GPU W4A8 fused MoE and of its activation quantizer: decode buffers and
// attributes, validate, enqueue the launchers of csrc/cuda on XLA's stream.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda/w4a8_moe.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda_handler_binding.h"
#include "xla_ffi/cuda_handler_checks.h"

namespace ffi = xla::ffi;

namespace jax_moeq::ffi_cuda {
namespace {

const TargetChecks kMoeChecks("jax_moeq_w4a8_moe_cuda");
const TargetChecks kQuantChecks("jax_moeq_w4a8_quantize_rows_cuda");

bool DtypeOf(ffi::DataType t, cuda::W4a8Dtype* out) {
  switch (t) {
    case ffi::F32: *out = cuda::W4a8Dtype::kF32; return true;
    case ffi::BF16: *out = cuda::W4a8Dtype::kBF16; return true;
    case ffi::F16: *out = cuda::W4a8Dtype::kF16; return true;
    default: return false;
  }
}

ffi::Error W4a8MoeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer topk_ids,
                       ffi::AnyBuffer topk_weights, ffi::AnyBuffer w13, ffi::AnyBuffer s13,
                       ffi::AnyBuffer rc13, ffi::AnyBuffer b13, ffi::AnyBuffer w2,
                       ffi::AnyBuffer s2, ffi::AnyBuffer rc2, ffi::AnyBuffer b2,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> sorted_ids,
                       ffi::Result<ffi::AnyBuffer> expert_ids,
                       ffi::Result<ffi::AnyBuffer> num_post_padded,
                       ffi::Result<ffi::AnyBuffer> qx, ffi::Result<ffi::AnyBuffer> x_params,
                       ffi::Result<ffi::AnyBuffer> act, ffi::Result<ffi::AnyBuffer> qact,
                       ffi::Result<ffi::AnyBuffer> act_params, ffi::Result<ffi::AnyBuffer> ws2,
                       int64_t hidden_size, int64_t intermediate_size, int64_t groups13,
                       int64_t groups2, int64_t activation_kind, bool has_bias,
                       bool apply_router_weight_on_input, int64_t block_m) {
  JAX_MOEQ_RETURN_IF_ERROR(
      kMoeChecks.IntAttrs({{"activation_kind", activation_kind}, {"block_m", block_m}}));
  cuda::W4a8MoeProblem p;
  if (!DtypeOf(x.element_type(), &p.dtype)) {
    return kMoeChecks.Invalid("x must be float32, bfloat16 or float16");
  }
  const int64_t H = hidden_size, I = intermediate_size;
  JAX_MOEQ_RETURN_IF_ERROR(kMoeChecks.TokenRows(x, H, &p.tokens));
  JAX_MOEQ_RETURN_IF_ERROR(kMoeChecks.TopK(topk_ids, topk_weights, p.tokens, &p.top_k));
  const auto w13d = w13.dimensions();
  if (w13d.size() != 5) {
    return kMoeChecks.Invalid("w13 must be packed [E, 2I/16, H/128, 32, 8] uint32");
  }
  p.experts = w13d[0];
  p.hidden = H;
  p.intermediate = I;
  p.groups13 = groups13;
  p.groups2 = groups2;
  p.activation = static_cast<int>(activation_kind);
  p.has_bias = has_bias;
  p.weight_on_input = apply_router_weight_on_input;
  p.block_m = block_m;
  JAX_MOEQ_RETURN_IF_ERROR(kMoeChecks.InvalidUnlessEmpty(cuda::ValidateW4a8MoeProblem(p)));
  const int64_t E = p.experts;
  JAX_MOEQ_RETURN_IF_ERROR(
      kMoeChecks.Buffer("w13", w13, ffi::U32, "uint32", {E, 2 * I / 16, H / 128, 32, 8}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kMoeChecks.Buffer("w2", w2, ffi::U32, "uint32", {E, H / 16, I / 128, 32, 8}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kMoeChecks.Buffer("w13_scales", s13, ffi::F32, "float32", {E, 2 * I / 16, groups13, 16}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kMoeChecks.Buffer("w2_scales", s2, ffi::F32, "float32", {E, H / 16, groups2, 16}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kMoeChecks.Buffer("w13_row_corr", rc13, ffi::F32, "float32", {E, 2 * I}));
  JAX_MOEQ_RETURN_IF_ERROR(kMoeChecks.Buffer("w2_row_corr", rc2, ffi::F32, "float32", {E, H}));
  if (has_bias) {
    JAX_MOEQ_RETURN_IF_ERROR(kMoeChecks.Buffer("w13_bias", b13, ffi::F32, "float32", {E, 2 * I}));
    JAX_MOEQ_RETURN_IF_ERROR(kMoeChecks.Buffer("w2_bias", b2, ffi::F32, "float32", {E, H}));
  }
  const int64_t rows = cuda::W4a8MoeRows(p);
  const int64_t in_rows = cuda::W4a8MoeInputRows(p);
  if (out->element_type() != x.element_type()) {
    return kMoeChecks.Invalid("output dtype differs from x");
  }
  if (out->dimensions().size() != 2 || out->dimensions()[0] != p.tokens ||
      out->dimensions()[1] != H) {
    return kMoeChecks.Invalid("output must be [tokens, hidden], got " + Dims(out->dimensions()));
  }
  auto at_least = [](ffi::Result<ffi::AnyBuffer>& b, int64_t n, ffi::DataType t) {
    return b->element_type() == t && static_cast<int64_t>(b->element_count()) >= n;
  };
  if (!at_least(sorted_ids, cuda::W4a8MoeMaxPadded(p), ffi::S32) ||
      !at_least(expert_ids, cuda::W4a8MoeMaxBlocks(p), ffi::S32) ||
      !at_least(num_post_padded, 1, ffi::S32)) {
    return kMoeChecks.Invalid("alignment scratch too small or not int32 (sorted_ids needs " +
                              std::to_string(cuda::W4a8MoeMaxPadded(p)) + ", expert_ids " +
                              std::to_string(cuda::W4a8MoeMaxBlocks(p)) + ")");
  }
  if (!at_least(qx, in_rows * H, ffi::S8) || !at_least(x_params, in_rows * 2, ffi::F32)) {
    return kMoeChecks.Invalid("input quantization scratch must hold " + std::to_string(in_rows) +
                              " rows (int8 [rows, H] and float32 [rows, 2])");
  }
  if (!at_least(act, rows * I, x.element_type()) || !at_least(qact, rows * I, ffi::S8) ||
      !at_least(act_params, rows * 2, ffi::F32)) {
    return kMoeChecks.Invalid(
        "activation scratch must hold T * K rows of I (x's dtype and int8) and float32 [T * K, 2]");
  }
  if (!at_least(ws2, rows * H, x.element_type())) {
    return kMoeChecks.Invalid("ws2 scratch must hold T * K * H elements of x's dtype");
  }

  p.x = x.untyped_data();
  p.topk_ids = static_cast<const int32_t*>(topk_ids.untyped_data());
  p.topk_weights = static_cast<const float*>(topk_weights.untyped_data());
  p.w13 = w13.untyped_data();
  p.s13 = static_cast<const float*>(s13.untyped_data());
  p.rc13 = static_cast<const float*>(rc13.untyped_data());
  p.b13 = static_cast<const float*>(b13.untyped_data());
  p.w2 = w2.untyped_data();
  p.s2 = static_cast<const float*>(s2.untyped_data());
  p.rc2 = static_cast<const float*>(rc2.untyped_data());
  p.b2 = static_cast<const float*>(b2.untyped_data());
  p.out = out->untyped_data();
  p.sorted_ids = static_cast<int32_t*>(sorted_ids->untyped_data());
  p.expert_ids = static_cast<int32_t*>(expert_ids->untyped_data());
  p.num_post_padded = static_cast<int32_t*>(num_post_padded->untyped_data());
  p.qx = static_cast<int8_t*>(qx->untyped_data());
  p.x_params = static_cast<float*>(x_params->untyped_data());
  p.act = act->untyped_data();
  p.qact = static_cast<int8_t*>(qact->untyped_data());
  p.act_params = static_cast<float*>(act_params->untyped_data());
  p.ws2 = ws2->untyped_data();
  return kMoeChecks.InternalUnlessEmpty(cuda::RunW4a8Moe(p, stream));
}

ffi::Error W4a8QuantizeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer> q,
                                ffi::Result<ffi::AnyBuffer> params) {
  cuda::W4a8Dtype dtype;
  if (!DtypeOf(x.element_type(), &dtype)) {
    return kQuantChecks.Invalid("x must be float32, bfloat16 or float16");
  }
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] <= 0) {
    return kQuantChecks.Invalid("x must be [rows, cols], got " + Dims(xd));
  }
  const int64_t rows = xd[0], cols = xd[1];
  if (q->element_type() != ffi::S8 || static_cast<int64_t>(q->element_count()) != rows * cols) {
    return kQuantChecks.Invalid("q must be int8 [rows, cols]");
  }
  if (params->element_type() != ffi::F32 ||
      static_cast<int64_t>(params->element_count()) != rows * 2) {
    return kQuantChecks.Invalid("params must be float32 [rows, 2]");
  }
  return kQuantChecks.InvalidUnlessEmpty(cuda::RunW4a8QuantizeRows(
      dtype, x.untyped_data(), rows, cols, static_cast<int8_t*>(q->untyped_data()),
      static_cast<float*>(params->untyped_data()), stream));
}

// The inputs of the plain handler and of its "_into" twin, in order: x, topk_ids, topk_weights;
// w13, w13_scales, w13_row_corr, w13_bias; w2, w2_scales, w2_row_corr, w2_bias.
auto BindArgs() { return AddInputs<11>(BindStream()); }

template <typename Binding>
auto BindResultsAndAttrs(Binding binding) {
  // Results, in order: out, sorted_ids, expert_ids, num_post_padded, qx, x_params, act, qact,
  // act_params, ws2.
  return AddResults<10>(std::move(binding))
      .template Attr<int64_t>("hidden_size")
      .template Attr<int64_t>("intermediate_size")
      .template Attr<int64_t>("groups13")
      .template Attr<int64_t>("groups2")
      .template Attr<int64_t>("activation_kind")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("apply_router_weight_on_input")
      .template Attr<int64_t>("block_m");
}

}  // namespace
}  // namespace jax_moeq::ffi_cuda

JAX_MOEQ_DEFINE_CUDA_HANDLER_PAIR(JaxMoeqW4a8MoeCuda, JaxMoeqW4a8MoeCudaInto,
                                  jax_moeq::ffi_cuda::W4a8MoeImpl,
                                  jax_moeq::ffi_cuda::BindArgs,
                                  jax_moeq::ffi_cuda::BindResultsAndAttrs);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeqW4a8QuantizeRowsCuda,
                              jax_moeq::ffi_cuda::W4a8QuantizeRowsImpl,
                              jax_moeq::ffi_cuda::BindStream()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Ret<ffi::AnyBuffer>()   // q
                                  .Ret<ffi::AnyBuffer>(),  // params
                              {ffi::Traits::kCmdBufferCompatible});
