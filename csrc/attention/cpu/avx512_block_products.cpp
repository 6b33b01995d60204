// The packed block products on AVX-512 (contracts in block_kernels.h).
//
// Shapes: the panels are 16 floats wide, one zmm register. A micro-tile is R rows x P adjacent
// panels, R * P accumulators + P panel vectors + 1 broadcast within AVX-512's 32 registers:
// 8 x 3 (28 registers; 8 broadcasts and 3 panel loads per 24 FMAs) while three or more panels
// remain, 12 x 2 (27; 12 + 2 loads per 24 FMAs) for the last two, and 12 x 1 for a lone panel.
// Four panels left take two 12 x 2 tiles rather than 8 x 3 and a lone panel. 8 x 3 against
// 12 x 2 (Sapphire Rapids VM, 2026-11-27, dev/cpu_forward_experiments.md): the loop alone
// 1.10-1.15x, the three products on a 128 x 256 tile at D 128 1.02-1.09x, the whole fp32
// forward 1.02-1.05x and forward + backward 1.03-1.07x.
//
// Exactness: each output element is the same chain of fused multiply-adds over k, in the
// same order, as in the AVX2 kernels; partial panels use masked loads and stores where the
// AVX2 kernels use a scalar std::fma loop, which rounds the same way.
//
// This file is compiled with the build's flags (AVX2) and switches to AVX-512 with a target
// pragma after its includes (wide_target_begin.h), so no inline function it shares with the rest of
// the library is ever emitted with AVX-512 code; block_kernels() calls it only on CPUs with
// AVX-512F.
#include "attention/cpu/avx512_block_products.h"

#ifdef ATTN_EXT_AVX512_PRODUCTS
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention/cpu/row_tiles.h"

#define ATTN_EXT_WIDE_TARGET "avx512f,fma"
#include "common/cpu/wide_target_begin.h"

namespace attn_ext::cpu::avx512 {
namespace {

constexpr int kLanes = 16;  // one zmm holds one row of a 16-wide panel
// Rows of a full micro-tile of P panels (see the file comment).
template <int P>
constexpr int kTileRows = P == 3 ? 8 : 12;
// Row and panel loops are unrolled before register allocation, or the accumulators land on
// the stack (see avx2_block_products.h).
#define ATTN_EXT_UNROLL _Pragma("GCC unroll 16")

inline __mmask16 lane_mask(int64_t cols) {
  return cols >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1u);
}

// acc[r][c] = sum_k a[r * row_stride + k * k_stride] * panel_c[k][0..16), panel_c at
// panel + c * panel_offset, for R rows and P (1 or 2) panels.
template <int R, int P>
__attribute__((always_inline)) inline void panel_product(const float* a, int64_t row_stride,
                                                         int64_t k_stride, const float* panel,
                                                         int64_t panel_offset, int64_t k_len,
                                                         __m512 (&acc)[R][P]) {
  ATTN_EXT_UNROLL
  for (int r = 0; r < R; ++r) {
    ATTN_EXT_UNROLL
    for (int c = 0; c < P; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 b[P];
    ATTN_EXT_UNROLL
    for (int c = 0; c < P; ++c) b[c] = _mm512_loadu_ps(panel + c * panel_offset + k * kLanes);
    ATTN_EXT_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * row_stride + k * k_stride]);
      ATTN_EXT_UNROLL
      for (int c = 0; c < P; ++c) acc[r][c] = _mm512_fmadd_ps(x, b[c], acc[r][c]);
    }
  }
}

// o[0..cols) = o * f + acc (f = 1 when factor is null), cols <= 16; the tile's sum is added
// once to the running output (see avx2::add_to_row for why).
inline void add_to_row(float* o, const float* factor, __m512 acc, int64_t cols) {
  const __mmask16 lanes = lane_mask(cols);
  const __m512 ov = _mm512_maskz_loadu_ps(lanes, o);
  const __m512 r =
      factor ? _mm512_fmadd_ps(ov, _mm512_set1_ps(*factor), acc) : _mm512_add_ps(ov, acc);
  _mm512_mask_storeu_ps(o, lanes, r);
}

// Covers columns [0, total) with micro-tile column groups: kernel(panels, col0, cols) for each,
// panels an std::integral_constant<int, P> (P = 3 while three or more 16-wide panels remain, but
// 2 of 4, so that no lone panel is left; else the 2 or 1 left), col0 the group's first column
// and cols its columns within total.
template <typename F>
inline void for_panel_groups(int64_t total, F&& kernel) {
  for (int64_t col0 = 0; col0 < total;) {
    const int64_t left = total - col0, panels_left = (left + kLanes - 1) / kLanes;
    const int panels = panels_left == 4 ? 2 : int(std::min<int64_t>(panels_left, 3));
    const int64_t cols = std::min<int64_t>(panels * kLanes, left);
    switch (panels) {
      case 3:
        kernel(std::integral_constant<int, 3>{}, col0, cols);
        break;
      case 2:
        kernel(std::integral_constant<int, 2>{}, col0, cols);
        break;
      default:
        kernel(std::integral_constant<int, 1>{}, col0, cols);
    }
    col0 += panels * kLanes;
  }
}

