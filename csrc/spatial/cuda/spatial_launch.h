#pragma once
// Host entry points of the CUDA spatial-attention (CBAM) kernels; see common/cuda/launch.h for
// the conventions (no ATen headers, the wrapper validates and checks the returned status).
#include <cuda_runtime.h>
#include "spatial/spatial_params.h"
#include "common/cuda/launch.h"

namespace attn_ext::cuda {

cudaError_t launch_channel_pool(const spatial::ChannelPoolParams& p, ElemKind kind,
                                cudaStream_t stream);
cudaError_t launch_channel_pool_backward(const spatial::ChannelPoolBackwardParams& p, ElemKind kind,
                                         cudaStream_t stream);
cudaError_t launch_spatial_gate(const spatial::SpatialGateParams& p, ElemKind kind,
                                cudaStream_t stream);
cudaError_t launch_spatial_gate_backward(const spatial::SpatialGateParams& p, ElemKind kind,
                                         cudaStream_t stream);

// The vectorized kernels (spatial_vec.cu; compiled, not yet run on a GPU): the same contracts,
// grids sized from the device's SM count.
cudaError_t launch_channel_pool_vec(const spatial::ChannelPoolParams& p, ElemKind kind,
                                    int sm_count, cudaStream_t stream);
cudaError_t launch_channel_pool_backward_vec(const spatial::ChannelPoolBackwardParams& p,
                                             ElemKind kind, int sm_count, cudaStream_t stream);
cudaError_t launch_spatial_gate_vec(const spatial::SpatialGateParams& p, ElemKind kind,
                                    int sm_count, cudaStream_t stream);
cudaError_t launch_spatial_gate_backward_vec(const spatial::SpatialGateParams& p, ElemKind kind,
                                             int sm_count, cudaStream_t stream);

}  // namespace attn_ext::cuda
