#pragma once
// Scalar stand-ins for the AVX-512, AVX512-BF16 and AMX intrinsics of the CPU kernels' wide
// sources (csrc/attention/cpu/avx512_block_products.cpp, avx512_softmax_rows.cpp,
// avx512bf16_block_products.cpp, amx_block_products.cpp, and
// csrc/decoding/cpu/avx512_decode_rows.cpp), lane by lane with the same IEEE operations
// (multiply-adds fused), so their tiling, packing, masking and tails can be checked on a CPU
// without those instructions (tests/test_cpu_kernels.py). What they cannot check is
// the instructions themselves: the tests on CPUs that have them do that. Compile with
// -ffp-contract=off.
//
// The real <immintrin.h> comes first (the sources also use AVX2 intrinsics, and GCC declares
// the AVX-512 ones whatever the target); every AVX-512 / AMX name a source uses is then a macro
// for the stand-in below, so the sources compile unchanged apart from skipping their target
// pragmas. The semantics are those of the Intel SDM's pseudocode; where it leaves an order open
// (the reductions), GCC's own sequence is followed.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace attn_ext_emu {

// One 512-bit register, whatever its element type (__m512, __m512i, __m512bh, __m512d): the
// sources' casts between them are then copies.
struct Zmm {
  union {
    float f[16];
    int32_t i[16];
    uint32_t u[16];
    uint16_t h[32];
    uint64_t q[8];
  };
};
// 16 bf16 (a __m256bh), convertible to the real __m256i the sources cast it to.
struct Bf16x16 {
  uint16_t h[16];
  operator __m256i() const {
    __m256i r;
    std::memcpy(&r, h, sizeof(h));
    return r;
  }
};

inline bool on(unsigned k, int lane) {
  return (k >> lane) & 1u;
}
inline Zmm zero() {
  Zmm r;
  std::memset(&r, 0, sizeof(r));
  return r;
}
template <typename Op>
inline Zmm each(Op op) {
  Zmm r;
  for (int l = 0; l < 16; ++l) r.f[l] = op(l);
  return r;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
// make_fp32 of the SDM's bf16 dot products: denormal inputs read as zero (DAZ).
inline float bf16_in(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  return (u & 0x7F800000u) == 0 ? bits_float(u & 0x80000000u) : bits_float(u);
}
// Results below the normal range flushed to zero (FTZ), as those instructions do.
inline float ftz(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x;
}
// convert_fp32_to_bfloat16 (SDM, VCVTNEPS2BF16): nearest even, denormals to signed zero, NaN
// kept quiet.
inline uint16_t to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7F800000u) == 0) return uint16_t((u >> 16) & 0x8000u);
  if (std::isnan(x)) return uint16_t((u >> 16) | 0x40u);
  if (std::isinf(x)) return uint16_t(u >> 16);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// MAXPS: the second operand when either is NaN (or both are zeros).
inline float maxps(float a, float b) {
  return a > b ? a : b;
}

// ---- widening (the decode P V's 16-bit rows)
// VPMOVZXWD: 16 unsigned 16-bit lanes to 32 bits.
inline Zmm cvtepu16_epi32(__m256i a) {
  uint16_t h[16];
  std::memcpy(h, &a, sizeof(h));
  Zmm r;
  for (int l = 0; l < 16; ++l) r.u[l] = h[l];
  return r;
}
// VCVTPH2PS: 16 fp16 lanes to fp32, exact (F16C's scalar conversion, lane by lane).
inline Zmm cvtph_ps(__m256i a) {
  uint16_t h[16];
  std::memcpy(h, &a, sizeof(h));
  return each([&](int l) { return _cvtsh_ss(h[l]); });
}

