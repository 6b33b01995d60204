// CPU tpa_decode_attention (Tensor Product Attention decoding): queries against the cached
// factors, never forming the keys or values. Per key tile of kTile tokens, with the rows of a
// task being (head, query) pairs of one sequence:
//   G = B_K (tile * R_K, D) . Q^T (D, rows)          -- one GEMM
//   s[row, t] = scale k_scale log2e sum_r A_K[t, r, h] G[(t, r), row]; online softmax over t
//   W[row, (t, r)] = p[row, t] v_scale A_V[t, r, h]
//   O (rows, D) += W . B_V (tile * R_V, D)           -- one GEMM
// Short batches split the tokens across tasks; the partial states merge with
// SoftmaxState::merge as in decode_attention.
#include <algorithm>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/constants.h"
#include "common/dispatch.h"
#include "common/online_softmax.h"
#include "compression/tpa_inputs.h"
#include "common/cpu/blas.h"
#include "common/cpu/cpu_support.h"
#include "common/cpu/kernel_traits.h"
#include "common/cpu/split_kv.h"
#include "common/cpu/vec_math.h"

namespace attn_ext::cpu {
namespace {

// Rows per task: all heads of up to kMaxRows / H queries, so a (query, head) block shares
// every factor tile it reads; 128 rows keep G, the scores and W of a 128-token tile in L2.
constexpr int64_t kMaxRows = 128;
constexpr int64_t kTile = 128;

struct Geometry {
  int64_t queries_per_block, blocks_per_seq, splits;
};

Geometry geometry(const TpaDecodeParams& p) {
  const int64_t qpb = std::max<int64_t>(1, kMaxRows / std::max<int64_t>(p.heads, 1));
  const int64_t blocks = ceil_div(p.seqlen_q, qpb);
  const int64_t max_len = p.batch ? *std::max_element(p.lengths, p.lengths + p.batch) : 0;
  return {qpb, blocks,
          auto_splits(p.batch * blocks, max_len, FlashTraits<float>::kMinSplitKeys,
                      FlashTraits<float>::kTasksPerThread)};
}

template <typename scalar_t>
void tpa_decode_kernel(const TpaDecodeParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t H = p.heads, S = p.seqlen_q, D = p.head_dim, RK = p.rank_k, RV = p.rank_v;
  const Geometry g = geometry(p);
  const int64_t splits = g.splits;
  const acc_t s_scale = static_cast<acc_t>(p.scale * p.k_scale) * static_cast<acc_t>(kLog2e);
  const acc_t v_scale = static_cast<acc_t>(p.v_scale);
  const int64_t max_rows = H * g.queries_per_block;
  // Partial results of every (sequence, row, split) when the tokens are split.
  const int64_t slots = splits > 1 ? p.batch * H * S * splits : 0;
  std::vector<acc_t> part_o(slots * D);
  std::vector<SoftmaxState<acc_t>> part_state(slots);

  at::parallel_for(0, p.batch * g.blocks_per_seq * splits, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> qm(max_rows * D), gt(kTile * RK * max_rows), st(max_rows * kTile);
    Buffer<acc_t> wt(max_rows * kTile * RV), o(max_rows * D);
    constexpr bool kConvert = !std::is_same_v<scalar_t, acc_t>;
    Buffer<acc_t> bk_buf(kConvert ? kTile * RK * D : 0), bv_buf(kConvert ? kTile * RV * D : 0);
    std::vector<SoftmaxState<acc_t>> state(max_rows);

    for (int64_t task = begin; task < end; ++task) {
      // ---- prologue: the sequence, its queries [i0, i0 + m) x all heads, this split's tokens
      const int64_t split = task % splits, blk = (task / splits) % g.blocks_per_seq;
      const int64_t b = task / (splits * g.blocks_per_seq);
      const int64_t i0 = blk * g.queries_per_block, m = std::min(g.queries_per_block, S - i0);
      const int64_t rows = H * m;  // row h * m + (i - i0)
      const int64_t len = p.lengths[b];
      const int64_t visible = std::clamp<int64_t>(len - S + i0 + m, 0, len);  // last row's view
      const auto [j_begin, j_end] = split_range(0, visible, splits, split, kTile);

      const auto* q = static_cast<const scalar_t*>(p.q) + b * p.q_batch_stride;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < m; ++i)
          load_row(q + h * p.q_head_stride + (i0 + i) * p.q_row_stride, qm.get() + (h * m + i) * D,
                   D, acc_t(1));
      std::fill(o.data.begin(), o.data.begin() + rows * D, acc_t(0));
      std::fill(state.begin(), state.begin() + rows, SoftmaxState<acc_t>{});
      const auto* ak = static_cast<const scalar_t*>(p.a_k) + b * p.ak_batch_stride;
      const auto* bk = static_cast<const scalar_t*>(p.b_k) + b * p.bk_batch_stride;
      const auto* av = static_cast<const scalar_t*>(p.a_v) + b * p.av_batch_stride;
      const auto* bv = static_cast<const scalar_t*>(p.b_v) + b * p.bv_batch_stride;

      // ---- main loop over token tiles
      for (int64_t j0 = j_begin; j0 < j_end; j0 += kTile) {
        const int64_t n = std::min(kTile, j_end - j0);
        int64_t ldbk, ldbv;
        const acc_t* bkt = load_tile(bk + j0 * RK * p.bk_row_stride, p.bk_row_stride, n * RK, D,
                                     bk_buf.get(), &ldbk);
        const acc_t* bvt = load_tile(bv + j0 * RV * p.bv_row_stride, p.bv_row_stride, n * RV, D,
                                     bv_buf.get(), &ldbv);
        // G[(t, r), row] = b_k[t, r] . q[row]
        gemm(false, true, n * RK, rows, D, acc_t(1), bkt, ldbk, qm.get(), D, acc_t(0), gt.get(),
             rows);
        // scores in the log2 domain, causal per query: token t is visible to query i when
        // t <= len - S + i
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t i = 0; i < m; ++i) {
            const int64_t row = h * m + i, last = len - S + i0 + i;
            acc_t* sr = st.get() + row * kTile;
            for (int64_t t = 0; t < n; ++t) {
              const auto* akr = ak + (j0 + t) * RK * p.ak_row_stride + h;
              const acc_t* gr = gt.get() + t * RK * rows + row;
              acc_t acc = 0;
              for (int64_t r = 0; r < RK; ++r)
                acc += static_cast<acc_t>(akr[r * p.ak_row_stride]) * gr[r * rows];
              sr[t] = j0 + t <= last ? acc * s_scale : -std::numeric_limits<acc_t>::infinity();
            }
          }
        }
        // online softmax per row, then W[row, (t, r)] = p[row, t] v_scale a_v[t, r, h]
        for (int64_t row = 0; row < rows; ++row) {
          acc_t* sr = st.get() + row * kTile;
          const acc_t factor = state[row].rescale_to(row_max(sr, n));
          state[row].sum += exp2_shift_sum(sr, n, state[row].shift());
          if (factor != acc_t(1)) scale_row(o.get() + row * D, D, factor);
          const int64_t h = row / m;
          acc_t* wr = wt.get() + row * n * RV;
          for (int64_t t = 0; t < n; ++t) {
            const auto* avr = av + (j0 + t) * RV * p.av_row_stride + h;
            const acc_t pt = sr[t] * v_scale;
            for (int64_t r = 0; r < RV; ++r)
              wr[t * RV + r] = pt * static_cast<acc_t>(avr[r * p.av_row_stride]);
          }
        }
        gemm(false, false, rows, D, n * RV, acc_t(1), wt.get(), n * RV, bvt, ldbv, acc_t(1),
             o.get(), D);
      }

