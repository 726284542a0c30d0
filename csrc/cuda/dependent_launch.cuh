// Programmatic dependent launch (Hopper): the kernels of one fused-MoE call run back to back on
// one stream, and at decode each is short (5-80 us), so the gap between two of them (launch
// latency plus the previous kernel's draining last wave) is a visible share of the call.
// Every kernel after an op's first is launched with LaunchAfterPrior: its CTAs may start as soon
// as every CTA of the previous kernel has called AllowDependentGrids (or exited), and they wait
// in WaitForPriorGrids until that kernel has completed and its writes are visible.
//
// The rule for a kernel launched this way: call WaitForPriorGrids before reading anything an
// earlier kernel of the op wrote and before writing anything an earlier kernel reads. Work
// before it may touch only the op's constant inputs. A kernel whose whole work is such (it reads
// only the op's inputs and writes what no earlier kernel of the op touches) may call it last
// instead, in every thread and on every path, so that its completion still implies the earlier
// kernels' (the next kernel waits only for it): it then runs beside the kernel before it.
// One exception: what the kernel two before wrote may be read before the wait where every CTA of
// the kernel between calls WaitForPriorGrids before AllowDependentGrids (so this kernel cannot
// start until those writes are complete), through the L2 (ld.cg): the one-token GEMM2 reads the
// routing kernel's pairs so.
// AllowDependentGrids right after the wait: the next kernel's CTAs then take SM slots as this
// kernel's CTAs retire. (An L2 prefetch of GEMM2's
// first weight chunks before its wait was tried and gained nothing measurable: not kept.)
// Both device calls are no-ops on a kernel launched the ordinary way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace jax_moeq::cuda {

__device__ __forceinline__ void WaitForPriorGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void AllowDependentGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// JAX_MOEQ_DEPENDENT_LAUNCH=0 launches every kernel the ordinary way (to compare, or to rule the
// overlap out when debugging); read once per process.
inline bool DependentLaunchEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_MOEQ_DEPENDENT_LAUNCH");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization. A
// launch error is left for the caller's cudaGetLastError, as with <<<>>>.
template <typename... Params, typename... Args>
void LaunchAfterPrior(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = DependentLaunchEnabled() ? 1 : 0;
  config.attrs = attribute;
  config.numAttrs = 1;
  (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace jax_moeq::cuda
