#pragma once
// Host entry points of the CUDA decoding kernels (rope, KV / latent cache append, decode
// attention). No ATen here (common/cuda/launch.h).
#include <cstdint>
#include <cuda_runtime.h>
#include "common/cuda/launch.h"
#include "decoding/decode_params.h"

namespace attn_ext::cuda {

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

}  // namespace attn_ext::cuda
