#pragma once
// Tensor-core flash-attention forward on CuTe, bf16 / fp16, sm_80+ (FlashAttention-2's
// algorithm). Serves fixed-length batches with D == Dv == kHeadDim, the causal / window band,
// GQA and any 16-byte aligned strides; no explicit mask, dropout or score modifier (those run
// on flash_fwd_mma.cuh / the generic kernel: attention_launch.cu's cute_ok()).
// One thread block owns kBlockM query rows of one (b, h); each warp owns its MMA row tiles.
//   prologue   Q and the last key block's K: cp.async into swizzled shared tiles;
//   main loop  key blocks from the last to the first (under a causal band the blocks crossing
//              the diagonal come first: masked, each element tested; the rest unmasked, no
//              test), per block:
//                V loads (cp.async) while S = Q K^T runs (ldmatrix + mma, fp32);
//                the next K loads while the online softmax (rows in registers, max / sum
//                exchanged in the quad by shuffles; the exp2 step a policy, below) and
//                O = O * rescale + P V run, P converted to 16 bits in registers as the A
//                operand (no shared-memory round trip);
//   epilogue   O / rowsum to 16 bits, through shared memory to 16-byte global stores; lse.
#include <cstdint>
#include <cutlass/numeric_conversion.h>
#include "common/constants.h"
#include "common/online_softmax.h"
#include "common/cuda/elem.cuh"
#include "attention/cuda/flash/block_info.cuh"
#include "attention/cuda/flash/cute_traits.cuh"
#include "attention/cuda/flash/cute_utils.cuh"
#include "attention/cuda/flash/launch_templates.h"
#include "common/mask.h"

namespace attn_ext::cuda {
namespace cute_fwd {

using namespace cute;
using cute_util::BlockKeys;
using cute_util::copy_rows;
using cute_util::exp2_ftz;
using cute_util::gemm_ss;
using cute_util::RowKeys;

// acc += A B with A already in registers (P) and B in shared memory.
template <class Mma, class Acc, class RA, class RB, class SB, class CpB>
__device__ __forceinline__ void gemm_rs(Mma const& mma, Acc& acc, RA const& rA, RB& rB,
                                        SB const& sB, CpB const& cpB) {
  auto rB_view = cpB.get_slice(threadIdx.x).retile_D(rB);
  copy(cpB, sB(_, _, 0), rB_view(_, _, 0));
#pragma unroll
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(cpB, sB(_, _, k + 1), rB_view(_, _, k + 1));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// Max / sum of a value over the four lanes of a quad (the lanes that share a row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The exp2 step of softmax_block, as policies (launch_templates.h declares them for the
// dispatch). A block's raw dot products s become exp2(s * scale - m), m the row's running max
// of the scaled scores (the log2 domain: scale = softmax scale * log2 e).
//   ScaleFirst  every score multiplied by scale where it is stored, the max taken over those,
//               exp2f(s' - m): 8 instructions a score in the SASS (sm_90a, D 128), 4 of them
//               exp2f's denormal handling. Kept for scale <= 0, where FoldScale's max is not
//               the scaled max.
//   FoldScale   the max over the raw scores, times scale (the same value: rounding is monotonic
//               and scale > 0, which the dispatch requires), then one FFMA a score into
//               exp2_ftz: 4 instructions a score, FlashAttention-2's scale_apply_exp2 under its
//               --use_fast_math. One rounding instead of two before the exp2. And the output
//               rows' rescale (D / 4 FMULs a row and thread) skipped when no row of the warp
//               raised its max (the factors are then exactly 1: the same bits), as the max
//               settles over a long key range. The masked blocks' key bounds from BlockKeys
//               (32-bit per row: fewer live registers). The Hopper forward's policy, and the
//               CuTe forward's wherever scale > 0: 1.06-1.18x ScaleFirst on an H100, same
//               errors (2026-11-27).
struct ScaleFirst {
  static constexpr bool kSkipUnitRescale = false;
  static constexpr bool kBlockKeyBounds = false;
  static __device__ __forceinline__ float stored(float s, float scale) { return s * scale; }
  static __device__ __forceinline__ float row_max(float stored_max, float) { return stored_max; }
  static __device__ __forceinline__ float exp2(float stored, float, float shift) {
    return exp2f(stored - shift);
  }
};
struct FoldScale {
  static constexpr bool kSkipUnitRescale = true;
  static constexpr bool kBlockKeyBounds = true;
  static __device__ __forceinline__ float stored(float s, float) { return s; }
  static __device__ __forceinline__ float row_max(float stored_max, float scale) {
    return stored_max * scale;
  }
  static __device__ __forceinline__ float exp2(float stored, float scale, float shift) {
    return exp2_ftz(fmaf(stored, scale, -shift));
  }
};

// One key block's scores (raw dot products, rows x cols view) to probabilities: the log2-domain
// scale (the Exp policy), the band / key-range mask (kMasked), the online softmax update of
// each row, the matching rescale of the output rows. `coords` gives each score's (row, key) in
// the block. Called by whole warps (the masked / unmasked choice is per block).
template <class Exp, bool kMasked, int kBlockN, class S, class C, class O, int kRows>
__device__ __forceinline__ void softmax_block(S& s, C const& coords, O& o,
                                              SoftmaxState<float> (&st)[kRows],
                                              const LocalBand& band, int64_t key_limit,
                                              float s_scale, int64_t m0, int64_t j0) {
  float factors[kRows];
  // used by masked blocks under kBlockKeyBounds; elsewhere unused and compiled away
  const BlockKeys<kBlockN> block_keys(band, key_limit, m0, j0);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float mx = -INFINITY;
    if constexpr (kMasked) {
      const int row = get<0>(coords(r, 0));
      const auto keys = [&] {
        if constexpr (Exp::kBlockKeyBounds) {
          return block_keys.row(row);
        } else {
          return RowKeys<kBlockN>(band, key_limit, m0 + row, j0);
        }
      }();
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) {
        const int col = get<1>(coords(r, c));
        s(r, c) = col >= keys.lo && col < keys.hi ? Exp::stored(s(r, c), s_scale) : -INFINITY;
        mx = fmaxf(mx, s(r, c));
      }
    } else {
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = Exp::stored(s(r, c), s_scale);
        mx = fmaxf(mx, s(r, c));
      }
    }
    const float factor = st[r].rescale_to(Exp::row_max(quad_max(mx), s_scale));
    const float shift = st[r].shift();
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < size<1>(s); ++c) {
      const float e = Exp::exp2(s(r, c), s_scale, shift);
      s(r, c) = e;
      sum += e;
    }
    st[r].sum += sum;  // this lane's share; the quad's shares are added in the epilogue
    if constexpr (Exp::kSkipUnitRescale) {
      factors[r] = factor;
    } else {
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= factor;
    }
  }
  if constexpr (Exp::kSkipUnitRescale) {
    bool moved = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) moved |= factors[r] != 1.f;
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int c = 0; c < size<1>(o); ++c) o(r, c) *= factors[r];
      }
    }
  }
}

