// CUDA decode attention: Sq new queries per sequence against a KV cache with per-sequence
// lengths (query i of sequence b at key position len_b - Sq + i). One thread block owns up to
// kDecodeRowsPerBlock rows (the query heads sharing a KV head, times the new tokens) and one
// split of the key sequence, so each cache row is read once per block:
//   prologue  scaled queries to shared memory;
//   main loop key tiles of kTile keys: thread t scores key t against every row (no
//             shuffles), one warp per row updates that row's online softmax, then thread t
//             accumulates output feature t for every row from the tile's values (coalesced);
//   epilogue  normalized output + lse, or the split's partial for the merge kernel, which
//             folds splits with SoftmaxState::merge.
// window_right is part of the band (LocalBand), as in every instantiation. FlashAttention's
// with_kvcache arguments (cache_batch_idx, cache_leftpad) and the score modifiers
// (attention/score_mod.h: per row, since a block's rows span G heads; a sink joins the first
// split's state only) follow the CPU kernel in a second instantiation (kExt), so the kernel
// without them compiles as it did before they existed (same registers: adding them to the one
// kernel took fp32 from 156 to 228 registers per thread at sm_80).
#include <cstdint>
#include <type_traits>
#include "common/constants.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "attention/score_mod.h"
#include "common/cuda/elem.cuh"
#include "decoding/cuda/decoding_launch.h"
#include "decoding/cuda/split_merge.cuh"

namespace attn_ext::cuda {
namespace {

constexpr int kThreads = 128;  // four warps; also the key tile and the output-feature stride
constexpr int kTile = kThreads;
constexpr int kWarp = 32;
// Dot products are summed in chunks of kDotChunk features, each chunk's partial sum added to
// the total: the fp32 rounding error grows with kDotChunk + D / kDotChunk rather than with D
// (MLA's absorbed decode has D = 576).
constexpr int kDotChunk = 32;
constexpr int kRows = static_cast<int>(kDecodeRowsPerBlock);
constexpr int kMaxDvPerThread = static_cast<int>((kDecodeMaxHeadDimV + kThreads - 1) / kThreads);

struct BlockRows {
  int64_t b, hk, r0, m;  // rows r0 .. r0 + m of (b, hk); row r is query r / G of head hk*G + r % G
};

__device__ BlockRows block_rows(const DecodeParams& p, int64_t rows) {
  const int64_t num_m = (rows + kRows - 1) / kRows;
  const int64_t bk = blockIdx.y / num_m, mb = blockIdx.y % num_m;
  BlockRows br;
  br.b = bk / p.kv_heads;
  br.hk = bk % p.kv_heads;
  br.r0 = mb * kRows;
  br.m = rows - br.r0 < kRows ? rows - br.r0 : kRows;
  return br;
}

template <typename T, bool kExt>
__global__ void __launch_bounds__(kThreads) decode_kernel(DecodeParams p, DecodeWorkspace ws) {
  using acc_t = typename Elem<T>::acc_t;
  extern __shared__ unsigned char smem_raw[];
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Sq = p.seqlen_q, G = p.group();
  const int64_t rows = G * Sq;
  acc_t* q_s = reinterpret_cast<acc_t*>(smem_raw);  // [kRows][D]
  acc_t* s_s = q_s + kRows * D;                     // [kRows][kTile]
  __shared__ acc_t factor_s[kRows];
  __shared__ SoftmaxState<acc_t> state_s[kRows];

  // ---- prologue: this block's rows, its share of the keys, the scaled queries
  const BlockRows br = block_rows(p, rows);
  int64_t len = p.lengths[br.b];
  len = len < 0 ? 0 : (len > p.seqlen_k ? p.seqlen_k : len);  // a GPU op clamps, never reads past L
  const int64_t bc = kExt ? p.cache_row(br.b) : br.b;         // the cache row this sequence reads
  const LocalBand band{len - Sq, p.window_left, p.window_right};
  const int64_t i_begin = br.r0 / G, i_end = (br.r0 + br.m - 1) / G + 1;
  int64_t lo = band.key_begin(i_begin, len), hi = band.key_end(i_end, len);
  if constexpr (kExt) {  // keys before the left padding are never seen
    lo = max(lo, p.first_key(br.b));
    hi = max(hi, lo);
  }
  const int64_t splits = gridDim.x, split = blockIdx.x;
  const int64_t span = hi > lo ? hi - lo : 0;
  const int64_t chunk = ((span + splits - 1) / splits + kTile - 1) / kTile * kTile;
  const int64_t j_begin = min(hi, lo + split * max(chunk, int64_t(kTile)));
  const int64_t j_end = min(hi, j_begin + max(chunk, int64_t(kTile)));
  const acc_t s_scale = static_cast<acc_t>(p.scale) * static_cast<acc_t>(kLog2e);

  for (int64_t idx = threadIdx.x; idx < kRows * D; idx += blockDim.x) {
    const int64_t rr = idx / D, c = idx % D;
    acc_t val = 0;
    if (rr < br.m) {
      const int64_t r = br.r0 + rr, i = r / G, h = br.hk * G + r % G;
      const T* q = static_cast<const T*>(p.q) + br.b * p.q_batch_stride + h * p.q_head_stride +
                   i * p.q_row_stride;
      val = Elem<T>::load(q[c]);
    }
    q_s[idx] = val;
  }
  if constexpr (kExt) {
    if (threadIdx.x < kRows) {
      const int64_t h = br.hk * G + (br.r0 + threadIdx.x) % G;
      state_s[threadIdx.x] = split == 0 ? initial_state<acc_t>(p, h, static_cast<acc_t>(kLog2e))
                                        : SoftmaxState<acc_t>{};  // a sink joins once
    }
  } else {
    if (threadIdx.x < kRows) state_s[threadIdx.x] = SoftmaxState<acc_t>{};
  }
  acc_t o[kRows][kMaxDvPerThread];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kMaxDvPerThread; ++c) o[r][c] = 0;
  __syncthreads();

