#pragma once
// The element-wise pieces every flash kernel applies to a score: the score modifiers
// (attention/score_mod.h), the explicit mask, the local band, the key range, and dropout. Scores
// are in the log2 domain, so an additive mask (natural-log units) is scaled by log2(e), as
// attention/cpu/tile_mask.h does (here added to the scaled score in one fma).
#include <cstdint>
#include "common/constants.h"
#include "common/dropout.h"
#include "common/mask.h"
#include "attention/score_mod.h"
#include "attention/params.h"

namespace attn_ext::cuda {

// kMods = false compiles the kernels without score modifiers (the verified paths: the
// modifier code is not even present); true applies them when the params ask.
template <typename acc_t, bool kMods>
struct ScoreMask {
  LocalBand band;
  MaskKind kind;
  const void* mask;  // at (b, h), row 0, key 0
  int64_t row_stride, col_stride;
  int64_t key_limit;  // keys >= key_limit are out of the sequence
  ScoreMod<acc_t> mod;

  // For (b, h) of the sequence `seq` (its rows and keys are relative to the sequence).
  // (kMods = false: the params' own key_offset and seqlen_k, read as the kernels did before.)
  __device__ ScoreMask(const AttentionParams& p, int64_t b, int64_t h, const SeqBounds& seq)
      : band{kMods ? seq.key_offset : p.key_offset, p.window_left, p.window_right},
        kind(p.mask_kind),
        mask(nullptr),
        row_stride(p.mask_row_stride),
        col_stride(p.mask_col_stride),
        key_limit(kMods ? seq.seqlen_k : p.seqlen_k) {
    if constexpr (kMods) mod = ScoreMod<acc_t>::make(p, b, h, seq.key_offset, acc_t(kLog2e));
    const int64_t off = b * p.mask_batch_stride + h * p.mask_head_stride;
    if (kind == MaskKind::kBool) mask = static_cast<const bool*>(p.mask) + off;
    if (kind == MaskKind::kAdditive) mask = static_cast<const acc_t*>(p.mask) + off;
  }

  __device__ bool modified() const { return kMods && mod.active(); }

  // True when no element of rows [r0, r1) x keys [c0, c1) needs a test or a modifier.
  __device__ bool tile_free(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    return kind == MaskKind::kNone && !modified() && c1 <= key_limit &&
           band.tile_unmasked(r0, r1, c0, c1);
  }

  // The log2-domain score of (row i, key j) from its raw dot product: raw * s_scale, the
  // modifiers, plus the additive mask in log2 units, -inf where the key is hidden. Without
  // modifiers the additive case is one fma (the product is not rounded before the mask is
  // added: one rounding fewer in fp32). With softcap, *dcap (when given) receives the
  // softcap's derivative for the backward.
  __device__ acc_t apply(acc_t raw, acc_t s_scale, int64_t i, int64_t j,
                         acc_t* dcap = nullptr) const {
    if (j >= key_limit) return -INFINITY;
    acc_t s;
    if (modified()) {
      s = raw * s_scale;
      if (mod.softcapped()) {
        s = mod.softcap(s);
        if (dcap != nullptr) *dcap = mod.softcap_grad(s);
      }
      if (mod.slope != acc_t(0)) s += mod.alibi(i, j);
      if (kind == MaskKind::kAdditive) s += mask_at<acc_t>(i, j) * acc_t(kLog2e);
      if (kind == MaskKind::kBool && !mask_at<bool>(i, j)) s = -INFINITY;
    } else if (kind == MaskKind::kAdditive) {
      s = fma(raw, s_scale, mask_at<acc_t>(i, j) * acc_t(kLog2e));
    } else {
      // (the bool test inside this branch, not after the if: hoisting it cost the tensor-core
      // kernel 46 more registers per thread)
      s = raw * s_scale;
      if (kind == MaskKind::kBool && !mask_at<bool>(i, j)) s = -INFINITY;
    }
    return band.allowed(i, j) ? s : acc_t(-INFINITY);
  }

 private:
  template <typename M>
  __device__ M mask_at(int64_t i, int64_t j) const {
    return static_cast<const M*>(mask)[i * row_stride + j * col_stride];
  }
};

// Dropout of one (b, h): the keep bit of (row i, key j), from the shared counter-based policy.
// Row i's stream is row_index() of the row (as on the CPU), (b * H + h) * rows + first + i:
// rows = Sq and first = 0 in a fixed-length batch, b = 0, rows = total_q and first = the
// sequence's first token in a varlen one (kVarlen = false: the former only).
template <bool kVarlen>
struct DropoutBits {
  DropoutPolicy policy;
  int64_t b, h, heads, rows, first;

  __device__ DropoutBits(const AttentionParams& p, int64_t b_, int64_t h_, const SeqBounds& seq)
      : policy{p.seed, p.rng_offset, static_cast<float>(p.dropout_p)},
        b(kVarlen && p.varlen() ? 0 : b_),
        h(h_),
        heads(p.heads),
        rows(kVarlen ? p.q_rows() : p.seqlen_q),
        first(kVarlen ? seq.q_begin : 0) {}

  __device__ bool active() const { return policy.active(); }
  // Bits of keys [4 g, 4 g + 4) of row i.
  __device__ uint32_t group(int64_t i, int64_t g) const {
    return policy.group_keep_bits(policy.row_id(b, h, first + i, heads, rows), g);
  }
  __device__ bool keep(int64_t i, int64_t j) const {
    return (group(i, j / kDrawsPerCounter) >> (j % kDrawsPerCounter)) & 1u;
  }
};

}  // namespace attn_ext::cuda
