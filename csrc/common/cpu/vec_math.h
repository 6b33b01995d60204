#pragma once
// Row primitives of the CPU kernels: max, exp2 with a running sum, scaling, conversion.
// float rows use AVX2/FMA when the translation unit is compiled for it; every other case
// (double rows, other ISAs, the tails) takes the scalar loop, which defines the semantics.
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <limits>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include "common/constants.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTN_EXT_AVX2 1
#endif

namespace attn_ext::cpu {

#ifdef ATTN_EXT_AVX2
namespace avx2 {
constexpr int kWidth = 8;
// Bytes per cache line: the step of the software prefetches.
constexpr int64_t kCacheLine = 64;
// Scores below 2^-127 flush to 0 (exp2(-inf) of masked scores included): clamping x at
// kExp2Floor gives n = -127 and f = 0, so p = 1 and the exponent bits of 2^n * p are
// exactly 0. Between 2^-127 and 2^-125 the construction yields a denormal within 2^-126 of
// the true value, which no sum of probabilities (the largest is 1) can see.
constexpr float kExp2Floor = -127.f;

// exp2's polynomial in f (below), highest degree first: the Taylor coefficients of 2^f = e^(f ln2),
// (ln 2)^k / k!. The one definition every vector width evaluates, by Horner with one FMA per
// coefficient in this order (avx2::exp2 here, the AVX-512 row pass in
// attention/cpu/avx512_softmax_rows.cpp), so the widths return identical bits
// (tests/test_cpu_kernels.py compares the kernel sets' outputs bit for bit).
constexpr float kExp2Poly[] = {0.000154035303933816f,
                               0.00133335581464284f,
                               0.00961812910762848f,
                               0.0555041086648216f,
                               0.240226506959101f,
                               0.693147180559945f,
                               1.f};
constexpr int kExp2PolyTerms = sizeof(kExp2Poly) / sizeof(kExp2Poly[0]);

// 2^x for x <= 0 (scores minus their row max): x = n + f with f in [-1/2, 1/2],
// 2^f by its degree-6 Taylor polynomial in f*ln2 (kExp2Poly; |rel err| < 2.2e-7, measured over
// [-30, 0]), 2^n added to the exponent bits. NaN propagates: max(floor, NaN) is NaN.
inline __m256 exp2(__m256 x) {
  // _mm256_max_ps returns its second operand when either is NaN.
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(kExp2Floor), x);
  const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(xc, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2PolyTerms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
}  // namespace avx2
#endif

// max over x[0..n); -inf for n == 0. A NaN need not win here: it reaches the output
// through exp2(x - max) all the same.
template <typename T>
inline T row_max(const T* x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// x[j] *= a; returns the max of the new values (-inf for n == 0). The kernels scale raw
// Q K^T scores by scale * log2(e) here rather than pre-scaling Q: a pre-scaled Q rounds
// every q_d before the dot product, which for rows with a dominant key tripled fp32's
// worst-case output error (measured against float64 over 2048 x 2048 randn inputs).
template <typename T>
inline T scale_row_max(T* x, int64_t n, T a) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    x[j] *= a;
    m = x[j] > m ? x[j] : m;
  }
  return m;
}

// x[j] = exp2(x[j] - shift); returns the sum of the new values.
template <typename T>
inline T exp2_shift_sum(T* x, int64_t n, T shift) {
  T s = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp2(x[j] - shift);
    s += x[j];
  }
  return s;
}

// x[j] = cap * tanh(x[j] / cap): logit soft-capping (Gemma 2) of a score row.
template <typename T>
inline void softcap_row(T* x, int64_t n, T cap) {
  for (int64_t j = 0; j < n; ++j) x[j] = cap * std::tanh(x[j] / cap);
}

// x[j] = exp2((x[j] * a - hi) - lo): raw scores scaled as scale_row_max scales them, then
// shifted by a float pair hi + lo, so a large shift (a log-sum-exp) costs no extra
// rounding before the subtraction.
template <typename T>
inline void exp2_scale_shift2(T* x, int64_t n, T a, T hi, T lo) {
  for (int64_t j = 0; j < n; ++j) x[j] = std::exp2((x[j] * a - hi) - lo);
}

