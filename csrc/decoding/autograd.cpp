// Autograd of rope (common/autograd.h says why it is C++). RoPE is a rotation: its gradient is
// the inverse rotation of the incoming gradient (rope_backward).
#include <torch/library.h>
#include "common/autograd.h"

namespace attn_ext {
namespace {

using at::Tensor;
using std::optional;
using TensorOpt = optional<Tensor>;

using RopeSig = Tensor(const Tensor&, const TensorOpt&, c10::SymInt, double, bool,
                       optional<c10::SymInt>);

const c10::TypedOperatorHandle<RopeSig>& rope_op() {
  static const auto op = registered_op<RopeSig>("attn_ext::rope");
  return op;
}

struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static constexpr size_t kFlagArgs = 5;  // positions, offset, base, interleaved, rotary_dim

  static Tensor forward(AutogradContext* ctx, const Tensor& x, const TensorOpt& positions,
                        c10::SymInt offset, double base, bool interleaved,
                        optional<c10::SymInt> rotary_dim) {
    Tensor out =
        call_below_autograd(rope_op(), x, positions, offset, base, interleaved, rotary_dim);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({saved(positions)});
    auto& d = ctx->saved_data;
    d["offset"] = std::move(offset);
    d["base"] = base;
    d["interleaved"] = interleaved;
    d["rotary_dim"] = std::move(rotary_dim);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // rope_backward shares rope's signature with the incoming gradient in place of x.
    static const auto backward_op = registered_op<RopeSig>("attn_ext::rope_backward");
    variable_list result(1);
    if (grads[0].defined()) {
      const auto& d = ctx->saved_data;
      result[0] = backward_op.call(grads[0], unsaved(ctx->get_saved_variables()[0]),
                                   d.at("offset").toSymInt(), d.at("base").toDouble(),
                                   d.at("interleaved").toBool(),
                                   d.at("rotary_dim").toOptional<c10::SymInt>());
    }
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

Tensor rope_autograd(const Tensor& x, const TensorOpt& positions, c10::SymInt offset, double base,
                     bool interleaved, optional<c10::SymInt> rotary_dim) {
  if (!records_graph(x)) {
    return call_below_autograd(rope_op(), x, positions, std::move(offset), base, interleaved,
                               std::move(rotary_dim));
  }
  return RopeFunction::apply(x, positions, std::move(offset), base, interleaved,
                             std::move(rotary_dim));
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, Autograd, m) {
  m.impl("rope", &rope_autograd);
}

}  // namespace attn_ext
