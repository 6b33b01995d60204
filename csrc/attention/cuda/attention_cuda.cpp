// CUDA op wrappers of attn_ext.attention, attention_varlen and their backwards: validation
// shared with the CPU ops (prepare_attention*), the current stream, a checked launch; nothing
// synchronizes.
// The generic backward is deterministic by construction (flash/flash_bwd_generic.cuh); the
// CuTe one (opt-in until verified) adds dQ by atomics and yields to it under
// torch.use_deterministic_algorithms.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "attention/inputs.h"
#include "common/cuda/elem_kind.h"
#include "attention/cuda/attention_launch.h"
#include "common/constants.h"
#include "common/cuda/sm_count.h"
#include "common/cuda/unverified.h"

namespace attn_ext::cuda {
namespace {

// Rejects, with the reason, inputs this build's kernels cannot serve on the current device;
// returns the device's opt-in shared memory per block, which the dispatch also heeds.
size_t check_supported(const char* op, const AttentionParams& p, ElemKind kind, bool backward) {
  int max_smem = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        c10::cuda::current_device()));
  const char* why = attention_cuda_unsupported(p, kind, backward, static_cast<size_t>(max_smem));
  TORCH_CHECK(why == nullptr, op, ": ", why, " (got B=", p.batch, ", H=", p.heads,
              ", Sq=", p.seqlen_q, ", Sk=", p.seqlen_k, ", D=", p.head_dim, ", Dv=", p.head_dim_v,
              ")");
  return static_cast<size_t>(max_smem);
}

// The forward kernel ATTN_EXT_CUDA_FWD_KERNEL asks for, read at each call:
//   (unset)  the Hopper forward on a device of compute capability 9.x, else the CuTe forward;
//   hopper   the sm_90a forward (flash/flash_fwd_hopper.cuh: TMA, wgmma, warp specialization)
//            where this build has it (TORCH_CUDA_ARCH_LIST with 9.0a) and it serves the inputs,
//            else the CuTe forward; needs compute capability 9.x. Ran green on an H100
//            (2026-11-27: tests, memcheck / racecheck / synccheck, no spills) at 1.6-2.0x the
//            CuTe forward (dev/gpu_notes.md);
//   cute     the CuTe forward (flash/flash_fwd_cute.cuh) where it serves the inputs;
//   mma      the older tensor-core kernel instead, for comparisons (dev/cute_fwd_check.py).
int device_major() {
  return compute_capability_major(c10::cuda::current_device());
}

constexpr int kHopperMajor = 9;  // sm_90a's wgmma / TMA exist on compute capability 9.x only

FwdKernel requested_fwd_kernel(const char* op) {
  const char* v = std::getenv("ATTN_EXT_CUDA_FWD_KERNEL");
  if (v == nullptr || std::strcmp(v, "") == 0)
    return device_major() == kHopperMajor ? FwdKernel::kHopper : FwdKernel::kCute;
  if (std::strcmp(v, "cute") == 0) return FwdKernel::kCute;
  if (std::strcmp(v, "mma") == 0) return FwdKernel::kMma;
  TORCH_CHECK(std::strcmp(v, "hopper") == 0,
              "ATTN_EXT_CUDA_FWD_KERNEL: expected 'hopper', 'cute' or 'mma' (unset: 'hopper' on "
              "compute capability 9.x, else 'cute'), got '",
              v, "'");
  const int major = device_major();
  TORCH_CHECK(major == kHopperMajor, op,
              ": ATTN_EXT_CUDA_FWD_KERNEL=hopper needs a device of compute capability 9.x, got ",
              major, ".x");
  return FwdKernel::kHopper;
}

// The backward kernel, from ATTN_EXT_CUDA_BWD_KERNEL (read at each call):
//   (unset), cute  the CuTe backward (flash/flash_bwd_cute.cuh; ran green on an H100 2026-11-27:
//                  its tests and racecheck; bf16 52-177 TFLOP/s, where the generic kernel
//                  measured 2.9 on 2026-11-23) with one query stage;
//   cute_prefetch  the same with two query stages, the next query block's Q and dO loading while
//                  this one's products run (FlashAttention-2's prefetch): compiled, not yet run on
//                  a GPU, so it needs ATTN_EXT_UNVERIFIED_CUDA=1;
//   generic        the generic kernel, for comparisons.
// The CuTe kernels' dQ sums are ordered by atomics, so under torch.use_deterministic_algorithms
// the generic (deterministic) kernel runs whatever the variable says.
BwdKernel requested_bwd_kernel(const char* op) {
  const char* v = std::getenv("ATTN_EXT_CUDA_BWD_KERNEL");
  BwdKernel kernel = BwdKernel::kCute;
  if (v != nullptr && std::strcmp(v, "") != 0 && std::strcmp(v, "cute") != 0) {
    if (std::strcmp(v, "cute_prefetch") == 0) {
      require_verified_or_opt_in(op,
                                 "ATTN_EXT_CUDA_BWD_KERNEL=cute_prefetch (the CuTe backward "
                                 "with two query stages)");
      kernel = BwdKernel::kCutePrefetch;
    } else {
      TORCH_CHECK(std::strcmp(v, "generic") == 0,
                  "ATTN_EXT_CUDA_BWD_KERNEL: expected 'cute', 'cute_prefetch' or 'generic' "
                  "(unset: 'cute'), got '",
                  v, "'");
      kernel = BwdKernel::kGeneric;
    }
  }
  return at::globalContext().deterministicAlgorithms() ? BwdKernel::kGeneric : kernel;
}