// ---- loads, stores, constants
inline Zmm setzero() {
  return zero();
}
inline Zmm set1_ps(float a) {
  return each([&](int) { return a; });
}
inline Zmm set1_epi32(int a) {
  Zmm r;
  for (int32_t& x : r.i) x = a;
  return r;
}
inline Zmm loadu(const void* p) {
  Zmm r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline Zmm load_aligned(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 64) std::abort();  // vmovdqa32 faults on this
  return loadu(p);
}
inline void storeu(void* p, Zmm a) {
  std::memcpy(p, &a, sizeof(a));
}
inline Zmm maskz_loadu_ps(__mmask16 k, const float* p) {
  // Masked-off lanes are not read (no fault past the end of a row).
  return each([&](int l) { return on(k, l) ? p[l] : 0.f; });
}
inline void mask_storeu_ps(float* p, __mmask16 k, Zmm a) {
  for (int l = 0; l < 16; ++l)
    if (on(k, l)) p[l] = a.f[l];
}
inline void mask_storeu_epi16_256(void* p, __mmask16 k, __m256i a) {
  uint16_t h[16];
  std::memcpy(h, &a, sizeof(h));
  for (int l = 0; l < 16; ++l)
    if (on(k, l)) static_cast<uint16_t*>(p)[l] = h[l];
}
inline Zmm maskz_mov_ps(__mmask16 k, Zmm a) {
  return each([&](int l) { return on(k, l) ? a.f[l] : 0.f; });
}
inline Zmm maskz_loadu_epi16(__mmask32 k, const void* p) {
  Zmm r = zero();
  for (int l = 0; l < 32; ++l)
    if (on(k, l)) r.h[l] = static_cast<const uint16_t*>(p)[l];
  return r;
}
inline __m256i maskz_loadu_epi16_256(__mmask16 k, const void* p) {
  uint16_t h[16] = {};
  for (int l = 0; l < 16; ++l)
    if (on(k, l)) h[l] = static_cast<const uint16_t*>(p)[l];
  __m256i r;
  std::memcpy(&r, h, sizeof(h));
  return r;
}
inline Zmm maskz_mov_epi16(__mmask32 k, Zmm a) {
  Zmm r = a;
  for (int l = 0; l < 32; ++l)
    if (!on(k, l)) r.h[l] = 0;
  return r;
}

// ---- arithmetic
inline Zmm add_ps(Zmm a, Zmm b) {
  return each([&](int l) { return a.f[l] + b.f[l]; });
}
inline Zmm sub_ps(Zmm a, Zmm b) {
  return each([&](int l) { return a.f[l] - b.f[l]; });
}
inline Zmm mul_ps(Zmm a, Zmm b) {
  return each([&](int l) { return a.f[l] * b.f[l]; });
}
inline Zmm fmadd_ps(Zmm a, Zmm b, Zmm c) {
  return each([&](int l) { return std::fma(a.f[l], b.f[l], c.f[l]); });
}
inline Zmm fmsub_ps(Zmm a, Zmm b, Zmm c) {
  return each([&](int l) { return std::fma(a.f[l], b.f[l], -c.f[l]); });
}
inline Zmm max_ps(Zmm a, Zmm b) {
  return each([&](int l) { return maxps(a.f[l], b.f[l]); });
}
inline Zmm mask_add_ps(Zmm src, __mmask16 k, Zmm a, Zmm b) {
  return each([&](int l) { return on(k, l) ? a.f[l] + b.f[l] : src.f[l]; });
}
inline Zmm mask_max_ps(Zmm src, __mmask16 k, Zmm a, Zmm b) {
  return each([&](int l) { return on(k, l) ? maxps(a.f[l], b.f[l]) : src.f[l]; });
}
inline Zmm add_epi32(Zmm a, Zmm b) {
  Zmm r;
  for (int l = 0; l < 16; ++l) r.u[l] = a.u[l] + b.u[l];
  return r;
}
inline Zmm slli_epi32(Zmm a, unsigned n) {
  Zmm r;
  for (int l = 0; l < 16; ++l) r.u[l] = n > 31 ? 0u : a.u[l] << n;
  return r;
}
// VCVTPS2DQ under the default rounding (nearest even); out of range gives the integer
// indefinite 0x80000000. The sources convert only clamped, already integral values.
inline Zmm cvtps_epi32(Zmm a) {
  Zmm r;
  for (int l = 0; l < 16; ++l) {
    const float x = std::nearbyint(a.f[l]);
    r.i[l] = std::isfinite(x) && x >= -2147483648.f && x < 2147483648.f ? int32_t(x) : INT32_MIN;
  }
  return r;
}
// VRNDSCALEPS with 0 fraction bits: round to an integer in the immediate's mode.
inline float round_mode(float x, int imm) {
  switch (imm & 3) {
    case _MM_FROUND_TO_NEAREST_INT:
      return std::nearbyint(x);
    case _MM_FROUND_TO_NEG_INF:
      return std::floor(x);
    case _MM_FROUND_TO_POS_INF:
      return std::ceil(x);
    default:
      return std::trunc(x);
  }
}
inline Zmm roundscale_ps(Zmm a, int imm) {
  if (imm >> 4) std::abort();  // fraction bits: not used by the sources
  return each([&](int l) { return round_mode(a.f[l], imm); });
}
// VREDUCEPS with 0 fraction bits: x - round(x), exact; +0 for infinities, NaN kept.
inline Zmm reduce_ps(Zmm a, int imm) {
  if (imm >> 4) std::abort();
  return each([&](int l) {
    const float x = a.f[l];
    if (std::isnan(x)) return x;
    if (std::isinf(x)) return 0.f;
    return x - round_mode(x, imm);
  });
}
// VSCALEFPS: a * 2^floor(b), with the SDM's special cases.
inline float scalef(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::nanf("");
  if (std::isinf(b)) {
    if (b > 0) return a == 0 ? std::nanf("") : std::copysign(INFINITY, a);
    return std::isinf(a) ? std::nanf("") : std::copysign(0.f, a);
  }
  const float e = std::floor(b);
  const int n = e > 400.f ? 400 : e < -400.f ? -400 : int(e);
  return std::ldexp(a, n);
}
inline Zmm maskz_scalef_ps(__mmask16 k, Zmm a, Zmm b) {
  return each([&](int l) { return on(k, l) ? scalef(a.f[l], b.f[l]) : 0.f; });
}
inline __mmask16 cmp_ps_mask(Zmm a, Zmm b, int pred) {
  if (pred != _CMP_NLT_UQ) std::abort();  // the one predicate the sources use
  unsigned k = 0;
  for (int l = 0; l < 16; ++l)
    if (!(a.f[l] < b.f[l])) k |= 1u << l;  // unordered: true
  return __mmask16(k);
}
// GCC's reduction order (avx512fintrin.h, __MM512_REDUCE_OP): halves, quarters, then pairs.
template <typename Op>
inline float reduce16(const float* a, Op op) {
  float h[8], q[4];
  for (int l = 0; l < 8; ++l) h[l] = op(a[8 + l], a[l]);
  for (int l = 0; l < 4; ++l) q[l] = op(h[4 + l], h[l]);
  return op(op(q[0], q[2]), op(q[1], q[3]));
}
inline float reduce_add_ps(Zmm a) {
  return reduce16(a.f, [](float x, float y) { return x + y; });
}
inline float reduce_max_ps(Zmm a) {
  return reduce16(a.f, maxps);
}

