#pragma once
// Validation at the spatial-attention ops' boundary and construction of their parameter
// structs; shared by the CPU and CUDA implementations so both reject the same inputs with the
// same messages.
//
// Layout: x is read in place when it is dense NCHW or dense channels-last; any other strides
// are copied once to NCHW. Outputs shaped like x (out, grad_x) take x's layout; pooled
// (N, 2, H, W) is always channels-last.
#include <ATen/core/Tensor.h>
#include "spatial/spatial_params.h"

namespace attn_ext::spatial {

// Inputs as the kernels read them (dense) and the params pointing into them (outputs unset).
struct PreparedPool {
  at::Tensor x;
  ChannelPoolParams params;
};
struct PreparedPoolBackward {
  at::Tensor grad_pooled, argmax;  // (N, P, 2) and (N, P) int32, both dense
  ChannelPoolBackwardParams params;
};
struct PreparedGate {
  at::Tensor x, gate, grad_out;  // gate (N, P) dense; grad_out in x's layout (backward only)
  SpatialGateParams params;
};

PreparedPool prepare_channel_pool(const char* op, const at::Tensor& x);
PreparedPoolBackward prepare_channel_pool_backward(const char* op, const at::Tensor& grad_pooled,
                                                   const at::Tensor& argmax, int64_t channels,
                                                   bool channels_last);
// grad_x += the pooling's gradient, in place: grad_x must be dense NCHW or channels-last.
PreparedPoolBackward prepare_channel_pool_accumulate(const char* op, const at::Tensor& grad_x,
                                                     const at::Tensor& grad_pooled,
                                                     const at::Tensor& argmax);
// gate: x's dtype, or float32 for a bfloat16 / float16 x. grad_out: undefined for the forward.
PreparedGate prepare_spatial_gate(const char* op, const at::Tensor& x, const at::Tensor& gate,
                                  const at::Tensor& grad_out);

// Whether x is read as channels-last: dense channels-last and not also dense NCHW (as a
// 1-channel or 1-pixel map is). Everything else is read as (or copied to) NCHW.
bool is_channels_last(const at::Tensor& x);

// Allocates (N, C, H, W) with `layout.channels_last` memory format.
at::Tensor empty_map(const MapLayout& layout, int64_t channels, int64_t height, int64_t width,
                     const at::TensorOptions& options);

}  // namespace attn_ext::spatial
