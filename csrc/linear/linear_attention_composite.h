#pragma once
// The ATen composite of linear_attention and its backward (linear_attention_composite.cpp):
// registered for every device but CPU, and called by the CUDA wrapper
// (linear/cuda/linear_attention_cuda.cpp) for the inputs its kernels do not serve.
#include <optional>
#include <tuple>
#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace attn_ext::linear {

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_composite(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_state_kv,
    const std::optional<at::Tensor>& initial_state_k, bool causal, double eps,
    c10::string_view feature_map);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_attention_backward_composite(const at::Tensor& grad_out, const at::Tensor& q,
                                    const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& initial_state_kv,
                                    const std::optional<at::Tensor>& initial_state_k,
                                    const std::optional<at::Tensor>& grad_state_kv,
                                    const std::optional<at::Tensor>& grad_state_k, bool causal,
                                    double eps, c10::string_view feature_map);

}  // namespace attn_ext::linear
