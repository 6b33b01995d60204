// linear_attention and its backward written with ATen ops: the implementation on every device
// but CPU, and on CUDA wherever the fused kernels (linear/cuda/) do not run (all of it while
// they are unverified, see linear/cuda/linear_attention_cuda.cpp). The math is the CPU kernel's
// (linear/cpu/linear_attention_cpu.cpp):
// values get a column of ones (v' = [v, 1], width Dp = Dv + 1), so the state (S, z) is one
// D x Dp matrix and the denominator is the last column of phi(q) S'. Causal attention runs in
// chunks of kCausalChunk: the masked C x C product inside a chunk, the exclusive prefix of the
// chunk states between chunks. Memory is O(S (D + Dp) + (S / C) D Dp), never S x S.
//
// It is plain ATen, so it is registered once for every device (CompositeExplicitAutograd); the
// CPU kernel (linear/cpu/linear_attention_cpu.cpp) is a backend registration and wins on CPU.
// The CUDA key reaches this composite in every build (a CUDA build's wrapper calls it for CPU
// tensors and whatever its kernels do not serve), so the CPU-only test suite runs this very
// code on CPU tensors by redispatching to the CUDA key.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "linear/linear_attention_composite.h"

#include "linear/feature_map.h"
#include "linear/linear_inputs.h"

