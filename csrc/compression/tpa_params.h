#pragma once
// Plain parameter struct of tpa_expand (Tensor Product Attention: Q, K or V formed from the
// per-token factors), built by tpa_inputs.cpp after validation. Strides are in elements.
#include <cstdint>
#include <c10/macros/Macros.h>
#include "common/rope.h"

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

// tpa_decode_attention: queries q (B, H, S, D) against cached factors of N tokens,
// a_k (B, N, R_K, H), b_k (B, N, R_K, D), a_v (B, N, R_V, H), b_v (B, N, R_V, D), read as
// rows of merged (token, rank) index (row stride in elements, last dimension contiguous).
// Query i of sequence b sits at position lengths[b] - S + i and sees tokens [0, position];
// score(h, i, t) = scale * k_scale * sum_r a_k[t, r, h] (q[h, i] . b_k[t, r]),
// out[h, i] = sum_t softmax_t(score) * v_scale * sum_r a_v[t, r, h] b_v[t, r].
struct TpaDecodeParams {
  const void* q = nullptr;
  const void *a_k = nullptr, *b_k = nullptr, *a_v = nullptr, *b_v = nullptr;
  void* out = nullptr;               // (B, H, S, D)
  float* lse = nullptr;              // (B, H, S), natural log, scale included
  const int64_t* lengths = nullptr;  // (B,) on the host for the CPU kernel
  int64_t batch = 0, heads = 0, seqlen_q = 0, head_dim = 0, tokens = 0, rank_k = 0, rank_v = 0;
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  int64_t ak_batch_stride = 0, ak_row_stride = 0, bk_batch_stride = 0, bk_row_stride = 0;
  int64_t av_batch_stride = 0, av_row_stride = 0, bv_batch_stride = 0, bv_row_stride = 0;
  double scale = 1.0, k_scale = 1.0, v_scale = 1.0;
  int64_t num_splits = 1;
};

}  // namespace attn_ext
