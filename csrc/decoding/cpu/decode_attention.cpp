// CPU decode attention: Sq new queries per sequence against a KV cache with per-sequence
// lengths, bottom-right causal (query i of sequence b sits at key lengths[b] - Sq + i).
// Steps of at least kPackedMinQueries queries per head run on the flash forward instead
// (on_flash_forward), which attends to a cache through AttentionParams' lengths / leftpad /
// batch_idx / pages. The G = H / Hkv query heads that share a KV head are one row block, so every
// cache row is read once per block. Short batches split the key sequence: each split keeps its own
// online-softmax state, and the partial results are merged by SoftmaxState::merge.
// A paged cache is read through its block table, and gives the contiguous cache's result bit
// for bit; a task may cover several KV heads of it, read page by page (heads_per_task). Blocks of
// at most kMaxDecodeRows rows (the common decode step: G * Sq small) run the products of
// decode_rows.h on the cache rows in place, a key tile being a list of row pointers. Larger blocks
// multiply with BLAS: pages of at least a key tile are read in place, tiles cut at page ends;
// smaller pages are gathered into the tile buffer (bf16 / fp16 tiles are converted into it anyway),
// so the GEMMs keep the contiguous kernel's tiles. A float8 cache (common/float8.h) is read as it
// lies: its rows widen in registers on the in-place path and into the tile buffer on the BLAS
// path, k_scale joins the score scale and v_scale the output's normalization.
#include <algorithm>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/constants.h"
#include "decoding/decode_inputs.h"
#include "attention/inputs.h"
#include "common/dispatch.h"
#include "common/float8.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "common/cpu/blas.h"
#include "common/cpu/cpu_support.h"
#include "common/cpu/kernel_traits.h"
#include "common/cpu/split_kv.h"
#include "common/cpu/vec_math.h"
#include "attention/score_mod.h"
#include "attention/cpu/tile_mask.h"
#include "attention/cpu/block_kernels.h"
#include "attention/cpu/flash_fwd.h"
#include "decoding/cpu/avx512_decode_rows.h"
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

// Keys per tile: few-row blocks on the rows in place take shorter tiles (kernel_traits.h says
// why); a paged cache and a contiguous one take the same, so they still agree bit for bit.
template <typename Traits>
constexpr int64_t decode_tile(bool in_place) {
  return in_place ? Traits::kDecodeRowsBlockN : Traits::kDecodeBlockN;
}

// Asks for the first avx2::kKeyAheadBytes of key rows [t0, t1) of sequence b at KV heads
// [hk0, hk0 + heads) into L2: issued once a tile's scores are formed, the next tile's first
// keys arrive while its softmax and P V run, where the hardware prefetcher would restart its
// stream only at the next tile's first misses (the contiguous step at 128-key tiles, against
// 256-key ones: 1.02-1.10x without, 0.97-1.06x with; asking for 32 KB ran 1-15% slower than 8;
// Zen 5 VM, 2026-11-29).
template <typename scalar_t>
void prefetch_next_keys(const DecodeParams& p, int64_t b, int64_t hk0, int64_t heads, int64_t t0,
                        int64_t t1) {
#ifdef ATTN_EXT_AVX2
  const int64_t key_bytes = p.head_dim * static_cast<int64_t>(sizeof(scalar_t));
  t1 = std::min(t1, t0 + std::max<int64_t>(1, avx2::kKeyAheadBytes / key_bytes));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = t0; t < t1; ++t) {
      const CacheSlot slot = p.key_slot(b, t);
      avx2::prefetch_row_l2(row_ptr(static_cast<const scalar_t*>(p.k), p.k_batch_stride,
                                    p.k_head_stride, p.k_row_stride, slot.block, hk0 + h, slot.row),
                            key_bytes);
    }
#else
  (void)p, (void)b, (void)hk0, (void)heads, (void)t0, (void)t1;
#endif
}

// Whether a cache's rows hold every KV head's row of a position side by side (FlashAttention's
// (page, rows, Hkv, D) pages) rather than each head's rows side by side.
inline bool rows_interleave_heads(const DecodeParams& p) {
  return p.k_head_stride < p.k_row_stride;
}

