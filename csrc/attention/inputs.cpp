#include "attention/inputs.h"

#include <cmath>
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

namespace attn_ext {
void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4, op, ": q must be 4-D (B, H, Sq, D), got ", q.dim(), "-D ", q.sizes());
  TORCH_CHECK(k.dim() == 4, op, ": k must be 4-D (B, Hkv, Sk, D), got ", k.dim(), "-D ", k.sizes());
  TORCH_CHECK(v.dim() == 4, op, ": v must be 4-D (B, Hkv, Sk, Dv), got ", v.dim(), "-D ",
              v.sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), op,
              ": q must be float32, float64, bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": k must have q's dtype ", q.scalar_type(),
              ", got ", k.scalar_type());
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), op, ": v must have q's dtype ", q.scalar_type(),
              ", got ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device(), op, ": k must be on q's device ", q.device(), ", got ",
              k.device());
  TORCH_CHECK(v.device() == q.device(), op, ": v must be on q's device ", q.device(), ", got ",
              v.device());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), op,
              ": k and v batch size must equal q's ", q.size(0), ", got k ", k.sizes(), " and v ",
              v.sizes());
  TORCH_CHECK(v.size(1) == k.size(1), op, ": v must have k's number of heads ", k.size(1), ", got ",
              v.size(1));
  TORCH_CHECK(k.size(1) > 0 || q.size(1) == 0, op, ": k must have at least one head, got ",
              k.sizes());
  TORCH_CHECK(k.size(1) == 0 || q.size(1) % k.size(1) == 0, op,
              ": q heads must be a multiple of k heads (GQA), got H=", q.size(1),
              " and Hkv=", k.size(1));
  TORCH_CHECK(v.size(2) == k.size(2), op, ": v sequence length must equal k's ", k.size(2),
              ", got ", v.size(2));
  TORCH_CHECK(k.size(3) == q.size(3), op, ": k head dim must equal q's ", q.size(3), ", got ",
              k.size(3));
}

namespace {

at::Tensor prepare_mask(const char* op, const at::Tensor& mask, const at::Tensor& q, int64_t sk) {
  TORCH_CHECK(mask.device() == q.device(), op, ": attn_mask must be on q's device ", q.device(),
              ", got ", mask.device());
  const auto dt = mask.scalar_type();
  TORCH_CHECK(dt == at::kBool || at::isFloatingType(dt), op,
              ": attn_mask must be bool (true = keep) or floating (additive), got ", dt);
  TORCH_CHECK(mask.dim() <= 4, op, ": attn_mask must be broadcastable to (B, H, Sq, Sk) = (",
              q.size(0), ", ", q.size(1), ", ", q.size(2), ", ", sk, "), got shape ", mask.sizes());
  const std::vector<int64_t> target{q.size(0), q.size(1), q.size(2), sk};
  const int64_t lead = 4 - mask.dim();
  for (int64_t d = 0; d < mask.dim(); ++d) {
    const int64_t s = mask.size(d);
    TORCH_CHECK(s == 1 || s == target[lead + d], op,
                ": attn_mask must be broadcastable to (B, H, Sq, Sk) = (", target[0], ", ",
                target[1], ", ", target[2], ", ", target[3], "), got shape ", mask.sizes());
  }
  // An additive mask is read in the kernels' accumulation type (fp64 for fp64 inputs, else
  // fp32) or, by the CPU kernels, in q's own element type: converting a full-size bf16 / fp16
  // (B, H, Sq, Sk) mask on every call cost as much as the attention itself. Convert before
  // expanding, so a broadcast mask is never materialized at full size.
  const bool as_is = dt == at::kBool || dt == at::toOpMathType(q.scalar_type()) ||
                     (q.device().is_cpu() && dt == q.scalar_type());
  at::Tensor m = as_is ? mask : mask.to(at::toOpMathType(q.scalar_type()));
  return m.expand(target);
}

}  // namespace

void read_rng_state(const char* op, const std::optional<at::Tensor>& rng_state, double dropout_p,
                    AttentionParams& p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p must be in [0, 1), got ",
              dropout_p);
  p.dropout_p = dropout_p;
  if (dropout_p == 0.0) return;
  TORCH_CHECK(rng_state.has_value(), op,
              ": rng_state (int64 tensor [seed, offset]) is required when dropout_p > 0");
  const at::Tensor& s = *rng_state;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kLong && s.numel() == 2, op,
              ": rng_state must be a CPU int64 tensor of 2 elements, got ", s.scalar_type(), " ",
              s.sizes(), " on ", s.device());
  const at::Tensor c = s.contiguous();
  p.seed = static_cast<uint64_t>(c.data_ptr<int64_t>()[0]);
  p.rng_offset = static_cast<uint64_t>(c.data_ptr<int64_t>()[1]);
}

