// CPU flash-attention backward: probabilities recomputed from the forward's lse, tile by
// tile; no Sq x Sk buffer. Parallel over (batch, head); every task owns its rows of dq and
// its query head's dk/dv, so the result is deterministic.
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
#include "attention/cpu/row_pass.h"
#include "attention/cpu/tile_mask.h"
#include "common/cpu/vec_math.h"
#include "common/cpu/work_queue.h"
#include "attention/score_mod.h"
#ifdef ATTN_EXT_AVX2
#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/bf16_pairs.h"
#include "attention/cpu/block_kernels.h"
#endif

namespace attn_ext::cpu {
namespace {

// The log-sum-exp rows of one (batch, head) in acc_t, log2 domain. The forward reports lse
// in float32 (design), which caps fp64 gradients at ~1e-7 relative error; fp64 callers ask
// for exactness, so for them the backward recomputes it in fp64 (one extra Q K^T pass).
template <typename scalar_t, typename acc_t>
void recompute_lse2(const AttentionParams& p, const SeqBounds& sb, int64_t b, int64_t h,
                    const scalar_t* q, const scalar_t* k, acc_t* s_buf, int64_t ld_s,
                    int64_t block_m, int64_t block_n, acc_t* lse2) {
  const LocalBand band{sb.key_offset, p.window_left, p.window_right};
  const acc_t log2e = static_cast<acc_t>(kLog2e);
  const ScoreMod<acc_t> mod = ScoreMod<acc_t>::make(p, b, h, sb.key_offset, log2e);
  const acc_t s_scale = static_cast<acc_t>(p.scale) * log2e;
  for (int64_t i0 = 0; i0 < sb.seqlen_q; i0 += block_m) {
    const int64_t m = std::min(block_m, sb.seqlen_q - i0);
    std::vector<SoftmaxState<acc_t>> st(m, initial_state<acc_t>(p, h, log2e));
    const int64_t n_end = band.key_end(i0 + m, sb.seqlen_k);
    for (int64_t j0 = band.key_begin(i0, sb.seqlen_k); j0 < n_end; j0 += block_n) {
      const int64_t n = std::min(block_n, n_end - j0);
      gemm(false, true, m, n, p.head_dim, acc_t(1), q + i0 * p.q_row_stride, p.q_row_stride,
           k + j0 * p.k_row_stride, p.k_row_stride, acc_t(0), s_buf, ld_s);
      for (int64_t r = 0; r < m; ++r) scale_row(s_buf + r * ld_s, n, s_scale);
      if (mod.active()) modify_tile(mod, i0, m, j0, n, s_buf, ld_s);
      mask_tile<scalar_t>(p, band, b, h, i0, m, j0, n, !band.tile_unmasked(i0, i0 + m, j0, j0 + n),
                          s_buf, ld_s);
      for (int64_t r = 0; r < m; ++r) {
        acc_t* sr = s_buf + r * ld_s;
        st[r].rescale_to(row_max(sr, n));
        st[r].sum += exp2_shift_sum(sr, n, st[r].shift());
      }
    }
    for (int64_t r = 0; r < m; ++r)
      lse2[i0 + r] = st[r].empty() && !std::isnan(st[r].sum)
                         ? -std::numeric_limits<acc_t>::infinity()
                         : st[r].max + std::log2(st[r].sum);
  }
}

// Key blocks of one (sequence, head) are split into this many chunks so that few heads still
// give every thread work; each chunk owns a partial dq, summed in a fixed order afterwards
// (deterministic). Depends only on shapes, never on the thread count.
inline int64_t bwd_key_chunks(int64_t seq_heads, int64_t key_blocks, int64_t partial_bytes) {
  constexpr int64_t kTargetTasks = 16;                      // enough for a 16-core machine
  constexpr int64_t kMaxPartialBytes = int64_t(256) << 20;  // memory for partial dq's
  if (seq_heads == 0) return 1;
  int64_t chunks = std::min(key_blocks, (kTargetTasks + seq_heads - 1) / seq_heads);
  chunks = std::min(chunks, kMaxPartialBytes / std::max<int64_t>(partial_bytes, 1));
  return std::max<int64_t>(chunks, 1);
}

// Varlen batches use the same count for every sequence, from the longest (max_seqlen_k); their
// (sequence, head) tasks count every sequence.
template <typename scalar_t>
int64_t flash_bwd_chunks(const AttentionParams& p) {
  using Traits = FlashTraits<scalar_t>;
  const int64_t key_blocks = (p.seqlen_k + Traits::kBwdBlockN - 1) / Traits::kBwdBlockN;
  const int64_t partial_bytes =
      p.row_batches() * p.heads * p.q_rows() * p.head_dim * sizeof(typename Traits::acc_t);
  return bwd_key_chunks(p.batch * p.heads, key_blocks, partial_bytes);
}

// The backward's five block products, one policy per backend, for a key block (K_j, V_j)
// and a query tile (Q_i, dO_i): S = scale * Q_i K_j^T, dP = dO_i V_j^T, dV_j += P^T dO_i,
// dQ_i += dS K_j, dK_j += dS^T Q_i (dS arrives already multiplied by the softmax scale).
// begin_rows(q, dO, lo, hi) opens a task whose query tiles lie in rows [lo, hi);
// load_queries(i0, ...) names the tile's first row; finish_keys(n, dK_j, dV_j) closes a key
// block. The fp32 policies accumulate into dK_j / dV_j directly and need neither.

// BLAS on the inputs as they are, or on fp32 copies of reduced-precision tiles.
template <typename scalar_t>
struct BlasBwdProducts {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  int64_t d, dv, ldk = 0, ldv = 0, ldq = 0, ldo = 0;
  Buffer<acc_t> k_buf, v_buf, q_buf, do_buf;
  const acc_t *kt = nullptr, *vt = nullptr, *qt = nullptr, *dot = nullptr;

