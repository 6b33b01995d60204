#pragma once
// Plain parameter structs of the decoding ops (RoPE, KV-cache append, decode attention),
// built by decode_inputs.cpp after validation. Strides are in elements.
#include <cstdint>
#include <c10/macros/Macros.h>
#include "attention/params.h"
#include "common/rope.h"

namespace attn_ext {

// Rotates x (B, H, S, D) into out (same shape; out == x in place).
struct RopeParams {
  RopePolicy policy;
  bool inverse = false;  // rotate by -angle (the backward)
  const void* x = nullptr;
  void* out = nullptr;
  int64_t batch = 0, heads = 0, seqlen = 0, head_dim = 0;
  int64_t x_batch_stride = 0, x_head_stride = 0, x_row_stride = 0, x_col_stride = 1;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0, o_col_stride = 1;
  // Position of token s of batch b: positions[b * pos_batch_stride + s] (int64, rows
  // contiguous; pos_batch_stride 0 when shared by the batch), or offset + s without them.
  const int64_t* positions = nullptr;
  int64_t pos_batch_stride = 0;
  int64_t offset = 0;

  C10_HOST_DEVICE int64_t position(int64_t b, int64_t s) const {
    return positions != nullptr ? positions[b * pos_batch_stride + s] : offset + s;
  }
};

// Appends k/v (B, Hkv, S_new, *) to the caches (B, Hkv, L, *) at each sequence's length
// (paged: caches (num_pages, Hkv, page_size, *) through `pages`, L = max_pages * page_size).
struct KVAppendParams {
  const void* k = nullptr;
  const void* v = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t batch = 0, kv_heads = 0, seqlen_new = 0, capacity = 0, head_dim = 0, head_dim_v = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0, k_col_stride = 1;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0, v_col_stride = 1;
  int64_t kc_batch_stride = 0, kc_head_stride = 0, kc_row_stride = 0;
  int64_t vc_batch_stride = 0, vc_head_stride = 0, vc_row_stride = 0;
  // Current lengths and the number of tokens each sequence appends (the last `appended[b]`
  // of the S_new inputs: batched generation pads on the left); int64, on the op's device.
  const int64_t* lengths = nullptr;
  const int64_t* appended = nullptr;
  double k_scale = 1.0, v_scale = 1.0;  // a float8 cache stores k / k_scale, v / v_scale
  bool rope = false;                    // rotate the keys at their cache positions on the way in
  RopePolicy policy;
  PageTable pages;  // the cache strides' batch stride is then the page stride
};

// Attention of Sq new queries against a KV cache with per-sequence lengths. Reuses the
// attention fields: seqlen_k is the cache capacity L (paged through `pages`: max_pages *
// page_size, with the k/v batch strides the page strides; never together with batch_idx),
// window_right is 0 (causal) or -1.
// Query i of sequence b sits at key position lengths[b] - Sq + i (bottom-right).
struct DecodeParams : AttentionParams {
  int64_t num_splits = 1;  // key-sequence splits per (batch, kv head)
  // A float8 cache holds K / k_scale and V / v_scale (common/float8.h); 1 otherwise.
  double k_scale = 1.0, v_scale = 1.0;

  // Key row t of sequence b: through the page table, or row t of its cache batch row.
  C10_HOST_DEVICE CacheSlot key_slot(int64_t b, int64_t t) const {
    return pages.paged() ? pages.locate(b, t) : CacheSlot{cache_row(b), t};
  }
  C10_HOST_DEVICE int64_t first_key(int64_t b) const {
    if (leftpad == nullptr) return 0;
    const int64_t f = leftpad[b];
    return f < 0 ? 0 : (f > seqlen_k ? seqlen_k : f);
  }
};

}  // namespace attn_ext
