// CPU tpa_expand (Tensor Product Attention): a token's per-head rows formed from its factors,
// out[h, :] = scale * sum_r a[r, h] * RoPE(b[r, :]), and the backward. One task per token:
// its R factor rows are converted (and rotated) once into a buffer that every head reads.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "compression/tpa_inputs.h"
#include "common/cpu/cpu_support.h"
#include "common/cpu/kernel_traits.h"
#include "common/cpu/rope_rows.h"

namespace attn_ext::cpu {
namespace {

// The token's b rows, converted to acc_t and rotated at its position: rb (R, D).
template <typename scalar_t, typename acc_t>
void load_factors(const TpaExpandParams& p, const float* inv_freq, int64_t bi, int64_t s, acc_t* rb,
                  acc_t* cos_t, acc_t* sin_t) {
  const auto* b = static_cast<const scalar_t*>(p.b) + bi * p.b_batch_stride + s * p.b_row_stride;
  const int64_t D = p.head_dim;
  for (int64_t r = 0; r < p.rank; ++r) {
    for (int64_t d = 0; d < D; ++d) {
      rb[r * D + d] = static_cast<acc_t>(b[r * p.b_rank_stride + d * p.b_col_stride]);
    }
  }
  if (!p.rope) return;
  rope_table(p.policy, inv_freq, p.position(bi, s), false, cos_t, sin_t);
  for (int64_t r = 0; r < p.rank; ++r)
    rope_row(p.policy, rb + r * D, 1, rb + r * D, 1, D, cos_t, sin_t);
}

template <typename scalar_t>
void tpa_forward_kernel(const TpaExpandParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const std::vector<float> inv_freq = p.rope ? rope_inv_freq(p.policy) : std::vector<float>{};
  const int64_t R = p.rank, H = p.heads, D = p.head_dim;
  const acc_t scale = static_cast<acc_t>(p.scale);
  at::parallel_for(0, p.batch * p.seqlen, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> rb(R * D), row(D), cos_t(p.policy.pairs()), sin_t(p.policy.pairs());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / p.seqlen, s = task % p.seqlen;
      load_factors<scalar_t>(p, inv_freq.data(), bi, s, rb.get(), cos_t.get(), sin_t.get());
      const auto* a =
          static_cast<const scalar_t*>(p.a) + bi * p.a_batch_stride + s * p.a_row_stride;
      auto* out = static_cast<scalar_t*>(p.out) + task * H * D;
      for (int64_t h = 0; h < H; ++h) {
        std::fill(row.data.begin(), row.data.end(), acc_t(0));
        for (int64_t r = 0; r < R; ++r) {
          const acc_t c = scale * static_cast<acc_t>(a[r * p.a_rank_stride + h * p.a_col_stride]);
          const acc_t* br = rb.get() + r * D;
          for (int64_t d = 0; d < D; ++d) row.get()[d] += c * br[d];
        }
        for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(row.get()[d]);
      }
    }
  });
}

