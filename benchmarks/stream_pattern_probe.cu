// Probe: how fast can the decode GEMM's weight stream be read, per packed layout, with no math?
// Mixtral GEMM1 at T=1: 2 experts x 1792 16-row subtiles x 64 chunks x 512 B = 117 MB, one warp
// per (gate, up) subtile pair, 8 warps per CTA, as MoeInt4GemmKernel reads it.
//   layout "sub-major"   [E][N/16][K/64][512 B] (today's): a warp's stream is contiguous
//   layout "chunk-major" [E][K/64][N/16][512 B]: warps at the same chunk read neighbouring bytes
// Build and run: nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -Icsrc -o /tmp/probe
//   benchmarks/stream_pattern_probe.cu && /tmp/probe
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "cuda/int4_mma_core.cuh"  // LoadStreaming, as the GEMM reads weights

using jax_moeq::cuda::LoadStreaming;

template <bool kChunkMajor, int kDepth>
__global__ void __launch_bounds__(256) ReadStreams(const uint4* w, int n_sub, int chunks,
                                                   unsigned* sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int expert = blockIdx.y;
  const int pair = blockIdx.x * 8 + warp;  // gate subtile `pair`, up subtile pair + n_sub / 2
  const int sub[2] = {pair, pair + n_sub / 2};
  const uint4* base = w + static_cast<size_t>(expert) * n_sub * chunks * 32;
  unsigned acc = 0;
  for (int kc = 0; kc < chunks; kc += kDepth) {
    uint4 v[kDepth][2];
#pragma unroll
    for (int u = 0; u < kDepth; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const size_t idx = kChunkMajor ? (static_cast<size_t>(kc + u) * n_sub + sub[j])
                                       : (static_cast<size_t>(sub[j]) * chunks + kc + u);
        v[u][j] = LoadStreaming(base + idx * 32 + lane);
      }
#pragma unroll
    for (int u = 0; u < kDepth; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) acc ^= v[u][j].x ^ v[u][j].y ^ v[u][j].z ^ v[u][j].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads
}

template <bool kChunkMajor, int kDepth>
float TimeIt(const uint4* const* bufs, int nbufs, int n_sub, int chunks, unsigned* sink) {
  const dim3 grid(n_sub / 2 / 8, 2);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < nbufs; ++i) ReadStreams<kChunkMajor, kDepth><<<grid, 256>>>(bufs[i], n_sub, chunks, sink);
  const int reps = 40;
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) {
    ReadStreams<kChunkMajor, kDepth><<<grid, 256>>>(bufs[i % nbufs], n_sub, chunks, sink);
  }
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms * 1000 / reps;
}

int main() {
  const int n_sub = 1792, chunks = 64, nbufs = 4;
  const size_t bytes = 2ull * n_sub * chunks * 512;
  std::vector<uint4*> bufs(nbufs);
  for (auto& p : bufs) {
    cudaMalloc(&p, bytes);
    cudaMemset(p, 0x5a, bytes);
  }
  unsigned* sink;
  cudaMalloc(&sink, 4);
  auto report = [&](const char* name, float us) {
    std::printf("%-34s %7.1f us  %5.2f TB/s\n", name, us, bytes / us / 1e6);
  };
  report("sub-major,   4 chunks in flight", TimeIt<false, 4>(bufs.data(), nbufs, n_sub, chunks, sink));
  report("sub-major,   8 chunks in flight", TimeIt<false, 8>(bufs.data(), nbufs, n_sub, chunks, sink));
  report("chunk-major, 4 chunks in flight", TimeIt<true, 4>(bufs.data(), nbufs, n_sub, chunks, sink));
  report("chunk-major, 8 chunks in flight", TimeIt<true, 8>(bufs.data(), nbufs, n_sub, chunks, sink));
  report("sub-major,   2 chunks in flight", TimeIt<false, 2>(bufs.data(), nbufs, n_sub, chunks, sink));
  report("chunk-major, 2 chunks in flight", TimeIt<true, 2>(bufs.data(), nbufs, n_sub, chunks, sink));
  std::printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
