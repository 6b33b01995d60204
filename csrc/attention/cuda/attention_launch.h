#pragma once
// Host entry points of the CUDA attention kernels (attn_ext.attention, attention_varlen and
// their backwards):
// the dispatch in attention_launch.cu, the kernels in flash/. No ATen here (common/cuda/launch.h).
#include <cstddef>
#include <cuda_runtime.h>
#include "attention/params.h"
#include "common/cuda/launch.h"

namespace attn_ext::cuda {

// Workspace of the backward, in the accumulation type (fp64 for fp64, else fp32), one value per
// row of lse (B*H*Sq; varlen H*total_q) each: delta = rowsum(dO * O) - grad_lse, the log2-domain
// lse and its float32 rounding remainder.
struct BwdWorkspace {
  void* delta = nullptr;
  void* lse2 = nullptr;
  void* lse2_lo = nullptr;
};

// softcap, ALiBi or sinks requested (attention/score_mod.h).
inline bool has_score_mods(const AttentionParams& p) {
  return p.softcap != 0.0 || p.alibi_slopes != nullptr || p.sinks != nullptr;
}
// Inputs that need the kernels' varlen / score-modifier code: the generic kernels' second
// instantiation serves them (flash/flash_fwd_generic.cuh), the tensor-core forward none yet.
inline bool varlen_or_mods(const AttentionParams& p) {
  return p.varlen() || has_score_mods(p);
}

// Why the CUDA kernels of this build cannot serve these inputs, or nullptr when they can.
// `max_smem` is the device's opt-in shared memory per block.
const char* attention_cuda_unsupported(const AttentionParams& p, ElemKind kind, bool backward,
                                       size_t max_smem);
// The forward kernel a call asks for (attention_cuda.cpp reads ATTN_EXT_CUDA_FWD_KERNEL).
enum class FwdKernel {
  kCute,    // the CuTe tensor-core forward (the default below compute capability 9.x)
  kMma,     // the older tensor-core forward, for comparisons
  kHopper,  // the sm_90a forward (the default on 9.x; the caller checked the device)
};

// The forward: out, lse. With kHopper, the Hopper kernel where this build has it and it serves
// the inputs (attention_launch.cu's hopper_index); else, unless kMma, the CuTe tensor-core
// kernel where it serves the inputs (cute_index) and its tiles fit `max_smem` (the device's
// opt-in shared memory per block); else the older tensor-core kernel for bf16 / fp16 with
// max(D, Dv) up to the largest instantiated head dim (when compiled) and no varlen_or_mods(),
// the generic kernel otherwise.
cudaError_t launch_attention_fwd(const AttentionParams& p, ElemKind kind, FwdKernel kernel,
                                 size_t max_smem, cudaStream_t stream);
// The backward kernel a call asks for (attention_cuda.cpp reads ATTN_EXT_CUDA_BWD_KERNEL and
// torch's deterministic flag).
enum class BwdKernel {
  kGeneric,      // the generic kernel: deterministic (dQ summed in a fixed order)
  kCute,         // the CuTe tensor-core kernel, one query stage (the default)
  kCutePrefetch  // the same with two query stages (the caller checked the opt-in)
};

// The backward into zeroed acc_t buffers dq (B, H, Sq, D), dk (B, H, Sk, D), dv (B, H, Sk, Dv)
// (per query head; varlen: token-major (total, H, *), AttentionBwdParams::acc_row). With
// kCute / kCutePrefetch, the CuTe tensor-core kernel where it serves the inputs and its tiles
// fit `max_smem` (dQ summed by atomics: not deterministic; kCutePrefetch falls back to one
// query stage where two do not fit); else the generic kernel, deterministic.
cudaError_t launch_attention_bwd(const AttentionBwdParams& p, ElemKind kind, BwdWorkspace ws,
                                 BwdKernel kernel, size_t max_smem, cudaStream_t stream);

}  // namespace attn_ext::cuda
