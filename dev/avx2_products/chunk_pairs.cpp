// Tried on Zen 3, 2026-11-30, not shipped: the AVX2 scores product with two kDotChunk chunks of
// the dot products formed at a time in registers on 3-row tiles (`pair_tile`), against the shipped
// `avx2::scores_tile` (6-row tiles, one chunk at a time, the partial sums in S after each). Same
// arithmetic, so the same bits (checked first). Times both and pv_tile (the yardstick) in
// alternating rounds, one thread, Q 128 x D against n packed keys. What it measured, and why the
// forward did not move: dev/cpu_forward_experiments.md, "Chunk pairs in registers".
//
//   g++ -O3 -std=c++17 -mavx2 -mfma -mf16c -Icsrc $(python -c "from torch.utils import \
//       cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))") \
//       dev/avx2_products/chunk_pairs.cpp -o /tmp/chunk_pairs && /tmp/chunk_pairs 256 128 5
#include "attention/cpu/avx2_block_products.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace attn_ext::cpu;
using namespace attn_ext::cpu::avx2;

// Rows of a chunk-pair tile: 2 chunks x 3 rows x 2 vectors = 12 accumulators + 2 panel vectors +
// 1 broadcast fill 15 of 16 registers, and 12 independent FMA chains keep both FMA ports busy.
constexpr int kPairRows = 3;

// s[r][0..16) for d > kDotChunk: the dot products summed in chunks of kDotChunk features,
// ((c_0 + c_1) + ...) * scale, in the order the AVX-512 kernel sums them. Two chunks are formed
// at a time in registers, each its own FMA chain from zero (so the bits of one chunk at a time),
// and each pair's sum goes to s once, not each chunk's.
template <int R>
inline void scores_pair_micro(const float* q, int64_t ldq, const float* panel, int64_t d,
                              __m256 scale, float* s, int64_t lds) {
  for (int64_t f0 = 0; f0 < d; f0 += 2 * kDotChunk) {
    const int64_t len_a = std::min(kDotChunk, d - f0);
    const int64_t len_b = std::clamp<int64_t>(d - f0 - kDotChunk, 0, kDotChunk);
    const float* qa = q + f0;
    const float* pa = panel + f0 * kCols;
    const float* pb = pa + kDotChunk * kCols;
    __m256 a[R][2], b[R][2];
    ATTN_EXT_UNROLL_ROWS
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = b[r][0] = b[r][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < len_b; ++k) {
      __m256 p0 = _mm256_loadu_ps(pa + k * kCols), p1 = _mm256_loadu_ps(pa + k * kCols + 8);
      ATTN_EXT_UNROLL_ROWS
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(qa + r * ldq + k);
        a[r][0] = _mm256_fmadd_ps(x, p0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(x, p1, a[r][1]);
      }
      p0 = _mm256_loadu_ps(pb + k * kCols), p1 = _mm256_loadu_ps(pb + k * kCols + 8);
      ATTN_EXT_UNROLL_ROWS
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(qa + r * ldq + kDotChunk + k);
        b[r][0] = _mm256_fmadd_ps(x, p0, b[r][0]);
        b[r][1] = _mm256_fmadd_ps(x, p1, b[r][1]);
      }
    }
    for (; k < len_a; ++k) {
      const __m256 p0 = _mm256_loadu_ps(pa + k * kCols), p1 = _mm256_loadu_ps(pa + k * kCols + 8);
      ATTN_EXT_UNROLL_ROWS
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(qa + r * ldq + k);
        a[r][0] = _mm256_fmadd_ps(x, p0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(x, p1, a[r][1]);
      }
    }
    const bool last = f0 + 2 * kDotChunk >= d;
    ATTN_EXT_UNROLL_ROWS
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        float* dst = s + r * lds + h * kWidth;
        __m256 sum = f0 == 0 ? a[r][h] : _mm256_add_ps(_mm256_loadu_ps(dst), a[r][h]);
        if (len_b > 0) sum = _mm256_add_ps(sum, b[r][h]);
        _mm256_storeu_ps(dst, last ? _mm256_mul_ps(sum, scale) : sum);
      }
    }
  }
}

void pair_tile(const float* q, int64_t ldq, int64_t m, const float* key_panels, int64_t n,
               int64_t d, float scale, float* s, int64_t lds) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < n; g += kCols) {
    for_row_tiles<kPairRows>(m, [&](auto rows, int64_t r0) {
      scores_pair_micro<decltype(rows)::value>(q + r0 * ldq, ldq, key_panels + g * d, d, sv,
                                               s + r0 * lds + g, lds);
    });
  }
}

int main(int argc, char** argv) {
  constexpr int64_t kQueries = 128;  // the forward's query block
  const int64_t n = argc > 1 ? std::atoi(argv[1]) : 256;
  const int64_t d = argc > 2 ? std::atoi(argv[2]) : 128;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  const int64_t ldk = round_up_cols(n);
  std::vector<float> q(kQueries * d), k(n * d), key_panels(ldk * d);
  std::vector<float> s_shipped(kQueries * ldk), s_pairs(kQueries * ldk);
  std::vector<float> value_panels(ldk * round_up_cols(d), 0.5f), o(kQueries * d),
      factor(kQueries, 0.5f);
  std::srand(1);
  for (float& x : q) x = float(std::rand() % 100000) / 1000.f - 50.f;
  for (float& x : k) x = float(std::rand() % 100000) / 1000.f - 50.f;
  pack_key_panels(k.data(), d, n, d, key_panels.data());
  scores_tile(q.data(), d, kQueries, key_panels.data(), n, d, 0.1f, s_shipped.data(), ldk);
  pair_tile(q.data(), d, kQueries, key_panels.data(), n, d, 0.1f, s_pairs.data(), ldk);
  std::printf(
      "same bits: %s\n",
      std::memcmp(s_shipped.data(), s_pairs.data(), s_pairs.size() * sizeof(float)) ? "no" : "yes");
  const double flops = 2.0 * kQueries * n * d;
  const int iters = int(2e9 / flops);  // ~2 GFLOP per product per round
  auto rate = [&](auto&& product) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) product();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return flops * iters / seconds / 1e9;
  };
  for (int r = 0; r < rounds; ++r) {
    const double shipped = rate([&] {
      scores_tile(q.data(), d, kQueries, key_panels.data(), n, d, 0.1f, s_shipped.data(), ldk);
    });
    const double pairs = rate([&] {
      pair_tile(q.data(), d, kQueries, key_panels.data(), n, d, 0.1f, s_pairs.data(), ldk);
    });
    const double pv = rate([&] {
      pv_tile(s_pairs.data(), ldk, kQueries, value_panels.data(), ldk * kCols, n, d, factor.data(),
              o.data(), d);
    });
    std::printf("GFLOP/s: shipped %.1f, pairs %.1f, pv %.1f; pairs / shipped %.3f\n", shipped,
                pairs, pv, pairs / shipped);
  }
}
