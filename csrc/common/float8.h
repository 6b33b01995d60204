#pragma once
// Float8 KV caches: a cache of float8_e4m3fn or float8_e5m2 rows holds K / k_scale and
// V / v_scale (one float scale per cache, as vLLM's and FlashInfer's fp8 caches keep). The
// append quantizes with saturation; decode attention folds k_scale into the score scale and
// v_scale into the output's normalization, so the kernels read the bytes as they lie.
#include <cmath>
#include <limits>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

namespace attn_ext {

inline bool is_float8_cache(c10::ScalarType t) {
  return t == c10::ScalarType::Float8_e4m3fn || t == c10::ScalarType::Float8_e5m2;
}

// The scales of a cache: positive and finite; anything but 1 only with a float8 cache (a 16-
// or 32-bit cache stores the values themselves).
inline void check_cache_scale(const char* op, const char* name, c10::ScalarType cache_dtype,
                              double s) {
  TORCH_CHECK(std::isfinite(s) && s > 0.0, op, ": ", name, " must be positive and finite, got ", s);
  TORCH_CHECK(s == 1.0 || is_float8_cache(cache_dtype), op, ": ", name,
              " applies to float8_e4m3fn / float8_e5m2 caches only, got ", name, " = ", s,
              " with a ", cache_dtype, " cache");
}
inline void check_cache_scales(const char* op, c10::ScalarType cache_dtype, double k_scale,
                               double v_scale) {
  check_cache_scale(op, "k_scale", cache_dtype, k_scale);
  check_cache_scale(op, "v_scale", cache_dtype, v_scale);
}

// The largest finite value of a float8 type, as float (read once, not per element).
template <typename fp8_t>
inline const float kFloat8Max = static_cast<float>(std::numeric_limits<fp8_t>::max());

// x / scale rounded to the float8 type (c10's round to nearest even), saturated at the type's
// largest finite value: c10's conversion saturates e4m3fn but turns an e5m2 overflow into
// infinity, and one outlier key must not poison every score of its row. NaN stays NaN.
template <typename fp8_t>
inline fp8_t quantize_saturated(float x, float inv_scale) {
  const float kMax = kFloat8Max<fp8_t>;
  float y = x * inv_scale;
  if (y > kMax) y = kMax;
  if (y < -kMax) y = -kMax;
  return static_cast<fp8_t>(y);
}

}  // namespace attn_ext

// Runs the lambda (using `cache_t`; variadic for the commas of template arguments) for a cache
// of q's dtype `scalar_t` or a float8 one.
#define ATTN_EXT_DISPATCH_CACHE(DTYPE, OP, ...)                                                \
  [&] {                                                                                        \
    switch (DTYPE) {                                                                           \
      case c10::ScalarType::Float8_e4m3fn: {                                                   \
        using cache_t = c10::Float8_e4m3fn;                                                    \
        return __VA_ARGS__();                                                                  \
      }                                                                                        \
      case c10::ScalarType::Float8_e5m2: {                                                     \
        using cache_t = c10::Float8_e5m2;                                                      \
        return __VA_ARGS__();                                                                  \
      }                                                                                        \
      default: {                                                                               \
        TORCH_CHECK(DTYPE == c10::CppTypeToScalarType<scalar_t>::value, OP,                    \
                    ": the cache must have q's dtype or be float8_e4m3fn / float8_e5m2, got ", \
                    DTYPE);                                                                    \
        using cache_t = scalar_t;                                                              \
        return __VA_ARGS__();                                                                  \
      }                                                                                        \
    }                                                                                          \
  }()
