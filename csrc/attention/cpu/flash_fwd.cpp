// CPU flash-attention forward: blocked over queries and keys with an online softmax;
// no Sq x Sk buffer, parallel over (batch, head, query block). Also attention_probabilities,
// the Sq x Sk probabilities of a forward's lse, on the same products and masks.
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
#include "attention/cpu/flash_fwd.h"
#include "attention/cpu/key_rows.h"
#include "attention/cpu/row_pass.h"
#include "attention/cpu/tile_mask.h"
#include "common/cpu/vec_math.h"
#include "common/cpu/work_queue.h"
#include "attention/score_mod.h"
#ifdef ATTN_EXT_AVX2
#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/block_kernels.h"
#include "attention/cpu/avx512_softmax_rows.h"
#include "attention/cpu/bf16_pairs.h"
#endif

namespace attn_ext::cpu {
namespace {

// Block products of the forward, one policy per backend. Each gives the query block's
// scaled scores S = scale * Q K^T for a key tile and folds P V into the output accumulator
// after rescaling it by the online softmax's per-row factor; the main loop is shared.

// BLAS on the inputs as they are (fp32 / fp64), or on fp32 copies of reduced-precision K and
// V: converted once per (batch, kv head) when the head is small enough, else per tile (paged
// keys are copied tile by tile even when no conversion is needed: BLAS reads strided rows).
template <typename scalar_t>
struct BlasProducts {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  static constexpr int64_t kKeyAlign = 1;          // tiles may start at any key
  static constexpr bool kRoundsInRowPass = false;  // P stays fp32 (Bf16Products rounds it)
  static constexpr bool kReadsInputQuery = false;  // Q as acc_t rows (load_tile)
  static constexpr int64_t kScoreRowAlign = 1;     // score blocks hold m rows
  static constexpr int64_t kBlockN = Traits::kFwdBlockN;

  static constexpr int64_t kRowGroup = 16;  // paged rows looked up per KeyRows::fill

  int64_t d, dv;
  bool whole_head, paged;
  KeyRows<scalar_t> k, v;
  int64_t head = -1, lo = 0, hi = 0;
  Buffer<acc_t> k_conv, v_conv, k_tile, v_tile;
  const acc_t *kt = nullptr, *vt = nullptr;
  int64_t ldk = 0, ldv = 0;

  BlasProducts(const AttentionParams& p, int64_t block_n)
      : d(p.head_dim),
        dv(p.head_dim_v),
        whole_head(Traits::kConvert && p.seqlen_k * (d + dv) <= Traits::kMaxConvertedHeadElems),
        paged(p.pages.paged()),
        k_conv(whole_head ? p.seqlen_k * d : 0),
        v_conv(whole_head ? p.seqlen_k * dv : 0),
        k_tile((Traits::kConvert || paged) && !whole_head ? block_n * d : 0),
        v_tile((Traits::kConvert || paged) && !whole_head ? block_n * dv : 0) {}

  // Keys [n_begin, n_end) of head `head_id` (rows k / v) are about to be used.
  void load_head(int64_t head_id, const KeyRows<scalar_t>& k_rows, const KeyRows<scalar_t>& v_rows,
                 int64_t n_begin, int64_t n_end, int64_t /*keys*/) {
    k = k_rows, v = v_rows;
    if (!whole_head || n_begin >= n_end) return;
    // Consecutive query blocks of one head ask for growing (causal) or equal key ranges.
    if (head_id != head || n_begin < lo || n_begin > hi) head = head_id, lo = hi = n_begin;
    if (hi < n_end) convert_rows(hi, n_end - hi, k_conv.get() + hi * d, v_conv.get() + hi * dv);
    hi = std::max(hi, n_end);
  }

  // Keys / values [j0, j0 + n) as acc_t rows of d / dv.
  void convert_rows(int64_t j0, int64_t n, acc_t* k_dst, acc_t* v_dst) const {
    const scalar_t* rows[2][kRowGroup];
    for (int64_t r0 = 0; r0 < n; r0 += kRowGroup) {
      const int64_t count = std::min(kRowGroup, n - r0);
      k.fill(j0 + r0, count, rows[0]);
      v.fill(j0 + r0, count, rows[1]);
      for (int64_t r = 0; r < count; ++r) {
        load_row(rows[0][r], k_dst + (r0 + r) * d, d, acc_t(1));
        load_row(rows[1][r], v_dst + (r0 + r) * dv, dv, acc_t(1));
      }
    }
  }

