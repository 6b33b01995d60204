// PROTOTYPE, NOT SHIPPED (2026-11-29): the decode step's Q K^T for bf16 caches on vdpbf16ps,
// measured on the 2-core Zen 5 VM and dropped. To rerun: copy this file and the .h into
// csrc/decoding/cpu/, `git apply dev/decode_bf16_pairs/hook.patch` (decode_attention.cpp calls
// it where the kernel set is avx512bf16), rebuild, and A/B `ATTN_EXT_CPU_KERNELS=avx512bf16`
// against `avx512` in alternating processes (the decode P V is the same in both sets).
//
// Idea: a decode block has 4 query rows (GQA 32 / 8), and the bf16 step read its cache at
// 30-42 GB/s against fp32's 35-61 GB/s on that VM: bound by instructions (per 128-feature key
// row, AVX2 spends 16 widenings, 64 FMAs and four 8-lane sums). Here: 16 vdpbf16ps per key row
// and one lane-sum tree per 4 key rows, so ~3x fewer instructions; the products are exact (bf16
// x bf16 in fp32), and every score goes through the same tree, so paged and contiguous caches
// agree bit for bit.
//
// What it measured (B 1, H 32, Hkv 8, D 128, bf16, 2 threads, step in ms, avx512bf16 vs avx512):
// - one cache re-read every step (L3-hot up to 4k keys): 1k 0.080-0.089 vs 0.096-0.126, 4k
//   0.27-0.31 vs 0.33-0.45 (1.2-1.4x faster); but 16k 3.0-4.7 vs 1.6-1.8 and 32k 6.3-11 vs
//   3.1-3.7 (2-3x slower).
// - From DRAM the V rows that the scores loop asks into L2 (as avx2::decode_scores does) were
//   not there when P V ran: with the P V skipped, the step cost the same with or without those
//   prefetches (XV), while the AVX2 loop lost 1.65 -> 2.9 ms at 16k without them. And the keys
//   read four rows by chunk (XO = 0) stream at half the rate of row by row (read_order.cpp).
//   Row by row with each value row asked for after its key row (XO = 1, XV = 2) came to 1.8-2.3
//   ms at 16k against 1.6-2.3: no better. Key prefetch 4-32 KB ahead (XK) changed nothing.
// - A model's step, where each layer's cache is cold (16-32 layers' caches read in turn, per
//   layer): 1k 0.12-0.16 vs 0.11-0.15 ms, 4k 0.48-0.53 vs 0.47, 16k 1.9-2.5 vs 1.6-1.9. No gain
//   where decode actually runs; the AVX2 scores with the value prefetch already read near the
//   VM's DRAM rate there.
//
// Knobs (environment, read once): XO key order (0 by chunk across the group, 1 row by row, 2 row
// by row with D 128 unrolled, 3 by chunk with D 128 unrolled), XV value rows (0 asked for before
// the group, 1 after it, 2 after each key row / per chunk, 3 not at all, 4 touched by loads),
// XK keys asked for 8 / 16 / 4 / 32 KB ahead (1-4).
#include "decoding/cpu/avx512bf16_decode_rows.h"

#ifdef ATTN_EXT_AVX512BF16_PRODUCTS
#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <utility>
#include <immintrin.h>

#include "attention/cpu/row_tiles.h"
#include "decoding/cpu/decode_rows.h"

#define ATTN_EXT_WIDE_TARGET "avx512f,avx512bw,avx512bf16,fma"
#include "common/cpu/wide_target_begin.h"

