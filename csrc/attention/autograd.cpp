// Autograd of the attention ops (common/autograd.h says why it is C++): attention and
// attention_varlen through their flash backward ops, attention_weights and
// attention_probabilities through the softmax's backward, merge_attention_states through its
// backward op. Saved: the inputs the backward op reads and the forward's outputs; nothing is
// recomputed here but the per-head probabilities of a head mean or dropped weights.
#include <tuple>
#include <ATen/OpMathType.h>
#include <torch/library.h>
#include "common/autograd.h"

namespace attn_ext {
namespace {

using at::Tensor;
using std::optional;
using TensorOpt = optional<Tensor>;

// ALiBi slopes are fixed per head (never trained), and the kernels form no gradient for them:
// refusing beats returning none, which autograd would read as a zero gradient.
void refuse_slopes_grad(const char* op, const TensorOpt& alibi_slopes) {
  TORCH_CHECK_NOT_IMPLEMENTED(!alibi_slopes.has_value() || !alibi_slopes->requires_grad(), op,
                              ": the gradient with respect to alibi_slopes is not supported; "
                              "pass alibi_slopes.detach()");
}

void refuse_mask_grad(const char* op, const TensorOpt& attn_mask, const char* advice) {
  TORCH_CHECK_NOT_IMPLEMENTED(!attn_mask.has_value() || !attn_mask->requires_grad(), op,
                              ": the gradient with respect to attn_mask is not supported", advice);
}

// ---------------------------------------------------------------------------------- attention

using AttentionSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                const TensorOpt&, const TensorOpt&,
                                                const TensorOpt&, const TensorOpt&,
                                                optional<double>, bool, int64_t, int64_t,
                                                optional<c10::SymInt>, double, double);
using AttentionBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const TensorOpt&, const TensorOpt&, optional<double>, bool, int64_t, int64_t,
    optional<c10::SymInt>, double, const TensorOpt&, const TensorOpt&, const TensorOpt&, double);

const c10::TypedOperatorHandle<AttentionSig>& attention_op() {
  static const auto op = registered_op<AttentionSig>("attn_ext::attention");
  return op;
}

struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  static constexpr size_t kTensorArgs = 7;  // q ... sinks
  static constexpr size_t kFlagArgs = 7;    // scale ... softcap

  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const TensorOpt& attn_mask,
                               const TensorOpt& rng_state, const TensorOpt& alibi_slopes,
                               const TensorOpt& sinks, optional<double> scale, bool causal,
                               int64_t window_left, int64_t window_right,
                               optional<c10::SymInt> key_offset, double dropout_p, double softcap) {
    auto [out, lse] = call_below_autograd(attention_op(), q, k, v, attn_mask, rng_state,
                                          alibi_slopes, sinks, scale, causal, window_left,
                                          window_right, key_offset, dropout_p, softcap);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward(
        {q, k, v, out, lse, saved(attn_mask), saved(rng_state), saved(alibi_slopes), saved(sinks)});
    auto& d = ctx->saved_data;
    d["scale"] = scale;
    d["causal"] = causal;
    d["window_left"] = window_left;
    d["window_right"] = window_right;
    d["key_offset"] = key_offset;
    d["dropout_p"] = dropout_p;
    d["softcap"] = softcap;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        registered_op<AttentionBackwardSig>("attn_ext::attention_backward");
    // Nothing flows back (a loss of the probabilities alone reaches here through lse): no
    // backward on zeros.
    if (!grads[0].defined() && !grads[1].defined()) return variable_list(kTensorArgs + kFlagArgs);
    const variable_list s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4], &sinks = s[8];
    auto [dq, dk, dv, dsinks] =
        backward_op.call(grad_or_zeros(grads[0], out), q, k, v, out, lse, unsaved(grads[1]),
                         unsaved(s[5]), d.at("scale").toOptional<double>(), d.at("causal").toBool(),
                         d.at("window_left").toInt(), d.at("window_right").toInt(),
                         d.at("key_offset").toOptional<c10::SymInt>(), d.at("dropout_p").toDouble(),
                         unsaved(s[6]), unsaved(s[7]), unsaved(sinks), d.at("softcap").toDouble());
    variable_list result{
        dq, dk, dv, Tensor(), Tensor(), Tensor(), sinks.defined() ? dsinks : Tensor()};
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

