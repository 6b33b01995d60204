#pragma once
// Paged key / value rows, shared by the decoding ops' caches and the paged varlen forward.
#include <cstdint>
#include <c10/macros/Macros.h>

namespace attn_ext {

// Where a sequence's cache row lives: the index on the cache's first axis (a sequence of a
// contiguous cache, a page of a paged one) and the row within it.
struct CacheSlot {
  int64_t block, row;
};

// A paged cache (vLLM / FlashAttention's layout; the decoding caches keep our axis order
// (num_pages, Hkv, page_size, *), the paged varlen forward FlashAttention's (num_pages,
// page_size, Hkv, *)): row t of sequence b is row t % page_size of page
// table[b * row_stride + t / page_size], so sequences grow page by page without moving and
// may share pages. page_size 0 means the cache holds one contiguous block per sequence (the
// table pointer cannot say so: an empty table has none).
struct PageTable {
  const int32_t* table = nullptr;  // (B, max_pages) int32, rows contiguous
  int64_t row_stride = 0;          // table entries between consecutive sequences
  int64_t page_size = 0;
  int64_t num_pages = 0;

  C10_HOST_DEVICE bool paged() const { return page_size > 0; }
  // The CPU ops check every entry they touch before running; a GPU op cannot read the table
  // without a sync, so an entry is clamped into range here: never an access outside the cache.
  C10_HOST_DEVICE int64_t page(int64_t b, int64_t t) const {
    const int64_t pg = table[b * row_stride + t / page_size];
    return pg < 0 ? 0 : (pg >= num_pages ? num_pages - 1 : pg);
  }
  // Row t of sequence b (contiguous cache: row t of block b).
  C10_HOST_DEVICE CacheSlot locate(int64_t b, int64_t t) const {
    if (!paged()) return {b, t};
    return {page(b, t), t % page_size};
  }
};

}  // namespace attn_ext
