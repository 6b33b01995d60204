#pragma once
// What every family's autograd kernels (`<family>/autograd.cpp`) share.
//
// Autograd is registered in C++ (TORCH_LIBRARY_IMPL(attn_ext, Autograd, m)): each
// differentiable op has a torch::autograd::Function whose forward calls the op below autograd
// and whose backward calls the op's registered backward op through the dispatcher, so fakes,
// torch.compile and every device see the same two ops. torch.library.register_autograd (the
// Python route) cost ~40 us per call on torch 2.13 (its fill_defaults reads the schema's
// argument list once per argument: quadratic in the 14-16 arguments of the attention ops) and
// ~4 us more per call without gradients: small-shape training ran at 0.53-0.87x SDPA on it
// (docs/performance.md, "Per-call overhead").
#include <optional>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/zeros_like.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace attn_ext {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The registered op `name` with C++ signature Sig; the dispatcher checks Sig against the schema
// at the first call. Callers keep the handle in a function-local static.
template <class Sig>
c10::TypedOperatorHandle<Sig> registered_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Sig>();
}

// Calls op below autograd: the forward of a Function, or a call that records no graph (no input
// requires grad, or grad mode is off).
template <class Sig, class... Args>
auto call_below_autograd(const c10::TypedOperatorHandle<Sig>& op, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(std::forward<Args>(args)...);
}

// Whether a call must record a graph: grad mode on and some tensor argument requires grad.
template <class... Args>
bool records_graph(const Args&... tensors) {
  return torch::autograd::compute_requires_grad(tensors...);
}

// An optional tensor as save_for_backward takes it (undefined for none), and back.
inline at::Tensor saved(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}
inline std::optional<at::Tensor> unsaved(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// grad_out of a backward op: the incoming gradient, or zeros shaped like the output when only
// another output (lse) took a gradient.
inline at::Tensor grad_or_zeros(const at::Tensor& grad, const at::Tensor& like) {
  return grad.defined() ? grad : at::zeros_like(like);
}

// The gradients a backward returns for `count` arguments that take none (flags, sizes, masks).
inline void append_no_grads(variable_list& grads, size_t count) {
  grads.insert(grads.end(), count, at::Tensor());
}

}  // namespace attn_ext
