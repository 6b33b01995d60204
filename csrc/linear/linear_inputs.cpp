#include "linear/linear_inputs.h"

#include <cmath>
#include <sstream>
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

#include "attention/inputs.h"

namespace attn_ext::linear {
namespace {

FeatureMap parse_feature_map(const char* op, std::string_view name) {
  for (int i = 0; i < kNumFeatureMaps; ++i) {
    if (name == kFeatureMapNames[i]) return static_cast<FeatureMap>(i);
  }
  std::ostringstream valid;
  for (int i = 0; i < kNumFeatureMaps; ++i)
    valid << (i ? ", " : "") << '"' << kFeatureMapNames[i] << '"';
  TORCH_CHECK(false, op, ": feature_map must be one of ", valid.str(), ", got \"", name, "\"");
}

void check_linear_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      bool causal) {
  check_qkv(op, q, k, v);
  // Every query head owns its state; grouped key/value heads are not supported.
  TORCH_CHECK(k.size(1) == q.size(1), op, ": k and v must have q's number of heads ", q.size(1),
              ", got k ", k.sizes(), " and v ", v.sizes());
  // Causal position i is both the i-th query and the i-th key.
  TORCH_CHECK(!causal || q.size(2) == k.size(2), op,
              ": causal linear attention needs Sq == Sk, got Sq=", q.size(2),
              " and Sk=", k.size(2));
}

Rows rows_of(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), blas_row_stride(t)};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> check_state_pair(const char* op, const char* kv_name,
                                                   const char* k_name,
                                                   const std::optional<at::Tensor>& kv,
                                                   const std::optional<at::Tensor>& k,
                                                   const at::Tensor& q, int64_t dv) {
  const bool has_kv = kv.has_value() && kv->defined(), has_k = k.has_value() && k->defined();
  TORCH_CHECK(has_kv == has_k, op, ": ", kv_name, " and ", k_name,
              " must be given together, got only ", has_kv ? kv_name : k_name);
  if (!has_kv) return {};
  const at::ScalarType acc = at::toOpMathType(q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  check_companion(op, kv_name, *kv, q, {B, H, D, dv}, acc);
  check_companion(op, k_name, *k, q, {B, H, D}, acc);
  return {kv->contiguous(), k->contiguous()};
}

LinearInputs prepare_linear_attention(const char* op, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v,
                                      const std::optional<at::Tensor>& initial_kv,
                                      const std::optional<at::Tensor>& initial_k, bool causal,
                                      double eps, std::string_view feature_map) {
  check_linear_qkv(op, q, k, v, causal);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0, got ", eps);
  LinearInputs r;
  LinearAttentionParams& p = r.params;
  p.feature_map = parse_feature_map(op, feature_map);
  r.q = blas_rows(q);
  r.k = blas_rows(k);
  r.v = blas_rows(v);
  p.batch = q.size(0);
  p.heads = q.size(1);
  p.seqlen_q = q.size(2);
  p.seqlen_k = k.size(2);
  p.head_dim = q.size(3);
  p.head_dim_v = v.size(3);
  p.causal = causal;
  p.eps = eps;
  p.q = rows_of(r.q);
  p.k = rows_of(r.k);
  p.v = rows_of(r.v);
  std::tie(r.initial_kv, r.initial_k) = check_state_pair(op, "initial_state_kv", "initial_state_k",
                                                         initial_kv, initial_k, q, p.head_dim_v);
  if (r.initial_kv.defined()) {
    p.initial_kv = r.initial_kv.data_ptr();
    p.initial_k = r.initial_k.data_ptr();
  }
  return r;
}

LinearBackwardInputs prepare_linear_attention_backward(
    const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& initial_kv,
    const std::optional<at::Tensor>& initial_k, const std::optional<at::Tensor>& grad_state_kv,
    const std::optional<at::Tensor>& grad_state_k, bool causal, double eps,
    std::string_view feature_map) {
  LinearBackwardInputs r;
  r.fwd = prepare_linear_attention(op, q, k, v, initial_kv, initial_k, causal, eps, feature_map);
  const LinearAttentionParams& p = r.fwd.params;
  check_companion(op, "grad_out", grad_out, q, {p.batch, p.heads, p.seqlen_q, p.head_dim_v},
                  q.scalar_type());
  std::tie(r.grad_final_kv, r.grad_final_k) = check_state_pair(
      op, "grad_state_kv", "grad_state_k", grad_state_kv, grad_state_k, q, p.head_dim_v);
  return r;
}

}  // namespace attn_ext::linear