  void load_tile(int64_t j0, int64_t n) {
    if (whole_head) {
      kt = k_conv.get() + j0 * d, vt = v_conv.get() + j0 * dv, ldk = d, ldv = dv;
    } else if (paged) {
      convert_rows(j0, n, k_tile.get(), v_tile.get());
      kt = k_tile.get(), vt = v_tile.get(), ldk = d, ldv = dv;
    } else {
      kt = cpu::load_tile(k.base + j0 * k.ld, k.ld, n, d, k_tile.get(), &ldk);
      vt = cpu::load_tile(v.base + j0 * v.ld, v.ld, n, dv, v_tile.get(), &ldv);
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
  static constexpr bool kRoundsInRowPass = false;
  static constexpr bool kReadsInputQuery = false;
  static constexpr int64_t kScoreRowAlign = 1;
  static constexpr int64_t kBlockN = Traits::kFwdBlockN;

  int64_t d, dv, dv_pad, sk_pad;
  bool whole_head;
  KeyRows<scalar_t> k, v;
  int64_t head = -1, lo = 0, hi = 0;
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
        sk_pad(avx2::round_up_cols(p.seqlen_k)),
        whole_head(sk_pad * (d + dv_pad) <= Traits::kMaxPackedHeadElems),
        panel_keys(whole_head ? sk_pad : block_n),
        v_panel_stride(panel_keys * avx2::kCols),
        k_panels(panel_keys * d),
        v_panels(panel_keys * dv_pad) {}

  // `keys` is the head's key count (the sequence's, for a varlen batch): no row past it is read.
  void load_head(int64_t head_id, const KeyRows<scalar_t>& k_rows, const KeyRows<scalar_t>& v_rows,
                 int64_t n_begin, int64_t n_end, int64_t keys) {
    k = k_rows, v = v_rows;
    if (!whole_head || n_begin >= n_end) return;
    if (head_id != head || n_begin < lo || n_begin > hi) head = head_id, lo = hi = n_begin;
    // Whole panels only (the last one zero-padded), so a later, longer range extends them.
    const int64_t stop = std::min(avx2::round_up_cols(n_end), avx2::round_up_cols(keys));
    if (hi >= stop) return;
    const int64_t n = std::min(stop, keys) - hi;
    avx2::pack_key_panels(k.from(hi), n, d, k_panels.get() + hi * d);
    avx2::pack_value_panels(v.from(hi), n, dv, v_panels.get() + hi * avx2::kCols, v_panel_stride);
    hi = stop;
  }

  void load_tile(int64_t j0, int64_t n) {
    if (whole_head) {
      kp = k_panels.get() + j0 * d;
      vp = v_panels.get() + j0 * avx2::kCols;
    } else {
      avx2::pack_key_panels(k.from(j0), n, d, k_panels.get());
      avx2::pack_value_panels(v.from(j0), n, dv, v_panels.get(), v_panel_stride);
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

#ifdef ATTN_EXT_AMX_PRODUCTS
// The bf16 forward on bf16 operands (AMX tiles or AVX512-BF16, `Pairs`). K and V are packed in
// the pair-interleaved tile layout (amx::pack_keys / pack_values) once per (batch, kv head)
// while the packed head fits the fp32 panels' element budget (half their bytes), else tile by
// tile, as PackedProducts does. The query block's input rows are copied, padded to whole tiles,
// once per task (no fp32 round trip), and P is rounded once per key tile, just before P V:
// without dropout, by the softmax row pass itself (exp2_sum_rounded; the fp32 P is never
// stored: a pass over the score block fewer), else from the fp32 rows dropout has masked.
// Where nothing but the band edits the scores (no modifier, no mask tensor, no dropout) and the
// scale is positive, the scores stay unscaled (scores_unscaled: AMX stores its tiles straight
// into the block, skipping the epilogue that bounded the product: 1.0-1.2 TFLOP/s without it
// against 0.71-0.88 with it, dev/cpu_forward_experiments.md) and the row pass applies the
// scale: the row max scales exactly (rounding is monotonic).
template <typename Pairs>
struct Bf16Products {
  using Traits = FlashTraits<c10::BFloat16>;
  static constexpr int64_t kKeyAlign = amx::kPairDepth;  // whole-head tiles hold 32-key chunks
  static constexpr bool kRoundsInRowPass = true;
  static constexpr bool kReadsInputQuery = true;  // bf16 rows padded as they are (pad_query)
  static constexpr int64_t kScoreRowAlign = amx::kTileRows;  // scores_unscaled stores whole tiles
  // Key tiles of 512: each P V chain is 16 tile steps (32 keys each) before its accumulators
  // leave through the rescaling epilogue, and the per-tile row bookkeeping halves; the score
  // block (128 x 512 fp32, 256 KiB) and P (128 KiB) stay in L2. 1.03-1.08x the forward with 256
  // at D 64/128, S 512-8192, causal or not; 1024 was no better (dev/cpu_forward_experiments.md).
  static constexpr int64_t kBlockN = 2 * Traits::kFwdBlockN;

  int64_t d, dv, d_pad, dv_pad, sk_pad;
  bool whole_head;
  KeyRows<uint16_t> k, v;
  int64_t head = -1, lo = 0, hi = 0;
  Buffer<uint16_t> k_tiles, v_tiles;
  AlignedVector<uint16_t> q_tile, p_tile;  // sized by the largest query block seen
  bool q_ready = false;
  const uint16_t *kt = nullptr, *vt = nullptr;
  Pairs pairs;

  Bf16Products(const AttentionParams& p, int64_t block_n)
      : d(p.head_dim),
        dv(p.head_dim_v),
        d_pad(amx::round_up(d, amx::kPairDepth)),
        dv_pad(amx::round_up(dv, amx::kAccCols)),
        sk_pad(amx::round_up(p.seqlen_k, amx::kPairDepth)),
        whole_head(sk_pad * (d_pad + dv_pad) <= Traits::kMaxPackedHeadElems),
        k_tiles(amx::key_tile_elems(whole_head ? sk_pad : block_n, d)),
        v_tiles(amx::value_tile_elems(whole_head ? sk_pad : block_n, dv)),
        pairs(dv) {}

  // Called once per task, before its first scores: also marks the query block as not yet
  // rounded. `keys` bounds the rows read, as in PackedProducts.
  void load_head(int64_t head_id, const KeyRows<c10::BFloat16>& k_rows,
                 const KeyRows<c10::BFloat16>& v_rows, int64_t n_begin, int64_t n_end,
                 int64_t keys) {
    k = k_rows.template as<uint16_t>(), v = v_rows.template as<uint16_t>(), q_ready = false;
    if (!whole_head || n_begin >= n_end) return;
    if (head_id != head || n_begin < lo || n_begin > hi) head = head_id, lo = hi = n_begin;
    const int64_t stop = std::min(amx::round_up(n_end, kKeyAlign), amx::round_up(keys, kKeyAlign));
    if (hi >= stop) return;
    const int64_t n = std::min(stop, keys) - hi;
    amx::pack_keys(k.from(hi), n, d, k_tiles.get() + hi * d_pad);
    amx::pack_values(v.from(hi), n, dv, v_tiles.get() + hi * dv_pad);
    hi = stop;
  }

  void load_tile(int64_t j0, int64_t n) {
    if (whole_head) {
      kt = k_tiles.get() + j0 * d_pad, vt = v_tiles.get() + j0 * dv_pad;
    } else {
      amx::pack_keys(k.from(j0), n, d, k_tiles.get());
      amx::pack_values(v.from(j0), n, dv, v_tiles.get());
      kt = k_tiles.get(), vt = v_tiles.get();
    }
  }

  // The query block's bf16 rows (the input's, ldq) as the A operand: features padded to d_pad,
  // rows to a whole tile, once per task.
  void pad_query(const c10::BFloat16* q, int64_t ldq, int64_t m) {
    if (q_ready) return;
    const int64_t m_pad = amx::round_up(m, amx::kTileRows);
    grow(q_tile, m_pad * d_pad);
    amx::pad_rows(reinterpret_cast<const uint16_t*>(q), ldq, m, d, q_tile.data(), d_pad, m_pad);
    q_ready = true;
  }

  void scores(const c10::BFloat16* q, int64_t ldq, int64_t m, int64_t n, float scale, float* s,
              int64_t lds) {
    pad_query(q, ldq, m);
    pairs.scores(q_tile.data(), d_pad, m, kt, n, d, scale, s, lds);
  }
  // Q K^T without the scale; s holds round_up(m, 16) rows (amx::scores_unscaled).
  void scores_unscaled(const c10::BFloat16* q, int64_t ldq, int64_t m, int64_t n, float* s,
                       int64_t lds) {
    pad_query(q, ldq, m);
    pairs.scores_unscaled(q_tile.data(), d_pad, m, kt, n, d, s, lds);
  }

  void accumulate(const float* pm, int64_t ldp, int64_t m, int64_t n, const float* factor,
                  float* o) {
    const int64_t n_pad = amx::round_up(n, amx::kPairDepth);
    grow(p_tile, amx::round_up(m, amx::kTileRows) * n_pad);
    amx::round_rows(pm, ldp, m, n, p_tile.data(), n_pad);
    pairs.pv(p_tile.data(), n_pad, m, vt, n, dv, factor, o, dv);
  }

  // The row pass of a key tile whose P goes to P V as it is (no dropout): row r's
  // 2^(s * scale - shift) and its sum, the values rounded straight into the P tile; then
  // accumulate_rounded(m, n, ...) in place of accumulate.
  float exp2_sum_rounded(int64_t m, int64_t r, const float* sr, int64_t n, float scale,
                         float shift) {
    const int64_t n_pad = amx::round_up(n, amx::kPairDepth);
    if (r == 0) grow(p_tile, amx::round_up(m, amx::kTileRows) * n_pad);
    return avx512::exp2_shift_sum_bf16(sr, n, scale, shift, p_tile.data() + r * n_pad, n_pad);
  }
  void accumulate_rounded(int64_t m, int64_t n, const float* factor, float* o) {
    const int64_t n_pad = amx::round_up(n, amx::kPairDepth),
                  m_pad = amx::round_up(m, amx::kTileRows);
    // The tile products read whole 16-row tiles: rows past m are zero, as round_rows leaves them.
    std::fill(p_tile.begin() + m * n_pad, p_tile.begin() + m_pad * n_pad, uint16_t(0));
    pairs.pv(p_tile.data(), n_pad, m, vt, n, dv, factor, o, dv);
  }
};
#endif

// One thread's forward: its block products and buffers, run on (sequence, head, query block)
// tasks in any order.
template <typename scalar_t, typename Products>
struct FwdWorker {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  static constexpr int64_t kN = Products::kBlockN;

  const AttentionParams& p;
  int64_t kM;
  Products prod;
  RowPass<acc_t> rows;
  Buffer<acc_t> q_buf, s_buf, o_buf, factor;
  Buffer<uint8_t> keep;
  std::vector<SoftmaxState<acc_t>> state;

  FwdWorker(const AttentionParams& params, int64_t block_m)
      : p(params),
        kM(block_m),
        prod(params, kN),
        q_buf(Traits::kConvert && !Products::kReadsInputQuery ? block_m * params.head_dim : 0),
        s_buf((block_m + Products::kScoreRowAlign - 1) / Products::kScoreRowAlign *
              Products::kScoreRowAlign * kN),
        o_buf(block_m * params.head_dim_v),
        factor(block_m),
        keep(params.dropout_p > 0.0 ? block_m * kN : 0),
        state(block_m) {}

  void run(int64_t b, int64_t h, int64_t mb) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    const acc_t log2e = static_cast<acc_t>(kLog2e);
    const acc_t s_scale = static_cast<acc_t>(p.scale) * log2e;
    const bool dropout = p.dropout_p > 0.0;
    const acc_t keep_scale = static_cast<acc_t>(1.0 / (1.0 - p.dropout_p));

    // ---- prologue: this task's rows, the keys they may see, the query tile
    const SeqBounds sb = seq_bounds(p, b);
    const LocalBand band{sb.key_offset, p.window_left, p.window_right};
    const ScoreMod<acc_t> mod = ScoreMod<acc_t>::make(p, b, h, sb.key_offset, log2e);
    const int64_t hk = h / p.group(), Sk = sb.seqlen_k;
    const int64_t i0 = mb * kM, m = std::min(kM, sb.seqlen_q - i0);
    const int64_t n_end = band.key_end(i0 + m, Sk);
    const int64_t n_begin = band.key_begin(i0, Sk) / Products::kKeyAlign * Products::kKeyAlign;

    const auto* q = row_ptr(static_cast<const scalar_t*>(p.q), p.q_batch_stride, p.q_head_stride,
                            p.q_row_stride, b, h, sb.q_begin + i0);
    // The query rows the products read: the input's (bf16 operands), else acc_t copies.
    int64_t ldq = p.q_row_stride;
    const auto* qt = [&] {
      if constexpr (Products::kReadsInputQuery)
        return q;
      else
        return load_tile(q, p.q_row_stride, m, D, q_buf.get(), &ldq);
    }();
    prod.load_head(b * p.kv_heads + hk,
                   kv_head_rows<scalar_t>(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                          b, hk, sb.k_begin),
                   kv_head_rows<scalar_t>(p, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                                          b, hk, sb.k_begin),
                   n_begin, n_end, Sk);
    std::fill(o_buf.data.begin(), o_buf.data.begin() + m * Dv, acc_t(0));
    std::fill(state.begin(), state.begin() + m, initial_state<acc_t>(p, h, log2e));
    const int64_t row0 = row_index(p, sb, b, h, i0);
    // Scores the row pass scales itself (Bf16Products::scores_unscaled), and the factor it
    // applies: 1 to scores the product already scaled (exact).
    [[maybe_unused]] const bool unscaled =
        !dropout && !mod.active() && p.mask_kind == MaskKind::kNone && s_scale > acc_t(0);
    [[maybe_unused]] const acc_t row_scale = unscaled ? s_scale : acc_t(1);

    // ---- main loop over key blocks; tiles crossing the band's edge are masked row by row
    for (int64_t j0 = n_begin; j0 < n_end; j0 += kN) {
      const int64_t n = std::min(kN, n_end - j0);
      acc_t* s = s_buf.get();
      prod.load_tile(j0, n);
      // Scaled scores (log2 domain), then modifiers and masks (which expect it), then each
      // row's max; unscaled ones only meet the band, whose -inf is the same before the scale.
      if constexpr (Products::kRoundsInRowPass) {
        if (unscaled)
          prod.scores_unscaled(qt, ldq, m, n, s, kN);
        else
          prod.scores(qt, ldq, m, n, s_scale, s, kN);
      } else {
        prod.scores(qt, ldq, m, n, s_scale, s, kN);
      }
      if (mod.active()) modify_tile(mod, i0, m, j0, n, s, kN);
      const bool band_partial = !band.tile_unmasked(i0, i0 + m, j0, j0 + n);
      if (band_partial || p.mask_kind != MaskKind::kNone)
        mask_tile<scalar_t>(p, band, b, h, i0, m, j0, n, band_partial, s, kN);
      if constexpr (Products::kRoundsInRowPass) {
        if (!dropout) {
          for (int64_t r = 0; r < m; ++r) {
            const acc_t* sr = s + r * kN;
            factor.get()[r] = state[r].rescale_to(rows.max(sr, n) * row_scale);
            state[r].sum += prod.exp2_sum_rounded(m, r, sr, n, row_scale, state[r].shift());
          }
          prod.accumulate_rounded(m, n, factor.get(), o_buf.get());
          continue;
        }
      }
      if (dropout) dropout_tile(p, row0, m, j0, n, keep.get());
      for (int64_t r = 0; r < m; ++r) {
        acc_t* sr = s + r * kN;
        factor.get()[r] = state[r].rescale_to(rows.max(sr, n));
        state[r].sum += rows.exp2_sum(sr, n, state[r].shift());
        if (dropout) apply_keep(sr, keep.get() + r * n, n, keep_scale);
      }
      prod.accumulate(s, kN, m, n, factor.get(), o_buf.get());
    }

    // ---- epilogue: normalize, store, log-sum-exp (rows that saw no key give 0 / -inf, or
    // lse = the sink's logit)
    auto* o = row_ptr(static_cast<scalar_t*>(p.out), p.o_batch_stride, p.o_head_stride,
                      p.o_row_stride, b, h, sb.q_begin + i0);
    float* lse = p.lse + row0;
    for (int64_t r = 0; r < m; ++r) {
      store_row(o_buf.get() + r * Dv, o + r * p.o_row_stride, Dv, state[r].inv_sum());
      lse[r] = state[r].lse();
    }
  }
};

// One thread's attention_probabilities (and attention_weights): P = exp2(S - lse2) for the keys a
// block's rows may see, on the forward's products and mask pieces, with the lse of the forward
// that is given, or its own (head_rows); with dropout, P * keep / (1 - p) on the forward's mask.
// run() writes a (batch, head, query block)'s rows whole: zeros outside its band and for rows
// that saw no key (lse -inf); run_mean() writes a (batch, query block)'s rows of the mean over
// heads, or the columns of one key chunk of them, summed in acc_t in a buffer of the block's rows.
template <typename scalar_t, typename Products>
struct ProbWorker {
  using Traits = FlashTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  static constexpr int64_t kN = Products::kBlockN;

  const AttentionParams& p;
  scalar_t* weights;  // (B, H, Sq, Sk), or (B, Sq, Sk) for run_mean; contiguous
  int64_t kM;
  Products prod;
  RowPass<acc_t> rows;
  Buffer<acc_t> q_buf, s_buf, lse2, lse2_lo;
  Buffer<uint8_t> keep;
  AlignedVector<acc_t> sum_rows;  // run_mean's block rows, sized on first use

  ProbWorker(const AttentionParams& params, scalar_t* w, int64_t block_m)
      : p(params),
        weights(w),
        kM(block_m),
        prod(params, kN),
        q_buf(Traits::kConvert && !Products::kReadsInputQuery ? block_m * params.head_dim : 0),
        s_buf((block_m + Products::kScoreRowAlign - 1) / Products::kScoreRowAlign *
              Products::kScoreRowAlign * kN),
        lse2(block_m),
        lse2_lo(block_m),
        keep(params.dropout_p > 0.0 ? block_m * kN : 0) {}

  // The keys [lo, hi) that some row of block [i0, i0 + m) may see, and the first tile's start.
  struct KeyRange {
    int64_t tiles_begin, lo, hi;
  };
  KeyRange key_range(const SeqBounds& sb, int64_t i0, int64_t m) const {
    const LocalBand band{sb.key_offset, p.window_left, p.window_right};
    const int64_t Sk = sb.seqlen_k;
    const int64_t n_begin = band.key_begin(i0, Sk) / Products::kKeyAlign * Products::kKeyAlign;
    const int64_t lo = std::clamp<int64_t>(n_begin, 0, Sk);
    return {n_begin, lo, std::clamp(band.key_end(i0 + m, Sk), lo, Sk)};
  }

  void run(int64_t b, int64_t h, int64_t mb) {
    const SeqBounds sb = seq_bounds(p, b);
    const int64_t Sk = sb.seqlen_k, i0 = mb * kM, m = std::min(kM, sb.seqlen_q - i0);
    const KeyRange kr = key_range(sb, i0, m);
    scalar_t* w = weights + ((b * p.heads + h) * sb.seqlen_q + i0) * Sk;
    for (int64_t r = 0; r < m; ++r) {
      std::fill(w + r * Sk, w + r * Sk + kr.lo, scalar_t(0));
      std::fill(w + r * Sk + kr.hi, w + (r + 1) * Sk, scalar_t(0));
    }
    head_rows(b, h, sb, i0, m, kr, kr, [&](int64_t r, int64_t j0, const acc_t* pr, int64_t n) {
      store_row(pr, w + r * Sk + j0, n, acc_t(1));
    });
  }

  // The mean over heads of the rows of query block mb, keys [c0, c1) (c0 a multiple of kN, so
  // that the chunk's tiles start aligned).
  void run_mean(int64_t b, int64_t mb, int64_t c0, int64_t c1) {
    const SeqBounds sb = seq_bounds(p, b);
    const int64_t Sk = sb.seqlen_k, i0 = mb * kM, m = std::min(kM, sb.seqlen_q - i0);
    const int64_t end = std::min(c1, Sk), width = end - c0;
    const KeyRange all = key_range(sb, i0, m);
    const int64_t lo = std::max(all.lo, c0), hi = std::min(all.hi, end);
    const KeyRange kr{std::max(all.tiles_begin, c0), lo, std::max(lo, hi)};
    grow(sum_rows, m * width);
    std::fill(sum_rows.begin(), sum_rows.begin() + m * width, acc_t(0));
    for (int64_t h = 0; h < p.heads; ++h) {
      head_rows(b, h, sb, i0, m, all, kr, [&](int64_t r, int64_t j0, const acc_t* pr, int64_t n) {
        acc_t* sum = sum_rows.data() + r * width + (j0 - c0);
        for (int64_t j = 0; j < n; ++j) sum[j] += pr[j];
      });
    }
    scalar_t* w = weights + (b * sb.seqlen_q + i0) * Sk + c0;
    const acc_t inv_heads = acc_t(1) / static_cast<acc_t>(p.heads);
    for (int64_t r = 0; r < m; ++r)
      store_row(sum_rows.data() + r * width, w + r * Sk, width, inv_heads);
  }

  // emit(r, j0, P, n): row r's probabilities of keys [j0, j0 + n), key tile by key tile over
  // kr (masked keys and rows that saw no key give 0); a recomputed lse sums the keys of
  // lse_keys, the block's whole range (kr may be one chunk of it).
  template <typename Emit>
  void head_rows(int64_t b, int64_t h, const SeqBounds& sb, int64_t i0, int64_t m,
                 const KeyRange& lse_keys, const KeyRange& kr, Emit&& emit) {
    if (kr.lo >= kr.hi) return;
    const acc_t log2e = static_cast<acc_t>(kLog2e);
    const acc_t s_scale = static_cast<acc_t>(p.scale) * log2e;
    const LocalBand band{sb.key_offset, p.window_left, p.window_right};
    const ScoreMod<acc_t> mod = ScoreMod<acc_t>::make(p, b, h, sb.key_offset, log2e);
    const int64_t hk = h / p.group(), n_begin = kr.tiles_begin, n_end = kr.hi;
    // lse in the log2 domain as a float pair hi + lo (exp2_scale_shift2), as the backward has it.
    // Recomputed here, in one more pass over the scores, without a given lse (attention_weights:
    // p.lse null) and for fp64, as the backward does (recompute_lse2): the float32 lse would cap
    // fp64's probabilities at ~1e-7 relative error.
    const bool recompute_lse = std::is_same_v<acc_t, double> || p.lse == nullptr;
    const KeyRange& packed = recompute_lse ? lse_keys : kr;  // kr lies within lse_keys
    const auto* q = row_ptr(static_cast<const scalar_t*>(p.q), p.q_batch_stride, p.q_head_stride,
                            p.q_row_stride, b, h, sb.q_begin + i0);
    int64_t ldq = p.q_row_stride;
    const auto* qt = [&] {
      if constexpr (Products::kReadsInputQuery)
        return q;
      else
        return load_tile(q, p.q_row_stride, m, p.head_dim, q_buf.get(), &ldq);
    }();
    // k doubles as v (prepare_probabilities): the products pack it for P V too, a pass over
    // the head's keys next to the Sq x Sk products.
    const auto k = kv_head_rows<scalar_t>(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                          b, hk, sb.k_begin);
    prod.load_head(b * p.kv_heads + hk, k, k, packed.tiles_begin, packed.hi, sb.seqlen_k);
    // Scaled (log2 domain), modified and masked scores of key tile [j0, j0 + n) into s, as the
    // forward forms them.
    auto tile_scores = [&](int64_t j0, int64_t n, acc_t* s) {
      prod.load_tile(j0, n);
      prod.scores(qt, ldq, m, n, s_scale, s, kN);
      if (mod.active()) modify_tile(mod, i0, m, j0, n, s, kN);
      const bool band_partial = !band.tile_unmasked(i0, i0 + m, j0, j0 + n);
      if (band_partial || p.mask_kind != MaskKind::kNone)
        mask_tile<scalar_t>(p, band, b, h, i0, m, j0, n, band_partial, s, kN);
    };

    if (recompute_lse) {
      std::vector<SoftmaxState<acc_t>> st(m, initial_state<acc_t>(p, h, log2e));
      for (int64_t j0 = lse_keys.tiles_begin; j0 < lse_keys.hi; j0 += kN) {
        const int64_t n = std::min(kN, lse_keys.hi - j0);
        acc_t* s = s_buf.get();
        tile_scores(j0, n, s);
        for (int64_t r = 0; r < m; ++r) {
          st[r].rescale_to(rows.max(s + r * kN, n));
          st[r].sum += rows.exp2_sum(s + r * kN, n, st[r].shift());
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        const double l2 =
            st[r].empty() && !std::isnan(st[r].sum)
                ? -std::numeric_limits<double>::infinity()
                : static_cast<double>(st[r].max) + std::log2(static_cast<double>(st[r].sum));
        lse2.get()[r] = static_cast<acc_t>(l2);
        lse2_lo.get()[r] =
            std::isfinite(l2) ? static_cast<acc_t>(l2 - static_cast<acc_t>(l2)) : acc_t(0);
      }
    } else {
      const int64_t lse_row0 = row_index(p, sb, b, h, i0);
      for (int64_t r = 0; r < m; ++r) {
        const double l2 = static_cast<double>(p.lse[lse_row0 + r]) * kLog2e;
        lse2.get()[r] = static_cast<acc_t>(l2);
        lse2_lo.get()[r] =
            std::isfinite(l2) ? static_cast<acc_t>(l2 - static_cast<acc_t>(l2)) : acc_t(0);
      }
    }

    // Dropout as the forward applies it (tile_mask.h): the same mask, from the same rows.
    const bool dropout = p.dropout_p > 0.0;
    const acc_t keep_scale = static_cast<acc_t>(1.0 / (1.0 - p.dropout_p));
    const int64_t row0 = row_index(p, sb, b, h, i0);
    for (int64_t j0 = n_begin; j0 < n_end; j0 += kN) {
      const int64_t n = std::min(kN, n_end - j0);
      acc_t* s = s_buf.get();
      tile_scores(j0, n, s);
      if (dropout) dropout_tile(p, row0, m, j0, n, keep.get());
      for (int64_t r = 0; r < m; ++r) {
        acc_t* sr = s + r * kN;
        if (lse2.get()[r] == -std::numeric_limits<acc_t>::infinity()) {
          std::fill(sr, sr + n, acc_t(0));  // a row that saw no key has no probabilities
        } else {
          rows.exp2_rows(sr, n, lse2.get()[r], lse2_lo.get()[r]);
          if (dropout) apply_keep(sr, keep.get() + r * n, n, keep_scale);
        }
        emit(r, j0, sr, n);
      }
    }
  }
};

// A varlen batch's (sequence, head, query block) tasks, the sequences with the most work
// first (work of a block ~ the keys it sees), a sequence's heads and blocks in order so that a
// thread's consecutive tasks share its packed keys; for parallel_claim.
struct VarlenTask {
  int32_t b, h, mb;
};
inline std::vector<VarlenTask> varlen_tasks(const AttentionParams& p, int64_t block_m) {
  std::vector<std::pair<int64_t, int64_t>> order;  // (-work, sequence)
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqBounds sb = seq_bounds(p, b);
    if (sb.seqlen_q > 0) order.emplace_back(-sb.seqlen_q * std::max<int64_t>(sb.seqlen_k, 1), b);
  }
  std::stable_sort(order.begin(), order.end());
  std::vector<VarlenTask> tasks;
  for (const auto& [work, b] : order) {
    const int64_t num_m = (seq_bounds(p, b).seqlen_q + block_m - 1) / block_m;
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t mb = 0; mb < num_m; ++mb)
        tasks.push_back(
            {static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(mb)});
  }
  return tasks;
}

// The (sequence, head, query block) tasks of a forward-side kernel, each run by a thread's
// worker (make_worker()): dense batches in order, varlen batches as varlen_tasks orders them.
template <typename MakeWorker>
void run_query_blocks(const AttentionParams& p, int64_t kM, MakeWorker make_worker) {
  using Worker = decltype(make_worker());
  if (p.varlen()) {
    const std::vector<VarlenTask> tasks = varlen_tasks(p, kM);
    parallel_claim(static_cast<int64_t>(tasks.size()), make_worker,
                   [&](Worker& w, int64_t t) { w.run(tasks[t].b, tasks[t].h, tasks[t].mb); });
    return;
  }
  const int64_t num_m = (p.seqlen_q + kM - 1) / kM;
  at::parallel_for(0, p.batch * p.heads * num_m, 1, [&](int64_t begin, int64_t end) {
    Worker w = make_worker();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t mb = task % num_m, bh = task / num_m;
      w.run(bh / p.heads, bh % p.heads, mb);
    }
  });
}

// Query blocks shorter than FlashTraits' choice are whole 16-row tiles (the AMX products' score
// rows, kScoreRowAlign).
constexpr int64_t kShortBlockRows = 16;

// The query-row block: FlashTraits' choice, or the query length rounded up to whole tiles when
// that is shorter (the same one block per head, so the same tasks and results). The workers'
// scratch is sized by it and value-initialized once per call: zeroing a 128-row score tile was
// ~6% of an 8-row fp32 call (docs/performance.md, "Per-call overhead").
template <typename scalar_t>
int64_t fwd_block_m(const AttentionParams& p) {
  const LocalBand band{p.key_offset, p.window_left, p.window_right};
  const int64_t rows =
      (std::max<int64_t>(p.seqlen_q, 1) + kShortBlockRows - 1) / kShortBlockRows * kShortBlockRows;
  return std::min(FlashTraits<scalar_t>::fwd_block_m(band.has_right(), p.seqlen_k), rows);
}

// The forward: out and lse.
template <typename scalar_t, typename Products>
struct FlashFwd {
  static void run(const AttentionParams& p) {
    const int64_t kM = fwd_block_m<scalar_t>(p);
    run_query_blocks(p, kM, [&] { return FwdWorker<scalar_t, Products>(p, kM); });
  }
};
// A head mean's tasks per thread to aim for (so that uneven blocks balance).
constexpr int64_t kMeanTasksPerThread = 2;

// The probabilities of a forward's lse into weights, the op's (B, H, Sq, Sk) output, or with
// mean_heads their mean over heads, (B, Sq, Sk): one task per (batch, query block, key chunk).
template <typename scalar_t, typename Products>
struct Probabilities {
  static void run(const AttentionParams& p, scalar_t* weights, bool mean_heads) {
    using Worker = ProbWorker<scalar_t, Products>;
    const int64_t kM = fwd_block_m<scalar_t>(p);
    if (!mean_heads) {
      run_query_blocks(p, kM, [&] { return Worker(p, weights, kM); });
      return;
    }
    // Tasks: (batch, query block, key chunk). A task sums every head of its rows, so with fewer
    // (batch, query block)s than kMeanTasksPerThread per thread (B 1 at a few hundred rows on a
    // server) the keys are split into chunks of whole kN tiles, each task owning its columns.
    const int64_t num_m = (p.seqlen_q + kM - 1) / kM, blocks = p.batch * num_m;
    const int64_t key_tiles = (p.seqlen_k + Worker::kN - 1) / Worker::kN;
    const int64_t wanted = static_cast<int64_t>(at::get_num_threads()) * kMeanTasksPerThread;
    const int64_t split = std::clamp<int64_t>((wanted + blocks - 1) / std::max<int64_t>(blocks, 1),
                                              1, std::max<int64_t>(key_tiles, 1));
    const int64_t chunk_keys = (key_tiles + split - 1) / split * Worker::kN;
    const int64_t chunks = std::max<int64_t>((p.seqlen_k + chunk_keys - 1) / chunk_keys, 1);
    at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
      Worker w(p, weights, kM);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c = task % chunks, block = task / chunks;
        w.run_mean(block / num_m, block % num_m, c * chunk_keys, (c + 1) * chunk_keys);
      }
    });
  }
};

// Kernel<scalar_t, Products>::run(p, args...) on the packed products for float accumulation
// once the query blocks of a head are enough to amortize packing it, or (fp32) its keys are few
// (for bf16 on AMX tiles or AVX512-BF16 where block_kernels() says so); BLAS otherwise (fp64,
// other ISAs, a few query rows against many keys).
template <template <typename, typename> class Kernel, typename scalar_t, typename... Args>
void with_fwd_products(const AttentionParams& p, Args... args) {
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<typename FlashTraits<scalar_t>::acc_t, float>) {
    const bool few_keys =
        std::is_same_v<scalar_t, float> && p.seqlen_k <= FlashTraits<scalar_t>::kPackedFewKeys;
    if (p.seqlen_q >= FlashTraits<scalar_t>::kPackedMinQueries || few_keys) {
#ifdef ATTN_EXT_AMX_PRODUCTS
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        switch (block_kernels().bf16_operands) {
          case Bf16Operands::kAmx:
            return Kernel<scalar_t, Bf16Products<AmxPairs>>::run(p, args...);
          case Bf16Operands::kAvx512Bf16:
            return Kernel<scalar_t, Bf16Products<Avx512Bf16Pairs>>::run(p, args...);
          case Bf16Operands::kFp32:
            break;
        }
      }
#endif
      return Kernel<scalar_t, PackedProducts<scalar_t>>::run(p, args...);
    }
  }
