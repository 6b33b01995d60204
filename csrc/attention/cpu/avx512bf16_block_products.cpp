// The bf16 forward's block products on AVX512-BF16 (contracts in avx512bf16_block_products.h).
//
// Shapes: a micro-tile is kRows rows x two 16-wide column blocks (32 keys of S, or 32 features
// of O): 12 x 2 fp32 accumulators + 2 packed tile rows + 1 broadcast pair use 27 of AVX-512's 32
// registers, and each pair of tile-row loads feeds 24 vdpbf16ps, 32 multiply-adds each, twice
// the work of the fp32 kernels' FMAs per instruction. Column blocks are walked outermost, so
// the packed keys or values of one block pair (32 x D bf16, <= 16 KiB) stay in L1 while every
// row tile passes over them, as in the AVX-512 fp32 products.
//
// This file is compiled with the build's flags (AVX2) and switches to AVX-512/BF16 with a
// target pragma after its includes (wide_target_begin.h), as avx512_block_products.cpp does, so no
// inline function it shares with the rest of the library is ever emitted with these instructions;
// block_kernels() calls it only where available() holds.
#include "attention/cpu/avx512bf16_block_products.h"

#ifdef ATTN_EXT_AVX512BF16_PRODUCTS
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <immintrin.h>

#include "attention/cpu/row_tiles.h"

#define ATTN_EXT_WIDE_TARGET "avx512f,avx512bw,avx512bf16,fma"
#include "common/cpu/wide_target_begin.h"

namespace attn_ext::cpu::avx512bf16 {
namespace {

constexpr int kLanes = 16;  // fp32 lanes of a zmm: one packed tile row's 16 keys or features
constexpr int kRows = 12;
// A packed tile row: kLanes pairs of bf16 (64 bytes), kTileRows of them per tile.
constexpr int64_t kRowElems = 2 * kLanes;
// Of the 32 bf16 of a tile row, the even ones (the first element of each pair).
constexpr __mmask32 kFirstOfPairs = 0x55555555u;
// Row and column loops are unrolled before register allocation, or the accumulators land on
// the stack (see avx2_block_products.h).
#define ATTN_EXT_UNROLL _Pragma("GCC unroll 16")

inline __mmask16 lane_mask(int64_t cols) {
  return cols >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1u);
}

// Elements i, i + 1 of a bf16 row in all 16 lanes (one 32-bit broadcast).
inline __m512bh pair_broadcast(const uint16_t* x) {
  uint32_t w;
  std::memcpy(&w, x, sizeof(w));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
}

inline __m512bh load_row(const uint16_t* x) {
  return (__m512bh)_mm512_loadu_si512(x);
}

// acc[r][c] += sum over pairs t in [0, pairs) of a[r * lda + 2t, 2t + 1] . b_at(t, c), for R
// rows and C (1 or 2) column blocks: b_at(t, c) is the packed tile row of pair t, block c.
template <int R, int C, typename BAt>
__attribute__((always_inline)) inline void pair_product(const uint16_t* a, int64_t lda,
                                                        int64_t pairs, BAt b_at,
                                                        __m512 (&acc)[R][C]) {
  for (int64_t t = 0; t < pairs; ++t) {
    __m512bh b[C];
    ATTN_EXT_UNROLL
    for (int c = 0; c < C; ++c) b[c] = b_at(t, c);
    ATTN_EXT_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512bh x = pair_broadcast(a + r * lda + 2 * t);
      ATTN_EXT_UNROLL
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, b[c]);
    }
  }
}

