#pragma once
// Row-major GEMM on raw pointers: C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C.
// Backed by the BLAS that libtorch links (MKL on x86-64) when it exports the Fortran
// symbols, else by ATen's addmm on views of the same memory. beta = 0 ignores C's contents.
#include <cstdint>

namespace attn_ext::cpu {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);

}  // namespace attn_ext::cpu
