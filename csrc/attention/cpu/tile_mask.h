#pragma once
// Applies the score modifiers, the explicit mask, the local band and dropout to one score /
// probability tile. Scores are in the log2 domain, so an additive mask (natural-log units) is
// scaled by log2(e) and the modifiers are built with unit log2(e).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <c10/util/Exception.h>
#include "common/constants.h"
#include "common/dropout.h"
#include "common/mask.h"
#include "attention/score_mod.h"
#include "attention/params.h"
#include "common/cpu/vec_math.h"

namespace attn_ext::cpu {

// One mask row onto n scores; key c's entry is mk[c * cs]. The column stride is 1 (a dense
// mask row) or 0 (a mask broadcast over keys) in practice, and both get a loop without
// branches: the generic strided loop ran at ~2.4 cycles per score, a quarter of the
// forward's time with a (B, 1, 1, Sk) padding mask.
template <typename acc_t>
inline void keep_row(acc_t* row, const bool* mk, int64_t n, int64_t cs) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  if (cs == 1) {
    int64_t c = 0;
#ifdef ATTN_EXT_AVX2
    if constexpr (std::is_same_v<acc_t, float>) {
      // 8 mask bytes widened to 32-bit lanes; a zero byte selects -inf.
      const __m256 neg_inf = _mm256_set1_ps(kNegInf);
      for (; c + avx2::kWidth <= n; c += avx2::kWidth) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mk + c));
        const __m256i drop =
            _mm256_cmpeq_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_setzero_si256());
        _mm256_storeu_ps(row + c, _mm256_blendv_ps(_mm256_loadu_ps(row + c), neg_inf,
                                                   _mm256_castsi256_ps(drop)));
      }
    }
#endif
    for (; c < n; ++c) row[c] = mk[c] ? row[c] : kNegInf;
  } else if (cs == 0) {
    if (!mk[0]) std::fill(row, row + n, kNegInf);
  } else {
    for (int64_t c = 0; c < n; ++c)
      if (!mk[c * cs]) row[c] = kNegInf;
  }
}

// row[c] += mask * log2(e) as one fma on every path, so a mask broadcast over keys and its
// materialized copy give the same bits; the mask in the accumulation type or q's
// reduced-precision type.
template <typename acc_t, typename mask_t>
inline void add_row(acc_t* row, const mask_t* mk, int64_t n, int64_t cs) {
  const acc_t log2e = static_cast<acc_t>(kLog2e);
  if (cs == 0) {
    const acc_t a = static_cast<acc_t>(mk[0]);
    for (int64_t c = 0; c < n; ++c) row[c] = std::fma(a, log2e, row[c]);
    return;
  }
  int64_t c = 0;
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float>) {
    if (cs == 1) {
      const __m256 l = _mm256_set1_ps(log2e);
      for (; c + avx2::kWidth <= n; c += avx2::kWidth) {
        _mm256_storeu_ps(row + c,
                         _mm256_fmadd_ps(avx2::load8(mk + c), l, _mm256_loadu_ps(row + c)));
      }
    }
  }
#endif
  for (; c < n; ++c) row[c] = std::fma(static_cast<acc_t>(mk[c * cs]), log2e, row[c]);
}

// Softcap and ALiBi on the tile's scores (before the masks); s[r * lds + c] holds the score of
// query row i0 + r and key j0 + c. With softcap, dcap (when given, m x n) receives the
// softcap's derivative for the backward. (ScoreMod's softcap and alibi in vector form:
// softcap_row, and the ALiBi distance formed in acc_t, exact below 2^24 positions in float.)
template <typename acc_t>
void modify_tile(const ScoreMod<acc_t>& mod, int64_t i0, int64_t m, int64_t j0, int64_t n, acc_t* s,
                 int64_t lds, acc_t* dcap = nullptr) {
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = s + r * lds;
    if (mod.softcapped()) {
      softcap_row(row, n, mod.cap);
      if (dcap != nullptr)
        for (int64_t c = 0; c < n; ++c) dcap[r * n + c] = mod.softcap_grad(row[c]);
    }
    if (mod.slope != acc_t(0)) {
      const acc_t base = static_cast<acc_t>(i0 + r + mod.key_offset - j0);  // distance at c = 0
      // (an int32 column converts to acc_t in vector registers, an int64 one does not on AVX2;
      // n is a tile width)
      const int32_t cols = static_cast<int32_t>(n);
      for (int32_t c = 0; c < cols; ++c)
        row[c] -= mod.slope * std::abs(base - static_cast<acc_t>(c));
    }
  }
}

// s[r * lds + c] holds the score of query row i0 + r and key j0 + c; mask rows are indexed
// by (b, h, i0 + r, j0 + c), the band by the sequence's rows and keys.
template <typename scalar_t, typename acc_t>
void mask_tile(const AttentionParams& p, const LocalBand& band, int64_t b, int64_t h, int64_t i0,
               int64_t m, int64_t j0, int64_t n, bool band_partial, acc_t* s, int64_t lds) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t base = b * p.mask_batch_stride + h * p.mask_head_stride;
    const int64_t cs = p.mask_col_stride;
    for (int64_t r = 0; r < m; ++r) {
      const int64_t off = base + (i0 + r) * p.mask_row_stride + j0 * cs;
      acc_t* row = s + r * lds;
      switch (p.mask_kind) {
        case MaskKind::kBool:
          keep_row(row, static_cast<const bool*>(p.mask) + off, n, cs);
          break;
        case MaskKind::kAdditive:
          add_row(row, static_cast<const acc_t*>(p.mask) + off, n, cs);
          break;
        case MaskKind::kAdditiveInput:
          if constexpr (!std::is_same_v<scalar_t, acc_t>) {
            add_row(row, static_cast<const scalar_t*>(p.mask) + off, n, cs);
            break;
          }
          [[fallthrough]];
        default:
          TORCH_CHECK(false, "mask_tile: mask kind ", static_cast<int>(p.mask_kind),
                      " is not readable for this dtype");
      }
    }
  }
  if (band_partial) {
    // Row i sees the keys [key_begin(i), key_end(i + 1)) of the band (band.allowed's test as a
    // range): the columns before and after it are filled, not tested one by one.
    for (int64_t r = 0; r < m; ++r) {
      acc_t* row = s + r * lds;
      const int64_t lo = std::clamp<int64_t>(band.key_begin(i0 + r, j0 + n) - j0, 0, n);
      const int64_t hi = std::clamp<int64_t>(band.key_end(i0 + r + 1, j0 + n) - j0, lo, n);
      std::fill(row, row + lo, kNegInf);
      std::fill(row + hi, row + n, kNegInf);
    }
  }
}

// keep[r * n + c] for the tile's rows and keys; row0 = row_index() of the tile's first row.
inline void dropout_tile(const AttentionParams& p, int64_t row0, int64_t m, int64_t j0, int64_t n,
                         uint8_t* keep) {
  const DropoutPolicy drop{p.seed, p.rng_offset, static_cast<float>(p.dropout_p)};
  for (int64_t r = 0; r < m; ++r)
    drop.row_keep(static_cast<uint64_t>(row0 + r), j0, n, keep + r * n);
}

// x[c] = keep[c] ? x[c] * keep_scale : 0
template <typename acc_t>
inline void apply_keep(acc_t* x, const uint8_t* keep, int64_t n, acc_t keep_scale) {
  for (int64_t c = 0; c < n; ++c) x[c] = keep[c] ? x[c] * keep_scale : acc_t(0);
}

}  // namespace attn_ext::cpu
