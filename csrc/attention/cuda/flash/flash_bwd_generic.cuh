#pragma once
// Generic flash-attention backward (SIMT, acc_t accumulation), deterministic by construction:
// no two thread blocks write one element and every sum runs in a fixed order.
//   preprocess  one warp per query row: delta = rowsum(dO * O) - grad_lse, and the log2-domain
//               lse the probabilities are rebuilt from (fp64: recomputed in fp64, since the
//               forward reports float32; otherwise the float32 lse as hi + lo); rows indexed as
//               lse (row_index), so a sink's gradient is formed from them afterwards;
//   dk/dv pass  one block per (b, query head h, key block): P and dS for the query rows that
//               see the block, tile by tile; dV += P_dropped^T dO, dK += scale dS^T Q;
//   dq pass     one block per (b, h, query block): the same tiles recomputed over the keys the
//               rows see; dQ += scale dS K.
// dk / dv are per query head (AttentionBwdParams); the op sums each GQA group afterwards.
// Two instantiations of each kernel per dtype, as in the forward: kVarlenOrMods = false for
// fixed-length batches without score modifiers (the verified kernels), true for varlen batches
// (rows and keys relative to each sequence, block_info.cuh; the passes loop over grid-stride
// blocks of sequences longer than the grid) and softcap / ALiBi / sinks (softcap's derivative
// scales dS; the sinks' gradient is formed from the preprocess's rows by the op).
#include <cstdint>
#include <type_traits>
#include "common/constants.h"
#include "common/online_softmax.h"
#include "attention/score_mod.h"
#include "common/cuda/elem.cuh"
#include "attention/cuda/flash/block_info.cuh"
#include "attention/cuda/flash/launch_templates.h"
#include "attention/cuda/flash/score_mask.cuh"

namespace attn_ext::cuda {

struct GenericBwdTraits {
  static constexpr int kThreads = 128;
  static constexpr int kWarp = 32;
  // Square 16 x 16 tiles: with fp64 and D = Dv = 256 the four operand tiles (Q, dO, K, V)
  // still fit the 163 KiB of shared memory an A100 block may use.
  static constexpr int kBlockM = 16;
  static constexpr int kBlockN = 16;
};

// Shared-memory layout of both passes: operand tiles in acc_t, K / V rows padded by one
// element so that threads reading different keys hit different banks.
template <typename acc_t>
struct BwdTiles {
  acc_t *q, *dout, *k, *v, *p, *ds;
  int64_t ldk, ldv;

