// CPU decode attention: Sq new queries per sequence against a KV cache with per-sequence
// lengths, bottom-right causal (query i of sequence b sits at key lengths[b] - Sq + i).
// The G = H / Hkv query heads that share a KV head are one row block, so every cache row is
// read once per block. Short batches split the key sequence: each split keeps its own
// online-softmax state, and the partial results are merged by SoftmaxState::merge.
// A paged cache is read through its block table, and gives the contiguous cache's result bit
// for bit. Blocks of at most kMaxDecodeRows rows (the common decode step: G * Sq small) run
// the products of decode_rows.h on the cache rows in place, a key tile being a list of row
// pointers. Larger blocks multiply with BLAS: pages of at least a key tile are read in place,
// tiles cut at page ends; smaller pages are gathered into the tile buffer (bf16 / fp16 tiles
// are converted into it anyway), so the GEMMs keep the contiguous kernel's tiles.
#include <algorithm>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/constants.h"
#include "decoding/decode_inputs.h"
#include "attention/inputs.h"
#include "common/dispatch.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "common/cpu/blas.h"
#include "common/cpu/cpu_support.h"
#include "common/cpu/kernel_traits.h"
#include "common/cpu/split_kv.h"
#include "common/cpu/vec_math.h"
#include "attention/score_mod.h"
#include "attention/cpu/tile_mask.h"
#include "decoding/cpu/decode_rows.h"

namespace attn_ext::cpu {
namespace {

// Where a task's partial result goes: straight to out / lse (one split), or to the split's
// slot of the workspace for the merge.
template <typename acc_t>
struct Partials {
  acc_t* o = nullptr;                    // (B * Hkv * rows, splits, Dv)
  SoftmaxState<acc_t>* state = nullptr;  // (B * Hkv * rows, splits)
};

// Rows [j0, j0 + n) of sequence b, gathered page by page from `base` (the cache at its KV
// head) into buf (n x cols, in the accumulation type).
template <typename scalar_t, typename acc_t>
const acc_t* gather_tile(const PageTable& pages, const scalar_t* base, int64_t page_stride,
                         int64_t row_stride, int64_t b, int64_t j0, int64_t n, int64_t cols,
                         acc_t* buf) {
  for (int64_t r = 0; r < n;) {
    const CacheSlot slot = pages.locate(b, j0 + r);
    const int64_t run = std::min(n - r, pages.page_size - slot.row);
    const scalar_t* src = base + slot.block * page_stride + slot.row * row_stride;
    for (int64_t i = 0; i < run; ++i)
      load_row(src + i * row_stride, buf + (r + i) * cols, cols, acc_t(1));
    r += run;
  }
  return buf;
}

// Pointers to rows [j0, j0 + n) of sequence b's K and V at KV head hk, page by page.
template <typename scalar_t>
void tile_rows(const DecodeParams& p, int64_t b, int64_t hk, int64_t j0, int64_t n,
               const scalar_t** k_rows, const scalar_t** v_rows) {
  for (int64_t r = 0; r < n;) {
    const CacheSlot slot = p.key_slot(b, j0 + r);
    const int64_t run = p.pages.paged() ? std::min(n - r, p.pages.page_size - slot.row) : n - r;
    const auto* k = row_ptr(static_cast<const scalar_t*>(p.k), p.k_batch_stride, p.k_head_stride,
                            p.k_row_stride, slot.block, hk, slot.row);
    const auto* v = row_ptr(static_cast<const scalar_t*>(p.v), p.v_batch_stride, p.v_head_stride,
                            p.v_row_stride, slot.block, hk, slot.row);
    for (int64_t i = 0; i < run; ++i) {
      k_rows[r + i] = k + i * p.k_row_stride;
      v_rows[r + i] = v + i * p.v_row_stride;
    }
    r += run;
  }
}

// Whether blocks of m rows run decode_rows.h's kernels (float accumulation, AVX2 builds).
template <typename acc_t>
constexpr bool decode_rows_in_place(int64_t m) {
#ifdef ATTN_EXT_AVX2
  return std::is_same_v<acc_t, float> && m <= avx2::kMaxDecodeRows;
#else
  return (void)m, false;
#endif
}

// S = Q K^T and O += P V for a block of m rows on rows in place (decode_rows.h); only
// blocks that decode_rows_in_place admits come here.
template <typename scalar_t, typename acc_t>
void scores_in_place(int64_t m, const acc_t* q, int64_t d, const scalar_t* const* keys, int64_t n,
                     acc_t* s, int64_t lds, const scalar_t* const* values, int64_t dv,
                     bool scattered) {
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float>)
    return avx2::dispatch_decode_rows(m, [&](auto rows) {
      avx2::decode_scores<decltype(rows)::value>(q, d, keys, n, d, s, lds, values, dv, scattered);
    });
#endif
  TORCH_INTERNAL_ASSERT(false, "decode_attention: no in-place products for this build and dtype");
}

template <typename scalar_t, typename acc_t>
void pv_in_place(int64_t m, const acc_t* p, int64_t ldp, const scalar_t* const* values, int64_t n,
                 int64_t dv, acc_t* o) {
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float>)
    return avx2::dispatch_decode_rows(m, [&](auto rows) {
      avx2::decode_pv<decltype(rows)::value>(p, ldp, values, n, dv, o, dv);
    });
#endif
  TORCH_INTERNAL_ASSERT(false, "decode_attention: no in-place products for this build and dtype");
}