// grad_a[r, h] = scale * <grad_out[h], RoPE(b[r])>;
// grad_b[r] = RoPE^-1(scale * sum_h a[r, h] grad_out[h]) (the rotation is orthogonal).
template <typename scalar_t>
void tpa_backward_kernel(const TpaExpandParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const std::vector<float> inv_freq = p.rope ? rope_inv_freq(p.policy) : std::vector<float>{};
  const int64_t R = p.rank, H = p.heads, D = p.head_dim;
  const acc_t scale = static_cast<acc_t>(p.scale);
  at::parallel_for(0, p.batch * p.seqlen, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> rb(R * D), go(H * D), gb(R * D), cos_t(p.policy.pairs()), sin_t(p.policy.pairs());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / p.seqlen, s = task % p.seqlen;
      load_factors<scalar_t>(p, inv_freq.data(), bi, s, rb.get(), cos_t.get(), sin_t.get());
      const auto* a =
          static_cast<const scalar_t*>(p.a) + bi * p.a_batch_stride + s * p.a_row_stride;
      const auto* g =
          static_cast<const scalar_t*>(p.grad_out) + bi * p.g_batch_stride + s * p.g_row_stride;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < D; ++d) {
          go.get()[h * D + d] = static_cast<acc_t>(g[h * p.g_head_stride + d * p.g_col_stride]);
        }
      }
      auto* ga = static_cast<scalar_t*>(p.grad_a) + task * R * H;
      auto* gbo = static_cast<scalar_t*>(p.grad_b) + task * R * D;
      std::fill(gb.data.begin(), gb.data.end(), acc_t(0));
      for (int64_t r = 0; r < R; ++r) {
        const acc_t* br = rb.get() + r * D;
        acc_t* gbr = gb.get() + r * D;
        for (int64_t h = 0; h < H; ++h) {
          const acc_t* gh = go.get() + h * D;
          acc_t dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += gh[d] * br[d];
          ga[r * H + h] = static_cast<scalar_t>(scale * dot);
          const acc_t c = scale * static_cast<acc_t>(a[r * p.a_rank_stride + h * p.a_col_stride]);
          for (int64_t d = 0; d < D; ++d) gbr[d] += c * gh[d];
        }
      }
      if (p.rope) {
        rope_table(p.policy, inv_freq.data(), p.position(bi, s), true, cos_t.get(), sin_t.get());
        for (int64_t r = 0; r < R; ++r) {
          rope_row(p.policy, gb.get() + r * D, 1, gb.get() + r * D, 1, D, cos_t.get(), sin_t.get());
        }
      }
      for (int64_t i = 0; i < R * D; ++i) gbo[i] = static_cast<scalar_t>(gb.get()[i]);
    }
  });
}

TpaOptions options(const std::optional<at::Tensor>& positions, double scale, bool rope,
                   double rope_base, bool rope_interleaved, std::optional<int64_t> rotary_dim) {
  return {positions, scale, rope, rope_base, rope_interleaved, rotary_dim};
}

at::Tensor tpa_expand_cpu(const at::Tensor& a, const at::Tensor& b,
                          const std::optional<at::Tensor>& positions, double scale, bool rope,
                          double rope_base, bool rope_interleaved,
                          std::optional<int64_t> rotary_dim) {
  constexpr const char* kOp = "attn_ext.tpa_expand";
  check_cpu_support(kOp);
  PreparedTpa r = prepare_tpa_expand(
      kOp, a, b, options(positions, scale, rope, rope_base, rope_interleaved, rotary_dim));
  at::Tensor out = allocate_tpa_output(r.params, a);
  r.params.out = out.data_ptr();
  if (out.numel() == 0) return out;
  ATTN_EXT_DISPATCH_FLOATING(a.scalar_type(), kOp, [&] { tpa_forward_kernel<scalar_t>(r.params); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> tpa_expand_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& b,
    const std::optional<at::Tensor>& positions, double scale, bool rope, double rope_base,
    bool rope_interleaved, std::optional<int64_t> rotary_dim) {
  constexpr const char* kOp = "attn_ext.tpa_expand_backward";
  check_cpu_support(kOp);
  PreparedTpa r = prepare_tpa_expand(
      kOp, a, b, options(positions, scale, rope, rope_base, rope_interleaved, rotary_dim),
      &grad_out);
  at::Tensor grad_a = at::empty(a.sizes(), a.options());
  at::Tensor grad_b = at::empty(b.sizes(), b.options());
  r.params.grad_a = grad_a.data_ptr();
  r.params.grad_b = grad_b.data_ptr();
  if (grad_a.numel() == 0 && grad_b.numel() == 0) return {grad_a, grad_b};
  ATTN_EXT_DISPATCH_FLOATING(a.scalar_type(), kOp,
                             [&] { tpa_backward_kernel<scalar_t>(r.params); });
  return {grad_a, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("tpa_expand", &tpa_expand_cpu);
  m.impl("tpa_expand_backward", &tpa_expand_backward_cpu);
}

}  // namespace attn_ext::cpu
