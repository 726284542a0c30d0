// FFI binding of the GPU MxInt4 fused MoE (routing inside): decode buffers
// and attributes, validate, enqueue the launchers of csrc/cuda on XLA's stream.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda/mxint4_moe.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda_handler_binding.h"
#include "xla_ffi/cuda_handler_checks.h"

namespace ffi = xla::ffi;

namespace jax_moeq::ffi_cuda {
namespace {

const TargetChecks kChecks("jax_moeq_mxint4_moe_cuda");
const TargetChecks kRoutingChecks("jax_moeq_mxint4_routing_cuda");

// Router logits, correction bias and the routing attributes into p (both targets route).
ffi::Error DecodeRouting(const TargetChecks& checks, ffi::AnyBuffer logits, ffi::AnyBuffer bias,
                         int64_t top_k, int64_t local_expert_offset, int64_t routing_method,
                         int64_t num_expert_group, int64_t topk_group,
                         float routed_scaling_factor, bool has_bias, cuda::MxInt4MoeProblem* p) {
  // Attributes narrowed to int below: out of int32 they are refused, not wrapped
  // (routing_method 2^32 + 2 would otherwise pass as 2).
  JAX_MOEQ_RETURN_IF_ERROR(checks.IntAttrs({{"routing_method", routing_method},
                                            {"num_expert_group", num_expert_group},
                                            {"topk_group", topk_group}}));
  const auto ld = logits.dimensions();
  if (ld.size() != 2) {
    return checks.Invalid("router_logits must be [tokens, num_experts], got " + Dims(ld));
  }
  if (logits.element_type() == ffi::BF16) {
    p->logits_bf16 = true;
  } else if (logits.element_type() != ffi::F32) {
    return checks.Invalid("router_logits must be float32 or bfloat16");
  }
  p->num_experts = ld[1];
  p->local_offset = local_expert_offset;
  p->top_k = top_k;
  p->routing_method = static_cast<int>(routing_method);
  p->num_expert_group = static_cast<int>(num_expert_group);
  p->topk_group = static_cast<int>(topk_group);
  p->routed_scaling_factor = routed_scaling_factor;
  p->logits = logits.untyped_data();
  if (has_bias) {
    JAX_MOEQ_RETURN_IF_ERROR(checks.Buffer("e_score_correction_bias", bias, ffi::F32, "float32",
                                           {p->num_experts}));
    p->bias = static_cast<const float*>(bias.untyped_data());
  }
  return ffi::Error::Success();
}

ffi::Error MxInt4MoeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer logits,
                         ffi::AnyBuffer bias, ffi::AnyBuffer w13, ffi::AnyBuffer s13,
                         ffi::AnyBuffer w2, ffi::AnyBuffer s2, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> topk_ids,
                         ffi::Result<ffi::AnyBuffer> topk_weights,
                         ffi::Result<ffi::AnyBuffer> local_ids,
                         ffi::Result<ffi::AnyBuffer> sorted_ids,
                         ffi::Result<ffi::AnyBuffer> expert_ids,
                         ffi::Result<ffi::AnyBuffer> num_post_padded,
                         ffi::Result<ffi::AnyBuffer> act, ffi::Result<ffi::AnyBuffer> ws13,
                         ffi::Result<ffi::AnyBuffer> ws2,
                         ffi::Result<ffi::AnyBuffer> x_perm, int64_t top_k,
                         int64_t intermediate_size, int64_t local_expert_offset,
                         int64_t routing_method, int64_t num_expert_group, int64_t topk_group,
                         float routed_scaling_factor, bool has_bias, int64_t block_m,
                         int64_t split13, int64_t split2, int64_t mainloop, bool one_token,
                         bool fused_decode) {
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.IntAttrs(
      {{"block_m", block_m}, {"split13", split13}, {"split2", split2}, {"mainloop", mainloop}}));
  cuda::MxInt4MoeProblem p;
  JAX_MOEQ_RETURN_IF_ERROR(DecodeRouting(kChecks, logits, bias, top_k, local_expert_offset,
                                         routing_method, num_expert_group, topk_group,
                                         routed_scaling_factor, has_bias, &p));
  const auto xd = x.dimensions();
  if (xd.size() != 2) return kChecks.Invalid("x must be [tokens, hidden], got " + Dims(xd));
  if (x.element_type() != ffi::BF16) return kChecks.Invalid("x must be bfloat16");
  p.tokens = xd[0];
  p.hidden = xd[1];
  if (logits.dimensions()[0] != p.tokens) {
    return kChecks.Invalid("router_logits must be [tokens, num_experts], got " +
                           Dims(logits.dimensions()));
  }
  const auto wd = w13.dimensions();
  if (wd.size() != 5) return kChecks.Invalid("w13 must be packed [L, 2I/16, H/64, 32, 4] uint32");
  p.local_experts = wd[0];
  p.intermediate = intermediate_size;
  p.block_m = static_cast<int>(block_m);
  p.split13 = static_cast<int>(split13);
  p.split2 = static_cast<int>(split2);
  p.mainloop = static_cast<int>(mainloop);
  p.one_token = one_token;
  p.fused_decode = fused_decode;
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.InvalidUnlessEmpty(cuda::ValidateMxInt4MoeProblem(p)));

  const int64_t L = p.local_experts, H = p.hidden, I = p.intermediate, T = p.tokens;
  const int64_t K = p.top_k;
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Buffer("w13", w13, ffi::U32, "uint32", {L, 2 * I / 16, H / 64, 32, 4}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Buffer("w2", w2, ffi::U32, "uint32", {L, H / 16, I / 64, 32, 4}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Buffer("w13_scale", s13, ffi::BF16, "bfloat16", {L, H / 32, 2 * I / 16, 16}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Buffer("w2_scale", s2, ffi::BF16, "bfloat16", {L, I / 32, H / 16, 16}));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Buffer("output", *out, ffi::BF16, "bfloat16", {T, H}));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Buffer("topk_ids", *topk_ids, ffi::S32, "int32", {T, K}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Buffer("topk_weights", *topk_weights, ffi::F32, "float32", {T, K}));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Buffer("local_ids", *local_ids, ffi::S32, "int32", {T, K}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Scratch("sorted_ids", *sorted_ids, ffi::S32, cuda::MxInt4MoeMaxPadded(p)));
  JAX_MOEQ_RETURN_IF_ERROR(
      kChecks.Scratch("expert_ids", *expert_ids, ffi::S32, cuda::MxInt4MoeMaxBlocks(p)));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Scratch("num_post_padded", *num_post_padded, ffi::S32, 1));
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Scratch("act", *act, ffi::BF16, T * K * I));
  if (p.split13 > 1) {
    JAX_MOEQ_RETURN_IF_ERROR(
        kChecks.Scratch("ws13", *ws13, ffi::F32, cuda::MxInt4MoeWs13Floats(p)));
  }
  JAX_MOEQ_RETURN_IF_ERROR(kChecks.Scratch("ws2", *ws2, ffi::F32, cuda::MxInt4MoeWs2Floats(p)));
  if (const int64_t perm_rows = cuda::MxInt4MoePermutedRows(p); perm_rows > 0) {
    JAX_MOEQ_RETURN_IF_ERROR(kChecks.Scratch("x_perm", *x_perm, ffi::BF16, perm_rows * H));
  }

  p.x = x.untyped_data();
  p.w13 = w13.untyped_data();
  p.s13 = s13.untyped_data();
  p.w2 = w2.untyped_data();
  p.s2 = s2.untyped_data();
  p.out = out->untyped_data();
  p.topk_ids = static_cast<int32_t*>(topk_ids->untyped_data());
  p.topk_weights = static_cast<float*>(topk_weights->untyped_data());
  p.local_ids = static_cast<int32_t*>(local_ids->untyped_data());
  p.sorted_ids = static_cast<int32_t*>(sorted_ids->untyped_data());
  p.expert_ids = static_cast<int32_t*>(expert_ids->untyped_data());
  p.num_post_padded = static_cast<int32_t*>(num_post_padded->untyped_data());
  p.act = act->untyped_data();
  p.ws13 = static_cast<float*>(ws13->untyped_data());
  p.ws2 = static_cast<float*>(ws2->untyped_data());
  p.x_perm = x_perm->untyped_data();
  return kChecks.InternalUnlessEmpty(cuda::RunMxInt4Moe(p, stream));
}

