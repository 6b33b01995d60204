#pragma once
// Plain parameter structs handed from the op boundary (validation) to the kernels.
// Every stride is in elements; the last dimension of every tensor is contiguous.
#include <cstdint>
#include <c10/macros/Macros.h>
#include "common/page_table.h"

namespace attn_ext {

enum class MaskKind : int {
  kNone = 0,           // no explicit mask
  kBool = 1,           // bool tensor, true = keep
  kAdditive = 2,       // tensor of the accumulation type added to the scores (natural-log units)
  kAdditiveInput = 3,  // the same in q's reduced-precision element type (CPU kernels only)
};

struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // (B, H, Sq) contiguous, natural log
  const void* mask = nullptr;

  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;

  int64_t batch = 0, heads = 0, kv_heads = 0;
  int64_t seqlen_q = 0, seqlen_k = 0, head_dim = 0, head_dim_v = 0;

  double scale = 1.0;  // double: fp64 inputs get an fp64 scale
  // Local (causal / sliding-window) band: query i sees keys
  // [i + key_offset - window_left, i + key_offset + window_right]; -1 = unbounded.
  int64_t key_offset = 0;
  int64_t window_left = -1, window_right = -1;
  MaskKind mask_kind = MaskKind::kNone;

  double dropout_p = 0.0;
  uint64_t seed = 0, rng_offset = 0;

  // Score modifiers (attention/score_mod.h), applied to the scaled scores in this order, before
  // the band and attn_mask: softcap (> 0: s = softcap * tanh(s / softcap), Gemma 2), then
  // ALiBi (s -= slope * |i + key_offset - j|). Both arrays are in the accumulation type.
  double softcap = 0.0;
  const void* alibi_slopes = nullptr;  // (B, H) or (H,): slope of (b, h) at
  int64_t alibi_batch_stride = 0;      // b * alibi_batch_stride + h (0 for (H,))
  // Attention sinks: a per-head logit sinks[h] (natural-log units, not scaled) that joins
  // every row's softmax denominator without a value; lse includes it.
  const void* sinks = nullptr;  // (H,) in the accumulation type, or null

  // Variable-length batches (FlashAttention's varlen layout): sequence b owns query tokens
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key tokens [cu_seqlens_k[b], cu_seqlens_k[b + 1])
  // of q (total_q, H, D) / k, v (total_k, Hkv, *); batch strides are 0 and rows are tokens.
  // seqlen_q / seqlen_k then hold the callers' max_seqlen_q / max_seqlen_k (grid sizes only:
  // kernels read each sequence's true length from cu_seqlens). Null: fixed-length batch.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;  // varlen: token counts of q and k
  // Paged keys and values (a varlen batch on the CPU; decode_attention's paged cache): k / v
  // are pages and key t of sequence b is row t % page_size of page pages.page(b, t), at
  // page * k_batch_stride + (t % page_size) * k_row_stride + kv_head * k_head_stride (v alike).
  // A paged varlen batch's sequences start at row 0 of their pages (SeqBounds::k_begin 0).
  PageTable pages;
  // A KV cache (decode_attention; FlashAttention's with_kvcache arguments), int64 (B,) on the
  // op's device or null: sequence b's keys end at lengths[b] (FlashAttention's seqused_k) and
  // start at leftpad[b], in cache batch row batch_idx[b] (k / v batch strides are the
  // cache's, cache_batch its rows). A fixed-length batch with lengths aligns each sequence's
  // queries bottom-right to its own keys (seq_bounds).
  const int64_t* lengths = nullptr;
  const int64_t* leftpad = nullptr;
  const int64_t* batch_idx = nullptr;
  int64_t cache_batch = 0;