// ---- casts and lane moves
inline Zmm cast(Zmm a) {
  return a;
}
inline __m256 castps512_ps256(Zmm a) {
  __m256 r;
  std::memcpy(&r, &a, sizeof(r));
  return r;
}
inline __m256d extractf64x4_pd(Zmm a, int hi) {
  __m256d r;
  std::memcpy(&r, a.q + 4 * (hi & 1), sizeof(r));
  return r;
}
// VBROADCASTF64X4: a in both 256-bit halves.
inline Zmm broadcast_f64x4(__m256d a) {
  Zmm r;
  std::memcpy(r.q, &a, sizeof(a));
  std::memcpy(r.q + 4, &a, sizeof(a));
  return r;
}
inline Zmm zextsi256_si512(__m256i a) {
  Zmm r = zero();
  std::memcpy(&r, &a, sizeof(a));
  return r;
}
inline Zmm inserti64x4(Zmm a, __m256i b, int hi) {
  std::memcpy(a.q + 4 * (hi & 1), &b, sizeof(b));
  return a;
}
inline Zmm permutexvar_epi16(Zmm idx, Zmm a) {
  Zmm r;
  for (int l = 0; l < 32; ++l) r.h[l] = a.h[idx.h[l] & 31];
  return r;
}
// Within each 128-bit lane: the low (high) half's 32-bit words of a and b, interleaved.
inline Zmm unpack32(Zmm a, Zmm b, int half) {
  Zmm r;
  for (int lane = 0; lane < 4; ++lane)
    for (int w = 0; w < 2; ++w) {
      r.u[4 * lane + 2 * w] = a.u[4 * lane + 2 * half + w];
      r.u[4 * lane + 2 * w + 1] = b.u[4 * lane + 2 * half + w];
    }
  return r;
}
inline Zmm unpack64(Zmm a, Zmm b, int half) {
  Zmm r;
  for (int lane = 0; lane < 4; ++lane) {
    r.q[2 * lane] = a.q[2 * lane + half];
    r.q[2 * lane + 1] = b.q[2 * lane + half];
  }
  return r;
}
// VSHUFI32X4: 128-bit lanes 0-1 from a, 2-3 from b, each picked by two bits of imm.
inline Zmm shuffle_i32x4(Zmm a, Zmm b, int imm) {
  Zmm r;
  for (int lane = 0; lane < 4; ++lane) {
    const Zmm& src = lane < 2 ? a : b;
    std::memcpy(r.u + 4 * lane, src.u + 4 * ((imm >> (2 * lane)) & 3), 16);
  }
  return r;
}

