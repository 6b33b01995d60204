#pragma once
// Generic flash-attention forward (SIMT, exact accumulation in acc_t: fp32, fp64 for fp64).
// Serves float32 / float64, and bf16 / fp16 head dims the tensor-core kernel does not cover.
// One thread block owns kRows query rows of one (b, h) (and, in a varlen batch whose sequence
// outgrows the grid, every grid-stride further block of them, in turn). Two instantiations
// per dtype: kVarlenOrMods = false, the fixed-length kernel without score modifiers (the
// verified one, chosen whenever it suffices), and true, which serves varlen batches and
// softcap / ALiBi / sinks (block_info.cuh, score_mask.cuh):
//   prologue  query rows to shared memory, output accumulators zeroed, softmax states (a sink's
//             logit, if any);
//   main loop key tiles of kTile keys: thread t scores key t against every row, masks it,
//             one warp per row updates that row's online softmax (and drops probabilities),
//             then thread t accumulates output features t, t + kThreads, ... of every row;
//   epilogue  normalized output and lse (rows that saw no key: 0 and -inf, or the sink).
#include <cstdint>
#include "common/constants.h"
#include "common/online_softmax.h"
#include "attention/score_mod.h"
#include "common/cuda/elem.cuh"
#include "attention/cuda/flash/block_info.cuh"
#include "attention/cuda/flash/launch_templates.h"
#include "attention/cuda/flash/score_mask.cuh"