// The routing alone: router logits -> topk_ids (global), topk_weights, and local_ids (ids of
// experts [offset, offset + local) minus offset, else -1).
ffi::Error MxInt4RoutingImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer bias,
                             ffi::Result<ffi::AnyBuffer> topk_ids,
                             ffi::Result<ffi::AnyBuffer> topk_weights,
                             ffi::Result<ffi::AnyBuffer> local_ids, int64_t top_k,
                             int64_t local_expert_offset, int64_t local_num_experts,
                             int64_t routing_method, int64_t num_expert_group, int64_t topk_group,
                             float routed_scaling_factor, bool has_bias) {
  cuda::MxInt4MoeProblem p;
  JAX_MOEQ_RETURN_IF_ERROR(DecodeRouting(kRoutingChecks, logits, bias, top_k,
                                         local_expert_offset, routing_method, num_expert_group,
                                         topk_group, routed_scaling_factor, has_bias, &p));
  p.tokens = logits.dimensions()[0];
  p.local_experts = local_num_experts;
  JAX_MOEQ_RETURN_IF_ERROR(kRoutingChecks.InvalidUnlessEmpty(cuda::ValidateMxInt4Routing(p)));
  const int64_t T = p.tokens, K = p.top_k;
  JAX_MOEQ_RETURN_IF_ERROR(
      kRoutingChecks.Buffer("topk_ids", *topk_ids, ffi::S32, "int32", {T, K}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kRoutingChecks.Buffer("topk_weights", *topk_weights, ffi::F32, "float32", {T, K}));
  JAX_MOEQ_RETURN_IF_ERROR(
      kRoutingChecks.Buffer("local_ids", *local_ids, ffi::S32, "int32", {T, K}));
  p.topk_ids = static_cast<int32_t*>(topk_ids->untyped_data());
  p.topk_weights = static_cast<float*>(topk_weights->untyped_data());
  p.local_ids = static_cast<int32_t*>(local_ids->untyped_data());
  return kRoutingChecks.InternalUnlessEmpty(cuda::RunMxInt4Routing(p, stream));
}

// The inputs of the plain handler and of its "_into" twin, in order: x, router_logits,
// e_score_correction_bias (or placeholder); w13, w13_scale; w2, w2_scale.
auto BindArgs() { return AddInputs<7>(BindStream()); }

template <typename Binding>
auto BindResultsAndAttrs(Binding binding) {
  // Results, in order: out, topk_ids, topk_weights, local_ids, sorted_ids, expert_ids,
  // num_post_padded, act, ws13, ws2, x_perm (block_m 128).
  return AddResults<11>(std::move(binding))
      .template Attr<int64_t>("top_k")
      .template Attr<int64_t>("intermediate_size")
      .template Attr<int64_t>("local_expert_offset")
      .template Attr<int64_t>("routing_method")
      .template Attr<int64_t>("num_expert_group")
      .template Attr<int64_t>("topk_group")
      .template Attr<float>("routed_scaling_factor")
      .template Attr<bool>("has_bias")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("split13")
      .template Attr<int64_t>("split2")
      .template Attr<int64_t>("mainloop")
      .template Attr<bool>("one_token")
      .template Attr<bool>("fused_decode");
}

}  // namespace
}  // namespace jax_moeq::ffi_cuda