  const T* k = static_cast<const T*>(p.k) + bc * p.k_batch_stride + br.hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + bc * p.v_batch_stride + br.hk * p.v_head_stride;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;

  // ---- main loop over key tiles
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTile) {
    // scores: thread t takes key j0 + t against every row
    const int64_t j = j0 + threadIdx.x;
    acc_t s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0;
    if (j < j_end) {
      const T* kr = k + j * p.k_row_stride;
      for (int64_t c0 = 0; c0 < D; c0 += kDotChunk) {
        acc_t part[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) part[r] = 0;
        for (int64_t c = c0; c < min(D, c0 + kDotChunk); ++c) {
          const acc_t kv = Elem<T>::load(kr[c]);
#pragma unroll
          for (int r = 0; r < kRows; ++r) part[r] += q_s[r * D + c] * kv;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) s[r] += part[r];
      }
    }
    const bool tile_full =
        band.tile_unmasked(i_begin, i_end, j0, j0 + kTile) && j0 + kTile <= j_end;
    if constexpr (kExt) {
      const bool modified = p.softcap != 0.0 || p.alibi_slopes != nullptr;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = (br.r0 + r) / G;
        const bool ok = r < br.m && j < j_end && (tile_full || band.allowed(i, j));
        acc_t sc = s[r] * s_scale;  // log2 domain
        if (ok && modified) {
          const int64_t h = br.hk * G + (br.r0 + r) % G;
          sc = ScoreMod<acc_t>::make(p, br.b, h, len - Sq, static_cast<acc_t>(kLog2e))
                   .apply(sc, i, j);
        }
        s_s[r * kTile + threadIdx.x] = ok ? sc : acc_t(-INFINITY);
      }
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const bool ok = r < br.m && j < j_end && (tile_full || band.allowed((br.r0 + r) / G, j));
        s_s[r * kTile + threadIdx.x] = ok ? s[r] * s_scale : -INFINITY;  // log2 domain
      }
    }
    __syncthreads();

    // online softmax: one warp per row
    for (int r = warp; r < br.m; r += kThreads / kWarp) {
      acc_t* sr = s_s + r * kTile;
      acc_t mx = -INFINITY;
      for (int c = lane; c < kTile; c += kWarp) mx = max(mx, sr[c]);
      for (int off = kWarp / 2; off > 0; off /= 2)
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      SoftmaxState<acc_t> st = state_s[r];
      const acc_t factor = st.rescale_to(mx);
      const acc_t shift = st.shift();
      acc_t sum = 0;
      for (int c = lane; c < kTile; c += kWarp) {
        const acc_t e = exp2(sr[c] - shift);
        sr[c] = e;
        sum += e;
      }
      for (int off = kWarp / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      __syncwarp();  // every lane has read state_s[r] before lane 0 overwrites it
      if (lane == 0) {
        st.sum += sum;
        state_s[r] = st;
        factor_s[r] = factor;
      }
    }
    __syncthreads();

    // output: thread t accumulates features t, t + kThreads, ... of every row
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < kMaxDvPerThread; ++c) o[r][c] *= (r < br.m ? factor_s[r] : acc_t(1));
    const int64_t n = min(int64_t(kTile), j_end - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const T* vr = v + (j0 + jj) * p.v_row_stride;
#pragma unroll
      for (int c = 0; c < kMaxDvPerThread; ++c) {
        const int64_t f = threadIdx.x + c * kThreads;
        if (f < Dv) {
          const acc_t vv = Elem<T>::load(vr[f]);
#pragma unroll
          for (int r = 0; r < kRows; ++r) o[r][c] += s_s[r * kTile + jj] * vv;
        }
      }
    }
    __syncthreads();
  }

  // ---- epilogue
  for (int r = 0; r < br.m; ++r) {
    const int64_t rg = br.r0 + r, i = rg / G, h = br.hk * G + rg % G;
    const SoftmaxState<acc_t> st = state_s[r];
    if (splits == 1) {
      T* out = static_cast<T*>(p.out) + br.b * p.o_batch_stride + h * p.o_head_stride +
               i * p.o_row_stride;
      const acc_t inv = st.inv_sum();
#pragma unroll
      for (int c = 0; c < kMaxDvPerThread; ++c) {
        const int64_t f = threadIdx.x + c * kThreads;
        if (f < Dv) out[f] = Elem<T>::store(o[r][c] * inv);
      }
      if (threadIdx.x == 0) p.lse[(br.b * p.heads + h) * Sq + i] = st.lse();
    } else {
      const int64_t slot = ((br.b * p.kv_heads + br.hk) * rows + rg) * splits + split;
      acc_t* ws_o = static_cast<acc_t*>(ws.o) + slot * Dv;
#pragma unroll
      for (int c = 0; c < kMaxDvPerThread; ++c) {
        const int64_t f = threadIdx.x + c * kThreads;
        if (f < Dv) ws_o[f] = o[r][c];
      }
      if (threadIdx.x == 0) {
        static_cast<acc_t*>(ws.stats)[2 * slot] = st.max;
        static_cast<acc_t*>(ws.stats)[2 * slot + 1] = st.sum;
      }
    }
  }
}

