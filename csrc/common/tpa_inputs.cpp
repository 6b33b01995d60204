#include "tpa_inputs.h"

#include <cmath>
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include "decode_inputs.h"

namespace attn_ext {

PreparedTpa prepare_tpa_expand(const char* op, const at::Tensor& a, const at::Tensor& b,
                               const TpaOptions& o, const at::Tensor* grad_out) {
  check_float_4d(op, "a", a, "(B, S, R, H)");
  check_float_4d(op, "b", b, "(B, S, R, D)");
  TORCH_CHECK(b.device() == a.device(), op, ": b must be on a's device ", a.device(), ", got ",
              b.device());
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), op, ": b must have a's dtype ",
              a.scalar_type(), ", got ", b.scalar_type());
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
  TORCH_CHECK(o.rope || !has_pos, op, ": positions are given but rope=False (they would be "
              "ignored); pass rope=True or drop them");
  p.rope = o.rope;
  if (o.rope) {
    p.policy = make_rope_policy(op, p.head_dim, o.rope_base, o.rope_interleaved, o.rotary_dim);
  }
  if (has_pos) {
    r.positions = prepare_positions(op, *o.positions, "a", a, p.batch, p.seqlen,
                                    &p.pos_batch_stride);
    p.positions = r.positions.data_ptr<int64_t>();
  }
  if (grad_out != nullptr) {
    const at::Tensor& g = *grad_out;
    TORCH_CHECK(g.dim() == 4 && g.size(0) == p.batch && g.size(1) == p.seqlen &&
                    g.size(2) == p.heads && g.size(3) == p.head_dim,
                op, ": grad_out must have shape (B, S, H, D) = (", p.batch, ", ", p.seqlen, ", ",
                p.heads, ", ", p.head_dim, "), got ", g.sizes());
    TORCH_CHECK(g.device() == a.device() && g.scalar_type() == a.scalar_type(), op,
                ": grad_out must have a's device and dtype (", a.device(), ", ",
                a.scalar_type(), "), got ", g.device(), ", ", g.scalar_type());
    p.grad_out = g.data_ptr();
    p.g_batch_stride = g.stride(0), p.g_row_stride = g.stride(1), p.g_head_stride = g.stride(2);
    p.g_col_stride = g.stride(3);
  }
  return r;
}

at::Tensor allocate_tpa_output(const TpaExpandParams& p, const at::Tensor& a) {
  return at::empty({p.batch, p.seqlen, p.heads, p.head_dim}, a.options());
}

}  // namespace attn_ext
