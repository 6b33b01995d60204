#pragma once
// Plain parameter struct of tpa_expand (Tensor Product Attention: Q, K or V formed from the
// per-token factors), built by tpa_inputs.cpp after validation. Strides are in elements.
#include <cstdint>
#include <c10/macros/Macros.h>
#include "rope.h"

namespace attn_ext {

// out[b, s, h, :] = scale * sum_r a[b, s, r, h] * RoPE_pos(b_[b, s, r, :]), pos = position(b, s).
// The backward reads grad_out with out's shape and writes grad_a / grad_b, contiguous in
// the shapes of a / b.
struct TpaExpandParams {
  const void* a = nullptr;  // (B, S, R, H)
  const void* b = nullptr;  // (B, S, R, D)
  void* out = nullptr;      // (B, S, H, D), contiguous
  const void* grad_out = nullptr;
  void* grad_a = nullptr;
  void* grad_b = nullptr;
  int64_t batch = 0, seqlen = 0, rank = 0, heads = 0, head_dim = 0;
  int64_t a_batch_stride = 0, a_row_stride = 0, a_rank_stride = 0, a_col_stride = 1;
  int64_t b_batch_stride = 0, b_row_stride = 0, b_rank_stride = 0, b_col_stride = 1;
  int64_t g_batch_stride = 0, g_row_stride = 0, g_head_stride = 0, g_col_stride = 1;
  double scale = 1.0;
  bool rope = false;  // rotate the b factors by RoPE at each token's position
  RopePolicy policy;
  // Position of token s of batch b: positions[b * pos_batch_stride + s] (int64, rows
  // contiguous; pos_batch_stride 0 when shared by the batch), or s without them.
  const int64_t* positions = nullptr;
  int64_t pos_batch_stride = 0;

  C10_HOST_DEVICE int64_t position(int64_t bi, int64_t s) const {
    return positions != nullptr ? positions[bi * pos_batch_stride + s] : s;
  }
};

}  // namespace attn_ext