std::tuple<Tensor, Tensor> attention_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const TensorOpt& attn_mask,
    const TensorOpt& rng_state, const TensorOpt& alibi_slopes, const TensorOpt& sinks,
    optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    optional<c10::SymInt> key_offset, double dropout_p, double softcap) {
  if (!records_graph(q, k, v, attn_mask, alibi_slopes, sinks)) {
    return call_below_autograd(attention_op(), q, k, v, attn_mask, rng_state, alibi_slopes, sinks,
                               scale, causal, window_left, window_right, key_offset, dropout_p,
                               softcap);
  }
  constexpr const char* kOp = "attn_ext.attention";
  refuse_mask_grad(kOp, attn_mask,
                   "; pass attn_mask.detach() or compute the bias gradient separately");
  refuse_slopes_grad(kOp, alibi_slopes);
  auto r = AttentionFunction::apply(q, k, v, attn_mask, rng_state, alibi_slopes, sinks, scale,
                                    causal, window_left, window_right, std::move(key_offset),
                                    dropout_p, softcap);
  return {r[0], r[1]};
}

// --------------------------------------------------------------------------- attention_varlen

using VarlenSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&, const Tensor&, const TensorOpt&,
                                             const TensorOpt&, const TensorOpt&, const TensorOpt&,
                                             c10::SymInt, c10::SymInt, optional<double>, bool,
                                             int64_t, int64_t, double, double);
using VarlenBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const TensorOpt&, c10::SymInt, c10::SymInt, optional<double>,
    bool, int64_t, int64_t, double, const TensorOpt&, const TensorOpt&, const TensorOpt&, double);

const c10::TypedOperatorHandle<VarlenSig>& varlen_op() {
  static const auto op = registered_op<VarlenSig>("attn_ext::attention_varlen");
  return op;
}

struct VarlenFunction : torch::autograd::Function<VarlenFunction> {
  static constexpr size_t kTensorArgs = 8;  // q ... sinks
  static constexpr size_t kFlagArgs = 8;    // max_seqlen_q ... softcap

  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
                               const TensorOpt& rng_state, const TensorOpt& alibi_slopes,
                               const TensorOpt& sinks, c10::SymInt max_q, c10::SymInt max_k,
                               optional<double> scale, bool causal, int64_t window_left,
                               int64_t window_right, double dropout_p, double softcap) {
    auto [out, lse] = call_below_autograd(varlen_op(), q, k, v, cu_q, cu_k, rng_state, alibi_slopes,
                                          sinks, std::nullopt, max_q, max_k, scale, causal,
                                          window_left, window_right, dropout_p, softcap);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward(
        {q, k, v, out, lse, cu_q, cu_k, saved(rng_state), saved(alibi_slopes), saved(sinks)});
    auto& d = ctx->saved_data;
    d["max_seqlen_q"] = std::move(max_q);
    d["max_seqlen_k"] = std::move(max_k);
    d["scale"] = scale;
    d["causal"] = causal;
    d["window_left"] = window_left;
    d["window_right"] = window_right;
    d["dropout_p"] = dropout_p;
    d["softcap"] = softcap;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        registered_op<VarlenBackwardSig>("attn_ext::attention_varlen_backward");
    // Nothing flows back (a loss of the probabilities alone reaches here through lse): no
    // backward on zeros.
    if (!grads[0].defined() && !grads[1].defined()) return variable_list(kTensorArgs + kFlagArgs);
    const variable_list s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const Tensor &out = s[3], &sinks = s[9];
    auto [dq, dk, dv, dsinks] = backward_op.call(
        grad_or_zeros(grads[0], out), s[0], s[1], s[2], out, s[4], s[5], s[6], unsaved(grads[1]),
        d.at("max_seqlen_q").toSymInt(), d.at("max_seqlen_k").toSymInt(),
        d.at("scale").toOptional<double>(), d.at("causal").toBool(), d.at("window_left").toInt(),
        d.at("window_right").toInt(), d.at("dropout_p").toDouble(), unsaved(s[7]), unsaved(s[8]),
        unsaved(sinks), d.at("softcap").toDouble());
    variable_list result{dq,       dk,       dv,       Tensor(),
                         Tensor(), Tensor(), Tensor(), sinks.defined() ? dsinks : Tensor()};
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

std::tuple<Tensor, Tensor> attention_varlen_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
    const TensorOpt& rng_state, const TensorOpt& alibi_slopes, const TensorOpt& sinks,
    const TensorOpt& block_table, c10::SymInt max_q, c10::SymInt max_k, optional<double> scale,
    bool causal, int64_t window_left, int64_t window_right, double dropout_p, double softcap) {
  if (!records_graph(q, k, v, alibi_slopes, sinks)) {
    return call_below_autograd(varlen_op(), q, k, v, cu_q, cu_k, rng_state, alibi_slopes, sinks,
                               block_table, std::move(max_q), std::move(max_k), scale, causal,
                               window_left, window_right, dropout_p, softcap);
  }
  refuse_slopes_grad("attn_ext.attention_varlen", alibi_slopes);
  // FlashAttention's paged varlen forward is inference-only too: its backward would scatter
  // dK / dV into pages that other sequences may share.
  TORCH_CHECK_NOT_IMPLEMENTED(!block_table.has_value() || !block_table->defined(),
                              "attn_ext.attention_varlen: paged k / v (block_table) have no "
                              "backward; gather the pages into (total_k, Hkv, D) rows to train "
                              "through them");
  auto r = VarlenFunction::apply(q, k, v, cu_q, cu_k, rng_state, alibi_slopes, sinks,
                                 std::move(max_q), std::move(max_k), scale, causal, window_left,
                                 window_right, dropout_p, softcap);
  return {r[0], r[1]};
}

