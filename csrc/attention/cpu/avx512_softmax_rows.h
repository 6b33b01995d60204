#pragma once
// The forward's softmax row pass on AVX-512 (16 lanes): vec_math.h's row_max and
// exp2_shift_sum for float rows, returning the same bits as its AVX2 versions (same exp2
// polynomial, avx2::kExp2Poly, and the same summation order; see the .cpp). Compiled into every
// x86-64 build, called only on CPUs with AVX-512F (block_kernels()).
#include <cstdint>

#include "attention/cpu/avx512_block_products.h"

#ifdef ATTN_EXT_AVX512_PRODUCTS
namespace attn_ext::cpu::avx512 {

// max over x[0..n); -inf for n == 0.
float row_max(const float* x, int64_t n);

// x[j] = exp2(x[j] - shift); returns the sum of the new values.
float exp2_shift_sum(float* x, int64_t n, float shift);

// The backward's element-wise row passes, vec_math.h's on 16 lanes with the same bits:
// x[j] = exp2((x[j] * a - hi) - lo); dp[j] = p[j] * (dp[j] - delta); x[j] *= a.
void exp2_scale_shift2(float* x, int64_t n, float a, float hi, float lo);
void softmax_grad_row(const float* p, float* dp, int64_t n, float delta);
void scale_row(float* x, int64_t n, float a);

}  // namespace attn_ext::cpu::avx512
#endif

#include "attention/cpu/amx_block_products.h"
#ifdef ATTN_EXT_AMX_PRODUCTS
namespace attn_ext::cpu::avx512 {

// exp2_shift_sum fused with the bf16 operand paths' rounding of P, on scores that may still need
// their scale: 2^(x[j] * scale - shift) (one fused multiply-subtract; scale 1 is exact for scores
// already scaled). The values go to dst rounded
// to bf16 (nearest even, as amx::round_rows) with zeros in [n, n_pad), x is left alone, and the
// sum of the fp32 values is returned. Not exp2_shift_sum's bits: its exp2 reduces to [0, 1) and
// scales by vscalefps (relative error < 1.5e-7, against exp2_shift_sum's 2.2e-7), values below
// 2^-126 are 0, and the sum runs in two accumulators. Only on CPUs with AVX512-BF16 and
// AVX512-DQ (the amx / avx512bf16 sets).
float exp2_shift_sum_bf16(const float* x, int64_t n, float scale, float shift, uint16_t* dst,
                          int64_t n_pad);

}  // namespace attn_ext::cpu::avx512
#endif
