// FFI binding of the GPU WNA16 fused MoE: decode buffers and attributes,
// validate, enqueue the launchers of csrc/cuda on XLA's stream.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda/wna16_moe.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda_handler_binding.h"
#include "xla_ffi/cuda_handler_checks.h"

namespace ffi = xla::ffi;

namespace jax_moeq::ffi_cuda {
namespace {

const TargetChecks kChecks("jax_moeq_wna16_moe_cuda");

ffi::Error Wna16MoeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer route_ids,
                        ffi::AnyBuffer route_weights, ffi::AnyBuffer w13, ffi::AnyBuffer s13,
                        ffi::AnyBuffer z13, ffi::AnyBuffer b13, ffi::AnyBuffer w2,
                        ffi::AnyBuffer s2, ffi::AnyBuffer z2, ffi::AnyBuffer b2,
                        ffi::AnyBuffer perm13, ffi::AnyBuffer inv_perm2,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> sorted_ids,
                        ffi::Result<ffi::AnyBuffer> expert_ids,
                        ffi::Result<ffi::AnyBuffer> num_post_padded,
                        ffi::Result<ffi::AnyBuffer> x_perm, ffi::Result<ffi::AnyBuffer> act,
                        ffi::Result<ffi::AnyBuffer> ws13, ffi::Result<ffi::AnyBuffer> ws2,
                        bool batched, int64_t hidden_size, int64_t intermediate_size,
                        int64_t groups13, int64_t groups2, int64_t block_m, int64_t split13,
                        int64_t split2, int64_t activation_kind, bool has_zeros, bool has_bias,
                        bool act_order, int64_t mainloop, bool one_token, bool fused_decode) {
  // Attributes narrowed to int below: out of int32 they are refused, not wrapped (block_m
  // 2^32 + 8 would otherwise pass as 8).
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.IntAttrs({{"block_m", block_m},
                                             {"split13", split13},
                                             {"split2", split2},
                                             {"activation_kind", activation_kind},
                                             {"mainloop", mainloop}}));
  cuda::Wna16MoeProblem p;
  switch (x.element_type()) {
    case ffi::BF16: p.dtype = cuda::HalfKind::kBF16; break;
    case ffi::F16: p.dtype = cuda::HalfKind::kF16; break;
    default: return kChecks.Invalid("x must be bfloat16 or float16");
  }
  const auto xd = x.dimensions();
  p.batched = batched;
  p.hidden = hidden_size;
  p.intermediate = intermediate_size;
  p.groups13 = groups13;
  p.groups2 = groups2;
  p.block_m = static_cast<int>(block_m);
  p.split13 = static_cast<int>(split13);
  p.split2 = static_cast<int>(split2);
  p.activation = static_cast<int>(activation_kind);
  p.has_zeros = has_zeros;
  p.has_bias = has_bias;
  p.act_order = act_order;
  p.mainloop = static_cast<int>(mainloop);
  p.one_token = one_token;
  p.fused_decode = fused_decode;
  const int64_t H = hidden_size, I = intermediate_size;
  const auto w13d = w13.dimensions();
  if (w13d.size() != 5) return kChecks.Invalid("w13 must be packed [E, 2I/16, H/64, 32, 4] uint32");
  p.experts = w13d[0];
  const int64_t E = p.experts;
  if (batched) {
    if (xd.size() != 3 || xd[0] != E || xd[2] != H) {
      return kChecks.Invalid("batched x must be [E, max_tokens, hidden], got " + Dims(xd));
    }
    p.tokens = xd[1];
    p.top_k = 1;
    if (route_ids.element_type() != ffi::S32) {
      return kChecks.Invalid("expert_num_tokens must be int32");
    }
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("expert_num_tokens", route_ids, {E}));
  } else {
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.TokenRows(x, H, &p.tokens));
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.TopK(route_ids, route_weights, p.tokens, &p.top_k));
  }
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.InvalidUnlessEmpty(cuda::ValidateWna16MoeProblem(p)));

  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w13", w13, {E, 2 * I / 16, H / 64, 32, 4}));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w2", w2, {E, H / 16, I / 64, 32, 4}));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w13_scales", s13, {E, groups13, 2 * I / 16, 16}));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w2_scales", s2, {E, groups2, H / 16, 16}));
  if (s13.element_type() != x.element_type() || s2.element_type() != x.element_type()) {
    return kChecks.Invalid("scales must have x's dtype");
  }
  if (has_zeros) {
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w13_zeros", z13, {E, groups13, 2 * I / 16, 16}));
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w2_zeros", z2, {E, groups2, H / 16, 16}));
    if (z13.element_type() != x.element_type() || z2.element_type() != x.element_type()) {
      return kChecks.Invalid("zero points must have x's dtype");
    }
  }
  if (has_bias) {
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w13_bias", b13, {E, 2 * I}));
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w2_bias", b2, {E, H}));
    if (b13.element_type() != ffi::F32 || b2.element_type() != ffi::F32) {
      return kChecks.Invalid("biases must be float32");
    }
  }
  if (act_order) {
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w13_perm", perm13, {E, H}));
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("w2_inv_perm", inv_perm2, {E, I}));
    if (perm13.element_type() != ffi::S32 || inv_perm2.element_type() != ffi::S32) {
      return kChecks.Invalid("act-order permutations must be int32");
    }
  }
  const int64_t rows = cuda::Wna16MoeRows(p);
  if (out->element_type() != x.element_type()) {
    return kChecks.Invalid("output dtype differs from x");
  }
  if (batched) {
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("output", *out, {E, p.tokens, H}));
  } else {
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Shape("output", *out, {p.tokens, H}));
  }
  if (sorted_ids->element_count() < cuda::Wna16MoeMaxPadded(p) ||
      expert_ids->element_count() < cuda::Wna16MoeMaxBlocks(p) ||
      num_post_padded->element_count() < 1) {
    return kChecks.Invalid("alignment scratch too small (sorted_ids needs " +
                           std::to_string(cuda::Wna16MoeMaxPadded(p)) + ", expert_ids " +
                           std::to_string(cuda::Wna16MoeMaxBlocks(p)) + ")");
  }
  if (act->element_count() < rows * I || act->element_type() != x.element_type()) {
    return kChecks.Invalid("act scratch must hold rows * I elements of x's dtype");
  }
  const int64_t perm_rows = cuda::Wna16MoePermutedRows(p);
  if (static_cast<int64_t>(x_perm->element_count()) < perm_rows * H) {
    return kChecks.Invalid("x_perm scratch must hold " + std::to_string(perm_rows * H) +
                           " elements (act-order or block_m 128)");
  }
  if (const int64_t floats = cuda::Wna16MoeWs13Floats(p);
      static_cast<int64_t>(ws13->element_count()) < floats) {
    return kChecks.Invalid("ws13 scratch must hold " + std::to_string(floats) +
                           " floats (rows * 2I, then rows * I / 16 counters at one token) when "
                           "split13 > 1");
  }
  if (static_cast<int64_t>(ws2->element_count()) < cuda::Wna16MoeWs2Floats(p)) {
    return kChecks.Invalid("ws2 scratch must hold rows * H + H / 32 floats");
  }

  p.x = x.untyped_data();
  p.topk_ids = batched ? nullptr : static_cast<const int32_t*>(route_ids.untyped_data());
  p.topk_weights = batched ? nullptr : static_cast<const float*>(route_weights.untyped_data());
  p.expert_num_tokens = batched ? static_cast<const int32_t*>(route_ids.untyped_data()) : nullptr;
  p.w13 = w13.untyped_data();
  p.s13 = s13.untyped_data();
  p.z13 = z13.untyped_data();
  p.b13 = static_cast<const float*>(b13.untyped_data());
  p.w2 = w2.untyped_data();
  p.s2 = s2.untyped_data();
  p.z2 = z2.untyped_data();
  p.b2 = static_cast<const float*>(b2.untyped_data());
  p.perm13 = static_cast<const int32_t*>(perm13.untyped_data());
  p.inv_perm2 = static_cast<const int32_t*>(inv_perm2.untyped_data());
  p.out = out->untyped_data();
  p.sorted_ids = static_cast<int32_t*>(sorted_ids->untyped_data());
  p.expert_ids = static_cast<int32_t*>(expert_ids->untyped_data());
  p.num_post_padded = static_cast<int32_t*>(num_post_padded->untyped_data());
  p.x_perm = x_perm->untyped_data();
  p.act = act->untyped_data();
  p.ws13 = static_cast<float*>(ws13->untyped_data());
  p.ws2 = static_cast<float*>(ws2->untyped_data());
  return kChecks.InternalUnlessEmpty(cuda::RunWna16Moe(p, stream));
}

