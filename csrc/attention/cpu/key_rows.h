#pragma once
// The key (or value) rows of one (sequence, kv head) that the forward's products pack: row j at
// base + j * ld, or, in a paged varlen batch, row first + j of the sequence through its block
// table (AttentionParams::pages). The packers take a group's row pointers from here (fill), so
// paged keys are packed where they lie: no gathered copy of the sequence.
#include <cstdint>

#include "attention/params.h"

namespace attn_ext::cpu {

template <typename T>
struct KeyRows {
  const T* base = nullptr;         // strided: row 0; paged: this head's row 0 of page 0
  int64_t ld = 0;                  // elements between consecutive rows (of one page)
  const int32_t* pages = nullptr;  // the sequence's block-table row (checked by the op), or null
  int64_t page_size = 1, page_stride = 0, first = 0;

  // out[c] = the pointer to row j0 + c for c < count: paged rows looked up a page at a time
  // (one division per group, not per row).
  void fill(int64_t j0, int64_t count, const T** out) const {
    if (pages == nullptr) {
      for (int64_t c = 0; c < count; ++c) out[c] = base + (j0 + c) * ld;
      return;
    }
    if (count <= 0) return;  // no entry read for no row (j0 may lie past the table row)
    const int64_t t = first + j0;
    int64_t page = t / page_size, offset = t % page_size;
    const T* page_rows = base + pages[page] * page_stride;
    for (int64_t c = 0; c < count; ++c) {
      out[c] = page_rows + offset * ld;
      // The next page's entry is read only when a row of it is wanted (the table row may end).
      if (++offset == page_size && c + 1 < count)
        offset = 0, page_rows = base + pages[++page] * page_stride;
    }
  }
  // The rows from row j on.
  KeyRows from(int64_t j) const {
    KeyRows r = *this;
    if (pages == nullptr)
      r.base += j * ld;
    else
      r.first += j;
    return r;
  }
  // The same rows read as another element type of the same size (bf16 as its bits).
  template <typename U>
  KeyRows<U> as() const {
    static_assert(sizeof(U) == sizeof(T));
    return {reinterpret_cast<const U*>(base), ld, pages, page_size, page_stride, first};
  }
};

// Rows ld apart from base.
template <typename T>
KeyRows<T> strided_rows(const T* base, int64_t ld) {
  return {base, ld};
}

// The keys (or values: the v_* strides) of kv head hk of sequence b, from its first key on: in
// its pages, its cache batch row, or its batch entry.
template <typename T>
KeyRows<T> kv_head_rows(const AttentionParams& p, const void* data, int64_t batch_stride,
                        int64_t head_stride, int64_t row_stride, int64_t b, int64_t hk,
                        int64_t k_begin) {
  const T* head = static_cast<const T*>(data) + hk * head_stride;
  if (!p.pages.paged())
    return {head + p.cache_row(b) * batch_stride + k_begin * row_stride, row_stride};
  return {head,         row_stride, p.pages.table + b * p.pages.row_stride, p.pages.page_size,
          batch_stride, k_begin};
}

}  // namespace attn_ext::cpu
