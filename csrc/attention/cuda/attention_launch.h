#pragma once
// Host entry points of the CUDA attention kernels (attn_ext.attention / attention_backward):
// the dispatch in attention_launch.cu, the kernels in flash/. No ATen here (common/cuda/launch.h).
#include <cstddef>
#include <cuda_runtime.h>
#include "attention/params.h"
#include "common/cuda/launch.h"

namespace attn_ext::cuda {

// Workspace of the backward, in the accumulation type (fp64 for fp64, else fp32), B*H*Sq each:
// delta = rowsum(dO * O) - grad_lse, the log2-domain lse and its float32 rounding remainder.
struct BwdWorkspace {
  void* delta = nullptr;
  void* lse2 = nullptr;
  void* lse2_lo = nullptr;
};

// Why the CUDA kernels of this build cannot serve these inputs, or nullptr when they can.
// `max_smem` is the device's opt-in shared memory per block.
const char* attention_cuda_unsupported(const AttentionParams& p, ElemKind kind, bool backward,
                                       size_t max_smem);
// The forward: out, lse. The tensor-core kernel for bf16 / fp16 with max(D, Dv) up to the
// largest instantiated head dim (when compiled), the generic kernel otherwise.
cudaError_t launch_attention_fwd(const AttentionParams& p, ElemKind kind, cudaStream_t stream);
// The backward into zeroed acc_t buffers dq (B, H, Sq, D), dk (B, H, Sk, D), dv (B, H, Sk, Dv)
// (per query head); deterministic.
cudaError_t launch_attention_bwd(const AttentionBwdParams& p, ElemKind kind, BwdWorkspace ws,
                                 cudaStream_t stream);

}  // namespace attn_ext::cuda
