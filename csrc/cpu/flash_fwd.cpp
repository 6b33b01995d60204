// CPU flash-attention forward: blocked over queries and keys with an online softmax;
// no Sq x Sk buffer, parallel over (batch, head, query block).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/constants.h"
#include "../common/inputs.h"
#include "../common/mask.h"
#include "../common/online_softmax.h"
#include "blas.h"
#include "cpu_support.h"
#include "kernel_traits.h"
#include "tile_mask.h"
#include "vec_math.h"

namespace attn_ext::cpu {
namespace {

// The keys and values of one (batch, kv head) in the accumulation type, converted lazily
// for the key range [lo, hi) that the thread's tasks on that head have asked for so far.
template <typename scalar_t, typename acc_t>
struct ConvertedHead {
  int64_t head = -1, lo = 0, hi = 0;
  Buffer<acc_t> k, v;

  ConvertedHead(int64_t sk, int64_t d, int64_t dv) : k(sk * d), v(sk * dv) {}

  // Makes keys [n_begin, n_end) of `head` available at k.get() + j * D / v.get() + j * Dv.
  void ensure(int64_t head_id, const scalar_t* ks, int64_t k_ld, const scalar_t* vs,
              int64_t v_ld, int64_t d, int64_t dv, int64_t n_begin, int64_t n_end) {
    if (head_id != head || n_begin < lo || n_begin > hi) {
      head = head_id;
      lo = hi = n_begin;
    }
    for (; hi < n_end; ++hi) {
      load_row(ks + hi * k_ld, k.get() + hi * d, d, acc_t(1));
      load_row(vs + hi * v_ld, v.get() + hi * dv, dv, acc_t(1));
    }
  }
};

template <typename scalar_t>
void flash_fwd(const AttentionParams& p) {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  const LocalBand band{p.key_offset, p.window_left, p.window_right};
  const int64_t kM = Traits::fwd_block_m(band.has_right(), p.seqlen_k);
  constexpr int64_t kN = Traits::kFwdBlockN;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int64_t num_m = (Sq + kM - 1) / kM;
  const acc_t s_scale = static_cast<acc_t>(p.scale) * static_cast<acc_t>(kLog2e);
  const bool dropout = p.dropout_p > 0.0;
  const acc_t keep_scale = static_cast<acc_t>(1.0 / (1.0 - p.dropout_p));
  const bool convert_whole_head =
      Traits::kConvert && Sk * (D + Dv) <= Traits::kMaxConvertedHeadElems;

  at::parallel_for(0, p.batch * p.heads * num_m, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> q_buf(Traits::kConvert ? kM * D : 0), s_buf(kM * kN), o_buf(kM * Dv);
    const bool per_tile = Traits::kConvert && !convert_whole_head;
    Buffer<acc_t> k_buf(per_tile ? kN * D : 0), v_buf(per_tile ? kN * Dv : 0);
    ConvertedHead<scalar_t, acc_t> head_kv(convert_whole_head ? Sk : 0, D, Dv);
    Buffer<uint8_t> keep(dropout ? kM * kN : 0);
    std::vector<SoftmaxState<acc_t>> state(kM);

    for (int64_t task = begin; task < end; ++task) {
      // ---- prologue: this task's rows, the keys they may see, the query tile
      const int64_t mb = task % num_m, bh = task / num_m;
      const int64_t b = bh / p.heads, h = bh % p.heads, hk = h / p.group();
      const int64_t i0 = mb * kM, m = std::min(kM, Sq - i0);
      const int64_t n_begin = band.key_begin(i0, Sk), n_end = band.key_end(i0 + m, Sk);

      const auto* q = row_ptr(static_cast<const scalar_t*>(p.q), p.q_batch_stride,
                              p.q_head_stride, p.q_row_stride, b, h, i0);
      const auto* k = row_ptr(static_cast<const scalar_t*>(p.k), p.k_batch_stride,
                              p.k_head_stride, p.k_row_stride, b, hk, 0);
      const auto* v = row_ptr(static_cast<const scalar_t*>(p.v), p.v_batch_stride,
                              p.v_head_stride, p.v_row_stride, b, hk, 0);
      int64_t ldq;
      const acc_t* qt = load_tile(q, p.q_row_stride, m, D, q_buf.get(), &ldq);
      if (convert_whole_head && n_begin < n_end) {
        head_kv.ensure(b * p.kv_heads + hk, k, p.k_row_stride, v, p.v_row_stride, D, Dv,
                       n_begin, n_end);
      }
      std::fill(o_buf.data.begin(), o_buf.data.begin() + m * Dv, acc_t(0));
      std::fill(state.begin(), state.begin() + m, SoftmaxState<acc_t>{});

      // ---- main loop over key blocks; tiles crossing the band's edge are masked per element
      for (int64_t j0 = n_begin; j0 < n_end; j0 += kN) {
        const int64_t n = std::min(kN, n_end - j0);
        int64_t ldk = D, ldv = Dv;
        const acc_t *kt, *vt;
        if (convert_whole_head) {
          kt = head_kv.k.get() + j0 * D;
          vt = head_kv.v.get() + j0 * Dv;
        } else {
          kt = load_tile(k + j0 * p.k_row_stride, p.k_row_stride, n, D, k_buf.get(), &ldk);
          vt = load_tile(v + j0 * p.v_row_stride, p.v_row_stride, n, Dv, v_buf.get(), &ldv);
        }
        acc_t* s = s_buf.get();
        gemm(false, true, m, n, D, acc_t(1), qt, ldq, kt, ldk, acc_t(0), s, kN);
        // Scores to the log2 domain, then masks (which expect it), then each row's max.
        const bool band_partial = !band.tile_unmasked(i0, i0 + m, j0, j0 + n);
        const bool masked = band_partial || p.mask_kind != MaskKind::kNone;
        if (masked) {
          for (int64_t r = 0; r < m; ++r) scale_row(s + r * kN, n, s_scale);
          mask_tile(p, b, h, i0, m, j0, n, band_partial, s, kN);
        }
        if (dropout) dropout_tile(p, b, h, i0, m, j0, n, keep.get());
        for (int64_t r = 0; r < m; ++r) {
          acc_t* sr = s + r * kN;
          const acc_t block_max = masked ? row_max(sr, n) : scale_row_max(sr, n, s_scale);
          const acc_t factor = state[r].rescale_to(block_max);
          state[r].sum += exp2_shift_sum(sr, n, state[r].shift());
          if (factor != acc_t(1)) scale_row(o_buf.get() + r * Dv, Dv, factor);
          if (dropout) apply_keep(sr, keep.get() + r * n, n, keep_scale);
        }
        gemm(false, false, m, Dv, n, acc_t(1), s, kN, vt, ldv, acc_t(1), o_buf.get(), Dv);
      }

      // ---- epilogue: normalize, store, log-sum-exp (rows that saw no key give 0 / -inf)
      auto* o = row_ptr(static_cast<scalar_t*>(p.out), p.o_batch_stride, p.o_head_stride,
                        p.o_row_stride, b, h, i0);
      float* lse = p.lse + (b * p.heads + h) * Sq + i0;
      for (int64_t r = 0; r < m; ++r) {
        store_row(o_buf.get() + r * Dv, o + r * p.o_row_stride, Dv, state[r].inv_sum());
        lse[r] = state[r].lse();
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> attention_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& rng_state,
    std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    std::optional<int64_t> key_offset, double dropout_p) {
  constexpr const char* kOp = "attn_ext.attention";
  check_cpu_support(kOp);
  PreparedInputs in = prepare_attention(
      kOp, q, k, v,
      {attn_mask, scale, causal, window_left, window_right, key_offset, dropout_p, rng_state});
  AttentionParams& p = in.params;
  auto [out, lse] = allocate_outputs(p, q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp, [&] { flash_fwd<scalar_t>(p); });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) { m.impl("attention", &attention_cpu); }

}  // namespace attn_ext::cpu