namespace attn_ext::cpu::avx512bf16 {
namespace {

constexpr int64_t kChunk = 32;  // bf16 features per vdpbf16ps: 16 fp32 lanes x one pair
constexpr int kKeys = 4;        // key rows whose lane sums share one tree (lane_tree_sum)
constexpr int kRowPass = 4;     // query rows per pass over a key group

// Features [c, c + 32) of a bf16 row, those at or past d read as zero (never loaded).
inline __m512bh load_chunk(const c10::BFloat16* x, int64_t c, int64_t d) {
  if (c + kChunk <= d) return (__m512bh)_mm512_loadu_si512(x + c);
  const __mmask32 k = static_cast<__mmask32>((1ull << (d - c)) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(k, x + c);
}

// The 16 lanes of each of a0..a3 summed, into lanes 0..3: the high 8 lanes added to the low 8,
// then neighbours (hadd), then neighbouring pairs (hadd), then the two 128-bit halves. Each
// output lane's tree reads only its own register, so a row summed alongside zeros (the tail)
// gets the bits it gets alongside other rows.
inline __m128 lane_tree_sum(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto fold = [](__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  };
  const __m256 h =
      _mm256_hadd_ps(_mm256_hadd_ps(fold(a0), fold(a1)), _mm256_hadd_ps(fold(a2), fold(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static int knob(const char* name) {
  const char* e = std::getenv(name);
  return e ? std::atoi(e) : 0;
}
static const int XO = knob("XO"), XV = knob("XV"), XK = knob("XK");

// s[r * lds + k] = q_r . keys[k] for r < R, k < J (J = kKeys, or 1 for the tail).
template <int R, int J>
__attribute__((always_inline)) inline void group_scores(const c10::BFloat16* q, int64_t ldq,
                                                        const c10::BFloat16* const* keys, int64_t d,
                                                        float* s, int64_t lds,
                                                        const c10::BFloat16* const* values,
                                                        int64_t dv) {
  static_assert(J == 1 || J == kKeys, "a key group is kKeys rows or one");
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < J; ++k) acc[r][k] = _mm512_setzero_ps();
  __m512i touch = _mm512_setzero_si512();
  if (XO == 2 && d == 128) {
    for (int k = 0; k < J; ++k) {
      for (int64_t c = 0; c < 128; c += kChunk) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(keys[k] + c);
        for (int r = 0; r < R; ++r)
          acc[r][k] =
              _mm512_dpbf16_ps(acc[r][k], (__m512bh)_mm512_loadu_si512(q + r * ldq + c), kv);
      }
      if (values) {
        if (XV == 2) avx2::prefetch_row_l2(values[k], dv * 2);
      }
    }
  } else if (XO == 3 && d == 128) {
    for (int64_t c = 0; c < 128; c += kChunk) {
      __m512bh kv[J];
      for (int k = 0; k < J; ++k) kv[k] = (__m512bh)_mm512_loadu_si512(keys[k] + c);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + r * ldq + c);
        for (int k = 0; k < J; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], qv, kv[k]);
      }
    }
    if (values && XV == 2)
      for (int k = 0; k < J; ++k) avx2::prefetch_row_l2(values[k], dv * 2);
  } else if (XO == 1) {
    for (int k = 0; k < J; ++k) {
      for (int64_t c = 0; c < d; c += kChunk) {
        const __m512bh kv = load_chunk(keys[k], c, d);
        for (int r = 0; r < R; ++r)
          acc[r][k] = _mm512_dpbf16_ps(acc[r][k], load_chunk(q + r * ldq, c, d), kv);
      }
      if (values) {
        if (XV == 2) avx2::prefetch_row_l2(values[k], dv * 2);
        if (XV == 4)
          for (int64_t c = 0; c < dv; c += kChunk)
            touch = _mm512_or_si512(touch, _mm512_loadu_si512(values[k] + c));
      }
    }
  } else {
    for (int64_t c = 0; c < d; c += kChunk) {
      if (values != nullptr && c < dv) {
        if (XV == 4)
          for (int k = 0; k < J; ++k)
            touch = _mm512_or_si512(touch, _mm512_loadu_si512(values[k] + c));
        if (XV == 2)
          for (int k = 0; k < J; ++k)
            _mm_prefetch(reinterpret_cast<const char*>(values[k] + c), _MM_HINT_T1);
      }
      __m512bh kv[J];
      for (int k = 0; k < J; ++k) kv[k] = load_chunk(keys[k], c, d);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = load_chunk(q + r * ldq, c, d);
        for (int k = 0; k < J; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], qv, kv[k]);
      }
    }
  }
  if (XV == 4) {
    static thread_local __m512i sink;
    sink = touch;
    asm volatile("" ::"m"(sink));
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    if constexpr (J == kKeys) {
      _mm_storeu_ps(s + r * lds, lane_tree_sum(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      s[r * lds] = _mm_cvtss_f32(lane_tree_sum(acc[r][0], zero, zero, zero));
    }
  }
}

// The M query rows over key rows [j, j + J): one pass of up to kRowPass rows, then the rest.
template <int M, int J>
inline void key_group(const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* const* keys,
                      int64_t d, float* s, int64_t lds, const c10::BFloat16* const* values,
                      int64_t dv) {
  constexpr int kFirst = M < kRowPass ? M : kRowPass;
  group_scores<kFirst, J>(q, ldq, keys, d, s, lds, values, dv);
  if constexpr (M > kFirst) {
    static_assert(M - kFirst <= kRowPass, "blocks of at most 2 * kRowPass rows");
    group_scores<M - kFirst, J>(q + kFirst * ldq, ldq, keys, d, s + kFirst * lds, lds, nullptr, 0);
  }
}

template <int M>
void scores_rows(const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* const* keys, int64_t n,
                 int64_t d, float* s, int64_t lds, const c10::BFloat16* const* values, int64_t dv,
                 bool scattered) {
  constexpr int64_t kElem = sizeof(c10::BFloat16);
  const int64_t value_bytes = dv * kElem, key_bytes = d * kElem;
  const int64_t kab = XK == 1   ? 8192
                      : XK == 2 ? 16384
                      : XK == 3 ? 4096
                      : XK == 4 ? 32768
                                : avx2::kKeyAheadBytes;
  const int64_t ahead = (scattered || XK) ? std::max<int64_t>(1, kab / key_bytes) : n;
  auto prefetch = [&](int64_t j) {
    if (XV == 0) avx2::prefetch_row_l2(values[j], value_bytes);
    if (j + ahead < n) avx2::prefetch_row_l2(keys[j + ahead], key_bytes);
  };
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) {
    for (int k = 0; k < kKeys; ++k) prefetch(j + k);
    key_group<M, kKeys>(q, ldq, keys + j, d, s + j, lds, values + j, dv);
    if (XV == 1)
      for (int k = 0; k < kKeys; ++k) avx2::prefetch_row_l2(values[j + k], value_bytes);
  }
  for (; j < n; ++j) {
    prefetch(j);
    key_group<M, 1>(q, ldq, keys + j, d, s + j, lds, values + j, dv);
  }
}

}  // namespace

void decode_scores(int64_t m, const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* const* keys,
                   int64_t n, int64_t d, float* s, int64_t lds, const c10::BFloat16* const* values,
                   int64_t dv, bool scattered) {
  auto kernel = [&](auto rows, int64_t /*r0*/) {
    scores_rows<decltype(rows)::value>(q, ldq, keys, n, d, s, lds, values, dv, scattered);
  };
  detail::call_rows(m, kernel, 0, std::make_integer_sequence<int, avx2::kMaxDecodeRows>{});
}

}  // namespace attn_ext::cpu::avx512bf16

#include "common/cpu/wide_target_end.h"

#endif  // ATTN_EXT_AVX512BF16_PRODUCTS
