#pragma once
// Which rows and keys one thread block of the flash kernels owns, from its block index.
// Rows and keys are relative to the block's sequence (seq_bounds: the whole batch entry of a
// fixed-length batch, one sequence of a varlen batch); the grid is sized from seqlen_q /
// seqlen_k, which a varlen call takes from the caller's max_seqlen_*: the generic kernels
// loop over advance() so that a sequence longer than that promise is still computed whole.
#include <cstdint>
#include "common/mask.h"
#include "attention/params.h"

namespace attn_ext::cuda {

// A query block of (b, h): rows [m0, m0 + rows) (rows <= 0: nothing left) and the key range
// [n_begin, n_end) the band lets any of them see. Heavy (late, under a causal band) query
// blocks get the low block indices so they start first.
struct QueryBlockInfo {
  int64_t b, h, hk, m0, rows, n_begin, n_end, block_m, stride;
  SeqBounds seq;

  __device__ QueryBlockInfo(const AttentionParams& p, int64_t block_m_, int64_t linear_block)
      : block_m(block_m_) {
    const int64_t num_m = (p.seqlen_q + block_m - 1) / block_m;
    const int64_t bh = linear_block / num_m;
    const int64_t mb = num_m - 1 - linear_block % num_m;
    b = bh / p.heads;
    h = bh % p.heads;
    hk = h / p.group();
    seq = seq_bounds(p, b);
    stride = num_m * block_m;
    set_rows(p, mb * block_m);
  }
  // The block's next rows of the same sequence (grid-stride), for sequences longer than the
  // grid assumed; false when there are none.
  __device__ bool advance(const AttentionParams& p) {
    set_rows(p, m0 + stride);
    return rows > 0;
  }

 private:
  __device__ void set_rows(const AttentionParams& p, int64_t first) {
    m0 = first;
    rows = seq.seqlen_q - m0 < block_m ? seq.seqlen_q - m0 : block_m;
    const LocalBand band{seq.key_offset, p.window_left, p.window_right};
    n_begin = band.key_begin(m0, seq.seqlen_k);
    n_end = band.key_end(m0 + (rows > 0 ? rows : 0), seq.seqlen_k);
    if (n_end < n_begin) n_end = n_begin;
  }
};

// A key block of (b, h): keys [n0, n0 + keys) (keys <= 0: nothing left) and the query rows
// [r_begin, r_end) that may see any of them.
struct KeyBlockInfo {
  int64_t b, h, hk, n0, keys, r_begin, r_end, block_n, stride;
  SeqBounds seq;

  __device__ KeyBlockInfo(const AttentionParams& p, int64_t block_n_, int64_t linear_block)
      : block_n(block_n_) {
    const int64_t num_n = (p.seqlen_k + block_n - 1) / block_n;
    const int64_t bh = linear_block / num_n;
    b = bh / p.heads;
    h = bh % p.heads;
    hk = h / p.group();
    seq = seq_bounds(p, b);
    stride = num_n * block_n;
    set_keys(p, (linear_block % num_n) * block_n);
  }
  __device__ bool advance(const AttentionParams& p) {
    set_keys(p, n0 + stride);
    return keys > 0;
  }

 private:
  __device__ void set_keys(const AttentionParams& p, int64_t first) {
    n0 = first;
    keys = seq.seqlen_k - n0 < block_n ? seq.seqlen_k - n0 : block_n;
    const LocalBand band{seq.key_offset, p.window_left, p.window_right};
    r_begin = band.row_begin(n0, seq.seqlen_q);
    r_end = band.row_end(n0 + (keys > 0 ? keys : 0), seq.seqlen_q);
    if (r_end < r_begin) r_end = r_begin;
  }
};

// The sequence of query token t of a varlen batch (cu_seqlens_q[b] <= t < cu_seqlens_q[b + 1]):
// a binary search over the offsets (empty sequences are skipped by taking the last b).
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
