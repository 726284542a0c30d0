# CUDA library (libjax_moeq_cuda.so): kernels in csrc/cuda (no XLA headers),
# FFI handlers in xla_ffi/cuda_*.cc, one C-ABI registry symbol
# (jax_moeq_cuda_targets) that jax_moeq/_ffi.py loads with ctypes.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# Extra architectures beyond sm_90a, e.g. "80" for a portable sm_80 build
# (only kernels that avoid sm_90a-only instructions are built for it).
set(JAX_MOEQ_CUDA_EXTRA_ARCHS "" CACHE STRING "Extra CUDA SM versions (e.g. 80;89)")

file(GLOB JAX_MOEQ_CUDA_KERNELS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cu)
file(GLOB JAX_MOEQ_CUDA_HANDLERS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/cuda_*.cc)

add_library(jax_moeq_cuda SHARED ${JAX_MOEQ_CUDA_KERNELS} ${JAX_MOEQ_CUDA_HANDLERS})
set_target_properties(jax_moeq_cuda PROPERTIES
  CUDA_ARCHITECTURES OFF          # we pass -gencode ourselves
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  CXX_VISIBILITY_PRESET hidden
  CUDA_VISIBILITY_PRESET hidden
  CUDA_RUNTIME_LIBRARY Static)
target_include_directories(jax_moeq_cuda PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/csrc
                                                 ${CMAKE_CURRENT_SOURCE_DIR})
# XLA headers only for the handlers, never for kernels.
set_source_files_properties(${JAX_MOEQ_CUDA_HANDLERS} PROPERTIES
  INCLUDE_DIRECTORIES "${XLA_FFI_INCLUDE_DIR}")
set(JAX_MOEQ_CUDA_GENCODE "-gencode=arch=compute_90a,code=sm_90a")
foreach(arch IN LISTS JAX_MOEQ_CUDA_EXTRA_ARCHS)
  list(APPEND JAX_MOEQ_CUDA_GENCODE "-gencode=arch=compute_${arch},code=sm_${arch}")
endforeach()
target_compile_options(jax_moeq_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${JAX_MOEQ_CUDA_GENCODE} -O3 --expt-relaxed-constexpr>
  $<$<COMPILE_LANGUAGE:CXX>:-O2>)
target_link_libraries(jax_moeq_cuda PRIVATE CUDA::cudart_static)
install(TARGETS jax_moeq_cuda LIBRARY DESTINATION lib)
message(STATUS "jax_moeq: building the CUDA library (${JAX_MOEQ_CUDA_GENCODE})")
