// CPU flash-attention forward: blocked over queries and keys with an online softmax;
// no Sq x Sk buffer, parallel over (batch, head, query block).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/constants.h"
#include "attention/inputs.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "common/cpu/blas.h"
#include "common/cpu/cpu_support.h"
#include "common/cpu/kernel_traits.h"
#include "attention/cpu/tile_mask.h"
#include "common/cpu/vec_math.h"
#ifdef ATTN_EXT_AVX2
#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/block_kernels.h"
#endif

namespace attn_ext::cpu {
namespace {

// Block products of the forward, one policy per backend. Each gives the query block's
// scaled scores S = scale * Q K^T for a key tile and folds P V into the output accumulator
// after rescaling it by the online softmax's per-row factor; the main loop is shared.

// BLAS on the inputs as they are (fp32 / fp64), or on fp32 copies of reduced-precision K and
// V: converted once per (batch, kv head) when the head is small enough, else per tile.
template <typename scalar_t>
struct BlasProducts {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  static constexpr int64_t kKeyAlign = 1;  // tiles may start at any key

  int64_t d, dv;
  bool whole_head;
  const scalar_t *k = nullptr, *v = nullptr;
  int64_t k_ld = 0, v_ld = 0, head = -1, lo = 0, hi = 0;
  Buffer<acc_t> k_conv, v_conv, k_tile, v_tile;
  const acc_t *kt = nullptr, *vt = nullptr;
  int64_t ldk = 0, ldv = 0;

  BlasProducts(const AttentionParams& p, int64_t block_n)
      : d(p.head_dim),
        dv(p.head_dim_v),
        whole_head(Traits::kConvert && p.seqlen_k * (d + dv) <= Traits::kMaxConvertedHeadElems),
        k_conv(whole_head ? p.seqlen_k * d : 0),
        v_conv(whole_head ? p.seqlen_k * dv : 0),
        k_tile(Traits::kConvert && !whole_head ? block_n * d : 0),
        v_tile(Traits::kConvert && !whole_head ? block_n * dv : 0) {}

  // Keys [n_begin, n_end) of head `head_id` (rows k / v) are about to be used.
  void load_head(int64_t head_id, const scalar_t* k_rows, int64_t k_stride, const scalar_t* v_rows,
                 int64_t v_stride, int64_t n_begin, int64_t n_end) {
    k = k_rows, v = v_rows, k_ld = k_stride, v_ld = v_stride;
    if (!whole_head || n_begin >= n_end) return;
    // Consecutive query blocks of one head ask for growing (causal) or equal key ranges.
    if (head_id != head || n_begin < lo || n_begin > hi) head = head_id, lo = hi = n_begin;
    for (; hi < n_end; ++hi) {
      load_row(k + hi * k_ld, k_conv.get() + hi * d, d, acc_t(1));
      load_row(v + hi * v_ld, v_conv.get() + hi * dv, dv, acc_t(1));
    }
  }

  void load_tile(int64_t j0, int64_t n) {
    if (whole_head) {
      kt = k_conv.get() + j0 * d, vt = v_conv.get() + j0 * dv, ldk = d, ldv = dv;
    } else {
      kt = cpu::load_tile(k + j0 * k_ld, k_ld, n, d, k_tile.get(), &ldk);
      vt = cpu::load_tile(v + j0 * v_ld, v_ld, n, dv, v_tile.get(), &ldv);
    }
  }

  void scores(const acc_t* q, int64_t ldq, int64_t m, int64_t n, acc_t scale, acc_t* s,
              int64_t lds) const {
    gemm(false, true, m, n, d, acc_t(1), q, ldq, kt, ldk, acc_t(0), s, lds);
    for (int64_t r = 0; r < m; ++r) scale_row(s + r * lds, n, scale);
  }

