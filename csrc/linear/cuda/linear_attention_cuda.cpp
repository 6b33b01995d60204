// CUDA op wrapper of linear_attention: validation shared with the CPU op
// (linear/linear_inputs.cpp), the current stream, a checked launch; nothing synchronizes.
//
// linear_attention_backward has no CUDA kernel yet: on CUDA it runs the ATen composite
// (linear_attention_composite.cpp, registered for CompositeExplicitAutograd), which recomputes
// the forward itself, so gradients never depend on the unverified forward kernels.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/cuda/elem_kind.h"
#include "common/cuda/unverified.h"
#include "linear/cuda/linear_launch.h"
#include "linear/linear_attention_composite.h"
#include "linear/linear_inputs.h"

namespace attn_ext::cuda {
namespace {

using linear::LinearAttentionParams;
using linear::LinearInputs;

// The routing, in one place. The fused forward kernels (linear_attention_fwd.cu) are compiled
// but have not yet run on a GPU, so they serve a call only with ATTN_EXT_UNVERIFIED_CUDA=1
// (common/cuda/unverified.h), on CUDA tensors (the CPU suite redispatches CPU tensors to this
// key to test the composite), in a build that has them (CUTLASS headers found), for the inputs
// they support (bf16 / fp16 / fp32, D in {64, 128}, Dv a multiple of 64, 16-byte aligned rows:
// linear_attention_fwd_supported). Everything else runs the ATen composite, which is the
// verified CUDA implementation: with the gate closed this is exactly the behaviour before the
// kernels existed, not a silent substitute for a failing kernel.
bool use_fused_forward(const at::Tensor& q) {
  return unverified_cuda_enabled() && q.is_cuda() && linear_attention_kernels_built();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_state_kv,
    const std::optional<at::Tensor>& initial_state_k, bool causal, double eps,
    c10::string_view feature_map) {
  constexpr const char* kOp = "attn_ext.linear_attention";
  const auto composite = [&] {
    return linear::linear_attention_composite(q, k, v, initial_state_kv, initial_state_k, causal,
                                              eps, feature_map);
  };
  if (!use_fused_forward(q)) return composite();
  c10::cuda::CUDAGuard guard(q.device());
  const LinearInputs in = linear::prepare_linear_attention(
      kOp, q, k, v, initial_state_kv, initial_state_k, causal, eps, feature_map);
  const LinearAttentionParams& p = in.params;
  const ElemKind kind = elem_kind(kOp, q.scalar_type());
  if (!linear_attention_fwd_supported(p, kind)) return composite();

  const auto acc = q.options().dtype(at::toOpMathType(q.scalar_type()));
  at::Tensor out = at::empty({p.batch, p.heads, p.seqlen_q, p.head_dim_v}, q.options());
  at::Tensor state_kv = at::empty({p.batch, p.heads, p.head_dim, p.head_dim_v}, acc);
  at::Tensor state_k = at::empty({p.batch, p.heads, p.head_dim}, acc);
  const LinearOutputs o{out.data_ptr(), state_kv.data_ptr<float>(), state_k.data_ptr<float>()};
  C10_CUDA_CHECK(launch_linear_attention_fwd(p, o, kind, c10::cuda::getCurrentCUDAStream()));
  return {out, state_kv, state_k};
}

}  // namespace

// The only CUDA registration of linear_attention; the backward keeps the composite's.
TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("linear_attention", &linear_attention_cuda);
}

}  // namespace attn_ext::cuda