// The scores summed in chunks of kDotChunk features, the partial sums kept in s, exactly as
// avx2::scores_micro does.
template <int R, int P>
inline void scores_micro(const float* q, int64_t ldq, const float* panel, int64_t panel_offset,
                         int64_t d, __m512 scale, float* s, int64_t lds) {
  __m512 acc[R][P];
  panel_product<R, P>(q, ldq, 1, panel, panel_offset, std::min(d, kDotChunk), acc);
  const bool single = d <= kDotChunk;
  ATTN_EXT_UNROLL
  for (int r = 0; r < R; ++r) {
    ATTN_EXT_UNROLL
    for (int c = 0; c < P; ++c)
      _mm512_storeu_ps(s + r * lds + c * kLanes,
                       single ? _mm512_mul_ps(acc[r][c], scale) : acc[r][c]);
  }
  for (int64_t f0 = kDotChunk; f0 < d; f0 += kDotChunk) {
    panel_product<R, P>(q + f0, ldq, 1, panel + f0 * kLanes, panel_offset,
                        std::min(kDotChunk, d - f0), acc);
    const bool last = f0 + kDotChunk >= d;
    ATTN_EXT_UNROLL
    for (int r = 0; r < R; ++r) {
      ATTN_EXT_UNROLL
      for (int c = 0; c < P; ++c) {
        float* dst = s + r * lds + c * kLanes;
        const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(dst), acc[r][c]);
        _mm512_storeu_ps(dst, last ? _mm512_mul_ps(sum, scale) : sum);
      }
    }
  }
}

template <int R, int P>
inline void pv_micro(const float* p, int64_t ldp, const float* panel, int64_t panel_stride,
                     int64_t n, const float* factor, float* o, int64_t ldo, int64_t cols) {
  __m512 acc[R][P];
  panel_product<R, P>(p, ldp, 1, panel, panel_stride, n, acc);
  ATTN_EXT_UNROLL
  for (int r = 0; r < R; ++r) {
    ATTN_EXT_UNROLL
    for (int c = 0; c < P; ++c)
      add_to_row(o + r * ldo + c * kLanes, factor ? factor + r : nullptr, acc[r][c],
                 cols - c * kLanes);
  }
}

template <int R, int P>
inline void atb_micro(const float* a, int64_t lda, const float* panel, int64_t panel_stride,
                      int64_t m, float* c, int64_t ldc, int64_t cols) {
  __m512 acc[R][P];
  panel_product<R, P>(a, 1, lda, panel, panel_stride, m, acc);
  ATTN_EXT_UNROLL
  for (int i = 0; i < R; ++i) {
    ATTN_EXT_UNROLL
    for (int j = 0; j < P; ++j)
      add_to_row(c + i * ldc + j * kLanes, nullptr, acc[i][j], cols - j * kLanes);
  }
}

}  // namespace

void scores_tile(const float* q, int64_t ldq, int64_t m, const float* key_panels, int64_t n,
                 int64_t d, float scale, float* s, int64_t lds) {
  const __m512 sv = _mm512_set1_ps(scale);
  const int64_t panel_offset = d * kLanes;
  // A group's key panels (up to 3 x d x 16 floats) stay in L1 while every row tile passes over
  // them.
  for_panel_groups(n, [&](auto panels, int64_t col0, int64_t) {
    constexpr int P = decltype(panels)::value;
    for_row_tiles<kTileRows<P>>(m, [&](auto rows, int64_t r0) {
      scores_micro<decltype(rows)::value, P>(q + r0 * ldq, ldq, key_panels + col0 * d, panel_offset,
                                             d, sv, s + r0 * lds + col0, lds);
    });
  });
}

void pv_tile(const float* p, int64_t ldp, int64_t m, const float* value_panels,
             int64_t panel_stride, int64_t n, int64_t dv, const float* factor, float* o,
             int64_t ldo) {
  for_panel_groups(dv, [&](auto panels, int64_t col0, int64_t cols) {
    constexpr int P = decltype(panels)::value;
    const float* panel = value_panels + col0 / kLanes * panel_stride;
    for_row_tiles<kTileRows<P>>(m, [&](auto rows, int64_t r0) {
      pv_micro<decltype(rows)::value, P>(p + r0 * ldp, ldp, panel, panel_stride, n,
                                         factor ? factor + r0 : nullptr, o + r0 * ldo + col0, ldo,
                                         cols);
    });
  });
}

void atb_tile(const float* a, int64_t lda, int64_t m, int64_t n, const float* b_panels,
              int64_t panel_stride, int64_t dc, float* c, int64_t ldc) {
  for_panel_groups(dc, [&](auto panels, int64_t col0, int64_t cols) {
    constexpr int P = decltype(panels)::value;
    const float* panel = b_panels + col0 / kLanes * panel_stride;
    for_row_tiles<kTileRows<P>>(n, [&](auto rows, int64_t i0) {
      atb_micro<decltype(rows)::value, P>(a + i0, lda, panel, panel_stride, m, c + i0 * ldc + col0,
                                          ldc, cols);
    });
  });
}

}  // namespace attn_ext::cpu::avx512

#include "common/cpu/wide_target_end.h"

#endif  // ATTN_EXT_AVX512_PRODUCTS