  BlasBwdProducts(const AttentionBwdParams& p, int64_t block_m, int64_t block_n)
      : d(p.head_dim),
        dv(p.head_dim_v),
        k_buf(Traits::kConvert ? block_n * d : 0),
        v_buf(Traits::kConvert ? block_n * dv : 0),
        q_buf(Traits::kConvert ? block_m * d : 0),
        do_buf(Traits::kConvert ? block_m * dv : 0) {}

  void load_keys(const scalar_t* k, int64_t k_ld, const scalar_t* v, int64_t v_ld, int64_t n) {
    kt = load_tile(k, k_ld, n, d, k_buf.get(), &ldk);
    vt = load_tile(v, v_ld, n, dv, v_buf.get(), &ldv);
  }
  void begin_rows(const scalar_t*, int64_t, const scalar_t*, int64_t, int64_t, int64_t) {}
  void load_queries(int64_t /*i0*/, const scalar_t* q, int64_t q_ld, const scalar_t* dout,
                    int64_t do_ld, int64_t m) {
    qt = load_tile(q, q_ld, m, d, q_buf.get(), &ldq);
    dot = load_tile(dout, do_ld, m, dv, do_buf.get(), &ldo);
  }
  void finish_keys(int64_t, acc_t*, int64_t, acc_t*, int64_t) {}
  void scores(int64_t m, int64_t n, acc_t scale, acc_t* s, int64_t lds) const {
    gemm(false, true, m, n, d, acc_t(1), qt, ldq, kt, ldk, acc_t(0), s, lds);
    for (int64_t r = 0; r < m; ++r) scale_row(s + r * lds, n, scale);
  }
  void dprobs(int64_t m, int64_t n, acc_t* dp, int64_t lds) const {
    gemm(false, true, m, n, dv, acc_t(1), dot, ldo, vt, ldv, acc_t(0), dp, lds);
  }
  void add_dv(const acc_t* pm, int64_t lds, int64_t m, int64_t n, acc_t* dv_rows,
              int64_t ld) const {
    gemm(true, false, n, dv, m, acc_t(1), pm, lds, dot, ldo, acc_t(1), dv_rows, ld);
  }
  void add_dq(const acc_t* ds, int64_t lds, int64_t m, int64_t n, acc_t* dq_rows,
              int64_t ld) const {
    gemm(false, false, m, d, n, acc_t(1), ds, lds, kt, ldk, acc_t(1), dq_rows, ld);
  }
  void add_dk(const acc_t* ds, int64_t lds, int64_t m, int64_t n, acc_t* dk_rows,
              int64_t ld) const {
    gemm(true, false, n, d, m, acc_t(1), ds, lds, qt, ldq, acc_t(1), dk_rows, ld);
  }
};

#ifdef ATTN_EXT_AVX2
// Register-blocked products (block_kernels(): AVX-512 or AVX2; float accumulation): each
// key block's K and V are packed once for all the query tiles that see it, each query
// tile's Q and dO once per key block, in the 16-wide panels of avx2_block_products.h (BLAS
// repacked both on all five calls).
template <typename scalar_t>
struct PackedBwdProducts {
  int64_t d, dv, bm, bn, ldq = 0, ldo = 0;
  Buffer<float> k_key, v_key, k_val, q_val, do_val, q_buf, do_buf;
  const float *qt = nullptr, *dot = nullptr;
  const BlockKernels& kernels = block_kernels();

  PackedBwdProducts(const AttentionBwdParams& p, int64_t block_m, int64_t block_n)
      : d(p.head_dim),
        dv(p.head_dim_v),
        bm(block_m),
        bn(avx2::round_up_cols(block_n)),
        k_key(bn * d),
        v_key(bn * dv),
        k_val(avx2::round_up_cols(d) * bn),
        q_val(avx2::round_up_cols(d) * block_m),
        do_val(avx2::round_up_cols(dv) * block_m),
        q_buf(FlashTraits<scalar_t>::kConvert ? block_m * d : 0),
        do_buf(FlashTraits<scalar_t>::kConvert ? block_m * dv : 0) {}