// S = Q K^T for a task's `heads` KV heads on key rows [0, n) of a tile in place (decode_rows.h;
// only blocks that decode_rows_in_place admits come here): head h's queries at q + h * ldq_head,
// its row pointers at keys / values + h * tile, its scores at s + h * lds_head. One head reads
// its tile row by row. Several heads read the tile page by page, every head's rows of a page
// before the next page, and within a page in the order the rows lie (head by head in
// (page, Hkv, rows, D) pages, row by row in FlashAttention's (page, rows, Hkv, D)): the reads
// then stream through whole pages. Each score is the same dot product either way.
template <typename scalar_t, typename acc_t>
void scores_in_place(const DecodeParams& p, int64_t m, int64_t heads, int64_t j0, int64_t n,
                     const acc_t* q, int64_t ldq_head, const scalar_t* const* keys,
                     const scalar_t* const* values, int64_t tile, acc_t* s, int64_t lds,
                     int64_t lds_head) {
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float>) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    return avx2::dispatch_decode_rows(m, [&](auto rows) {
      constexpr int M = decltype(rows)::value;
      auto score = [&](const acc_t* qh, const scalar_t* const* k, int64_t count, acc_t* sh,
                       const scalar_t* const* v, bool keys_ahead) {
#ifdef ATTN_EXT_AVX512_PRODUCTS
        if constexpr (sizeof(scalar_t) == 1)  // float8 rows
          if (block_kernels().avx512)
            return avx512::decode_scores(M, qh, D, k, count, D, sh, lds, v, Dv);
#endif
        avx2::decode_scores<M>(qh, D, k, count, D, sh, lds, v, Dv, keys_ahead);
      };
      if (heads == 1) return score(q, keys, n, s, values, /*keys_ahead=*/true);
      const bool interleaved = rows_interleave_heads(p);
      for (int64_t r = 0, run = 0; r < n; r += run) {
        run = std::min(n - r, p.pages.page_size - (j0 + r) % p.pages.page_size);
        if (interleaved) {
          for (int64_t j = r; j < r + run; ++j)
            for (int64_t h = 0; h < heads; ++h)
              score(q + h * ldq_head, keys + h * tile + j, 1, s + h * lds_head + j,
                    values + h * tile + j, false);
        } else {
          for (int64_t h = 0; h < heads; ++h)
            score(q + h * ldq_head, keys + h * tile + r, run, s + h * lds_head + r,
                  values + h * tile + r, false);
        }
      }
    });
  }
#endif
  TORCH_INTERNAL_ASSERT(false, "decode_attention: no in-place products for this build and dtype");
}

// O += P V for a block of m rows on rows in place: 16 lanes where the CPU kernel set runs
// AVX-512 (avx512_decode_rows.h), else 8; the same bits either way.
template <typename scalar_t, typename acc_t>
void pv_in_place(int64_t m, const acc_t* p, int64_t ldp, const scalar_t* const* values, int64_t n,
                 int64_t dv, acc_t* o) {
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float>)
    return avx2::dispatch_decode_rows(m, [&](auto rows) {
      constexpr int M = decltype(rows)::value;
#ifdef ATTN_EXT_AVX512_PRODUCTS
      if (block_kernels().avx512) return avx512::decode_pv(M, p, ldp, values, n, dv, o);
#endif
      avx2::decode_pv<M>(p, ldp, values, n, dv, o, dv);
    });
#endif
  TORCH_INTERNAL_ASSERT(false, "decode_attention: no in-place products for this build and dtype");
}

