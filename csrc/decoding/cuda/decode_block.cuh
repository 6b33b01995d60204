#pragma once
// What the split-KV and tensor-core decode kernels share: the rows and keys a thread block
// owns (DecodeBlock) and where it finds key / value row j of sequence b (the cache-row
// policies, a template parameter, so that one kernel body serves contiguous and paged caches).
#include <cstdint>
#include "common/mask.h"
#include "decoding/decode_params.h"

namespace attn_ext::cuda {

// One thread block's share of a decode call, from its block index: grid x runs over
// (sequence b, KV head hk, row block), grid y over the key splits. Its rows are
// [r0, r0 + m) of the KV head's G x Sq query rows (row r: query r / G of head hk G + r % G);
// its keys [j_begin, j_end) are split `split` of those any of its rows sees (from cache_leftpad
// on, within the band), a whole number of `tile_keys` tiles. Key indices are int32: the host
// keeps capacities below 2^30 (kSplitKvMaxCapacity), so no sum of keys, tiles and splits
// overflows. The sequence's length is clamped into the capacity (never a read past it).
struct DecodeBlock {
  int64_t G, Sq, rows, bk, r0, b, hk, len, first;
  int m;
  LocalBand band;
  int32_t splits, split, j_begin, j_end;

  __device__ DecodeBlock(const DecodeParams& p, int rows_per_block, int tile_keys)
      : G(p.group()), Sq(p.seqlen_q), band{0, p.window_left, p.window_right} {
    rows = G * Sq;
    const int64_t num_m = (rows + rows_per_block - 1) / rows_per_block;
    bk = blockIdx.x / num_m;
    r0 = (blockIdx.x % num_m) * rows_per_block;
    b = bk / p.kv_heads;
    hk = bk % p.kv_heads;
    m = static_cast<int>(rows - r0 < rows_per_block ? rows - r0 : rows_per_block);
    len = p.lengths[b];
    len = len < 0 ? 0 : (len > p.seqlen_k ? p.seqlen_k : len);
    band.key_offset = len - Sq;  // query i sits at key position len - Sq + i
    first = p.first_key(b);
    const int64_t i_begin = r0 / G, i_end = (r0 + m - 1) / G + 1;
    const int32_t lo = static_cast<int32_t>(max(band.key_begin(i_begin, len), first));
    const int32_t hi = static_cast<int32_t>(max(band.key_end(i_end, len), int64_t(lo)));
    splits = gridDim.y;
    split = blockIdx.y;
    const int32_t chunk = ((hi - lo + splits - 1) / splits + tile_keys - 1) / tile_keys * tile_keys;
    j_begin = min(hi, lo + split * chunk);
    j_end = min(hi, j_begin + chunk);
  }
  // Row r's keys of this split, [lo, hi): its band from the first key on, cut to the split.
  __device__ int32_t row_begin(int64_t r) const {
    const int64_t i = (r0 + r) / G;
    return static_cast<int32_t>(max(max(band.key_begin(i, len), first), int64_t(j_begin)));
  }
  __device__ int32_t row_end(int64_t r) const {
    return static_cast<int32_t>(min(band.key_end((r0 + r) / G + 1, len), int64_t(j_end)));
  }
};

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
