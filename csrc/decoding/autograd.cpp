// Autograd of rope (common/autograd.h says why it is C++). RoPE is a rotation times
// attention_scaling: its gradient is the scaled inverse rotation of the incoming gradient
// (rope_backward). The frequencies get no gradient (a variant's constants).
#include <torch/library.h>
#include "common/autograd.h"

namespace attn_ext {
namespace {

using at::Tensor;
using std::optional;
using TensorOpt = optional<Tensor>;

using RopeSig = Tensor(const Tensor&, const TensorOpt&, c10::SymInt, double, bool,
                       optional<c10::SymInt>, const TensorOpt&, double);

const c10::TypedOperatorHandle<RopeSig>& rope_op() {
  static const auto op = registered_op<RopeSig>("attn_ext::rope");
  return op;
}

struct RopeFunction : torch::autograd::Function<RopeFunction> {
  // positions, offset, base, interleaved, rotary_dim, inv_freq, attention_scaling
  static constexpr size_t kFlagArgs = 7;

  static Tensor forward(AutogradContext* ctx, const Tensor& x, const TensorOpt& positions,
                        c10::SymInt offset, double base, bool interleaved,
                        optional<c10::SymInt> rotary_dim, const TensorOpt& inv_freq,
                        double attention_scaling) {
    Tensor out = call_below_autograd(rope_op(), x, positions, offset, base, interleaved, rotary_dim,
                                     inv_freq, attention_scaling);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({saved(positions), saved(inv_freq)});
    auto& d = ctx->saved_data;
    d["offset"] = std::move(offset);
    d["base"] = base;
    d["interleaved"] = interleaved;
    d["rotary_dim"] = std::move(rotary_dim);
    d["attention_scaling"] = attention_scaling;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // rope_backward shares rope's signature with the incoming gradient in place of x.
    static const auto backward_op = registered_op<RopeSig>("attn_ext::rope_backward");
    variable_list result(1);
    if (grads[0].defined()) {
      const auto& d = ctx->saved_data;
      const variable_list s = ctx->get_saved_variables();
      result[0] = backward_op.call(grads[0], unsaved(s[0]), d.at("offset").toSymInt(),
                                   d.at("base").toDouble(), d.at("interleaved").toBool(),
                                   d.at("rotary_dim").toOptional<c10::SymInt>(), unsaved(s[1]),
                                   d.at("attention_scaling").toDouble());
    }
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

Tensor rope_autograd(const Tensor& x, const TensorOpt& positions, c10::SymInt offset, double base,
                     bool interleaved, optional<c10::SymInt> rotary_dim, const TensorOpt& inv_freq,
                     double attention_scaling) {
  if (!records_graph(x)) {
    return call_below_autograd(rope_op(), x, positions, std::move(offset), base, interleaved,
                               std::move(rotary_dim), inv_freq, attention_scaling);
  }
  return RopeFunction::apply(x, positions, std::move(offset), base, interleaved,
                             std::move(rotary_dim), inv_freq, attention_scaling);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, Autograd, m) {
  m.impl("rope", &rope_autograd);
}

}  // namespace attn_ext