// The epilogue's row pass: each row's sum over its quad, the output rows divided by it, and
// the row's lse written by the quad's first lane (rows past seqlen_q write nothing).
template <class O, class C, int kRows>
__device__ __forceinline__ void finish_rows(O& o, C const& coords, SoftmaxState<float> (&st)[kRows],
                                            const AttentionParams& p, int64_t b, int64_t h,
                                            int64_t m0) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    st[r].sum = quad_sum(st[r].sum);
    const float inv = st[r].inv_sum();
#pragma unroll
    for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
    const int64_t i = m0 + get<0>(coords(r, 0));
    if (get<1>(coords(r, 0)) == 0 && i < p.seqlen_q) {
      p.lse[(b * p.heads + h) * p.seqlen_q + i] = st[r].lse();
    }
  }
}

}  // namespace cute_fwd

template <typename Tr, class Exp>
__global__ void __launch_bounds__(Tr::kThreads, 1) flash_fwd_cute_kernel(AttentionParams p) {
  using namespace cute;
  using namespace cute_fwd;
  using Elem = typename Tr::Elem;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int tid = threadIdx.x;

  const QueryBlockInfo<false> bi(p, kBlockM, blockIdx.x);
  // the band (causal / window, bottom-right aligned) and the key range: no explicit mask here
  const LocalBand band{p.key_offset, p.window_left, p.window_right};
  const float s_scale = static_cast<float>(p.scale * kLog2e);

  // ---- global views: this block's query rows, (b, hk)'s keys and values, the output rows
  const Elem* q_ptr = static_cast<const Elem*>(p.q) + bi.b * p.q_batch_stride +
                      bi.h * p.q_head_stride + bi.m0 * p.q_row_stride;
  const Elem* k_ptr =
      static_cast<const Elem*>(p.k) + bi.b * p.k_batch_stride + bi.hk * p.k_head_stride;
  const Elem* v_ptr =
      static_cast<const Elem*>(p.v) + bi.b * p.v_batch_stride + bi.hk * p.v_head_stride;
  Elem* o_ptr = static_cast<Elem*>(p.out) + bi.b * p.o_batch_stride + bi.h * p.o_head_stride +
                bi.m0 * p.o_row_stride;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  Tensor gQ = make_tensor(make_gmem_ptr(q_ptr), TileQ{}, make_stride(p.q_row_stride, _1{}));
  Tensor gO = make_tensor(make_gmem_ptr(o_ptr), TileQ{}, make_stride(p.o_row_stride, _1{}));
  // (kBlockN, kHeadDim, key blocks)
  Tensor gK = local_tile(make_tensor(make_gmem_ptr(k_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}),
                                     make_stride(p.k_row_stride, _1{})),
                         TileKV{}, make_coord(_, 0));
  Tensor gV = local_tile(make_tensor(make_gmem_ptr(v_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}),
                                     make_stride(p.v_row_stride, _1{})),
                         TileKV{}, make_coord(_, 0));

  // ---- shared tiles
  Elem* smem = reinterpret_cast<Elem*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Tr::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Tr::SmemLayoutVt{});
  Tensor sVt_plain = make_tensor(sV.data(), get_nonswizzle_portion(typename Tr::SmemLayoutVt{}));
  Tensor sO = make_tensor(sQ.data(), typename Tr::SmemLayoutO{});

  // ---- global -> shared copies, with each vector's (row, col) for the row predicates
  typename Tr::GmemCopyQKV gmem_copy;
  auto gthr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gthr.partition_S(gQ);
  Tensor tQsQ = gthr.partition_D(sQ);
  Tensor tKgK = gthr.partition_S(gK);  // (CPY, CPY_N, CPY_K, key blocks)
  Tensor tKsK = gthr.partition_D(sK);
  Tensor tVgV = gthr.partition_S(gV);
  Tensor tVsV = gthr.partition_D(sV);
  Tensor tQcQ = gthr.partition_S(make_identity_tensor(TileQ{}));
  Tensor tKcK = gthr.partition_S(make_identity_tensor(TileKV{}));

  // ---- MMA partitions and the shared -> register copies (ldmatrix) that feed them
  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor rQ = thr_mma.partition_fragment_A(sQ);          // (MMA, MMA_M, MMA_K)
  Tensor rK = thr_mma.partition_fragment_B(sK);          // (MMA, MMA_N, MMA_K)
  Tensor rVt = thr_mma.partition_fragment_B(sVt_plain);  // (MMA, MMA_K(D), MMA_N(keys))
  auto smem_copy_q = make_tiled_copy_A(typename Tr::SmemCopyAtom{}, mma);
  auto smem_copy_k = make_tiled_copy_B(typename Tr::SmemCopyAtom{}, mma);
  auto smem_copy_v = make_tiled_copy_B(typename Tr::SmemCopyAtomTransposed{}, mma);
  Tensor tSsQ = smem_copy_q.get_thread_slice(tid).partition_S(sQ);
  Tensor tSsK = smem_copy_k.get_thread_slice(tid).partition_S(sK);
  Tensor tOsVt = smem_copy_v.get_thread_slice(tid).partition_S(sVt);

  // Output accumulator and each element's (row, col), in rows x cols views.
  Tensor acc_o = partition_fragment_C(mma, TileQ{});  // (MMA, MMA_M, MMA_N(D))
  clear(acc_o);
  Tensor o_rc = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
  Tensor co = thr_mma.partition_C(make_identity_tensor(TileQ{}));
  Tensor co_rc = make_tensor(co.data(), rowcol(co.layout()));
  // Score coordinates: the same partition over a (kBlockM, kBlockN) tile.
  Tensor cs = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kRows = decltype(size<0>(o_rc))::value;
  SoftmaxState<float> st[kRows];

  // ---- prologue: Q and the last key block's K in flight
  copy_rows(gmem_copy, tQgQ, tQsQ, tQcQ, bi.rows);
  const int64_t nb_begin = bi.n_begin / kBlockN;
  const int64_t nb_end = bi.n_end > bi.n_begin ? ceil_div(bi.n_end, kBlockN) : nb_begin;
  if (nb_end > nb_begin) {
    copy_rows(gmem_copy, tKgK(_, _, _, nb_end - 1), tKsK, tKcK,
              p.seqlen_k - (nb_end - 1) * kBlockN);
  }
  cp_async_fence();

  // ---- main loop
  for (int64_t nb = nb_end - 1; nb >= nb_begin; --nb) {
    const int64_t j0 = nb * kBlockN;
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K[nb] (and Q) landed; every warp is done with the previous V
    copy_rows(gmem_copy, tVgV(_, _, _, nb), tVsV, tKcK, p.seqlen_k - j0);
    cp_async_fence();

    gemm_ss(mma, acc_s, rQ, rK, tSsQ, tSsK, smem_copy_q, smem_copy_k);

    cp_async_wait<0>();
    __syncthreads();  // V[nb] landed; every warp is done with K[nb]
    if (nb > nb_begin) {
      // keys below the last block are whole blocks: no row predicate needed, but kept for
      // one code path (the test is per 16-byte vector row, not per element)
      copy_rows(gmem_copy, tKgK(_, _, _, nb - 1), tKsK, tKcK, p.seqlen_k - (nb - 1) * kBlockN);
      cp_async_fence();
    }

    Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
    Tensor cs_rc = make_tensor(cs.data(), rowcol(cs.layout()));
    if (j0 + kBlockN <= p.seqlen_k &&
        band.tile_unmasked(bi.m0, bi.m0 + bi.rows, j0, j0 + kBlockN)) {
      softmax_block<Exp, false, kBlockN>(s_rc, cs_rc, o_rc, st, band, p.seqlen_k, s_scale, bi.m0,
                                         j0);
    } else {
      softmax_block<Exp, true, kBlockN>(s_rc, cs_rc, o_rc, st, band, p.seqlen_k, s_scale, bi.m0,
                                        j0);
    }

    // O += P V with P (16-bit) straight from the score registers
    constexpr int kS = decltype(size(acc_s))::value;
    cutlass::NumericArrayConverter<Elem, float, kS> to_elem;
    cutlass::Array<Elem, kS> p_frag =
        to_elem(*reinterpret_cast<const cutlass::Array<float, kS>*>(acc_s.data()));
    Tensor rP = make_tensor(make_rmem_ptr<Elem>(p_frag.data()), acc_as_a(acc_s.layout()));
    gemm_rs(mma, acc_o, rP, rVt, tOsVt, smem_copy_v);
  }

  // ---- epilogue: the quad's partial sums, O / sum, lse
  finish_rows(o_rc, co_rc, st, p, bi.b, bi.h, bi.m0);
  // O through shared memory (Q's tile) to 16-byte global stores; with no key block the
  // prologue's Q copy may still be in flight, hence the wait.
  constexpr int kO = decltype(size(acc_o))::value;
  cutlass::NumericArrayConverter<Elem, float, kO> to_elem_o;
  cutlass::Array<Elem, kO> o_frag =
      to_elem_o(*reinterpret_cast<const cutlass::Array<float, kO>*>(acc_o.data()));
  Tensor rO = make_tensor(make_rmem_ptr<Elem>(o_frag.data()), acc_o.layout());
  auto smem_copy_o = make_tiled_copy_C(typename Tr::SmemCopyAtomO{}, mma);
  auto sothr = smem_copy_o.get_thread_slice(tid);
  cp_async_wait<0>();
  __syncthreads();  // every warp is done reading Q
  copy(smem_copy_o, sothr.retile_S(rO), sothr.partition_D(sO));
  __syncthreads();
  typename Tr::GmemCopyO gmem_copy_o;
  auto othr = gmem_copy_o.get_thread_slice(tid);
  Tensor tOsO = othr.partition_S(sO);
  Tensor tOgO = othr.partition_D(gO);
  Tensor tOcO = othr.partition_D(make_identity_tensor(TileQ{}));
#pragma unroll
  for (int m = 0; m < size<1>(tOgO); ++m) {
    if (get<0>(tOcO(0, m, 0)) < bi.rows) copy(gmem_copy_o, tOsO(_, m, _), tOgO(_, m, _));
  }
}

template <typename T, int kHeadDim>
size_t fwd_cute_smem_bytes() {
  return FwdCuteTraits<T, kHeadDim>::kSmemBytes;
}

template <typename T, int kHeadDim, class Exp>
cudaError_t run_fwd_cute(const AttentionParams& p, cudaStream_t stream) {
  using Tr = FwdCuteTraits<T, kHeadDim>;
  const int64_t blocks = p.batch * p.heads * ceil_div(p.seqlen_q, Tr::kBlockM);
  if (blocks == 0) return cudaSuccess;
  const auto kernel = flash_fwd_cute_kernel<Tr, Exp>;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(Tr::kSmemBytes));
  if (e != cudaSuccess) return e;
  kernel<<<static_cast<unsigned>(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attn_ext::cuda
