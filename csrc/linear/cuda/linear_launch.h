#pragma once
// Host entry points of the CUDA linear-attention kernels; see common/cuda/launch.h for the
// conventions (no ATen headers; the wrapper validates, routes and checks the returned status).
#include <cstdint>
#include <cuda_runtime.h>
#include "common/cuda/launch.h"
#include "linear/linear_params.h"

namespace attn_ext::cuda {

// Where the forward kernels write: out (B, H, Sq, Dv) contiguous in the inputs' element type,
// the final state kv (B, H, D, Dv) and k (B, H, D), contiguous fp32.
struct LinearOutputs {
  void* out = nullptr;
  float* state_kv = nullptr;
  float* state_k = nullptr;
  // (B, H, Sq) fp32: each row's 1 / (den + eps), written when not null (the backward's
  // recomputed forward needs it).
  float* inv = nullptr;
};

// The backward's operands beyond the forward's parameters. Every tensor but grad_out is
// contiguous; grad_out is read through its strides.
struct LinearBwdBuffers {
  linear::Rows grad_out;       // (B, H, Sq, Dv), element type
  const void* out = nullptr;   // (B, H, Sq, Dv) element type: the recomputed forward
  const float* inv = nullptr;  // (B, H, Sq): its 1 / (den + eps)
  void* gn = nullptr;          // workspace (B, H, Sq, Dv) element type: grad_out / (den + eps)
  float* gz = nullptr;         // workspace (B, H, Sq): -(grad_out . out) / (den + eps)
  void* dq = nullptr;          // (B, H, Sq, D) element type
  void* dk = nullptr;          // (B, H, Sk, D)
  void* dv = nullptr;          // (B, H, Sk, Dv)
  const float* grad_final_kv = nullptr;  // (B, H, D, Dv), null: zero
  const float* grad_final_k = nullptr;   // (B, H, D)
  float* grad_init_kv = nullptr;         // (B, H, D, Dv)
  float* grad_init_k = nullptr;          // (B, H, D)
};

// Whether this build compiled the kernels (they need the CUTLASS headers, as the CuTe
// attention forward does).
bool linear_attention_kernels_built();

// Whether the forward kernels serve these inputs (element kind, head dims, alignment, grid
// limits); the wrapper routes everything else to the ATen composite.
bool linear_attention_fwd_supported(const linear::LinearAttentionParams& p, ElemKind kind);

// Whether the backward kernels serve these inputs: causal, what the forward serves, Dv <= 128
// (the dq / dk blocks hold a 64 x Dv state slice in registers).
bool linear_attention_bwd_supported(const linear::LinearAttentionParams& p, ElemKind kind);

// The gradients from the recomputed forward (b.out, b.inv: launch_linear_attention_fwd with
// LinearOutputs::inv set): the gn / gz pass, then dq (chunks in order), dk and dv (chunks in
// reverse order, carrying the gradient of the state).
cudaError_t launch_linear_attention_bwd(const linear::LinearAttentionParams& p,
                                        const LinearBwdBuffers& b, ElemKind kind,
                                        cudaStream_t stream);

cudaError_t launch_linear_attention_fwd(const linear::LinearAttentionParams& p,
                                        const LinearOutputs& o, ElemKind kind, cudaStream_t stream);

}  // namespace attn_ext::cuda
