#pragma once
// The decode step's P V on the cache rows in place (decode_rows.h's avx2::decode_pv) on
// AVX-512's 16 lanes, for blocks of 1 to avx2::kMaxDecodeRows rows. The same bits as the AVX2
// version: each output element is its own chain of fused multiply-adds over the rows in order,
// whatever the vector width. Compiled into every x86-64 build, called only when the CPU
// kernel set runs AVX-512 (block_kernels().avx512).
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "attention/cpu/avx512_block_products.h"

#ifdef ATTN_EXT_AVX512_PRODUCTS
namespace attn_ext::cpu::avx512 {

// s[r * lds + j] = q_r . keys[j] for r < m, j < n (1 <= m <= 8), float8 key rows: the bits of
// avx2::decode_scores, two key rows per register; value rows asked into L2 as there.
void decode_scores(int64_t m, const float* q, int64_t ldq, const c10::Float8_e4m3fn* const* keys,
                   int64_t n, int64_t d, float* s, int64_t lds,
                   const c10::Float8_e4m3fn* const* values, int64_t dv);
void decode_scores(int64_t m, const float* q, int64_t ldq, const c10::Float8_e5m2* const* keys,
                   int64_t n, int64_t d, float* s, int64_t lds,
                   const c10::Float8_e5m2* const* values, int64_t dv);

// o[r * dv + c] += sum_j p[r * ldp + j] * values[j][c] for r < m, j < n, c < dv (1 <= m <= 8).
void decode_pv(int64_t m, const float* p, int64_t ldp, const float* const* values, int64_t n,
               int64_t dv, float* o);
void decode_pv(int64_t m, const float* p, int64_t ldp, const c10::BFloat16* const* values,
               int64_t n, int64_t dv, float* o);
void decode_pv(int64_t m, const float* p, int64_t ldp, const c10::Half* const* values, int64_t n,
               int64_t dv, float* o);
void decode_pv(int64_t m, const float* p, int64_t ldp, const c10::Float8_e4m3fn* const* values,
               int64_t n, int64_t dv, float* o);
void decode_pv(int64_t m, const float* p, int64_t ldp, const c10::Float8_e5m2* const* values,
               int64_t n, int64_t dv, float* o);

}  // namespace attn_ext::cpu::avx512
#endif