// ------------------------------------------------- attention_weights, attention_probabilities

using WeightsSig = Tensor(const Tensor&, const Tensor&, const TensorOpt&, const TensorOpt&,
                          const TensorOpt&, optional<double>, bool, int64_t, int64_t,
                          optional<c10::SymInt>, double);
using WeightsBackwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&, optional<double>, double);
using ProbabilitiesSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const TensorOpt&,
                                const TensorOpt&, const TensorOpt&, const TensorOpt&,
                                optional<double>, bool, int64_t, int64_t, optional<c10::SymInt>,
                                double, bool, double);
using DropoutMaskSig = Tensor(const Tensor&, c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt,
                              double);

const c10::TypedOperatorHandle<WeightsSig>& weights_op() {
  static const auto op = registered_op<WeightsSig>("attn_ext::attention_weights");
  return op;
}
const c10::TypedOperatorHandle<ProbabilitiesSig>& probabilities_op() {
  static const auto op = registered_op<ProbabilitiesSig>("attn_ext::attention_probabilities");
  return op;
}

// dq, dk of the softmax probabilities `weights` = softmax(scores) per head (softcap's tanh is
// the one modifier of q and k with a derivative; slopes and masks are refused with a gradient).
std::tuple<Tensor, Tensor> weights_backward(const Tensor& grad_weights, const Tensor& weights,
                                            const Tensor& q, const Tensor& k,
                                            optional<double> scale, double softcap) {
  static const auto op = registered_op<WeightsBackwardSig>("attn_ext::attention_weights_backward");
  return op.call(grad_weights, weights, q, k, scale, softcap);
}

// d loss / d sinks (H,) of per-head probabilities P (B, H, Sq, Sk) whose softmax counted a sink
// logit: dP_ij / d sink = -P_ij P_sink,i with the sink's share P_sink,i = 1 - sum_j P_ij, so
// the gradient is -sum over (b, i) of P_sink,i * delta_i, delta_i = sum_j P_ij dP_ij (the
// softmax backward's row term), in the accumulation type. Undefined without sinks to train.
Tensor sinks_grad(const Tensor& grad_weights, const Tensor& weights, const Tensor& sinks) {
  if (!sinks.defined() || !sinks.requires_grad()) return Tensor();
  const Tensor p = weights.to(at::toOpMathType(weights.scalar_type()));
  const Tensor delta = p.mul(grad_weights.to(p.scalar_type())).sum(-1);
  const Tensor share = p.sum(-1).neg_().add_(1.0);
  return share.mul_(delta).sum(at::IntArrayRef{0, 2}).neg_().to(sinks.scalar_type());
}

