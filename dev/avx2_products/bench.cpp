// Times the AVX2 fp32 block products (csrc/attention/cpu/avx2_block_products.h) alone, one
// thread, on the forward's tile pair: scores_tile (Q 128 x D against n packed keys) and pv_tile
// (P 128 x n against n packed values, D wide). Prints GFLOP/s of each per round; compare
// variants by the ratio scores / pv of each round, which cancels the shared VM's phases. Results
// and what they decided: dev/cpu_forward_experiments.md, "The chunked score sum on Zen 3".
//
//   g++ -O3 -std=c++17 -mavx2 -mfma -mf16c -Icsrc $(python -c "from torch.utils import \
//       cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))") \
//       dev/avx2_products/bench.cpp -o /tmp/avx2_bench && /tmp/avx2_bench 256 128 5
#include "attention/cpu/avx2_block_products.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace attn_ext::cpu;

int main(int argc, char** argv) {
  constexpr int64_t kRows = 128;                          // the forward's query block
  const int64_t n = argc > 1 ? std::atoi(argv[1]) : 256;  // keys per block
  const int64_t d = argc > 2 ? std::atoi(argv[2]) : 128;  // head dim
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  const int64_t ldk = avx2::round_up_cols(n);
  std::vector<float> q(kRows * d), k(n * d), key_panels(ldk * d), s(kRows * ldk);
  std::vector<float> value_panels(ldk * ((d + avx2::kCols - 1) / avx2::kCols) * avx2::kCols);
  std::vector<float> o(kRows * d), factor(kRows, 0.5f);
  std::srand(1);
  for (float& x : q) x = float(std::rand() % 1000) / 1000.f;
  for (float& x : k) x = float(std::rand() % 1000) / 1000.f;
  for (float& x : value_panels) x = float(std::rand() % 1000) / 1000.f;
  avx2::pack_key_panels(k.data(), d, n, d, key_panels.data());
  const double flops = 2.0 * kRows * n * d;
  const int iters = int(2e9 / flops);  // ~2 GFLOP per product per round
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i)
      avx2::scores_tile(q.data(), d, kRows, key_panels.data(), n, d, 0.1f, s.data(), ldk);
    const auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i)
      avx2::pv_tile(s.data(), ldk, kRows, value_panels.data(), ldk * avx2::kCols, n, d,
                    factor.data(), o.data(), d);
    const auto t2 = std::chrono::steady_clock::now();
    const double gs = flops * iters / std::chrono::duration<double>(t1 - t0).count() / 1e9;
    const double gp = flops * iters / std::chrono::duration<double>(t2 - t1).count() / 1e9;
    std::printf("scores %.1f  pv %.1f GFLOP/s  scores / pv %.3f\n", gs, gp, gs / gp);
  }
}
