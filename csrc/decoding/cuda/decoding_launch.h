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

// The split-KV kernel (decode_split_kv.cu): contiguous and paged caches, bf16 / fp16 / fp32,
// D = Dv in kSplitKvHeadDims, 16-byte aligned rows; partials in fp32 (DecodeWorkspace).
constexpr int64_t kSplitKvHeadDims[] = {64, 128, 256};
// Rows (query heads x new tokens) per block: 4 when a KV head has at most 4 (decode with
// G <= 4 wastes no lanes), else 8 (more rows per block mean fewer re-reads of the KV head's
// rows; 8 keeps the per-lane query slices and accumulators in registers at D = 256).
constexpr int64_t kSplitKvSmallRows = 4;
constexpr int64_t kSplitKvRowsPerBlock = 8;
// Key indices are int32 in the kernel: capacities (rows per sequence) below 2^30 leave room for
// every sum of a key index, a tile and a split.
constexpr int64_t kSplitKvMaxCapacity = int64_t(1) << 30;
inline int64_t split_kv_rows_per_block(const DecodeParams& p) {
  return p.group() * p.seqlen_q <= kSplitKvSmallRows ? kSplitKvSmallRows : kSplitKvRowsPerBlock;
}
cudaError_t launch_decode_split_kv(const DecodeParams& p, ElemKind kind, DecodeWorkspace ws,
                                   cudaStream_t stream);

// The tensor-core kernel (decode_mma.cu) for many query rows per KV head: bf16 / fp16,
// contiguous and paged caches, D = Dv in kSplitKvHeadDims, or MLA's latent head (D
// kDecodeMmaLatentDim whose first kDecodeMmaLatentDimV columns are the values: v_cache a view
// of k_cache, `values_in_keys`); 16-byte aligned rows, capacities below kSplitKvMaxCapacity;
// no softcap / ALiBi. Partials in fp32 (DecodeWorkspace), merged by split_merge.cuh's kernel.
constexpr int64_t kDecodeMmaLatentDim = 576;
constexpr int64_t kDecodeMmaLatentDimV = 512;
// Query rows (G x Sq) per KV head from which the tensor-core kernel serves a call whose shape
// the split-KV kernel also serves: at 8 rows the split-KV kernel's FMAs per cache byte reach
// about the H100's fp32 rate at its memory bandwidth. To be measured on the device.
constexpr int64_t kDecodeMmaMinRows = 8;
// Query rows per block of the tensor-core kernel: 16 (one MMA row tile) when the KV head has at
// most 16 rows (G x Sq), else as many as keep the output accumulator at 64 fp32 registers a
// thread (64 at Dv <= 128, 32 at 256, 16 at 512). decode_mma.cu instantiates exactly these.
constexpr int64_t kDecodeMmaSmallRows = 16;
constexpr int64_t decode_mma_rows_per_block(int64_t rows, int64_t head_dim_v) {
  const int64_t most = 64 * 128 / head_dim_v > 64 ? 64 : 64 * 128 / head_dim_v;
  return rows <= kDecodeMmaSmallRows ? kDecodeMmaSmallRows : most;
}
cudaError_t launch_decode_mma(const DecodeParams& p, ElemKind kind, bool values_in_keys,
                              DecodeWorkspace ws, cudaStream_t stream);

}  // namespace attn_ext::cuda