  static __host__ __device__ size_t elems(int64_t d, int64_t dv) {
    using Tr = GenericBwdTraits;
    return static_cast<size_t>(Tr::kBlockM * (d + dv) + Tr::kBlockN * (d + 1 + dv + 1) +
                               2 * Tr::kBlockM * Tr::kBlockN);
  }
  __device__ BwdTiles(acc_t* base, int64_t d, int64_t dv) : ldk(d + 1), ldv(dv + 1) {
    using Tr = GenericBwdTraits;
    q = base;
    dout = q + Tr::kBlockM * d;
    k = dout + Tr::kBlockM * dv;
    v = k + Tr::kBlockN * ldk;
    p = v + Tr::kBlockN * ldv;
    ds = p + Tr::kBlockM * Tr::kBlockN;
  }
};

template <typename T>
size_t bwd_generic_smem_bytes(int64_t head_dim, int64_t head_dim_v) {
  using acc_t = typename Elem<T>::acc_t;
  return BwdTiles<acc_t>::elems(head_dim, head_dim_v) * sizeof(acc_t);
}

// Per-row values of the backward, read from the workspace.
template <typename acc_t>
struct BwdRows {
  const acc_t* delta;
  const acc_t* lse2;
  const acc_t* lse2_lo;
};

template <typename T, bool kVarlenOrMods>
__global__ void __launch_bounds__(GenericBwdTraits::kThreads)
    flash_bwd_preprocess_kernel(AttentionBwdParams p, BwdWorkspace ws) {
  using acc_t = typename Elem<T>::acc_t;
  using Rows = RowLayout<kVarlenOrMods>;
  constexpr int kWarp = GenericBwdTraits::kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= (kVarlenOrMods ? p.row_batches() : p.batch) * p.heads * Rows::q_rows(p)) return;
  // (b, h, i) of the row: row = head_row(b, h, q_rows) + q_begin + i
  int64_t b, h, i;
  if (kVarlenOrMods && p.varlen()) {
    const int64_t token = row % p.total_q;
    h = row / p.total_q;
    b = sequence_of_token(p, token);
    const SeqBounds s = p.batch == 0 ? SeqBounds{} : seq_bounds(p, b);  // clamped offsets
    i = token - s.q_begin;
    if (p.batch == 0 || i < 0 || i >= s.seqlen_q) {
      // a token outside every sequence (offsets the op cannot check): no probability at all,
      // so that it adds nothing to a sink's gradient; no other kernel reads its row
      if (lane == 0) {
        static_cast<acc_t*>(ws.delta)[row] = 0;
        static_cast<acc_t*>(ws.lse2)[row] = INFINITY;
        static_cast<acc_t*>(ws.lse2_lo)[row] = 0;
      }
      return;
    }
  } else {
    i = row % p.seqlen_q;
    const int64_t bh = row / p.seqlen_q;
    b = bh / p.heads;
    h = bh % p.heads;
  }
  const int64_t hk = h / p.group();
  const auto seq = [&] { return Rows::seq(p, b); };  // formed where used, as block_info's
  const T* o = static_cast<const T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
               (seq().q_begin + i) * p.o_row_stride;
  const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride +
                  (seq().q_begin + i) * p.do_row_stride;
  acc_t d = 0;
  for (int64_t c = lane; c < p.head_dim_v; c += kWarp)
    d += Elem<T>::load(dout[c]) * Elem<T>::load(o[c]);
  for (int off = kWarp / 2; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);

  acc_t hi, lo = 0;
  if constexpr (std::is_same_v<acc_t, double>) {
    // lane-wise online softmax over the keys the row sees, then a fixed-order warp merge
    const LocalBand band{seq().key_offset, p.window_left, p.window_right};
    const ScoreMask<acc_t, kVarlenOrMods> mask(p, b, h, seq());
    const acc_t s_scale = static_cast<acc_t>(p.scale) * static_cast<acc_t>(kLog2e);
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                 (seq().q_begin + i) * p.q_row_stride;
    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride +
                 seq().k_begin * p.k_row_stride;
    // lane 0 starts from the sink (if any): the merge below then counts it once
    SoftmaxState<acc_t> st = kVarlenOrMods && lane == 0
                                 ? initial_state<acc_t>(p, h, static_cast<acc_t>(kLog2e))
                                 : SoftmaxState<acc_t>{};
    const int64_t keys = seq().seqlen_k;
    const int64_t j_end = band.key_end(i + 1, keys);
    for (int64_t j = band.key_begin(i, keys) + lane; j < j_end; j += kWarp) {
      acc_t s = 0;
      for (int64_t c = 0; c < p.head_dim; ++c)
        s += Elem<T>::load(q[c]) * Elem<T>::load(k[j * p.k_row_stride + c]);
      s = mask.apply(s, s_scale, i, j);
      st.rescale_to(s);
      st.sum += exp2(s - st.shift());
    }
    for (int off = kWarp / 2; off > 0; off /= 2) {
      SoftmaxState<acc_t> other;
      other.max = __shfl_xor_sync(0xffffffffu, st.max, off);
      other.sum = __shfl_xor_sync(0xffffffffu, st.sum, off);
      acc_t fs, fo;
      st.merge(other, &fs, &fo);
    }
    hi = st.empty() && !isnan(st.sum) ? acc_t(-INFINITY) : st.max + log2(st.sum);
  } else {
    const double l2 = static_cast<double>(p.lse[row]) * kLog2e;
    hi = static_cast<acc_t>(l2);
    lo = isfinite(l2) ? static_cast<acc_t>(l2 - static_cast<double>(hi)) : acc_t(0);
  }
  if (lane == 0) {
    static_cast<acc_t*>(ws.delta)[row] = p.grad_lse ? d - static_cast<acc_t>(p.grad_lse[row]) : d;
    static_cast<acc_t*>(ws.lse2)[row] = hi;
    static_cast<acc_t*>(ws.lse2_lo)[row] = lo;
  }
}

