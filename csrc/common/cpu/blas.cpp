#include "common/cpu/blas.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <limits>

// Fortran BLAS entry points; weak so that a libtorch without them still loads and
// falls back to ATen.
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc) __attribute__((weak));
// MKL's per-thread thread count (returns the previous one; 0 = the global setting); absent
// from other BLAS builds. The by-value C entry point: in torch's libtorch_cpu the lowercase
// mkl_set_num_threads_local is the Fortran one, which takes a pointer.
int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));
}

namespace attn_ext::cpu {
namespace {

// A row-major operand of logical shape (rows x cols) stored with leading dimension ld,
// viewed as a tensor without copying.
template <typename T>
at::Tensor view(const T* p, int64_t rows, int64_t cols, int64_t ld, bool trans) {
  const int64_t r = trans ? cols : rows, c = trans ? rows : cols;
  at::Tensor t = at::from_blob(const_cast<T*>(p), {r, c}, {ld, 1},
                               at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  return trans ? t.t() : t;
}

template <typename T>
void gemm_aten(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  at::Tensor cv = view(c, m, n, ldc, false);
  cv.addmm_(view(a, m, k, lda, ta), view(b, k, n, ldb, tb), beta, alpha);
}

bool fits_int(int64_t x) {
  return x <= std::numeric_limits<int>::max();
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
template <typename T, typename Fn>
void gemm_impl(Fn* blas, bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
               int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
    return;
  }
  if (blas == nullptr || !(fits_int(m) && fits_int(n) && fits_int(k) && fits_int(lda) &&
                           fits_int(ldb) && fits_int(ldc))) {
    gemm_aten(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  const int ilda = static_cast<int>(lda), ildb = static_cast<int>(ldb),
            ildc = static_cast<int>(ldc);
  // One BLAS thread per call: the kernels parallelize over their own tasks, and a call made
  // outside a parallel region (a small op running inline) would otherwise let MKL split it
  // by the thread count, changing the result's bits with torch.set_num_threads.
  const int previous = MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0;
  blas(&opb, &opa, &in, &im, &ik, &alpha, b, &ildb, a, &ilda, &beta, c, &ildc);
  if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous);
}

}  // namespace

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_impl(sgemm_, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  gemm_impl(dgemm_, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace attn_ext::cpu
