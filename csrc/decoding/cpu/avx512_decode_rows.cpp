// The decode step's P V on 16 lanes (contract in avx512_decode_rows.h).
//
// Same bits as decode_rows.h's avx2::decode_pv: output element (r, c) is
// o = fma(p[r][j], values[j][c], o) over the rows j in order in both, with o kept in a register
// across a run of avx2::kPvRowRun rows and stored between runs or passes (exact). Only the
// columns per register and the order of the passes over them differ. bf16 and fp16 rows widen
// exactly, as avx2::load8 does. The columns past the last 16-lane chunk go through
// avx2::decode_pv_columns.
//
// Why: with a few query rows per key row, the AVX2 P V issues one 8-column FMA per row and
// value chunk, and 16-bit rows add a widening per chunk. On a Zen 5 VM (2026-11-29, H 32,
// Hkv 8, D 128, B 1 and 4, 1k-16k keys) the bf16 step ran 5-26% faster on 16 lanes, fp16
// mostly 7-26%, fp32 at parity within the noise (docs/performance.md, "Decode's P V on
// AVX-512"). The scores product stays on AVX2 but for float8 rows (scores_pairs below): two
// key rows per 16-lane register (the same bits) measured no faster for bf16 and 1.6x slower
// for fp32 from DRAM (rows read chunk by chunk, as pv_rows below no longer reads them).
//
// This file is compiled with the build's flags (AVX2) and switches to AVX-512 with a target
// pragma after its includes (wide_target_begin.h), as avx512_softmax_rows.cpp does; the AVX2
// helpers it calls are defined before the pragma, so they keep the build's flags.
#include "decoding/cpu/avx512_decode_rows.h"

#ifdef ATTN_EXT_AVX512_PRODUCTS
#include <algorithm>
#include <cstdint>
#include <utility>
#include <immintrin.h>

#include "attention/cpu/row_tiles.h"
#include "decoding/cpu/decode_rows.h"

#define ATTN_EXT_WIDE_TARGET "avx512f,fma"
#include "common/cpu/wide_target_begin.h"

namespace attn_ext::cpu::avx512 {
namespace {

constexpr int kLanes = 16;

inline __m512 load16(const float* src) {
  return _mm512_loadu_ps(src);
}
inline __m512 load16(const c10::BFloat16* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// 16 float8 bytes widened as avx2::load8 widens 8 (vec_math.h says how).
inline __m512 widen16(__m128i bytes, c10::Float8_e4m3fn /*format*/) {
  const __m256i w = _mm256_cvtepi8_epi16(bytes);
  const __m256i h =
      _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(avx2::kE4m3HalfMask));
  const __m256i nan =
      _mm256_cmpeq_epi16(_mm256_slli_epi16(w, 9), _mm256_set1_epi16(avx2::kE4m3NanLow7));
  const __m256i half =
      _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(avx2::kHalfExponent)));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(avx2::kE4m3HalfBias));
}
inline __m512 widen16(__m128i bytes, c10::Float8_e5m2 /*format*/) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* src) {
  return widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)), c10::Float8_e4m3fn{});
}
inline __m512 load16(const c10::Float8_e5m2* src) {
  return widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)), c10::Float8_e5m2{});
}