JAX_MOEQ_DEFINE_CUDA_HANDLER_PAIR(JaxMoeqMxInt4MoeCuda, JaxMoeqMxInt4MoeCudaInto,
                                  jax_moeq::ffi_cuda::MxInt4MoeImpl,
                                  jax_moeq::ffi_cuda::BindArgs,
                                  jax_moeq::ffi_cuda::BindResultsAndAttrs);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMoeqMxInt4RoutingCuda, jax_moeq::ffi_cuda::MxInt4RoutingImpl,
    jax_moeq::ffi_cuda::BindStream()
        .Arg<ffi::AnyBuffer>()  // router_logits
        .Arg<ffi::AnyBuffer>()  // e_score_correction_bias (or placeholder)
        .Ret<ffi::AnyBuffer>()  // topk_ids
        .Ret<ffi::AnyBuffer>()  // topk_weights
        .Ret<ffi::AnyBuffer>()  // local_ids
        .Attr<int64_t>("top_k")
        .Attr<int64_t>("local_expert_offset")
        .Attr<int64_t>("local_num_experts")
        .Attr<int64_t>("routing_method")
        .Attr<int64_t>("num_expert_group")
        .Attr<int64_t>("topk_group")
        .Attr<float>("routed_scaling_factor")
        .Attr<bool>("has_bias"),
    {ffi::Traits::kCmdBufferCompatible});