namespace attn_ext::cuda {

struct GenericFwdTraits {
  static constexpr int kThreads = 128;  // four warps; one key per thread in the score phase
  static constexpr int kTile = kThreads;
  static constexpr int kWarp = 32;
  // Rows per block: each key / value row read from global memory serves kRows queries,
  // and kRows score registers per thread stay cheap.
  static constexpr int kRows = 16;
};

template <typename T>
size_t fwd_generic_smem_bytes(int64_t head_dim, int64_t head_dim_v) {
  using acc_t = typename Elem<T>::acc_t;
  using Tr = GenericFwdTraits;
  return static_cast<size_t>(Tr::kRows * (head_dim + head_dim_v + Tr::kTile)) * sizeof(acc_t);
}

template <typename T, bool kVarlenOrMods>
__global__ void __launch_bounds__(GenericFwdTraits::kThreads)
    flash_fwd_generic_kernel(AttentionParams p) {
  using acc_t = typename Elem<T>::acc_t;
  using Tr = GenericFwdTraits;
  constexpr int kRows = Tr::kRows, kTile = Tr::kTile;
  extern __shared__ unsigned char smem_raw[];
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  acc_t* q_s = reinterpret_cast<acc_t*>(smem_raw);  // [kRows][D] queries, unscaled
  acc_t* s_s = q_s + kRows * D;                     // [kRows][kTile] scores, then probabilities
  acc_t* o_s = s_s + kRows * kTile;                 // [kRows][Dv] output accumulators
  __shared__ acc_t factor_s[kRows];
  __shared__ SoftmaxState<acc_t> state_s[kRows];

  // ---- prologue
  using Rows = RowLayout<kVarlenOrMods>;
  QueryBlockInfo<kVarlenOrMods> bi(p, kRows, blockIdx.x);
  if (kVarlenOrMods && bi.rows <= 0) return;  // past the end of a short varlen sequence
  const ScoreMask<acc_t, kVarlenOrMods> mask(p, bi.b, bi.h, bi.seq(p));
  const DropoutBits<kVarlenOrMods> drop(p, bi.b, bi.h, bi.seq(p));
  const acc_t keep_scale = static_cast<acc_t>(1.0 / (1.0 - p.dropout_p));
  const acc_t s_scale = static_cast<acc_t>(p.scale) * static_cast<acc_t>(kLog2e);
  do {  // once, but for the grid-stride blocks of a varlen sequence that outgrows the grid
    const T* q = static_cast<const T*>(p.q) + bi.b * p.q_batch_stride + bi.h * p.q_head_stride +
                 (bi.seq(p).q_begin + bi.m0) * p.q_row_stride;
    for (int64_t idx = threadIdx.x; idx < kRows * D; idx += blockDim.x) {
      const int64_t r = idx / D, c = idx % D;
      q_s[idx] = r < bi.rows ? Elem<T>::load(q[r * p.q_row_stride + c]) : acc_t(0);
    }
    for (int64_t idx = threadIdx.x; idx < kRows * Dv; idx += blockDim.x) o_s[idx] = 0;
    if (threadIdx.x < kRows) {
      state_s[threadIdx.x] =
          kVarlenOrMods ? initial_state<acc_t>(p, bi.h, acc_t(kLog2e)) : SoftmaxState<acc_t>{};
    }
    __syncthreads();

    const T* k = static_cast<const T*>(p.k) + bi.b * p.k_batch_stride + bi.hk * p.k_head_stride +
                 bi.seq(p).k_begin * p.k_row_stride;
    const T* v = static_cast<const T*>(p.v) + bi.b * p.v_batch_stride + bi.hk * p.v_head_stride +
                 bi.seq(p).k_begin * p.v_row_stride;
    const int warp = threadIdx.x / Tr::kWarp, lane = threadIdx.x % Tr::kWarp;

    // ---- main loop over key tiles
    for (int64_t j0 = bi.n_begin; j0 < bi.n_end; j0 += kTile) {
      const int64_t j = j0 + threadIdx.x;
      const bool in_range = j < bi.n_end;
      acc_t s[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[r] = 0;
      if (in_range) {
        const T* kr = k + j * p.k_row_stride;
        for (int64_t c = 0; c < D; ++c) {
          const acc_t kv = Elem<T>::load(kr[c]);
#pragma unroll
          for (int r = 0; r < kRows; ++r) s[r] += q_s[r * D + c] * kv;
        }
      }
      const bool unmasked =
          mask.tile_free(bi.m0, bi.m0 + bi.rows, j0, j0 + kTile) && j0 + kTile <= bi.n_end;
// Scores scaled to the log2 domain after the dot product (as the CPU kernel does:
// pre-scaling Q rounds every q_d and costs fp32 accuracy on peaked rows).
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        acc_t val = -INFINITY;
        const acc_t sc = s[r] * s_scale;
        if (r < bi.rows && in_range) val = unmasked ? sc : mask.apply(s[r], s_scale, bi.m0 + r, j);
        s_s[r * kTile + threadIdx.x] = val;
      }
      __syncthreads();

      // online softmax: one warp per row; probabilities replace the scores (dropped ones 0)
      for (int r = warp; r < bi.rows; r += Tr::kThreads / Tr::kWarp) {
        acc_t* sr = s_s + r * kTile;
        acc_t mx = -INFINITY;
        for (int c = lane; c < kTile; c += Tr::kWarp) mx = max(mx, sr[c]);
        for (int off = Tr::kWarp / 2; off > 0; off /= 2)
          mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        SoftmaxState<acc_t> st = state_s[r];
        const acc_t factor = st.rescale_to(mx);
        const acc_t shift = st.shift();
        acc_t sum = 0;
        for (int c = lane; c < kTile; c += Tr::kWarp) {
          acc_t e = exp2(sr[c] - shift);
          sum += e;
          if (drop.active()) e = drop.keep(bi.m0 + r, j0 + c) ? e * keep_scale : acc_t(0);
          sr[c] = e;
        }
        for (int off = Tr::kWarp / 2; off > 0; off /= 2)
          sum += __shfl_xor_sync(0xffffffffu, sum, off);
        __syncwarp();  // every lane has read state_s[r] before lane 0 overwrites it
        if (lane == 0) {
          st.sum += sum;
          state_s[r] = st;
          factor_s[r] = factor;
        }
      }
      __syncthreads();

      // output: thread t owns features t, t + kThreads, ... of every row
      const int64_t n = min(int64_t(kTile), bi.n_end - j0);
      // (the tile's sum is formed apart and then added: blocked summation, so the rounding
      // error grows with kTile + Sk / kTile rather than with Sk)
      for (int64_t f = threadIdx.x; f < Dv; f += blockDim.x) {
        acc_t o[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) o[r] = 0;
        for (int64_t jj = 0; jj < n; ++jj) {
          const acc_t vv = Elem<T>::load(v[(j0 + jj) * p.v_row_stride + f]);
#pragma unroll
          for (int r = 0; r < kRows; ++r) o[r] += s_s[r * kTile + jj] * vv;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const acc_t factor = r < bi.rows ? factor_s[r] : acc_t(1);
          o_s[r * Dv + f] = o_s[r * Dv + f] * factor + o[r];
        }
      }
      __syncthreads();
    }

    // ---- epilogue
    T* out = static_cast<T*>(p.out) + bi.b * p.o_batch_stride + bi.h * p.o_head_stride +
             (bi.seq(p).q_begin + bi.m0) * p.o_row_stride;
    for (int64_t idx = threadIdx.x; idx < bi.rows * Dv; idx += blockDim.x) {
      const int64_t r = idx / Dv, f = idx % Dv;
      out[r * p.o_row_stride + f] = Elem<T>::store(o_s[r * Dv + f] * state_s[r].inv_sum());
    }
    if (threadIdx.x < bi.rows) {
      p.lse[Rows::row0(p, bi.seq(p), Rows::head(p, bi.b, bi.h)) + bi.m0 + threadIdx.x] =
          state_s[threadIdx.x].lse();
    }
    // the epilogue has read o_s / state_s before the next rows reuse them
    if (kVarlenOrMods) __syncthreads();
  } while (kVarlenOrMods && bi.advance(p));  // (fixed length: no loop at all)
}

template <typename T, bool kVarlenOrMods>
cudaError_t launch_fwd_generic(const AttentionParams& p, cudaStream_t stream) {
  using Tr = GenericFwdTraits;
  const int64_t blocks = p.batch * p.heads * grid_blocks(p, p.seqlen_q, Tr::kRows);
  if (blocks == 0) return cudaSuccess;
  const size_t smem = fwd_generic_smem_bytes<T>(p.head_dim, p.head_dim_v);
  const cudaError_t e =
      cudaFuncSetAttribute(flash_fwd_generic_kernel<T, kVarlenOrMods>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  flash_fwd_generic_kernel<T, kVarlenOrMods>
      <<<static_cast<unsigned>(blocks), Tr::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t run_fwd_generic(const AttentionParams& p, cudaStream_t stream) {
  return varlen_or_mods(p) ? launch_fwd_generic<T, true>(p, stream)
                           : launch_fwd_generic<T, false>(p, stream);
}

}  // namespace attn_ext::cuda
