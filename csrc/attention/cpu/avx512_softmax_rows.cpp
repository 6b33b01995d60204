// The softmax row pass on AVX-512 (contracts in avx512_softmax_rows.h).
//
// Same bits as vec_math.h's AVX2 versions: exp2 runs the same operations per element (clamp,
// round to nearest, Horner over avx2::kExp2Poly with FMAs, exponent add), and the sum keeps
// AVX2's order. The AVX2 loop adds 16 elements per step into two 8-lane accumulators (lane l of
// the pair sums the elements j = l mod 16 in order), then at most one 8-element step into the
// first, then avx2::hsum of their sum, then a scalar tail; one 16-lane accumulator holds exactly
// that pair, the 8-element step is a masked add into its low half, and its halves are added and
// reduced by the same avx2::hsum. So the row pass changes no output of the fp32 kernel sets.
// The bf16 sets' fused pass (exp2_shift_sum_bf16, at the end) owes no bits to AVX2 and takes a
// cheaper exp2 of the same or better accuracy.
//
// This file is compiled with the build's flags (AVX2) and switches to AVX-512 with a target
// pragma after its includes (wide_target_begin.h), as avx512_block_products.cpp does; the AVX2
// helpers it calls (avx2::hsum, std::exp2) are defined before the pragma, so they keep the build's
// flags.
#include "attention/cpu/avx512_softmax_rows.h"

#ifdef ATTN_EXT_AVX512_PRODUCTS
#include <cmath>
#include <cstdint>
#include <limits>
#include <immintrin.h>

#include "common/cpu/vec_math.h"

#define ATTN_EXT_WIDE_TARGET "avx512f,fma"
#include "common/cpu/wide_target_begin.h"
// The functions that need more than the region's sets name them (none under emulation).
#ifdef ATTN_EXT_AVX512_EMULATION
#define ATTN_EXT_ROW_PASS_TARGET(isa)
#else
#define ATTN_EXT_ROW_PASS_TARGET(isa) __attribute__((target(isa)))
#endif

namespace attn_ext::cpu::avx512 {
namespace {

constexpr int kLanes = 16;
constexpr __mmask16 kLowHalf = 0x00FF;  // the lanes of the AVX2 loop's first accumulator

// The first `count` lanes (none for count <= 0, all for count >= 16).
inline __mmask16 first_lanes(int64_t count) {
  return count <= 0        ? __mmask16(0)
         : count >= kLanes ? __mmask16(0xFFFF)
                           : __mmask16((1u << count) - 1u);
}

// avx2::exp2 on 16 lanes, operation for operation.
inline __m512 exp2(__m512 x) {
  // _mm512_max_ps, like _mm256_max_ps, returns its second operand when either is NaN.
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(avx2::kExp2Floor), x);
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(avx2::kExp2Poly[0]);
  for (int i = 1; i < avx2::kExp2PolyTerms; ++i)
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(avx2::kExp2Poly[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

}  // namespace

float row_max(const float* x, int64_t n) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + j));
  // The tail as masked lanes (the others keep -inf): the max is the same in any order.
  if (j < n) {
    const __mmask16 lanes = first_lanes(n - j);
    mv = _mm512_mask_max_ps(mv, lanes, mv, _mm512_maskz_loadu_ps(lanes, x + j));
  }
  return _mm512_reduce_max_ps(mv);
}

float exp2_shift_sum(float* x, int64_t n, float shift) {
  const __m512 sv = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const __m512 e = exp2(_mm512_sub_ps(_mm512_loadu_ps(x + j), sv));
    _mm512_storeu_ps(x + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (j + avx2::kWidth <= n) {
    const __m512 e = exp2(_mm512_sub_ps(_mm512_maskz_loadu_ps(kLowHalf, x + j), sv));
    _mm512_mask_storeu_ps(x + j, kLowHalf, e);
    acc = _mm512_mask_add_ps(acc, kLowHalf, acc, e);
    j += avx2::kWidth;
  }
  float s =
      avx2::hsum(_mm256_add_ps(_mm512_castps512_ps256(acc),
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1))));
  for (; j < n; ++j) {
    x[j] = std::exp2(x[j] - shift);
    s += x[j];
  }
  return s;
}

// AVX2's loop is 8 lanes then a scalar tail through std::exp2; here 16 lanes, one masked 8-lane
// step, then the same scalar tail, so every element takes the same path as there.
void exp2_scale_shift2(float* x, int64_t n, float a, float hi, float lo) {
  const __m512 av = _mm512_set1_ps(a), hv = _mm512_set1_ps(hi), lv = _mm512_set1_ps(lo);
  auto step = [&](int64_t j, __mmask16 lanes) {
    const __m512 sc = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + j), av);
    _mm512_mask_storeu_ps(x + j, lanes, exp2(_mm512_sub_ps(_mm512_sub_ps(sc, hv), lv)));
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) step(j, 0xFFFF);
  if (j + avx2::kWidth <= n) step(j, kLowHalf), j += avx2::kWidth;
  for (; j < n; ++j) x[j] = std::exp2((x[j] * a - hi) - lo);
}

