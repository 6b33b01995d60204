#include "attention/merge_inputs.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "common/tensors.h"

namespace attn_ext::merge {
namespace {

bool is_state_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

void check_out(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a tensor, got None");
  TORCH_CHECK(is_state_dtype(t.scalar_type()), op, ": ", name,
              " must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() >= 1 && t.dim() <= kMaxLeadingDims + 1, op, ": ", name, " must have 1 to ",
              kMaxLeadingDims + 1, " dimensions (..., Dv), got ", t.dim(), "-D ", t.sizes());
}

// A tensor received alongside `like` (same device, and shape when given).
void check_like(const char* op, const char* name, const at::Tensor& t, const char* like_name,
                const at::Tensor& like, at::IntArrayRef shape) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a tensor, got None");
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like_name, "'s device ",
              like.device(), ", got ", t.device());
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType expected,
                 const char* why) {
  TORCH_CHECK(t.scalar_type() == expected, op, ": ", name, " must have dtype ", expected, " (", why,
              "), got ", t.scalar_type());
}

// lse float32, or float64 alongside float64 outs (what gradcheck and fp64 callers use).
void check_lse_dtype(const char* op, const char* name, const at::Tensor& lse,
                     at::ScalarType out_dtype) {
  const auto t = lse.scalar_type();
  TORCH_CHECK(t == at::kFloat || (t == at::kDouble && out_dtype == at::kDouble), op, ": ", name,
              " must be float32 (or float64 with float64 outs), got ", t, " with outs of ",
              out_dtype);
}

// The last dimension contiguous: the tensor itself, else one copy.
at::Tensor rows_readable(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

RowShape row_shape(const at::Tensor& out) {
  RowShape s;
  s.ndim = static_cast<int>(out.dim()) - 1;
  s.rows = 1;
  for (int d = 0; d < s.ndim; ++d) {
    s.size[d] = out.size(d);
    s.rows *= out.size(d);
  }
  s.dv = out.size(-1);
  return s;
}

RowStrides strides_of(const at::Tensor& t, int ndim) {
  RowStrides st;
  for (int d = 0; d < ndim; ++d) st.s[d] = t.stride(d);
  return st;
}

PreparedMerge prepare_inputs(const char* op, const char* a_name, const char* la_name,
                             const char* b_name, const char* lb_name, const at::Tensor& out_a,
                             const at::Tensor& lse_a, const at::Tensor& out_b,
                             const at::Tensor& lse_b) {
  check_out(op, a_name, out_a);
  check_out(op, b_name, out_b);
  check_like(op, b_name, out_b, a_name, out_a, out_a.sizes());
  const auto row_sizes = out_a.sizes().slice(0, out_a.dim() - 1);
  check_like(op, la_name, lse_a, a_name, out_a, row_sizes);
  check_like(op, lb_name, lse_b, a_name, out_a, row_sizes);
  check_lse_dtype(op, lb_name, lse_b, out_b.scalar_type());
  check_dtype(op, la_name, lse_a, lse_b.scalar_type(), "both lses share one dtype");
  PreparedMerge r{rows_readable(out_a), lse_a, rows_readable(out_b), lse_b, {}};
  MergeParams& p = r.params;
  p.shape = row_shape(out_a);
  const int nd = p.shape.ndim;
  p.out_a = r.out_a.const_data_ptr();
  p.lse_a = lse_a.const_data_ptr();
  p.out_b = r.out_b.const_data_ptr();
  p.lse_b = lse_b.const_data_ptr();
  p.out_a_st = strides_of(r.out_a, nd);
  p.lse_a_st = strides_of(lse_a, nd);
  p.out_b_st = strides_of(r.out_b, nd);
  p.lse_b_st = strides_of(lse_b, nd);
  return r;
}

}  // namespace

PreparedMerge prepare_merge(const char* op, const at::Tensor& out_a, const at::Tensor& lse_a,
                            const at::Tensor& out_b, const at::Tensor& lse_b, at::Tensor* out,
                            at::Tensor* lse) {
  PreparedMerge r =
      prepare_inputs(op, "out_a", "lse_a", "out_b", "lse_b", out_a, lse_a, out_b, lse_b);
  check_dtype(op, "out_b", out_b, out_a.scalar_type(), "both outs share one dtype");
  check_lse_dtype(op, "lse_a", lse_a, out_a.scalar_type());
  *out = advise_huge_pages(
      at::empty(out_a.sizes(), out_a.options().memory_format(at::MemoryFormat::Contiguous)));
  *lse = at::empty(lse_a.sizes(), lse_a.options().memory_format(at::MemoryFormat::Contiguous));
  MergeParams& p = r.params;
  p.out = out->data_ptr();
  p.lse = lse->data_ptr();
  p.out_st = strides_of(*out, p.shape.ndim);
  p.lse_st = strides_of(*lse, p.shape.ndim);
  return r;
}

