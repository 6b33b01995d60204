#pragma once
// Host entry points of the CUDA kernels. Kernel sources (.cu) include no ATen headers, only
// this file and the plain parameter / policy headers of csrc/common, so that they compile
// with nvcc alone (the CI compile check); the op wrappers (*_cuda.cpp) validate inputs, pick
// the stream and check the returned launch status.
#include <cstdint>
#include <cuda_runtime.h>
#include "../common/decode_params.h"
#include "../common/tpa_params.h"
#include "../common/params.h"

namespace attn_ext::cuda {

// Element type of the tensors a kernel reads and writes (accumulation is fp32, fp64 for fp64).
enum class ElemKind : int { kFloat32, kFloat64, kBFloat16, kFloat16 };

cudaError_t launch_rope(const RopeParams& p, ElemKind kind, cudaStream_t stream);

// Appends and then advances cache_seqlens (int32 or int64, `seqlens_int64`) on the stream.
// A call that would overflow any sequence writes nothing: the kernels check every sequence.
cudaError_t launch_kv_append(const KVAppendParams& p, ElemKind kind, void* cache_seqlens,
                             bool seqlens_int64, cudaStream_t stream);

// Workspace for split-KV decode, in the accumulation type (fp64 for fp64, else fp32):
// partial outputs (B * Hkv * rows, splits, Dv) and their (max, sum) pairs.
struct DecodeWorkspace {
  void* o = nullptr;
  void* stats = nullptr;
};
// Rows (query heads x new tokens) handled by one thread block.
constexpr int64_t kDecodeRowsPerBlock = 16;
// Largest head dims the decode kernel holds in shared memory / registers.
constexpr int64_t kDecodeMaxHeadDim = 576;
constexpr int64_t kDecodeMaxHeadDimV = 512;
cudaError_t launch_decode(const DecodeParams& p, ElemKind kind, DecodeWorkspace ws,
                          cudaStream_t stream);

// tpa_expand: one thread block per token holds the token's factors in shared memory (the
// rotated b rows, a, the cos/sin table; the backward also the gradient of b) in the
// accumulation type. Without opting in, a block may use 48 KiB of shared memory.
constexpr int64_t kTpaMaxSharedBytes = 48 * 1024;
inline int64_t tpa_shared_bytes(const TpaExpandParams& p, int64_t acc_bytes, bool backward) {
  const int64_t values = (backward ? 2 : 1) * p.rank * p.head_dim + p.rank * p.heads +
                         (p.rope ? 2 * p.policy.pairs() : 0);
  return values * acc_bytes;
}
cudaError_t launch_tpa_expand(const TpaExpandParams& p, ElemKind kind, cudaStream_t stream);
cudaError_t launch_tpa_expand_backward(const TpaExpandParams& p, ElemKind kind,
                                       cudaStream_t stream);

// ---- attn_ext.attention / attention_backward (csrc/cuda/flash, csrc/cuda/attention_launch.cu)

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
// The forward: out, lse. The tensor-core kernel for bf16 / fp16 with max(D, Dv) up to 256
// (when compiled), the generic kernel otherwise.
cudaError_t launch_attention_fwd(const AttentionParams& p, ElemKind kind, cudaStream_t stream);
// The backward into zeroed acc_t buffers dq (B, H, Sq, D), dk (B, H, Sk, D), dv (B, H, Sk, Dv)
// (per query head); deterministic.
cudaError_t launch_attention_bwd(const AttentionBwdParams& p, ElemKind kind, BwdWorkspace ws,
                                 cudaStream_t stream);

}  // namespace attn_ext::cuda