// Columns [c, c + 16 W) of o_r += sum_j p[r * ldp + j] * values[j] over rows [j0, j1).
template <int M, int W, typename scalar_t>
void pv_chunk(const float* p, int64_t ldp, const scalar_t* const* values, int64_t j0, int64_t j1,
              int64_t c, float* o, int64_t ldo) {
  __m512 acc[M][W];
  for (int r = 0; r < M; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_loadu_ps(o + r * ldo + c + w * kLanes);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 v[W];
    for (int w = 0; w < W; ++w) v[w] = load16(values[j] + c + w * kLanes);
    for (int r = 0; r < M; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * ldp + j]);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(pr, v[w], acc[r][w]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(o + r * ldo + c + w * kLanes, acc[r][w]);
}

// Accumulators a pass over the value rows may hold: with the W value registers of a row and a
// broadcast they fit AVX-512's 32 registers.
constexpr int kMaxAccumulators = 16;
// Value columns per block: 128 columns make a bf16 row of D 128 (256 bytes) or half an fp32 one,
// read whole by each pass.
constexpr int kBlockChunks = 8;
// float8 rows: 64 columns per block, so that a block's accumulators hold all of a GQA 4 block's
// rows (4 x 4) and each value chunk is widened once, not once per pass (its widening is most of
// the work: the e4m3 step at B 1, 16k keys, Zen 5 VM, 2026-11-29, went 2.67 -> 2.2 ms, with
// the bf16 step at 1.7-1.8 ms in the same process).
template <typename scalar_t>
constexpr int block_chunks() {
  return sizeof(scalar_t) == 1 ? kBlockChunks / 2 : kBlockChunks;
}

// Columns [c, c + 16 W) of the M rows, over value rows [j0, j1): passes of as many rows as
// kMaxAccumulators allows (R x W), each reading the rows' W chunks in order. The first pass
// streams the value rows; the others find them in L1 (a run of avx2::kPvRowRun rows is 8 KB
// of bf16 at D 128).
template <int M, int W, typename scalar_t>
void row_passes(const float* p, int64_t ldp, const scalar_t* const* values, int64_t j0, int64_t j1,
                int64_t c, float* o, int64_t ldo) {
  constexpr int kRows = kMaxAccumulators / W < M ? kMaxAccumulators / W : M;
  pv_chunk<kRows, W>(p, ldp, values, j0, j1, c, o, ldo);
  if constexpr (M > kRows)
    row_passes<M - kRows, W>(p + kRows * ldp, ldp, values, j0, j1, c, o + kRows * ldo, ldo);
}

// Calls row_passes<M, W> for the 1 <= w <= kBlockChunks chunks left of a row.
template <int M, typename scalar_t, int... W>
void last_block(int w, const float* p, int64_t ldp, const scalar_t* const* values, int64_t j0,
                int64_t j1, int64_t c, float* o, int64_t ldo, std::integer_sequence<int, W...>) {
  ((w == W + 1 ? row_passes<M, W + 1>(p, ldp, values, j0, j1, c, o, ldo) : void()), ...);
}

// Each run of avx2::kPvRowRun value rows is read block by block of kBlockChunks 16-column
// chunks (a whole bf16 row at D 128), its M rows in passes, and not chunk by chunk across the
// rows: rows read chunk by chunk leave the hardware prefetchers behind when the rows are not
// in L2 (dev/decode_bf16_pairs/read_order.cpp: half the rate). On a Zen 5 VM (2026-11-29, H 32,
// Hkv 8, D 128, 4k-16k keys, cold caches) this took fp32 steps through 16-row pages 5-10%
// faster and the contiguous bf16 step 3-4%.
template <int M, typename scalar_t>
void pv_rows(const float* p, int64_t ldp, const scalar_t* const* values, int64_t n, int64_t dv,
             float* o) {
  const int64_t d16 = dv / kLanes * kLanes;
  for (int64_t j0 = 0; j0 < n; j0 += avx2::kPvRowRun) {
    const int64_t j1 = std::min(n, j0 + avx2::kPvRowRun);
    int64_t c = 0;
    constexpr int kChunks = block_chunks<scalar_t>();
    for (; c + kChunks * kLanes <= d16; c += kChunks * kLanes)
      row_passes<M, kChunks>(p, ldp, values, j0, j1, c, o, dv);
    if (c < d16)
      last_block<M>(static_cast<int>((d16 - c) / kLanes), p, ldp, values, j0, j1, c, o, dv,
                    std::make_integer_sequence<int, kChunks>{});
    avx2::decode_pv_columns<M>(p, ldp, values, j0, j1, d16, dv, o, dv);
  }
}

// pv_rows for m rows (the caller checks 1 <= m <= avx2::kMaxDecodeRows).
template <typename scalar_t>
void pv(int64_t m, const float* p, int64_t ldp, const scalar_t* const* values, int64_t n,
        int64_t dv, float* o) {
  auto kernel = [&](auto rows, int64_t /*r0*/) {
    pv_rows<decltype(rows)::value>(p, ldp, values, n, dv, o);
  };
  detail::call_rows(m, kernel, 0, std::make_integer_sequence<int, avx2::kMaxDecodeRows>{});
}

// ------------------------------------------------------------------ Q K^T of float8 key rows

// Features [c, c + 8) of key rows a and b, widened: a's in the low 8 lanes, b's in the high 8.
template <typename fp8_t>
inline __m512 load_pair8(const fp8_t* a, const fp8_t* b) {
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  return widen16(_mm_unpacklo_epi64(lo, hi), fp8_t{});
}

// q's features [c, c + 8) in both 8-lane halves.
inline __m512 dup8(const float* q) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q))));
}

