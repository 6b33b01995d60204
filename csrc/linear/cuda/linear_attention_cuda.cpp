// CUDA op wrappers of linear_attention and its backward: validation shared with the CPU ops
// (linear/linear_inputs.cpp), the current stream, checked launches; nothing synchronizes. The
// backward recomputes the forward (the schema passes no output) with the forward kernels, then
// runs the backward kernels (linear_attention_bwd.cu, causal only).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/tensors.h"
#include "common/cuda/elem_kind.h"
#include "common/cuda/unverified.h"
#include "linear/cuda/linear_launch.h"
#include "linear/linear_attention_composite.h"
#include "linear/linear_inputs.h"

namespace attn_ext::cuda {
namespace {

using linear::LinearAttentionParams;
using linear::LinearInputs;

// The routing, in one place (both ops call it). The fused kernels (linear_attention_fwd.cu,
// linear_attention_bwd.cu) passed their tests and memcheck on an H100 (2026-11-27); racecheck
// and their speed are still to run, so they serve a call only with ATTN_EXT_UNVERIFIED_CUDA=1
// (common/cuda/unverified.h), on CUDA tensors (the CPU suite redispatches CPU tensors to this key
// to test the composite), in a build that has them (CUTLASS headers found), for the inputs they
// support: linear_attention_fwd_supported (bf16 / fp16 / fp32, D in {64, 128}, Dv a multiple of 64,
// 16-byte aligned rows) and, for the backward, linear_attention_bwd_supported (causal, Dv in {64,
// 128}). Everything else runs the ATen composite, which is the verified CUDA implementation: with
// the gate closed this is exactly the behaviour before the kernels existed, not a silent substitute
// for a failing kernel.
bool gate_open(const at::Tensor& q) {
  return unverified_cuda_enabled() && q.is_cuda() && linear_attention_kernels_built();
}
enum class Pass { kForward, kBackward };
bool use_kernels(Pass pass, const LinearAttentionParams& p, ElemKind kind) {
  return pass == Pass::kForward ? linear_attention_fwd_supported(p, kind)
                                : linear_attention_bwd_supported(p, kind);
}

// The forward kernels' outputs: out, the final state and (for the backward) each row's
// 1 / (den + eps).
struct Forward {
  at::Tensor out, state_kv, state_k, inv;
};

Forward run_forward(const at::Tensor& q, const LinearAttentionParams& p, ElemKind kind,
                    bool with_inv) {
  const auto acc = q.options().dtype(at::toOpMathType(q.scalar_type()));
  Forward f;
  f.out = at::empty({p.batch, p.heads, p.seqlen_q, p.head_dim_v}, q.options());
  f.state_kv = at::empty({p.batch, p.heads, p.head_dim, p.head_dim_v}, acc);
  f.state_k = at::empty({p.batch, p.heads, p.head_dim}, acc);
  if (with_inv) f.inv = at::empty({p.batch, p.heads, p.seqlen_q}, acc);
  const LinearOutputs o{f.out.data_ptr(), f.state_kv.data_ptr<float>(), f.state_k.data_ptr<float>(),
                        with_inv ? f.inv.data_ptr<float>() : nullptr};
  C10_CUDA_CHECK(launch_linear_attention_fwd(p, o, kind, c10::cuda::getCurrentCUDAStream()));
  return f;
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
  if (!gate_open(q)) return composite();
  c10::cuda::CUDAGuard guard(q.device());
  const LinearInputs in = linear::prepare_linear_attention(
      kOp, q, k, v, initial_state_kv, initial_state_k, causal, eps, feature_map);
  const ElemKind kind = elem_kind(kOp, q.scalar_type());
  if (!use_kernels(Pass::kForward, in.params, kind)) return composite();
  const Forward f = run_forward(q, in.params, kind, false);
  return {f.out, f.state_kv, f.state_k};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_attention_backward_cuda(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v,
                               const std::optional<at::Tensor>& initial_state_kv,
                               const std::optional<at::Tensor>& initial_state_k,
                               const std::optional<at::Tensor>& grad_state_kv,
                               const std::optional<at::Tensor>& grad_state_k, bool causal,
                               double eps, c10::string_view feature_map) {
  constexpr const char* kOp = "attn_ext.linear_attention_backward";
  const auto composite = [&] {
    return linear::linear_attention_backward_composite(grad_out, q, k, v, initial_state_kv,
                                                       initial_state_k, grad_state_kv, grad_state_k,
                                                       causal, eps, feature_map);
  };
  if (!gate_open(q)) return composite();
  c10::cuda::CUDAGuard guard(q.device());
  const linear::LinearBackwardInputs in = linear::prepare_linear_attention_backward(
      kOp, grad_out, q, k, v, initial_state_kv, initial_state_k, grad_state_kv, grad_state_k,
      causal, eps, feature_map);
  const LinearAttentionParams& p = in.fwd.params;
  const ElemKind kind = elem_kind(kOp, q.scalar_type());
  if (!use_kernels(Pass::kBackward, p, kind)) return composite();

  const Forward f = run_forward(q, p, kind, true);
  const auto acc = q.options().dtype(at::toOpMathType(q.scalar_type()));
  const at::Tensor g = blas_rows(grad_out);
  at::Tensor gn = at::empty({p.batch, p.heads, p.seqlen_q, p.head_dim_v}, q.options());
  at::Tensor gz = at::empty({p.batch, p.heads, p.seqlen_q}, acc);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor grad_init_kv = at::empty({p.batch, p.heads, p.head_dim, p.head_dim_v}, acc);
  at::Tensor grad_init_k = at::empty({p.batch, p.heads, p.head_dim}, acc);
  LinearBwdBuffers b;
  b.grad_out = {g.data_ptr(), g.stride(0), g.stride(1), blas_row_stride(g)};
  b.out = f.out.data_ptr();
  b.inv = f.inv.data_ptr<float>();
  b.gn = gn.data_ptr();
  b.gz = gz.data_ptr<float>();
  b.dq = dq.data_ptr();
  b.dk = dk.data_ptr();
  b.dv = dv.data_ptr();
  if (in.grad_final_kv.defined()) {
    b.grad_final_kv = in.grad_final_kv.data_ptr<float>();
    b.grad_final_k = in.grad_final_k.data_ptr<float>();
  }
  b.grad_init_kv = grad_init_kv.data_ptr<float>();
  b.grad_init_k = grad_init_k.data_ptr<float>();
  C10_CUDA_CHECK(launch_linear_attention_bwd(p, b, kind, c10::cuda::getCurrentCUDAStream()));
  return {dq, dk, dv, grad_init_kv, grad_init_k};
}

}  // namespace

// The only CUDA registrations of the two ops (the composite's is CompositeExplicitAutograd).
TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("linear_attention", &linear_attention_cuda);
  m.impl("linear_attention_backward", &linear_attention_backward_cuda);
}

}  // namespace attn_ext::cuda