// x[j] *= a
template <typename T>
inline void scale_row(T* x, int64_t n, T a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

// ds[j] = p[j] * (dp[j] - delta): the softmax backward of one row, in place on dp.
template <typename T>
inline void softmax_grad_row(const T* p, T* dp, int64_t n, T delta) {
  for (int64_t j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - delta);
}

#ifdef ATTN_EXT_AVX2
template <>
inline float row_max<float>(const float* x, int64_t n) {
  int64_t j = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (n >= avx2::kWidth) {
    __m256 mv = _mm256_set1_ps(m);
    for (; j + avx2::kWidth <= n; j += avx2::kWidth) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + j));
    m = avx2::hmax(mv);
  }
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

template <>
inline float scale_row_max<float>(float* x, int64_t n, float a) {
  int64_t j = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (n >= avx2::kWidth) {
    const __m256 av = _mm256_set1_ps(a);
    __m256 mv = _mm256_set1_ps(m);
    for (; j + avx2::kWidth <= n; j += avx2::kWidth) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + j), av);
      _mm256_storeu_ps(x + j, v);
      mv = _mm256_max_ps(mv, v);
    }
    m = avx2::hmax(mv);
  }
  for (; j < n; ++j) {
    x[j] *= a;
    m = x[j] > m ? x[j] : m;
  }
  return m;
}

template <>
inline float exp2_shift_sum<float>(float* x, int64_t n, float shift) {
  const __m256 sv = _mm256_set1_ps(shift);
  // Two independent chains so consecutive vectors' polynomials overlap in the pipeline.
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 * avx2::kWidth <= n; j += 2 * avx2::kWidth) {
    const __m256 e0 = avx2::exp2(_mm256_sub_ps(_mm256_loadu_ps(x + j), sv));
    const __m256 e1 = avx2::exp2(_mm256_sub_ps(_mm256_loadu_ps(x + j + avx2::kWidth), sv));
    _mm256_storeu_ps(x + j, e0);
    _mm256_storeu_ps(x + j + avx2::kWidth, e1);
    acc0 = _mm256_add_ps(acc0, e0);
    acc1 = _mm256_add_ps(acc1, e1);
  }
  for (; j + avx2::kWidth <= n; j += avx2::kWidth) {
    const __m256 e = avx2::exp2(_mm256_sub_ps(_mm256_loadu_ps(x + j), sv));
    _mm256_storeu_ps(x + j, e);
    acc0 = _mm256_add_ps(acc0, e);
  }
  float s = avx2::hsum(_mm256_add_ps(acc0, acc1));
  for (; j < n; ++j) {
    x[j] = std::exp2(x[j] - shift);
    s += x[j];
  }
  return s;
}

template <>
inline void exp2_scale_shift2<float>(float* x, int64_t n, float a, float hi, float lo) {
  const __m256 av = _mm256_set1_ps(a), hv = _mm256_set1_ps(hi), lv = _mm256_set1_ps(lo);
  int64_t j = 0;
  for (; j + avx2::kWidth <= n; j += avx2::kWidth) {
    const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(x + j), av);
    _mm256_storeu_ps(x + j, avx2::exp2(_mm256_sub_ps(_mm256_sub_ps(sc, hv), lv)));
  }
  for (; j < n; ++j) x[j] = std::exp2((x[j] * a - hi) - lo);
}

template <>
inline void scale_row<float>(float* x, int64_t n, float a) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t j = 0;
  for (; j + avx2::kWidth <= n; j += avx2::kWidth)
    _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), av));
  for (; j < n; ++j) x[j] *= a;
}