  void accumulate(const acc_t* pm, int64_t ldp, int64_t m, int64_t n, const acc_t* factor,
                  acc_t* o) const {
    for (int64_t r = 0; r < m; ++r)
      if (factor[r] != acc_t(1)) scale_row(o + r * dv, dv, factor[r]);
    gemm(false, false, m, dv, n, acc_t(1), pm, ldp, vt, ldv, acc_t(1), o, dv);
  }
};

#ifdef ATTN_EXT_AVX2
// Register-blocked products (block_kernels(): AVX-512 or AVX2) on K / V packed into 16-wide
// panels (float accumulation only): once per (batch, kv head) when the packed head fits the
// per-thread budget, else per tile. Tiles start at multiples of the panel width so that
// whole-head panels line up.
template <typename scalar_t>
struct PackedProducts {
  using Traits = FlashTraits<scalar_t>;
  static constexpr int64_t kKeyAlign = avx2::kCols;

  int64_t d, dv, dv_pad, sk, sk_pad;
  bool whole_head;
  const scalar_t *k = nullptr, *v = nullptr;
  int64_t k_ld = 0, v_ld = 0, head = -1, lo = 0, hi = 0;
  // Keys the panels hold: the whole head, or one tile. A value panel (16 features) spans them.
  int64_t panel_keys, v_panel_stride;
  Buffer<float> k_panels, v_panels;
  const float* kp = nullptr;
  const float* vp = nullptr;
  const BlockKernels& kernels = block_kernels();

  PackedProducts(const AttentionParams& p, int64_t block_n)
      : d(p.head_dim),
        dv(p.head_dim_v),
        dv_pad(avx2::round_up_cols(dv)),
        sk(p.seqlen_k),
        sk_pad(avx2::round_up_cols(p.seqlen_k)),
        whole_head(sk_pad * (d + dv_pad) <= Traits::kMaxPackedHeadElems),
        panel_keys(whole_head ? sk_pad : block_n),
        v_panel_stride(panel_keys * avx2::kCols),
        k_panels(panel_keys * d),
        v_panels(panel_keys * dv_pad) {}

  void load_head(int64_t head_id, const scalar_t* k_rows, int64_t k_stride, const scalar_t* v_rows,
                 int64_t v_stride, int64_t n_begin, int64_t n_end) {
    k = k_rows, v = v_rows, k_ld = k_stride, v_ld = v_stride;
    if (!whole_head || n_begin >= n_end) return;
    if (head_id != head || n_begin < lo || n_begin > hi) head = head_id, lo = hi = n_begin;
    // Whole panels only (the last one zero-padded), so a later, longer range extends them.
    const int64_t stop = std::min(avx2::round_up_cols(n_end), sk_pad);
    if (hi >= stop) return;
    const int64_t n = std::min(stop, sk) - hi;
    avx2::pack_key_panels(k + hi * k_ld, k_ld, n, d, k_panels.get() + hi * d);
    avx2::pack_value_panels(v + hi * v_ld, v_ld, n, dv, v_panels.get() + hi * avx2::kCols,
                            v_panel_stride);
    hi = stop;
  }

  void load_tile(int64_t j0, int64_t n) {
    if (whole_head) {
      kp = k_panels.get() + j0 * d;
      vp = v_panels.get() + j0 * avx2::kCols;
    } else {
      avx2::pack_key_panels(k + j0 * k_ld, k_ld, n, d, k_panels.get());
      avx2::pack_value_panels(v + j0 * v_ld, v_ld, n, dv, v_panels.get(), v_panel_stride);
      kp = k_panels.get(), vp = v_panels.get();
    }
  }

  void scores(const float* q, int64_t ldq, int64_t m, int64_t n, float scale, float* s,
              int64_t lds) const {
    kernels.scores(q, ldq, m, kp, n, d, scale, s, lds);
  }

  void accumulate(const float* pm, int64_t ldp, int64_t m, int64_t n, const float* factor,
                  float* o) const {
    kernels.pv(pm, ldp, m, vp, v_panel_stride, n, dv, factor, o, dv);
  }
};
#endif

template <typename scalar_t, typename Products>
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