  void load_keys(const scalar_t* k, int64_t k_ld, const scalar_t* v, int64_t v_ld, int64_t n) {
    avx2::pack_key_panels(k, k_ld, n, d, k_key.get());
    avx2::pack_key_panels(v, v_ld, n, dv, v_key.get());
    avx2::pack_value_panels(k, k_ld, n, d, k_val.get(), bn * avx2::kCols);
  }
  void begin_rows(const scalar_t*, int64_t, const scalar_t*, int64_t, int64_t, int64_t) {}
  void load_queries(int64_t /*i0*/, const scalar_t* q, int64_t q_ld, const scalar_t* dout,
                    int64_t do_ld, int64_t m) {
    qt = load_tile(q, q_ld, m, d, q_buf.get(), &ldq);
    dot = load_tile(dout, do_ld, m, dv, do_buf.get(), &ldo);
    avx2::pack_value_panels(qt, ldq, m, d, q_val.get(), bm * avx2::kCols);
    avx2::pack_value_panels(dot, ldo, m, dv, do_val.get(), bm * avx2::kCols);
  }
  void scores(int64_t m, int64_t n, float scale, float* s, int64_t lds) const {
    kernels.scores(qt, ldq, m, k_key.get(), n, d, scale, s, lds);
  }
  void dprobs(int64_t m, int64_t n, float* dp, int64_t lds) const {
    kernels.scores(dot, ldo, m, v_key.get(), n, dv, 1.f, dp, lds);
  }
  void add_dv(const float* pm, int64_t lds, int64_t m, int64_t n, float* dv_rows,
              int64_t ld) const {
    kernels.atb(pm, lds, m, n, do_val.get(), bm * avx2::kCols, dv, dv_rows, ld);
  }
  void add_dq(const float* ds, int64_t lds, int64_t m, int64_t n, float* dq_rows,
              int64_t ld) const {
    kernels.pv(ds, lds, m, k_val.get(), bn * avx2::kCols, n, d, nullptr, dq_rows, ld);
  }
  void add_dk(const float* ds, int64_t lds, int64_t m, int64_t n, float* dk_rows,
              int64_t ld) const {
    kernels.atb(ds, lds, m, n, q_val.get(), bm * avx2::kCols, d, dk_rows, ld);
  }
  void finish_keys(int64_t, float*, int64_t, float*, int64_t) {}
};
#endif

#ifdef ATTN_EXT_AMX_PRODUCTS
// The bf16 backward on bf16 operands (AMX tiles or AVX512-BF16, `Pairs`; bf16_pairs.h), as
// FlashAttention's bf16 backward multiplies: Q, K, V and dO are exact bf16, P is rounded to bf16
// once for dV and dS once for dQ and dK; every product accumulates in fp32, and P, dP and dS
// themselves are formed in fp32 from fp32 scores, as on the fp32 path.
//
// Tile products reduce over pairs along a row of their A operand and take B pair-packed, so the
// five products are arranged so that only operands built once per task or key block are
// transposed, never the per-tile P and dS:
//   S = Q K^T,  dP = dO V^T       A: Q / dO rows (per task)      B: pack_keys(K / V) (per block)
//   dQ += dS K                    A: dS rows (round_rows)        B: pack_values(K)   (per block)
//   dK^T += Q^T dS, dV^T += dO^T P  A: Q^T / dO^T (per task)     B: pack_row_pairs(dS / P)
// dK^T and dV^T of the key block accumulate in fp32 scratch and are added, transposed, to the
// block's dK / dV rows once its query tiles are done (finish_keys).
template <typename Pairs>
struct Bf16BwdProducts {
  using Traits = FlashTraits<c10::BFloat16>;
  // The per-task bf16 rows (Q and dO, as rows and transposed): at most the forward's per-thread
  // packing budget in bytes (kMaxPackedHeadElems fp32); longer query ranges take the fp32
  // products (flash_bwd's dispatch, via fits()).
  static constexpr int64_t kMaxRowElems = 2 * Traits::kMaxPackedHeadElems;

  int64_t d, dv, d_pad, dv_pad, bn;
  Buffer<uint16_t> k_key, v_key, k_val, ds_rows, p_pairs, ds_pairs, a_tail;
  Buffer<float> dk_t, dv_t;
  AlignedVector<uint16_t> q_rows, do_rows, q_t, do_t;  // sized by the longest row range seen
  int64_t lo = 0, ld_t = 0, i0 = 0;
  Pairs pairs;

  static bool fits(const AttentionBwdParams& p) {
    const int64_t widths =
        amx::round_up(p.head_dim, amx::kPairDepth) + amx::round_up(p.head_dim_v, amx::kPairDepth);
    return 2 * (p.seqlen_q + amx::kPairDepth) * widths <= kMaxRowElems;
  }

  Bf16BwdProducts(const AttentionBwdParams& p, int64_t block_m, int64_t block_n)
      : d(p.head_dim),
        dv(p.head_dim_v),
        d_pad(amx::round_up(d, amx::kPairDepth)),
        dv_pad(amx::round_up(dv, amx::kPairDepth)),
        bn(block_n),
        k_key(amx::key_tile_elems(block_n, d)),
        v_key(amx::key_tile_elems(block_n, dv)),
        k_val(amx::value_tile_elems(block_n, d)),
        ds_rows(amx::round_up(block_m, amx::kTileRows) * amx::round_up(block_n, amx::kPairDepth)),
        p_pairs(amx::value_tile_elems(block_m, block_n)),
        ds_pairs(amx::value_tile_elems(block_m, block_n)),
        a_tail(amx::round_up(std::max(d, dv), amx::kTileRows) * amx::kPairDepth),
        dk_t(d * block_n),
        dv_t(dv * block_n),
        pairs(std::max({d, dv, block_n})) {}

