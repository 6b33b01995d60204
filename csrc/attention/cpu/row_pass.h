#pragma once
// The flash kernels' element-wise row passes, forward (row max, exp2 with the row sum) and
// backward (exp2 of the scores against the lse, dS = P (dP - delta), the scale): the kernel
// set's for float rows (16 lanes on the AVX-512 sets, the same bits as AVX2's), vec_math.h's
// otherwise (fp64).
#include <cstdint>

#include "common/cpu/vec_math.h"
#ifdef ATTN_EXT_AVX2
#include "attention/cpu/block_kernels.h"
#endif

namespace attn_ext::cpu {

template <typename acc_t>
struct RowPass {
  acc_t max(const acc_t* x, int64_t n) const { return row_max(x, n); }
  acc_t exp2_sum(acc_t* x, int64_t n, acc_t shift) const { return exp2_shift_sum(x, n, shift); }
  void exp2_rows(acc_t* x, int64_t n, acc_t hi, acc_t lo) const {
    exp2_scale_shift2(x, n, acc_t(1), hi, lo);
  }
  void grad(const acc_t* p, acc_t* dp, int64_t n, acc_t delta) const {
    softmax_grad_row(p, dp, n, delta);
  }
  void scale(acc_t* x, int64_t n, acc_t a) const { scale_row(x, n, a); }
};

#ifdef ATTN_EXT_AVX2
template <>
struct RowPass<float> {
  const BlockKernels& kernels = block_kernels();
  float max(const float* x, int64_t n) const { return kernels.row_max(x, n); }
  float exp2_sum(float* x, int64_t n, float shift) const {
    return kernels.exp2_shift_sum(x, n, shift);
  }
  void exp2_rows(float* x, int64_t n, float hi, float lo) const {
    kernels.exp2_scale_shift2(x, n, 1.f, hi, lo);
  }
  void grad(const float* p, float* dp, int64_t n, float delta) const {
    kernels.softmax_grad_row(p, dp, n, delta);
  }
  void scale(float* x, int64_t n, float a) const { kernels.scale_row(x, n, a); }
};
#endif

}  // namespace attn_ext::cpu