#endif
  Kernel<scalar_t, BlasProducts<scalar_t>>::run(p, args...);
}

void run_fwd(const char* op, AttentionParams& p, const at::Tensor& q) {
  // (The lambdas are parenthesized: their template arguments' commas would split the macro's.)
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), op,
                             ([&] { with_fwd_products<FlashFwd, scalar_t>(p); }));
}

std::tuple<at::Tensor, at::Tensor> attention_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    std::optional<int64_t> key_offset, double dropout_p, double softcap) {
  constexpr const char* kOp = "attn_ext.attention";
  check_cpu_support(kOp);
  PreparedInputs in =
      prepare_attention(kOp, q, k, v,
                        {attn_mask, scale, causal, window_left, window_right, key_offset, dropout_p,
                         rng_state, softcap, alibi_slopes, sinks});
  AttentionParams& p = in.params;
  auto [out, lse] = allocate_outputs(p, q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  run_fwd(kOp, p, q);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& block_table, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    double dropout_p, double softcap) {
  constexpr const char* kOp = "attn_ext.attention_varlen";
  check_cpu_support(kOp);
  PreparedInputs in = prepare_attention_varlen(
      kOp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      varlen_options(scale, causal, window_left, window_right, dropout_p, rng_state, softcap,
                     alibi_slopes, sinks, block_table));
  AttentionParams& p = in.params;
  auto [out, lse] = allocate_outputs(p, q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  run_fwd(kOp, p, q);
  return {out, lse};
}

at::Tensor attention_probabilities_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    std::optional<int64_t> key_offset, double dropout_p, bool mean_heads, double softcap) {
  constexpr const char* kOp = "attn_ext.attention_probabilities";
  check_cpu_support(kOp);
  PreparedInputs in =
      prepare_probabilities(kOp, q, k, lse,
                            {attn_mask, scale, causal, window_left, window_right, key_offset,
                             dropout_p, rng_state, softcap, alibi_slopes, sinks});
  AttentionParams& p = in.params;
  // Written whole by the tasks; a memory-bound output, advised as attention_weights' buffers are.
  const std::vector<int64_t> shape =
      mean_heads ? std::vector<int64_t>{p.batch, p.seqlen_q, p.seqlen_k}
                 : std::vector<int64_t>{p.batch, p.heads, p.seqlen_q, p.seqlen_k};
  at::Tensor w = advise_huge_pages(at::empty(shape, q.options()));
  if (w.numel() == 0) return w;
  if (p.kv_heads == 0 || p.heads == 0) return w.zero_();
  const at::Tensor l = lse.contiguous();
  p.lse = const_cast<float*>(l.const_data_ptr<float>());
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp, ([&] {
                               with_fwd_products<Probabilities, scalar_t>(
                                   p, w.mutable_data_ptr<scalar_t>(), mean_heads);
                             }));
  return w;
}

