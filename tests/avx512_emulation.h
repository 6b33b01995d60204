#pragma once
// Scalar stand-ins for the AVX-512 intrinsics that csrc/cpu/avx512_block_products.cpp uses,
// lane by lane with the same IEEE operations (multiply-adds fused), so its tiling, panel
// pairing and masking can be checked bit for bit against the AVX2 kernels on a CPU without
// AVX-512 (tests/test_cpu_kernels.py). Compile with -ffp-contract=off.
#include <cmath>
#include <cstdint>

struct __m512 {
  float v[16];
};
using __mmask16 = uint16_t;

inline __m512 _mm512_setzero_ps() {
  __m512 r;
  for (float& x : r.v) x = 0.f;
  return r;
}
inline __m512 _mm512_set1_ps(float a) {
  __m512 r;
  for (float& x : r.v) x = a;
  return r;
}
inline __m512 _mm512_loadu_ps(const float* p) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.v[i] = p[i];
  return r;
}
inline __m512 _mm512_maskz_loadu_ps(__mmask16 k, const float* p) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.v[i] = (k >> i) & 1 ? p[i] : 0.f;
  return r;
}
inline void _mm512_storeu_ps(float* p, __m512 a) {
  for (int i = 0; i < 16; ++i) p[i] = a.v[i];
}
inline void _mm512_mask_storeu_ps(float* p, __mmask16 k, __m512 a) {
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) p[i] = a.v[i];
}
inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline __m512 _mm512_mul_ps(__m512 a, __m512 b) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}
inline __m512 _mm512_add_ps(__m512 a, __m512 b) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
