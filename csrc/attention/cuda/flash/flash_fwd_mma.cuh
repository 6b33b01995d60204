#pragma once
// Tensor-core flash-attention forward for bf16 / fp16 (FlashAttention-2 structure), sm_80+.
// Fixed-length batches without score modifiers (attention_launch.cu routes varlen batches and
// softcap / ALiBi / sinks to the generic kernel until this one has run them on a GPU).
// One thread block owns kBlockM query rows of one (b, h); each of its warps owns 16 rows.
//   prologue   the query tile to shared memory (zero-padded to kHeadDim and kBlockM);
//   main loop  key blocks from the last to the first, so that under a causal band the
//              blocks crossing the diagonal (masked: each element tested) come first and the
//              rest (unmasked: no test at all) follow; per block
//                S = Q K^T (mma, fp32), scaled to the log2 domain, masked if needed,
//                online softmax per row in registers (quad shuffles), dropout on P,
//                O = O * rescale + P V (P re-packed from the score fragments, no smem trip);
//   epilogue   O / rowsum, stores masked to Dv, lse.
#include <cstdint>
#include "common/constants.h"
#include "common/online_softmax.h"
#include "common/cuda/elem.cuh"
#include "attention/cuda/flash/block_info.cuh"
#include "attention/cuda/flash/launch_templates.h"
#include "attention/cuda/flash/kernel_traits.cuh"
#include "attention/cuda/flash/mma.cuh"
#include "attention/cuda/flash/score_mask.cuh"

