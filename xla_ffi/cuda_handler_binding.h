// Binding pieces shared by the CUDA FFI handlers: XLA's stream as the context, runs of buffer
// inputs and results, and the second handler of targets whose output is aliased to an extra input
// ("_into"). Handlers only (XLA types); csrc/ never sees them.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_moeq::ffi_cuda {

namespace ffi = xla::ffi;

// A binding whose first parameter is XLA's CUDA stream (every handler enqueues on it).
inline auto BindStream() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

// `binding` with kCount more buffer inputs (ffi::AnyBuffer parameters); a count that differs
// from the handler's signature fails to compile. Taken by reference: XLA's bindings have no
// public move constructor, only their own methods make the next one.
template <int kCount, typename Binding>
auto AddInputs(Binding&& binding) {
  static_assert(kCount >= 1, "at least one input");
  if constexpr (kCount == 1) {
    return std::move(binding).template Arg<ffi::AnyBuffer>();
  } else {
    return AddInputs<kCount - 1>(std::move(binding).template Arg<ffi::AnyBuffer>());
  }
}

// `binding` with kCount more buffer results (ffi::Result<ffi::AnyBuffer> parameters).
template <int kCount, typename Binding>
auto AddResults(Binding&& binding) {
  static_assert(kCount >= 1, "at least one result");
  if constexpr (kCount == 1) {
    return std::move(binding).template Ret<ffi::AnyBuffer>();
  } else {
    return AddResults<kCount - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  }
}

namespace binding_internal {

// Position of the last buffer input among a handler's parameters.
template <typename... Params>
constexpr size_t LastInputIndex() {
  constexpr bool kIsInput[] = {std::is_same_v<Params, ffi::AnyBuffer>...};
  size_t last = 0;
  for (size_t i = 0; i < sizeof...(Params); ++i) {
    if (kIsInput[i]) last = i;
  }
  return last;
}

// impl(params without the one at kSkipped).
template <size_t kSkipped, typename Impl, typename Params, size_t... Is>
ffi::Error CallSkipping(const Impl& impl, const Params& params, std::index_sequence<Is...>) {
  return impl(std::get<(Is < kSkipped ? Is : Is + 1)>(params)...);
}

}  // namespace binding_internal

// The handler of an "_into" target: its binding has one more input after the plain target's
// inputs, the buffer its output is aliased to (tests poison it to prove every element written).
// That input is dropped and `impl`, the plain target's handler, runs on the rest.
template <typename Impl>
auto IgnoringAliasedInput(Impl impl) {
  return [impl](auto... params) -> ffi::Error {
    constexpr size_t kAliased = binding_internal::LastInputIndex<decltype(params)...>();
    return binding_internal::CallSkipping<kAliased>(
        impl, std::forward_as_tuple(params...), std::make_index_sequence<sizeof...(params) - 1>());
  };
}

// Runs of the handlers that JAX_MOEQ_DEFINE_CUDA_HANDLER_PAIR defines (the ops' targets and
// their "_into" twins) in this process, read by `jax_moeq_cuda_handler_runs`. Under XLA's command
// buffers a handler runs when its launches are captured, not when the captured graph is
// replayed: a benchmark that sees runs on every call is timing capture, not replay.
inline std::atomic<uint64_t>& HandlerRuns() {
  static std::atomic<uint64_t> runs{0};
  return runs;
}

// `impl`, counted in HandlerRuns.
template <typename Impl>
auto Counted(Impl impl) {
  return [impl](auto... params) -> ffi::Error {
    HandlerRuns().fetch_add(1, std::memory_order_relaxed);
    return impl(params...);
  };
}

}  // namespace jax_moeq::ffi_cuda

// Defines the handler symbols of a target and of its "_into" twin: `plain` binds
// bind_rest(bind_inputs()), `into` the same with one extra input after the inputs (see
// IgnoringAliasedInput). Both are stream-ordered without host syncs, so graph-capturable.
#define JAX_MOEQ_DEFINE_CUDA_HANDLER_PAIR(plain, into, impl, bind_inputs, bind_rest)         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(plain, ::jax_moeq::ffi_cuda::Counted(impl),                \
                                bind_rest(bind_inputs()),                                   \
                                {::xla::ffi::Traits::kCmdBufferCompatible});                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(into,                                                       \
                                ::jax_moeq::ffi_cuda::Counted(                              \
                                    ::jax_moeq::ffi_cuda::IgnoringAliasedInput(impl)),      \
                                bind_rest(bind_inputs().Arg<::xla::ffi::AnyBuffer>()),      \
                                {::xla::ffi::Traits::kCmdBufferCompatible})