// Loads `rows` rows of a (b, h) slab into a tile of pitch ld, times `scale`; rows past
// `rows` are zero.
template <typename T, typename acc_t>
__device__ void load_rows(const T* src, int64_t row_stride, int64_t rows, int64_t max_rows,
                          int64_t cols, acc_t* dst, int64_t ld, acc_t scale) {
  for (int64_t idx = threadIdx.x; idx < max_rows * cols; idx += blockDim.x) {
    const int64_t r = idx / cols, c = idx % cols;
    dst[r * ld + c] = r < rows ? Elem<T>::load(src[r * row_stride + c]) * scale : acc_t(0);
  }
}

// P (dropped, for dV) and dS of the tile rows [i0, i0 + m) x keys [j0, j0 + n) from the
// operand tiles; zero outside the tile, where the key is hidden, or for an empty row.
// (rows: the sequence's, indexed by its row i.)
template <typename acc_t, bool kVarlenOrMods>
__device__ void bwd_tile(const AttentionBwdParams& p, const BwdTiles<acc_t>& t,
                         const ScoreMask<acc_t, kVarlenOrMods>& mask,
                         const DropoutBits<kVarlenOrMods>& drop, const BwdRows<acc_t>& rows,
                         int64_t i0, int64_t m, int64_t j0, int64_t n) {
  using Tr = GenericBwdTraits;
  const acc_t keep_scale = static_cast<acc_t>(1.0 / (1.0 - p.dropout_p));
  const acc_t s_scale = static_cast<acc_t>(p.scale) * static_cast<acc_t>(kLog2e);
  for (int idx = threadIdx.x; idx < Tr::kBlockM * Tr::kBlockN; idx += blockDim.x) {
    const int r = idx / Tr::kBlockN, c = idx % Tr::kBlockN;
    acc_t pd = 0, ds = 0;
    if (r < m && c < n) {
      const int64_t i = i0 + r, j = j0 + c;
      const acc_t l2 = rows.lse2[i];
      acc_t s = 0;
      for (int64_t x = 0; x < p.head_dim; ++x) s += t.q[r * p.head_dim + x] * t.k[c * t.ldk + x];
      // the forward's log2-domain score, and (with softcap) d softcap(s) / d s
      acc_t dcap = 1;
      s = mask.apply(s, s_scale, i, j, kVarlenOrMods ? &dcap : nullptr);
      const acc_t prob = l2 == acc_t(-INFINITY) ? acc_t(0) : exp2((s - l2) - rows.lse2_lo[i]);
      acc_t dp = 0;
      for (int64_t x = 0; x < p.head_dim_v; ++x)
        dp += t.dout[r * p.head_dim_v + x] * t.v[c * t.ldv + x];
      pd = prob;
      if (drop.active()) {
        const bool keep = drop.keep(i, j);
        pd = keep ? prob * keep_scale : acc_t(0);
        dp = keep ? dp * keep_scale : acc_t(0);
      }
      ds = prob * (dp - rows.delta[i]);
      if (kVarlenOrMods) ds *= dcap;
    }
    t.p[idx] = pd;
    t.ds[idx] = ds;
  }
}

