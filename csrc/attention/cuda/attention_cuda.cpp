// CUDA op wrappers of attn_ext.attention and attention_backward: validation shared with the
// CPU ops (prepare_attention), the current stream, a checked launch; nothing synchronizes.
// The backward is deterministic by construction (flash/flash_bwd_generic.cuh), so it
// honours torch.use_deterministic_algorithms without a flag.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "attention/inputs.h"
#include "common/cuda/elem_kind.h"
#include "attention/cuda/attention_launch.h"

namespace attn_ext::cuda {
namespace {

// Rejects, with the reason, inputs this build's kernels cannot serve on the current device.
void check_supported(const char* op, const AttentionParams& p, ElemKind kind, bool backward) {
  int max_smem = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        c10::cuda::current_device()));
  const char* why = attention_cuda_unsupported(p, kind, backward, static_cast<size_t>(max_smem));
  TORCH_CHECK(why == nullptr, op, ": ", why, " (got B=", p.batch, ", H=", p.heads,
              ", Sq=", p.seqlen_q, ", Sk=", p.seqlen_k, ", D=", p.head_dim, ", Dv=", p.head_dim_v,
              ")");
}

// The score modifiers have no CUDA kernel yet.
void check_no_score_mods(const char* op, const AttentionParams& p) {
  TORCH_CHECK(p.softcap == 0.0 && p.alibi_slopes == nullptr && p.sinks == nullptr, op,
              ": softcap, alibi_slopes and sinks are not yet supported on CUDA");
}

std::tuple<at::Tensor, at::Tensor> attention_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    std::optional<int64_t> key_offset, double dropout_p, double softcap) {
  constexpr const char* kOp = "attn_ext.attention";
  c10::cuda::CUDAGuard guard(q.device());
  PreparedInputs in =
      prepare_attention(kOp, q, k, v,
                        {attn_mask, scale, causal, window_left, window_right, key_offset, dropout_p,
                         rng_state, softcap, alibi_slopes, sinks});
  check_no_score_mods(kOp, in.params);
  AttentionParams& p = in.params;
  const ElemKind kind = elem_kind(kOp, q.scalar_type());
  auto [out, lse] = allocate_outputs(p, q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  check_supported(kOp, p, kind, /*backward=*/false);
  C10_CUDA_CHECK(launch_attention_fwd(p, kind, c10::cuda::getCurrentCUDAStream()));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool causal,
    int64_t window_left, int64_t window_right, std::optional<int64_t> key_offset, double dropout_p,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double softcap) {
  constexpr const char* kOp = "attn_ext.attention_backward";
  c10::cuda::CUDAGuard guard(q.device());
  PreparedBackward in =
      prepare_attention_backward(kOp, grad_out, q, k, v, out, lse, grad_lse,
                                 {attn_mask, scale, causal, window_left, window_right, key_offset,
                                  dropout_p, rng_state, softcap, alibi_slopes, sinks});
  AttentionBwdParams& p = in.params;
  check_no_score_mods(kOp, p);
  const ElemKind kind = elem_kind(kOp, q.scalar_type());
  Grads g = allocate_grads(p, q);
  if (p.batch * p.heads * p.seqlen_q > 0 && p.seqlen_k > 0) {
    check_supported(kOp, p, kind, /*backward=*/true);
    // delta, lse2 and lse2_lo of every row, in the compute type
    at::Tensor ws = at::empty({3, p.batch * p.heads * p.seqlen_q}, g.dq.options());
    const BwdWorkspace w{ws[0].data_ptr(), ws[1].data_ptr(), ws[2].data_ptr()};
    C10_CUDA_CHECK(launch_attention_bwd(p, kind, w, c10::cuda::getCurrentCUDAStream()));
  }
  return finish_grads(p, std::move(g), q.scalar_type(), sinks);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
}

}  // namespace attn_ext::cuda
