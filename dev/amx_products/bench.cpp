// Times the AMX block products (csrc/attention/cpu/amx_block_products.cpp) alone, one thread,
// on a forward tile pair (Q 128 x 128 against 256 or 512 keys), with operands aligned to 64 bytes
// (-DALIGNED, as CacheLineAllocator gives the kernels) or at malloc's alignment. Results and what
// they decided: dev/cpu_forward_experiments.md, "AMX block products". Run it for a second or more
// per case: the tile unit warms up over the first ~100 ms of a run.
//
//   g++ -O3 -mavx2 -mfma -DALIGNED -Icsrc dev/amx_products/bench.cpp \
//       csrc/attention/cpu/amx_block_products.cpp -o /tmp/amx_bench && /tmp/amx_bench 256
#include "attention/cpu/amx_block_products.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace attn_ext::cpu::amx;

// std::vector storage on 64-byte boundaries (-DALIGNED) or malloc's.
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const LineAligned&) const { return true; }
  bool operator!=(const LineAligned&) const { return false; }
};
#ifdef ALIGNED
template <class T>
using Vec = std::vector<T, LineAligned<T>>;
#else
template <class T>
using Vec = std::vector<T>;
#endif

int main(int argc, char** argv) {
  constexpr int64_t kRows = 128, kD = 128;  // the forward's query block and a common head dim
  constexpr int kIters = 60000;             // ~1 s per product at ~1 TFLOP/s
  constexpr uint16_t kOne = 0x3f80, kHalf = 0x3f00, kQuarter = 0x3e80;  // bf16 bits
  const int64_t n = argc > 1 ? std::atoi(argv[1]) : 256;                // keys per tile
  if (!available()) {
    std::printf("this CPU or OS offers no AMX-BF16 tiles\n");
    return 1;
  }
  ThreadTiles tiles;
  Vec<uint16_t> q(kRows * kD, kOne), k(n * kD, kHalf), v(n * kD, kQuarter), p(kRows * n, kOne);
  Vec<uint16_t> kt(key_tile_elems(n, kD)), vt(value_tile_elems(n, kD));
  Vec<uint16_t> tail(value_tile_elems(kPairDepth, kD));
  pack_keys(k.data(), kD, n, kD, kt.data());
  pack_values(v.data(), kD, n, kD, vt.data());
  Vec<float> s(kRows * n), o(kRows * kD), factor(kRows, 1.f);
  std::printf("operands at %ld / %ld bytes past a cache line\n",
              static_cast<long>(reinterpret_cast<uintptr_t>(q.data()) % 64),
              static_cast<long>(reinterpret_cast<uintptr_t>(kt.data()) % 64));
  auto seconds = [](auto t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int round = 0; round < 3; ++round) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kIters; ++i)
      scores(q.data(), kD, kRows, kt.data(), n, kD, 0.1f, s.data(), n);
    const double t_scores = seconds(t0);
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kIters; ++i)
      pv(p.data(), n, kRows, vt.data(), n, kD, factor.data(), o.data(), kD, tail.data());
    const double t_pv = seconds(t0);
    const double flops = 2.0 * kRows * n * kD * kIters;
    std::printf("keys %ld: scores %.2f TFLOP/s, pv %.2f TFLOP/s\n", static_cast<long>(n),
                flops / t_scores / 1e12, flops / t_pv / 1e12);
  }
}
