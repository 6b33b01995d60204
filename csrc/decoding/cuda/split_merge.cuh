#pragma once
// The second pass of split-KV decoding, shared by the CUDA decode kernels: one row's partial
// results (one per key split) folded with SoftmaxState::merge (the LSE merge) into the
// normalized output row and its lse. The workspace holds, per (row, split) slot, the split's
// unnormalized output (Dv values) and its (max, sum) pair, in acc_t.
#include <cstdint>
#include "common/online_softmax.h"
#include "common/cuda/elem.cuh"
#include "decoding/cuda/decoding_launch.h"

namespace attn_ext::cuda {

// Row `row` over (b, hk, r), r = i * G + g: query i of head hk * G + g. The calling threads
// cover its features f = first + c * stride (c < kPerThread, f < Dv); `leader` writes the lse.
template <typename T, typename acc_t, int kPerThread>
__device__ __forceinline__ void merge_split_row(const DecodeParams& p, const DecodeWorkspace& ws,
                                                int64_t row, int64_t splits, int64_t Dv, int first,
                                                int stride, bool leader) {
  const int64_t G = p.group(), Sq = p.seqlen_q, rows = G * Sq;
  const int64_t bk = row / rows, r = row % rows;
  const int64_t b = bk / p.kv_heads, hk = bk % p.kv_heads, i = r / G, h = hk * G + r % G;
  const acc_t* ws_o = static_cast<const acc_t*>(ws.o);
  const acc_t* ws_stats = static_cast<const acc_t*>(ws.stats);
  SoftmaxState<acc_t> total;
  acc_t acc[kPerThread] = {};
  for (int64_t sp = 0; sp < splits; ++sp) {
    const int64_t slot = row * splits + sp;
    SoftmaxState<acc_t> part;
    part.max = ws_stats[2 * slot];
    part.sum = ws_stats[2 * slot + 1];
    acc_t self_factor, other_factor;
    total.merge(part, &self_factor, &other_factor);
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const int64_t f = first + c * stride;
      if (f < Dv) acc[c] = acc[c] * self_factor + ws_o[slot * Dv + f] * other_factor;
    }
  }
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride;
  const acc_t inv = total.inv_sum();
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) {
    const int64_t f = first + c * stride;
    if (f < Dv) out[f] = Elem<T>::store(acc[c] * inv);
  }
  if (leader) p.lse[(b * p.heads + h) * Sq + i] = total.lse();
}

// The merge pass as its own kernel: one warp per row, its lanes striding over the Dv output
// features (merge_split_row). Used by the kernels whose blocks cannot merge in place.
constexpr int kMergeThreads = 128;
constexpr int kMergeWarp = 32;
template <typename T, int kHeadDimV>
__global__ void __launch_bounds__(kMergeThreads)
    merge_kernel(DecodeParams p, DecodeWorkspace ws, int64_t splits) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kMergeThreads / kMergeWarp) +
                      threadIdx.x / kMergeWarp;  // over (b, hk, r)
  if (row >= p.batch * p.kv_heads * p.group() * p.seqlen_q) return;
  const int lane = threadIdx.x % kMergeWarp;
  merge_split_row<T, float, (kHeadDimV + kMergeWarp - 1) / kMergeWarp>(
      p, ws, row, splits, kHeadDimV, lane, kMergeWarp, lane == 0);
}

// Launches merge_kernel over every row of p (p.num_splits partials each) on the stream.
template <typename T, int kHeadDimV>
cudaError_t launch_split_merge(const DecodeParams& p, DecodeWorkspace ws, cudaStream_t stream) {
  const int64_t all_rows = p.batch * p.kv_heads * p.group() * p.seqlen_q;
  constexpr int64_t kRowsPerMergeBlock = kMergeThreads / kMergeWarp;
  merge_kernel<T, kHeadDimV>
      <<<static_cast<unsigned>(ceil_div(all_rows, kRowsPerMergeBlock)), kMergeThreads, 0, stream>>>(
          p, ws, p.num_splits);
  return cudaGetLastError();
}

}  // namespace attn_ext::cuda
