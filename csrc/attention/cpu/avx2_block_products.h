#pragma once
// The flash kernels' block products as AVX2/FMA register-blocked kernels on packed operands.
//
// Why not BLAS: each query block of the forward multiplies the same keys and values as the
// head's other query blocks (and each key block of the backward the same K/V as all its
// query tiles), but a BLAS call repacks both operands on every call (~10% of the forward on
// a Zen 3 core, measured with perf) and writes C with beta = 0 before the softmax reads it
// again. Here operands are packed into 16-wide panels once per reuse, the score scale is
// applied in registers, and the forward's online-softmax rescale is folded into P V.
//
// Shapes: a micro-tile is kRows rows x kCols (two 8-lane vectors) columns; 12 accumulators
// + 2 panel vectors + 1 broadcast use 15 of AVX2's 16 vector registers, and each panel load
// feeds kRows FMAs, so the loop is bound by the two FMA ports (~97 GFLOP/s per core on
// L2-resident tiles, vs 76-83 for MKL's sgemm on the same tiles).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <immintrin.h>

#include "attention/cpu/key_rows.h"
#include "attention/cpu/row_tiles.h"
#include "common/cpu/vec_math.h"

namespace attn_ext::cpu::avx2 {

constexpr int kRows = 6;
// The row loops must be unrolled before GCC decides where the accumulator array lives:
// left to -O3 alone it kept acc[][] on the stack and stored it every iteration (a third
// of the FMA rate, measured).
#define ATTN_EXT_UNROLL_ROWS _Pragma("GCC unroll 8")
constexpr int kCols = 16;

inline int64_t round_up_cols(int64_t n) {
  return (n + kCols - 1) / kCols * kCols;
}

// Rows r[0..8) (8 keys x 8 features) become r[f] = feature f of the 8 keys.
inline void transpose8x8(__m256 (&r)[8]) {
  // Pairs of rows interleaved, then quads, then the 128-bit halves exchanged.
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    const __m256 lo01 = t[4 * i], hi01 = t[4 * i + 1], lo23 = t[4 * i + 2], hi23 = t[4 * i + 3];
    u[4 * i] = _mm256_shuffle_ps(lo01, lo23, _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(lo01, lo23, _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(hi01, hi23, _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(hi01, hi23, _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int f = 0; f < 4; ++f) {
    r[f] = _mm256_permute2f128_ps(u[f], u[f + 4], 0x20);
    r[f + 4] = _mm256_permute2f128_ps(u[f], u[f + 4], 0x31);
  }
}

// Keys [0, n) of rows k (strided or paged, key_rows.h) as panels of kCols keys: panel g holds, for
// each feature d, keys g * kCols .. g * kCols + 15 (zero past n). dst holds round_up_cols(n) * d.
// Panels move as 8 x 8 register transposes (the element-wise loop was ~4% of the fp32
// forward at S = 512, where four query blocks share a head's panels); a partial panel
// transposes zeros for its missing keys (element-wise it was 5% of an fp32 fwd+bwd at S = 8,
// docs/performance.md, "Per-call overhead"). Features past a multiple of 8 take the
// element-wise loop.
// One panel of w <= kCols keys, key c's row at rows(c).
template <typename scalar_t, typename Rows>
inline void pack_key_panel(Rows rows, int64_t w, int64_t d, float* panel) {
  const int64_t d_vec = d / kWidth * kWidth;
  int64_t f0 = 0;
  for (; f0 < d_vec; f0 += kWidth) {
    for (int64_t half = 0; half < kCols; half += kWidth) {
      __m256 r[kWidth];
      ATTN_EXT_UNROLL_ROWS
      for (int c = 0; c < kWidth; ++c)
        r[c] = half + c < w ? load8(rows(half + c) + f0) : _mm256_setzero_ps();
      transpose8x8(r);
      ATTN_EXT_UNROLL_ROWS
      for (int f = 0; f < kWidth; ++f) _mm256_storeu_ps(panel + (f0 + f) * kCols + half, r[f]);
    }
  }
  float row[kCols];
  for (int64_t f = f0; f < d; ++f) {
    for (int64_t c = 0; c < w; ++c) row[c] = static_cast<float>(rows(c)[f]);
    for (int64_t c = w; c < kCols; ++c) row[c] = 0.f;
    std::copy(row, row + kCols, panel + f * kCols);
  }
}

// Strided rows are addressed from the group's first row (as many registers as the compiler
// likes); paged ones through the group's pointers (KeyRows::fill; the pointer array costs
// strided rows 7-20% of their packing, dev/paged_varlen/notes.md).
template <typename scalar_t>
void pack_key_panels(const KeyRows<scalar_t>& k, int64_t n, int64_t d, float* dst) {
  const scalar_t* key[kCols];
  for (int64_t g = 0; g < n; g += kCols) {
    const int64_t w = std::min<int64_t>(kCols, n - g);
    if (k.pages == nullptr) {
      const scalar_t* first = k.base + g * k.ld;
      const int64_t ld = k.ld;
      pack_key_panel<scalar_t>([=](int64_t c) { return first + c * ld; }, w, d, dst + g * d);
    } else {
      k.fill(g, w, key);
      pack_key_panel<scalar_t>([&](int64_t c) { return key[c]; }, w, d, dst + g * d);
    }
  }
}
template <typename scalar_t>
void pack_key_panels(const scalar_t* k, int64_t ld, int64_t n, int64_t d, float* dst) {
  pack_key_panels(strided_rows(k, ld), n, d, dst);
}

// Values [0, n) of rows v (strided or paged) as column panels: panel c (stride panel_stride)
// holds, for each key j, features c * kCols .. c * kCols + 15 (zero past dv). Rows are taken
// kCols at a time, each group into all its panels. Whole panels move as two 8-lane loads and
// stores per row: the copy through a scratch row compiled to a
// memcpy and a memset call per 64 bytes, and the backward packs each query tile's Q and dO once
// per key block (fp32 forward + backward 1.03-1.04x at D 128, 2026-11-27).
template <typename scalar_t>
void pack_value_panels(const KeyRows<scalar_t>& v, int64_t n, int64_t dv, float* dst,
                       int64_t panel_stride) {
  float row[kCols];
  const scalar_t* value[kCols];  // a group of rows, looked up once for all their panels
  for (int64_t g = 0; g < n; g += kCols) {
    const int64_t w = std::min<int64_t>(kCols, n - g);
    v.fill(g, w, value);
    for (int64_t c0 = 0; c0 < dv; c0 += kCols) {
      float* panel = dst + (c0 / kCols) * panel_stride + g * kCols;
      const int64_t cols = std::min<int64_t>(kCols, dv - c0);
      if (cols == kCols) {
        for (int64_t j = 0; j < w; ++j) {
          _mm256_storeu_ps(panel + j * kCols, load8(value[j] + c0));
          _mm256_storeu_ps(panel + j * kCols + kWidth, load8(value[j] + c0 + kWidth));
        }
        continue;
      }
      for (int64_t j = 0; j < w; ++j) {
        load_row(value[j] + c0, row, cols, 1.f);
        for (int64_t c = cols; c < kCols; ++c) row[c] = 0.f;
        std::copy(row, row + kCols, panel + j * kCols);
      }
    }
  }
}
template <typename scalar_t>
void pack_value_panels(const scalar_t* v, int64_t ld, int64_t n, int64_t dv, float* dst,
                       int64_t panel_stride) {
  pack_value_panels(strided_rows(v, ld), n, dv, dst, panel_stride);
}

// acc[r] = sum_k a[r * row_stride + k * k_stride] * panel[k][0..16) for R rows: the one
// register-blocked loop behind all three products (A read by rows, or transposed).
template <int R>
__attribute__((always_inline)) inline void panel_product(const float* a, int64_t row_stride,
                                                         int64_t k_stride, const float* panel,
                                                         int64_t k_len, __m256 (&acc)[R][2]) {
  ATTN_EXT_UNROLL_ROWS
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kCols);
    const __m256 b1 = _mm256_loadu_ps(panel + k * kCols + 8);
    ATTN_EXT_UNROLL_ROWS
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * row_stride + k * k_stride);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
}

// s[r][0..16) = scale * (q[r] . key panel columns) for R rows, the dot products summed in
// chunks of kDotChunk features (row_tiles.h): ((c_0 + c_1) + ...) * scale, the partial sums
// kept in s. The AVX-512 kernel adds the same chunks in the same order.
template <int R>
inline void scores_micro(const float* q, int64_t ldq, const float* panel, int64_t d, __m256 scale,
                         float* s, int64_t lds) {
  __m256 acc[R][2];
  panel_product<R>(q, ldq, 1, panel, std::min(d, kDotChunk), acc);
  if (d <= kDotChunk) {
    ATTN_EXT_UNROLL_ROWS
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * lds, _mm256_mul_ps(acc[r][0], scale));
      _mm256_storeu_ps(s + r * lds + 8, _mm256_mul_ps(acc[r][1], scale));
    }
    return;
  }
  ATTN_EXT_UNROLL_ROWS
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * lds, acc[r][0]);
    _mm256_storeu_ps(s + r * lds + 8, acc[r][1]);
  }
  for (int64_t f0 = kDotChunk; f0 < d; f0 += kDotChunk) {
    panel_product<R>(q + f0, ldq, 1, panel + f0 * kCols, std::min(kDotChunk, d - f0), acc);
    const bool last = f0 + kDotChunk >= d;
    ATTN_EXT_UNROLL_ROWS
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        float* dst = s + r * lds + h * kWidth;
        const __m256 sum = _mm256_add_ps(_mm256_loadu_ps(dst), acc[r][h]);
        _mm256_storeu_ps(dst, last ? _mm256_mul_ps(sum, scale) : sum);
      }
    }
  }
}

