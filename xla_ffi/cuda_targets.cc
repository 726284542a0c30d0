// Registry of the CUDA library's FFI handlers, read by jax_moeq/_ffi.py via
// ctypes. One line per target; the two arrays stay in step.
#include <cstdint>

#include "xla/ffi/api/c_api.h"
#include "xla_ffi/abi_version.h"
#include "xla_ffi/cuda_handler_binding.h"

extern "C" XLA_FFI_Error* JaxMoeqWna16MoeCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqWna16MoeCudaInto(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqMxInt4MoeCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqMxInt4MoeCudaInto(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqMxInt4RoutingCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4a8MoeCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4a8MoeCudaInto(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4a8QuantizeRowsCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqWna16LinearCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqWna16LinearCudaInto(XLA_FFI_CallFrame* call_frame);

namespace {

const char* kTargetNames[] = {
    "jax_moeq_wna16_moe_cuda",
    "jax_moeq_wna16_moe_cuda_into",
    "jax_moeq_mxint4_moe_cuda",
    "jax_moeq_mxint4_moe_cuda_into",
    "jax_moeq_mxint4_routing_cuda",
    "jax_moeq_w4a8_moe_cuda",
    "jax_moeq_w4a8_moe_cuda_into",
    "jax_moeq_w4a8_quantize_rows_cuda",
    "jax_moeq_wna16_linear_cuda",
    "jax_moeq_wna16_linear_cuda_into",
};

void* kTargetHandlers[] = {
    reinterpret_cast<void*>(&JaxMoeqWna16MoeCuda),
    reinterpret_cast<void*>(&JaxMoeqWna16MoeCudaInto),
    reinterpret_cast<void*>(&JaxMoeqMxInt4MoeCuda),
    reinterpret_cast<void*>(&JaxMoeqMxInt4MoeCudaInto),
    reinterpret_cast<void*>(&JaxMoeqMxInt4RoutingCuda),
    reinterpret_cast<void*>(&JaxMoeqW4a8MoeCuda),
    reinterpret_cast<void*>(&JaxMoeqW4a8MoeCudaInto),
    reinterpret_cast<void*>(&JaxMoeqW4a8QuantizeRowsCuda),
    reinterpret_cast<void*>(&JaxMoeqWna16LinearCuda),
    reinterpret_cast<void*>(&JaxMoeqWna16LinearCudaInto),
};

static_assert(sizeof(kTargetNames) / sizeof(kTargetNames[0]) ==
              sizeof(kTargetHandlers) / sizeof(kTargetHandlers[0]));

}  // namespace

extern "C" __attribute__((visibility("default"))) int jax_moeq_cuda_targets(const char*** names,
                                                                            void*** handlers) {
  *names = kTargetNames;
  *handlers = kTargetHandlers;
  return static_cast<int>(sizeof(kTargetNames) / sizeof(kTargetNames[0]));
}

// How many times XLA has run the ops' handlers in this process (HandlerRuns).
extern "C" __attribute__((visibility("default"))) uint64_t jax_moeq_cuda_handler_runs() {
  return jax_moeq::ffi_cuda::HandlerRuns().load(std::memory_order_relaxed);
}

// Checked by jax_moeq/_ffi.py before it registers any handler (xla_ffi/abi_version.h).
extern "C" __attribute__((visibility("default"))) int jax_moeq_cuda_abi_version() {
  return JAX_MOEQ_FFI_ABI_VERSION;
}
