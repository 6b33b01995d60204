#pragma once
// AVX-512 versions of the three packed block products (same contracts and panel layout as
// avx2_block_products.h; see block_kernels.h). Compiled into every x86-64 build, called only
// on CPUs that report AVX-512F.
#include <cstdint>

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && \
    (defined(__GNUC__) || defined(__clang__))
#define ATTN_EXT_AVX512_PRODUCTS 1

namespace attn_ext::cpu::avx512 {

void scores_tile(const float* q, int64_t ldq, int64_t m, const float* key_panels, int64_t n,
                 int64_t d, float scale, float* s, int64_t lds);
void pv_tile(const float* p, int64_t ldp, int64_t m, const float* value_panels,
             int64_t panel_stride, int64_t n, int64_t dv, const float* factor, float* o,
             int64_t ldo);
void atb_tile(const float* a, int64_t lda, int64_t m, int64_t n, const float* b_panels,
              int64_t panel_stride, int64_t dc, float* c, int64_t ldc);

}  // namespace attn_ext::cpu::avx512

#endif
