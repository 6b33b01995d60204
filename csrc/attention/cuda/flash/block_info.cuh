#pragma once
// Which rows and keys one thread block of the flash kernels owns, from its block index.
// Rows and keys are relative to the block's sequence (seq_bounds: the whole batch entry of a
// fixed-length batch, one sequence of a varlen batch). kVarlen = false compiles the
// fixed-length layout only, reading the params where the kernels did before varlen batches
// existed (the verified kernels compile to the same code); true also serves varlen batches,
// whose grid is sized from the caller's max_seqlen_*: the blocks then loop over advance(), so
// that a sequence longer than that promise is still computed whole.
#include <cstdint>
#include "common/cuda/elem.cuh"
#include "common/mask.h"
#include "attention/params.h"

namespace attn_ext::cuda {

// Blocks per (b, h) along `len` rows (a varlen batch: its max_seqlen). A varlen grid has at
// least one, so that a max_seqlen of 0 still covers its sequences; shared by the launches and
// the block infos so that they agree.
__host__ __device__ inline int64_t grid_blocks(const AttentionParams& p, int64_t len,
                                               int64_t block) {
  const int64_t n = ceil_div(len, block);
  return n == 0 && p.varlen() ? 1 : n;
}

// The AttentionParams row helpers (params.h) with varlen() known at compile time.
template <bool kVarlen>
struct RowLayout {
  __device__ static SeqBounds seq(const AttentionParams& p, int64_t b) {
    if constexpr (kVarlen) return seq_bounds(p, b);
    return {0, p.seqlen_q, 0, p.seqlen_k, p.key_offset};
  }
  // (b, h)'s index among the row arrays' heads (head_row() = head * rows), and row_index() of
  // its sequence's row 0 from it: where its rows start in lse and the backward's workspace.
  __device__ static int64_t head(const AttentionParams& p, int64_t b, int64_t h) {
    if constexpr (kVarlen) return p.varlen() ? h : b * p.heads + h;
    return b * p.heads + h;
  }
  __device__ static int64_t row0(const AttentionParams& p, const SeqBounds& s, int64_t head) {
    if constexpr (kVarlen) return head * p.q_rows() + s.q_begin;
    return head * p.seqlen_q;
  }
  __device__ static int64_t q_rows(const AttentionParams& p) {
    return kVarlen ? p.q_rows() : p.seqlen_q;
  }
  __device__ static int64_t k_rows(const AttentionParams& p) {
    return kVarlen ? p.k_rows() : p.seqlen_k;
  }
  // AttentionBwdParams::acc_row() / acc_row_step(), from (b, h)'s head index (head()) and h.
  __device__ static int64_t acc_row(const AttentionBwdParams& p, int64_t head, int64_t h, int64_t r,
                                    int64_t rows) {
    if constexpr (kVarlen) return p.varlen() ? r * p.heads + h : head * rows + r;
    return head * rows + r;
  }
  __device__ static int64_t acc_step(const AttentionBwdParams& p) {
    if constexpr (kVarlen) return p.acc_row_step();
    return 1;
  }
};

// A query block of (b, h): rows [m0, m0 + rows) (rows <= 0: nothing left) and the key range
// [n_begin, n_end) the band lets any of them see. Heavy (late, under a causal band) query
// blocks get the low block indices so they start first.
template <bool kVarlen>
struct QueryBlockInfo {
  int64_t b, h, hk, m0, rows, n_begin, n_end;
  int64_t block_m, stride;

  __device__ QueryBlockInfo(const AttentionParams& p, int64_t block_m_, int64_t linear_block)
      : block_m(block_m_) {
    const int64_t num_m =
        kVarlen ? grid_blocks(p, p.seqlen_q, block_m) : (p.seqlen_q + block_m - 1) / block_m;
    const int64_t bh = linear_block / num_m;
    const int64_t mb = num_m - 1 - linear_block % num_m;
    b = bh / p.heads;
    h = bh % p.heads;
    hk = h / p.group();
    if constexpr (kVarlen) seq_ = seq_bounds(p, b);
    stride = num_m * block_m;
    set_rows(p, mb * block_m);
  }
  // The block's sequence: read once (varlen) or formed from the params where it is used.
  __device__ SeqBounds seq(const AttentionParams& p) const {
    if constexpr (kVarlen) return seq_;
    return RowLayout<false>::seq(p, b);
  }
  // The block's next rows of the same sequence (grid-stride), for sequences longer than the
  // grid assumed; false when there are none (always, for a fixed-length batch).
  __device__ bool advance(const AttentionParams& p) {
    set_rows(p, m0 + stride);
    return rows > 0;
  }

 private:
  SeqBounds seq_;  // kVarlen only

  __device__ void set_rows(const AttentionParams& p, int64_t first) {
    m0 = first;
    rows = seq(p).seqlen_q - m0 < block_m ? seq(p).seqlen_q - m0 : block_m;
    const LocalBand band{seq(p).key_offset, p.window_left, p.window_right};
    n_begin = band.key_begin(m0, seq(p).seqlen_k);
    n_end = band.key_end(m0 + (kVarlen ? max(rows, int64_t(0)) : rows), seq(p).seqlen_k);
    if (n_end < n_begin) n_end = n_begin;
  }
};

// A key block of (b, h): keys [n0, n0 + keys) (keys <= 0: nothing left) and the query rows
// [r_begin, r_end) that may see any of them.
template <bool kVarlen>
struct KeyBlockInfo {
  int64_t b, h, hk, n0, keys, r_begin, r_end;
  int64_t block_n, stride;

  __device__ KeyBlockInfo(const AttentionParams& p, int64_t block_n_, int64_t linear_block)
      : block_n(block_n_) {
    const int64_t num_n =
        kVarlen ? grid_blocks(p, p.seqlen_k, block_n) : (p.seqlen_k + block_n - 1) / block_n;
    const int64_t bh = linear_block / num_n;
    b = bh / p.heads;
    h = bh % p.heads;
    hk = h / p.group();
    if constexpr (kVarlen) seq_ = seq_bounds(p, b);
    stride = num_n * block_n;
    set_keys(p, (linear_block % num_n) * block_n);
  }
  __device__ SeqBounds seq(const AttentionParams& p) const {
    if constexpr (kVarlen) return seq_;
    return RowLayout<false>::seq(p, b);
  }
  __device__ bool advance(const AttentionParams& p) {
    set_keys(p, n0 + stride);
    return keys > 0;
  }

 private:
  SeqBounds seq_;  // kVarlen only

  __device__ void set_keys(const AttentionParams& p, int64_t first) {
    n0 = first;
    keys = seq(p).seqlen_k - n0 < block_n ? seq(p).seqlen_k - n0 : block_n;
    const LocalBand band{seq(p).key_offset, p.window_left, p.window_right};
    r_begin = band.row_begin(n0, seq(p).seqlen_q);
    r_end = band.row_end(n0 + (kVarlen ? max(keys, int64_t(0)) : keys), seq(p).seqlen_q);
    if (r_end < r_begin) r_end = r_begin;
  }
};

// The sequence of query token t of a varlen batch: the last b with cu_seqlens_q[b] <= t (a
// binary search; empty sequences are skipped). A token outside every sequence (offsets not
// starting at 0 or ending short of total_q, which the GPU op cannot check) gets a b whose rows
// do not contain it; callers test that.
__device__ inline int64_t sequence_of_token(const AttentionParams& p, int64_t t) {
  int64_t lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.cu_seqlens_q[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace attn_ext::cuda
