// Times the bf16 forward's softmax row pass (exp2 of the scores minus the row max, the row sum,
// P rounded to bf16) alone, one thread, on a 128 x 256 fp32 score block (L2-resident, as in the
// forward) and a 16 x 256 one (L1): the shipped exp2_shift_sum_bf16 against the forms it went
// through (avx2::exp2's steps 16 then 32 values a step, two accumulators, vscalefps for the
// exponent with the Taylor polynomials of degree 6 and 4, vreduceps with degree 5 without and with
// the zeroed denormal lanes, which is what shipped). OFFSET=110 moves the scores down so that
// some results are denormal. Results: dev/cpu_forward_experiments.md, "bf16 row pass".
//
//   TI=$(python -c "import torch.utils.cpp_extension as c; \
//        print(' '.join('-I' + p for p in c.include_paths()))")
//   g++ -O3 -mavx2 -mfma -Icsrc $TI dev/row_pass_bench/bench.cpp \
//       csrc/attention/cpu/avx512_softmax_rows.cpp -o /tmp/rp && /tmp/rp
#include "attention/cpu/avx512_softmax_rows.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <immintrin.h>
#include <initializer_list>

#include "common/cpu/vec_math.h"

#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,fma")

namespace {
constexpr float kFloor = attn_ext::cpu::avx2::kExp2Floor;
// Degree 6, Taylor: the fp32 sets' polynomial (vec_math.h).
constexpr const float* kP6 = attn_ext::cpu::avx2::kExp2Poly;

// Degree 5 on [0, 1), constant term 1 (so 2^0 = 1 exactly); |rel err| < 1.5e-7 in fp32.
constexpr float kP5[] = {0.0018671300495043397f, 0.009017030708491802f, 0.05579991266131401f,
                         0.24016444385051727f,   0.6931512951850891f,   1.f};

template <int Terms>
inline __m512 poly(__m512 f, const float* c) {
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return p;
}

// Shipped: exponent added to the bits.
template <int Terms>
inline __m512 exp2_bits(__m512 x, const float* c) {
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(kFloor), x);
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 p = poly<Terms>(_mm512_sub_ps(xc, n), c);
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}
// vscalefps: p * 2^n in one instruction.
template <int Terms>
inline __m512 exp2_scalef(__m512 x, const float* c) {
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(kFloor), x);
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(poly<Terms>(_mm512_sub_ps(xc, n), c), n);
}

// x = floor(x) + f, f in [0, 1) by vreduceps (exact); 2^floor(x) applied by vscalefps, which
// also takes -inf to 0. Below 2^-126 the result is denormal.
inline __m512 exp2_reduce(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(poly<6>(f, kP5), x);
}
// The same with lanes below 2^-126 set to 0 (never computed as denormals).
inline __m512 exp2_reduce_ftz(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(normal, poly<6>(f, kP5), x);
}

template <typename Exp>
float pass(const float* x, int64_t n, float shift, uint16_t* dst, Exp exp2) {
  const __m512 sv = _mm512_set1_ps(shift);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 32) {
    const __m512 e0 = exp2(_mm512_sub_ps(_mm512_loadu_ps(x + j), sv));
    const __m512 e1 = exp2(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16), sv));
    _mm512_storeu_si512(dst + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// The shipped pass before 2026-11-26 (main loop only): 16 values a step, one accumulator.
float pass16(const float* x, int64_t n, float shift, uint16_t* dst) {
  const __m512 sv = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 e = exp2_bits<7>(_mm512_sub_ps(_mm512_loadu_ps(x + j), sv), kP6);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(e));
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

template <typename F>
double time_it(const char* name, int64_t rows, F f, double base) {
  const float offset = std::getenv("OFFSET") ? std::atof(std::getenv("OFFSET")) : 0.f;
  constexpr int64_t kCols = 256;
  static float* s = static_cast<float*>(std::aligned_alloc(64, 128 * kCols * 4));
  static uint16_t* p = static_cast<uint16_t*>(std::aligned_alloc(64, 128 * kCols * 2));
  for (int64_t i = 0; i < 128 * kCols; ++i) s[i] = -float(i % 97) * 0.3f - offset;
  double best = 1e30, sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const int64_t iters = (1 << 22) / (rows * kCols) * 16;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t it = 0; it < iters; ++it)
      for (int64_t r = 0; r < rows; ++r) sink += f(s + r * kCols, kCols, 0.5f, p + r * kCols);
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
        double(iters * rows * kCols);
    if (ns < best) best = ns;
  }
  std::printf("%-28s rows %3ld: %.3f ns/elem %s%.2fx (sink %g)\n", name, rows, best, base ? "" : "",
              base ? base / best : 1.0, sink > 0 ? 1.0 : 0.0);
  return best;
}
}  // namespace

int main() {
  using attn_ext::cpu::avx512::exp2_shift_sum_bf16;
  for (int64_t rows : {16, 128}) {
    const double b = time_it(
        "shipped", rows,
        [](const float* x, int64_t n, float sh, uint16_t* d) {
          return exp2_shift_sum_bf16(x, n, 1.f, sh, d, n);
        },
        0);
    time_it(
        "16 a step (before)", rows,
        [](const float* x, int64_t n, float sh, uint16_t* d) { return pass16(x, n, sh, d); }, b);
    time_it(
        "2 accumulators", rows,
        [](const float* x, int64_t n, float sh, uint16_t* d) {
          return pass(x, n, sh, d, [](__m512 v) { return exp2_bits<7>(v, kP6); });
        },
        b);
    time_it(
        "2 acc + vscalefps", rows,
        [](const float* x, int64_t n, float sh, uint16_t* d) {
          return pass(x, n, sh, d, [](__m512 v) { return exp2_scalef<7>(v, kP6); });
        },
        b);
    time_it(
        "2 acc, vscalefps, degree 4", rows,
        [](const float* x, int64_t n, float sh, uint16_t* d) {
          return pass(x, n, sh, d, [](__m512 v) { return exp2_scalef<5>(v, kP6 + 2); });
        },
        b);
    time_it(
        "2 acc, vreduceps, degree 5", rows,
        [](const float* x, int64_t n, float sh, uint16_t* d) {
          return pass(x, n, sh, d, exp2_reduce);
        },
        b);
    time_it(
        "the same, lanes < -126 zeroed", rows,
        [](const float* x, int64_t n, float sh, uint16_t* d) {
          return pass(x, n, sh, d, exp2_reduce_ftz);
        },
        b);
    time_it(
        "no exp (floor)", rows,
        [](const float* x, int64_t n, float sh, uint16_t* d) {
          return pass(x, n, sh, d, [](__m512 v) { return v; });
        },
        b);
  }
}