// One block per row: its threads stride over the output features (merge_split_row).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    merge_kernel(DecodeParams p, DecodeWorkspace ws, int64_t splits) {
  merge_split_row<T, typename Elem<T>::acc_t, kMaxDvPerThread>(
      p, ws, blockIdx.x, splits, p.head_dim_v, threadIdx.x, kThreads, threadIdx.x == 0);
}

// The instantiation with the with_kvcache arguments and the score modifiers.
bool extended(const DecodeParams& p) {
  return p.batch_idx != nullptr || p.leftpad != nullptr || p.softcap != 0.0 ||
         p.alibi_slopes != nullptr || p.sinks != nullptr;
}

}  // namespace

cudaError_t launch_decode(const DecodeParams& p, ElemKind kind, DecodeWorkspace ws,
                          cudaStream_t stream) {
  const int64_t rows = p.group() * p.seqlen_q;
  const int64_t blocks_y = p.batch * p.kv_heads * ceil_div(rows, kDecodeRowsPerBlock);
  if (blocks_y == 0) return cudaSuccess;
  if (p.head_dim > kDecodeMaxHeadDim || p.head_dim_v > kDecodeMaxHeadDimV)
    return cudaErrorInvalidValue;
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using acc_t = typename Elem<T>::acc_t;
    const size_t smem = (kRows * p.head_dim + kRows * kTile) * sizeof(acc_t);
    const auto kernel = extended(p) ? decode_kernel<T, true> : decode_kernel<T, false>;
    if (smem > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (e != cudaSuccess) return e;
    }
    const dim3 grid(static_cast<unsigned>(p.num_splits), static_cast<unsigned>(blocks_y));
    kernel<<<grid, kThreads, smem, stream>>>(p, ws);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || p.num_splits == 1) return err;
    merge_kernel<T><<<static_cast<unsigned>(p.batch * p.kv_heads * rows), kThreads, 0, stream>>>(
        p, ws, p.num_splits);
    return cudaGetLastError();
  });
}

}  // namespace attn_ext::cuda