// Element-wise without a fused multiply-add: any lane count gives the same bits, the tail as
// masked lanes.
void softmax_grad_row(const float* p, float* dp, int64_t n, float delta) {
  const __m512 dv = _mm512_set1_ps(delta);
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 lanes = first_lanes(n - j);
    const __m512 r = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, p + j),
                                   _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, dp + j), dv));
    _mm512_mask_storeu_ps(dp + j, lanes, r);
  }
}

void scale_row(float* x, int64_t n, float a) {
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 lanes = first_lanes(n - j);
    _mm512_mask_storeu_ps(x + j, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + j), av));
  }
}

#ifdef ATTN_EXT_AMX_PRODUCTS
namespace {

// 2^f on [0, 1), highest degree first: degree 5 fitted for relative error (Lawson's reweighted
// least squares on Chebyshev points) with the constant term 1, so 2^0 = 1 exactly. Evaluated by
// Horner in fp32 its error is below 1.5e-7, under avx2::kExp2Poly's 2.2e-7 on [-1/2, 1/2]
// (degree 6), for one fused multiply-add less.
constexpr float kExp2UnitPoly[] = {0.0018671300495043397f, 0.009017030708491802f,
                                   0.05579991266131401f,   0.24016444385051727f,
                                   0.6931512951850891f,    1.f};
constexpr int kExp2UnitPolyTerms = sizeof(kExp2UnitPoly) / sizeof(kExp2UnitPoly[0]);
// Below 2^-126 an fp32 result is denormal; those lanes are set to 0 instead of computed.
constexpr float kExp2NormalFloor = -126.f;

// 2^x for the bf16 row pass, whose values are rounded to bf16 and which owes no bits to
// avx2::exp2: x = floor(x) + f with f in [0, 1) by vreduceps (exact), 2^f by the polynomial,
// 2^floor(x) applied by vscalefps. -inf (a masked score) gives 0, NaN propagates (the compare is
// unordered-true). Lanes below kExp2NormalFloor are zeroed by the instruction's mask, never
// computed: vscalefps takes a microcode assist on a denormal result, which ran a block of such
// lanes 10x slower (dev/row_pass_bench, OFFSET=110).
ATTN_EXT_ROW_PASS_TARGET("avx512f,avx512dq,fma") inline __m512 exp2_unit(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(kExp2UnitPoly[0]);
  for (int i = 1; i < kExp2UnitPolyTerms; ++i)
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2UnitPoly[i]));
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExp2NormalFloor), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(normal, p, x);
}

}  // namespace

// 32 values a step, rounded by one vcvtne2ps2bf16 into one 64-byte store, summed in two
// accumulators; the rest in masked 16-lane steps. With exp2_unit, 1.4-1.7x the rate of
// exp2_shift_sum's form (dev/row_pass_bench, dev/cpu_forward_experiments.md "bf16 row pass").
ATTN_EXT_ROW_PASS_TARGET("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,fma")
float exp2_shift_sum_bf16(const float* x, int64_t n, float scale, float shift, uint16_t* dst,
                          int64_t n_pad) {
  const __m512 av = _mm512_set1_ps(scale), sv = _mm512_set1_ps(shift);
  __m512 acc_lo = _mm512_setzero_ps(), acc_hi = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    const __m512 lo = exp2_unit(_mm512_fmsub_ps(_mm512_loadu_ps(x + j), av, sv));
    const __m512 hi = exp2_unit(_mm512_fmsub_ps(_mm512_loadu_ps(x + j + kLanes), av, sv));
    _mm512_storeu_si512(dst + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    acc_lo = _mm512_add_ps(acc_lo, lo);
    acc_hi = _mm512_add_ps(acc_hi, hi);
  }
  for (; j < n_pad; j += kLanes) {  // lanes past n are 0, up to n_pad
    const __mmask16 live = first_lanes(n - j);
    const __m512 e = _mm512_maskz_mov_ps(
        live, exp2_unit(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, x + j), av, sv)));
    _mm256_mask_storeu_epi16(dst + j, first_lanes(n_pad - j), (__m256i)_mm512_cvtneps_pbh(e));
    acc_lo = _mm512_add_ps(acc_lo, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc_lo, acc_hi));
}
#endif

}  // namespace attn_ext::cpu::avx512

#undef ATTN_EXT_ROW_PASS_TARGET
#include "common/cpu/wide_target_end.h"

#endif  // ATTN_EXT_AVX512_PRODUCTS