// ---- bf16
inline Zmm cvtne2ps_pbh(Zmm a, Zmm b) {  // b's 16 values in the low half, a's in the high
  Zmm r;
  for (int l = 0; l < 16; ++l) {
    r.h[l] = to_bf16(b.f[l]);
    r.h[16 + l] = to_bf16(a.f[l]);
  }
  return r;
}
inline Bf16x16 cvtneps_pbh(Zmm a) {
  Bf16x16 r;
  for (int l = 0; l < 16; ++l) r.h[l] = to_bf16(a.f[l]);
  return r;
}
// VDPBF16PS: per fp32 lane, the odd pair's product added, then the even one's, each rounded.
inline Zmm dpbf16_ps(Zmm acc, Zmm a, Zmm b) {
  return each([&](int l) {
    float t = ftz(acc.f[l] + bf16_in(a.h[2 * l + 1]) * bf16_in(b.h[2 * l + 1]));
    return ftz(t + bf16_in(a.h[2 * l]) * bf16_in(b.h[2 * l]));
  });
}

// ---- AMX: eight tiles of up to 16 rows x 64 bytes per thread, configured by LDTILECFG. Using a
// tile on a thread without a configuration faults on the hardware; here it aborts.
struct Tiles {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) unsigned char data[8][16][64] = {};
};
inline Tiles& tiles() {
  static thread_local Tiles t;
  return t;
}
inline void check_tile(int t) {
  if (t < 0 || t > 7 || !tiles().configured || tiles().rows[t] == 0) std::abort();
}
inline void tile_loadconfig(const void* cfg) {
  const auto* b = static_cast<const unsigned char*>(cfg);
  if (b[0] != 1) std::abort();  // palette 1, the only one
  Tiles& t = tiles();
  for (int i = 0; i < 8; ++i) {
    std::memcpy(&t.colsb[i], b + 16 + 2 * i, 2);
    t.rows[i] = b[48 + i];
    if (t.rows[i] > 16 || t.colsb[i] > 64) std::abort();
  }
  t.configured = true;
  std::memset(t.data, 0, sizeof(t.data));
}
inline void tile_release() {
  tiles() = Tiles{};
}
inline void tile_zero(int t) {
  check_tile(t);
  std::memset(tiles().data[t], 0, sizeof(tiles().data[t]));
}
inline void tile_loadd(int t, const void* base, long stride) {
  check_tile(t);
  Tiles& s = tiles();
  std::memset(s.data[t], 0, sizeof(s.data[t]));
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.data[t][r], static_cast<const char*>(base) + r * stride, s.colsb[t]);
}
inline void tile_stored(int t, void* base, long stride) {
  check_tile(t);
  Tiles& s = tiles();
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, s.data[t][r], s.colsb[t]);
}
// TDPBF16PS: c[m][n] += a[m][pair k] . b[k][pair n] over the pairs k of a's row, the even
// product added before the odd one, each rounded.
inline void tile_dpbf16ps(int c, int a, int b) {
  check_tile(c), check_tile(a), check_tile(b);
  Tiles& s = tiles();
  const int pairs = s.colsb[a] / 4, cols = s.colsb[c] / 4;
  if (s.rows[b] != pairs || s.colsb[b] != s.colsb[c] || s.rows[a] != s.rows[c]) std::abort();
  for (int m = 0; m < s.rows[c]; ++m) {
    float acc[16];
    uint16_t ah[32], bh[32];
    std::memcpy(acc, s.data[c][m], sizeof(acc));
    std::memcpy(ah, s.data[a][m], sizeof(ah));
    for (int k = 0; k < pairs; ++k) {
      std::memcpy(bh, s.data[b][k], sizeof(bh));
      for (int n = 0; n < cols; ++n) {
        const float even = ftz(acc[n] + bf16_in(ah[2 * k]) * bf16_in(bh[2 * n]));
        acc[n] = ftz(even + bf16_in(ah[2 * k + 1]) * bf16_in(bh[2 * n + 1]));
      }
    }
    std::memcpy(s.data[c][m], acc, sizeof(acc));
  }
}

}  // namespace attn_ext_emu