// avx2::decode_scores for float8 rows, two key rows per register: the low 8 lanes run row j's
// 8-lane chain and the high 8 row j + 1's, each as avx2::decode_scores runs it (lane = feature
// mod 8, the features in order, summed by avx2::hsum, then the tail): the same bits. Each query
// load and FMA serves two rows, and one widening two rows' 8 features. Why float8 only: its
// widening makes the 8-lane loop instruction-bound (the e4m3 step read 11 GB/s on a Zen 5 VM,
// 2026-11-29, where bf16 reads 35-38), while 16-bit and fp32 rows are bound by DRAM and read
// two rows by chunk slower (the note at the top of this file).
template <int M, typename fp8_t>
void scores_pairs(const float* q, int64_t ldq, const fp8_t* const* keys, int64_t n, int64_t d,
                  float* s, int64_t lds, const fp8_t* const* values, int64_t dv) {
  const int64_t d8 = d / avx2::kWidth * avx2::kWidth;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const fp8_t *k0 = keys[j], *k1 = keys[j + 1];
    avx2::prefetch_row_l2(values[j], dv);
    avx2::prefetch_row_l2(values[j + 1], dv);
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d8; c += avx2::kWidth) {
      const __m512 kv = load_pair8(k0 + c, k1 + c);
      for (int r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(dup8(q + r * ldq + c), kv, acc[r]);
    }
    for (int r = 0; r < M; ++r) {
      float t0 = avx2::hsum(_mm512_castps512_ps256(acc[r]));
      float t1 = avx2::hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
      for (int64_t c = d8; c < d; ++c) {
        t0 = std::fma(q[r * ldq + c], static_cast<float>(k0[c]), t0);
        t1 = std::fma(q[r * ldq + c], static_cast<float>(k1[c]), t1);
      }
      s[r * lds + j] = t0;
      s[r * lds + j + 1] = t1;
    }
  }
  if (j < n) avx2::decode_scores<M>(q, ldq, keys + j, n - j, d, s + j, lds, values + j, dv, false);
}

template <typename fp8_t>
void scores(int64_t m, const float* q, int64_t ldq, const fp8_t* const* keys, int64_t n, int64_t d,
            float* s, int64_t lds, const fp8_t* const* values, int64_t dv) {
  auto kernel = [&](auto rows, int64_t /*r0*/) {
    scores_pairs<decltype(rows)::value>(q, ldq, keys, n, d, s, lds, values, dv);
  };
  detail::call_rows(m, kernel, 0, std::make_integer_sequence<int, avx2::kMaxDecodeRows>{});
}

}  // namespace

void decode_scores(int64_t m, const float* q, int64_t ldq, const c10::Float8_e4m3fn* const* keys,
                   int64_t n, int64_t d, float* s, int64_t lds,
                   const c10::Float8_e4m3fn* const* values, int64_t dv) {
  scores(m, q, ldq, keys, n, d, s, lds, values, dv);
}
void decode_scores(int64_t m, const float* q, int64_t ldq, const c10::Float8_e5m2* const* keys,
                   int64_t n, int64_t d, float* s, int64_t lds,
                   const c10::Float8_e5m2* const* values, int64_t dv) {
  scores(m, q, ldq, keys, n, d, s, lds, values, dv);
}

void decode_pv(int64_t m, const float* p, int64_t ldp, const float* const* values, int64_t n,
               int64_t dv, float* o) {
  pv(m, p, ldp, values, n, dv, o);
}
void decode_pv(int64_t m, const float* p, int64_t ldp, const c10::BFloat16* const* values,
               int64_t n, int64_t dv, float* o) {
  pv(m, p, ldp, values, n, dv, o);
}
void decode_pv(int64_t m, const float* p, int64_t ldp, const c10::Half* const* values, int64_t n,
               int64_t dv, float* o) {
  pv(m, p, ldp, values, n, dv, o);
}
void decode_pv(int64_t m, const float* p, int64_t ldp, const c10::Float8_e4m3fn* const* values,
               int64_t n, int64_t dv, float* o) {
  pv(m, p, ldp, values, n, dv, o);
}
void decode_pv(int64_t m, const float* p, int64_t ldp, const c10::Float8_e5m2* const* values,
               int64_t n, int64_t dv, float* o) {
  pv(m, p, ldp, values, n, dv, o);
}

}  // namespace attn_ext::cpu::avx512

#include "common/cpu/wide_target_end.h"

#endif  // ATTN_EXT_AVX512_PRODUCTS
