#pragma once
// Which rows and keys one thread block of the flash kernels owns, from its block index.
#include <cstdint>
#include "common/mask.h"
#include "attention/params.h"

namespace attn_ext::cuda {

// A query block of (b, h): rows [m0, m0 + rows) and the key range [n_begin, n_end) the
// band lets any of them see. Heavy (late, under a causal band) query blocks get the low
// block indices so they start first.
struct QueryBlockInfo {
  int64_t b, h, hk, m0, rows, n_begin, n_end;

  __device__ QueryBlockInfo(const AttentionParams& p, int64_t block_m, int64_t linear_block) {
    const int64_t num_m = (p.seqlen_q + block_m - 1) / block_m;
    const int64_t bh = linear_block / num_m;
    const int64_t mb = num_m - 1 - linear_block % num_m;
    b = bh / p.heads;
    h = bh % p.heads;
    hk = h / p.group();
    m0 = mb * block_m;
    rows = p.seqlen_q - m0 < block_m ? p.seqlen_q - m0 : block_m;
    const LocalBand band{p.key_offset, p.window_left, p.window_right};
    n_begin = band.key_begin(m0, p.seqlen_k);
    n_end = band.key_end(m0 + rows, p.seqlen_k);
    if (n_end < n_begin) n_end = n_begin;
  }
};

// A key block of (b, h): keys [n0, n0 + keys) and the query rows [r_begin, r_end) that
// may see any of them.
struct KeyBlockInfo {
  int64_t b, h, hk, n0, keys, r_begin, r_end;

  __device__ KeyBlockInfo(const AttentionParams& p, int64_t block_n, int64_t linear_block) {
    const int64_t num_n = (p.seqlen_k + block_n - 1) / block_n;
    const int64_t bh = linear_block / num_n;
    b = bh / p.heads;
    h = bh % p.heads;
    hk = h / p.group();
    n0 = (linear_block % num_n) * block_n;
    keys = p.seqlen_k - n0 < block_n ? p.seqlen_k - n0 : block_n;
    const LocalBand band{p.key_offset, p.window_left, p.window_right};
    r_begin = band.row_begin(n0, p.seqlen_q);
    r_end = band.row_end(n0 + keys, p.seqlen_q);
    if (r_end < r_begin) r_end = r_begin;
  }
};

}  // namespace attn_ext::cuda
