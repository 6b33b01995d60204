#pragma once
// The decode step's two products for a block of few query rows (a KV head's G query heads
// times the new tokens, G * Sq <= kMaxDecodeRows), computed on the cache rows where they lie:
// each key tile is a list of row pointers, so a contiguous cache and a paged one of any page
// size run the same arithmetic in the same order and give the same bits.
//
// Why not BLAS: with a few query rows the step only streams the cache, and the paged cache's
// rows are scattered. Gathering 16-row pages into a tile for the GEMM cost 1.26-1.33x the
// contiguous step (docs/performance.md, "Paged cache (CPU)"): the copy waits on DRAM, then the
// GEMM reads the copy. Here each row is read once, straight into the FMAs; bf16 / fp16 rows
// are widened in registers instead of into a buffer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <c10/util/Exception.h>

#include "common/cpu/vec_math.h"

#ifdef ATTN_EXT_AVX2
#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/row_tiles.h"

namespace attn_ext::cpu::avx2 {

// Rows per block that take these kernels: up to 8 accumulators, one per query row, plus the
// key (or value) vectors and a broadcast fit AVX2's 16 registers. Larger blocks reuse each
// cache row enough for the GEMM's packing to pay.
constexpr int64_t kMaxDecodeRows = 8;
// Value rows per pass of P V: each pass walks the output columns in register-sized chunks
// over the same rows, so the rows (32 x 512 B of fp32 at D = 128) stay in L1 between chunks.
constexpr int64_t kPvRowRun = 32;

// How far ahead decode_scores asks for a paged cache's key rows, in bytes of keys (32 rows of
// bf16 at D = 128).
constexpr int64_t kKeyAheadBytes = 8192;

// Asks for the lines of a row into L2 (no wait for them).
inline void prefetch_row_l2(const void* row, int64_t bytes) {
  const char* c = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += kCacheLine) _mm_prefetch(c + b, _MM_HINT_T1);
}

// s[r * lds + j] = q_r . keys[j][0..d) for r < M, j < n: per (r, j), 8 lanes of FMAs over
// d in order (lane = feature mod 8), summed by hsum, then the tail features in order.
// Meanwhile value row j (dv features) is prefetched into L2 for decode_pv: its DRAM reads then
// overlap these FMAs instead of following them (fp32 contiguous step, B 1, ctx 16k, Zen 3:
// 15.2 -> 9.5 ms). With `keys_ahead`, 16-bit key rows are prefetched kKeyAheadBytes ahead
// too. On a Zen 5 VM (2026-11-29, H 32, Hkv 8, D 128) that took the bf16 step through pages of
// 16 rows (where the hardware prefetcher loses the stream at every page) from 1.7-1.8x the
// contiguous cache's to 1.1-1.3x, and the contiguous bf16 step with 128-key tiles 5-9% faster
// (cold caches); fp32 rows moved -8% to +7% through pages and lost up to 4% contiguous, so they
// keep the hardware's.
template <int M, typename scalar_t>
inline void decode_scores(const float* q, int64_t ldq, const scalar_t* const* keys, int64_t n,
                          int64_t d, float* s, int64_t lds, const scalar_t* const* values,
                          int64_t dv, bool keys_ahead) {
  const int64_t d8 = d / kWidth * kWidth;
  const int64_t value_bytes = dv * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t key_bytes = d * static_cast<int64_t>(sizeof(scalar_t));
  const bool prefetch_keys = keys_ahead && sizeof(scalar_t) == 2;
  const int64_t ahead = prefetch_keys ? std::max<int64_t>(1, kKeyAheadBytes / key_bytes) : n;
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* k = keys[j];
    prefetch_row_l2(values[j], value_bytes);
    if (j + ahead < n) prefetch_row_l2(keys[j + ahead], key_bytes);
    __m256 acc[M];
    ATTN_EXT_UNROLL_ROWS
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d8; c += kWidth) {
      const __m256 kv = load8(k + c);
      ATTN_EXT_UNROLL_ROWS
      for (int r = 0; r < M; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + c), kv, acc[r]);
    }
    ATTN_EXT_UNROLL_ROWS
    for (int r = 0; r < M; ++r) {
      float t = hsum(acc[r]);
      for (int64_t c = d8; c < d; ++c) t = std::fma(q[r * ldq + c], static_cast<float>(k[c]), t);
      s[r * lds + j] = t;
    }
  }
}

