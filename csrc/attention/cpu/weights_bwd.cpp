// CPU backward of the probabilities (attention_weights_backward): with P the (B, H, Sq, Sk)
// probabilities and dP their gradient, dS = P (dP - delta), delta_i = sum_j P_ij dP_ij, then
// dq = scale dS K and dk = scale sum over the group dS^T Q. ATen's form converts both Sq x Sk
// inputs to the accumulation type, writes dS whole and reads it twice more for the two matmuls;
// here dS is formed tile by tile in cache from the inputs as they are, twice: once by query rows
// (delta and dq, each task owning its rows), once by key columns (dk, each task owning its
// keys, with the rows' delta from the first pass), so no task sums another's results. With
// softcap, dS goes on through c = softcap tanh(s / softcap) (score_mod.h): times 1 - tanh^2 of
// the tile's scores, recomputed from the Q and K tiles the products read anyway.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention/inputs.h"
#include "attention/score_mod.h"
#include "common/cpu/blas.h"
#include "common/cpu/cpu_support.h"
#include "common/cpu/kernel_traits.h"
#include "common/cpu/vec_math.h"
#include "common/dispatch.h"

namespace attn_ext::cpu {
namespace {

// Tiles: kRows query rows by kKeys keys of dS (128 KiB of fp32) with the K or Q tile beside it
// in L2; the products run on BLAS.
constexpr int64_t kRows = 128;
constexpr int64_t kKeys = 256;

// A (B, H, Sq, Sk) input whose rows are read in place (last dimension contiguous; any other
// strides, a gradient broadcast over heads included).
template <typename scalar_t>
struct RowView {
  const scalar_t* base;
  int64_t sb, sh, sq;
  explicit RowView(const at::Tensor& t)
      : base(t.const_data_ptr<scalar_t>()), sb(t.stride(0)), sh(t.stride(1)), sq(t.stride(2)) {}
  const scalar_t* row(int64_t b, int64_t h, int64_t i) const {
    return base + b * sb + h * sh + i * sq;
  }
};

// ds[r, j] *= d softcap(s) / d s for the tile's scores s = scale q_r . k_j (m rows of qt, n keys
// of kt, ld ldq / ldk), formed in s_buf (ld ld, as ds).
template <typename acc_t>
void softcap_chain(const ScoreMod<acc_t>& mod, acc_t scale, const acc_t* qt, int64_t ldq, int64_t m,
                   const acc_t* kt, int64_t ldk, int64_t n, int64_t D, acc_t* s_buf, acc_t* ds,
                   int64_t ld) {
  gemm(false, true, m, n, D, scale, qt, ldq, kt, ldk, acc_t(0), s_buf, ld);
  for (int64_t r = 0; r < m; ++r) {
    acc_t* sr = s_buf + r * ld;
    acc_t* dr = ds + r * ld;
    softcap_row(sr, n, mod.cap);  // the forward's (vectorized) tanh
    for (int64_t j = 0; j < n; ++j) dr[j] *= mod.softcap_grad(sr[j]);
  }
}

template <typename scalar_t>
void weights_bwd(const AttentionParams& p, const at::Tensor& grad_weights,
                 const at::Tensor& weights, double scale, at::Tensor& dq, at::Tensor& dk) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = p.batch, H = p.heads, Hkv = p.kv_heads, G = H / Hkv;
  const int64_t Sq = p.seqlen_q, Sk = p.seqlen_k, D = p.head_dim;
  const RowView<scalar_t> P(weights), dP(grad_weights);
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  auto* dq_out = dq.mutable_data_ptr<scalar_t>();
  auto* dk_out = dk.mutable_data_ptr<scalar_t>();
  const acc_t sc = static_cast<acc_t>(scale);
  auto q_rows = [&](int64_t b, int64_t h, int64_t i0) {
    return row_ptr(q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, b, h, i0);
  };
  auto k_rows = [&](int64_t b, int64_t hk, int64_t j0) {
    return row_ptr(k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, b, hk, j0);
  };
  ScoreMod<acc_t> cap;  // softcap only (ALiBi and masks are constants of the scores)
  cap.cap = static_cast<acc_t>(p.softcap);
  const bool capped = cap.softcapped();
  std::vector<acc_t> delta(B * H * Sq);

  // dS[r, 0:n) of row i of (b, h), keys [j0, j0 + n), into ds (pbuf: scratch of n).
  auto ds_row = [&](int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n, acc_t d, acc_t* pbuf,
                    acc_t* ds) {
    load_row(P.row(b, h, i) + j0, pbuf, n, acc_t(1));
    load_row(dP.row(b, h, i) + j0, ds, n, acc_t(1));
    for (int64_t j = 0; j < n; ++j) ds[j] = pbuf[j] * (ds[j] - d);
  };

