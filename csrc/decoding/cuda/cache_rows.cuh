#pragma once
// Where a decode kernel finds key / value row j of sequence b: the cache-row policies the
// split-KV and tensor-core decode kernels take as a template parameter, so that one kernel
// body serves contiguous and paged caches.
#include <cstdint>
#include "decoding/decode_params.h"

namespace attn_ext::cuda {

// Sequence b's key row j: row j of its cache batch row (cache_batch_idx applied).
struct ContiguousRows {
  __device__ static CacheSlot slot(const DecodeParams& p, int64_t b, int64_t j) {
    return {p.cache_row(b), j};
  }
};

// Through the block table. int32 arithmetic (the callers keep capacities below 2^30), the
// entry clamped into the cache as PageTable::page does: a GPU op cannot check the table
// without a sync, so a bad entry reads a wrong page, never outside the cache.
struct PagedRows {
  __device__ static CacheSlot slot(const DecodeParams& p, int64_t b, int64_t j) {
    const int32_t ps = static_cast<int32_t>(p.pages.page_size), t = static_cast<int32_t>(j);
    const int32_t idx = t / ps;
    const int32_t pg = p.pages.table[b * p.pages.row_stride + idx];
    const int32_t last = static_cast<int32_t>(p.pages.num_pages - 1);
    return {pg < 0 ? 0 : (pg > last ? last : pg), t - idx * ps};
  }
};

}  // namespace attn_ext::cuda
