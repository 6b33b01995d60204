#pragma once
// Plain parameter structs handed from the op boundary (validation) to the kernels.
// Every stride is in elements; the last dimension of every tensor is contiguous.
#include <cstdint>
#include <c10/macros/Macros.h>

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

  C10_HOST_DEVICE int64_t group() const { return heads / kv_heads; }
};

// The backward pass reads the forward's tensors and writes gradients.
struct AttentionBwdParams : AttentionParams {
  const void* dout = nullptr;
  const float* grad_lse = nullptr;  // (B, H, Sq) contiguous, or null
  int64_t do_batch_stride = 0, do_head_stride = 0, do_row_stride = 0;
  // Accumulators in the compute type, contiguous:
  //   dq (B, H, Sq, D); dk (B, H, Sk, D), dv (B, H, Sk, Dv) per *query* head
  //   (summed over each GQA group afterwards, so no two threads share a row).
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
};

}  // namespace attn_ext
