// How fast one core issues vdpbf16ps against vfmadd231ps on zmm registers: N independent
// accumulator chains of each, so the loop is bound by issue rate and not by latency once N
// covers latency x pipes. Decides whether AVX512-BF16 products can beat the fp32 products on a
// CPU (block_kernels.cpp's auto order; notes in dev/cpu_forward_experiments.md, "vdpbf16ps
// against the FMA"). A vdpbf16ps does 32 multiply-adds and an FMA 16, so at equal rates the
// bf16 products do twice the work per instruction.
//
//   g++ -O2 -o /tmp/rate dev/vdpbf16ps_rate/bench.cpp && /tmp/rate
#include <chrono>
#include <cstdio>
#include <immintrin.h>

namespace {

constexpr long kIters = 25000000;  // ~0.1 s per loop at 24 chains and 2 instructions a cycle
constexpr int kRounds = 3;         // the loops alternate; shared machines drift between minutes

template <int N>
__attribute__((target("avx512f,avx512bw,avx512bf16"), noinline)) float bf16_chains(long iters) {
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f81);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 32
    for (int i = 0; i < N; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    asm volatile("" : "+v"(a), "+v"(b));  // keeps the operands in registers, the loop alive
  }
  __m512 s = acc[0];
  for (int i = 1; i < N; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

template <int N>
__attribute__((target("avx512f"), noinline)) float fma_chains(long iters) {
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 32
    for (int i = 0; i < N; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    asm volatile("" : "+v"(a), "+v"(b));
  }
  __m512 s = acc[0];
  for (int i = 1; i < N; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// Instructions per second (G/s) of one loop of N chains.
template <int N, typename F>
double rate(F loop) {
  const auto t0 = std::chrono::steady_clock::now();
  volatile float sink = loop(kIters);
  (void)sink;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return double(kIters) * N / s / 1e9;
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("this CPU reports no AVX512-BF16\n");
    return 1;
  }
  for (int r = 0; r < kRounds; ++r)
    std::printf(
        "G instructions/s: fma x12 %.2f  vdpbf16ps x12 %.2f  fma x24 %.2f  vdpbf16ps x24 %.2f\n",
        rate<12>(fma_chains<12>), rate<12>(bf16_chains<12>), rate<24>(fma_chains<24>),
        rate<24>(bf16_chains<24>));
  return 0;
}
