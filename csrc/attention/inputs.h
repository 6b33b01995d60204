#pragma once
// Validation at the op boundary and construction of the kernel parameter structs.
// Shared by the CPU and CUDA implementations so both reject the same inputs with the
// same messages.
#include <optional>
#include <tuple>
#include <ATen/core/Tensor.h>
#include "attention/params.h"
#include "common/tensors.h"

namespace attn_ext {

struct AttentionOptions {
  std::optional<at::Tensor> attn_mask;
  std::optional<double> scale;
  bool causal = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  std::optional<int64_t> key_offset;
  double dropout_p = 0.0;
  std::optional<at::Tensor> rng_state;
  // Score modifiers (attention/score_mod.h).
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;  // (H,) or (B, H)
  std::optional<at::Tensor> sinks;         // (H,)
  // k and v may be a float8 cache (decode_attention; common/float8.h) instead of q's dtype.
  bool float8_kv = false;
  // Varlen only: k / v are FlashAttention's pages (num_pages, page_size, Hkv, *) and sequence
  // b's keys lie in the pages of block_table[b] (B, max_pages) int32 (CPU kernels only).
  std::optional<at::Tensor> block_table;
};

// Tensors as the kernel reads them: last dimension contiguous, rows addressable by BLAS,
// the mask expanded (a view) to (B, H, Sq, Sk): bool, the accumulation type, or (CPU) q's
// own reduced-precision type.
struct PreparedInputs {
  at::Tensor q, k, v, mask;
  at::Tensor alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k;  // as the kernels read them
  AttentionParams params;  // shapes, strides, scale, band, mask, dropout, modifiers; no outputs
};

// The q/k/v checks every attention-like op shares: 4-D, one floating dtype, one device, one
// batch size, H % Hkv == 0, v's heads and length equal to k's, k's head dim equal to q's.
// With float8_kv, k and v may instead be a float8 KV cache, whose dtypes the caller checks.
void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               bool float8_kv = false);

PreparedInputs prepare_attention(const char* op, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const AttentionOptions& opts);

// The varlen form (attn_ext.attention_varlen): q (total_q, H, D), k (total_k, Hkv, D),
// v (total_k, Hkv, Dv), cu_seqlens (B + 1,) int32 on q's device. On the CPU the offsets are
// checked (0 first, non-decreasing, last = total, lengths within max_seqlen); a CUDA caller's
// values cannot be read without a sync, so the CUDA kernels stay in bounds for any offsets
// that are non-decreasing and end within the tensors (as FlashAttention requires). With
// opts.block_table (CPU only), k / v are pages (num_pages, page_size, Hkv, D / Dv), sequence b's
// cu_seqlens_k length counts the rows of its pages it attends to (at most max_pages *
// page_size), and every table entry those rows touch must be a page.
PreparedInputs prepare_attention_varlen(const char* op, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                        const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                        int64_t max_seqlen_k, const AttentionOptions& opts);

// The options of a varlen call (no attn_mask, no key_offset: bottom-right per sequence).
AttentionOptions varlen_options(std::optional<double> scale, bool causal, int64_t window_left,
                                int64_t window_right, double dropout_p,
                                const std::optional<at::Tensor>& rng_state, double softcap,
                                const std::optional<at::Tensor>& alibi_slopes,
                                const std::optional<at::Tensor>& sinks,
                                const std::optional<at::Tensor>& block_table = std::nullopt);

// attention_weights' options: attention's masking and score modifiers, no dropout.
AttentionOptions weights_options(const std::optional<at::Tensor>& attn_mask,
                                 std::optional<double> scale, bool causal, int64_t window_left,
                                 int64_t window_right, std::optional<int64_t> key_offset,
                                 double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                 const std::optional<at::Tensor>& sinks);

// The probabilities ops (attention_weights, attention_probabilities): q and k checked and
// prepared as attention's, k doubling as v (the same band, mask and dropout); for
// attention_probabilities also lse, (B, H, Sq) float32.
PreparedInputs prepare_probabilities(const char* op, const at::Tensor& q, const at::Tensor& k,
                                     const AttentionOptions& opts);
PreparedInputs prepare_probabilities(const char* op, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& lse, const AttentionOptions& opts);
// Their backward (attention_weights_backward): q and k as above, grad_weights and weights
// (B, H, Sq, Sk) in q's dtype, softcap checked as attention checks it.
PreparedInputs prepare_probabilities_backward(const char* op, const at::Tensor& grad_weights,
                                              const at::Tensor& weights, const at::Tensor& q,
                                              const at::Tensor& k, double softcap);

// Allocates the forward's outputs, out (B, H, Sq, Dv) in q's dtype and lse (B, H, Sq)
// float32 (varlen: out (total_q, H, Dv), lse (H, total_q)), and points the params at them.
std::tuple<at::Tensor, at::Tensor> allocate_outputs(AttentionParams& p, const at::Tensor& q);

// The backward's inputs: q/k/v and the options as prepare_attention takes them, then
// grad_out / out (B, H, Sq, Dv) in q's dtype, lse (and grad_lse when given) (B, H, Sq)
// float32, checked and made readable by rows; the params point at all of them.
struct PreparedBackward {
  PreparedInputs in;
  at::Tensor grad_out, out, lse, grad_lse;  // as the kernel reads them (grad_lse may be undefined)
  AttentionBwdParams params;                // no gradient pointers yet (allocate_grads)
};
PreparedBackward prepare_attention_backward(const char* op, const at::Tensor& grad_out,
                                            const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& out,
                                            const at::Tensor& lse,
                                            const std::optional<at::Tensor>& grad_lse,
                                            const AttentionOptions& opts);
// The same for the varlen form.
PreparedBackward prepare_attention_varlen_backward(
    const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const std::optional<at::Tensor>& grad_lse, const AttentionOptions& opts);
// The backward's preparation around prepared forward inputs.
PreparedBackward prepare_backward_of(const char* op, PreparedInputs in, const at::Tensor& grad_out,
                                     const at::Tensor& out, const at::Tensor& lse,
                                     const std::optional<at::Tensor>& grad_lse);

// The results a kernel writes in q's dtype itself, from accumulators of its own: dq (one
// partial) and dk / dv (one query head per kv head, no GQA group to sum).
struct FinalGrads {
  bool dq = false;
  bool dkv = false;
};
// Gradient accumulators in q's compute type, and the params pointed at them: dq as
// `dq_partials` chunk-major partials (B, H, Sq, D) each, dk / dv per query head (varlen:
// (H, total, *)), dsinks (H,) when the op has sinks; the tensors `final` names instead in q's
// dtype and the op's layout. Zeroed, or with `zeroed` false left uninitialized for a kernel that
// writes every element itself (dsinks is zeroed either way).
struct Grads {
  at::Tensor dq, dk, dv, dsinks;
  FinalGrads final;
};
Grads allocate_grads(AttentionBwdParams& p, const at::Tensor& q, int64_t dq_partials = 1,
                     bool zeroed = true, FinalGrads final = {});
// The op's results from the accumulators: dq's partials summed in a fixed order, each GQA
// group's dk / dv summed in the compute type, all cast to `dtype`, in the op's layout;
// grad_sinks in `sinks`' dtype (an empty float32 tensor without sinks).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> finish_grads(
    const AttentionBwdParams& p, Grads g, at::ScalarType dtype,
    const std::optional<at::Tensor>& sinks);

// Reads (seed, offset) from an int64 rng_state tensor of shape (2,).
void read_rng_state(const char* op, const std::optional<at::Tensor>& rng_state, double dropout_p,
                    AttentionParams& params);

}  // namespace attn_ext