PreparedMerge prepare_merge_inplace(const char* op, const at::Tensor& out, const at::Tensor& lse,
                                    const at::Tensor& out_other, const at::Tensor& lse_other) {
  check_out(op, "out", out);
  // The accumulator is written where it lies: it cannot be a copy.
  TORCH_CHECK(out.size(-1) <= 1 || out.stride(-1) == 1, op,
              ": out must have a contiguous last dimension (stride 1), got strides ",
              out.strides());
  PreparedMerge r =
      prepare_inputs(op, "out", "lse", "out_other", "lse_other", out, lse, out_other, lse_other);
  const auto t = out_other.scalar_type();
  const bool low = t == at::kBFloat16 || t == at::kHalf;
  TORCH_CHECK(out.scalar_type() == t || (low && out.scalar_type() == at::kFloat), op,
              ": out must have out_other's dtype ", t,
              low ? " or float32 (an fp32 accumulator)" : "", ", got ", out.scalar_type());
  MergeParams& p = r.params;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr();
  p.out_st = p.out_a_st;
  p.lse_st = p.lse_a_st;
  return r;
}

PreparedMergeBackward prepare_merge_backward(const char* op, const at::Tensor& grad_out,
                                             const std::optional<at::Tensor>& grad_lse,
                                             const at::Tensor& out_a, const at::Tensor& lse_a,
                                             const at::Tensor& out_b, const at::Tensor& lse_b,
                                             std::vector<at::Tensor>* grads) {
  PreparedMergeBackward r{
      prepare_inputs(op, "out_a", "lse_a", "out_b", "lse_b", out_a, lse_a, out_b, lse_b),
      {},
      {},
      {}};
  check_dtype(op, "out_b", out_b, out_a.scalar_type(), "both outs share one dtype");
  check_lse_dtype(op, "lse_a", lse_a, out_a.scalar_type());
  check_like(op, "grad_out", grad_out, "out_a", out_a, out_a.sizes());
  check_dtype(op, "grad_out", grad_out, out_a.scalar_type(), "out_a's dtype");
  r.grad_out = rows_readable(grad_out);
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if (has_glse) {
    check_like(op, "grad_lse", *grad_lse, "lse_a", lse_a, lse_a.sizes());
    check_dtype(op, "grad_lse", *grad_lse, lse_a.scalar_type(), "lse_a's dtype");
    r.grad_lse = *grad_lse;
  }
  const int nd = r.fwd.params.shape.ndim;
  const auto dense = at::MemoryFormat::Contiguous;
  *grads = {advise_huge_pages(at::empty(out_a.sizes(), out_a.options().memory_format(dense))),
            at::empty(lse_a.sizes(), lse_a.options().memory_format(dense)),
            advise_huge_pages(at::empty(out_b.sizes(), out_b.options().memory_format(dense))),
            at::empty(lse_b.sizes(), lse_b.options().memory_format(dense))};
  MergeBackwardParams& p = r.params;
  p.fwd = r.fwd.params;
  p.grad_out = r.grad_out.const_data_ptr();
  p.grad_out_st = strides_of(r.grad_out, nd);
  if (has_glse) {
    p.grad_lse = r.grad_lse.const_data_ptr();
    p.grad_lse_st = strides_of(r.grad_lse, nd);
  }
  p.grad_out_a = (*grads)[0].data_ptr();
  p.grad_lse_a = (*grads)[1].data_ptr();
  p.grad_out_b = (*grads)[2].data_ptr();
  p.grad_lse_b = (*grads)[3].data_ptr();
  // The gradients are dense, laid out as the merged out / lse of the forward.
  p.fwd.out_st = strides_of((*grads)[0], nd);
  p.fwd.lse_st = strides_of((*grads)[1], nd);
  return r;
}

}  // namespace attn_ext::merge
