#pragma once
// The linear-attention kernels' parameter struct: plain data (no ATen), so that the CPU kernel,
// the CUDA kernels (compiled by nvcc alone) and the validation (linear_inputs.h) share it.
#include <cstdint>
#include "linear/feature_map.h"

namespace attn_ext::linear {

// A (B, H, S, X) tensor read row by row: element (b, h, i, x) is at
// data[b * batch_stride + h * head_stride + i * row_stride + x].
struct Rows {
  const void* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0;

  template <typename T>
  const T* row(int64_t b, int64_t h, int64_t i) const {
    return static_cast<const T*>(data) + b * batch_stride + h * head_stride + i * row_stride;
  }
};

struct LinearAttentionParams {
  Rows q, k, v;
  int64_t batch = 0, heads = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0, head_dim_v = 0;
  bool causal = false;
  double eps = 0.0;
  FeatureMap feature_map = FeatureMap::kEluPlusOne;
  // Initial state, contiguous in the accumulation type (null = zero state):
  // kv (B, H, D, Dv) = sum phi(k) v^T, k (B, H, D) = sum phi(k).
  const void* initial_kv = nullptr;
  const void* initial_k = nullptr;
};

}  // namespace attn_ext::linear
