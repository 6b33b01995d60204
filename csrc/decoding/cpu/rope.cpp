// CPU rotary position embedding: out of place, in place and the backward (the inverse
// rotation). Parallel over (batch, block of positions); the cos/sin table of a position is
// built once and serves every head.
#include <algorithm>
#include <cstdlib>
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
#include "common/cpu/split_kv.h"

namespace attn_ext::cpu {
namespace {

// Positions per task, at most: their cos / sin tables (32 x 64 pairs x 2 floats, 16 KB at D 128)
// stay in L1 while every head's rows at them are rotated, and in the (B, H, S, D) layout each
// head then streams a run of 32 rows. With one position per task that layout read the 32
// heads' rows of a position 2 MB apart (bf16, S 8192): 26 ms at (1, 32, 8192, 128) against
// 8-12 ms for the (B, S, H, D) view, whose heads of a position lie side by side
// (docs/performance.md).
constexpr int64_t kRopeBlockRows = 32;
// Tasks per thread that the block size leaves, where the positions allow: short prompts on
// many threads take smaller blocks rather than idle threads.
constexpr int64_t kRopeTasksPerThread = 4;

template <typename scalar_t>
void rope_kernel(const RopeParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const std::vector<float> inv_freq = rope_inv_freq(p.policy);
  const int64_t pairs = p.policy.pairs();
  const int64_t wanted = kRopeTasksPerThread * at::get_num_threads();
  const int64_t rows = std::clamp<int64_t>(ceil_div(p.batch * p.seqlen, wanted), 1, kRopeBlockRows);
  const int64_t blocks = ceil_div(p.seqlen, rows);
  // Heads outer where a head's rows lie together ((B, H, S, D)), positions outer where a
  // position's heads do (the (B, S, H, D) view): either way the rows are read in memory order.
  const bool heads_outer = std::abs(p.x_head_stride) >= std::abs(p.x_row_stride);
  at::parallel_for(0, p.batch * blocks, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> cos_t(rows * pairs), sin_t(rows * pairs);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / blocks, s0 = task % blocks * rows;
      const int64_t n = std::min(rows, p.seqlen - s0);
      for (int64_t i = 0; i < n; ++i)
        rope_table(p.policy, inv_freq.data(), p.position(b, s0 + i), p.inverse,
                   cos_t.get() + i * pairs, sin_t.get() + i * pairs);
      const auto rotate = [&](int64_t h, int64_t i) {
        const int64_t s = s0 + i;
        const auto* x = static_cast<const scalar_t*>(p.x) + b * p.x_batch_stride +
                        h * p.x_head_stride + s * p.x_row_stride;
        auto* y = static_cast<scalar_t*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
                  s * p.o_row_stride;
        rope_row(p.policy, x, p.x_col_stride, y, p.o_col_stride, p.head_dim,
                 cos_t.get() + i * pairs, sin_t.get() + i * pairs);
      };
      if (heads_outer) {
        for (int64_t h = 0; h < p.heads; ++h)
          for (int64_t i = 0; i < n; ++i) rotate(h, i);
      } else {
        for (int64_t i = 0; i < n; ++i)
          for (int64_t h = 0; h < p.heads; ++h) rotate(h, i);
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
                             const std::optional<at::Tensor>& inv_freq, double attention_scaling,
                             bool inverse) {
  PreparedRope r = prepare_rope(
      op, x, {positions, offset, base, interleaved, rotary_dim, {inv_freq, attention_scaling}});
  // Same layout as x (a (B, S, H, D).transpose(1, 2) view stays one), like ATen's pointwise ops.
  at::Tensor out = advise_huge_pages(at::empty_like(x));
  r.params.inverse = inverse;
  set_rope_output(r.params, out);
  run(op, r.params, x);
  return out;
}

at::Tensor rope_cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions, int64_t offset,
                    double base, bool interleaved, std::optional<int64_t> rotary_dim,
                    const std::optional<at::Tensor>& inv_freq, double attention_scaling) {
  return rope_out_of_place("attn_ext.rope", x, positions, offset, base, interleaved, rotary_dim,
                           inv_freq, attention_scaling, false);
}

at::Tensor rope_backward_cpu(const at::Tensor& grad_out, const std::optional<at::Tensor>& positions,
                             int64_t offset, double base, bool interleaved,
                             std::optional<int64_t> rotary_dim,
                             const std::optional<at::Tensor>& inv_freq, double attention_scaling) {
  return rope_out_of_place("attn_ext.rope_backward", grad_out, positions, offset, base, interleaved,
                           rotary_dim, inv_freq, attention_scaling, true);
}

void rope_inplace_cpu(at::Tensor& x, const std::optional<at::Tensor>& positions, int64_t offset,
                      double base, bool interleaved, std::optional<int64_t> rotary_dim,
                      const std::optional<at::Tensor>& inv_freq, double attention_scaling) {
  constexpr const char* kOp = "attn_ext.rope_";
  PreparedRope r = prepare_rope(
      kOp, x, {positions, offset, base, interleaved, rotary_dim, {inv_freq, attention_scaling}});
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