      // ---- epilogue: the result, or this split's partial for the merge
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < m; ++i) {
          const int64_t row = h * m + i;
          if (splits == 1) {
            auto* out = static_cast<scalar_t*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
                        (i0 + i) * p.o_row_stride;
            store_row(o.get() + row * D, out, D, state[row].inv_sum());
            p.lse[(b * H + h) * S + i0 + i] = state[row].lse();
          } else {
            const int64_t slot = ((b * H + h) * S + i0 + i) * splits + split;
            std::copy_n(o.get() + row * D, D, part_o.data() + slot * D);
            part_state[slot] = state[row];
          }
        }
      }
    }
  });
  if (splits == 1) return;

  // ---- merge of the splits, row by row in a fixed order (deterministic)
  at::parallel_for(0, p.batch * H * S, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> acc(D);
    for (int64_t row = begin; row < end; ++row) {
      const SoftmaxState<acc_t> total = merge_row_splits(
          part_state.data() + row * splits, part_o.data() + row * splits * D, splits, D, acc.get());
      const int64_t b = row / (H * S), h = (row / S) % H, i = row % S;
      auto* out = static_cast<scalar_t*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
                  i * p.o_row_stride;
      store_row(acc.get(), out, D, total.inv_sum());
      p.lse[row] = total.lse();
    }
  });
}

std::tuple<at::Tensor, at::Tensor> tpa_decode_attention_cpu(
    const at::Tensor& q, const at::Tensor& a_k, const at::Tensor& b_k, const at::Tensor& a_v,
    const at::Tensor& b_v, const at::Tensor& cache_seqlens, std::optional<double> scale,
    std::optional<double> k_scale, std::optional<double> v_scale) {
  constexpr const char* kOp = "attn_ext.tpa_decode_attention";
  check_cpu_support(kOp);
  PreparedTpaDecode in = prepare_tpa_decode(kOp, q, a_k, b_k, a_v, b_v, cache_seqlens, scale,
                                            k_scale, v_scale, /*check_values=*/true);
  TpaDecodeParams& p = in.params;
  at::Tensor out = at::empty({p.batch, p.heads, p.seqlen_q, p.head_dim}, q.options());
  at::Tensor lse = at::empty({p.batch, p.heads, p.seqlen_q}, q.options().dtype(at::kFloat));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.lengths = in.lengths.const_data_ptr<int64_t>();
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp, [&] { tpa_decode_kernel<scalar_t>(p); });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("tpa_decode_attention", &tpa_decode_attention_cpu);
}

}  // namespace attn_ext::cpu