namespace detail {
// tanh on 8 lanes, two formulas blended on |y| < kSmall:
// - |y| >= kSmall: (1 - t) / (1 + t), t = e^(-2|y|) (avx2::exp2): no cancellation there, the
//   result is >= 0.46;
// - |y| < kSmall: the odd Taylor series through y^17 (Horner in y^2), whose first omitted term
//   is below 1e-9 of the value (successive terms shrink by ~(2y / pi)^2 <= 0.1).
inline __m256 tanh8(__m256 y) {
  constexpr float kSmall = 0.5f;
  // tanh's Taylor coefficients: 1, -1/3, 2/15, -17/315, 62/2835, -1382/155925,
  // 21844/6081075, -929569/638512875, 6404582/10854718875
  constexpr float kC[] = {1.f,
                          -1.f / 3.f,
                          2.f / 15.f,
                          -17.f / 315.f,
                          62.f / 2835.f,
                          -1382.f / 155925.f,
                          21844.f / 6081075.f,
                          -929569.f / 638512875.f,
                          6404582.f / 10854718875.f};
  constexpr int kTerms = sizeof(kC) / sizeof(kC[0]);
  const __m256 sign_mask = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_andnot_ps(sign_mask, y);  // |y|
  const __m256 y2 = _mm256_mul_ps(y, y);
  __m256 poly = _mm256_set1_ps(kC[kTerms - 1]);
  for (int c = kTerms - 2; c >= 0; --c) poly = _mm256_fmadd_ps(poly, y2, _mm256_set1_ps(kC[c]));
  const __m256 small = _mm256_mul_ps(poly, y);
  const __m256 t = avx2::exp2(_mm256_mul_ps(a, _mm256_set1_ps(-2.f * static_cast<float>(kLog2e))));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 large_abs = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
  const __m256 large = _mm256_or_ps(large_abs, _mm256_and_ps(sign_mask, y));  // sign of y
  return _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(kSmall), _CMP_LT_OQ));
}
}  // namespace detail

template <>
inline void softcap_row<float>(float* x, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.f / cap);
  int64_t j = 0;
  for (; j + avx2::kWidth <= n; j += avx2::kWidth) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + j), inv);
    _mm256_storeu_ps(x + j, _mm256_mul_ps(c, detail::tanh8(y)));
  }
  for (; j < n; ++j) x[j] = cap * std::tanh(x[j] / cap);
}

template <>
inline void softmax_grad_row<float>(const float* p, float* dp, int64_t n, float delta) {
  const __m256 dv = _mm256_set1_ps(delta);
  int64_t j = 0;
  for (; j + avx2::kWidth <= n; j += avx2::kWidth) {
    const __m256 r =
        _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_sub_ps(_mm256_loadu_ps(dp + j), dv));
    _mm256_storeu_ps(dp + j, r);
  }
  for (; j < n; ++j) dp[j] = p[j] * (dp[j] - delta);
}
#endif

// dst[j] = acc_t(src[j]) * a (loads a row of a reduced-precision input into fp32).
template <typename acc_t, typename scalar_t>
inline void load_row(const scalar_t* src, acc_t* dst, int64_t n, acc_t a) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<acc_t>(src[j]) * a;
}

// dst[j] = scalar_t(src[j] * a)
template <typename scalar_t, typename acc_t>
inline void store_row(const acc_t* src, scalar_t* dst, int64_t n, acc_t a) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<scalar_t>(src[j] * a);
}