// The tasks: one row block of one sequence, one key split, and `heads` consecutive KV heads (a
// divisor of Hkv; heads_per_task). q and out are scalar_t, the cache cache_t.
template <typename scalar_t, typename cache_t>
void decode_fwd(const DecodeParams& p, int64_t heads,
                Partials<at::opmath_type<scalar_t>> partials) {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  const int64_t G = p.group(), Sq = p.seqlen_q, D = p.head_dim, Dv = p.head_dim_v;
  const int64_t rows = G * Sq;  // row r = i * G + g: query i of head hk * G + g
  const int64_t kM = std::min(Traits::kDecodeBlockM, rows);
  const bool in_place = decode_rows_in_place<acc_t>(kM);
  const int64_t kN = decode_tile<Traits>(in_place);
  const int64_t num_m = ceil_div(rows, kM), splits = p.num_splits;
  const int64_t head_groups = p.kv_heads / heads;
  const acc_t log2e = static_cast<acc_t>(kLog2e);
  // The raw products are q . k_cache: k_scale turns them into q . K.
  const acc_t s_scale = static_cast<acc_t>(p.scale * p.k_scale) * log2e;
  const acc_t v_scale = static_cast<acc_t>(p.v_scale);
  const bool modified = p.softcap > 0.0 || p.alibi_slopes != nullptr;
  const bool gather = !in_place && p.pages.paged() && p.pages.page_size < kN;
  constexpr bool kConvert = Traits::kConvert || !std::is_same_v<cache_t, scalar_t>;
  const bool buffered = !in_place && (kConvert || gather);
  TORCH_INTERNAL_ASSERT(in_place || heads == 1, "decode_attention: ", heads,
                        " KV heads per task on the BLAS path");

  at::parallel_for(0, p.batch * head_groups * num_m * splits, 1, [&](int64_t begin, int64_t end) {
    // Per head of the task: its rows' queries, scores, outputs and softmax states.
    Buffer<acc_t> q_buf(heads * kM * D), s_buf(heads * kM * kN), o_buf(heads * kM * Dv);
    Buffer<acc_t> k_buf(buffered ? kN * D : 0), v_buf(buffered ? kN * Dv : 0);
    std::vector<const cache_t*> k_rows(in_place ? heads * kN : 0);
    std::vector<const cache_t*> v_rows(in_place ? heads * kN : 0);
    std::vector<SoftmaxState<acc_t>> state(heads * kM);

    for (int64_t task = begin; task < end; ++task) {
      // ---- prologue: the rows of this block, the keys they may see, this split's share
      const int64_t split = task % splits, mb = (task / splits) % num_m;
      const int64_t bg = task / (splits * num_m), b = bg / head_groups;
      const int64_t hk0 = bg % head_groups * heads;
      const int64_t r0 = mb * kM, m = std::min(kM, rows - r0);
      const int64_t i_begin = r0 / G, i_end = (r0 + m - 1) / G + 1;
      const int64_t len = p.lengths[b], first = p.first_key(b);
      const LocalBand band{len - Sq, p.window_left, p.window_right};
      const int64_t lo = std::max(band.key_begin(i_begin, len), first);
      const int64_t hi = std::max(band.key_end(i_end, len), lo);
      const auto [j_begin, j_end] = split_range(lo, hi, splits, split, kN);

      for (int64_t h = 0; h < heads; ++h)
        for (int64_t rr = 0; rr < m; ++rr) {
          const int64_t r = r0 + rr, i = r / G, hq = (hk0 + h) * G + r % G;
          const auto* q = row_ptr(static_cast<const scalar_t*>(p.q), p.q_batch_stride,
                                  p.q_head_stride, p.q_row_stride, b, hq, i);
          load_row(q, q_buf.get() + (h * kM + rr) * D, D, acc_t(1));
          // A head's sink joins its rows' denominators once: in the first split only (the
          // merge adds the splits' sums).
          state[h * kM + rr] =
              split == 0 ? initial_state<acc_t>(p, hq, log2e) : SoftmaxState<acc_t>{};
          std::fill_n(o_buf.get() + (h * kM + rr) * Dv, Dv, acc_t(0));
        }

      // ---- main loop over key tiles; tiles crossing the band's edge are masked per element
      for (int64_t j0 = j_begin, n = 0; j0 < j_end; j0 += n) {
        n = std::min(kN, j_end - j0);
        const acc_t *kt = nullptr, *vt = nullptr;
        int64_t ldk = D, ldv = Dv;
        if (in_place) {
          for (int64_t h = 0; h < heads; ++h)
            tile_rows(p, b, hk0 + h, j0, n, k_rows.data() + h * kN, v_rows.data() + h * kN);
          scores_in_place(p, m, heads, j0, n, q_buf.get(), kM * D, k_rows.data(), v_rows.data(), kN,
                          s_buf.get(), kN, kM * kN);
          prefetch_next_keys<cache_t>(p, b, hk0, heads, j0 + n, j_end);
        } else if (gather) {
          const auto* k = static_cast<const cache_t*>(p.k) + hk0 * p.k_head_stride;
          const auto* v = static_cast<const cache_t*>(p.v) + hk0 * p.v_head_stride;
          kt = gather_tile(p.pages, k, p.k_batch_stride, p.k_row_stride, b, j0, n, D, k_buf.get());
          vt = gather_tile(p.pages, v, p.v_batch_stride, p.v_row_stride, b, j0, n, Dv, v_buf.get());
        } else {
          const CacheSlot slot = p.key_slot(b, j0);
          if (p.pages.paged()) n = std::min(n, p.pages.page_size - slot.row);
          const auto* k = row_ptr(static_cast<const cache_t*>(p.k), p.k_batch_stride,
                                  p.k_head_stride, p.k_row_stride, slot.block, hk0, slot.row);
          const auto* v = row_ptr(static_cast<const cache_t*>(p.v), p.v_batch_stride,
                                  p.v_head_stride, p.v_row_stride, slot.block, hk0, slot.row);
          kt = load_tile(k, p.k_row_stride, n, D, k_buf.get(), &ldk);
          vt = load_tile(v, p.v_row_stride, n, Dv, v_buf.get(), &ldv);
        }
        if (!in_place)
          gemm(false, true, m, n, D, acc_t(1), q_buf.get(), D, kt, ldk, acc_t(0), s_buf.get(), kN);
        const bool band_partial = !band.tile_unmasked(i_begin, i_end, j0, j0 + n);
        const bool masked = band_partial || modified;
        for (int64_t h = 0; h < heads; ++h) {
          acc_t* s = s_buf.get() + h * kM * kN;
          acc_t* o = o_buf.get() + h * kM * Dv;
          // Scores to the log2 domain (see scale_row_max), modifiers (per query head: a row
          // block spans G heads), band edges masked, rows' maxima.
          if (masked) {
            constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
            for (int64_t rr = 0; rr < m; ++rr) {
              const int64_t r = r0 + rr, i = r / G;
              acc_t* sr = s + rr * kN;
              scale_row(sr, n, s_scale);
              if (modified) {
                const auto mod =
                    ScoreMod<acc_t>::make(p, b, (hk0 + h) * G + r % G, len - Sq, log2e);
                modify_tile(mod, i, 1, j0, n, sr, kN);
              }
              if (band_partial)
                for (int64_t c = 0; c < n; ++c)
                  if (!band.allowed(i, j0 + c)) sr[c] = kNegInf;
            }
          }
          for (int64_t rr = 0; rr < m; ++rr) {
            acc_t* sr = s + rr * kN;
            SoftmaxState<acc_t>& st = state[h * kM + rr];
            const acc_t block_max = masked ? row_max(sr, n) : scale_row_max(sr, n, s_scale);
            const acc_t factor = st.rescale_to(block_max);
            st.sum += exp2_shift_sum(sr, n, st.shift());
            if (factor != acc_t(1)) scale_row(o + rr * Dv, Dv, factor);
          }
          // The value rows were asked into L2 while the scores were formed (in the cache's
          // order), so reading them head by head here costs no stream.
          if (in_place)
            pv_in_place(m, s, kN, v_rows.data() + h * kN, n, Dv, o);
          else
            gemm(false, false, m, Dv, n, acc_t(1), s, kN, vt, ldv, acc_t(1), o, Dv);
        }
      }

      // ---- epilogue: the final result, or this split's partial for the merge
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t rr = 0; rr < m; ++rr) {
          const int64_t r = r0 + rr, i = r / G, hk = hk0 + h, hq = hk * G + r % G;
          const acc_t* o = o_buf.get() + (h * kM + rr) * Dv;
          const SoftmaxState<acc_t>& st = state[h * kM + rr];
          if (splits == 1) {
            auto* out = row_ptr(static_cast<scalar_t*>(p.out), p.o_batch_stride, p.o_head_stride,
                                p.o_row_stride, b, hq, i);
            store_row(o, out, Dv, st.inv_sum() * v_scale);
            p.lse[(b * p.heads + hq) * Sq + i] = st.lse();
          } else {
            const int64_t slot = ((b * p.kv_heads + hk) * rows + r) * splits + split;
            std::copy_n(o, Dv, partials.o + slot * Dv);
            partials.state[slot] = st;
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
  const acc_t v_scale = static_cast<acc_t>(p.v_scale);
  at::parallel_for(0, p.batch * p.kv_heads * rows, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> acc(Dv);
    for (int64_t row = begin; row < end; ++row) {
      const SoftmaxState<acc_t> total = merge_row_splits(
          partials.state + row * splits, partials.o + row * splits * Dv, splits, Dv, acc.get());
      const int64_t bk = row / rows, r = row % rows;
      const int64_t b = bk / p.kv_heads, hk = bk % p.kv_heads, i = r / G, h = hk * G + r % G;
      auto* o = row_ptr(static_cast<scalar_t*>(p.out), p.o_batch_stride, p.o_head_stride,
                        p.o_row_stride, b, h, i);
      store_row(acc.get(), o, Dv, total.inv_sum() * v_scale);
      p.lse[(b * p.heads + h) * Sq + i] = total.lse();
    }
  });
}

// KV heads per task. A paged cache with pages below the key tile holds one head's rows in
// runs of a page between the other heads' rows. Read head by head, 8 KB runs of fp32 at the
// 64 KB page stride (D 128, Hkv 8, pages of 16 rows) stream at 0.7-0.8x of a contiguous
// read, and FlashAttention's (page, rows, Hkv, D) pages, one row per run, at 0.45-0.55x;
// reading every head of a page before the next page streams at the contiguous rate (a
// read-only loop on a Zen 5 VM, 2026-11-29: dev/paged_stream). So a task covers as many
// heads as leave each thread a task: all of them where the splits allow, else at least half
// of each page (4 of 8 heads still took the fp32 step from ~1.5x to ~1.3x the contiguous one
// and FlashAttention's pages from ~1.9x to ~1.75x), else one head (2 of 8 gained nothing in
// fp32 and lost in FlashAttention's pages: ~2.15x). The exception: 16-bit rows in
// (page, Hkv, rows, D) pages, read head by head with the key rows prefetched across the page
// jumps (decode_rows.h), ran 1.1-1.25x the contiguous step against 1.25-1.5x page by page
// with 256-key tiles, and still 1.2-1.35x against 1.3-1.75x with the 128-key tiles of
// kDecodeRowsBlockN (Zen 5 VM, 2026-11-29; why page by page loses there is not known).
inline int64_t heads_per_task(const DecodeParams& p, int64_t element_bytes, int64_t tasks_per_head,
                              int64_t tile) {
  if (!p.pages.paged() || p.pages.page_size >= tile) return 1;
  if (!rows_interleave_heads(p) && element_bytes == 2) return 1;
  const int64_t threads = at::get_num_threads();
  for (int64_t heads = p.kv_heads; 2 * heads >= p.kv_heads && heads > 1; --heads)
    if (p.kv_heads % heads == 0 && tasks_per_head * (p.kv_heads / heads) >= threads) return heads;
  return 1;
}

template <typename scalar_t, typename cache_t>
void decode(DecodeParams& p) {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  const int64_t rows = p.group() * p.seqlen_q;
  const int64_t kM = std::min(Traits::kDecodeBlockM, rows), num_m = ceil_div(rows, kM);
  const bool in_place = decode_rows_in_place<acc_t>(kM);
  if (p.num_splits == 0) {
    // Blocks on the rows in place count their splits per sequence and row block, not per KV
    // head, so that a paged cache whose tasks cover several heads has the splits to spread
    // over the threads and still splits like a contiguous cache (bit for bit the same
    // result). The contiguous cache's step paid at most ~1-3% for the extra splits of
    // at least kMinSplitKeys keys (B 1, 512-32k keys, Zen 5 VM, 2026-11-29).
    const int64_t blocks = p.batch * num_m * (in_place ? 1 : p.kv_heads);
    const int64_t max_len = *std::max_element(p.lengths, p.lengths + p.batch);
    p.num_splits = auto_splits(blocks, max_len, Traits::kMinSplitKeys, Traits::kTasksPerThread);
  }
  const int64_t heads = in_place
                            ? heads_per_task(p, sizeof(cache_t), p.batch * num_m * p.num_splits,
                                             decode_tile<Traits>(in_place))
                            : 1;
  Partials<acc_t> partials;
  std::vector<acc_t> o_ws;
  std::vector<SoftmaxState<acc_t>> state_ws;
  if (p.num_splits > 1) {
    const int64_t slots = p.batch * p.kv_heads * rows * p.num_splits;
    o_ws.resize(slots * p.head_dim_v);
    state_ws.resize(slots);
    partials = {o_ws.data(), state_ws.data()};
  }
  decode_fwd<scalar_t, cache_t>(p, heads, partials);
  if (p.num_splits > 1) merge_splits<scalar_t>(p, partials);
}

// Whether the step runs on the flash forward (attention/cpu/flash_fwd.h) instead of the decode
// blocks: from kPackedMinQueries query rows per head its packed products take the rows, and
// measured 1.6-2.2x (fp32) and 2.8-4.4x (bf16) the decode blocks' speed at Sq 16-512 (B 2,
// H 16, Hkv 4, D 128, 4k keys, Zen 5 VM, 2026-11-30); below that it runs BLAS blocks, which
// lose to the decode blocks (0.14-0.71x at Sq 1-8), which read a KV head's G x Sq rows' keys
// once. Not for float8 caches (the forward reads q's dtype), fp64 (BLAS either way, so the
// decode blocks' own order is kept), or while the forward's (batch, head, query block) tasks
// would leave more than half the threads idle (it does not split the keys; the decode blocks
// do).
bool on_flash_forward(const DecodeParams& p, at::ScalarType q, at::ScalarType cache) {
#ifdef ATTN_EXT_AVX2
  using Traits = FlashTraits<float>;
  if (q != cache || q == at::kDouble || p.seqlen_q < Traits::kPackedMinQueries) return false;
  const int64_t tasks = p.batch * p.heads * ceil_div(p.seqlen_q, Traits::kFwdBlockM);
  return 2 * tasks >= at::get_num_threads();
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> decode_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, int64_t num_splits, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    double k_scale, double v_scale) {
  constexpr const char* kOp = "attn_ext.decode_attention";
  check_cpu_support(kOp);
  PreparedDecode in =
      prepare_decode(kOp, q, k_cache, v_cache, cache_seqlens,
                     {scale, causal, window_left, window_right, num_splits, softcap, alibi_slopes,
                      sinks, cache_batch_idx, cache_leftpad, block_table, k_scale, v_scale},
                     /*check_values=*/true);
  DecodeParams& p = in.params;
  auto [out, lse] = allocate_outputs(p, q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  if (on_flash_forward(p, q.scalar_type(), k_cache.scalar_type())) {
    // The keys each sequence reads end by the longest length (the capacity sized its buffers).
    AttentionParams fwd = p;
    fwd.seqlen_k = *std::max_element(p.lengths, p.lengths + p.batch);
    flash_forward(kOp, fwd, q);
    return {out, lse};
  }
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp, [&] {
    ATTN_EXT_DISPATCH_CACHE(k_cache.scalar_type(), kOp, [&] { decode<scalar_t, cache_t>(p); });
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("decode_attention", &decode_attention_cpu);
}

}  // namespace attn_ext::cpu