// o[0..cols) = o * f + acc (f = 1 when factor is null), cols <= kCols: the tile's sum is
// formed on its own and added once; accumulating onto the (larger) running output would
// round every term at the output's magnitude (2.3x torch's fp32 error tail, measured).
inline void add_to_row(float* o, const float* factor, __m256 acc0, __m256 acc1, int64_t cols) {
  if (cols == kCols) {
    const __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8);
    if (factor) {
      const __m256 f = _mm256_broadcast_ss(factor);
      _mm256_storeu_ps(o, _mm256_fmadd_ps(o0, f, acc0));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(o1, f, acc1));
    } else {
      _mm256_storeu_ps(o, _mm256_add_ps(o0, acc0));
      _mm256_storeu_ps(o + 8, _mm256_add_ps(o1, acc1));
    }
    return;
  }
  alignas(32) float t[kCols];
  _mm256_store_ps(t, acc0);
  _mm256_store_ps(t + 8, acc1);
  const float f = factor ? *factor : 1.f;
  for (int64_t c = 0; c < cols; ++c) o[c] = std::fma(o[c], f, t[c]);
}

// o[r][0..cols) = o[r] * factor[r] + p[r][0..n) . value panel, for R rows.
template <int R>
inline void pv_micro(const float* p, int64_t ldp, const float* panel, int64_t n,
                     const float* factor, float* o, int64_t ldo, int64_t cols) {
  __m256 acc[R][2];
  panel_product<R>(p, ldp, 1, panel, n, acc);
  ATTN_EXT_UNROLL_ROWS
  for (int r = 0; r < R; ++r)
    add_to_row(o + r * ldo, factor ? factor + r : nullptr, acc[r][0], acc[r][1], cols);
}

