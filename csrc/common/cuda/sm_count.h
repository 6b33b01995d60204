#pragma once
// Device attributes the op wrappers (*_cuda.cpp) read on every call: the SM count (grid sizes)
// and the compute capability (kernel choice), each queried once per device and process.
#include <array>
#include <atomic>
#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAMacros.h>
#include <cuda_runtime.h>

namespace attn_ext::cuda {

// An attribute, no sync; cached per attribute and device (no attribute read here is 0).
template <cudaDeviceAttr kAttr>
inline int cached_device_attribute(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> cache{};
  std::atomic<int>& slot = cache.at(device);
  int value = slot.load(std::memory_order_relaxed);
  if (value == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttr, device));
    slot.store(value, std::memory_order_relaxed);
  }
  return value;
}

inline int sm_count(c10::DeviceIndex device) {
  return cached_device_attribute<cudaDevAttrMultiProcessorCount>(device);
}

inline int compute_capability_major(c10::DeviceIndex device) {
  return cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
}

}  // namespace attn_ext::cuda
