// Checks the AMX packing routines (pack_keys, pack_values, transpose_rows in
// csrc/attention/cpu/amx_block_products.cpp) element for element against scalar references on
// 99 (keys, features) shapes with partial tiles, and times each against its earlier scalar form
// on a 2048 x 128 head (2026-11-26, AMX Xeon VM: pack_keys 145 -> 38 us, pack_values 35 -> 26,
// transpose_rows 290 -> 67). Needs AVX-512BW, not the tiles.
//
//   g++ -O3 -mavx2 -mfma -Icsrc dev/amx_products/pack_check.cpp \
//       csrc/attention/cpu/amx_block_products.cpp -o /tmp/pack_check && /tmp/pack_check
#include "attention/cpu/amx_block_products.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
using namespace attn_ext::cpu::amx;
static void ref_pack_keys(const uint16_t* k, int64_t ld, int64_t n, int64_t d, uint16_t* dst) {
  const int64_t chunks = round_up(d, kPairDepth) / kPairDepth;
  for (int64_t j0 = 0; j0 < round_up(n, kPairDepth); j0 += kTileRows)
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t* tile = dst + (j0 / kTileRows * chunks + c) * kTileElems;
      const int64_t f0 = c * kPairDepth;
      for (int64_t t = 0; t < kTileRows; ++t)
        for (int64_t j = 0; j < kTileRows; ++j)
          for (int64_t e = 0; e < 2; ++e) {
            const int64_t key = j0 + j, f = f0 + 2 * t + e;
            tile[(t * kTileRows + j) * 2 + e] = key < n && f < d ? k[key * ld + f] : 0;
          }
    }
}
static void ref_pack_values(const uint16_t* v, int64_t ld, int64_t n, int64_t dv, uint16_t* dst) {
  const int64_t blocks = round_up(dv, kAccCols) / kAccCols;
  for (int64_t j0 = 0; j0 < round_up(n, kPairDepth); j0 += kPairDepth)
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t* tile = dst + (j0 / kPairDepth * blocks + b) * kTileElems;
      const int64_t f0 = b * kAccCols;
      for (int64_t t = 0; t < kTileRows; ++t)
        for (int64_t col = 0; col < kAccCols; ++col)
          for (int64_t e = 0; e < 2; ++e) {
            const int64_t key = j0 + 2 * t + e, f = f0 + col;
            tile[(t * kAccCols + col) * 2 + e] = key < n && f < dv ? v[key * ld + f] : 0;
          }
    }
}
static void ref_transpose(const uint16_t* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst,
                          int64_t ldd, int64_t rows) {
  for (int64_t c = 0; c < rows; ++c)
    for (int64_t r = 0; r < ldd; ++r) dst[c * ldd + r] = (c < n && r < m) ? src[r * ld + c] : 0;
}
#include <chrono>
static void old_pack_keys(const uint16_t* k, int64_t ld, int64_t n, int64_t d, uint16_t* dst) {
  const int64_t chunks = round_up(d, kPairDepth) / kPairDepth;
  for (int64_t j0 = 0; j0 < round_up(n, kPairDepth); j0 += kTileRows)
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t* tile = dst + (j0 / kTileRows * chunks + c) * kTileElems;
      const int64_t f0 = c * kPairDepth;
      for (int64_t j = 0; j < kTileRows; ++j) {
        const uint16_t* row = k + (j0 + j) * ld + f0;
        for (int64_t t = 0; t < kTileRows; ++t)
          std::memcpy(tile + (t * kTileRows + j) * 2, row + 2 * t, 2 * sizeof(uint16_t));
      }
    }
}
static void old_pack_values(const uint16_t* v, int64_t ld, int64_t n, int64_t dv, uint16_t* dst) {
  const int64_t blocks = round_up(dv, kAccCols) / kAccCols;
  for (int64_t j0 = 0; j0 < round_up(n, kPairDepth); j0 += kPairDepth)
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t* tile = dst + (j0 / kPairDepth * blocks + b) * kTileElems;
      const int64_t f0 = b * kAccCols;
      for (int64_t t = 0; t < kTileRows; ++t) {
        const uint16_t* even = v + (j0 + 2 * t) * ld + f0;
        const uint16_t* odd = even + ld;
        for (int64_t col = 0; col < kAccCols; ++col) {
          tile[(t * kAccCols + col) * 2] = even[col];
          tile[(t * kAccCols + col) * 2 + 1] = odd[col];
        }
      }
    }
}
static void old_transpose(const uint16_t* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst,
                          int64_t ldd, int64_t rows) {
  for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
    const int64_t r_end = std::min(m, r0 + kTileRows);
    for (int64_t c = 0; c < n; ++c)
      for (int64_t r = r0; r < r_end; ++r) dst[c * ldd + r] = src[r * ld + c];
  }
}
template <class F>
double tm(F f) {
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 50; ++i) f();
    double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        50;
    if (us < best) best = us;
  }
  return best;
}
int main() {
  {
    const int64_t n = 2048, d = 128;
    std::vector<uint16_t> src(n * d, 3), dst(key_tile_elems(n, d) + value_tile_elems(n, d) + n * d);
    printf("pack_keys  2048x128: old %.1f us, new %.1f us\n",
           tm([&] { old_pack_keys(src.data(), d, n, d, dst.data()); }),
           tm([&] { pack_keys(src.data(), d, n, d, dst.data()); }));
    printf("pack_values 2048x128: old %.1f us, new %.1f us\n",
           tm([&] { old_pack_values(src.data(), d, n, d, dst.data()); }),
           tm([&] { pack_values(src.data(), d, n, d, dst.data()); }));
    printf("transpose  2048x128: old %.1f us, new %.1f us\n",
           tm([&] { old_transpose(src.data(), d, n, d, dst.data(), n, d); }),
           tm([&] { transpose_rows(src.data(), d, n, d, dst.data(), n, d); }));
  }
  std::mt19937 g(1);
  int bad = 0, cases = 0;
  for (int64_t n : {1, 15, 16, 17, 31, 32, 33, 64, 77, 130, 256})
    for (int64_t d : {8, 16, 31, 32, 40, 64, 96, 128, 130}) {
      const int64_t ld = d + 5;
      std::vector<uint16_t> src((n + 40) * ld + 64);
      for (auto& x : src) x = g() & 0xFFFF;
      std::vector<uint16_t> a(key_tile_elems(n, d) + 64, 7), b(a.size(), 7);
      pack_keys(src.data(), ld, n, d, a.data());
      ref_pack_keys(src.data(), ld, n, d, b.data());
      bad += a != b;
      ++cases;
      std::vector<uint16_t> c(value_tile_elems(n, d) + 64, 7), e(c.size(), 7);
      pack_values(src.data(), ld, n, d, c.data());
      ref_pack_values(src.data(), ld, n, d, e.data());
      bad += c != e;
      ++cases;
      const int64_t ldd = round_up(n, 32), rows = round_up(d, 16);
      std::vector<uint16_t> t1(rows * ldd, 7), t2(rows * ldd, 7);
      transpose_rows(src.data(), ld, n, d, t1.data(), ldd, rows);
      ref_transpose(src.data(), ld, n, d, t2.data(), ldd, rows);
      if (t1 != t2) {
        ++bad;
        printf("transpose bad n=%ld d=%ld\n", n, d);
      }
      ++cases;
    }
  printf("%d cases, %d mismatches\n", cases, bad);
  return bad != 0;
}