// c[i][0..cols) += sum_r a[r][i] * panel[r], for R output rows i (columns of a).
template <int R>
inline void atb_micro(const float* a, int64_t lda, const float* panel, int64_t m, float* c,
                      int64_t ldc, int64_t cols) {
  __m256 acc[R][2];
  panel_product<R>(a, 1, lda, panel, m, acc);
  ATTN_EXT_UNROLL_ROWS
  for (int i = 0; i < R; ++i) add_to_row(c + i * ldc, nullptr, acc[i][0], acc[i][1], cols);
}

// S[m x round_up_cols(n)] = scale * Q K^T over consecutive key panels (stride d * kCols).
// Columns past n hold scores of the zero padding keys; callers read only [0, n).
inline void scores_tile(const float* q, int64_t ldq, int64_t m, const float* key_panels, int64_t n,
                        int64_t d, float scale, float* s, int64_t lds) {
  const __m256 sv = _mm256_set1_ps(scale);
  // One key panel (d x 16) stays in L1 while every row tile of the block passes over it.
  for (int64_t g = 0; g < n; g += kCols) {
    const float* panel = key_panels + g * d;
    for_row_tiles<kRows>(m, [&](auto rows, int64_t r0) {
      scores_micro<decltype(rows)::value>(q + r0 * ldq, ldq, panel, d, sv, s + r0 * lds + g, lds);
    });
  }
}

// O[m x dv] = O * factor[row] + P[m x n] V over value panels (factor null: 1).
inline void pv_tile(const float* p, int64_t ldp, int64_t m, const float* value_panels,
                    int64_t panel_stride, int64_t n, int64_t dv, const float* factor, float* o,
                    int64_t ldo) {
  // One value panel (n x 16) stays in L1 while every row tile of the block passes over it.
  for (int64_t c0 = 0; c0 < dv; c0 += kCols) {
    const float* panel = value_panels + (c0 / kCols) * panel_stride;
    const int64_t cols = std::min<int64_t>(kCols, dv - c0);
    for_row_tiles<kRows>(m, [&](auto rows, int64_t r0) {
      pv_micro<decltype(rows)::value>(p + r0 * ldp, ldp, panel, n, factor ? factor + r0 : nullptr,
                                      o + r0 * ldo + c0, ldo, cols);
    });
  }
}

// C[n x dc] += A[m x n]^T B[m x dc], B as value panels (the backward's dV and dK).
inline void atb_tile(const float* a, int64_t lda, int64_t m, int64_t n, const float* b_panels,
                     int64_t panel_stride, int64_t dc, float* c, int64_t ldc) {
  for (int64_t c0 = 0; c0 < dc; c0 += kCols) {
    const float* panel = b_panels + (c0 / kCols) * panel_stride;
    const int64_t cols = std::min<int64_t>(kCols, dc - c0);
    for_row_tiles<kRows>(n, [&](auto rows, int64_t i0) {
      atb_micro<decltype(rows)::value>(a + i0, lda, panel, m, c + i0 * ldc + c0, ldc, cols);
    });
  }
}

}  // namespace attn_ext::cpu::avx2
