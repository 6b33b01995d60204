// How fast one thread reads 64 MB of 256-byte rows (a bf16 K cache at D 128) from DRAM in four
// load orders, with one add per load: what sank the vdpbf16ps decode scores prototype next to
// this file (avx512bf16_decode_rows.cpp, XO = 0 reads shape c).
//
//   a: 16-byte loads, one stream (the AVX2 decode scores' load8 of bf16 rows)
//   b: 64-byte loads, row by row, the row's four loads unrolled
//   c: 64-byte loads, four rows at a time by chunk: chunk 0 of rows 0-3, then chunk 1, ...
//   d: 64-byte loads, one load instruction over the whole buffer
//
//   g++ -O2 -o /tmp/read_order dev/decode_bf16_pairs/read_order.cpp && /tmp/read_order
//
// Zen 5 VM (2 cores), 2026-11-29, three rounds: a 29.8-30.0 GB/s, b 43.9-54.8, c 23.7-24.9,
// d 37.7-41.1. Reading four rows by chunk halves the rate of reading them row by row: the lines
// of a 1 KB group are touched out of order (0, 4, 8, 12, 1, 5, ...), and the hardware
// prefetchers no longer run ahead.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cstdint>
// Read 64 MB (rows of 256 B) with different load shapes; report GB/s. One thread.
constexpr size_t kBytes = 64ull << 20, kRow = 256;
__attribute__((target("avx512f,avx512bw"))) float shape_a(const char* p,
                                                          size_t rows) {  // 16B loads, one stream
  __m256 acc = _mm256_setzero_ps();
  for (size_t i = 0; i < rows * kRow; i += 16) {
    __m256 v = _mm256_castsi256_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + i))));
    acc = _mm256_add_ps(acc, v);
  }
  float o[8];
  _mm256_storeu_ps(o, acc);
  return o[0];
}
__attribute__((target("avx512f,avx512bw"))) float shape_b(
    const char* p, size_t rows) {  // 64B loads, row by row, 4 unrolled
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t r = 0; r < rows; ++r) {
    const char* q = p + r * kRow;
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(q));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(q + 64));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(q + 128));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(q + 192));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
__attribute__((target("avx512f,avx512bw"))) float shape_c(const char* p,
                                                          size_t rows) {  // 4 rows by chunk
  __m512 a[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) a[i][j] = _mm512_setzero_ps();
  for (size_t r = 0; r < rows; r += 4) {
    const char* q = p + r * kRow;
    for (int c = 0; c < 4; ++c)
      for (int k = 0; k < 4; ++k)
        a[c][k] = _mm512_add_ps(a[c][k], _mm512_loadu_ps(q + k * kRow + c * 64));
  }
  __m512 s = _mm512_setzero_ps();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) s = _mm512_add_ps(s, a[i][j]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx512f,avx512bw"))) float shape_d(
    const char* p, size_t rows) {  // 64B loads, single instruction stream (not unrolled)
  __m512 a0 = _mm512_setzero_ps();
#pragma GCC unroll 1
  for (size_t i = 0; i < rows * kRow; i += 64) a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
  return _mm512_reduce_add_ps(a0);
}
int main() {
  char* buf = (char*)aligned_alloc(4096, kBytes);
  memset(buf, 1, kBytes);
  size_t rows = kBytes / kRow;
  float (*f[])(const char*, size_t) = {shape_a, shape_b, shape_c, shape_d};
  const char* names[] = {"a 16B one stream", "b 64B row-wise x4", "c 4 rows by chunk",
                         "d 64B one instr"};
  volatile float sink = 0;
  for (int round = 0; round < 3; ++round)
    for (int s = 0; s < 4; ++s) {
      auto t0 = std::chrono::steady_clock::now();
      for (int rep = 0; rep < 5; ++rep) sink = sink + f[s](buf, rows);
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      printf("%s: %.1f GB/s\n", names[s], 5 * kBytes / dt / 1e9);
    }
}
