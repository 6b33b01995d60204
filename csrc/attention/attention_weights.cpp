// attention_weights: the probability matrix itself (the ops that materialize Sq x Sk), for
// diagnostics and modules that must return weights; attention_probabilities: the same matrix
// from the lse of an attention call; the softmax backward of both. Written with ATen ops, so one
// implementation serves every device; the CPU runs its own kernels (cpu/flash_fwd.cpp for the two
// forwards, cpu/weights_bwd.cpp for the backward). The band comes from the shared LocalBand.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "attention/inputs.h"
#include "common/mask.h"

namespace attn_ext {
namespace {

// (B, H, Sq, Sk) scores in acc_t of q @ k^T, GQA by viewing q as (B, Hkv, G, Sq, D).
at::Tensor grouped_scores(const at::Tensor& q, const at::Tensor& k, double scale) {
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), Sq = q.size(2), Sk = k.size(2);
  const at::ScalarType acc = at::toOpMathType(q.scalar_type());
  const at::Tensor qg = q.to(acc).reshape({B, Hkv, H / Hkv, Sq, q.size(3)});
  const at::Tensor kg = k.to(acc).unsqueeze(2).transpose(-1, -2);
  at::Tensor s = at::empty({B, Hkv, H / Hkv, Sq, Sk}, q.options().dtype(acc));
  at::matmul_out(s, qg, kg);
  return s.mul_(scale).reshape({B, H, Sq, Sk});
}

// |i + key_offset - j| (Sq, Sk) in acc_t: the distances ALiBi scales (score_mod.h).
at::Tensor alibi_distances(const AttentionParams& p, const at::TensorOptions& acc) {
  const auto idx = acc.dtype(at::kLong);
  const at::Tensor center = at::arange(p.seqlen_q, idx).unsqueeze(1) + p.key_offset;
  return (center - at::arange(p.seqlen_k, idx).unsqueeze(0)).abs_().to(acc.dtype());
}

// The scaled scores in acc_t with the score modifiers (score_mod.h: softcap, then ALiBi), the
// band and the mask applied (-inf where masked).
at::Tensor masked_scores(const PreparedInputs& in, const at::Tensor& q) {
  const AttentionParams& p = in.params;
  at::Tensor s = grouped_scores(in.q, in.k, p.scale);
  if (p.softcap > 0.0) s.div_(p.softcap).tanh_().mul_(p.softcap);
  if (in.alibi_slopes.defined()) {
    // slopes (B or 1, H) as the kernels read them: s -= slope[b, h] * |i + key_offset - j|
    const at::Tensor slopes =
        in.alibi_slopes.to(s.scalar_type()).reshape({-1, p.heads}).unsqueeze(-1).unsqueeze(-1);
    s.sub_(slopes * alibi_distances(p, s.options()));
  }
  const auto neg_inf = -std::numeric_limits<double>::infinity();
  if (p.window_left >= 0 || p.window_right >= 0) {
    const LocalBand band{p.key_offset, p.window_left, p.window_right};
    const auto idx = q.options().dtype(at::kLong);
    const at::Tensor center = at::arange(p.seqlen_q, idx).unsqueeze(1) + band.key_offset;
    const at::Tensor j = at::arange(p.seqlen_k, idx).unsqueeze(0);
    at::Tensor allowed = at::ones({p.seqlen_q, p.seqlen_k}, q.options().dtype(at::kBool));
    if (band.has_left()) allowed = allowed.logical_and(j >= center - band.left);
    if (band.has_right()) allowed = allowed.logical_and(j <= center + band.right);
    s.masked_fill_(allowed.logical_not(), neg_inf);
  }
  if (in.mask.defined()) {
    if (in.mask.scalar_type() == at::kBool) {
      s.masked_fill_(in.mask.logical_not(), neg_inf);
    } else {
      s.add_(in.mask);
    }
  }
  return s;
}

// The log-sum-exp l (B, H, Sq, 1) of a row's scores with the head's sink logit added to the
// denominator, when there are sinks.
at::Tensor with_sinks(const at::Tensor& l, const PreparedInputs& in) {
  if (!in.sinks.defined()) return l;
  return at::logaddexp(l, in.sinks.to(l.scalar_type()).view({1, -1, 1, 1}));
}

// e in q's dtype.
at::Tensor in_dtype_of(const at::Tensor& e, const at::Tensor& q) {
  return e.scalar_type() == q.scalar_type() ? e : e.to(q.scalar_type());
}

// d scores -> (grad_q, grad_k) through s = scale q k^T, GQA groups summed, in q's dtype.
std::tuple<at::Tensor, at::Tensor> score_grads(const at::Tensor& ds, const PreparedInputs& in,
                                               const at::Tensor& q, double scale) {
  const AttentionParams& p = in.params;
  const int64_t B = p.batch, H = p.heads, Hkv = p.kv_heads, Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int64_t D = p.head_dim, G = H / Hkv;
  const at::ScalarType acc = ds.scalar_type();
  const at::Tensor dsg = ds.reshape({B, Hkv, G, Sq, Sk});
  const at::Tensor kf = in.k.to(acc).unsqueeze(2);
  const at::Tensor dq = at::matmul(dsg, kf).mul_(scale).reshape({B, H, Sq, D});
  const at::Tensor qg = in.q.to(acc).reshape({B, Hkv, G, Sq, D});
  const at::Tensor dk = at::matmul(dsg.transpose(-1, -2), qg).sum(2).mul_(scale);
  return {dq.to(q.scalar_type()), dk.to(q.scalar_type())};
}

bool has_band_or_mask(const PreparedInputs& in) {
  const AttentionParams& p = in.params;
  return p.window_left >= 0 || p.window_right >= 0 || in.mask.defined();
}

at::Tensor attention_weights_impl(const at::Tensor& q, const at::Tensor& k,
                                  const std::optional<at::Tensor>& attn_mask,
                                  const std::optional<at::Tensor>& alibi_slopes,
                                  const std::optional<at::Tensor>& sinks,
                                  std::optional<double> scale, bool causal, int64_t window_left,
                                  int64_t window_right, std::optional<int64_t> key_offset,
                                  double softcap) {
  constexpr const char* kOp = "attn_ext.attention_weights";
  PreparedInputs in =
      prepare_probabilities(kOp, q, k,
                            weights_options(attn_mask, scale, causal, window_left, window_right,
                                            key_offset, softcap, alibi_slopes, sinks));
  const AttentionParams& p = in.params;
  const int64_t B = p.batch, H = p.heads, Sq = p.seqlen_q, Sk = p.seqlen_k;
  if (B * H * Sq * Sk == 0 || p.kv_heads == 0) return at::zeros({B, H, Sq, Sk}, q.options());
  const at::Tensor s = masked_scores(in, q);
  if (in.sinks.defined()) {
    // The sink joins each row's denominator: P = exp(s - lse) with lse counting exp(sink); a
    // row that saw no key has lse = sink and P = 0.
    const at::Tensor l = with_sinks(at::logsumexp(s, -1, true), in);
    return in_dtype_of(s.sub(l).exp_(), q);
  }
  // ATen's fused softmax (one kernel, no temporaries); rows that a mask or band left without
  // a key come out of it as NaN and are set to 0. Only masks can empty a row, so unmasked
  // scores skip the row-max pass, and NaN from the inputs propagates either way.
  at::Tensor e = at::empty_like(s);
  at::_softmax_out(e, s, -1, false);
  if (has_band_or_mask(in)) {
    e.masked_fill_(std::get<0>(s.max(-1, true)) == -std::numeric_limits<double>::infinity(), 0.0);
  }
  return in_dtype_of(e, q);
}

std::tuple<at::Tensor, at::Tensor> attention_weights_backward_impl(
    const at::Tensor& grad_weights, const at::Tensor& weights, const at::Tensor& q,
    const at::Tensor& k, std::optional<double> scale, double softcap) {
  constexpr const char* kOp = "attn_ext.attention_weights_backward";
  PreparedInputs in = prepare_probabilities_backward(kOp, grad_weights, weights, q, k, softcap);
  const AttentionParams& p = in.params;
  const int64_t B = p.batch, H = p.heads, Sq = p.seqlen_q, Sk = p.seqlen_k;
  const double sc = scale.has_value() ? *scale : p.scale;
  if (B * H * Sq * Sk == 0 || p.kv_heads == 0) return {at::zeros_like(q), at::zeros_like(k)};
  const at::ScalarType acc = at::toOpMathType(q.scalar_type());
  // dS = P * (dP - rowsum(dP * P)) by ATen's fused softmax backward (one Sq x Sk result, no
  // temporaries; rows emptied by a mask have P = 0 and so dS = 0), then the two products of
  // the score matmul.
  at::Tensor ds = at::empty({B, H, Sq, Sk}, q.options().dtype(acc));
  at::_softmax_backward_data_out(ds, grad_weights.to(acc), weights.to(acc), -1, acc);
  if (softcap > 0.0) {
    // Through c = softcap tanh(s / softcap): dc/ds = 1 - tanh^2, on the recomputed scores.
    const at::Tensor t = grouped_scores(in.q, in.k, sc).div_(softcap).tanh_();
    ds.mul_(t.mul_(t).neg_().add_(1.0));
  }
  return score_grads(ds, in, q, sc);
}

// attention_probabilities on any device with ATen ops (the CPU has its own kernel,
// cpu/flash_fwd.cpp): the masked scores against the given lse.
at::Tensor attention_probabilities_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    std::optional<int64_t> key_offset, double dropout_p, bool mean_heads, double softcap) {
  constexpr const char* kOp = "attn_ext.attention_probabilities";
  PreparedInputs in =
      prepare_probabilities(kOp, q, k, lse,
                            {attn_mask, scale, causal, window_left, window_right, key_offset,
                             dropout_p, rng_state, softcap, alibi_slopes, sinks});
  const AttentionParams& p = in.params;
  const int64_t B = p.batch, H = p.heads, Sq = p.seqlen_q, Sk = p.seqlen_k;
  if (B * H * Sq * Sk == 0 || p.kv_heads == 0) {
    return mean_heads ? at::zeros({B, Sq, Sk}, q.options())
                      : at::zeros({B, H, Sq, Sk}, q.options());
  }
  at::Tensor s = masked_scores(in, q);
  // fp64 recomputes the lse in fp64, as the CPU kernel and attention's backward do (the
  // float32 lse would cap the probabilities at ~1e-7 relative error).
  const at::Tensor l = q.scalar_type() == at::kDouble ? with_sinks(at::logsumexp(s, -1, true), in)
                                                      : lse.to(s.scalar_type()).unsqueeze(-1);
  s.sub_(l).exp_();
  // A row that saw no key (lse -inf) has only -inf scores: -inf - -inf is NaN, its P is 0.
  s.masked_fill_(l == -std::numeric_limits<double>::infinity(), 0.0);
  if (p.dropout_p > 0.0) {
    // The attention kernels' mask for this rng_state (dropout_mask: generated on the CPU).
    static const auto mask_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("attn_ext::dropout_mask", "")
                                    .typed<at::Tensor(const at::Tensor&, c10::SymInt, c10::SymInt,
                                                      c10::SymInt, c10::SymInt, double)>();
    const at::Tensor keep = mask_op.call(*rng_state, B, H, Sq, Sk, dropout_p).to(s.device());
    s.masked_fill_(keep.logical_not(), 0.0).mul_(1.0 / (1.0 - dropout_p));
  }
  return in_dtype_of(mean_heads ? s.mean(1) : s, q);
}

}  // namespace

// ATen ops only: one registration serves every device (csrc/README.md, "Registering kernels").
TORCH_LIBRARY_IMPL(attn_ext, CompositeExplicitAutograd, m) {
  m.impl("attention_weights", &attention_weights_impl);
  m.impl("attention_weights_backward", &attention_weights_backward_impl);
  m.impl("attention_probabilities", &attention_probabilities_impl);
}

}  // namespace attn_ext