template <typename T, bool kVarlenOrMods>
__global__ void __launch_bounds__(GenericBwdTraits::kThreads)
    flash_bwd_dkdv_kernel(AttentionBwdParams p, BwdWorkspace ws) {
  using acc_t = typename Elem<T>::acc_t;
  using Tr = GenericBwdTraits;
  extern __shared__ unsigned char smem_raw[];
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const BwdTiles<acc_t> t(reinterpret_cast<acc_t*>(smem_raw), D, Dv);
  using Rows = RowLayout<kVarlenOrMods>;
  KeyBlockInfo<kVarlenOrMods> bi(p, Tr::kBlockN, blockIdx.x);
  if (kVarlenOrMods && bi.keys <= 0) return;  // past the end of a short varlen sequence
  const int64_t bh = Rows::head(p, bi.b, bi.h);
  const ScoreMask<acc_t, kVarlenOrMods> mask(p, bi.b, bi.h, bi.seq(p));
  const DropoutBits<kVarlenOrMods> drop(p, bi.b, bi.h, bi.seq(p));
  const BwdRows<acc_t> rows{static_cast<const acc_t*>(ws.delta) + Rows::row0(p, bi.seq(p), bh),
                            static_cast<const acc_t*>(ws.lse2) + Rows::row0(p, bi.seq(p), bh),
                            static_cast<const acc_t*>(ws.lse2_lo) + Rows::row0(p, bi.seq(p), bh)};
  const acc_t scale = static_cast<acc_t>(p.scale);
  const int64_t step = Rows::acc_step(p);  // accumulator rows between a head's rows
  const T* q = static_cast<const T*>(p.q) + bi.b * p.q_batch_stride + bi.h * p.q_head_stride +
               bi.seq(p).q_begin * p.q_row_stride;
  const T* dout = static_cast<const T*>(p.dout) + bi.b * p.do_batch_stride +
                  bi.h * p.do_head_stride + bi.seq(p).q_begin * p.do_row_stride;
  do {
    const int64_t key0 = bi.seq(p).k_begin + bi.n0;
    const T* k = static_cast<const T*>(p.k) + bi.b * p.k_batch_stride + bi.hk * p.k_head_stride +
                 key0 * p.k_row_stride;
    const T* v = static_cast<const T*>(p.v) + bi.b * p.v_batch_stride + bi.hk * p.v_head_stride +
                 key0 * p.v_row_stride;
    acc_t* dk = static_cast<acc_t*>(p.dk) + Rows::acc_row(p, bh, bi.h, key0, Rows::k_rows(p)) * D;
    acc_t* dv = static_cast<acc_t*>(p.dv) + Rows::acc_row(p, bh, bi.h, key0, Rows::k_rows(p)) * Dv;

    load_rows(k, p.k_row_stride, bi.keys, Tr::kBlockN, D, t.k, t.ldk, acc_t(1));
    load_rows(v, p.v_row_stride, bi.keys, Tr::kBlockN, Dv, t.v, t.ldv, acc_t(1));
    for (int64_t i0 = bi.r_begin; i0 < bi.r_end; i0 += Tr::kBlockM) {
      const int64_t m = min(int64_t(Tr::kBlockM), bi.r_end - i0);
      load_rows(q + i0 * p.q_row_stride, p.q_row_stride, m, Tr::kBlockM, D, t.q, D, acc_t(1));
      load_rows(dout + i0 * p.do_row_stride, p.do_row_stride, m, Tr::kBlockM, Dv, t.dout, Dv,
                acc_t(1));
      __syncthreads();
      bwd_tile(p, t, mask, drop, rows, i0, m, bi.n0, bi.keys);
      __syncthreads();
      // thread per (key, feature): each element of this block's dk / dv rows has one owner
      for (int64_t idx = threadIdx.x; idx < bi.keys * Dv; idx += blockDim.x) {
        const int64_t c = idx / Dv, f = idx % Dv;
        acc_t acc = 0;
        for (int r = 0; r < m; ++r) acc += t.p[r * Tr::kBlockN + c] * t.dout[r * Dv + f];
        dv[c * step * Dv + f] += acc;
      }
      for (int64_t idx = threadIdx.x; idx < bi.keys * D; idx += blockDim.x) {
        const int64_t c = idx / D, f = idx % D;
        acc_t acc = 0;
        for (int r = 0; r < m; ++r) acc += t.ds[r * Tr::kBlockN + c] * t.q[r * D + f];
        dk[c * step * D + f] += acc * scale;
      }
      __syncthreads();
    }
    if (kVarlenOrMods) __syncthreads();  // the tiles are read before the next keys overwrite them
  } while (kVarlenOrMods && bi.advance(p));  // (fixed length: no loop at all)
}

