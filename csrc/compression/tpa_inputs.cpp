#include "compression/tpa_inputs.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include "decoding/decode_inputs.h"
#include "common/tensors.h"

namespace attn_ext {

PreparedTpa prepare_tpa_expand(const char* op, const at::Tensor& a, const at::Tensor& b,
                               const TpaOptions& o, const at::Tensor* grad_out) {
  check_float_4d(op, "a", a, "(B, S, R, H)");
  check_float_4d(op, "b", b, "(B, S, R, D)");
  TORCH_CHECK(b.device() == a.device(), op, ": b must be on a's device ", a.device(), ", got ",
              b.device());
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), op, ": b must have a's dtype ", a.scalar_type(),
              ", got ", b.scalar_type());
  TORCH_CHECK(b.size(0) == a.size(0) && b.size(1) == a.size(1), op,
              ": a and b must agree in (B, S), got a ", a.sizes(), " and b ", b.sizes());
  TORCH_CHECK(a.size(2) >= 1 && b.size(2) == a.size(2), op,
              ": the rank R (dim 2) of a and b must be equal and >= 1, got a ", a.sizes(),
              " and b ", b.sizes());
  TORCH_CHECK(std::isfinite(o.scale), op, ": scale must be finite, got ", o.scale);

  PreparedTpa r;
  TpaExpandParams& p = r.params;
  p.batch = a.size(0);
  p.seqlen = a.size(1);
  p.rank = a.size(2);
  p.heads = a.size(3);
  p.head_dim = b.size(3);
  p.scale = o.scale;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.a_batch_stride = a.stride(0), p.a_row_stride = a.stride(1), p.a_rank_stride = a.stride(2);
  p.a_col_stride = a.stride(3);
  p.b_batch_stride = b.stride(0), p.b_row_stride = b.stride(1), p.b_rank_stride = b.stride(2);
  p.b_col_stride = b.stride(3);

  const bool has_pos = o.positions.has_value() && o.positions->defined();
  TORCH_CHECK(o.rope || !has_pos, op,
              ": positions are given but rope=False (they would be "
              "ignored); pass rope=True or drop them");
  p.rope = o.rope;
  if (o.rope) {
    p.policy = make_rope_policy(op, p.head_dim, o.rope_base, o.rope_interleaved, o.rotary_dim);
  }
  if (has_pos) {
    r.positions =
        prepare_positions(op, *o.positions, "a", a, p.batch, p.seqlen, &p.pos_batch_stride);
    p.positions = r.positions.data_ptr<int64_t>();
  }
  if (grad_out != nullptr) {
    const at::Tensor& g = *grad_out;
    TORCH_CHECK(g.dim() == 4 && g.size(0) == p.batch && g.size(1) == p.seqlen &&
                    g.size(2) == p.heads && g.size(3) == p.head_dim,
                op, ": grad_out must have shape (B, S, H, D) = (", p.batch, ", ", p.seqlen, ", ",
                p.heads, ", ", p.head_dim, "), got ", g.sizes());
    TORCH_CHECK(g.device() == a.device() && g.scalar_type() == a.scalar_type(), op,
                ": grad_out must have a's device and dtype (", a.device(), ", ", a.scalar_type(),
                "), got ", g.device(), ", ", g.scalar_type());
    p.grad_out = g.data_ptr();
    p.g_batch_stride = g.stride(0), p.g_row_stride = g.stride(1), p.g_head_stride = g.stride(2);
    p.g_col_stride = g.stride(3);
  }
  return r;
}

at::Tensor allocate_tpa_output(const TpaExpandParams& p, const at::Tensor& a) {
  return advise_huge_pages(at::empty({p.batch, p.seqlen, p.heads, p.head_dim}, a.options()));
}

