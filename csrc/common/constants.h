#pragma once
// Numeric constants shared by every kernel (CPU and CUDA).
namespace attn_ext {

// Scores are kept in the log2 domain so that softmax uses exp2: s2 = s * log2(e).
constexpr double kLog2e = 1.4426950408889634;
// ln(2): converts a log2-domain log-sum-exp back to the natural log that `lse` reports.
constexpr double kLn2 = 0.6931471805599453;

}  // namespace attn_ext
