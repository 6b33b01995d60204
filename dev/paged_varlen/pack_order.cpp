// Times the forward's value packing (avx2::pack_value_panels, one thread) in the order it had
// before paged keys (each 16-column panel over all rows, rows addressed base + j * ld) against
// the shipped order (rows 16 at a time, their pointers looked up once, each group into all its
// panels), and the key packing with and without the group's row pointers, on strided rows as
// the fixed-length and varlen forwards pack them (ld = Hkv * D tokens apart), fp32 and bf16,
// tiles of 256 keys (L2) and whole heads of 4096 keys. Results: dev/paged_varlen/notes.md.
//
//   TI=$(python -c "import torch.utils.cpp_extension as c; \
//        print(' '.join('-I' + p for p in c.include_paths()))")
//   g++ -O3 -mavx2 -mfma -mf16c -Icsrc $TI dev/paged_varlen/pack_order.cpp -o /tmp/po && /tmp/po
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "attention/cpu/avx2_block_products.h"

namespace {
using namespace attn_ext::cpu;
using avx2::kCols;
using avx2::kWidth;

// The value packing as it was at d6f2527.
template <typename scalar_t>
void pack_values_before(const scalar_t* v, int64_t ld, int64_t n, int64_t dv, float* dst,
                        int64_t panel_stride) {
  float row[kCols];
  for (int64_t c0 = 0; c0 < dv; c0 += kCols) {
    float* panel = dst + (c0 / kCols) * panel_stride;
    const int64_t w = std::min<int64_t>(kCols, dv - c0);
    if (w == kCols) {
      for (int64_t j = 0; j < n; ++j) {
        _mm256_storeu_ps(panel + j * kCols, avx2::load8(v + j * ld + c0));
        _mm256_storeu_ps(panel + j * kCols + kWidth, avx2::load8(v + j * ld + c0 + kWidth));
      }
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      load_row(v + j * ld + c0, row, w, 1.f);
      for (int64_t c = w; c < kCols; ++c) row[c] = 0.f;
      std::copy(row, row + kCols, panel + j * kCols);
    }
  }
}

// The key packing as it was at d6f2527.
template <typename scalar_t>
void pack_keys_before(const scalar_t* k, int64_t ld, int64_t n, int64_t d, float* dst) {
  const int64_t d_vec = d / kWidth * kWidth;
  float row[kCols];
  for (int64_t g = 0; g < n; g += kCols) {
    float* panel = dst + g * d;
    const int64_t w = std::min<int64_t>(kCols, n - g);
    int64_t f0 = 0;
    for (; f0 < d_vec; f0 += kWidth) {
      for (int64_t half = 0; half < kCols; half += kWidth) {
        __m256 r[kWidth];
        ATTN_EXT_UNROLL_ROWS
        for (int c = 0; c < kWidth; ++c)
          r[c] = half + c < w ? avx2::load8(k + (g + half + c) * ld + f0) : _mm256_setzero_ps();
        avx2::transpose8x8(r);
        ATTN_EXT_UNROLL_ROWS
        for (int f = 0; f < kWidth; ++f) _mm256_storeu_ps(panel + (f0 + f) * kCols + half, r[f]);
      }
    }
    for (int64_t f = f0; f < d; ++f) {
      for (int64_t c = 0; c < w; ++c) row[c] = static_cast<float>(k[(g + c) * ld + f]);
      for (int64_t c = w; c < kCols; ++c) row[c] = 0.f;
      std::copy(row, row + kCols, panel + f * kCols);
    }
  }
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename scalar_t>
void run(const char* name, int64_t n, int64_t d, int64_t heads) {
  const int64_t ld = heads * d;
  std::vector<scalar_t> src(n * ld);
  for (size_t i = 0; i < src.size(); ++i) src[i] = scalar_t(float(i % 97) * 0.01f);
  std::vector<float> a(avx2::round_up_cols(n) * d), b(a.size());
  const int64_t reps = std::max<int64_t>(1, (int64_t(1) << 26) / (n * d));
  double t[4] = {1e9, 1e9, 1e9, 1e9};
  for (int round = 0; round < 15; ++round) {
    double s = now();
    for (int64_t r = 0; r < reps; ++r)
      pack_values_before(src.data(), ld, n, d, a.data(), n * kCols);
    t[0] = std::min(t[0], now() - s);
    s = now();
    for (int64_t r = 0; r < reps; ++r)
      avx2::pack_value_panels(src.data(), ld, n, d, b.data(), n * kCols);
    t[1] = std::min(t[1], now() - s);
    s = now();
    for (int64_t r = 0; r < reps; ++r) pack_keys_before(src.data(), ld, n, d, a.data());
    t[2] = std::min(t[2], now() - s);
    s = now();
    for (int64_t r = 0; r < reps; ++r) avx2::pack_key_panels(src.data(), ld, n, d, b.data());
    t[3] = std::min(t[3], now() - s);
  }
  std::printf(
      "%-5s n %5lld d %3lld ld %5lld | values before %.3f us, now %.3f us (%.2fx) | "
      "keys before %.3f us, now %.3f us (%.2fx)\n",
      name, (long long)n, (long long)d, (long long)ld, t[0] / reps * 1e6, t[1] / reps * 1e6,
      t[0] / t[1], t[2] / reps * 1e6, t[3] / reps * 1e6, t[2] / t[3]);
}
}  // namespace

int main() {
  for (int64_t n : {256, 4096})
    for (int64_t d : {64, 128}) {
      run<float>("fp32", n, d, 4);
      run<c10::BFloat16>("bf16", n, d, 4);
    }
  return 0;
}