  C10_HOST_DEVICE int64_t group() const { return heads / kv_heads; }
  C10_HOST_DEVICE bool varlen() const { return cu_seqlens_q != nullptr; }
  // Per-head row arrays (lse, the dropout streams, the backward's accumulators) are
  // head-major: row r of (b, h) is at head_row(b, h, rows) + r, where rows = q_rows() for
  // query rows (Sq; varlen: total_q, with r = the token) and k_rows() for key rows. So
  // lse is (B, H, Sq), or (H, total_q) for a varlen batch.
  C10_HOST_DEVICE int64_t q_rows() const { return varlen() ? total_q : seqlen_q; }
  C10_HOST_DEVICE int64_t k_rows() const { return varlen() ? total_k : seqlen_k; }
  C10_HOST_DEVICE int64_t row_batches() const { return varlen() ? 1 : batch; }
  C10_HOST_DEVICE int64_t head_row(int64_t b, int64_t h, int64_t rows) const {
    return ((varlen() ? 0 : b) * heads + h) * rows;
  }
  // The cache batch row of sequence b. The CPU op checks batch_idx; a GPU op cannot read it
  // without a sync, so it is clamped into range here: never a read outside the cache.
  C10_HOST_DEVICE int64_t cache_row(int64_t b) const {
    if (batch_idx == nullptr) return b;
    const int64_t r = batch_idx[b];
    return r < 0 ? 0 : (r >= cache_batch ? cache_batch - 1 : r);
  }
};

// Where sequence b's rows lie and how its queries align with its keys.
struct SeqBounds {
  int64_t q_begin, seqlen_q;  // first query row (token) and count
  int64_t k_begin, seqlen_k;  // first key row (token) and count
  int64_t key_offset;         // query i sits at key position i + key_offset
};

C10_HOST_DEVICE inline int64_t clamp_offset(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// Varlen offsets are clamped into [0, total] and made non-decreasing: the GPU ops cannot check
// them without a sync, so offsets out of order or past the tokens select the wrong rows but
// never rows outside q, k, v (the CPU ops refuse such offsets: there this changes nothing).
C10_HOST_DEVICE inline SeqBounds seq_bounds(const AttentionParams& p, int64_t b) {
  if (!p.varlen()) {
    if (p.lengths == nullptr) return {0, p.seqlen_q, 0, p.seqlen_k, p.key_offset};
    // A cache: keys [leftpad, length) of the sequence's rows, the queries bottom-right.
    const int64_t end = clamp_offset(p.lengths[b], 0, p.seqlen_k);
    const int64_t begin = p.leftpad == nullptr ? 0 : clamp_offset(p.leftpad[b], 0, end);
    return {0, p.seqlen_q, begin, end - begin, (end - begin) - p.seqlen_q};
  }
  const int64_t q0 = clamp_offset(p.cu_seqlens_q[b], 0, p.total_q);
  const int64_t q1 = clamp_offset(p.cu_seqlens_q[b + 1], q0, p.total_q);
  const int64_t k0 = clamp_offset(p.cu_seqlens_k[b], 0, p.total_k);
  const int64_t k1 = clamp_offset(p.cu_seqlens_k[b + 1], k0, p.total_k);
  const int64_t k_begin = p.pages.paged() ? 0 : k0;  // a paged sequence's keys: its own pages
  return {q0, q1 - q0, k_begin, k1 - k0, (k1 - k0) - (q1 - q0)};  // bottom-right per sequence
}

// Index of query row i (relative to the sequence) of (b, h) in lse and the dropout streams.
C10_HOST_DEVICE inline int64_t row_index(const AttentionParams& p, const SeqBounds& s, int64_t b,
                                         int64_t h, int64_t i) {
  return p.head_row(b, h, p.q_rows()) + s.q_begin + i;
}

// The backward pass reads the forward's tensors and writes gradients.
struct AttentionBwdParams : AttentionParams {
  const void* dout = nullptr;
  const float* grad_lse = nullptr;  // laid out as lse, or null
  int64_t do_batch_stride = 0, do_head_stride = 0, do_row_stride = 0;
  // Accumulators in the compute type: dq (partials, B, H, Sq, D); dk (B, H, Sk, D), dv
  // (B, H, Sk, Dv) per *query* head (summed over each GQA group afterwards, so no two threads
  // share a row). Fixed-length batches are head-major (rows of a head contiguous); varlen ones
  // token-major like their inputs, (partials,) (total, H, *), so the results need no
  // transpose. acc_row() is a row's index in units of rows, acc_row_step() the distance
  // between consecutive rows of one head.
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  C10_HOST_DEVICE int64_t acc_row(int64_t b, int64_t h, int64_t r, int64_t rows) const {
    return varlen() ? r * heads + h : head_row(b, h, rows) + r;
  }
  C10_HOST_DEVICE int64_t acc_row_step() const { return varlen() ? heads : 1; }
  // d loss / d sinks[h] in the compute type, or null without sinks.
  void* dsinks = nullptr;
};

}  // namespace attn_ext
