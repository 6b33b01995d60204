#pragma once
// Validation at the linear-attention ops' boundary, shared by the CPU and CUDA implementations
// so both reject the same inputs with the same messages.
#include <optional>
#include <string_view>
#include <ATen/core/Tensor.h>
#include "linear/feature_map.h"
#include "linear/linear_params.h"

namespace attn_ext::linear {

// Inputs as the kernels read them (last dimension contiguous, states contiguous) and the
// parameters pointing into them.
struct LinearInputs {
  at::Tensor q, k, v, initial_kv, initial_k;
  LinearAttentionParams params;
};

LinearInputs prepare_linear_attention(const char* op, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v,
                                      const std::optional<at::Tensor>& initial_kv,
                                      const std::optional<at::Tensor>& initial_k, bool causal,
                                      double eps, std::string_view feature_map);

// The backward's inputs: the forward's (as prepare_linear_attention), grad_out checked against
// (B, H, Sq, Dv) in q's dtype, and the final state's gradient pair (undefined when absent).
struct LinearBackwardInputs {
  LinearInputs fwd;
  at::Tensor grad_final_kv, grad_final_k;
};

LinearBackwardInputs prepare_linear_attention_backward(
    const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& initial_kv,
    const std::optional<at::Tensor>& initial_k, const std::optional<at::Tensor>& grad_state_kv,
    const std::optional<at::Tensor>& grad_state_k, bool causal, double eps,
    std::string_view feature_map);

// Checks an optional (kv, k)-shaped state tensor pair the op receives (initial state or the
// gradient of the final state): both or neither, accumulation dtype, q's device, shapes
// (B, H, D, Dv) and (B, H, D). Returns them contiguous (undefined tensors when absent).
std::pair<at::Tensor, at::Tensor> check_state_pair(const char* op, const char* kv_name,
                                                   const char* k_name,
                                                   const std::optional<at::Tensor>& kv,
                                                   const std::optional<at::Tensor>& k,
                                                   const at::Tensor& q, int64_t dv);

}  // namespace attn_ext::linear