namespace attn_ext::cuda {

// rows x cols of a strided (row_stride) global tile into a [max_rows][kPitch] shared tile,
// zero outside rows x cols; 16-byte loads where the addresses allow. T is a 16-bit type.
template <typename Tr, typename T>
__device__ __forceinline__ void load_tile_mma(T* dst, const T* src, int64_t row_stride,
                                              int64_t rows, int max_rows, int64_t cols) {
  constexpr int kChunks = Tr::kHeadDim / Tr::kVec;
  const bool vec_ok =
      reinterpret_cast<uintptr_t>(src) % sizeof(uint4) == 0 && row_stride % Tr::kVec == 0;
  for (int idx = threadIdx.x; idx < max_rows * kChunks; idx += Tr::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * Tr::kVec;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows) {
      const T* s = src + r * row_stride + c;
      if (vec_ok && c + Tr::kVec <= cols) {
        val = *reinterpret_cast<const uint4*>(s);
      } else {
        // element by element as 16-bit patterns packed into the four words (registers only)
        const unsigned short* bits = reinterpret_cast<const unsigned short*>(s);
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < Tr::kVec; ++e)
          if (c + e < cols) w[e / 2] |= static_cast<uint32_t>(bits[e]) << (16 * (e % 2));
        val = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    *reinterpret_cast<uint4*>(dst + r * Tr::kPitch + c) = val;
  }
}

// One key block: scores, mask (kMasked), online softmax, dropout, and P V into acc_o.
template <typename Tr, bool kMasked>
__device__ __forceinline__ void fwd_mma_block(
    const typename Tr::Elem* sQ, const typename Tr::Elem* sK, const typename Tr::Elem* sV,
    int64_t j0, int64_t row0, int64_t seqlen_q, float s_scale, float keep_scale,
    const ScoreMask<float, false>& mask, const DropoutBits<false>& drop,
    float (&acc_o)[Tr::kTilesO][4], SoftmaxState<float> (&st)[2]) {
  using T = typename Tr::Elem;
  using M = mma::Mma<T>;
  const int warp = threadIdx.x / Tr::kWarp, lane = threadIdx.x % Tr::kWarp;
  const int g = lane / 4, t = lane % 4;

  // S = Q K^T for this warp's 16 rows
  float acc_s[Tr::kTilesS][4];
#pragma unroll
  for (int nt = 0; nt < Tr::kTilesS; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_s[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < Tr::kHeadDim / Tr::kMmaK; ++kk) {
    uint32_t a[4];
    mma::ldmatrix_x4(
        a, sQ + (warp * Tr::kMmaM + lane % 16) * Tr::kPitch + kk * Tr::kMmaK + (lane / 16) * 8);
#pragma unroll
    for (int nt = 0; nt < Tr::kTilesS; nt += 2) {
      uint32_t b[4];
      mma::ldmatrix_x4(b, sK + (nt * Tr::kMmaN + lane % 8 + (lane / 16) * 8) * Tr::kPitch +
                              kk * Tr::kMmaK + ((lane / 8) % 2) * 8);
      M::run(acc_s[nt], a, b[0], b[1]);
      M::run(acc_s[nt + 1], a, b[2], b[3]);
    }
  }

  // log2-domain scores; element e of tile nt is (row g + 8 (e / 2), key nt * 8 + 2t + e % 2)
#pragma unroll
  for (int nt = 0; nt < Tr::kTilesS; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float s = acc_s[nt][e] * s_scale;
      if constexpr (kMasked) {
        const int64_t i = row0 + g + 8 * (e / 2), j = j0 + nt * Tr::kMmaN + 2 * t + e % 2;
        s = i < seqlen_q ? mask.apply(acc_s[nt][e], s_scale, i, j) : -INFINITY;
      }
      acc_s[nt][e] = s;
    }
  }

  // online softmax of the thread's two rows (the four lanes of a quad share a row)
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < Tr::kTilesS; ++nt)
      mx = fmaxf(mx, fmaxf(acc_s[nt][2 * rh], acc_s[nt][2 * rh + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float factor = st[rh].rescale_to(mx);
    const float shift = st[rh].shift();
    float sum = 0.f;
    const int64_t i = row0 + g + 8 * rh;
#pragma unroll
    for (int nt = 0; nt < Tr::kTilesS; ++nt) {
      float p0 = exp2f(acc_s[nt][2 * rh] - shift), p1 = exp2f(acc_s[nt][2 * rh + 1] - shift);
      sum += p0 + p1;
      if (drop.active()) {
        // keys j, j + 1 (j = j0 + nt * 8 + 2t, j0 a multiple of 8) share one Philox group
        const int64_t j = j0 + nt * Tr::kMmaN + 2 * t;
        const uint32_t bits = drop.group(i, j / kDrawsPerCounter) >> (j % kDrawsPerCounter);
        p0 = (bits & 1u) ? p0 * keep_scale : 0.f;
        p1 = (bits & 2u) ? p1 * keep_scale : 0.f;
      }
      acc_s[nt][2 * rh] = p0;
      acc_s[nt][2 * rh + 1] = p1;
    }
    st[rh].sum += sum;  // this thread's share; the quad's shares are added in the epilogue
#pragma unroll
    for (int ot = 0; ot < Tr::kTilesO; ++ot) {
      acc_o[ot][2 * rh] *= factor;
      acc_o[ot][2 * rh + 1] *= factor;
    }
  }

  // O += P V, P as the A operand straight from the score fragments
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / Tr::kMmaK; ++kk) {
    const uint32_t a[4] = {M::pack(acc_s[2 * kk][0], acc_s[2 * kk][1]),
                           M::pack(acc_s[2 * kk][2], acc_s[2 * kk][3]),
                           M::pack(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]),
                           M::pack(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3])};
#pragma unroll
    for (int ot = 0; ot < Tr::kTilesO; ot += 2) {
      uint32_t b[4];
      mma::ldmatrix_x4_trans(
          b, sV + (kk * Tr::kMmaK + lane % 8 + ((lane / 8) % 2) * 8) * Tr::kPitch + ot * Tr::kMmaN +
                 (lane / 16) * 8);
      M::run(acc_o[ot], a, b[0], b[1]);
      M::run(acc_o[ot + 1], a, b[2], b[3]);
    }
  }
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads) flash_fwd_mma_kernel(AttentionParams p) {
  using T = typename Tr::Elem;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [kBlockM][kPitch]
  T* sK = sQ + Tr::kBlockM * Tr::kPitch;   // [kBlockN][kPitch]
  T* sV = sK + Tr::kBlockN * Tr::kPitch;   // [kBlockN][kPitch]
  const int warp = threadIdx.x / Tr::kWarp, lane = threadIdx.x % Tr::kWarp;
  const int g = lane / 4, t = lane % 4;

  // ---- prologue
  const QueryBlockInfo<false> bi(p, Tr::kBlockM, blockIdx.x);
  const ScoreMask<float, false> mask(p, bi.b, bi.h, bi.seq(p));
  const DropoutBits<false> drop(p, bi.b, bi.h, bi.seq(p));
  const float s_scale = static_cast<float>(p.scale * kLog2e);
  const float keep_scale = static_cast<float>(1.0 / (1.0 - p.dropout_p));
  const int64_t row0 = bi.m0 + warp * Tr::kMmaM;  // this warp's first row
  const T* q = static_cast<const T*>(p.q) + bi.b * p.q_batch_stride + bi.h * p.q_head_stride +
               bi.m0 * p.q_row_stride;
  const T* k = static_cast<const T*>(p.k) + bi.b * p.k_batch_stride + bi.hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + bi.b * p.v_batch_stride + bi.hk * p.v_head_stride;
  load_tile_mma<Tr>(sQ, q, p.q_row_stride, bi.rows, Tr::kBlockM, p.head_dim);

  float acc_o[Tr::kTilesO][4];
#pragma unroll
  for (int ot = 0; ot < Tr::kTilesO; ++ot)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[ot][e] = 0.f;
  SoftmaxState<float> st[2];

  // ---- main loop: key blocks aligned to kBlockN (so Philox groups never straddle a
  // fragment), last first; masked blocks take the element tests, the others skip them
  const int64_t nb_begin = bi.n_begin / Tr::kBlockN;
  const int64_t nb_end = bi.n_end > bi.n_begin ? ceil_div(bi.n_end, Tr::kBlockN) : nb_begin;
  for (int64_t nb = nb_end - 1; nb >= nb_begin; --nb) {
    const int64_t j0 = nb * Tr::kBlockN;
    const int64_t keys = p.seqlen_k - j0 < Tr::kBlockN ? p.seqlen_k - j0 : Tr::kBlockN;
    __syncthreads();  // every warp is done with the previous block's K / V
    load_tile_mma<Tr>(sK, k + j0 * p.k_row_stride, p.k_row_stride, keys, Tr::kBlockN, p.head_dim);
    load_tile_mma<Tr>(sV, v + j0 * p.v_row_stride, p.v_row_stride, keys, Tr::kBlockN, p.head_dim_v);
    __syncthreads();
    if (mask.tile_free(bi.m0, bi.m0 + bi.rows, j0, j0 + Tr::kBlockN)) {
      fwd_mma_block<Tr, false>(sQ, sK, sV, j0, row0, p.seqlen_q, s_scale, keep_scale, mask, drop,
                               acc_o, st);
    } else {
      fwd_mma_block<Tr, true>(sQ, sK, sV, j0, row0, p.seqlen_q, s_scale, keep_scale, mask, drop,
                              acc_o, st);
    }
  }

  // ---- epilogue: the quad's partial sums, normalized stores masked to Dv, lse
  T* out = static_cast<T*>(p.out) + bi.b * p.o_batch_stride + bi.h * p.o_head_stride;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float sum = st[rh].sum;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    st[rh].sum = sum;
    const int64_t i = row0 + g + 8 * rh;
    if (i >= p.seqlen_q) continue;
    const float inv = st[rh].inv_sum();
    T* orow = out + i * p.o_row_stride;
#pragma unroll
    for (int ot = 0; ot < Tr::kTilesO; ++ot) {
      const int64_t c = ot * Tr::kMmaN + 2 * t;
      if (c < p.head_dim_v) orow[c] = Elem<T>::store(acc_o[ot][2 * rh] * inv);
      if (c + 1 < p.head_dim_v) orow[c + 1] = Elem<T>::store(acc_o[ot][2 * rh + 1] * inv);
    }
    if (t == 0) p.lse[(bi.b * p.heads + bi.h) * p.seqlen_q + i] = st[rh].lse();
  }
}

template <typename T, int kHeadDim>
cudaError_t run_fwd_mma(const AttentionParams& p, cudaStream_t stream) {
  using Tr = FwdMmaTraits<T, kHeadDim>;
  const int64_t blocks = p.batch * p.heads * ceil_div(p.seqlen_q, Tr::kBlockM);
  if (blocks == 0) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(flash_fwd_mma_kernel<Tr>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Tr::kSmemBytes));
  if (e != cudaSuccess) return e;
  flash_fwd_mma_kernel<Tr>
      <<<static_cast<unsigned>(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attn_ext::cuda
