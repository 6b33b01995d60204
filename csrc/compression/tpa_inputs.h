#pragma once
// Validation at the boundary of tpa_expand / tpa_expand_backward (shared by the CPU and CUDA
// ops) and construction of their parameter struct. Messages name the argument, the expected
// and the actual value.
#include <optional>
#include <ATen/core/Tensor.h>
#include "compression/tpa_params.h"

namespace attn_ext {

struct TpaOptions {
  std::optional<at::Tensor> positions;
  double scale = 1.0;
  bool rope = false;
  double rope_base = 10000.0;
  bool rope_interleaved = false;
  std::optional<int64_t> rotary_dim;
};

struct PreparedTpa {
  at::Tensor positions;  // int64, rows contiguous, or undefined
  TpaExpandParams params;
};

// a (B, S, R, H), b (B, S, R, D); out (B, S, H, D) is allocated by the caller and set with
// set_tpa_output. With grad_out (the backward) its shape is checked as out's.
PreparedTpa prepare_tpa_expand(const char* op, const at::Tensor& a, const at::Tensor& b,
                               const TpaOptions& o, const at::Tensor* grad_out = nullptr);
at::Tensor allocate_tpa_output(const TpaExpandParams& p, const at::Tensor& a);

// tpa_decode_attention's inputs (see TpaDecodeParams): shapes, dtypes and devices checked,
// each factor cache viewed as (B, N * R, X) rows (copied once only if its token and rank
// dimensions do not merge), lengths as int64 (values checked in [0, N] with check_values).
struct PreparedTpaDecode {
  at::Tensor q, a_k, b_k, a_v, b_v, lengths;
  TpaDecodeParams params;  // everything but out / lse
};
PreparedTpaDecode prepare_tpa_decode(const char* op, const at::Tensor& q, const at::Tensor& a_k,
                                     const at::Tensor& b_k, const at::Tensor& a_v,
                                     const at::Tensor& b_v, const at::Tensor& cache_seqlens,
                                     std::optional<double> scale, std::optional<double> k_scale,
                                     std::optional<double> v_scale, bool check_values);

}  // namespace attn_ext
