#pragma once
// Host entry points of the CUDA Tensor Product Attention kernels (tpa_expand and its
// backward). No ATen here (common/cuda/launch.h).
#include <cstdint>
#include <cuda_runtime.h>
#include "common/cuda/launch.h"
#include "compression/tpa_params.h"

namespace attn_ext::cuda {

// tpa_expand: one thread block per token holds the token's factors in shared memory (the
// rotated b rows, a, the cos/sin table; the backward also the gradient of b) in the
// accumulation type. Without opting in, a block may use 48 KiB of shared memory.
constexpr int64_t kTpaMaxSharedBytes = 48 * 1024;
inline int64_t tpa_shared_bytes(const TpaExpandParams& p, int64_t acc_bytes, bool backward) {
  const int64_t values = (backward ? 2 : 1) * p.rank * p.head_dim + p.rank * p.heads +
                         (p.rope ? 2 * p.policy.pairs() : 0);
  return values * acc_bytes;
}
cudaError_t launch_tpa_expand(const TpaExpandParams& p, ElemKind kind, cudaStream_t stream);
cudaError_t launch_tpa_expand_backward(const TpaExpandParams& p, ElemKind kind,
                                       cudaStream_t stream);

}  // namespace attn_ext::cuda
