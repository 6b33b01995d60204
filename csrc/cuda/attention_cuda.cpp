// CUDA op wrappers of attn_ext.attention and attention_backward: validation shared with the
// CPU ops (prepare_attention), the current stream, a checked launch; nothing synchronizes.
// The backward is deterministic by construction (csrc/cuda/flash/flash_bwd_generic.cuh), so it
// honours torch.use_deterministic_algorithms without a flag.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../common/inputs.h"
#include "elem_kind.h"
#include "launch.h"

namespace attn_ext::cuda {
namespace {

// Rejects, with the reason, inputs this build's kernels cannot serve on the current device.
void check_supported(const char* op, const AttentionParams& p, ElemKind kind, bool backward) {
  int max_smem = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        c10::cuda::current_device()));
  const char* why = attention_cuda_unsupported(p, kind, backward, static_cast<size_t>(max_smem));
  TORCH_CHECK(why == nullptr, op, ": ", why, " (got B=", p.batch, ", H=", p.heads, ", Sq=",
              p.seqlen_q, ", Sk=", p.seqlen_k, ", D=", p.head_dim, ", Dv=", p.head_dim_v, ")");
}

std::tuple<at::Tensor, at::Tensor> attention_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& rng_state,
    std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    std::optional<int64_t> key_offset, double dropout_p) {
  constexpr const char* kOp = "attn_ext.attention";
  c10::cuda::CUDAGuard guard(q.device());
  PreparedInputs in = prepare_attention(
      kOp, q, k, v,
      {attn_mask, scale, causal, window_left, window_right, key_offset, dropout_p, rng_state});
  AttentionParams& p = in.params;
  const ElemKind kind = elem_kind(kOp, q.scalar_type());
  auto [out, lse] = allocate_outputs(p, q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  check_supported(kOp, p, kind, /*backward=*/false);
  C10_CUDA_CHECK(launch_attention_fwd(p, kind, c10::cuda::getCurrentCUDAStream()));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool causal,
    int64_t window_left, int64_t window_right, std::optional<int64_t> key_offset,
    double dropout_p, const std::optional<at::Tensor>& rng_state) {
  constexpr const char* kOp = "attn_ext.attention_backward";
  c10::cuda::CUDAGuard guard(q.device());
  PreparedInputs in = prepare_attention(
      kOp, q, k, v,
      {attn_mask, scale, causal, window_left, window_right, key_offset, dropout_p, rng_state});
  AttentionBwdParams p;
  static_cast<AttentionParams&>(p) = in.params;
  const int64_t B = p.batch, H = p.heads, Hkv = p.kv_heads, Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const std::vector<int64_t> o_shape{B, H, Sq, Dv};
  check_companion(kOp, "grad_out", grad_out, q, o_shape, q.scalar_type());
  check_companion(kOp, "out", out, q, o_shape, q.scalar_type());
  check_companion(kOp, "lse", lse, q, {B, H, Sq}, at::kFloat);
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if (has_glse) check_companion(kOp, "grad_lse", *grad_lse, q, {B, H, Sq}, at::kFloat);
  const ElemKind kind = elem_kind(kOp, q.scalar_type());

  // Accumulators in the compute type; dk / dv per query head (summed per group below).
  const auto acc_opts = q.options().dtype(at::toOpMathType(q.scalar_type()));
  at::Tensor dq = at::zeros({B, H, Sq, D}, acc_opts);
  at::Tensor dk = at::zeros({B, H, Sk, D}, acc_opts);
  at::Tensor dv = at::zeros({B, H, Sk, Dv}, acc_opts);
  if (B * H * Sq > 0 && Sk > 0) {
    check_supported(kOp, p, kind, /*backward=*/true);
    const at::Tensor go = blas_rows(grad_out);
    const at::Tensor o = blas_rows(out);
    const at::Tensor l = lse.contiguous();
    const at::Tensor gl = has_glse ? grad_lse->contiguous() : at::Tensor();
    at::Tensor ws = at::empty({3, B * H * Sq}, acc_opts);
    p.grad_lse = has_glse ? gl.const_data_ptr<float>() : nullptr;
    p.dout = go.data_ptr();
    p.do_batch_stride = go.stride(0);
    p.do_head_stride = go.stride(1);
    p.do_row_stride = blas_row_stride(go);
    p.out = const_cast<void*>(o.const_data_ptr());
    p.o_batch_stride = o.stride(0);
    p.o_head_stride = o.stride(1);
    p.o_row_stride = blas_row_stride(o);
    p.lse = const_cast<float*>(l.const_data_ptr<float>());
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    const BwdWorkspace w{ws[0].data_ptr(), ws[1].data_ptr(), ws[2].data_ptr()};
    C10_CUDA_CHECK(launch_attention_bwd(p, kind, w, c10::cuda::getCurrentCUDAStream()));
  }
  if (H != Hkv) {
    dk = Hkv == 0 ? dk.new_zeros({B, 0, Sk, D}) : dk.view({B, Hkv, H / Hkv, Sk, D}).sum(2);
    dv = Hkv == 0 ? dv.new_zeros({B, 0, Sk, Dv}) : dv.view({B, Hkv, H / Hkv, Sk, Dv}).sum(2);
  }
  const auto dt = q.scalar_type();
  return {dq.to(dt), dk.to(dt), dv.to(dt)};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
}

}  // namespace attn_ext::cuda
