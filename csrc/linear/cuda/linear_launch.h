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
};

// Whether this build compiled the kernels (they need the CUTLASS headers, as the CuTe
// attention forward does).
bool linear_attention_kernels_built();

// Whether the forward kernels serve these inputs (element kind, head dims, alignment, grid
// limits); the wrapper routes everything else to the ATen composite.
bool linear_attention_fwd_supported(const linear::LinearAttentionParams& p, ElemKind kind);

cudaError_t launch_linear_attention_fwd(const linear::LinearAttentionParams& p,
                                        const LinearOutputs& o, ElemKind kind, cudaStream_t stream);

}  // namespace attn_ext::cuda
