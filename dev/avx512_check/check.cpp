// Runs the AVX-512 block products next to the AVX2 ones on random data and compares them bit
// for bit over every row remainder, panel tail and partial-panel width (the cases of
// tests/test_cpu_kernels.py, here with the real intrinsics). Built static and booted as the
// init of a Linux guest on an emulated AVX-512 CPU by run_bochs.sh; prints one verdict line.
#include <sys/reboot.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/avx512_block_products.h"

using namespace attn_ext::cpu;

namespace {

uint64_t rng_state = 0x9E3779B97F4A7C15ull;
float next_float() {  // xorshift64*, uniform in [-1, 1)
  rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
  return static_cast<float>((rng_state * 0x2545F4914F6CDD1Dull) >> 40) / float(1 << 23) - 1.f;
}
std::vector<float> random(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = next_float();
  return v;
}
int64_t round16(int64_t n) {
  return (n + 15) / 16 * 16;
}

const int64_t kRowsList[] = {1, 2, 3, 4, 5, 7, 11, 12, 13, 14, 15, 16, 25, 37, 128};
const int64_t kColsList[] = {1, 8, 16, 17, 24, 31, 32, 33, 40, 48, 80, 128};
int cases = 0, failures = 0;

void expect_equal(const std::vector<float>& a, const std::vector<float>& b, const char* what,
                  int64_t x, int64_t y, int64_t z) {
  ++cases;
  if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0 && failures++ < 10)
    std::printf("MISMATCH %s %lld %lld %lld\n", what, (long long)x, (long long)y, (long long)z);
}

void check_scores() {
  for (int64_t d : {5, 64, 128})
    for (int64_t n : {1, 16, 17, 32, 33, 77, 256}) {
      std::vector<float> k = random(n * (d + 2)), kp(round16(n) * d);
      avx2::pack_key_panels(k.data(), d + 2, n, d, kp.data());
      for (int64_t m : kRowsList) {
        std::vector<float> q = random(m * (d + 1));
        const int64_t lds = round16(n) + 5;
        std::vector<float> s0(m * lds, 12345.f), s1 = s0;
        avx2::scores_tile(q.data(), d + 1, m, kp.data(), n, d, 0.37f, s0.data(), lds);
        avx512::scores_tile(q.data(), d + 1, m, kp.data(), n, d, 0.37f, s1.data(), lds);
        expect_equal(s0, s1, "scores m n d", m, n, d);
      }
    }
}

void check_pv() {
  for (int with_factor = 0; with_factor < 2; ++with_factor)
    for (int64_t n : {1, 17, 100})
      for (int64_t dv : kColsList) {
        std::vector<float> v = random(n * dv);
        const int64_t stride = round16(n) * 16;
        std::vector<float> vp(round16(dv) / 16 * stride, 0.f);
        avx2::pack_value_panels(v.data(), dv, n, dv, vp.data(), stride);
        for (int64_t m : kRowsList) {
          std::vector<float> p = random(m * (n + 3)), factor = random(m);
          std::vector<float> o0 = random(m * (dv + 3)), o1 = o0;
          const float* f = with_factor ? factor.data() : nullptr;
          avx2::pv_tile(p.data(), n + 3, m, vp.data(), stride, n, dv, f, o0.data(), dv + 3);
          avx512::pv_tile(p.data(), n + 3, m, vp.data(), stride, n, dv, f, o1.data(), dv + 3);
          expect_equal(o0, o1, "pv m n dv", m, n, dv);
        }
      }
}

void check_atb() {
  for (int64_t m : {1, 9, 64})
    for (int64_t dc : kColsList) {
      std::vector<float> b = random(m * dc);
      const int64_t stride = round16(m) * 16;
      std::vector<float> bp(round16(dc) / 16 * stride, 0.f);
      avx2::pack_value_panels(b.data(), dc, m, dc, bp.data(), stride);
      for (int64_t n : kRowsList) {
        std::vector<float> a = random(m * (n + 2));
        std::vector<float> c0 = random(n * (dc + 1)), c1 = c0;
        avx2::atb_tile(a.data(), n + 2, m, n, bp.data(), stride, dc, c0.data(), dc + 1);
        avx512::atb_tile(a.data(), n + 2, m, n, bp.data(), stride, dc, c1.data(), dc + 1);
        expect_equal(c0, c1, "atb m n dc", m, n, dc);
      }
    }
}

}  // namespace

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("AVX512 CHECK SKIPPED: this CPU reports no AVX-512F\n");
  } else {
    check_scores();
    check_pv();
    check_atb();
    std::printf("AVX512 CHECK %s: %d cases, %d mismatches\n", failures ? "FAIL" : "PASS", cases,
                failures);
  }
  std::fflush(stdout);
  if (getpid() == 1) {  // the guest's init: power off instead of letting the kernel panic
    sync();
    sleep(1);  // let the serial port drain the verdict before the machine goes away
    reboot(RB_POWER_OFF);
  }
  return failures ? 1 : 0;
}