template <typename scalar_t>
void decode_fwd(const DecodeParams& p, Partials<at::opmath_type<scalar_t>> partials) {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  constexpr int64_t kN = Traits::kDecodeBlockN;
  const int64_t G = p.group(), Sq = p.seqlen_q, D = p.head_dim, Dv = p.head_dim_v;
  const int64_t rows = G * Sq;  // row r = i * G + g: query i of head hk * G + g
  const int64_t kM = std::min(Traits::kDecodeBlockM, rows);
  const int64_t num_m = ceil_div(rows, kM), splits = p.num_splits;
  const acc_t log2e = static_cast<acc_t>(kLog2e);
  const acc_t s_scale = static_cast<acc_t>(p.scale) * log2e;
  const bool modified = p.softcap > 0.0 || p.alibi_slopes != nullptr;
  const bool in_place = decode_rows_in_place<acc_t>(kM);
  const bool gather = !in_place && p.pages.paged() && p.pages.page_size < kN;
  const bool buffered = !in_place && (Traits::kConvert || gather);

  at::parallel_for(0, p.batch * p.kv_heads * num_m * splits, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> q_buf(kM * D), s_buf(kM * kN), o_buf(kM * Dv);
    Buffer<acc_t> k_buf(buffered ? kN * D : 0), v_buf(buffered ? kN * Dv : 0);
    std::vector<const scalar_t*> k_rows(in_place ? kN : 0), v_rows(in_place ? kN : 0);
    std::vector<SoftmaxState<acc_t>> state(kM);

    for (int64_t task = begin; task < end; ++task) {
      // ---- prologue: the rows of this block, the keys they may see, this split's share
      const int64_t split = task % splits, mb = (task / splits) % num_m;
      const int64_t bk = task / (splits * num_m), b = bk / p.kv_heads, hk = bk % p.kv_heads;
      const int64_t r0 = mb * kM, m = std::min(kM, rows - r0);
      const int64_t i_begin = r0 / G, i_end = (r0 + m - 1) / G + 1;
      const int64_t len = p.lengths[b], first = p.first_key(b);
      const LocalBand band{len - Sq, p.window_left, p.window_right};
      const int64_t lo = std::max(band.key_begin(i_begin, len), first);
      const int64_t hi = std::max(band.key_end(i_end, len), lo);
      const auto [j_begin, j_end] = split_range(lo, hi, splits, split, kN);

      for (int64_t rr = 0; rr < m; ++rr) {
        const int64_t r = r0 + rr, i = r / G, h = hk * G + r % G;
        const auto* q = row_ptr(static_cast<const scalar_t*>(p.q), p.q_batch_stride,
                                p.q_head_stride, p.q_row_stride, b, h, i);
        load_row(q, q_buf.get() + rr * D, D, acc_t(1));
      }
      std::fill(o_buf.data.begin(), o_buf.data.begin() + m * Dv, acc_t(0));
      // A head's sink joins its rows' denominators once: in the first split only (the merge
      // adds the splits' sums).
      for (int64_t rr = 0; rr < m; ++rr)
        state[rr] = split == 0 ? initial_state<acc_t>(p, hk * G + (r0 + rr) % G, log2e)
                               : SoftmaxState<acc_t>{};

      // ---- main loop over key tiles; tiles crossing the band's edge are masked per element
      for (int64_t j0 = j_begin, n = 0; j0 < j_end; j0 += n) {
        n = std::min(kN, j_end - j0);
        acc_t* s = s_buf.get();
        const acc_t *kt = nullptr, *vt = nullptr;
        int64_t ldk = D, ldv = Dv;
        if (in_place) {
          tile_rows(p, b, hk, j0, n, k_rows.data(), v_rows.data());
          scores_in_place(m, q_buf.get(), D, k_rows.data(), n, s, kN, v_rows.data(), Dv,
                          p.pages.paged());
        } else if (gather) {
          const auto* k = static_cast<const scalar_t*>(p.k) + hk * p.k_head_stride;
          const auto* v = static_cast<const scalar_t*>(p.v) + hk * p.v_head_stride;
          kt = gather_tile(p.pages, k, p.k_batch_stride, p.k_row_stride, b, j0, n, D, k_buf.get());
          vt = gather_tile(p.pages, v, p.v_batch_stride, p.v_row_stride, b, j0, n, Dv, v_buf.get());
        } else {
          const CacheSlot slot = p.key_slot(b, j0);
          if (p.pages.paged()) n = std::min(n, p.pages.page_size - slot.row);
          const auto* k = row_ptr(static_cast<const scalar_t*>(p.k), p.k_batch_stride,
                                  p.k_head_stride, p.k_row_stride, slot.block, hk, slot.row);
          const auto* v = row_ptr(static_cast<const scalar_t*>(p.v), p.v_batch_stride,
                                  p.v_head_stride, p.v_row_stride, slot.block, hk, slot.row);
          kt = load_tile(k, p.k_row_stride, n, D, k_buf.get(), &ldk);
          vt = load_tile(v, p.v_row_stride, n, Dv, v_buf.get(), &ldv);
        }
        if (!in_place)
          gemm(false, true, m, n, D, acc_t(1), q_buf.get(), D, kt, ldk, acc_t(0), s, kN);
        // Scores to the log2 domain (see scale_row_max), modifiers (per head: a row block
        // spans G heads), band edges masked, rows' maxima.
        const bool band_partial = !band.tile_unmasked(i_begin, i_end, j0, j0 + n);
        const bool masked = band_partial || modified;
        if (masked) {
          constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
          for (int64_t rr = 0; rr < m; ++rr) {
            const int64_t r = r0 + rr, i = r / G;
            acc_t* sr = s + rr * kN;
            scale_row(sr, n, s_scale);
            if (modified) {
              const auto mod = ScoreMod<acc_t>::make(p, b, hk * G + r % G, len - Sq, log2e);
              modify_tile(mod, i, 1, j0, n, sr, kN);
            }
            if (band_partial)
              for (int64_t c = 0; c < n; ++c)
                if (!band.allowed(i, j0 + c)) sr[c] = kNegInf;
          }
        }
        for (int64_t rr = 0; rr < m; ++rr) {
          acc_t* sr = s + rr * kN;
          const acc_t block_max = masked ? row_max(sr, n) : scale_row_max(sr, n, s_scale);
          const acc_t factor = state[rr].rescale_to(block_max);
          state[rr].sum += exp2_shift_sum(sr, n, state[rr].shift());
          if (factor != acc_t(1)) scale_row(o_buf.get() + rr * Dv, Dv, factor);
        }
        if (in_place)
          pv_in_place(m, s, kN, v_rows.data(), n, Dv, o_buf.get());
        else
          gemm(false, false, m, Dv, n, acc_t(1), s, kN, vt, ldv, acc_t(1), o_buf.get(), Dv);
      }

      // ---- epilogue: the final result, or this split's partial for the merge
      for (int64_t rr = 0; rr < m; ++rr) {
        const int64_t r = r0 + rr, i = r / G, h = hk * G + r % G;
        if (splits == 1) {
          auto* o = row_ptr(static_cast<scalar_t*>(p.out), p.o_batch_stride, p.o_head_stride,
                            p.o_row_stride, b, h, i);
          store_row(o_buf.get() + rr * Dv, o, Dv, state[rr].inv_sum());
          p.lse[(b * p.heads + h) * Sq + i] = state[rr].lse();
        } else {
          const int64_t slot = (bk * rows + r) * splits + split;
          std::copy_n(o_buf.get() + rr * Dv, Dv, partials.o + slot * Dv);
          partials.state[slot] = state[rr];
        }
      }
    }
  });
}

