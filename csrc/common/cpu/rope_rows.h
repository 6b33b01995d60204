#pragma once
// RoPE on rows of a (B, H, S, D) tensor: the per-position cos/sin table and the rotation
// of one row, shared by the rope op and the KV-cache append.
#include <cmath>
#include <cstdint>
#include <vector>
#include "common/rope.h"

namespace attn_ext::cpu {

// cos / sin of every pair's angle at `pos` (sin negated for the inverse rotation).
template <typename acc_t>
inline void rope_table(const RopePolicy& pol, const float* inv_freq, int64_t pos, bool inverse,
                       acc_t* cos_t, acc_t* sin_t) {
  for (int64_t i = 0; i < pol.pairs(); ++i) {
    const acc_t a = static_cast<acc_t>(RopePolicy::angle(pos, inv_freq[i]));
    cos_t[i] = std::cos(a);
    sin_t[i] = inverse ? -std::sin(a) : std::sin(a);
  }
}

// y = rope(x) for one row of D features with element strides xs / ys; y may be x (every pair
// is read before it is written). Features past rotary_dim are copied when y is not x.
template <typename scalar_t, typename acc_t>
inline void rope_row(const RopePolicy& pol, const scalar_t* x, int64_t xs, scalar_t* y, int64_t ys,
                     int64_t d, const acc_t* cos_t, const acc_t* sin_t) {
  for (int64_t i = 0; i < pol.pairs(); ++i) {
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
