#pragma once
// The bf16 kernels' two block products on AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake
// and Sapphire Rapids): scores = scale * Q K^T and O = O * factor + P V, each a chain of
// _mm512_dpbf16_ps (vdpbf16ps: per fp32 lane, a pair of bf16 products added to the accumulator)
// over feature or key pairs. The ATTN_EXT_CPU_KERNELS=avx512bf16 set; auto takes it on AMD CPUs
// with AVX512-BF16, and not on Intel ones (block_kernels.cpp says why).
//
// Operands: the AMX path's packed forms (amx_block_products.h), which this file reads one
// 64-byte tile row at a time: a row of a key tile is one feature pair of 16 keys and a row of a
// value tile one key pair of 16 features, exactly the B operand of one vdpbf16ps; the A operand
// is a pair of Q or P elements broadcast to all 16 lanes. Q and P are rows as amx::round_rows
// writes them. So both sets share the packing code and its layout; only the products differ.
//
// Numerics: as on AMX. Q, K and V are bf16, so each product is exact in fp32 and only the
// accumulation rounds (one fp32 add per product, over all of D or the tile's keys in one chain);
// P is rounded to bf16 once before P V (torch's and FlashAttention's bf16 kernels do the same),
// the softmax row sums use the unrounded fp32 P. vdpbf16ps treats bf16 denormals as zero and
// flushes denormal results: only P entries below 2^-126 of the row max are affected, which no
// sum of probabilities can see. tests/test_avx512bf16.py holds the outputs to the AMX test's
// bound against torch's own bf16 SDPA.
#include <cstdint>

#include "attention/cpu/amx_block_products.h"

#ifdef ATTN_EXT_AMX_PRODUCTS
#define ATTN_EXT_AVX512BF16_PRODUCTS 1

namespace attn_ext::cpu::avx512bf16 {

// Whether this CPU runs AVX-512F/BW with the BF16 extension and the OS saves the zmm state.
bool available();

// S[m x n] = scale * Q K^T: q as amx::round_rows wrote it (d padded to 32, ldq), key_tiles as
// amx::pack_keys wrote them for these n keys. Columns past n are left alone.
void scores(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* key_tiles, int64_t n,
            int64_t d, float scale, float* s, int64_t lds);

// O[m x dv] = O * factor[row] + P V for P = p_bf16 (amx::round_rows of the fp32 P, ldp) and
// value_tiles as amx::pack_values wrote them. Only keys [0, n) are read: the pair holding key
// n - 1 of an odd n has its other key zeroed in registers, so a value row these rows never see
// (NaN included) reaches no output.
void pv(const uint16_t* p_bf16, int64_t ldp, int64_t m, const uint16_t* value_tiles, int64_t n,
        int64_t dv, const float* factor, float* o, int64_t ldo);

}  // namespace attn_ext::cpu::avx512bf16

#endif