struct WeightsFunction : torch::autograd::Function<WeightsFunction> {
  static constexpr size_t kFlagArgs = 6;  // scale ... softcap

  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                        const TensorOpt& attn_mask, const TensorOpt& alibi_slopes,
                        const TensorOpt& sinks, optional<double> scale, bool causal,
                        int64_t window_left, int64_t window_right, optional<c10::SymInt> key_offset,
                        double softcap) {
    Tensor weights =
        call_below_autograd(weights_op(), q, k, attn_mask, alibi_slopes, sinks, scale, causal,
                            window_left, window_right, std::move(key_offset), softcap);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, weights, saved(sinks)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["softcap"] = softcap;
    return weights;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(5);
    if (grads[0].defined()) {
      const variable_list s = ctx->get_saved_variables();
      const auto& d = ctx->saved_data;
      std::tie(result[0], result[1]) =
          weights_backward(grads[0], s[2], s[0], s[1], d.at("scale").toOptional<double>(),
                           d.at("softcap").toDouble());
      result[4] = sinks_grad(grads[0], s[2], s[3]);
    }
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

Tensor attention_weights_autograd(const Tensor& q, const Tensor& k, const TensorOpt& attn_mask,
                                  const TensorOpt& alibi_slopes, const TensorOpt& sinks,
                                  optional<double> scale, bool causal, int64_t window_left,
                                  int64_t window_right, optional<c10::SymInt> key_offset,
                                  double softcap) {
  if (!records_graph(q, k, attn_mask, alibi_slopes, sinks)) {
    return call_below_autograd(weights_op(), q, k, attn_mask, alibi_slopes, sinks, scale, causal,
                               window_left, window_right, std::move(key_offset), softcap);
  }
  constexpr const char* kOp = "attn_ext.attention_weights";
  refuse_mask_grad(kOp, attn_mask, "");
  refuse_slopes_grad(kOp, alibi_slopes);
  return WeightsFunction::apply(q, k, attn_mask, alibi_slopes, sinks, scale, causal, window_left,
                                window_right, std::move(key_offset), softcap);
}

// Differentiated as the softmax of the scores: lse is the scores' own log-sum-exp, so it takes
// no gradient (a float32 lse gradient would also cap float64 at ~1e-7).
struct ProbabilitiesFunction : torch::autograd::Function<ProbabilitiesFunction> {
  static constexpr size_t kFlagArgs = 8;  // scale ... softcap

  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& lse,
                        const TensorOpt& attn_mask, const TensorOpt& rng_state,
                        const TensorOpt& alibi_slopes, const TensorOpt& sinks,
                        optional<double> scale, bool causal, int64_t window_left,
                        int64_t window_right, optional<c10::SymInt> key_offset, double dropout_p,
                        bool mean_heads, double softcap) {
    Tensor weights = call_below_autograd(probabilities_op(), q, k, lse, attn_mask, rng_state,
                                         alibi_slopes, sinks, scale, causal, window_left,
                                         window_right, key_offset, dropout_p, mean_heads, softcap);
    ctx->set_materialize_grads(false);
    // The backward takes the per-head probabilities before dropout: the output itself, or (for
    // a mean over heads, or dropped weights) what recomputes them.
    const bool recomputes = mean_heads || dropout_p > 0.0;
    if (recomputes) {
      ctx->save_for_backward(
          {q, k, lse, saved(attn_mask), saved(rng_state), saved(alibi_slopes), saved(sinks)});
    } else {
      ctx->save_for_backward({q, k, weights, saved(sinks)});
    }
    auto& d = ctx->saved_data;
    d["scale"] = scale;
    d["causal"] = causal;
    d["window_left"] = window_left;
    d["window_right"] = window_right;
    d["key_offset"] = std::move(key_offset);
    d["dropout_p"] = dropout_p;
    d["mean_heads"] = mean_heads;
    d["softcap"] = softcap;
    return weights;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(7);
    if (grads[0].defined()) {
      const variable_list s = ctx->get_saved_variables();
      const auto& d = ctx->saved_data;
      const optional<double> scale = d.at("scale").toOptional<double>();
      const double softcap = d.at("softcap").toDouble();
      const bool mean_heads = d.at("mean_heads").toBool();
      const double p = d.at("dropout_p").toDouble();
      Tensor grad = grads[0];
      Tensor weights;
      if (mean_heads || p > 0.0) {
        weights = probabilities_op().call(
            s[0], s[1], s[2], unsaved(s[3]), std::nullopt, unsaved(s[5]), unsaved(s[6]), scale,
            d.at("causal").toBool(), d.at("window_left").toInt(), d.at("window_right").toInt(),
            d.at("key_offset").toOptional<c10::SymInt>(), 0.0, false, softcap);
        if (mean_heads) {  // d mean_h P_h / d P_h = 1 / H for every head
          grad = grad.div(c10::Scalar(s[0].sym_size(1)))
                     .unsqueeze(1)
                     .expand_symint(weights.sym_sizes());
        }
        if (p > 0.0) {  // the dropped P_h is P_h * keep / (1 - p)
          static const auto mask_op = registered_op<DropoutMaskSig>("attn_ext::dropout_mask");
          const auto shape = weights.sym_sizes();
          Tensor keep =
              mask_op.call(s[4], shape[0], shape[1], shape[2], shape[3], p).to(weights.device());
          grad = grad.mul(keep.to(grad.scalar_type())).mul(1.0 / (1.0 - p));
        }
      } else {
        weights = s[2];
      }
      std::tie(result[0], result[1]) = weights_backward(grad, weights, s[0], s[1], scale, softcap);
      result[6] = sinks_grad(grad, weights, s.back());  // the sinks are saved last
    }
    append_no_grads(result, kFlagArgs);
    return result;
  }
};

