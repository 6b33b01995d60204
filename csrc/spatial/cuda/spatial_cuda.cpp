// CUDA op wrappers of the spatial-attention (CBAM) ops: validation shared with the CPU ops
// (csrc/spatial/spatial_inputs.cpp), the current stream, a checked launch; nothing
// synchronizes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/cuda/elem_kind.h"
#include "common/cuda/sm_count.h"
#include "common/cuda/unverified.h"
#include "spatial/spatial_inputs.h"
#include "spatial/cuda/spatial_launch.h"

namespace attn_ext::cuda {
namespace {

using namespace attn_ext::spatial;

// The vectorized kernels (spatial_vec.cu: 16-byte accesses, grids sized from the SM count)
// compile but have not yet run on a GPU, so they serve only with ATTN_EXT_UNVERIFIED_CUDA=1;
// without it the verified kernels of spatial.cu run, as before. Each op below makes this choice
// in one line; once the vectorized kernels are verified, delete spatial.cu, its launchers in
// spatial_launch.h, this function and the other arm of each choice.
bool vectorized() {
  return unverified_cuda_enabled();
}

// The SM count of the current device (each op's guard selected the input's device).
int current_sms() {
  return sm_count(c10::cuda::current_device());
}

std::tuple<at::Tensor, at::Tensor> channel_pool_cuda(const at::Tensor& x) {
  constexpr const char* kOp = "attn_ext.channel_pool";
  c10::cuda::CUDAGuard guard(x.device());
  PreparedPool in = prepare_channel_pool(kOp, x);
  const MapLayout& l = in.params.x;
  at::Tensor pooled = at::empty({l.batch, 2, x.size(2), x.size(3)},
                                x.options().memory_format(at::MemoryFormat::ChannelsLast));
  at::Tensor argmax = at::empty({l.batch, 1, x.size(2), x.size(3)}, x.options().dtype(at::kInt));
  in.params.pooled = pooled.data_ptr();
  in.params.argmax = argmax.data_ptr<int32_t>();
  const ElemKind kind = elem_kind(kOp, x.scalar_type());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(vectorized() ? launch_channel_pool_vec(in.params, kind, current_sms(), stream)
                              : launch_channel_pool(in.params, kind, stream));
  return {pooled, argmax};
}

at::Tensor channel_pool_backward_cuda(const at::Tensor& grad_pooled, const at::Tensor& argmax,
                                      int64_t channels, bool channels_last) {
  constexpr const char* kOp = "attn_ext.channel_pool_backward";
  c10::cuda::CUDAGuard guard(grad_pooled.device());
  PreparedPoolBackward in =
      prepare_channel_pool_backward(kOp, grad_pooled, argmax, channels, channels_last);
  at::Tensor grad_x = empty_map(in.params.grad_x, channels, grad_pooled.size(2),
                                grad_pooled.size(3), grad_pooled.options());
  in.params.out = grad_x.data_ptr();
  const ElemKind kind = elem_kind(kOp, grad_pooled.scalar_type());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(vectorized()
                     ? launch_channel_pool_backward_vec(in.params, kind, current_sms(), stream)
                     : launch_channel_pool_backward(in.params, kind, stream));
  return grad_x;
}

void channel_pool_backward_accumulate_cuda(at::Tensor& grad_x, const at::Tensor& grad_pooled,
                                           const at::Tensor& argmax) {
  constexpr const char* kOp = "attn_ext.channel_pool_backward_accumulate_";
  c10::cuda::CUDAGuard guard(grad_x.device());
  PreparedPoolBackward in = prepare_channel_pool_accumulate(kOp, grad_x, grad_pooled, argmax);
  const ElemKind kind = elem_kind(kOp, grad_x.scalar_type());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(vectorized()
                     ? launch_channel_pool_backward_vec(in.params, kind, current_sms(), stream)
                     : launch_channel_pool_backward(in.params, kind, stream));
}

at::Tensor spatial_gate_cuda(const at::Tensor& x, const at::Tensor& gate) {
  constexpr const char* kOp = "attn_ext.spatial_gate";
  c10::cuda::CUDAGuard guard(x.device());
  PreparedGate in = prepare_spatial_gate(kOp, x, gate, at::Tensor());
  at::Tensor out = empty_map(in.params.x, x.size(1), x.size(2), x.size(3), x.options());
  in.params.out = out.data_ptr();
  const ElemKind kind = elem_kind(kOp, x.scalar_type());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(vectorized() ? launch_spatial_gate_vec(in.params, kind, current_sms(), stream)
                              : launch_spatial_gate(in.params, kind, stream));
  return out;
}

std::tuple<at::Tensor, at::Tensor> spatial_gate_backward_cuda(const at::Tensor& grad_out,
                                                              const at::Tensor& x,
                                                              const at::Tensor& gate) {
  constexpr const char* kOp = "attn_ext.spatial_gate_backward";
  c10::cuda::CUDAGuard guard(x.device());
  PreparedGate in = prepare_spatial_gate(kOp, x, gate, grad_out);
  const MapLayout& l = in.params.x;
  at::Tensor grad_x = empty_map(l, x.size(1), x.size(2), x.size(3), x.options());
  at::Tensor grad_gate =
      at::empty({l.batch, 1, x.size(2), x.size(3)}, x.options().dtype(gate.scalar_type()));
  in.params.out = grad_x.data_ptr();
  in.params.grad_gate = grad_gate.data_ptr();
  const ElemKind kind = elem_kind(kOp, x.scalar_type());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(vectorized()
                     ? launch_spatial_gate_backward_vec(in.params, kind, current_sms(), stream)
                     : launch_spatial_gate_backward(in.params, kind, stream));
  return {grad_x, grad_gate};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("channel_pool", &channel_pool_cuda);
  m.impl("channel_pool_backward", &channel_pool_backward_cuda);
  m.impl("channel_pool_backward_accumulate_", &channel_pool_backward_accumulate_cuda);
  m.impl("spatial_gate", &spatial_gate_cuda);
  m.impl("spatial_gate_backward", &spatial_gate_backward_cuda);
}

}  // namespace attn_ext::cuda
