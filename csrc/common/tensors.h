#pragma once
// Tensor checks and layouts the input checks of every op family share (attention, decoding,
// compression, linear).
#include <cstdint>
#include <ATen/core/Tensor.h>

namespace attn_ext {

// Checks a tensor the op receives alongside q/k/v (grad_out, out, lse) for device, dtype
// and shape.
void check_companion(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                     at::IntArrayRef shape, at::ScalarType dtype);

// A 4-D tensor whose rows BLAS can address (last dim contiguous, row stride >= row
// length): the tensor itself when it already is, else one contiguous copy.
at::Tensor blas_rows(const at::Tensor& t);
// The row stride to hand to BLAS (any valid value for a single-row tensor).
int64_t blas_row_stride(const at::Tensor& t);

}  // namespace attn_ext