  void begin_rows(const c10::BFloat16* q, int64_t q_ld, const c10::BFloat16* dout, int64_t do_ld,
                  int64_t row_lo, int64_t row_hi) {
    // The transposed rows keep a whole number of 32-element (64-byte) pair chunks per row, so a
    // tile starting at a 32-aligned row offset reads whole cache lines.
    lo = row_lo, ld_t = amx::round_up(row_hi - row_lo, amx::kPairDepth);
    const int64_t rows = row_hi - row_lo, rows_pad = rows + amx::kTileRows;  // 16-row tile reads
    grow(q_rows, rows_pad * d_pad), grow(do_rows, rows_pad * dv_pad);
    grow(q_t, amx::round_up(d, amx::kTileRows) * ld_t);
    grow(do_t, amx::round_up(dv, amx::kTileRows) * ld_t);
    const auto* qb = reinterpret_cast<const uint16_t*>(q) + lo * q_ld;
    const auto* ob = reinterpret_cast<const uint16_t*>(dout) + lo * do_ld;
    amx::pad_rows(qb, q_ld, rows, d, q_rows.data(), d_pad, rows_pad);
    amx::pad_rows(ob, do_ld, rows, dv, do_rows.data(), dv_pad, rows_pad);
    amx::transpose_rows(qb, q_ld, rows, d, q_t.data(), ld_t, amx::round_up(d, amx::kTileRows));
    amx::transpose_rows(ob, do_ld, rows, dv, do_t.data(), ld_t, amx::round_up(dv, amx::kTileRows));
  }
  void load_keys(const c10::BFloat16* k, int64_t k_ld, const c10::BFloat16* v, int64_t v_ld,
                 int64_t n) {
    const auto* kb = reinterpret_cast<const uint16_t*>(k);
    amx::pack_keys(kb, k_ld, n, d, k_key.get());
    amx::pack_keys(reinterpret_cast<const uint16_t*>(v), v_ld, n, dv, v_key.get());
    amx::pack_values(kb, k_ld, n, d, k_val.get());
    std::fill(dk_t.data.begin(), dk_t.data.end(), 0.f);
    std::fill(dv_t.data.begin(), dv_t.data.end(), 0.f);
  }
  void load_queries(int64_t first_row, const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                    int64_t) {
    i0 = first_row - lo;
  }
  void scores(int64_t m, int64_t n, float scale, float* s, int64_t lds) {
    pairs.scores(q_rows.data() + i0 * d_pad, d_pad, m, k_key.get(), n, d, scale, s, lds);
  }
  void dprobs(int64_t m, int64_t n, float* dp, int64_t lds) {
    pairs.scores(do_rows.data() + i0 * dv_pad, dv_pad, m, v_key.get(), n, dv, 1.f, dp, lds);
  }
  void add_dv(const float* pm, int64_t lds, int64_t m, int64_t n, float*, int64_t) {
    amx::pack_row_pairs(pm, lds, m, n, p_pairs.get());
    reduce_over_rows(do_t.data() + i0, dv, p_pairs.get(), m, n, dv_t.get());
  }
  void add_dq(const float* ds, int64_t lds, int64_t m, int64_t n, float* dq_rows, int64_t ld) {
    const int64_t n_pad = amx::round_up(n, amx::kPairDepth);
    amx::round_rows(ds, lds, m, n, ds_rows.get(), n_pad);
    pairs.pv(ds_rows.get(), n_pad, m, k_val.get(), n, d, nullptr, dq_rows, ld);
  }
  void add_dk(const float* ds, int64_t lds, int64_t m, int64_t n, float*, int64_t) {
    amx::pack_row_pairs(ds, lds, m, n, ds_pairs.get());
    reduce_over_rows(q_t.data() + i0, d, ds_pairs.get(), m, n, dk_t.get());
  }
  void finish_keys(int64_t n, float* dk_rows, int64_t ldk, float* dv_rows, int64_t ldv) const {
    add_transposed(dk_t.get(), d, n, dk_rows, ldk);
    add_transposed(dv_t.get(), dv, n, dv_rows, ldv);
  }

