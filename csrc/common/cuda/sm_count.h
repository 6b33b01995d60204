#pragma once
// The SM count of a device, for the op wrappers (*_cuda.cpp) that size grids from it.
#include <array>
#include <atomic>
#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAMacros.h>
#include <cuda_runtime.h>

namespace attn_ext::cuda {

// Queried once per device and process (an attribute, no sync).
inline int sm_count(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> cache{};
  std::atomic<int>& slot = cache.at(device);
  int sms = slot.load(std::memory_order_relaxed);
  if (sms == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    slot.store(sms, std::memory_order_relaxed);
  }
  return sms;
}

}  // namespace attn_ext::cuda