template <typename T, bool kVarlenOrMods>
__global__ void __launch_bounds__(GenericBwdTraits::kThreads)
    flash_bwd_dq_kernel(AttentionBwdParams p, BwdWorkspace ws) {
  using acc_t = typename Elem<T>::acc_t;
  using Tr = GenericBwdTraits;
  extern __shared__ unsigned char smem_raw[];
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const BwdTiles<acc_t> t(reinterpret_cast<acc_t*>(smem_raw), D, Dv);
  using Rows = RowLayout<kVarlenOrMods>;
  QueryBlockInfo<kVarlenOrMods> bi(p, Tr::kBlockM, blockIdx.x);
  if (kVarlenOrMods && bi.rows <= 0) return;  // past the end of a short varlen sequence
  const int64_t bh = Rows::head(p, bi.b, bi.h);
  const ScoreMask<acc_t, kVarlenOrMods> mask(p, bi.b, bi.h, bi.seq(p));
  const DropoutBits<kVarlenOrMods> drop(p, bi.b, bi.h, bi.seq(p));
  const BwdRows<acc_t> rows{static_cast<const acc_t*>(ws.delta) + Rows::row0(p, bi.seq(p), bh),
                            static_cast<const acc_t*>(ws.lse2) + Rows::row0(p, bi.seq(p), bh),
                            static_cast<const acc_t*>(ws.lse2_lo) + Rows::row0(p, bi.seq(p), bh)};
  const acc_t scale = static_cast<acc_t>(p.scale);
  const int64_t step = Rows::acc_step(p);
  do {
    const int64_t token0 = bi.seq(p).q_begin + bi.m0;
    const T* q = static_cast<const T*>(p.q) + bi.b * p.q_batch_stride + bi.h * p.q_head_stride +
                 token0 * p.q_row_stride;
    const T* dout = static_cast<const T*>(p.dout) + bi.b * p.do_batch_stride +
                    bi.h * p.do_head_stride + token0 * p.do_row_stride;
    const T* k = static_cast<const T*>(p.k) + bi.b * p.k_batch_stride + bi.hk * p.k_head_stride +
                 bi.seq(p).k_begin * p.k_row_stride;
    const T* v = static_cast<const T*>(p.v) + bi.b * p.v_batch_stride + bi.hk * p.v_head_stride +
                 bi.seq(p).k_begin * p.v_row_stride;
    acc_t* dq = static_cast<acc_t*>(p.dq) + Rows::acc_row(p, bh, bi.h, token0, Rows::q_rows(p)) * D;

    load_rows(q, p.q_row_stride, bi.rows, Tr::kBlockM, D, t.q, D, acc_t(1));
    load_rows(dout, p.do_row_stride, bi.rows, Tr::kBlockM, Dv, t.dout, Dv, acc_t(1));
    for (int64_t j0 = bi.n_begin; j0 < bi.n_end; j0 += Tr::kBlockN) {
      const int64_t n = min(int64_t(Tr::kBlockN), bi.n_end - j0);
      load_rows(k + j0 * p.k_row_stride, p.k_row_stride, n, Tr::kBlockN, D, t.k, t.ldk, acc_t(1));
      load_rows(v + j0 * p.v_row_stride, p.v_row_stride, n, Tr::kBlockN, Dv, t.v, t.ldv, acc_t(1));
      __syncthreads();
      bwd_tile(p, t, mask, drop, rows, bi.m0, bi.rows, j0, n);
      __syncthreads();
      for (int64_t idx = threadIdx.x; idx < bi.rows * D; idx += blockDim.x) {
        const int64_t r = idx / D, f = idx % D;
        acc_t acc = 0;
        for (int c = 0; c < n; ++c) acc += t.ds[r * Tr::kBlockN + c] * t.k[c * t.ldk + f];
        dq[r * step * D + f] += acc * scale;
      }
      __syncthreads();
    }
    if (kVarlenOrMods) __syncthreads();  // the tiles are read before the next rows overwrite them
  } while (kVarlenOrMods && bi.advance(p));  // (fixed length: no loop at all)
}

