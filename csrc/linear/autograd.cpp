// Autograd of linear_attention (common/autograd.h says why it is C++), through
// linear_attention_backward: the output and both final states take gradients.
#include <tuple>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include "common/autograd.h"

namespace attn_ext {
namespace {

using at::Tensor;
using std::optional;
using TensorOpt = optional<Tensor>;

using LinearSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                     const TensorOpt&, const TensorOpt&, bool,
                                                     double, c10::string_view);
using LinearBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const TensorOpt&, const TensorOpt&,
    const TensorOpt&, const TensorOpt&, bool, double, c10::string_view);

const c10::TypedOperatorHandle<LinearSig>& linear_op() {
  static const auto op = registered_op<LinearSig>("attn_ext::linear_attention");
  return op;
}

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static constexpr size_t kFlagArgs = 3;  // causal, eps, feature_map

  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const TensorOpt& initial_state_kv,
                               const TensorOpt& initial_state_k, bool causal, double eps,
                               c10::string_view feature_map) {
    auto [out, state_kv, state_k] = call_below_autograd(linear_op(), q, k, v, initial_state_kv,
                                                        initial_state_k, causal, eps, feature_map);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, saved(initial_state_kv), saved(initial_state_k)});
    auto& d = ctx->saved_data;
    d["causal"] = causal;
    d["eps"] = eps;
    d["feature_map"] = std::string(feature_map);
    return {out, state_kv, state_k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        registered_op<LinearBackwardSig>("attn_ext::linear_attention_backward");
    const variable_list s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const Tensor &q = s[0], &v = s[2], &init_kv = s[3];
    Tensor grad_out = grads[0], grad_state_kv = grads[1], grad_state_k = grads[2];
    const auto B = q.sym_size(0), H = q.sym_size(1), S = q.sym_size(2), D = q.sym_size(3),
               Dv = v.sym_size(3);
    if (!grad_out.defined()) grad_out = at::zeros_symint({B, H, S, Dv}, q.options());
    // The op takes the final state's gradient as a pair or not at all.
    if (grad_state_kv.defined() != grad_state_k.defined()) {
      if (!grad_state_kv.defined()) {
        grad_state_kv = at::zeros_symint({B, H, D, Dv}, grad_state_k.options());
      } else {
        grad_state_k = at::zeros_symint({B, H, D}, grad_state_kv.options());
      }
    }
    const std::string feature_map = d.at("feature_map").toStringRef();
    auto [dq, dk, dv, d_init_kv, d_init_k] = backward_op.call(
        grad_out, q, s[1], v, unsaved(init_kv), unsaved(s[4]), unsaved(grad_state_kv),
        unsaved(grad_state_k), d.at("causal").toBool(), d.at("eps").toDouble(), feature_map);
    if (!init_kv.defined()) d_init_kv = d_init_k = Tensor();
    variable_list result{dq, dk, dv, d_init_kv, d_init_k};
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

std::tuple<Tensor, Tensor, Tensor> linear_attention_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const TensorOpt& initial_state_kv,
    const TensorOpt& initial_state_k, bool causal, double eps, c10::string_view feature_map) {
  if (!records_graph(q, k, v, initial_state_kv, initial_state_k)) {
    return call_below_autograd(linear_op(), q, k, v, initial_state_kv, initial_state_k, causal, eps,
                               feature_map);
  }
  auto r =
      LinearFunction::apply(q, k, v, initial_state_kv, initial_state_k, causal, eps, feature_map);
  return {r[0], r[1], r[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, Autograd, m) {
  m.impl("linear_attention", &linear_attention_autograd);
}

}  // namespace attn_ext
