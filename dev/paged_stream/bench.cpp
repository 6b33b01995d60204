// How fast a paged KV cache's rows stream from DRAM in the orders a decode step can read them,
// against a contiguous cache: a read-only loop (one FMA per 32 bytes of K and V, no softmax)
// over H = 8 heads, D = 128, pages of 16 rows, two threads, the candidates alternating in
// rounds in one process (shared machines drift between minutes). Decides how the CPU decode
// kernel cuts a paged cache into tasks (decoding/cpu/decode_attention.cpp, heads_per_task;
// docs/performance.md, "Paged cache (CPU)").
//
//   contig  g 1: (B, Hkv, L, D), each task one head's rows
//   ours    g G: (pages, Hkv, rows, D) pages, each task G heads, page by page (G = 8: whole pages)
//   fa      g G: FlashAttention's (pages, rows, Hkv, D) pages, row by row across the G heads
//   fa_hr   g 8: the same pages, head by head within a page
//
//   g++ -O2 -mavx2 -mfma -fopenmp -o /tmp/paged_stream dev/paged_stream/bench.cpp
//   /tmp/paged_stream <rows> <bytes per element: 4 or 2> [threads, default 2]
//
// Zen 5 VM (2 cores), 2026-11-29, 16k rows, ratio to contig: fp32 ours g1 1.27-1.29, g2 1.29,
// g4 1.12, g8 0.97-1.02; fa g1 1.80-2.02, g8 0.96-1.07; fa_hr g8 1.44. bf16: ours g1
// 1.41-1.52, g8 0.98-1.03; fa g1 2.24-2.32, g8 1.02-1.04. One thread: ours g1 1.79, g8 0.95.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr long kHeads = 8, kDim = 128, kPage = 16;
constexpr int kRounds = 15;

enum Kind { kContig, kOurs, kFlash, kFlashHeadOuter };
const char* const kNames[] = {"contig", "ours", "fa", "fa_hr"};

struct Cache {
  long rows, row_bytes, pages;
  char *k, *v;
};

inline void consume(const char* k, const char* v, long bytes, __m256& acc) {
  for (long c = 0; c < bytes; c += 32)
    acc = _mm256_fmadd_ps(_mm256_load_ps(reinterpret_cast<const float*>(k + c)),
                          _mm256_load_ps(reinterpret_cast<const float*>(v + c)), acc);
}

// One pass over the cache: tasks of g heads (g = kHeads: every head, the pages split in two
// so that both threads have a task).
float pass(const Cache& c, Kind kind, long g, int threads) {
  const long groups = kHeads / g, splits = g == kHeads ? 2 : 1, rb = c.row_bytes;
  float total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
  for (long t = 0; t < groups * splits; ++t) {
    const long h0 = t / splits * g, sp = t % splits;
    const long p0 = sp * c.pages / splits, p1 = (sp + 1) * c.pages / splits;
    __m256 acc = _mm256_setzero_ps();
    if (kind == kContig) {
      for (long h = h0; h < h0 + g; ++h) {
        const long off = (h * c.rows + p0 * kPage) * rb;
        consume(c.k + off, c.v + off, (p1 - p0) * kPage * rb, acc);
      }
    } else if (kind == kOurs) {
      for (long p = p0; p < p1; ++p) {
        const long off = (p * kHeads + h0) * kPage * rb;
        consume(c.k + off, c.v + off, g * kPage * rb, acc);
      }
    } else if (kind == kFlash) {
      for (long p = p0; p < p1; ++p)
        for (long r = 0; r < kPage; ++r) {
          const long off = ((p * kPage + r) * kHeads + h0) * rb;
          consume(c.k + off, c.v + off, g * rb, acc);
        }
    } else {
      for (long p = p0; p < p1; ++p)
        for (long h = h0; h < h0 + g; ++h)
          for (long r = 0; r < kPage; ++r) {
            const long off = ((p * kPage + r) * kHeads + h) * rb;
            consume(c.k + off, c.v + off, rb, acc);
          }
    }
    float a[8];
    _mm256_storeu_ps(a, acc);
    total += a[0];
  }
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <rows> <bytes per element> [threads]\n", argv[0]);
    return 1;
  }
  Cache c;
  c.rows = std::atol(argv[1]) / kPage * kPage;
  c.row_bytes = kDim * std::atol(argv[2]);
  c.pages = c.rows / kPage;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2;
  const long bytes = kHeads * c.rows * c.row_bytes;
  c.k = static_cast<char*>(std::aligned_alloc(4096, bytes));
  c.v = static_cast<char*>(std::aligned_alloc(4096, bytes));
  std::memset(c.k, 1, bytes);
  std::memset(c.v, 1, bytes);

  const std::vector<std::pair<Kind, long>> cands = {
      {kContig, 1}, {kOurs, 1},  {kOurs, 2},  {kOurs, 4},  {kOurs, 8},
      {kFlash, 1},  {kFlash, 2}, {kFlash, 4}, {kFlash, 8}, {kFlashHeadOuter, 8}};
  std::vector<std::vector<double>> t(cands.size());
  for (int round = 0; round < kRounds; ++round)
    for (size_t i = 0; i < cands.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      volatile float sink = pass(c, cands[i].first, cands[i].second, threads);
      (void)sink;
      t[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  for (size_t i = 0; i < cands.size(); ++i) {
    std::vector<double> ratio, s = t[i];
    for (int r = 0; r < kRounds; ++r) ratio.push_back(t[i][r] / t[0][r]);
    std::sort(ratio.begin(), ratio.end());
    std::sort(s.begin(), s.end());
    std::printf("%-6s g %ld: %.2f ms (%.1f GB/s), ratio to contig %.2f\n", kNames[cands[i].first],
                cands[i].second, s[kRounds / 2] * 1e3, 2 * bytes / s[kRounds / 2] / 1e9,
                ratio[kRounds / 2]);
  }
  std::free(c.k);
  std::free(c.v);
}
