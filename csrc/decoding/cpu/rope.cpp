// CPU rotary position embedding: out of place, in place and the backward (the inverse
// rotation). Parallel over (batch, position); the cos/sin table of a position is built once
// and serves every head.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/tensors.h"
#include "decoding/decode_inputs.h"
#include "common/dispatch.h"
#include "common/cpu/kernel_traits.h"
#include "common/cpu/rope_rows.h"

namespace attn_ext::cpu {
namespace {

template <typename scalar_t>
void rope_kernel(const RopeParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const std::vector<float> inv_freq = rope_inv_freq(p.policy);
  at::parallel_for(0, p.batch * p.seqlen, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> cos_t(p.policy.pairs()), sin_t(p.policy.pairs());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.seqlen, s = task % p.seqlen;
      rope_table(p.policy, inv_freq.data(), p.position(b, s), p.inverse, cos_t.get(), sin_t.get());
      for (int64_t h = 0; h < p.heads; ++h) {
        const auto* x = static_cast<const scalar_t*>(p.x) + b * p.x_batch_stride +
                        h * p.x_head_stride + s * p.x_row_stride;
        auto* y = static_cast<scalar_t*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
                  s * p.o_row_stride;
        rope_row(p.policy, x, p.x_col_stride, y, p.o_col_stride, p.head_dim, cos_t.get(),
                 sin_t.get());
      }
    }
  });
}

void run(const char* op, RopeParams& p, const at::Tensor& x) {
  if (x.numel() == 0) return;
  ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), op, [&] { rope_kernel<scalar_t>(p); });
}

at::Tensor rope_out_of_place(const char* op, const at::Tensor& x,
                             const std::optional<at::Tensor>& positions, int64_t offset,
                             double base, bool interleaved, std::optional<int64_t> rotary_dim,
                             bool inverse) {
  PreparedRope r = prepare_rope(op, x, {positions, offset, base, interleaved, rotary_dim});
  // Same layout as x (a (B, S, H, D).transpose(1, 2) view stays one), like ATen's pointwise ops.
  at::Tensor out = advise_huge_pages(at::empty_like(x));
  r.params.inverse = inverse;
  set_rope_output(r.params, out);
  run(op, r.params, x);
  return out;
}

at::Tensor rope_cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions, int64_t offset,
                    double base, bool interleaved, std::optional<int64_t> rotary_dim) {
  return rope_out_of_place("attn_ext.rope", x, positions, offset, base, interleaved, rotary_dim,
                           false);
}

at::Tensor rope_backward_cpu(const at::Tensor& grad_out, const std::optional<at::Tensor>& positions,
                             int64_t offset, double base, bool interleaved,
                             std::optional<int64_t> rotary_dim) {
  return rope_out_of_place("attn_ext.rope_backward", grad_out, positions, offset, base, interleaved,
                           rotary_dim, true);
}

void rope_inplace_cpu(at::Tensor& x, const std::optional<at::Tensor>& positions, int64_t offset,
                      double base, bool interleaved, std::optional<int64_t> rotary_dim) {
  constexpr const char* kOp = "attn_ext.rope_";
  PreparedRope r = prepare_rope(kOp, x, {positions, offset, base, interleaved, rotary_dim});
  // Two elements sharing memory (an expanded view) would be rotated twice.
  at::assert_no_internal_overlap(x);
  set_rope_output(r.params, x);
  run(kOp, r.params, x);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("rope", &rope_cpu);
  m.impl("rope_", &rope_inplace_cpu);
  m.impl("rope_backward", &rope_backward_cpu);
}

}  // namespace attn_ext::cpu