// Columns [c, c + 8 W) of o_r += sum_j p[r * ldp + j] * values[j] over rows [j0, j1), one FMA
// per (r, j, column) in j order.
template <int M, int W, typename scalar_t>
inline void decode_pv_chunk(const float* p, int64_t ldp, const scalar_t* const* values, int64_t j0,
                            int64_t j1, int64_t c, float* o, int64_t ldo) {
  __m256 acc[M][W];
  ATTN_EXT_UNROLL_ROWS
  for (int r = 0; r < M; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm256_loadu_ps(o + r * ldo + c + w * kWidth);
  for (int64_t j = j0; j < j1; ++j) {
    __m256 v[W];
    for (int w = 0; w < W; ++w) v[w] = load8(values[j] + c + w * kWidth);
    ATTN_EXT_UNROLL_ROWS
    for (int r = 0; r < M; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * ldp + j);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(pr, v[w], acc[r][w]);
    }
  }
  ATTN_EXT_UNROLL_ROWS
  for (int r = 0; r < M; ++r)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(o + r * ldo + c + w * kWidth, acc[r][w]);
}

// Columns [c, dv) of o_r += sum_j p[r * ldp + j] * values[j] over rows [j0, j1): register-sized
// chunks, then one column at a time. (avx512_decode_rows.cpp takes the columns past its
// 16-lane chunks through here.)
template <int M, typename scalar_t>
inline void decode_pv_columns(const float* p, int64_t ldp, const scalar_t* const* values,
                              int64_t j0, int64_t j1, int64_t c, int64_t dv, float* o,
                              int64_t ldo) {
  // Two vectors per row while M x 2 accumulators leave registers for the values.
  constexpr int kWide = M <= 4 ? 2 : 1;
  const int64_t d8 = dv / kWidth * kWidth;
  for (; c + kWide * kWidth <= d8; c += kWide * kWidth)
    decode_pv_chunk<M, kWide>(p, ldp, values, j0, j1, c, o, ldo);
  for (; c < d8; c += kWidth) decode_pv_chunk<M, 1>(p, ldp, values, j0, j1, c, o, ldo);
  for (; c < dv; ++c)
    for (int r = 0; r < M; ++r) {
      float t = o[r * ldo + c];
      for (int64_t j = j0; j < j1; ++j)
        t = std::fma(p[r * ldp + j], static_cast<float>(values[j][c]), t);
      o[r * ldo + c] = t;
    }
}

// o[r * ldo + c] += sum_j p[r * ldp + j] * values[j][c] for r < M, j < n, c < dv; every
// element's sum runs in j order (so the chunking below, and any vector width, changes no bits).
template <int M, typename scalar_t>
inline void decode_pv(const float* p, int64_t ldp, const scalar_t* const* values, int64_t n,
                      int64_t dv, float* o, int64_t ldo) {
  for (int64_t j0 = 0; j0 < n; j0 += kPvRowRun)
    decode_pv_columns<M>(p, ldp, values, j0, std::min(n, j0 + kPvRowRun), 0, dv, o, ldo);
}

// Calls f(Rows<m>{}) for 1 <= m <= kMaxDecodeRows (row_tiles.h's dispatch on the row count).
template <typename F>
inline void dispatch_decode_rows(int64_t m, F&& f) {
  TORCH_CHECK(m >= 1 && m <= kMaxDecodeRows, "decode_attention: row block of ", m,
              " rows, expected 1 to ", kMaxDecodeRows);
  auto kernel = [&f](auto rows, int64_t /*r0*/) { f(rows); };
  attn_ext::cpu::detail::call_rows(m, kernel, 0, std::make_integer_sequence<int, kMaxDecodeRows>{});
}

}  // namespace attn_ext::cpu::avx2
#endif