// The names the sources use, from here on the stand-ins.
#define __m512 attn_ext_emu::Zmm
#define __m512i attn_ext_emu::Zmm
#define __m512bh attn_ext_emu::Zmm
#define __m256bh attn_ext_emu::Bf16x16
#define _mm512_setzero_ps attn_ext_emu::setzero
#define _mm512_setzero_si512 attn_ext_emu::setzero
#define _mm512_set1_ps attn_ext_emu::set1_ps
#define _mm512_set1_epi32 attn_ext_emu::set1_epi32
#define _mm512_undefined_ps attn_ext_emu::setzero
#define _mm512_undefined_epi32 attn_ext_emu::setzero
#define _mm512_loadu_ps attn_ext_emu::loadu
#define _mm512_loadu_si512 attn_ext_emu::loadu
#define _mm512_load_si512 attn_ext_emu::load_aligned
#define _mm512_storeu_ps attn_ext_emu::storeu
#define _mm512_storeu_si512 attn_ext_emu::storeu
#define _mm512_maskz_loadu_ps attn_ext_emu::maskz_loadu_ps
#define _mm512_mask_storeu_ps attn_ext_emu::mask_storeu_ps
#define _mm256_mask_storeu_epi16 attn_ext_emu::mask_storeu_epi16_256
#define _mm512_maskz_mov_ps attn_ext_emu::maskz_mov_ps
#define _mm512_maskz_mov_epi16 attn_ext_emu::maskz_mov_epi16
#define _mm512_maskz_loadu_epi16 attn_ext_emu::maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 attn_ext_emu::maskz_loadu_epi16_256
#define _mm512_add_ps attn_ext_emu::add_ps
#define _mm512_sub_ps attn_ext_emu::sub_ps
#define _mm512_mul_ps attn_ext_emu::mul_ps
#define _mm512_fmadd_ps attn_ext_emu::fmadd_ps
#define _mm512_fmsub_ps attn_ext_emu::fmsub_ps
#define _mm512_max_ps attn_ext_emu::max_ps
#define _mm512_mask_add_ps attn_ext_emu::mask_add_ps
#define _mm512_mask_max_ps attn_ext_emu::mask_max_ps
#define _mm512_add_epi32 attn_ext_emu::add_epi32
#define _mm512_slli_epi32 attn_ext_emu::slli_epi32
#define _mm512_cvtepu16_epi32 attn_ext_emu::cvtepu16_epi32
#define _mm512_cvtph_ps attn_ext_emu::cvtph_ps
#define _mm512_cvtps_epi32 attn_ext_emu::cvtps_epi32
#define _mm512_roundscale_ps attn_ext_emu::roundscale_ps
#define _mm512_reduce_ps attn_ext_emu::reduce_ps
#define _mm512_maskz_scalef_ps attn_ext_emu::maskz_scalef_ps
#define _mm512_cmp_ps_mask attn_ext_emu::cmp_ps_mask
#define _mm512_reduce_add_ps attn_ext_emu::reduce_add_ps
#define _mm512_reduce_max_ps attn_ext_emu::reduce_max_ps
#define _mm512_castps_si512 attn_ext_emu::cast
#define _mm512_castsi512_ps attn_ext_emu::cast
#define _mm512_castps_pd attn_ext_emu::cast
#define _mm512_castps512_ps256 attn_ext_emu::castps512_ps256
#define _mm512_extractf64x4_pd attn_ext_emu::extractf64x4_pd
#define _mm512_broadcast_f64x4 attn_ext_emu::broadcast_f64x4
#define _mm512_castpd_ps attn_ext_emu::cast
#define _mm512_zextsi256_si512 attn_ext_emu::zextsi256_si512
#define _mm512_inserti64x4 attn_ext_emu::inserti64x4
#define _mm512_permutexvar_epi16 attn_ext_emu::permutexvar_epi16
#define _mm512_unpacklo_epi32(a, b) attn_ext_emu::unpack32(a, b, 0)
#define _mm512_unpackhi_epi32(a, b) attn_ext_emu::unpack32(a, b, 1)
#define _mm512_unpacklo_epi64(a, b) attn_ext_emu::unpack64(a, b, 0)
#define _mm512_unpackhi_epi64(a, b) attn_ext_emu::unpack64(a, b, 1)
#define _mm512_shuffle_i32x4 attn_ext_emu::shuffle_i32x4
#define _mm512_cvtne2ps_pbh attn_ext_emu::cvtne2ps_pbh
#define _mm512_cvtneps_pbh attn_ext_emu::cvtneps_pbh
#define _mm512_dpbf16_ps attn_ext_emu::dpbf16_ps
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig attn_ext_emu::tile_loadconfig
#define _tile_release attn_ext_emu::tile_release
#define _tile_zero attn_ext_emu::tile_zero
#define _tile_loadd attn_ext_emu::tile_loadd
#define _tile_stored attn_ext_emu::tile_stored
#define _tile_dpbf16ps attn_ext_emu::tile_dpbf16ps