Tensor attention_probabilities_autograd(const Tensor& q, const Tensor& k, const Tensor& lse,
                                        const TensorOpt& attn_mask, const TensorOpt& rng_state,
                                        const TensorOpt& alibi_slopes, const TensorOpt& sinks,
                                        optional<double> scale, bool causal, int64_t window_left,
                                        int64_t window_right, optional<c10::SymInt> key_offset,
                                        double dropout_p, bool mean_heads, double softcap) {
  if (!records_graph(q, k, attn_mask, alibi_slopes, sinks)) {
    return call_below_autograd(probabilities_op(), q, k, lse, attn_mask, rng_state, alibi_slopes,
                               sinks, scale, causal, window_left, window_right,
                               std::move(key_offset), dropout_p, mean_heads, softcap);
  }
  constexpr const char* kOp = "attn_ext.attention_probabilities";
  refuse_mask_grad(kOp, attn_mask, "");
  refuse_slopes_grad(kOp, alibi_slopes);
  // lse takes no gradient: detached, so that a loss of the probabilities alone does not run
  // the backward of the attention call that returned it (on zeros).
  return ProbabilitiesFunction::apply(q, k, lse.detach(), attn_mask, rng_state, alibi_slopes, sinks,
                                      scale, causal, window_left, window_right,
                                      std::move(key_offset), dropout_p, mean_heads, softcap);
}

// --------------------------------------------------------------------- merge_attention_states

using MergeSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&);
using MergeBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const TensorOpt&,
                                                                    const Tensor&, const Tensor&,
                                                                    const Tensor&, const Tensor&);

const c10::TypedOperatorHandle<MergeSig>& merge_op() {
  static const auto op = registered_op<MergeSig>("attn_ext::merge_attention_states");
  return op;
}

struct MergeFunction : torch::autograd::Function<MergeFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& out_a, const Tensor& lse_a,
                               const Tensor& out_b, const Tensor& lse_b) {
    auto [out, lse] = call_below_autograd(merge_op(), out_a, lse_a, out_b, lse_b);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({out_a, lse_a, out_b, lse_b});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        registered_op<MergeBackwardSig>("attn_ext::merge_attention_states_backward");
    const variable_list s = ctx->get_saved_variables();
    auto [d_out_a, d_lse_a, d_out_b, d_lse_b] =
        backward_op.call(grad_or_zeros(grads[0], s[0]), unsaved(grads[1]), s[0], s[1], s[2], s[3]);
    return {d_out_a, d_lse_a, d_out_b, d_lse_b};
  }
};

std::tuple<Tensor, Tensor> merge_attention_states_autograd(const Tensor& out_a, const Tensor& lse_a,
                                                           const Tensor& out_b,
                                                           const Tensor& lse_b) {
  if (!records_graph(out_a, lse_a, out_b, lse_b)) {
    return call_below_autograd(merge_op(), out_a, lse_a, out_b, lse_b);
  }
  auto r = MergeFunction::apply(out_a, lse_a, out_b, lse_b);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("attention_varlen", &attention_varlen_autograd);
  m.impl("attention_weights", &attention_weights_autograd);
  m.impl("attention_probabilities", &attention_probabilities_autograd);
  m.impl("merge_attention_states", &merge_attention_states_autograd);
}

}  // namespace attn_ext
