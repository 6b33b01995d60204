#pragma once
// Small dispatch switches; an unsupported value is an error, never a silent fall-through.
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

// Runs FN (a lambda using `scalar_t`) for float32, float64, bfloat16 and float16.
#define ATTN_EXT_DISPATCH_FLOATING(DTYPE, OP, FN)                         \
  [&] {                                                                   \
    switch (DTYPE) {                                                      \
      case c10::ScalarType::Float: {                                      \
        using scalar_t = float;                                           \
        return FN();                                                      \
      }                                                                   \
      case c10::ScalarType::Double: {                                     \
        using scalar_t = double;                                          \
        return FN();                                                      \
      }                                                                   \
      case c10::ScalarType::BFloat16: {                                   \
        using scalar_t = c10::BFloat16;                                   \
        return FN();                                                      \
      }                                                                   \
      case c10::ScalarType::Half: {                                       \
        using scalar_t = c10::Half;                                       \
        return FN();                                                      \
      }                                                                   \
      default:                                                            \
        TORCH_CHECK(false, OP, ": unsupported dtype ", DTYPE,             \
                    " (expected float32, float64, bfloat16 or float16)"); \
    }                                                                     \
  }()
