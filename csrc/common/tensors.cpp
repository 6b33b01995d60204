#include "common/tensors.h"

#include <algorithm>
#include <c10/util/Exception.h>

namespace attn_ext {

// BLAS needs the last dimension contiguous and a row stride >= the row length; a row
// stride of 0 (a sequence-expanded view) or an odd layout gets one copy, never a rejection.
at::Tensor blas_rows(const at::Tensor& t) {
  const int64_t rows = t.size(2), cols = t.size(3);
  const bool last_ok = t.stride(3) == 1 || cols <= 1;
  const bool rows_ok = rows <= 1 || t.stride(2) >= cols;
  return (last_ok && rows_ok) ? t : t.contiguous();
}

// Stride of a dimension, made harmless when the dimension has size 1 (PyTorch leaves
// those strides arbitrary and BLAS validates leading dimensions even for one row).
int64_t blas_row_stride(const at::Tensor& t) {
  return t.size(2) <= 1 ? std::max<int64_t>(t.size(3), 1) : t.stride(2);
}

void check_companion(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                     at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on q's device ", like.device(),
              ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

}  // namespace attn_ext