 private:
  // C[rows x n] += A B over the tile's m query rows: A = rows of a transposed per-task operand
  // from this tile's column (ld_t), B = pack_row_pairs of P or dS. A tile that ends mid pair
  // chunk would read A's columns of the rows after it (the next tile's, or rows past the band
  // that may hold NaN); that chunk's A is copied with those columns zeroed instead.
  void reduce_over_rows(const uint16_t* a, int64_t rows, const uint16_t* b_pairs, int64_t m,
                        int64_t n, float* c) {
    const int64_t full = m / amx::kPairDepth * amx::kPairDepth;
    if (full > 0) pairs.pv(a, ld_t, rows, b_pairs, full, n, nullptr, c, bn);
    if (full == m) return;
    const int64_t keep = m - full, rows_pad = amx::round_up(rows, amx::kTileRows);
    uint16_t* t = a_tail.get();
    for (int64_t r = 0; r < rows_pad; ++r) {
      uint16_t* dst = t + r * amx::kPairDepth;
      if (r < rows) std::copy(a + r * ld_t + full, a + r * ld_t + m, dst);
      std::fill(dst + (r < rows ? keep : 0), dst + amx::kPairDepth, uint16_t(0));
    }
    const int64_t chunk_elems = amx::value_tile_elems(amx::kPairDepth, n);
    pairs.pv(t, amx::kPairDepth, rows, b_pairs + full / amx::kPairDepth * chunk_elems, keep, n,
             nullptr, c, bn);
  }
  // rows_out[c][f] += t[f][c] for f < features, c < n (t: features x bn).
  void add_transposed(const float* t, int64_t features, int64_t n, float* rows_out,
                      int64_t ld) const {
    for (int64_t c = 0; c < n; ++c)
      for (int64_t f = 0; f < features; ++f) rows_out[c * ld + f] += t[f * bn + c];
  }
};
#endif

// rows x cols of src (ld_src apart) rounded to scalar_t into dst (ld_dst apart).
template <typename scalar_t, typename acc_t>
void store_rows(const acc_t* src, int64_t ld_src, int64_t rows, int64_t cols, scalar_t* dst,
                int64_t ld_dst) {
  for (int64_t r = 0; r < rows; ++r) store_row(src + r * ld_src, dst + r * ld_dst, cols, acc_t(1));
}

// dq must hold chunks x (B, H, Sq, D) partials (chunk-major; varlen: chunks x (H, total_q, D)),
// or dq in scalar_t where final.dq; dk / dv likewise (final.dkv). allocate_grads' layouts.
template <typename scalar_t, typename Products>
void flash_bwd(const AttentionBwdParams& p, int64_t chunks, FinalGrads final) {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  constexpr int64_t kM = Traits::kBwdBlockM, kN = Traits::kBwdBlockN;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const int64_t BH = p.batch * p.heads, QR = p.q_rows(), KR = p.k_rows();
  const acc_t log2e = static_cast<acc_t>(kLog2e);
  const acc_t scale = static_cast<acc_t>(p.scale);
  const acc_t s_scale = scale * log2e;
  const RowPass<acc_t> row_pass{};
  const bool dropout = p.dropout_p > 0.0;
  const acc_t keep_scale = static_cast<acc_t>(1.0 / (1.0 - p.dropout_p));
  auto q_of = [&](int64_t b, int64_t h, const SeqBounds& sb) {
    return row_ptr(static_cast<const scalar_t*>(p.q), p.q_batch_stride, p.q_head_stride,
                   p.q_row_stride, b, h, sb.q_begin);
  };
  auto k_of = [&](int64_t b, int64_t hk, const SeqBounds& sb) {
    return row_ptr(static_cast<const scalar_t*>(p.k), p.k_batch_stride, p.k_head_stride,
                   p.k_row_stride, b, hk, sb.k_begin);
  };

  // ---- prologue, per (batch, head): delta_i = rowsum(dO_i * O_i) (minus the lse gradient)
  // and the log2-domain lse each probability is recomputed from, indexed as lse; with sinks,
  // each (batch, head)'s share of d sink = -sum_i P_sink,i * delta_i.
  // lse in the log2 domain as a float pair hi + lo (see exp2_scale_shift2).
  const int64_t rows = p.row_batches() * p.heads * QR;
  std::vector<acc_t> delta(rows), lse2(rows), lse2_lo(rows, acc_t(0));
  std::vector<acc_t> dsink_part(p.sinks != nullptr ? BH : 0, acc_t(0));
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> s_buf(std::is_same_v<scalar_t, double> ? kM * kN : 0);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.heads, h = bh % p.heads;
      const SeqBounds sb = seq_bounds(p, b);
      const int64_t r0 = row_index(p, sb, b, h, 0), Sq = sb.seqlen_q;
      const auto* o = row_ptr(static_cast<const scalar_t*>(p.out), p.o_batch_stride,
                              p.o_head_stride, p.o_row_stride, b, h, sb.q_begin);
      const auto* dout = row_ptr(static_cast<const scalar_t*>(p.dout), p.do_batch_stride,
                                 p.do_head_stride, p.do_row_stride, b, h, sb.q_begin);
      for (int64_t i = 0; i < Sq; ++i) {
        const acc_t d = row_dot<acc_t>(dout + i * p.do_row_stride, o + i * p.o_row_stride, Dv);
        // d lse_i / d s_ij = P_ij, so an lse gradient enters as dS_ij += P_ij * glse_i.
        delta[r0 + i] = p.grad_lse ? d - static_cast<acc_t>(p.grad_lse[r0 + i]) : d;
      }
      if constexpr (std::is_same_v<scalar_t, double>) {
        recompute_lse2(p, sb, b, h, q_of(b, h, sb), k_of(b, h / p.group(), sb), s_buf.get(), kN, kM,
                       kN, lse2.data() + r0);
      } else {
        for (int64_t i = 0; i < Sq; ++i) {
          const double l2 = static_cast<double>(p.lse[r0 + i]) * kLog2e;
          lse2[r0 + i] = static_cast<acc_t>(l2);
          lse2_lo[r0 + i] =
              std::isfinite(l2) ? static_cast<acc_t>(l2 - static_cast<acc_t>(l2)) : acc_t(0);
        }
      }
      if (p.sinks != nullptr) {
        // The sink's probability in row i is exp2(sink2 - lse2_i); it holds no value, so
        // d loss / d sink = sum_i P_sink,i * (0 - delta_i).
        const acc_t sink2 = static_cast<const acc_t*>(p.sinks)[h] * log2e;
        acc_t g = 0;
        for (int64_t i = 0; i < Sq; ++i)
          g -= std::exp2((sink2 - lse2[r0 + i]) - lse2_lo[r0 + i]) * delta[r0 + i];
        dsink_part[bh] = g;
      }
    }
  });
  if (p.sinks != nullptr) {  // summed over the batch in a fixed order (deterministic)
    auto* dsinks = static_cast<acc_t*>(p.dsinks);
    for (int64_t bh = 0; bh < BH; ++bh) dsinks[bh % p.heads] += dsink_part[bh];
  }

  // ---- main loop, per (batch, head, key chunk): the chunk's key blocks outside, the query
  // rows that see them inside; each task owns its dq partial and its dk / dv rows.
  struct Worker {
    Products prod;
    Buffer<acc_t> p_buf, dp_buf, dcap_buf;
    Buffer<uint8_t> keep;
    Buffer<acc_t> dq_rows, dk_rows, dv_rows;  // the accumulators of the final results
  };
  auto task = [&](Worker& w, int64_t b, int64_t h, int64_t chunk) {
    Products& prod = w.prod;
    const SeqBounds sb = seq_bounds(p, b);
    const int64_t Sq = sb.seqlen_q, Sk = sb.seqlen_k, hk = h / p.group();
    const LocalBand band{sb.key_offset, p.window_left, p.window_right};
    const ScoreMod<acc_t> mod = ScoreMod<acc_t>::make(p, b, h, sb.key_offset, log2e);
    const auto* q = q_of(b, h, sb);
    const auto* k = k_of(b, hk, sb);
    const auto* v = row_ptr(static_cast<const scalar_t*>(p.v), p.v_batch_stride, p.v_head_stride,
                            p.v_row_stride, b, hk, sb.k_begin);
    const auto* dout = row_ptr(static_cast<const scalar_t*>(p.dout), p.do_batch_stride,
                               p.do_head_stride, p.do_row_stride, b, h, sb.q_begin);
    const int64_t r0 = row_index(p, sb, b, h, 0);
    const acc_t* lse_r = lse2.data() + r0;
    const acc_t* lse_lo_r = lse2_lo.data() + r0;
    const acc_t* delta_r = delta.data() + r0;
    const int64_t step = p.acc_row_step();  // rows apart of a head's consecutive rows
    const int64_t q_row0 = p.acc_row(b, h, sb.q_begin, QR),
                  k_row0 = p.acc_row(b, h, sb.k_begin, KR);
    // Where the products accumulate, ld apart: the op's fp32 tensors (step rows apart), or, for
    // the results in q's dtype (final), this worker's rows, rounded into the op's tensors once
    // complete: dq after the task, dk / dv after each key block.
    acc_t* const dq =
        final.dq ? w.dq_rows.get() : static_cast<acc_t*>(p.dq) + (chunk * rows + q_row0) * D;
    const int64_t ld_q = final.dq ? D : step * D;
    const int64_t ld_k = final.dkv ? D : step * D, ld_v = final.dkv ? Dv : step * Dv;
    auto dk_of = [&](int64_t j0) {
      return final.dkv ? w.dk_rows.get() : static_cast<acc_t*>(p.dk) + (k_row0 + j0 * step) * D;
    };
    auto dv_of = [&](int64_t j0) {
      return final.dkv ? w.dv_rows.get() : static_cast<acc_t*>(p.dv) + (k_row0 + j0 * step) * Dv;
    };

    const int64_t key_blocks = (Sk + kN - 1) / kN;
    const int64_t blocks_per_chunk = (key_blocks + chunks - 1) / chunks;
    const int64_t j_begin = std::min(Sk, chunk * blocks_per_chunk * kN);
    const int64_t j_end = std::min(Sk, (chunk + 1) * blocks_per_chunk * kN);
    // Every task writes all of its rows (the dq partial's or dq's and the chunk's dk / dv rows,
    // zeros where no query sees a key): accumulators start at zero here, in cache, unless they
    // are varlen fp32 tensors (zeroed by run_bwd: rows of empty sequences have no task).
    const bool zero_q = final.dq || !p.varlen(), zero_kv = final.dkv || !p.varlen();
    if (zero_q) std::fill(dq, dq + Sq * D, acc_t(0));  // (contiguous: ld_q = D)
    // The band's rows are monotone in the keys: the chunk's tiles lie in these rows, and a
    // block's rows [r_begin, r_end) lie in them.
    const int64_t rows_lo = band.row_begin(j_begin, Sq), rows_hi = band.row_end(j_end, Sq);
    if (rows_lo < rows_hi)
      prod.begin_rows(q, p.q_row_stride, dout, p.do_row_stride, rows_lo, rows_hi);
    // The products of key block [j0, j0 + n) with the query rows [r_begin, r_end) that see it.
    auto key_block = [&](int64_t j0, int64_t n, int64_t r_begin, int64_t r_end, acc_t* dk,
                         acc_t* dv) {
      prod.load_keys(k + j0 * p.k_row_stride, p.k_row_stride, v + j0 * p.v_row_stride,
                     p.v_row_stride, n);

      for (int64_t i0 = r_begin; i0 < r_end; i0 += kM) {
        const int64_t m = std::min(kM, r_end - i0);
        prod.load_queries(i0, q + i0 * p.q_row_stride, p.q_row_stride, dout + i0 * p.do_row_stride,
                          p.do_row_stride, m);
        acc_t* pt = w.p_buf.get();
        acc_t* dpt = w.dp_buf.get();
        acc_t* dcap = mod.softcapped() ? w.dcap_buf.get() : nullptr;

        // P = exp(modified scores - lse), masked entries 0; the scores are scaled and
        // modified as the forward did, so they match its lse to the rounding of the products.
        prod.scores(m, n, s_scale, pt, kN);
        if (mod.active()) modify_tile(mod, i0, m, j0, n, pt, kN, dcap);
        const bool band_partial = !band.tile_unmasked(i0, i0 + m, j0, j0 + n);
        if (band_partial || p.mask_kind != MaskKind::kNone)
          mask_tile<scalar_t>(p, band, b, h, i0, m, j0, n, band_partial, pt, kN);
        for (int64_t r = 0; r < m; ++r) {
          const acc_t l2 = lse_r[i0 + r];
          acc_t* pr = pt + r * kN;
          if (l2 == -std::numeric_limits<acc_t>::infinity()) {
            std::fill(pr, pr + n, acc_t(0));  // a row that sees no key has no gradient
          } else {
            row_pass.exp2_rows(pr, n, l2, lse_lo_r[i0 + r]);
          }
        }

        // dV += P_dropped^T dO
        const acc_t* pv = pt;
        if (dropout) {
          dropout_tile(p, r0 + i0, m, j0, n, w.keep.get());
          for (int64_t r = 0; r < m; ++r) {
            std::copy(pt + r * kN, pt + r * kN + n, dpt + r * kN);
            apply_keep(dpt + r * kN, w.keep.get() + r * n, n, keep_scale);
          }
          pv = dpt;
        }
        prod.add_dv(pv, kN, m, n, dv, ld_v);

        // dS = scale * P * (dP - delta) (* softcap'), dP = (dO V^T) through the dropout mask
        prod.dprobs(m, n, dpt, kN);
        for (int64_t r = 0; r < m; ++r) {
          if (dropout) apply_keep(dpt + r * kN, w.keep.get() + r * n, n, keep_scale);
          row_pass.grad(pt + r * kN, dpt + r * kN, n, delta_r[i0 + r]);
          if (dcap != nullptr)
            for (int64_t c = 0; c < n; ++c) dpt[r * kN + c] *= dcap[r * n + c];
          row_pass.scale(dpt + r * kN, n, scale);
        }

        // dQ += dS K,  dK += dS^T Q
        prod.add_dq(dpt, kN, m, n, dq + i0 * ld_q, ld_q);
        prod.add_dk(dpt, kN, m, n, dk, ld_k);
      }
      prod.finish_keys(n, dk, ld_k, dv, ld_v);
    };
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kN) {
      const int64_t n = std::min(kN, Sk - j0);
      acc_t* const dk = dk_of(j0);
      acc_t* const dv = dv_of(j0);
      if (zero_kv) {  // (contiguous: step 1 or the worker's rows)
        std::fill(dk, dk + n * D, acc_t(0));
        std::fill(dv, dv + n * Dv, acc_t(0));
      }
      const int64_t r_begin = band.row_begin(j0, Sq), r_end = band.row_end(j0 + n, Sq);
      if (r_begin < r_end) key_block(j0, n, r_begin, r_end, dk, dv);
      if (final.dkv) {
        store_rows(dk, D, n, D, static_cast<scalar_t*>(p.dk) + (k_row0 + j0 * step) * D, step * D);
        store_rows(dv, Dv, n, Dv, static_cast<scalar_t*>(p.dv) + (k_row0 + j0 * step) * Dv,
                   step * Dv);
      }
    }
    if (final.dq) store_rows(dq, D, Sq, D, static_cast<scalar_t*>(p.dq) + q_row0 * D, step * D);
  };

  auto make_worker = [&] {
    return Worker{Products(p, kM, kN),
                  Buffer<acc_t>(kM * kN),
                  Buffer<acc_t>(kM * kN),
                  Buffer<acc_t>(p.softcap > 0.0 ? kM * kN : 0),
                  Buffer<uint8_t>(dropout ? kM * kN : 0),
                  Buffer<acc_t>(final.dq ? p.seqlen_q * D : 0),  // (varlen: the longest)
                  Buffer<acc_t>(final.dkv ? kN * D : 0),
                  Buffer<acc_t>(final.dkv ? kN * Dv : 0)};
  };
  auto run = [&](Worker& w, int64_t b, int64_t h, int64_t chunk) { task(w, b, h, chunk); };
  if (p.varlen()) {
    // (sequence, head, chunk) tasks, the sequences with the most work first.
    std::vector<std::pair<int64_t, int64_t>> order;  // (-work, sequence)
    for (int64_t b = 0; b < p.batch; ++b) {
      const SeqBounds sb = seq_bounds(p, b);
      if (sb.seqlen_q > 0 && sb.seqlen_k > 0) order.emplace_back(-sb.seqlen_q * sb.seqlen_k, b);
    }
    std::stable_sort(order.begin(), order.end());
    std::vector<int64_t> seqs;
    for (const auto& o : order) seqs.push_back(o.second);
    const int64_t per_seq = p.heads * chunks;
    parallel_claim(static_cast<int64_t>(seqs.size()) * per_seq, make_worker,
                   [&](Worker& w, int64_t t) {
                     run(w, seqs[t / per_seq], (t % per_seq) / chunks, t % chunks);
                   });
    return;
  }
  at::parallel_for(0, BH * chunks, 1, [&](int64_t begin, int64_t end) {
    Worker w = make_worker();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t chunk = t % chunks, bh = t / chunks;
      run(w, bh / p.heads, bh % p.heads, chunk);
    }
  });
}