  // ---- by query rows: delta, then dq = scale dS K, key tile by key tile
  const int64_t num_m = (Sq + kRows - 1) / kRows;
  at::parallel_for(0, B * H * num_m, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> ds(kRows * kKeys), pbuf(kKeys), k_buf(kKeys * D), acc(kRows * D);
    Buffer<acc_t> s_buf(capped ? kRows * kKeys : 0), q_buf(capped ? kRows * D : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t mb = task % num_m, bh = task / num_m, b = bh / H, h = bh % H;
      const int64_t i0 = mb * kRows, m = std::min(kRows, Sq - i0);
      acc_t* d = delta.data() + bh * Sq + i0;
      for (int64_t r = 0; r < m; ++r)
        d[r] = row_dot<acc_t>(P.row(b, h, i0 + r), dP.row(b, h, i0 + r), Sk);
      std::fill(acc.get(), acc.get() + m * D, acc_t(0));
      const scalar_t* kh = k_rows(b, h / G, 0);
      int64_t ldq = 0;
      const acc_t* qt =
          capped ? load_tile(q_rows(b, h, i0), p.q_row_stride, m, D, q_buf.get(), &ldq) : nullptr;
      for (int64_t j0 = 0; j0 < Sk; j0 += kKeys) {
        const int64_t n = std::min(kKeys, Sk - j0);
        for (int64_t r = 0; r < m; ++r)
          ds_row(b, h, i0 + r, j0, n, d[r], pbuf.get(), ds.get() + r * kKeys);
        int64_t ldk = 0;
        const acc_t* kt =
            load_tile(kh + j0 * p.k_row_stride, p.k_row_stride, n, D, k_buf.get(), &ldk);
        if (capped) softcap_chain(cap, sc, qt, ldq, m, kt, ldk, n, D, s_buf.get(), ds.get(), kKeys);
        gemm(false, false, m, D, n, acc_t(1), ds.get(), kKeys, kt, ldk, acc_t(1), acc.get(), D);
      }
      scalar_t* out = dq_out + (bh * Sq + i0) * D;
      for (int64_t r = 0; r < m; ++r) store_row(acc.get() + r * D, out + r * D, D, sc);
    }
  });

  // ---- by key columns: dk = scale sum over the group's heads and rows of dS^T Q
  const int64_t num_n = (Sk + kKeys - 1) / kKeys;
  at::parallel_for(0, B * Hkv * num_n, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> ds(kRows * kKeys), pbuf(kKeys), q_buf(kRows * D), acc(kKeys * D);
    Buffer<acc_t> s_buf(capped ? kRows * kKeys : 0), k_buf(capped ? kKeys * D : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t nb = task % num_n, bhk = task / num_n, b = bhk / Hkv, hk = bhk % Hkv;
      const int64_t j0 = nb * kKeys, n = std::min(kKeys, Sk - j0);
      std::fill(acc.get(), acc.get() + n * D, acc_t(0));
      int64_t ldk = 0;
      const acc_t* kt =
          capped ? load_tile(k_rows(b, hk, j0), p.k_row_stride, n, D, k_buf.get(), &ldk) : nullptr;
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        const acc_t* d = delta.data() + (b * H + h) * Sq;
        for (int64_t i0 = 0; i0 < Sq; i0 += kRows) {
          const int64_t m = std::min(kRows, Sq - i0);
          for (int64_t r = 0; r < m; ++r)
            ds_row(b, h, i0 + r, j0, n, d[i0 + r], pbuf.get(), ds.get() + r * kKeys);
          int64_t ldq = 0;
          const acc_t* qt = load_tile(q_rows(b, h, i0), p.q_row_stride, m, D, q_buf.get(), &ldq);
          if (capped)
            softcap_chain(cap, sc, qt, ldq, m, kt, ldk, n, D, s_buf.get(), ds.get(), kKeys);
          gemm(true, false, n, D, m, acc_t(1), ds.get(), kKeys, qt, ldq, acc_t(1), acc.get(), D);
        }
      }
      scalar_t* out = dk_out + (bhk * Sk + j0) * D;
      for (int64_t r = 0; r < n; ++r) store_row(acc.get() + r * D, out + r * D, D, sc);
    }
  });
}

at::Tensor readable_rows(const at::Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

std::tuple<at::Tensor, at::Tensor> attention_weights_backward_cpu(
    const at::Tensor& grad_weights, const at::Tensor& weights, const at::Tensor& q,
    const at::Tensor& k, std::optional<double> scale, double softcap) {
  constexpr const char* kOp = "attn_ext.attention_weights_backward";
  check_cpu_support(kOp);
  PreparedInputs in = prepare_probabilities_backward(kOp, grad_weights, weights, q, k, softcap);
  const AttentionParams& p = in.params;
  const std::vector<int64_t> dq_shape{p.batch, p.heads, p.seqlen_q, p.head_dim},
      dk_shape{p.batch, p.kv_heads, p.seqlen_k, p.head_dim};
  if (p.batch * p.heads * p.seqlen_q * p.seqlen_k == 0 || p.kv_heads == 0) {
    return {at::zeros(dq_shape, q.options()), at::zeros(dk_shape, q.options())};
  }
  // Written whole: every (batch, head, query block) task its dq rows, every (batch, kv head,
  // key block) task its dk rows.
  at::Tensor dq = at::empty(dq_shape, q.options()), dk = at::empty(dk_shape, q.options());
  const double sc = scale.has_value() ? *scale : p.scale;
  const at::Tensor g = readable_rows(grad_weights), w = readable_rows(weights);
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp,
                             [&] { weights_bwd<scalar_t>(p, g, w, sc, dq, dk); });
  return {dq, dk};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_weights_backward", &attention_weights_backward_cpu);
}

}  // namespace attn_ext::cpu