// Folds the splits of every row into the final output with the shared online-softmax merge.
template <typename scalar_t>
void merge_splits(const DecodeParams& p, Partials<at::opmath_type<scalar_t>> partials) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t G = p.group(), Sq = p.seqlen_q, Dv = p.head_dim_v, rows = G * Sq;
  const int64_t splits = p.num_splits;
  at::parallel_for(0, p.batch * p.kv_heads * rows, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> acc(Dv);
    for (int64_t row = begin; row < end; ++row) {
      const SoftmaxState<acc_t> total = merge_row_splits(
          partials.state + row * splits, partials.o + row * splits * Dv, splits, Dv, acc.get());
      const int64_t bk = row / rows, r = row % rows;
      const int64_t b = bk / p.kv_heads, hk = bk % p.kv_heads, i = r / G, h = hk * G + r % G;
      auto* o = row_ptr(static_cast<scalar_t*>(p.out), p.o_batch_stride, p.o_head_stride,
                        p.o_row_stride, b, h, i);
      store_row(acc.get(), o, Dv, total.inv_sum());
      p.lse[(b * p.heads + h) * Sq + i] = total.lse();
    }
  });
}

template <typename scalar_t>
void decode(DecodeParams& p) {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  const int64_t rows = p.group() * p.seqlen_q;
  const int64_t blocks = p.batch * p.kv_heads * ceil_div(rows, Traits::kDecodeBlockM);
  if (p.num_splits == 0) {
    const int64_t max_len = *std::max_element(p.lengths, p.lengths + p.batch);
    p.num_splits = auto_splits(blocks, max_len, Traits::kMinSplitKeys, Traits::kTasksPerThread);
  }
  Partials<acc_t> partials;
  std::vector<acc_t> o_ws;
  std::vector<SoftmaxState<acc_t>> state_ws;
  if (p.num_splits > 1) {
    const int64_t slots = p.batch * p.kv_heads * rows * p.num_splits;
    o_ws.resize(slots * p.head_dim_v);
    state_ws.resize(slots);
    partials = {o_ws.data(), state_ws.data()};
  }
  decode_fwd<scalar_t>(p, partials);
  if (p.num_splits > 1) merge_splits<scalar_t>(p, partials);
}

std::tuple<at::Tensor, at::Tensor> decode_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, int64_t num_splits, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table) {
  constexpr const char* kOp = "attn_ext.decode_attention";
  check_cpu_support(kOp);
  PreparedDecode in =
      prepare_decode(kOp, q, k_cache, v_cache, cache_seqlens,
                     {scale, causal, window_left, window_right, num_splits, softcap, alibi_slopes,
                      sinks, cache_batch_idx, cache_leftpad, block_table},
                     /*check_values=*/true);
  DecodeParams& p = in.params;
  auto [out, lse] = allocate_outputs(p, q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp, [&] { decode<scalar_t>(p); });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("decode_attention", &decode_attention_cpu);
}

}  // namespace attn_ext::cpu
