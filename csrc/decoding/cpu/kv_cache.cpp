// CPU KV-cache append: copies each sequence's new keys/values into the preallocated cache at
// its current length (rotating the keys by RoPE at their cache positions when asked) and
// advances the lengths. A paged cache is written through its block table (row t of sequence
// b: row t % page_size of page block_table[b, t / page_size]). A float8 cache takes the rows
// quantized (common/float8.h). Every check, the table's
// entries included, runs before the first write, so a rejected call leaves the cache untouched.
#include <cstring>
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "decoding/decode_inputs.h"
#include "common/dispatch.h"
#include "common/float8.h"
#include "common/cpu/kernel_traits.h"
#include "common/cpu/rope_rows.h"

namespace attn_ext::cpu {
namespace {

template <typename scalar_t>
inline void copy_row(const scalar_t* src, int64_t stride, scalar_t* dst, int64_t n) {
  if (stride == 1) {
    std::memcpy(dst, src, n * sizeof(scalar_t));
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = src[j * stride];
  }
}

// dst[j] = src[j * stride] / scale into a float8 row (common/float8.h: saturated).
template <typename scalar_t, typename fp8_t>
inline void quantize_row(const scalar_t* src, int64_t stride, fp8_t* dst, int64_t n, float scale) {
  const float inv_scale = 1.0f / scale;
  for (int64_t j = 0; j < n; ++j)
    dst[j] = quantize_saturated<fp8_t>(static_cast<float>(src[j * stride]), inv_scale);
}

// Appends the new rows; cache_t is scalar_t, or a float8 type that the rows are quantized to
// (rotated first, in the accumulation type, when the keys take RoPE).
template <typename scalar_t, typename cache_t = scalar_t>
void kv_append_kernel(const KVAppendParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kQuantize = !std::is_same_v<scalar_t, cache_t>;
  const std::vector<float> inv_freq = p.rope ? rope_inv_freq(p.policy) : std::vector<float>{};
  const int64_t S = p.seqlen_new;
  // One task per (sequence, new token): the token's cos/sin table serves all its heads.
  at::parallel_for(0, p.batch * S, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> cos_t(p.rope ? p.policy.pairs() : 0), sin_t(p.rope ? p.policy.pairs() : 0);
    Buffer<acc_t> rotated(kQuantize && p.rope ? p.head_dim : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / S, t = task % S;
      const int64_t first = S - p.appended[b];  // inputs are left-padded
      if (t < first) continue;
      const int64_t dst_row = p.lengths[b] + (t - first);
      const CacheSlot dst = p.pages.locate(b, dst_row);
      if (p.rope) rope_table(p.policy, inv_freq.data(), dst_row, false, cos_t.get(), sin_t.get());
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        const auto* k = static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride +
                        h * p.k_head_stride + t * p.k_row_stride;
        const auto* v = static_cast<const scalar_t*>(p.v) + b * p.v_batch_stride +
                        h * p.v_head_stride + t * p.v_row_stride;
        auto* kc = static_cast<cache_t*>(p.k_cache) + dst.block * p.kc_batch_stride +
                   h * p.kc_head_stride + dst.row * p.kc_row_stride;
        auto* vc = static_cast<cache_t*>(p.v_cache) + dst.block * p.vc_batch_stride +
                   h * p.vc_head_stride + dst.row * p.vc_row_stride;
        if constexpr (kQuantize) {
          const float k_scale = static_cast<float>(p.k_scale);
          if (p.rope) {
            for (int64_t j = 0; j < p.head_dim; ++j)
              rotated.get()[j] = static_cast<acc_t>(k[j * p.k_col_stride]);
            rope_row(p.policy, rotated.get(), 1, rotated.get(), 1, p.head_dim, cos_t.get(),
                     sin_t.get());
            quantize_row(rotated.get(), 1, kc, p.head_dim, k_scale);
          } else {
            quantize_row(k, p.k_col_stride, kc, p.head_dim, k_scale);
          }
          quantize_row(v, p.v_col_stride, vc, p.head_dim_v, static_cast<float>(p.v_scale));
        } else {
          if (p.rope) {
            rope_row(p.policy, k, p.k_col_stride, kc, 1, p.head_dim, cos_t.get(), sin_t.get());
          } else {
            copy_row(k, p.k_col_stride, kc, p.head_dim);
          }
          copy_row(v, p.v_col_stride, vc, p.head_dim_v);
        }
      }
    }
  });
}

void kv_cache_append_cpu(at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& cache_seqlens,
                         const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& new_lengths, bool rope, double rope_base,
                         bool rope_interleaved, std::optional<int64_t> rotary_dim,
                         const std::optional<at::Tensor>& block_table, double k_scale,
                         double v_scale, const std::optional<at::Tensor>& rope_inv_freq,
                         double rope_attention_scaling) {
  constexpr const char* kOp = "attn_ext.kv_cache_append";
  PreparedAppend r = prepare_kv_append(kOp, k_cache, v_cache, cache_seqlens, k, v, new_lengths,
                                       rope, rope_base, rope_interleaved, rotary_dim, block_table,
                                       /*check_values=*/true, {k_scale, v_scale}, {},
                                       {rope_inv_freq, rope_attention_scaling});
  if (k.numel() > 0 || v.numel() > 0) {
    ATTN_EXT_DISPATCH_FLOATING(k.scalar_type(), kOp, [&] {
      ATTN_EXT_DISPATCH_CACHE(k_cache.scalar_type(), kOp,
                              [&] { kv_append_kernel<scalar_t, cache_t>(r.params); });
    });
  }
  cache_seqlens.add_(r.appended.to(cache_seqlens.scalar_type()));
}

void latent_cache_append_cpu(at::Tensor& cache, at::Tensor& cache_seqlens, const at::Tensor& c_kv,
                             const at::Tensor& k_rope, const std::optional<at::Tensor>& new_lengths,
                             double rope_base, bool rope_interleaved,
                             const std::optional<at::Tensor>& block_table,
                             const std::optional<at::Tensor>& rope_inv_freq,
                             double rope_attention_scaling, double kv_scale) {
  constexpr const char* kOp = "attn_ext.latent_cache_append";
  PreparedAppend r = prepare_latent_append(
      kOp, cache, cache_seqlens, c_kv, k_rope, new_lengths, rope_base, rope_interleaved,
      block_table, /*check_values=*/true, {rope_inv_freq, rope_attention_scaling}, kv_scale);
  if (c_kv.numel() > 0 || k_rope.numel() > 0) {
    ATTN_EXT_DISPATCH_FLOATING(c_kv.scalar_type(), kOp, [&] {
      ATTN_EXT_DISPATCH_CACHE(cache.scalar_type(), kOp,
                              [&] { kv_append_kernel<scalar_t, cache_t>(r.params); });
    });
  }
  cache_seqlens.add_(r.appended.to(cache_seqlens.scalar_type()));
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("kv_cache_append", &kv_cache_append_cpu);
  m.impl("latent_cache_append", &latent_cache_append_cpu);
}

}  // namespace attn_ext::cpu
