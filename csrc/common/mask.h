#pragma once
// Mask policies shared by the CPU kernel, the CUDA kernel and the composite ops.
#include <algorithm>
#include <cstdint>
#include <c10/macros/Macros.h>

namespace attn_ext {

// The causal / sliding-window band. Query row i is aligned with key position
// i + key_offset (key_offset = Sk - Sq is bottom-right alignment) and sees keys in
// [i + key_offset - left, i + key_offset + right]; a negative bound is unbounded.
struct LocalBand {
  int64_t key_offset;
  int64_t left;
  int64_t right;

  C10_HOST_DEVICE bool has_left() const { return left >= 0; }
  C10_HOST_DEVICE bool has_right() const { return right >= 0; }

  C10_HOST_DEVICE bool allowed(int64_t i, int64_t j) const {
    const int64_t center = i + key_offset;
    return (!has_left() || j >= center - left) && (!has_right() || j <= center + right);
  }
  // First / one-past-last key any row in [row_begin, row_end) may see, clipped to [0, sk).
  C10_HOST_DEVICE int64_t key_begin(int64_t row_begin, int64_t sk) const {
    if (!has_left()) return 0;
    const int64_t b = row_begin + key_offset - left;
    return b < 0 ? 0 : (b > sk ? sk : b);
  }
  C10_HOST_DEVICE int64_t key_end(int64_t row_end, int64_t sk) const {
    if (!has_right()) return sk;
    const int64_t e = row_end - 1 + key_offset + right + 1;
    return e < 0 ? 0 : (e > sk ? sk : e);
  }
  // First / one-past-last query row that may see any key in [col_begin, col_end).
  C10_HOST_DEVICE int64_t row_begin(int64_t col_begin, int64_t sq) const {
    if (!has_right()) return 0;
    const int64_t b = col_begin - key_offset - right;
    return b < 0 ? 0 : (b > sq ? sq : b);
  }
  C10_HOST_DEVICE int64_t row_end(int64_t col_end, int64_t sq) const {
    if (!has_left()) return sq;
    const int64_t e = col_end - 1 - key_offset + left + 1;
    return e < 0 ? 0 : (e > sq ? sq : e);
  }
  // True when every (row, key) of the tile is inside the band, so no element test is needed.
  C10_HOST_DEVICE bool tile_unmasked(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    return (!has_left() || c0 >= (r1 - 1) + key_offset - left) &&
           (!has_right() || c1 - 1 <= r0 + key_offset + right);
  }
};

}  // namespace attn_ext
