#pragma once
// The packed block products behind the CPU flash kernels, chosen once per process for the CPU
// that runs them: AVX-512 where it has it (avx512_block_products.cpp), else AVX2
// (avx2_block_products.h). Both read the same 16-wide panels (packed by avx2::pack_*) and
// form every output element from the same fused multiply-adds in the same order, so they
// return identical bits; only the speed differs. The "amx" set runs the bf16 forward's and
// backward's products on AMX tiles instead (amx_block_products.h: P, and in the backward dS,
// rounded to bf16, so not the same bits) and everything else on the AVX-512 products; the
// "avx512bf16" set does the same on vdpbf16ps (avx512bf16_block_products.h: same roundings).
#include <cstdint>

namespace attn_ext::cpu {

// How the bf16 forward and backward multiply: on fp32 panels of converted operands (the set's
// products), or on bf16 operands with P (and dS) rounded to bf16 once, on AMX tiles or with
// AVX512-BF16's vdpbf16ps (bf16_pairs.h).
enum class Bf16Operands { kFp32, kAmx, kAvx512Bf16 };

struct BlockKernels {
  const char* name;
  // S[m x round_up_cols(n)] = scale * Q K^T, K as consecutive key panels (stride d * 16).
  void (*scores)(const float* q, int64_t ldq, int64_t m, const float* key_panels, int64_t n,
                 int64_t d, float scale, float* s, int64_t lds);
  // O[m x dv] = O * factor[row] + P[m x n] V, V as value panels (factor null: 1).
  void (*pv)(const float* p, int64_t ldp, int64_t m, const float* value_panels,
             int64_t panel_stride, int64_t n, int64_t dv, const float* factor, float* o,
             int64_t ldo);
  // C[n x dc] += A[m x n]^T B[m x dc], B as value panels.
  void (*atb)(const float* a, int64_t lda, int64_t m, int64_t n, const float* b_panels,
              int64_t panel_stride, int64_t dc, float* c, int64_t ldc);
  // The forward's softmax row pass on fp32 score rows: vec_math.h's row_max and exp2_shift_sum,
  // on 16 lanes in the AVX-512 sets (avx512_softmax_rows.h: the same bits).
  float (*row_max)(const float* x, int64_t n);
  float (*exp2_shift_sum)(float* x, int64_t n, float shift);
  // The backward's element-wise row passes (vec_math.h's exp2_scale_shift2, softmax_grad_row,
  // scale_row), likewise on 16 lanes in the AVX-512 sets with the same bits.
  void (*exp2_scale_shift2)(float* x, int64_t n, float a, float hi, float lo);
  void (*softmax_grad_row)(const float* p, float* dp, int64_t n, float delta);
  void (*scale_row)(float* x, int64_t n, float a);
  Bf16Operands bf16_operands;
  // Whether the set runs AVX-512F instructions: the decode step's P V follows it
  // (decoding/cpu/avx512_decode_rows.h, 16 lanes with the same bits).
  bool avx512;
};

// The widest kernels this CPU runs; the environment variable ATTN_EXT_CPU_KERNELS = avx2,
// avx512, avx512bf16 or amx pins the choice (auto or unset: the fastest measured of those this CPU
// runs, block_kernels.cpp). Read on first use; a value that is unknown or that this CPU cannot
// run raises then.
const BlockKernels& block_kernels();

}  // namespace attn_ext::cpu
