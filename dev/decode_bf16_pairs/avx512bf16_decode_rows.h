#pragma once
// PROTOTYPE, NOT SHIPPED: see avx512bf16_decode_rows.cpp in this folder for what it measured.
// The decode step's Q K^T for bf16 caches on AVX512-BF16's vdpbf16ps, on the cache rows in place
// (decode_rows.h's avx2::decode_scores on 32 bf16 features per instruction), for blocks of 1 to
// avx2::kMaxDecodeRows query rows. Compiled into every x86-64 build, called only when the CPU
// kernel set multiplies bf16 operands with vdpbf16ps (block_kernels().bf16_operands ==
// kAvx512Bf16): on the Sapphire Rapids core measured in block_kernels.cpp vdpbf16ps issues at a
// quarter of the FMA's rate, so the amx set keeps the AVX2 scores.
//
// Numerics: q and the keys are bf16, so every product is exact in fp32; only the sums round.
// Each lane of a 16-lane accumulator sums its features' pairs over the 32-feature chunks in
// order, and the 16 lanes are then added in one fixed tree (lane_tree_sum in the source), the
// same for every key row whatever rows share its registers: a key's score does not depend on
// the tile, the page or the group it is read in, so paged and contiguous caches still agree bit
// for bit. The order differs from AVX2's (8 lanes over d in order), so the bits do too, within
// fp32 summation error. vdpbf16ps treats bf16 denormals (below 2^-126) as zero and flushes
// denormal partial sums: a score that small is exp2'ed to 1 either way.
#include <cstdint>

#include <c10/util/BFloat16.h>

#include "attention/cpu/avx512bf16_block_products.h"

#ifdef ATTN_EXT_AVX512BF16_PRODUCTS
namespace attn_ext::cpu::avx512bf16 {

// s[r * lds + j] = q_r . keys[j][0..d) for r < m (1 <= m <= avx2::kMaxDecodeRows), j < n, q
// as bf16 rows (ldq). As avx2::decode_scores does, value row j (dv features) is asked into L2
// while key row j's scores are formed, and where the rows are `scattered` (a paged cache) the
// key rows avx2::kKeyAheadBytes ahead too.
void decode_scores(int64_t m, const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* const* keys,
                   int64_t n, int64_t d, float* s, int64_t lds, const c10::BFloat16* const* values,
                   int64_t dv, bool scattered);

}  // namespace attn_ext::cpu::avx512bf16
#endif