template <int R, int C>
inline void zero(__m512 (&acc)[R][C]) {
  ATTN_EXT_UNROLL
  for (int r = 0; r < R; ++r) {
    ATTN_EXT_UNROLL
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
}

// Calls kernel(std::integral_constant<int, C>{}) with C = 2 when more than one block's worth of
// columns remain, else 1.
template <typename F>
inline void with_blocks(int64_t cols_left, F&& kernel) {
  if (cols_left > kLanes)
    kernel(std::integral_constant<int, 2>{});
  else
    kernel(std::integral_constant<int, 1>{});
}

// s[r][0..cols) = scale * q[r] . keys of the block pair at `keys` (block stride block_elems).
template <int R, int C>
inline void scores_micro(const uint16_t* q, int64_t ldq, const uint16_t* keys, int64_t block_elems,
                         int64_t pairs, __m512 scale, float* s, int64_t lds, int64_t cols) {
  __m512 acc[R][C];
  zero(acc);
  pair_product<R, C>(
      q, ldq, pairs,
      [&](int64_t t, int c) { return load_row(keys + c * block_elems + t * kRowElems); }, acc);
  ATTN_EXT_UNROLL
  for (int r = 0; r < R; ++r) {
    ATTN_EXT_UNROLL
    for (int c = 0; c < C; ++c)
      _mm512_mask_storeu_ps(s + r * lds + c * kLanes, lane_mask(cols - c * kLanes),
                            _mm512_mul_ps(acc[r][c], scale));
  }
}

// o[r][0..cols) = o[r] * factor[r] + p[r] . values of the feature-block pair starting at block
// `block` (value tiles: chunk stride chunk_elems).
template <int R, int C>
inline void pv_micro(const uint16_t* p, int64_t ldp, const uint16_t* values, int64_t chunk_elems,
                     int64_t n, const float* factor, float* o, int64_t ldo, int64_t cols) {
  // Pair t of the keys lives in chunk t / kTileRows, row t % kTileRows of each block's tile.
  const auto row_at = [&](int64_t t, int c) {
    return values + t / amx::kTileRows * chunk_elems + c * amx::kTileElems +
           t % amx::kTileRows * kRowElems;
  };
  __m512 acc[R][C];
  zero(acc);
  const int64_t whole = n / 2;
  pair_product<R, C>(p, ldp, whole, [&](int64_t t, int c) { return load_row(row_at(t, c)); }, acc);
  if (n % 2) {
    // The last pair holds key n - 1 and key n, which these rows must not see: its value row
    // may be NaN, and P's zero would not cancel it (0 * NaN is NaN).
    pair_product<R, C>(
        p + 2 * whole, ldp, 1,
        [&](int64_t, int c) {
          return (__m512bh)_mm512_maskz_mov_epi16(kFirstOfPairs,
                                                  _mm512_loadu_si512(row_at(whole, c)));
        },
        acc);
  }
  ATTN_EXT_UNROLL
  for (int r = 0; r < R; ++r) {
    ATTN_EXT_UNROLL
    for (int c = 0; c < C; ++c) {
      const __mmask16 lanes = lane_mask(cols - c * kLanes);
      float* dst = o + r * ldo + c * kLanes;
      const __m512 ov = _mm512_maskz_loadu_ps(lanes, dst);
      // The tile's sum is added once to the running output (see avx2::add_to_row for why).
      const __m512 res = factor ? _mm512_fmadd_ps(ov, _mm512_set1_ps(factor[r]), acc[r][c])
                                : _mm512_add_ps(ov, acc[r][c]);
      _mm512_mask_storeu_ps(dst, lanes, res);
    }
  }
}

}  // namespace

bool available() {
  // libgcc's check includes the OS: AVX-512 state must be enabled in XCR0, not only in CPUID.
  // AVX512-DQ for the shared row pass (avx512::exp2_shift_sum_bf16's vreduceps).
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
  return ok;
}

void scores(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* key_tiles, int64_t n,
            int64_t d, float scale, float* s, int64_t lds) {
  if (m <= 0 || n <= 0) return;
  // Features past d are zero in both q and the key tiles, so an odd d ends in a half-zero pair.
  const int64_t pairs = (d + 1) / 2;
  // The tiles of one block of 16 keys: round_up(d, 32) / 2 rows, one per feature pair.
  const int64_t block_elems = amx::round_up(d, amx::kPairDepth) * amx::kTileRows;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < n; g += 2 * kLanes) {
    const uint16_t* keys = key_tiles + g / kLanes * block_elems;
    const int64_t cols = std::min<int64_t>(2 * kLanes, n - g);
    with_blocks(cols, [&](auto blocks) {
      for_row_tiles<kRows>(m, [&](auto rows, int64_t r0) {
        scores_micro<decltype(rows)::value, decltype(blocks)::value>(
            q + r0 * ldq, ldq, keys, block_elems, pairs, sv, s + r0 * lds + g, lds, cols);
      });
    });
  }
}

void pv(const uint16_t* p_bf16, int64_t ldp, int64_t m, const uint16_t* value_tiles, int64_t n,
        int64_t dv, const float* factor, float* o, int64_t ldo) {
  if (m <= 0) return;
  // The tiles of one chunk of 32 keys: one per block of 16 features.
  const int64_t chunk_elems = amx::round_up(dv, amx::kAccCols) / amx::kAccCols * amx::kTileElems;
  for (int64_t c0 = 0; c0 < dv; c0 += 2 * kLanes) {
    const uint16_t* values = value_tiles + c0 / kLanes * amx::kTileElems;
    const int64_t cols = std::min<int64_t>(2 * kLanes, dv - c0);
    with_blocks(cols, [&](auto blocks) {
      for_row_tiles<kRows>(m, [&](auto rows, int64_t r0) {
        pv_micro<decltype(rows)::value, decltype(blocks)::value>(
            p_bf16 + r0 * ldp, ldp, values, chunk_elems, n, factor ? factor + r0 : nullptr,
            o + r0 * ldo + c0, ldo, cols);
      });
    });
  }
}

}  // namespace attn_ext::cpu::avx512bf16

#include "common/cpu/wide_target_end.h"

#endif  // ATTN_EXT_AVX512BF16_PRODUCTS
