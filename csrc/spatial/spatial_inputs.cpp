#include "spatial/spatial_inputs.h"

#include <limits>
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "common/tensors.h"

namespace attn_ext::spatial {

bool is_channels_last(const at::Tensor& x) {
  return !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

namespace {

void check_map(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a tensor, got None");
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D (N, C, H, W), got ", t.dim(), "-D ",
              t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must be a floating tensor (float32, float64, bfloat16 or float16), got ",
              t.scalar_type());
}

void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like_name, "'s device ",
              like.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have ", like_name,
              "'s dtype ", like.scalar_type(), ", got ", t.scalar_type());
}

// x dense in its own layout (a copy to NCHW when it is neither layout) and that layout.
std::pair<at::Tensor, MapLayout> dense_map(const at::Tensor& x) {
  const bool cl = is_channels_last(x);
  at::Tensor d = cl ? x : x.contiguous();
  return {d, MapLayout{x.size(0), x.size(1), x.size(2) * x.size(3), cl}};
}

// A (N, 1, H, W) map of x's batch and pixels as a dense (N, P) plane.
at::Tensor dense_plane(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  check_map(op, name, t);
  TORCH_CHECK(
      t.size(0) == x.size(0) && t.size(1) == 1 && t.size(2) == x.size(2) && t.size(3) == x.size(3),
      op, ": ", name, " must have shape (N, 1, H, W) = [", x.size(0), ", 1, ", x.size(2), ", ",
      x.size(3), "] (x is ", x.sizes(), "), got ", t.sizes());
  return t.reshape({x.size(0), x.size(2) * x.size(3)}).contiguous();
}

}  // namespace

PreparedPool prepare_channel_pool(const char* op, const at::Tensor& x) {
  check_map(op, "x", x);
  TORCH_CHECK(x.size(1) >= 1, op, ": x must have at least one channel, got ", x.sizes());
  // argmax is int32
  TORCH_CHECK(x.size(1) <= std::numeric_limits<int32_t>::max(), op,
              ": x may have at most 2^31 - 1 channels, got ", x.size(1));
  auto [d, layout] = dense_map(x);
  PreparedPool r{d, {}};
  r.params.x = layout;
  r.params.in = d.data_ptr();
  return r;
}

PreparedPoolBackward prepare_channel_pool_backward(const char* op, const at::Tensor& grad_pooled,
                                                   const at::Tensor& argmax, int64_t channels,
                                                   bool channels_last) {
  check_map(op, "grad_pooled", grad_pooled);
  const int64_t N = grad_pooled.size(0), H = grad_pooled.size(2), W = grad_pooled.size(3);
  TORCH_CHECK(grad_pooled.size(1) == 2, op, ": grad_pooled must have 2 channels (mean, max), got ",
              grad_pooled.sizes());
  TORCH_CHECK(channels >= 1 && channels <= std::numeric_limits<int32_t>::max(), op,
              ": channels must be in [1, 2^31 - 1], got ", channels);
  TORCH_CHECK(argmax.defined() && argmax.scalar_type() == at::kInt, op,
              ": argmax must be an int32 tensor, got ",
              argmax.defined() ? c10::toString(argmax.scalar_type()) : "None");
  TORCH_CHECK(argmax.device() == grad_pooled.device(), op,
              ": argmax must be on grad_pooled's device ", grad_pooled.device(), ", got ",
              argmax.device());
  TORCH_CHECK(argmax.dim() == 4 && argmax.size(0) == N && argmax.size(1) == 1 &&
                  argmax.size(2) == H && argmax.size(3) == W,
              op, ": argmax must have shape [", N, ", 1, ", H, ", ", W, "], got ", argmax.sizes());
  PreparedPoolBackward r;
  r.grad_pooled = grad_pooled.contiguous(at::MemoryFormat::ChannelsLast);
  r.argmax = argmax.reshape({N, H * W}).contiguous();
  r.params.grad_x = MapLayout{N, channels, H * W, channels_last};
  r.params.grad_pooled = r.grad_pooled.data_ptr();
  r.params.argmax = r.argmax.data_ptr<int32_t>();
  return r;
}

PreparedPoolBackward prepare_channel_pool_accumulate(const char* op, const at::Tensor& grad_x,
                                                     const at::Tensor& grad_pooled,
                                                     const at::Tensor& argmax) {
  check_map(op, "grad_x", grad_x);
  const bool cl = is_channels_last(grad_x);
  TORCH_CHECK(cl || grad_x.is_contiguous(), op,
              ": grad_x must be dense NCHW or channels-last, got strides ", grad_x.strides());
  PreparedPoolBackward r =
      prepare_channel_pool_backward(op, grad_pooled, argmax, grad_x.size(1), cl);
  check_like(op, "grad_pooled", grad_pooled, grad_x, "grad_x");
  TORCH_CHECK(grad_pooled.size(0) == grad_x.size(0) && grad_pooled.size(2) == grad_x.size(2) &&
                  grad_pooled.size(3) == grad_x.size(3),
              op, ": grad_pooled must have shape [", grad_x.size(0), ", 2, ", grad_x.size(2), ", ",
              grad_x.size(3), "] (grad_x is ", grad_x.sizes(), "), got ", grad_pooled.sizes());
  r.params.out = grad_x.data_ptr();
  r.params.accumulate = true;
  return r;
}

PreparedGate prepare_spatial_gate(const char* op, const at::Tensor& x, const at::Tensor& gate,
                                  const at::Tensor& grad_out) {
  check_map(op, "x", x);
  PreparedGate r;
  r.gate = dense_plane(op, "gate", gate, x);
  TORCH_CHECK(gate.device() == x.device(), op, ": gate must be on x's device ", x.device(),
              ", got ", gate.device());
  const bool low = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  TORCH_CHECK(gate.scalar_type() == x.scalar_type() || (low && gate.scalar_type() == at::kFloat),
              op, ": gate must have x's dtype ", x.scalar_type(), low ? " or float32" : "",
              ", got ", gate.scalar_type());
  MapLayout layout;
  std::tie(r.x, layout) = dense_map(x);
  if (grad_out.defined()) {
    check_map(op, "grad_out", grad_out);
    check_like(op, "grad_out", grad_out, x, "x");
    TORCH_CHECK(grad_out.sizes() == x.sizes(), op, ": grad_out must have x's shape ", x.sizes(),
                ", got ", grad_out.sizes());
    r.grad_out = grad_out.contiguous(layout.channels_last ? at::MemoryFormat::ChannelsLast
                                                          : at::MemoryFormat::Contiguous);
    r.params.grad_out = r.grad_out.data_ptr();
  }
  r.params.x = layout;
  r.params.in = r.x.data_ptr();
  r.params.gate = r.gate.data_ptr();
  r.params.gate_is_acc = gate.scalar_type() != x.scalar_type();
  return r;
}

at::Tensor empty_map(const MapLayout& layout, int64_t channels, int64_t height, int64_t width,
                     const at::TensorOptions& options) {
  return advise_huge_pages(
      at::empty({layout.batch, channels, height, width},
                options.memory_format(layout.channels_last ? at::MemoryFormat::ChannelsLast
                                                           : at::MemoryFormat::Contiguous)));
}

}  // namespace attn_ext::spatial
