// Autograd of the CBAM spatial-attention ops (common/autograd.h says why it is C++):
// channel_pool (the gradient goes to each pixel's max channel and spreads the mean evenly) and
// spatial_gate, through their registered backward ops.
#include <tuple>
#include <torch/library.h>
#include "common/autograd.h"
#include "spatial/spatial_inputs.h"

namespace attn_ext {
namespace {

using at::Tensor;

using PoolSig = std::tuple<Tensor, Tensor>(const Tensor&);
using PoolBackwardSig = Tensor(const Tensor&, const Tensor&, c10::SymInt, bool);
using GateSig = Tensor(const Tensor&, const Tensor&);
using GateBackwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&);

const c10::TypedOperatorHandle<PoolSig>& pool_op() {
  static const auto op = registered_op<PoolSig>("attn_ext::channel_pool");
  return op;
}
const c10::TypedOperatorHandle<GateSig>& gate_op() {
  static const auto op = registered_op<GateSig>("attn_ext::spatial_gate");
  return op;
}

struct PoolFunction : torch::autograd::Function<PoolFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x) {
    auto [pooled, argmax] = call_below_autograd(pool_op(), x);
    ctx->set_materialize_grads(false);
    ctx->mark_non_differentiable({argmax});
    ctx->save_for_backward({argmax});
    ctx->saved_data["channels"] = x.sym_size(1);
    // grad_x takes x's layout (the kernels' rule, spatial/spatial_inputs.h).
    ctx->saved_data["channels_last"] = spatial::is_channels_last(x);
    return {pooled, argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        registered_op<PoolBackwardSig>("attn_ext::channel_pool_backward");
    if (!grads[0].defined()) return {Tensor()};
    const auto& d = ctx->saved_data;
    return {backward_op.call(grads[0], ctx->get_saved_variables()[0], d.at("channels").toSymInt(),
                             d.at("channels_last").toBool())};
  }
};

std::tuple<Tensor, Tensor> channel_pool_autograd(const Tensor& x) {
  if (!records_graph(x)) return call_below_autograd(pool_op(), x);
  auto r = PoolFunction::apply(x);
  return {r[0], r[1]};
}

struct GateFunction : torch::autograd::Function<GateFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& gate) {
    Tensor out = call_below_autograd(gate_op(), x, gate);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, gate});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        registered_op<GateBackwardSig>("attn_ext::spatial_gate_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor()};
    const variable_list s = ctx->get_saved_variables();
    auto [grad_x, grad_gate] = backward_op.call(grads[0], s[0], s[1]);
    return {grad_x, grad_gate};
  }
};

Tensor spatial_gate_autograd(const Tensor& x, const Tensor& gate) {
  if (!records_graph(x, gate)) return call_below_autograd(gate_op(), x, gate);
  return GateFunction::apply(x, gate);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, Autograd, m) {
  m.impl("channel_pool", &channel_pool_autograd);
  m.impl("spatial_gate", &spatial_gate_autograd);
}

}  // namespace attn_ext
