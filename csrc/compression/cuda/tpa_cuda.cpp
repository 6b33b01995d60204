// CUDA op wrappers of tpa_expand and its backward: validation (shared with the CPU ops), the
// shared-memory bound, the current stream, a checked launch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "compression/tpa_inputs.h"
#include "common/cuda/elem_kind.h"
#include "compression/cuda/tpa_launch.h"

namespace attn_ext::cuda {
namespace {

void check_shared(const char* op, const TpaExpandParams& p, const at::Tensor& a, bool backward) {
  const int64_t acc_bytes = a.scalar_type() == at::kDouble ? 8 : 4;
  const int64_t need = tpa_shared_bytes(p, acc_bytes, backward);
  TORCH_CHECK(need <= kTpaMaxSharedBytes, op, ": a token's factors (R = ", p.rank,
              ", H = ", p.heads, ", D = ", p.head_dim, ") need ", need,
              " bytes of shared memory on CUDA, "
              "at most ",
              kTpaMaxSharedBytes, " are supported");
}

at::Tensor tpa_expand_cuda(const at::Tensor& a, const at::Tensor& b,
                           const std::optional<at::Tensor>& positions, double scale, bool rope,
                           double rope_base, bool rope_interleaved,
                           std::optional<int64_t> rotary_dim) {
  constexpr const char* kOp = "attn_ext.tpa_expand";
  c10::cuda::CUDAGuard guard(a.device());
  PreparedTpa r = prepare_tpa_expand(
      kOp, a, b, {positions, scale, rope, rope_base, rope_interleaved, rotary_dim});
  check_shared(kOp, r.params, a, false);
  at::Tensor out = allocate_tpa_output(r.params, a);
  r.params.out = out.data_ptr();
  if (out.numel() == 0) return out;
  C10_CUDA_CHECK(launch_tpa_expand(r.params, elem_kind(kOp, a.scalar_type()),
                                   c10::cuda::getCurrentCUDAStream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> tpa_expand_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& b,
    const std::optional<at::Tensor>& positions, double scale, bool rope, double rope_base,
    bool rope_interleaved, std::optional<int64_t> rotary_dim) {
  constexpr const char* kOp = "attn_ext.tpa_expand_backward";
  c10::cuda::CUDAGuard guard(a.device());
  PreparedTpa r = prepare_tpa_expand(
      kOp, a, b, {positions, scale, rope, rope_base, rope_interleaved, rotary_dim}, &grad_out);
  check_shared(kOp, r.params, a, true);
  at::Tensor grad_a = at::empty(a.sizes(), a.options());
  at::Tensor grad_b = at::empty(b.sizes(), b.options());
  r.params.grad_a = grad_a.data_ptr();
  r.params.grad_b = grad_b.data_ptr();
  if (grad_a.numel() == 0 && grad_b.numel() == 0) return {grad_a, grad_b};
  C10_CUDA_CHECK(launch_tpa_expand_backward(r.params, elem_kind(kOp, a.scalar_type()),
                                            c10::cuda::getCurrentCUDAStream()));
  return {grad_a, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("tpa_expand", &tpa_expand_cuda);
  m.impl("tpa_expand_backward", &tpa_expand_backward_cuda);
}

}  // namespace attn_ext::cuda
