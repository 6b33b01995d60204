#pragma once
// The ElemKind of a tensor's dtype, for the op wrappers (*_cuda.cpp) that launch kernels.
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include "common/cuda/launch.h"

namespace attn_ext::cuda {

inline ElemKind elem_kind(const char* op, c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return ElemKind::kFloat32;
    case c10::kDouble:
      return ElemKind::kFloat64;
    case c10::kBFloat16:
      return ElemKind::kBFloat16;
    case c10::kHalf:
      return ElemKind::kFloat16;
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", t,
                  " (expected float32, float64, bfloat16 or float16)");
  }
}

}  // namespace attn_ext::cuda
