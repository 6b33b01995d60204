// CPU kernels of the attention-state merge: two partial attention results over disjoint key
// sets (split-KV halves, ring-attention blocks) combined by their log-sum-exps, out of place
// with a backward, or accumulated in place. Memory-bound: each row's weights are formed once
// from the two lses, then the Dv elements stream through a branch-free loop that vectorizes.
// The weights and sums are taken in the accumulation type (fp32 for bfloat16 / float16,
// fp64 for fp64).
#include <algorithm>
#include <cmath>
#include <limits>
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention/merge_inputs.h"
#include "common/dispatch.h"

namespace attn_ext::merge {
namespace {

// Elements per parallel chunk: below this the threading overhead outweighs the work.
constexpr int64_t kGrainElems = 32768;

template <typename Fn>
void for_each_row(const RowShape& s, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, s.dv));
  at::parallel_for(0, s.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

// The merge weights of one row. An empty state (lse = -inf) gets weight 0 and is never read;
// a NaN lse makes both weights and the lse NaN (propagated, never hidden).
template <typename acc_t>
struct Weights {
  acc_t wa, wb, lse;

  static Weights of(acc_t la, acc_t lb) {
    constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
    if (std::isnan(la) || std::isnan(lb)) {
      const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
      return {nan, nan, nan};
    }
    const acc_t m = std::max(la, lb);
    if (m == -kInf) return {acc_t(0), acc_t(0), -kInf};
    // Shifted by the larger lse, so the larger weight's exponential is exp(0) = 1.
    const acc_t ea = std::exp(la - m), eb = std::exp(lb - m);
    const acc_t sum = ea + eb;
    return {ea / sum, eb / sum, m + std::log(sum)};
  }
};

template <typename T>
inline const T* row_in(const void* base, int64_t off) {
  return static_cast<const T*>(base) + off;
}
template <typename T>
inline T* row_out(void* base, int64_t off) {
  return static_cast<T*>(base) + off;
}

// out = w_a a + w_b b over one row; a term whose weight is 0 is skipped, so an empty state's
// out (zeros, or an accumulator never written) is not read.
template <typename acc_t, typename a_t, typename b_t, typename out_t>
inline void combine_row(const a_t* a, const b_t* b, out_t* o, int64_t dv, acc_t wa, acc_t wb) {
  if (wa != acc_t(0) && wb != acc_t(0)) {
    for (int64_t c = 0; c < dv; ++c)
      o[c] = static_cast<out_t>(wa * static_cast<acc_t>(a[c]) + wb * static_cast<acc_t>(b[c]));
  } else if (wb != acc_t(0)) {
    for (int64_t c = 0; c < dv; ++c) o[c] = static_cast<out_t>(wb * static_cast<acc_t>(b[c]));
  } else if (wa != acc_t(0)) {
    for (int64_t c = 0; c < dv; ++c) o[c] = static_cast<out_t>(wa * static_cast<acc_t>(a[c]));
  } else {
    for (int64_t c = 0; c < dv; ++c) o[c] = out_t(0);
  }
}

// a_t: out_a's (and out's) element type, b_t: out_b's; in place, a_t is the accumulator's
// (b_t, or float for a bfloat16 / float16 b_t).
template <typename a_t, typename b_t, typename lse_t>
void merge_kernel(const MergeParams& p) {
  using acc_t = at::opmath_type<b_t>;
  const RowShape& s = p.shape;
  for_each_row(s, [&](int64_t r) {
    const acc_t la = static_cast<acc_t>(*row_in<lse_t>(p.lse_a, s.offset(r, p.lse_a_st)));
    const acc_t lb = static_cast<acc_t>(*row_in<lse_t>(p.lse_b, s.offset(r, p.lse_b_st)));
    const Weights<acc_t> w = Weights<acc_t>::of(la, lb);
    combine_row<acc_t>(row_in<a_t>(p.out_a, s.offset(r, p.out_a_st)),
                       row_in<b_t>(p.out_b, s.offset(r, p.out_b_st)),
                       row_out<a_t>(p.out, s.offset(r, p.out_st)), s.dv, w.wa, w.wb);
    *row_out<lse_t>(p.lse, s.offset(r, p.lse_st)) = static_cast<lse_t>(w.lse);
  });
}

template <typename scalar_t, typename lse_t>
void merge_backward_kernel(const MergeBackwardParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const MergeParams& f = p.fwd;
  const RowShape& s = f.shape;
  for_each_row(s, [&](int64_t r) {
    const acc_t la = static_cast<acc_t>(*row_in<lse_t>(f.lse_a, s.offset(r, f.lse_a_st)));
    const acc_t lb = static_cast<acc_t>(*row_in<lse_t>(f.lse_b, s.offset(r, f.lse_b_st)));
    const Weights<acc_t> w = Weights<acc_t>::of(la, lb);
    const acc_t gl =
        p.grad_lse ? static_cast<acc_t>(*row_in<lse_t>(p.grad_lse, s.offset(r, p.grad_lse_st)))
                   : acc_t(0);
    const scalar_t* g = row_in<scalar_t>(p.grad_out, s.offset(r, p.grad_out_st));
    const scalar_t* a = row_in<scalar_t>(f.out_a, s.offset(r, f.out_a_st));
    const scalar_t* b = row_in<scalar_t>(f.out_b, s.offset(r, f.out_b_st));
    const int64_t o = s.offset(r, f.out_st);
    scalar_t* ga = row_out<scalar_t>(p.grad_out_a, o);
    scalar_t* gb = row_out<scalar_t>(p.grad_out_b, o);
    for (int64_t c = 0; c < s.dv; ++c) {
      const acc_t gc = static_cast<acc_t>(g[c]);
      ga[c] = static_cast<scalar_t>(w.wa * gc);
      gb[c] = static_cast<scalar_t>(w.wb * gc);
    }
    // d lse_a = w_a (g . (out_a - out) + gl) = w_a w_b (g . out_a - g . out_b) + w_a gl; the
    // product term needs both states present (an empty state's out is not read).
    acc_t cross = 0;
    if (w.wa != acc_t(0) && w.wb != acc_t(0)) {
      acc_t dot = 0;
      for (int64_t c = 0; c < s.dv; ++c)
        dot += static_cast<acc_t>(g[c]) * (static_cast<acc_t>(a[c]) - static_cast<acc_t>(b[c]));
      cross = w.wa * w.wb * dot;
    }
    const int64_t lo = s.offset(r, f.lse_st);
    *row_out<lse_t>(p.grad_lse_a, lo) = static_cast<lse_t>(cross + w.wa * gl);
    *row_out<lse_t>(p.grad_lse_b, lo) = static_cast<lse_t>(-cross + w.wb * gl);
  });
}

// Runs fn with lse_t = float, or double for a float64 lse.
template <typename Fn>
void with_lse_type(at::ScalarType t, Fn&& fn) {
  if (t == at::kDouble) {
    fn(static_cast<double*>(nullptr));
  } else {
    fn(static_cast<float*>(nullptr));
  }
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cpu(const at::Tensor& out_a,
                                                              const at::Tensor& lse_a,
                                                              const at::Tensor& out_b,
                                                              const at::Tensor& lse_b) {
  constexpr const char* kOp = "attn_ext.merge_attention_states";
  at::Tensor out, lse;
  PreparedMerge in = prepare_merge(kOp, out_a, lse_a, out_b, lse_b, &out, &lse);
  ATTN_EXT_DISPATCH_FLOATING(out_a.scalar_type(), kOp, [&] {
    with_lse_type(lse_a.scalar_type(), [&](auto* tag) {
      merge_kernel<scalar_t, scalar_t, std::remove_pointer_t<decltype(tag)>>(in.params);
    });
  });
  return {out, lse};
}

void merge_attention_states_inplace_cpu(const at::Tensor& out, const at::Tensor& lse,
                                        const at::Tensor& out_other, const at::Tensor& lse_other) {
  constexpr const char* kOp = "attn_ext.merge_attention_states_";
  PreparedMerge in = prepare_merge_inplace(kOp, out, lse, out_other, lse_other);
  const bool fp32_acc = out.scalar_type() != out_other.scalar_type();
  ATTN_EXT_DISPATCH_FLOATING(out_other.scalar_type(), kOp, [&] {
    with_lse_type(lse.scalar_type(), [&](auto* tag) {
      using lse_t = std::remove_pointer_t<decltype(tag)>;
      if (fp32_acc) {
        merge_kernel<float, scalar_t, lse_t>(in.params);
      } else {
        merge_kernel<scalar_t, scalar_t, lse_t>(in.params);
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_attention_states_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& out_a,
    const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b) {
  constexpr const char* kOp = "attn_ext.merge_attention_states_backward";
  std::vector<at::Tensor> g;
  PreparedMergeBackward in =
      prepare_merge_backward(kOp, grad_out, grad_lse, out_a, lse_a, out_b, lse_b, &g);
  ATTN_EXT_DISPATCH_FLOATING(out_a.scalar_type(), kOp, [&] {
    with_lse_type(lse_a.scalar_type(), [&](auto* tag) {
      merge_backward_kernel<scalar_t, std::remove_pointer_t<decltype(tag)>>(in.params);
    });
  });
  return {g[0], g[1], g[2], g[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("merge_attention_states", &merge_attention_states_cpu);
  m.impl("merge_attention_states_", &merge_attention_states_inplace_cpu);
  m.impl("merge_attention_states_backward", &merge_attention_states_backward_cpu);
}

}  // namespace attn_ext::merge