// The inputs of the plain handler and of its "_into" twin, in order: x;
// topk_ids | expert_num_tokens; topk_weights | unused; w13, w13_scales, w13_zeros, w13_bias;
// w2, w2_scales, w2_zeros, w2_bias; w13_perm, w2_inv_perm.
auto BindArgs() { return AddInputs<13>(BindStream()); }

template <typename Binding>
auto BindResultsAndAttrs(Binding binding) {
  // Results, in order: out, sorted_ids, expert_ids, num_post_padded, x_perm, act, ws13, ws2.
  return AddResults<8>(std::move(binding))
      .template Attr<bool>("batched")
      .template Attr<int64_t>("hidden_size")
      .template Attr<int64_t>("intermediate_size")
      .template Attr<int64_t>("groups13")
      .template Attr<int64_t>("groups2")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("split13")
      .template Attr<int64_t>("split2")
      .template Attr<int64_t>("activation_kind")
      .template Attr<bool>("has_zeros")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("act_order")
      .template Attr<int64_t>("mainloop")
      .template Attr<bool>("one_token")
      .template Attr<bool>("fused_decode");
}

}  // namespace
}  // namespace jax_moeq::ffi_cuda

JAX_MOEQ_DEFINE_CUDA_HANDLER_PAIR(JaxMoeqWna16MoeCuda, JaxMoeqWna16MoeCudaInto,
                                  jax_moeq::ffi_cuda::Wna16MoeImpl,
                                  jax_moeq::ffi_cuda::BindArgs,
                                  jax_moeq::ffi_cuda::BindResultsAndAttrs);