#ifdef ATTN_EXT_AVX2
// Reduced-precision rows convert 8 lanes at a time (F16C for fp16, a 16-bit shift for
// bf16): c10's scalar fp16 conversion is bit manipulation that no compiler vectorizes,
// and converting K/V tiles would otherwise cost a fifth of the forward.
namespace avx2 {
inline __m256 load8(const float* src) {
  return _mm256_loadu_ps(src);
}
inline __m256 load8(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
inline __m256 load8(const c10::BFloat16* src) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// float8 rows widen through fp16, which F16C widens exactly (subnormals included, whatever
// MXCSR's denormal flags). An e5m2 byte is the high byte of the fp16 of its value. An e4m3fn
// byte's exponent and mantissa moved into fp16's fields read as its value times 2^-8 (fp16's
// exponent bias is 15, e4m3's 7; subnormals too), so one exact multiply by 2^8 restores it:
// the byte sign-extended to 16 bits and shifted left by 7 puts them there, with the sign in
// bit 15 and a copy of it in bit 14, which the mask clears. e4m3fn's NaN (every bit but the
// sign set: the low 7 bits, shifted to the top, read 0xFE00) becomes an fp16 NaN.
constexpr float kE4m3HalfBias = 256.0f;
constexpr int16_t kE4m3HalfMask = ~int16_t(1 << 14);
constexpr int16_t kE4m3NanLow7 = int16_t(0xFE00);
constexpr int16_t kHalfExponent = 0x7C00;
inline __m128i e4m3_to_half8(__m128i bytes) {
  const __m128i w = _mm_cvtepi8_epi16(bytes);
  const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(kE4m3HalfMask));
  const __m128i nan = _mm_cmpeq_epi16(_mm_slli_epi16(w, 9), _mm_set1_epi16(kE4m3NanLow7));
  return _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(kHalfExponent)));
}
inline __m256 load8(const c10::Float8_e4m3fn* src) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  return _mm256_mul_ps(_mm256_cvtph_ps(e4m3_to_half8(b)), _mm256_set1_ps(kE4m3HalfBias));
}
inline __m256 load8(const c10::Float8_e5m2* src) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
}
inline void store8(float* dst, __m256 v) {
  _mm256_storeu_ps(dst, v);
}
inline void store8(c10::Half* dst, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// c10's rounding, lane by lane: round to nearest even by adding 0x7FFF plus the kept part's
// lowest bit, NaN to the quiet NaN 0x7FC0. (The 32 -> 16-bit pack saturates signed inputs,
// and the rounded words are 0..0xFFFF, so it keeps them.)
inline void store8(c10::BFloat16* dst, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}
}  // namespace avx2

// store_row: fp16 stores go through F16C (round to nearest even, like c10::Half); bf16 stores
// keep c10's scalar rounding, which the compiler vectorizes well enough there (avx2::store8 is
// the same rounding for loops the compiler leaves scalar).
template <typename scalar_t>
inline constexpr bool kVectorLoad =
    std::is_same_v<scalar_t, c10::Half> || std::is_same_v<scalar_t, c10::BFloat16> ||
    std::is_same_v<scalar_t, c10::Float8_e4m3fn> || std::is_same_v<scalar_t, c10::Float8_e5m2>;

template <typename scalar_t, std::enable_if_t<kVectorLoad<scalar_t>, int> = 0>
inline void load_row(const scalar_t* src, float* dst, int64_t n, float a) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t j = 0;
  for (; j + avx2::kWidth <= n; j += avx2::kWidth)
    _mm256_storeu_ps(dst + j, _mm256_mul_ps(avx2::load8(src + j), av));
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]) * a;
}

inline void store_row(const float* src, c10::Half* dst, int64_t n, float a) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t j = 0;
  for (; j + avx2::kWidth <= n; j += avx2::kWidth)
    avx2::store8(dst + j, _mm256_mul_ps(_mm256_loadu_ps(src + j), av));
  for (; j < n; ++j) dst[j] = static_cast<c10::Half>(src[j] * a);
}
#endif

// sum_j acc_t(a[j]) * acc_t(b[j]); float accumulation runs 8 lanes of FMAs (one lane per
// j mod 8, summed by hsum) then the tail in order.
template <typename acc_t, typename scalar_t>
inline acc_t row_dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  int64_t j = 0;
  acc_t s = 0;
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float>) {  // float, fp16 and bf16 rows
    __m256 v = _mm256_setzero_ps();
    for (; j + avx2::kWidth <= n; j += avx2::kWidth)
      v = _mm256_fmadd_ps(avx2::load8(a + j), avx2::load8(b + j), v);
    s = avx2::hsum(v);
  }
#endif
  for (; j < n; ++j) s += static_cast<acc_t>(a[j]) * static_cast<acc_t>(b[j]);
  return s;
}

// Points at a tile of `rows` rows of a strided input, converting it to acc_t if needed.
template <typename scalar_t, typename acc_t>
const acc_t* load_tile(const scalar_t* src, int64_t ld, int64_t rows, int64_t cols, acc_t* buf,
                       int64_t* ld_out) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    *ld_out = ld;
    return src;
  } else {
    for (int64_t r = 0; r < rows; ++r) load_row(src + r * ld, buf + r * cols, cols, acc_t(1));
    *ld_out = cols;
    return buf;
  }
}

}  // namespace attn_ext::cpu
