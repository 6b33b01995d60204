#pragma once
// Validation at the boundary of the attention-state merge ops and construction of their
// parameters; shared by every device's kernel so all reject the same inputs with the same
// messages.
#include <ATen/core/Tensor.h>
#include "attention/merge_params.h"

namespace attn_ext::merge {

// Inputs as the kernels read them (out-like tensors with a contiguous last dimension: the
// tensor itself, or one copy) and the params pointing into them.
struct PreparedMerge {
  at::Tensor out_a, lse_a, out_b, lse_b;
  MergeParams params;
};
struct PreparedMergeBackward {
  PreparedMerge fwd;
  at::Tensor grad_out, grad_lse;  // grad_lse undefined when absent
  MergeBackwardParams params;
};

// out (..., Dv) floating; lse (...) float32, or float64 with float64 outs. Allocates the
// merged out (out_a's shape and dtype, dense) and lse (dense).
PreparedMerge prepare_merge(const char* op, const at::Tensor& out_a, const at::Tensor& lse_a,
                            const at::Tensor& out_b, const at::Tensor& lse_b, at::Tensor* out,
                            at::Tensor* lse);
// In place: out / lse (the accumulator, written through its strides) absorb out_other /
// lse_other. out has out_other's dtype, or float32 for a bfloat16 / float16 out_other.
PreparedMerge prepare_merge_inplace(const char* op, const at::Tensor& out, const at::Tensor& lse,
                                    const at::Tensor& out_other, const at::Tensor& lse_other);
// Allocates grad_out_a / grad_out_b (outs' shape and dtype) and grad_lse_a / grad_lse_b
// (lses' shape and dtype), dense.
PreparedMergeBackward prepare_merge_backward(const char* op, const at::Tensor& grad_out,
                                             const std::optional<at::Tensor>& grad_lse,
                                             const at::Tensor& out_a, const at::Tensor& lse_a,
                                             const at::Tensor& out_b, const at::Tensor& lse_b,
                                             std::vector<at::Tensor>* grads);

}  // namespace attn_ext::merge