// The packed products for float accumulation (for bf16 on AMX tiles or AVX512-BF16 where
// block_kernels() says so and the query rows fit the per-thread budget); BLAS for fp64 and
// other ISAs.
template <typename scalar_t>
void flash_bwd(const AttentionBwdParams& p, int64_t chunks, FinalGrads final) {
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<typename FlashTraits<scalar_t>::acc_t, float>) {
#ifdef ATTN_EXT_AMX_PRODUCTS
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (Bf16BwdProducts<AmxPairs>::fits(p)) {
        switch (block_kernels().bf16_operands) {
          case Bf16Operands::kAmx:
            return flash_bwd<scalar_t, Bf16BwdProducts<AmxPairs>>(p, chunks, final);
          case Bf16Operands::kAvx512Bf16:
            return flash_bwd<scalar_t, Bf16BwdProducts<Avx512Bf16Pairs>>(p, chunks, final);
          case Bf16Operands::kFp32:
            break;
        }
      }
    }
#endif
    return flash_bwd<scalar_t, PackedBwdProducts<scalar_t>>(p, chunks, final);
  }
#endif
  flash_bwd<scalar_t, BlasBwdProducts<scalar_t>>(p, chunks, final);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_bwd(
    const char* op, PreparedBackward& in, const std::optional<at::Tensor>& sinks) {
  AttentionBwdParams& p = in.params;
  const at::Tensor& q = in.in.q;
  int64_t chunks = 1;
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), op, [&] { chunks = flash_bwd_chunks<scalar_t>(p); });
  // bf16 / fp16 results are rounded by the tasks from their own fp32 rows where no sum follows
  // (one dq partial; dk / dv without GQA groups): no fp32 tensors, no separate cast.
  const bool reduced = at::toOpMathType(q.scalar_type()) != q.scalar_type();
  const FinalGrads final{reduced && chunks == 1, reduced && p.heads == p.kv_heads};
  // The tasks write every row of dense batches; varlen rows of empty sequences have none.
  const bool has_rows = p.batch * p.heads * p.q_rows() > 0;
  Grads g = allocate_grads(p, q, chunks, /*zeroed=*/p.varlen() || !has_rows, final);
  if (has_rows) {
    ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), op, [&] { flash_bwd<scalar_t>(p, chunks, final); });
  }
  return finish_grads(p, std::move(g), q.scalar_type(), sinks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool causal,
    int64_t window_left, int64_t window_right, std::optional<int64_t> key_offset, double dropout_p,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double softcap) {
  constexpr const char* kOp = "attn_ext.attention_backward";
  check_cpu_support(kOp);
  PreparedBackward in =
      prepare_attention_backward(kOp, grad_out, q, k, v, out, lse, grad_lse,
                                 {attn_mask, scale, causal, window_left, window_right, key_offset,
                                  dropout_p, rng_state, softcap, alibi_slopes, sinks});
  return run_bwd(kOp, in, sinks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& grad_lse, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, double dropout_p, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double softcap) {
  constexpr const char* kOp = "attn_ext.attention_varlen_backward";
  check_cpu_support(kOp);
  PreparedBackward in = prepare_attention_varlen_backward(
      kOp, grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      grad_lse,
      varlen_options(scale, causal, window_left, window_right, dropout_p, rng_state, softcap,
                     alibi_slopes, sinks));
  return run_bwd(kOp, in, sinks);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_backward", &attention_backward_cpu);
  m.impl("attention_varlen_backward", &attention_varlen_backward_cpu);
}

}  // namespace attn_ext::cpu