namespace {

// The stride of the merged (token, rank) row index t * R + r of a (B, N, R, X) factor cache,
// if that index has one (rows not overlapping, so that BLAS takes it as a leading dimension).
// PyTorch leaves the stride of a size-1 dimension arbitrary (and calls such tensors
// contiguous): with R == 1 the rows step by the token stride, with N == 1 by the rank stride;
// reading stride(2) when R == 1 walked off the tensor (found by tests/test_fuzz.py).
std::optional<int64_t> merged_row_stride(const at::Tensor& t) {
  const int64_t tokens = t.size(1), rank = t.size(2), width = std::max<int64_t>(t.size(3), 1);
  if (tokens * rank <= 1 || t.size(3) == 0) {  // nothing to step over: any valid stride
    return width;
  }
  int64_t stride = 0;
  if (rank == 1) {
    stride = t.stride(1);
  } else if (tokens == 1 || t.stride(1) == rank * t.stride(2)) {
    stride = t.stride(2);
  } else {
    return std::nullopt;
  }
  if (stride < width) {
    return std::nullopt;
  }
  return stride;
}

// A factor cache as rows of merged (token, rank) index with a contiguous last dimension: the
// tensor itself, else one contiguous copy; *row_stride receives the rows' stride.
at::Tensor factor_rows(const at::Tensor& t, int64_t* row_stride) {
  const bool last_ok = t.stride(3) == 1 || t.size(3) <= 1;
  if (const auto stride = merged_row_stride(t); last_ok && stride) {
    *row_stride = *stride;
    return t;
  }
  at::Tensor copy = t.contiguous();
  *row_stride = merged_row_stride(copy).value();
  return copy;
}

void check_factor_cache(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q,
                        int64_t batch, int64_t tokens, int64_t last, const char* last_name) {
  check_float_4d(op, name, t, "(B, N, R, *)");
  TORCH_CHECK(t.device() == q.device(), op, ": ", name, " must be on q's device ", q.device(),
              ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype ",
              q.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(0) == batch && t.size(1) == tokens && t.size(2) >= 1 && t.size(3) == last, op,
              ": ", name, " must have shape (B, N, R, ", last_name, ") = (", batch, ", ", tokens,
              ", R >= 1, ", last, "), got ", t.sizes());
}

}  // namespace

PreparedTpaDecode prepare_tpa_decode(const char* op, const at::Tensor& q, const at::Tensor& a_k,
                                     const at::Tensor& b_k, const at::Tensor& a_v,
                                     const at::Tensor& b_v, const at::Tensor& cache_seqlens,
                                     std::optional<double> scale, std::optional<double> k_scale,
                                     std::optional<double> v_scale, bool check_values) {
  check_float_4d(op, "q", q, "(B, H, S, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  TORCH_CHECK(a_k.dim() == 4, op, ": a_k must be 4-D (B, N, R_K, H), got ", a_k.dim(), "-D ",
              a_k.sizes());
  const int64_t N = a_k.size(1);
  check_factor_cache(op, "a_k", a_k, q, B, N, H, "H");
  check_factor_cache(op, "b_k", b_k, q, B, N, D, "D");
  check_factor_cache(op, "a_v", a_v, q, B, N, H, "H");
  check_factor_cache(op, "b_v", b_v, q, B, N, D, "D");
  TORCH_CHECK(b_k.size(2) == a_k.size(2), op, ": b_k's rank (dim 2) must be a_k's ", a_k.size(2),
              ", got ", b_k.size(2));
  TORCH_CHECK(b_v.size(2) == a_v.size(2), op, ": b_v's rank (dim 2) must be a_v's ", a_v.size(2),
              ", got ", b_v.size(2));

  PreparedTpaDecode r;
  r.q = blas_rows(q);
  TpaDecodeParams& p = r.params;
  r.a_k = factor_rows(a_k, &p.ak_row_stride);
  r.b_k = factor_rows(b_k, &p.bk_row_stride);
  r.a_v = factor_rows(a_v, &p.av_row_stride);
  r.b_v = factor_rows(b_v, &p.bv_row_stride);
  r.lengths = int64_lengths(op, "cache_seqlens", cache_seqlens, B, q, N, check_values);
  p.batch = B, p.heads = H, p.seqlen_q = q.size(2), p.head_dim = D, p.tokens = N;
  p.rank_k = a_k.size(2), p.rank_v = a_v.size(2);
  p.q = r.q.const_data_ptr();
  p.q_batch_stride = r.q.stride(0), p.q_head_stride = r.q.stride(1);
  p.q_row_stride = blas_row_stride(r.q);
  p.a_k = r.a_k.const_data_ptr(), p.b_k = r.b_k.const_data_ptr();
  p.a_v = r.a_v.const_data_ptr(), p.b_v = r.b_v.const_data_ptr();
  p.ak_batch_stride = r.a_k.stride(0), p.bk_batch_stride = r.b_k.stride(0);
  p.av_batch_stride = r.a_v.stride(0), p.bv_batch_stride = r.b_v.stride(0);
  p.scale =
      scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(D, 1)));
  p.k_scale = k_scale.has_value() ? *k_scale : 1.0 / static_cast<double>(p.rank_k);
  p.v_scale = v_scale.has_value() ? *v_scale : 1.0 / static_cast<double>(p.rank_v);
  TORCH_CHECK(std::isfinite(p.scale) && std::isfinite(p.k_scale) && std::isfinite(p.v_scale), op,
              ": scale, k_scale and v_scale must be finite, got ", p.scale, ", ", p.k_scale, ", ",
              p.v_scale);
  return r;
}

}  // namespace attn_ext
