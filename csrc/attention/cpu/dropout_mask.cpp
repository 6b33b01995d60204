// The dropout keep-mask that attention(..., dropout_p, rng_state) applies, materialized:
// for tests and for users who must reproduce a training step exactly.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention/inputs.h"
#include "common/dropout.h"

namespace attn_ext::cpu {
namespace {

at::Tensor dropout_mask_cpu(const at::Tensor& rng_state, int64_t batch, int64_t heads, int64_t sq,
                            int64_t sk, double dropout_p) {
  constexpr const char* kOp = "attn_ext.dropout_mask";
  TORCH_CHECK(batch >= 0 && heads >= 0 && sq >= 0 && sk >= 0, kOp,
              ": sizes must be non-negative, got (", batch, ", ", heads, ", ", sq, ", ", sk, ")");
  AttentionParams p;
  read_rng_state(kOp, rng_state, dropout_p, p);
  at::Tensor keep = at::ones({batch, heads, sq, sk}, rng_state.options().dtype(at::kBool));
  if (dropout_p == 0.0 || keep.numel() == 0) return keep;
  const DropoutPolicy drop{p.seed, p.rng_offset, static_cast<float>(p.dropout_p)};
  auto* out = reinterpret_cast<uint8_t*>(keep.data_ptr<bool>());
  at::parallel_for(0, batch * heads * sq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % sq, bh = row / sq;
      drop.row_keep(drop.row_id(bh / heads, bh % heads, i, heads, sq), 0, sk, out + row * sk);
    }
  });
  return keep;
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("dropout_mask", &dropout_mask_cpu);
}

}  // namespace attn_ext::cpu
