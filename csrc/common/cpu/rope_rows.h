#pragma once
// RoPE on rows of a (B, H, S, D) tensor: the per-position cos/sin table and the rotation
// of one row, shared by the rope op and the KV-cache append.
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>
#include "common/rope.h"
#include "common/cpu/vec_math.h"

namespace attn_ext::cpu {

// cos / sin of every pair's angle at `pos` times the policy's attention_scaling (sin negated
// for the inverse rotation: the backward of a scaled rotation is the scaled inverse one).
template <typename acc_t>
inline void rope_table(const RopePolicy& pol, const float* inv_freq, int64_t pos, bool inverse,
                       acc_t* cos_t, acc_t* sin_t) {
  const acc_t scaling = static_cast<acc_t>(pol.attention_scaling);
  for (int64_t i = 0; i < pol.pairs(); ++i) {
    const acc_t a = static_cast<acc_t>(RopePolicy::angle(pos, inv_freq[i]));
    cos_t[i] = std::cos(a) * scaling;
    sin_t[i] = (inverse ? -std::sin(a) : std::sin(a)) * scaling;
  }
}

#ifdef ATTN_EXT_AVX2
// Pairs [0, returned) of a row with unit strides, 8 lanes at a time, in float: rotate_pair's
// FMAs (common/rope.h), so the same bits as the scalar loop. Half-split pairs (i, i + pairs)
// take 8 pairs a step; interleaved ones (2i, 2i + 1) 4, with cos / sin duplicated per pair and
// fmaddsub forming x0 c - x1 s in the even lanes and x1 c + x0 s in the odd ones. Each step
// loads before it stores, so y may be x. (bf16 rows through the scalar loop: 1.2 ms at
// (1, 32, 512, 128), slower than transformers' unfused rotation; docs/performance.md.)
template <typename scalar_t>
inline int64_t rope_row_avx2(const RopePolicy& pol, const scalar_t* x, scalar_t* y,
                             const float* cos_t, const float* sin_t) {
  using avx2::kWidth;
  const int64_t pairs = pol.pairs();
  if (!pol.interleaved) {
    const int64_t n = pairs / kWidth * kWidth;
    for (int64_t i = 0; i < n; i += kWidth) {
      const __m256 x0 = avx2::load8(x + i), x1 = avx2::load8(x + pairs + i);
      const __m256 c = _mm256_loadu_ps(cos_t + i), s = _mm256_loadu_ps(sin_t + i);
      avx2::store8(y + i, _mm256_fmsub_ps(x0, c, _mm256_mul_ps(x1, s)));
      avx2::store8(y + pairs + i, _mm256_fmadd_ps(x1, c, _mm256_mul_ps(x0, s)));
    }
    return n;
  }
  constexpr int64_t kPairs = kWidth / 2;
  const int64_t n = pairs / kPairs * kPairs;
  for (int64_t i = 0; i < n; i += kPairs) {
    const __m256 v = avx2::load8(x + 2 * i);
    const __m128 c4 = _mm_loadu_ps(cos_t + i), s4 = _mm_loadu_ps(sin_t + i);
    const __m256 c = _mm256_set_m128(_mm_unpackhi_ps(c4, c4), _mm_unpacklo_ps(c4, c4));
    const __m256 s = _mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4));
    const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // each pair's two features exchanged
    avx2::store8(y + 2 * i, _mm256_fmaddsub_ps(v, c, _mm256_mul_ps(swapped, s)));
  }
  return n;
}
#endif

// y = rope(x) for one row of D features with element strides xs / ys; y may be x (every pair
// is read before it is written). Features past rotary_dim are copied when y is not x.
template <typename scalar_t, typename acc_t>
inline void rope_row(const RopePolicy& pol, const scalar_t* x, int64_t xs, scalar_t* y, int64_t ys,
                     int64_t d, const acc_t* cos_t, const acc_t* sin_t) {
  int64_t i = 0;
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float>) {
    if (xs == 1 && ys == 1) i = rope_row_avx2(pol, x, y, cos_t, sin_t);
  }
#endif
  for (; i < pol.pairs(); ++i) {
    const int64_t f = pol.first(i), s = pol.second(i);
    acc_t y0, y1;
    rotate_pair(static_cast<acc_t>(x[f * xs]), static_cast<acc_t>(x[s * xs]), cos_t[i], sin_t[i],
                &y0, &y1);
    y[f * ys] = static_cast<scalar_t>(y0);
    y[s * ys] = static_cast<scalar_t>(y1);
  }
  if (y != x) {
    for (int64_t j = pol.rotary_dim; j < d; ++j) y[j * ys] = x[j * xs];
  }
}

// The fp32 frequencies of every pair.
inline std::vector<float> rope_inv_freq(const RopePolicy& pol) {
  std::vector<float> f(static_cast<size_t>(pol.pairs()));
  for (int64_t i = 0; i < pol.pairs(); ++i) f[i] = pol.inv_freq(i);
  return f;
}

}  // namespace attn_ext::cpu