std::tuple<at::Tensor, at::Tensor> run_fwd(const char* op, PreparedInputs& in) {
  AttentionParams& p = in.params;
  const ElemKind kind = elem_kind(op, in.q.scalar_type());
  auto [out, lse] = allocate_outputs(p, in.q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  const size_t max_smem = check_supported(op, p, kind, /*backward=*/false);
  const FwdKernel fwd_kernel = requested_fwd_kernel(op);
  C10_CUDA_CHECK(
      launch_attention_fwd(p, kind, fwd_kernel, max_smem, c10::cuda::getCurrentCUDAStream()));
  return {out, lse};
}

// The gradient of each head's sink from the backward's per-row workspace, laid out as lse:
// d sink_h = -sum over h's rows of P_sink,i * delta_i, P_sink,i = exp2(sink2_h - lse2_i).
at::Tensor sink_grads(const AttentionBwdParams& p, const at::Tensor& ws, const at::Tensor& sinks) {
  const at::Tensor sink2 = sinks.to(ws.scalar_type()) * kLog2e;
  const std::vector<int64_t> shape = p.varlen()
                                         ? std::vector<int64_t>{1, p.heads, p.total_q}
                                         : std::vector<int64_t>{p.batch, p.heads, p.seqlen_q};
  const at::Tensor delta = ws[0].view(shape), lse2 = ws[1].view(shape), lo = ws[2].view(shape);
  const at::Tensor prob = at::exp2((sink2.view({1, -1, 1}) - lse2) - lo);
  return -(prob * delta).sum(at::IntArrayRef{0, 2});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_bwd(
    const char* op, PreparedBackward& in, const std::optional<at::Tensor>& sinks) {
  AttentionBwdParams& p = in.params;
  const at::Tensor& q = in.in.q;
  const ElemKind kind = elem_kind(op, q.scalar_type());
  Grads g = allocate_grads(p, q);
  const int64_t rows = p.row_batches() * p.heads * p.q_rows();
  // Without keys there is no gradient but the sinks' (from the preprocess's rows).
  if (rows > 0 && (p.k_rows() > 0 || p.sinks != nullptr)) {
    const size_t max_smem = check_supported(op, p, kind, /*backward=*/true);
    // delta, lse2 and lse2_lo of every row (indexed as lse), in the compute type
    at::Tensor ws = at::empty({3, rows}, g.dq.options());
    const BwdWorkspace w{ws[0].data_ptr(), ws[1].data_ptr(), ws[2].data_ptr()};
    C10_CUDA_CHECK(launch_attention_bwd(p, kind, w, requested_bwd_kernel(op), max_smem,
                                        c10::cuda::getCurrentCUDAStream()));
    if (p.sinks != nullptr) g.dsinks.copy_(sink_grads(p, ws, in.in.sinks));
  }
  return finish_grads(p, std::move(g), q.scalar_type(), sinks);
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
  return run_fwd(kOp, in);
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& block_table, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    double dropout_p, double softcap) {
  constexpr const char* kOp = "attn_ext.attention_varlen";
  c10::cuda::CUDAGuard guard(q.device());
  PreparedInputs in = prepare_attention_varlen(
      kOp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      varlen_options(scale, causal, window_left, window_right, dropout_p, rng_state, softcap,
                     alibi_slopes, sinks, block_table));
  return run_fwd(kOp, in);
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
  return run_bwd(kOp, in, sinks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& grad_lse, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, double dropout_p, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double softcap) {
  constexpr const char* kOp = "attn_ext.attention_varlen_backward";
  c10::cuda::CUDAGuard guard(q.device());
  PreparedBackward in = prepare_attention_varlen_backward(
      kOp, grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      grad_lse,
      varlen_options(scale, causal, window_left, window_right, dropout_p, rng_state, softcap,
                     alibi_slopes, sinks));
  return run_bwd(kOp, in, sinks);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
  m.impl("attention_varlen", &attention_varlen_cuda);
  m.impl("attention_varlen_backward", &attention_varlen_backward_cuda);
}

}  // namespace attn_ext::cuda