namespace attn_ext::linear {
namespace {

using at::indexing::Slice;

at::Tensor feature_rows(const at::Tensor& x, FeatureMap f) {
  switch (f) {
    case FeatureMap::kEluPlusOne:
      return at::where(x > 0, x + 1, at::exp(x));
    case FeatureMap::kRelu:
      return at::relu(x);
    case FeatureMap::kIdentity:
      return x;
  }
  TORCH_CHECK(false, "attn_ext.linear_attention: unknown feature map ", static_cast<int>(f));
}

// d phi / d x from phi itself, as feature_grad_from_value (feature_map.h).
at::Tensor feature_grad(const at::Tensor& phi, FeatureMap f) {
  switch (f) {
    case FeatureMap::kEluPlusOne:
      return at::where(phi > 1, at::ones_like(phi), phi);
    case FeatureMap::kRelu:
      return (phi > 0).to(phi.scalar_type());
    case FeatureMap::kIdentity:
      return at::ones_like(phi);
  }
  TORCH_CHECK(false, "attn_ext.linear_attention_backward: unknown feature map ",
              static_cast<int>(f));
}

// (B, H, D, Dv) and (B, H, D) as one (B, H, D, Dp) state; zeros where absent.
at::Tensor packed_state(const at::Tensor& kv, const at::Tensor& k, const LinearAttentionParams& p,
                        const at::TensorOptions& acc) {
  if (!kv.defined()) return at::zeros({p.batch, p.heads, p.head_dim, p.head_dim_v + 1}, acc);
  return at::cat({kv, k.unsqueeze(-1)}, -1);
}

// The forward's operands in the compute type: features, [v, 1], and the packed initial state.
struct Operands {
  at::Tensor phiq, phik, v1, init;  // (B, H, Sq, D), (B, H, Sk, D), (B, H, Sk, Dp), (B, H, D, Dp)
};

Operands operands(const LinearInputs& in) {
  const LinearAttentionParams& p = in.params;
  const auto acc = in.q.options().dtype(at::toOpMathType(in.q.scalar_type()));
  Operands o;
  o.phiq = feature_rows(in.q.to(acc.dtype()), p.feature_map);
  o.phik = feature_rows(in.k.to(acc.dtype()), p.feature_map);
  o.v1 = at::cat({in.v.to(acc.dtype()), at::ones({p.batch, p.heads, p.seqlen_k, 1}, acc)}, -1);
  o.init = packed_state(in.initial_kv, in.initial_k, p, acc);
  return o;
}

// (B, H, L, X) -> (B, H, N, C, X), zero-padded to N * C rows.
at::Tensor chunked(const at::Tensor& x, int64_t n_chunks) {
  const int64_t pad = n_chunks * kCausalChunk - x.size(2);
  const at::Tensor padded = pad > 0 ? at::constant_pad_nd(x, {0, 0, 0, pad}) : x;
  return padded.reshape({x.size(0), x.size(1), n_chunks, kCausalChunk, x.size(3)});
}

// (B, H, N, C, X) -> (B, H, L, X)
at::Tensor unchunked(const at::Tensor& x, int64_t length) {
  return x.reshape({x.size(0), x.size(1), x.size(2) * x.size(3), x.size(4)}).narrow(2, 0, length);
}

// Along the chunk dimension (2) of (B, H, N, D, Dp): the sum of the chunks before each one, and
// of the chunks after it. Formed from the shifted cumulative sum, never as (inclusive sum - own
// term): with an infinite state that difference is inf - inf = NaN where the quadratic form
// (and the CPU kernel) give inf.
at::Tensor exclusive_prefix(const at::Tensor& x) {
  const int64_t n = x.size(2);
  if (n == 0) return x;
  return at::constant_pad_nd(at::cumsum(x.narrow(2, 0, n - 1), 2), {0, 0, 0, 0, 1, 0});
}
at::Tensor exclusive_suffix(const at::Tensor& x) {
  const int64_t n = x.size(2);
  if (n == 0) return x;
  const at::Tensor later = x.narrow(2, 1, n - 1).flip(2);
  return at::constant_pad_nd(at::cumsum(later, 2).flip(2), {0, 0, 0, 0, 0, 1});
}

struct Forward {
  at::Tensor nd;      // (B, H, Sq, Dp): phi(q) S' per row, numerator and denominator
  at::Tensor final;   // (B, H, D, Dp)
  at::Tensor prefix;  // causal: (B, H, N, D, Dp) state each chunk starts from
};

Forward forward(const LinearAttentionParams& p, const Operands& o) {
  Forward f;
  if (!p.causal) {
    f.final = o.init + at::matmul(o.phik.transpose(-1, -2), o.v1);
    f.nd = at::matmul(o.phiq, f.final);
    return f;
  }
  const int64_t L = p.seqlen_q, n = (L + kCausalChunk - 1) / kCausalChunk;
  const at::Tensor q_c = chunked(o.phiq, n), k_c = chunked(o.phik, n), v_c = chunked(o.v1, n);
  const at::Tensor states = at::matmul(k_c.transpose(-1, -2), v_c);  // padded rows add 0
  f.prefix = o.init.unsqueeze(2) + exclusive_prefix(states);
  f.final = o.init + states.sum(2);
  const at::Tensor a = at::tril(at::matmul(q_c, k_c.transpose(-1, -2)));  // keys j <= i
  f.nd = unchunked(at::matmul(a, v_c) + at::matmul(q_c, f.prefix), L);
  return f;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_composite(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_state_kv,
    const std::optional<at::Tensor>& initial_state_k, bool causal, double eps,
    c10::string_view feature_map) {
  const LinearInputs in =
      prepare_linear_attention("attn_ext.linear_attention", q, k, v, initial_state_kv,
                               initial_state_k, causal, eps, feature_map);
  const LinearAttentionParams& p = in.params;
  const int64_t Dv = p.head_dim_v;
  const Forward f = forward(p, operands(in));
  const at::Tensor den = f.nd.narrow(-1, Dv, 1) + eps;
  const at::Tensor out = (f.nd.narrow(-1, 0, Dv) / den).to(q.scalar_type()).contiguous();
  return {out, f.final.narrow(-1, 0, Dv).contiguous(), f.final.select(-1, Dv).contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_attention_backward_composite(const at::Tensor& grad_out, const at::Tensor& q,
                                    const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& initial_state_kv,
                                    const std::optional<at::Tensor>& initial_state_k,
                                    const std::optional<at::Tensor>& grad_state_kv,
                                    const std::optional<at::Tensor>& grad_state_k, bool causal,
                                    double eps, c10::string_view feature_map) {
  const LinearBackwardInputs in = prepare_linear_attention_backward(
      "attn_ext.linear_attention_backward", grad_out, q, k, v, initial_state_kv, initial_state_k,
      grad_state_kv, grad_state_k, causal, eps, feature_map);
  const LinearAttentionParams& p = in.fwd.params;
  const int64_t Dv = p.head_dim_v;
  const auto acc = q.options().dtype(at::toOpMathType(q.scalar_type()));
  const Operands o = operands(in.fwd);
  const Forward f = forward(p, o);

  // d(num / den): the numerator columns get g / den, the ones column -(g . out) / den.
  const at::Tensor g = grad_out.to(acc.dtype());
  const at::Tensor den = f.nd.narrow(-1, Dv, 1) + eps;
  const at::Tensor out = f.nd.narrow(-1, 0, Dv) / den;
  const at::Tensor dnd = at::cat({g / den, -(g * out).sum(-1, true) / den}, -1);  // (B, H, Sq, Dp)
  const at::Tensor grad_final = packed_state(in.grad_final_kv, in.grad_final_k, p, acc);

  at::Tensor dphiq, dphik, dv1, grad_init;
  if (!p.causal) {
    const at::Tensor ds = at::matmul(o.phiq.transpose(-1, -2), dnd) + grad_final;
    dphiq = at::matmul(dnd, f.final.transpose(-1, -2));
    dphik = at::matmul(o.v1, ds.transpose(-1, -2));
    dv1 = at::matmul(o.phik, ds);
    grad_init = ds;
  } else {
    const int64_t L = p.seqlen_q, n = (L + kCausalChunk - 1) / kCausalChunk;
    const at::Tensor q_c = chunked(o.phiq, n), k_c = chunked(o.phik, n), v_c = chunked(o.v1, n);
    const at::Tensor dnd_c = chunked(dnd, n);
    // inside a chunk: nd = tril(Q K^T) V'
    const at::Tensor a = at::tril(at::matmul(q_c, k_c.transpose(-1, -2)));
    const at::Tensor da = at::tril(at::matmul(dnd_c, v_c.transpose(-1, -2)));
    at::Tensor dq_c = at::matmul(da, k_c) + at::matmul(dnd_c, f.prefix.transpose(-1, -2));
    at::Tensor dk_c = at::matmul(da.transpose(-1, -2), q_c);
    at::Tensor dv_c = at::matmul(a.transpose(-1, -2), dnd_c);
    // between chunks: chunk m's state reaches every later chunk's prefix and the final state
    const at::Tensor dprefix = at::matmul(q_c.transpose(-1, -2), dnd_c);  // (B, H, N, D, Dp)
    const at::Tensor total = dprefix.sum(2);
    const at::Tensor dstate = grad_final.unsqueeze(2) + exclusive_suffix(dprefix);
    dk_c = dk_c + at::matmul(v_c, dstate.transpose(-1, -2));
    dv_c = dv_c + at::matmul(k_c, dstate);
    dphiq = unchunked(dq_c, L);
    dphik = unchunked(dk_c, L);
    dv1 = unchunked(dv_c, L);
    grad_init = total + grad_final;
  }
  const auto cast = [](const at::Tensor& t, const at::Tensor& like) {
    return t.to(like.scalar_type()).contiguous();
  };
  return {cast(dphiq * feature_grad(o.phiq, p.feature_map), q),
          cast(dphik * feature_grad(o.phik, p.feature_map), k), cast(dv1.narrow(-1, 0, Dv), v),
          grad_init.narrow(-1, 0, Dv).contiguous(), grad_init.select(-1, Dv).contiguous()};
}

TORCH_LIBRARY_IMPL(attn_ext, CompositeExplicitAutograd, m) {
  m.impl("linear_attention", &linear_attention_composite);
  m.impl("linear_attention_backward", &linear_attention_backward_composite);
}

}  // namespace attn_ext::linear
