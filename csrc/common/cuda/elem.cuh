#pragma once
// Element types of the CUDA kernels and their conversions to the accumulation type.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "common/cuda/launch.h"

namespace attn_ext::cuda {

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using acc_t = float;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};
template <>
struct Elem<double> {
  using acc_t = double;
  static __device__ __forceinline__ double load(double x) { return x; }
  static __device__ __forceinline__ double store(double x) { return x; }
};
template <>
struct Elem<__nv_bfloat16> {
  using acc_t = float;
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Elem<__half> {
  using acc_t = float;
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};

// Runs FN (a generic lambda taking a T* tag) for the element type `kind`; an unknown kind is
// an error status, never a silent fall-through.
template <typename Fn>
cudaError_t dispatch_elem(ElemKind kind, Fn&& fn) {
  switch (kind) {
    case ElemKind::kFloat32:
      return fn(static_cast<float*>(nullptr));
    case ElemKind::kFloat64:
      return fn(static_cast<double*>(nullptr));
    case ElemKind::kBFloat16:
      return fn(static_cast<__nv_bfloat16*>(nullptr));
    case ElemKind::kFloat16:
      return fn(static_cast<__half*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace attn_ext::cuda
