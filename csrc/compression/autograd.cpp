// Autograd of the Tensor Product Attention ops (common/autograd.h says why it is C++):
// tpa_expand and tpa_decode_attention through their registered backward ops.
#include <tuple>
#include <torch/library.h>
#include "common/autograd.h"

namespace attn_ext {
namespace {

using at::Tensor;
using std::optional;
using TensorOpt = optional<Tensor>;

// ----------------------------------------------------------------------------------- tpa_expand

using ExpandSig = Tensor(const Tensor&, const Tensor&, const TensorOpt&, double, bool, double, bool,
                         optional<c10::SymInt>);
using ExpandBackwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                     const TensorOpt&, double, bool, double, bool,
                                                     optional<c10::SymInt>);

const c10::TypedOperatorHandle<ExpandSig>& expand_op() {
  static const auto op = registered_op<ExpandSig>("attn_ext::tpa_expand");
  return op;
}

struct ExpandFunction : torch::autograd::Function<ExpandFunction> {
  static constexpr size_t kFlagArgs = 6;  // positions, scale ... rotary_dim

  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b,
                        const TensorOpt& positions, double scale, bool rope, double rope_base,
                        bool rope_interleaved, optional<c10::SymInt> rotary_dim) {
    Tensor out = call_below_autograd(expand_op(), a, b, positions, scale, rope, rope_base,
                                     rope_interleaved, rotary_dim);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({a, b, saved(positions)});
    auto& d = ctx->saved_data;
    d["scale"] = scale;
    d["rope"] = rope;
    d["rope_base"] = rope_base;
    d["rope_interleaved"] = rope_interleaved;
    d["rotary_dim"] = std::move(rotary_dim);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        registered_op<ExpandBackwardSig>("attn_ext::tpa_expand_backward");
    variable_list result(2);
    if (grads[0].defined()) {
      const variable_list s = ctx->get_saved_variables();
      const auto& d = ctx->saved_data;
      std::tie(result[0], result[1]) = backward_op.call(
          grads[0], s[0], s[1], unsaved(s[2]), d.at("scale").toDouble(), d.at("rope").toBool(),
          d.at("rope_base").toDouble(), d.at("rope_interleaved").toBool(),
          d.at("rotary_dim").toOptional<c10::SymInt>());
    }
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

Tensor tpa_expand_autograd(const Tensor& a, const Tensor& b, const TensorOpt& positions,
                           double scale, bool rope, double rope_base, bool rope_interleaved,
                           optional<c10::SymInt> rotary_dim) {
  if (!records_graph(a, b)) {
    return call_below_autograd(expand_op(), a, b, positions, scale, rope, rope_base,
                               rope_interleaved, std::move(rotary_dim));
  }
  return ExpandFunction::apply(a, b, positions, scale, rope, rope_base, rope_interleaved,
                               std::move(rotary_dim));
}

// ------------------------------------------------------------------------- tpa_decode_attention

using DecodeSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&, const Tensor&, const Tensor&,
                                             optional<double>, optional<double>, optional<double>);
using DecodeBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const TensorOpt&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, optional<double>, optional<double>, optional<double>);

const c10::TypedOperatorHandle<DecodeSig>& decode_op() {
  static const auto op = registered_op<DecodeSig>("attn_ext::tpa_decode_attention");
  return op;
}

struct DecodeFunction : torch::autograd::Function<DecodeFunction> {
  static constexpr size_t kFlagArgs = 4;  // cache_seqlens, scale, k_scale, v_scale

  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& a_k,
                               const Tensor& b_k, const Tensor& a_v, const Tensor& b_v,
                               const Tensor& cache_seqlens, optional<double> scale,
                               optional<double> k_scale, optional<double> v_scale) {
    auto [out, lse] = call_below_autograd(decode_op(), q, a_k, b_k, a_v, b_v, cache_seqlens, scale,
                                          k_scale, v_scale);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, a_k, b_k, a_v, b_v, cache_seqlens});
    auto& d = ctx->saved_data;
    d["scale"] = scale;
    d["k_scale"] = k_scale;
    d["v_scale"] = v_scale;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        registered_op<DecodeBackwardSig>("attn_ext::tpa_decode_attention_backward");
    const variable_list s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    // out is shaped like q (s[0]), which is saved; out is not.
    auto [dq, da_k, db_k, da_v, db_v] = backward_op.call(
        grad_or_zeros(grads[0], s[0]), unsaved(grads[1]), s[0], s[1], s[2], s[3], s[4], s[5],
        d.at("scale").toOptional<double>(), d.at("k_scale").toOptional<double>(),
        d.at("v_scale").toOptional<double>());
    variable_list result{dq, da_k, db_k, da_v, db_v};
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

std::tuple<Tensor, Tensor> tpa_decode_attention_autograd(
    const Tensor& q, const Tensor& a_k, const Tensor& b_k, const Tensor& a_v, const Tensor& b_v,
    const Tensor& cache_seqlens, optional<double> scale, optional<double> k_scale,
    optional<double> v_scale) {
  if (!records_graph(q, a_k, b_k, a_v, b_v)) {
    return call_below_autograd(decode_op(), q, a_k, b_k, a_v, b_v, cache_seqlens, scale, k_scale,
                               v_scale);
  }
  auto r = DecodeFunction::apply(q, a_k, b_k, a_v, b_v, cache_seqlens, scale, k_scale, v_scale);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, Autograd, m) {
  m.impl("tpa_expand", &tpa_expand_autograd);
  m.impl("tpa_decode_attention", &tpa_decode_attention_autograd);
}

}  // namespace attn_ext
