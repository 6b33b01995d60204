#pragma once
// Applies the explicit mask, the local band and dropout to one score / probability tile.
// Scores are in the log2 domain, so an additive mask (natural-log units) is scaled by log2(e).
#include <cstdint>
#include <limits>
#include "../common/constants.h"
#include "../common/dropout.h"
#include "../common/mask.h"
#include "../common/params.h"

namespace attn_ext::cpu {

// s[r * lds + c] holds the score of query row i0 + r and key j0 + c.
template <typename acc_t>
void mask_tile(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t m,
               int64_t j0, int64_t n, bool band_partial, acc_t* s, int64_t lds) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const LocalBand band{p.key_offset, p.window_left, p.window_right};
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t base = b * p.mask_batch_stride + h * p.mask_head_stride;
    const int64_t cs = p.mask_col_stride;
    for (int64_t r = 0; r < m; ++r) {
      const int64_t off = base + (i0 + r) * p.mask_row_stride + j0 * cs;
      acc_t* row = s + r * lds;
      if (p.mask_kind == MaskKind::kBool) {
        const bool* mk = static_cast<const bool*>(p.mask) + off;
        for (int64_t c = 0; c < n; ++c)
          if (!mk[c * cs]) row[c] = kNegInf;
      } else {
        const acc_t* mk = static_cast<const acc_t*>(p.mask) + off;
        for (int64_t c = 0; c < n; ++c) row[c] += mk[c * cs] * acc_t(kLog2e);
      }
    }
  }
  if (band_partial) {
    for (int64_t r = 0; r < m; ++r) {
      acc_t* row = s + r * lds;
      for (int64_t c = 0; c < n; ++c)
        if (!band.allowed(i0 + r, j0 + c)) row[c] = kNegInf;
    }
  }
}

// keep[r * n + c] for the tile's rows and keys.
inline void dropout_tile(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t m,
                         int64_t j0, int64_t n, uint8_t* keep) {
  const DropoutPolicy drop{p.seed, p.rng_offset, static_cast<float>(p.dropout_p)};
  for (int64_t r = 0; r < m; ++r)
    drop.row_keep(drop.row_id(b, h, i0 + r, p.heads, p.seqlen_q), j0, n, keep + r * n);
}

// x[c] = keep[c] ? x[c] * keep_scale : 0
template <typename acc_t>
inline void apply_keep(acc_t* x, const uint8_t* keep, int64_t n, acc_t keep_scale) {
  for (int64_t c = 0; c < n; ++c) x[c] = keep[c] ? x[c] * keep_scale : acc_t(0);
}

}  // namespace attn_ext::cpu