inline cudaError_t set_smem(const void* kernel, size_t smem) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem));
}

// The preprocess alone (the CuTe backward runs it too): every row of lse.
template <typename T, bool kVarlenOrMods>
cudaError_t launch_bwd_preprocess(const AttentionBwdParams& p, BwdWorkspace ws,
                                  cudaStream_t stream) {
  using Tr = GenericBwdTraits;
  const int64_t rows = p.row_batches() * p.heads * p.q_rows();
  constexpr int kRowsPerBlock = Tr::kThreads / Tr::kWarp;  // one warp per row
  flash_bwd_preprocess_kernel<T, kVarlenOrMods>
      <<<static_cast<unsigned>(ceil_div(rows, kRowsPerBlock)), Tr::kThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

template <typename T, bool kVarlenOrMods>
cudaError_t launch_bwd_generic(const AttentionBwdParams& p, BwdWorkspace ws, cudaStream_t stream) {
  using Tr = GenericBwdTraits;
  const int64_t rows = p.row_batches() * p.heads * p.q_rows();
  // A fixed-length batch without keys has no gradient; with sinks, the preprocess still forms
  // the rows their gradient is read from.
  if (rows == 0 || (p.k_rows() == 0 && p.sinks == nullptr)) return cudaSuccess;
  cudaError_t e = launch_bwd_preprocess<T, kVarlenOrMods>(p, ws, stream);
  if (e != cudaSuccess || p.k_rows() == 0) return e;

  const size_t smem = bwd_generic_smem_bytes<T>(p.head_dim, p.head_dim_v);
  const int64_t bh = p.batch * p.heads;
  const auto dkdv = flash_bwd_dkdv_kernel<T, kVarlenOrMods>;
  const auto dq = flash_bwd_dq_kernel<T, kVarlenOrMods>;
  if ((e = set_smem(reinterpret_cast<const void*>(dkdv), smem)) != cudaSuccess) return e;
  dkdv<<<static_cast<unsigned>(bh * grid_blocks(p, p.seqlen_k, Tr::kBlockN)), Tr::kThreads, smem,
         stream>>>(p, ws);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if ((e = set_smem(reinterpret_cast<const void*>(dq), smem)) != cudaSuccess) return e;
  dq<<<static_cast<unsigned>(bh * grid_blocks(p, p.seqlen_q, Tr::kBlockM)), Tr::kThreads, smem,
       stream>>>(p, ws);
  return cudaGetLastError();
}

template <typename T>
cudaError_t run_bwd_generic(const AttentionBwdParams& p, BwdWorkspace ws, cudaStream_t stream) {
  return varlen_or_mods(p) ? launch_bwd_generic<T, true>(p, ws, stream)
                           : launch_bwd_generic<T, false>(p, ws, stream);
}

}  // namespace attn_ext::cuda
