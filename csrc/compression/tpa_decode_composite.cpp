// tpa_decode_attention written with ATen ops: the backward on every device, and the forward
// on every device but CPU (CUDA included) until a fused kernel exists. It materializes the
// (B, H, S, N) scores and the (B, N, R, H, S) factor products, which the CPU forward
// (compression/cpu/tpa_decode.cpp) never does; decoding steps have S = 1, so that is N x H
// values per sequence.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "common/tensors.h"
#include "compression/tpa_inputs.h"

namespace attn_ext {
namespace {

struct Factors {
  at::Tensor q, a_k, b_k, a_v, b_v;  // in the compute type
  at::Tensor qb;                     // (B, N, R_K, H, S): b_k[t, r] . q[h, i]
  at::Tensor p;                      // (B, H, S, N) probabilities, 0 where masked / empty rows
  at::Tensor lse;                    // (B, H, S) natural log, -inf for empty rows
  double score_scale = 1.0, v_scale = 1.0;
};

Factors probabilities(const PreparedTpaDecode& in) {
  const TpaDecodeParams& p = in.params;
  const auto acc = at::toOpMathType(in.q.scalar_type());
  Factors f;
  f.q = in.q.to(acc), f.a_k = in.a_k.to(acc), f.b_k = in.b_k.to(acc);
  f.a_v = in.a_v.to(acc), f.b_v = in.b_v.to(acc);
  f.score_scale = p.scale * p.k_scale;
  f.v_scale = p.v_scale;
  f.qb = at::einsum("bnrd,bhsd->bnrhs", {f.b_k, f.q});
  at::Tensor s = at::einsum("bnrh,bnrhs->bhsn", {f.a_k, f.qb}).mul_(f.score_scale);
  // query i of sequence b sees tokens t <= lengths[b] - S + i
  const auto idx = in.lengths.options();
  const at::Tensor last = in.lengths.unsqueeze(1) - p.seqlen_q + at::arange(p.seqlen_q, idx);
  const at::Tensor visible = at::arange(p.tokens, idx).view({1, 1, -1}) <= last.unsqueeze(2);
  s.masked_fill_(visible.logical_not().unsqueeze(1), -std::numeric_limits<double>::infinity());
  f.lse = at::logsumexp(s, -1);
  // Only a row that sees no token (lse -inf) gives 0: a NaN or inf score propagates as the
  // reference's softmax does, so a non-finite input is never turned into a finite output.
  const at::Tensor empty = at::isneginf(f.lse).unsqueeze(-1);
  f.p = at::where(empty, at::zeros({}, s.options()), (s - f.lse.unsqueeze(-1)).exp_());
  return f;
}

std::tuple<at::Tensor, at::Tensor> tpa_decode_attention_composite(
    const at::Tensor& q, const at::Tensor& a_k, const at::Tensor& b_k, const at::Tensor& a_v,
    const at::Tensor& b_v, const at::Tensor& cache_seqlens, std::optional<double> scale,
    std::optional<double> k_scale, std::optional<double> v_scale) {
  constexpr const char* kOp = "attn_ext.tpa_decode_attention";
  const PreparedTpaDecode in = prepare_tpa_decode(kOp, q, a_k, b_k, a_v, b_v, cache_seqlens, scale,
                                                  k_scale, v_scale, q.is_cpu());
  const Factors f = probabilities(in);
  const at::Tensor w = at::einsum("bhsn,bnrh->bnrhs", {f.p, f.a_v}).mul_(f.v_scale);
  const at::Tensor out = at::einsum("bnrhs,bnrd->bhsd", {w, f.b_v});
  return {out.to(q.scalar_type()).contiguous(), f.lse.to(at::kFloat)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
tpa_decode_attention_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                              const at::Tensor& q, const at::Tensor& a_k, const at::Tensor& b_k,
                              const at::Tensor& a_v, const at::Tensor& b_v,
                              const at::Tensor& cache_seqlens, std::optional<double> scale,
                              std::optional<double> k_scale, std::optional<double> v_scale) {
  constexpr const char* kOp = "attn_ext.tpa_decode_attention_backward";
  const PreparedTpaDecode in = prepare_tpa_decode(kOp, q, a_k, b_k, a_v, b_v, cache_seqlens, scale,
                                                  k_scale, v_scale, q.is_cpu());
  const TpaDecodeParams& prm = in.params;
  const std::vector<int64_t> o_shape{prm.batch, prm.heads, prm.seqlen_q, prm.head_dim};
  check_companion(kOp, "grad_out", grad_out, q, o_shape, q.scalar_type());
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if (has_glse) {
    check_companion(kOp, "grad_lse", *grad_lse, q, {prm.batch, prm.heads, prm.seqlen_q},
                    at::kFloat);
  }
  const Factors f = probabilities(in);
  const at::Tensor go = grad_out.to(f.q.scalar_type());
  // out = sum_{t,r} w b_v with w[t, r, h, i] = v_scale p[h, i, t] a_v[t, r, h]
  const at::Tensor u = at::einsum("bhsd,bnrd->bnrhs", {go, f.b_v});  // d out / d w
  const at::Tensor w = at::einsum("bhsn,bnrh->bnrhs", {f.p, f.a_v}).mul_(f.v_scale);
  const at::Tensor grad_bv = at::einsum("bnrhs,bhsd->bnrd", {w, go});
  const at::Tensor grad_av = at::einsum("bhsn,bnrhs->bnrh", {f.p, u}).mul_(f.v_scale);
  const at::Tensor dp = at::einsum("bnrh,bnrhs->bhsn", {f.a_v, u}).mul_(f.v_scale);
  // softmax backward; an lse gradient enters as ds += p * grad_lse (d lse / d s = p)
  at::Tensor shift = (f.p * dp).sum(-1, true);
  if (has_glse) shift = shift - grad_lse->to(shift.scalar_type()).unsqueeze(-1);
  const at::Tensor ds = f.p * (dp - shift);
  // s[h, i, t] = score_scale sum_r a_k[t, r, h] qb[t, r, h, i]
  const at::Tensor grad_ak = at::einsum("bhsn,bnrhs->bnrh", {ds, f.qb}).mul_(f.score_scale);
  const at::Tensor dqb = at::einsum("bhsn,bnrh->bnrhs", {ds, f.a_k}).mul_(f.score_scale);
  const at::Tensor grad_q = at::einsum("bnrhs,bnrd->bhsd", {dqb, f.b_k});
  const at::Tensor grad_bk = at::einsum("bnrhs,bhsd->bnrd", {dqb, f.q});
  // contiguous in the inputs' shapes (the fake kernel's promise)
  const auto cast = [&](const at::Tensor& t) { return t.to(q.scalar_type()).contiguous(); };
  return {cast(grad_q), cast(grad_ak), cast(grad_bk), cast(grad_av), cast(grad_bv)};
}

}  // namespace

// ATen ops only: one registration serves every device. The CPU forward kernel
// (compression/cpu/tpa_decode.cpp) is a backend registration, which wins over this one on CPU;
// every other device, CUDA included, runs this forward. Because the CUDA key gets it in every
// build, the CPU-only suite runs it on CPU tensors by redispatching to the CUDA key.
TORCH_LIBRARY_IMPL(attn_ext, CompositeExplicitAutograd, m) {
  m.impl("tpa_decode_attention", &tpa_decode_attention_composite);
  m.impl("tpa_decode_attention_backward", &tpa_decode_attention_backward);
}

}  // namespace attn_ext