PreparedInputs prepare_attention(const char* op, const at::Tensor& q_in, const at::Tensor& k_in,
                                 const at::Tensor& v_in, const AttentionOptions& o) {
  check_qkv(op, q_in, k_in, v_in);
  PreparedInputs r;
  r.q = blas_rows(q_in);
  r.k = blas_rows(k_in);
  r.v = blas_rows(v_in);
  AttentionParams& p = r.params;
  p.batch = r.q.size(0);
  p.heads = r.q.size(1);
  p.kv_heads = r.k.size(1);
  p.seqlen_q = r.q.size(2);
  p.seqlen_k = r.k.size(2);
  p.head_dim = r.q.size(3);
  p.head_dim_v = r.v.size(3);

  const double scale =
      o.scale.has_value() ? *o.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  p.scale = scale;

  TORCH_CHECK(o.window_left >= -1, op, ": window_size[0] (left) must be >= -1, got ",
              o.window_left);
  TORCH_CHECK(o.window_right >= -1, op, ": window_size[1] (right) must be >= -1, got ",
              o.window_right);
  p.key_offset = o.key_offset.has_value() ? *o.key_offset : p.seqlen_k - p.seqlen_q;
  p.window_left = o.window_left;
  p.window_right =
      o.causal ? (o.window_right < 0 ? 0 : std::min<int64_t>(o.window_right, 0)) : o.window_right;

  if (o.attn_mask.has_value() && o.attn_mask->defined()) {
    r.mask = prepare_mask(op, *o.attn_mask, r.q, p.seqlen_k);
    const auto mt = r.mask.scalar_type();
    p.mask_kind = mt == at::kBool                             ? MaskKind::kBool
                  : mt == at::toOpMathType(r.q.scalar_type()) ? MaskKind::kAdditive
                                                              : MaskKind::kAdditiveInput;
    p.mask = r.mask.data_ptr();
    p.mask_batch_stride = r.mask.stride(0);
    p.mask_head_stride = r.mask.stride(1);
    p.mask_row_stride = r.mask.stride(2);
    p.mask_col_stride = r.mask.stride(3);
  }
  read_rng_state(op, o.rng_state, o.dropout_p, p);

  p.q = r.q.data_ptr();
  p.k = r.k.data_ptr();
  p.v = r.v.data_ptr();
  p.q_batch_stride = r.q.stride(0);
  p.q_head_stride = r.q.stride(1);
  p.q_row_stride = blas_row_stride(r.q);
  p.k_batch_stride = r.k.stride(0);
  p.k_head_stride = r.k.stride(1);
  p.k_row_stride = blas_row_stride(r.k);
  p.v_batch_stride = r.v.stride(0);
  p.v_head_stride = r.v.stride(1);
  p.v_row_stride = blas_row_stride(r.v);
  return r;
}

std::tuple<at::Tensor, at::Tensor> allocate_outputs(AttentionParams& p, const at::Tensor& q) {
  at::Tensor out = at::empty({p.batch, p.heads, p.seqlen_q, p.head_dim_v}, q.options());
  at::Tensor lse = at::empty({p.batch, p.heads, p.seqlen_q}, q.options().dtype(at::kFloat));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_batch_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.o_row_stride = std::max<int64_t>(out.stride(2), 1);
  return {out, lse};
}

PreparedBackward prepare_attention_backward(const char* op, const at::Tensor& grad_out,
                                            const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& out,
                                            const at::Tensor& lse,
                                            const std::optional<at::Tensor>& grad_lse,
                                            const AttentionOptions& opts) {
  PreparedBackward r{prepare_attention(op, q, k, v, opts)};
  AttentionBwdParams& p = r.params;
  static_cast<AttentionParams&>(p) = r.in.params;
  const std::vector<int64_t> o_shape{p.batch, p.heads, p.seqlen_q, p.head_dim_v};
  const std::vector<int64_t> row_shape{p.batch, p.heads, p.seqlen_q};
  check_companion(op, "grad_out", grad_out, q, o_shape, q.scalar_type());
  check_companion(op, "out", out, q, o_shape, q.scalar_type());
  check_companion(op, "lse", lse, q, row_shape, at::kFloat);
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if (has_glse) check_companion(op, "grad_lse", *grad_lse, q, row_shape, at::kFloat);

  // The kernels read grad_out / out by rows (through BLAS on the CPU), lse by index.
  r.grad_out = blas_rows(grad_out);
  r.out = blas_rows(out);
  r.lse = lse.contiguous();
  if (has_glse) r.grad_lse = grad_lse->contiguous();
  p.grad_lse = has_glse ? r.grad_lse.const_data_ptr<float>() : nullptr;
  p.dout = r.grad_out.const_data_ptr();
  p.do_batch_stride = r.grad_out.stride(0);
  p.do_head_stride = r.grad_out.stride(1);
  p.do_row_stride = blas_row_stride(r.grad_out);
  p.out = const_cast<void*>(r.out.const_data_ptr());
  p.o_batch_stride = r.out.stride(0);
  p.o_head_stride = r.out.stride(1);
  p.o_row_stride = blas_row_stride(r.out);
  p.lse = const_cast<float*>(r.lse.const_data_ptr<float>());
  return r;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_grads(AttentionBwdParams& p,
                                                              const at::Tensor& q,
                                                              int64_t dq_partials) {
  const auto acc = q.options().dtype(at::toOpMathType(q.scalar_type()));
  const int64_t B = p.batch, H = p.heads, Sq = p.seqlen_q, Sk = p.seqlen_k;
  at::Tensor dq = at::zeros({dq_partials, B, H, Sq, p.head_dim}, acc);
  at::Tensor dk = at::zeros({B, H, Sk, p.head_dim}, acc);
  at::Tensor dv = at::zeros({B, H, Sk, p.head_dim_v}, acc);
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_grads(const AttentionBwdParams& p,
                                                            at::Tensor dq, at::Tensor dk,
                                                            at::Tensor dv, at::ScalarType dtype) {
  dq = dq.size(0) == 1 ? dq.squeeze(0) : dq.sum(0);
  const int64_t B = p.batch, H = p.heads, Hkv = p.kv_heads, Sk = p.seqlen_k;
  if (H != Hkv) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    dk = Hkv == 0 ? dk.new_zeros({B, 0, Sk, D}) : dk.view({B, Hkv, H / Hkv, Sk, D}).sum(2);
    dv = Hkv == 0 ? dv.new_zeros({B, 0, Sk, Dv}) : dv.view({B, Hkv, H / Hkv, Sk, Dv}).sum(2);
  }
  return {dq.to(dtype), dk.to(dtype), dv.to(dtype)};
}

}  // namespace attn_ext