  at::parallel_for(0, p.batch * p.heads * num_m, 1, [&](int64_t begin, int64_t end) {
    Products prod(p, kN);
    Buffer<acc_t> q_buf(Traits::kConvert ? kM * D : 0), s_buf(kM * kN), o_buf(kM * Dv);
    Buffer<acc_t> factor(kM);
    Buffer<uint8_t> keep(dropout ? kM * kN : 0);
    std::vector<SoftmaxState<acc_t>> state(kM);

    for (int64_t task = begin; task < end; ++task) {
      // ---- prologue: this task's rows, the keys they may see, the query tile
      const int64_t mb = task % num_m, bh = task / num_m;
      const int64_t b = bh / p.heads, h = bh % p.heads, hk = h / p.group();
      const int64_t i0 = mb * kM, m = std::min(kM, Sq - i0);
      const int64_t n_end = band.key_end(i0 + m, Sk);
      const int64_t n_begin = band.key_begin(i0, Sk) / Products::kKeyAlign * Products::kKeyAlign;

      const auto* q = row_ptr(static_cast<const scalar_t*>(p.q), p.q_batch_stride, p.q_head_stride,
                              p.q_row_stride, b, h, i0);
      int64_t ldq;
      const acc_t* qt = load_tile(q, p.q_row_stride, m, D, q_buf.get(), &ldq);
      prod.load_head(b * p.kv_heads + hk,
                     row_ptr(static_cast<const scalar_t*>(p.k), p.k_batch_stride, p.k_head_stride,
                             p.k_row_stride, b, hk, 0),
                     p.k_row_stride,
                     row_ptr(static_cast<const scalar_t*>(p.v), p.v_batch_stride, p.v_head_stride,
                             p.v_row_stride, b, hk, 0),
                     p.v_row_stride, n_begin, n_end);
      std::fill(o_buf.data.begin(), o_buf.data.begin() + m * Dv, acc_t(0));
      std::fill(state.begin(), state.begin() + m, SoftmaxState<acc_t>{});

      // ---- main loop over key blocks; tiles crossing the band's edge are masked per element
      for (int64_t j0 = n_begin; j0 < n_end; j0 += kN) {
        const int64_t n = std::min(kN, n_end - j0);
        acc_t* s = s_buf.get();
        prod.load_tile(j0, n);
        prod.scores(qt, ldq, m, n, s_scale, s, kN);
        // Scaled scores (log2 domain), then masks (which expect it), then each row's max.
        const bool band_partial = !band.tile_unmasked(i0, i0 + m, j0, j0 + n);
        if (band_partial || p.mask_kind != MaskKind::kNone)
          mask_tile<scalar_t>(p, b, h, i0, m, j0, n, band_partial, s, kN);
        if (dropout) dropout_tile(p, b, h, i0, m, j0, n, keep.get());
        for (int64_t r = 0; r < m; ++r) {
          acc_t* sr = s + r * kN;
          factor.get()[r] = state[r].rescale_to(row_max(sr, n));
          state[r].sum += exp2_shift_sum(sr, n, state[r].shift());
          if (dropout) apply_keep(sr, keep.get() + r * n, n, keep_scale);
        }
        prod.accumulate(s, kN, m, n, factor.get(), o_buf.get());
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

// The packed products for float accumulation once the query blocks of a head are
// enough to amortize packing it; BLAS otherwise (fp64, other ISAs, a few query rows).
template <typename scalar_t>
void flash_fwd(const AttentionParams& p) {
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<typename FlashTraits<scalar_t>::acc_t, float>) {
    if (p.seqlen_q >= FlashTraits<scalar_t>::kPackedMinQueries)
      return flash_fwd<scalar_t, PackedProducts<scalar_t>>(p);
  }
#endif
  flash_fwd<scalar_t, BlasProducts<scalar_t>>(p);
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

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention", &attention_cpu);
}

}  // namespace attn_ext::cpu