// The softmax of the scores itself: the probabilities kernel with its own lse (no P V).
at::Tensor attention_weights_cpu(const at::Tensor& q, const at::Tensor& k,
                                 const std::optional<at::Tensor>& attn_mask,
                                 const std::optional<at::Tensor>& alibi_slopes,
                                 const std::optional<at::Tensor>& sinks,
                                 std::optional<double> scale, bool causal, int64_t window_left,
                                 int64_t window_right, std::optional<int64_t> key_offset,
                                 double softcap) {
  constexpr const char* kOp = "attn_ext.attention_weights";
  check_cpu_support(kOp);
  PreparedInputs in =
      prepare_probabilities(kOp, q, k,
                            weights_options(attn_mask, scale, causal, window_left, window_right,
                                            key_offset, softcap, alibi_slopes, sinks));
  AttentionParams& p = in.params;
  at::Tensor w =
      advise_huge_pages(at::empty({p.batch, p.heads, p.seqlen_q, p.seqlen_k}, q.options()));
  if (w.numel() == 0) return w;
  if (p.kv_heads == 0) return w.zero_();
  p.lse = nullptr;  // head_rows recomputes it
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp, ([&] {
                               with_fwd_products<Probabilities, scalar_t>(
                                   p, w.mutable_data_ptr<scalar_t>(), false);
                             }));
  return w;
}

}  // namespace

void flash_forward(const char* op, AttentionParams& p, const at::Tensor& q) {
  run_fwd(op, p, q);
}

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention", &attention_cpu);
  m.impl("attention_varlen", &attention_varlen_cpu);
  m.impl("attention_probabilities", &attention_probabilities_cpu);
  m.impl("attention_weights", &attention_weights_cpu);
}

}  // namespace attn_ext::cpu
