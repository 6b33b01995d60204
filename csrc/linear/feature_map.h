#pragma once
// Per-element math of linear attention, shared by the CPU kernel and a future CUDA kernel.
//
// out_i = phi(q_i) . S_i / (phi(q_i) . z_i + eps), with S_i = sum_j phi(k_j) v_j^T and
// z_i = sum_j phi(k_j) over the keys position i sees (all of them, or j <= i when causal),
// plus the initial state. The kernels append a column of ones to v, so the denominator is
// one more output column and the state (S, z) is one D x (Dv + 1) matrix.
#include <cmath>
#include <c10/macros/Macros.h>

namespace attn_ext::linear {

// Causal chunk length: quadratic (masked) within a chunk, state carried between chunks.
// 64 keeps the chunk's C x C score tile and its operands in L1/L2, and the intra-chunk
// work (S * C * (D + Dv)) comparable to the state work (S * D * Dv) at D = 64.
constexpr int64_t kCausalChunk = 64;
// Non-causal row block: no intra-block term, so larger blocks only make the GEMMs more
// efficient; the partial state of every block (D x (Dv + 1)) is kept until the reduction.
constexpr int64_t kNonCausalBlock = 256;

enum class FeatureMap : int {
  kEluPlusOne = 0,  // elu(x) + 1: positive, document 000's choice
  kRelu = 1,        // max(x, 0)
  kIdentity = 2,    // x: no positivity, the denominator can vanish (caller's choice)
};

// The names accepted by the ops' feature_map argument, in enum order.
constexpr const char* kFeatureMapNames[] = {"elu+1", "relu", "identity"};
constexpr int kNumFeatureMaps = 3;

// phi(x)
template <typename T>
C10_HOST_DEVICE inline T feature(FeatureMap f, T x) {
  switch (f) {
    case FeatureMap::kEluPlusOne:
      // elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise (elu's alpha = 1).
      return x > T(0) ? x + T(1) : std::exp(x);
    case FeatureMap::kRelu:
      return x > T(0) ? x : T(0);
    case FeatureMap::kIdentity:
    default:
      return x;
  }
}

// d phi / d x written in terms of phi = phi(x), so the backward needs only the feature rows
// it already holds. elu+1: x > 0 <=> phi > 1 and the slope is 1; for x <= 0 the slope is
// exp(x) = phi (where phi rounds to 1 both branches give 1). relu: x > 0 <=> phi > 0.
template <typename T>
C10_HOST_DEVICE inline T feature_grad_from_value(FeatureMap f, T phi) {
  switch (f) {
    case FeatureMap::kEluPlusOne:
      return phi > T(1) ? T(1) : phi;
    case FeatureMap::kRelu:
      return phi > T(0) ? T(1) : T(0);
    case FeatureMap::kIdentity:
    default:
      return T(1);
  }
}

// out = n / (den + eps) for one row with numerator n (Dv values) and denominator den:
// out[c] = n[c] * inv with inv = 1 / (den + eps).
template <typename T>
C10_HOST_DEVICE inline T normalizer_inv(T den, T eps) {
  return T(1) / (den + eps);
}
// Its backward for the incoming gradient g: dn[c] = g[c] * inv and
// dden = -(g . n) * inv^2 (the caller computes g . n).
template <typename T>
C10_HOST_DEVICE inline T denominator_grad(T g_dot_n, T inv) {
  return -g_dot_n * inv * inv;
}

}  // namespace attn_ext::linear
