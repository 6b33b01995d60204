#pragma once
// How the block products cover a block's rows with register-blocked micro-tiles (shared by the
// AVX2 and AVX-512 kernels, which differ in their full tile height).
#include <cstdint>
#include <type_traits>
#include <utility>

namespace attn_ext::cpu {

template <int R>
using Rows = std::integral_constant<int, R>;

// Features per partial dot product of a score: the scores kernels sum each q . k in chunks of
// kDotChunk features and add the chunk sums, so a score's rounding error grows like
// kDotChunk + D / kDotChunk terms rather than D. One FMA chain over all of D gave 1.6x torch's
// mean fp32 error at D = 256 and 1.9x at D = 512 (its BLAS sums in blocks); chunks of 64 left
// D = 64 at 1.14x, chunks of 32 bring every D from 64 to 512 to <= 0.97x (Zen 3, 2026-11-24;
// tests/test_accuracy.py). Cost: one load, add and store per accumulator per chunk, 12 of
// each per 384 FMAs of an AVX2 micro-tile, on the load/store and FP-add ports.
constexpr int64_t kDotChunk = 32;

namespace detail {
// kernel(Rows<rows>{}, r0) for a run-time rows in [1, sizeof...(I)].
template <typename F, int... I>
inline void call_rows(int64_t rows, F& kernel, int64_t r0, std::integer_sequence<int, I...>) {
  ((rows == I + 1 ? (kernel(Rows<I + 1>{}, r0), void()) : void()), ...);
}
}  // namespace detail

// Calls kernel(Rows<R>{}, r0) for tiles covering rows [0, m): tiles of kFull rows, then the
// rest. A tile of R rows keeps R * (vectors per row) independent FMA chains, and two FMA
// ports with 4-cycle latency need 8 in flight; a remainder of 1-3 rows after a full tile is
// therefore merged with it and split into two near-equal tiles (AVX2, kFull = 6: m = 128 ends
// 4 + 4, not 6 + 2: 96.2 vs 95.2 GFLOP/s for a 128 x 256 scores + P V tile pair at D = 64; a
// block of 7 rows: 87.5 vs 70.4; Zen 3 core).
template <int kFull, typename F>
inline void for_row_tiles(int64_t m, F&& kernel) {
  const int64_t rest = m % kFull;
  const int64_t full_end = m - rest - (rest > 0 && rest < 4 && m > kFull ? kFull : 0);
  int64_t r0 = 0;
  for (; r0 < full_end; r0 += kFull) kernel(Rows<kFull>{}, r0);
  const int64_t left = m - r0;  // 0 .. kFull - 1, or kFull + 1 .. kFull + 3 after a merge
  const auto heights = std::make_integer_sequence<int, kFull>{};
  if (left > kFull) {
    const int64_t first = (left + 1) / 2;
    detail::call_rows(first, kernel, r0, heights);
    detail::call_rows(left - first, kernel, r0 + first, heights);
  } else if (left > 0) {
    detail::call_rows(left, kernel, r0, heights);
  }
}

}  // namespace attn_ext::cpu
