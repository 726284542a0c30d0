// Per-device state of the launchers' host side, safe for concurrent first use. XLA calls a
// handler from several host threads at once (one per device in a multi-GPU process, or several
// executions of one device), each with its own current device, so anything cached here is
// cached per device and published atomically:
//  - device figures (SM count, opt-in shared memory per block), queried once per device;
//  - a kernel's dynamic shared-memory opt-in (cudaFuncSetAttribute applies to the function on
//    the *current* device only: a once-per-process flag leaves every other device at the 48 KB
//    default, and the launch there fails), raised once per (kernel, device) and only upwards,
//    under one lock, so two threads cannot leave it lower than either needs.
// No XLA types; host code only.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace jax_moeq::cuda {

constexpr int kMaxCachedDevices = 64;  // devices past this are served uncached

// The current device, or -1 (and the error cleared) when there is none.
inline int CurrentDevice() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

struct DeviceFigures {
  int sms = 0;             // multiprocessors
  int max_smem_optin = 0;  // opt-in dynamic shared memory per block, bytes
};

// Figures of `device`, queried on its first use (concurrent first uses store equal values).
inline cudaError_t DeviceFiguresOf(int device, DeviceFigures* figures) {
  // (sms << 32) | bytes, one atomic so a reader never sees half of an entry; 0: not yet queried.
  static std::atomic<uint64_t> cache[kMaxCachedDevices];
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  uint64_t packed = cached ? cache[device].load(std::memory_order_acquire) : 0;
  if (packed == 0) {
    int sms = 0, bytes = 0;
    cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      return err;
    }
    packed = (static_cast<uint64_t>(static_cast<uint32_t>(sms)) << 32) |
             static_cast<uint32_t>(bytes);
    if (cached) cache[device].store(packed, std::memory_order_release);
  }
  figures->sms = static_cast<int>(packed >> 32);
  figures->max_smem_optin = static_cast<int>(packed & 0xffffffffu);
  return cudaSuccess;
}

// A kernel's dynamic shared-memory opt-in per device: a static of the kernel's launcher (one
// per kernel instantiation), zero-initialized.
struct SmemOptInTable {
  std::atomic<int> bytes[kMaxCachedDevices];
};

inline std::mutex& SmemOptInMutex() {
  static std::mutex mutex;
  return mutex;
}

// Makes `kernel` launchable with `bytes` of dynamic shared memory on the current device
// (`max_carveout`: also prefer the largest shared-memory carveout). The attribute is set on
// the first launch needing it on each device and never lowered; later calls cost one atomic
// load. The error of cudaFuncSetAttribute is returned (and cleared) if it fails.
template <typename Kernel>
cudaError_t EnsureDynamicSmem(SmemOptInTable& table, Kernel kernel, int bytes,
                              bool max_carveout = false) {
  const int device = CurrentDevice();
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached && table.bytes[device].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  std::lock_guard<std::mutex> lock(SmemOptInMutex());
  const int have = cached ? table.bytes[device].load(std::memory_order_relaxed) : 0;
  if (have >= bytes) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes);
  if (err == cudaSuccess && max_carveout) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    return err;
  }
  if (cached) table.bytes[device].store(bytes, std::memory_order_release);
  return cudaSuccess;
}

}  // namespace jax_moeq::cuda
