#pragma once
// Tensor-core flash-attention backward on CuTe, bf16 / fp16, sm_80+ (FlashAttention-2's
// algorithm). Serves what the CuTe forward serves (D == Dv == kHeadDim, no explicit mask,
// dropout, varlen batch or score modifier) when atomics may order dQ's sums
// (attention_launch.cu's cute_bwd_index; under torch.use_deterministic_algorithms the generic
// kernel runs).
//   preprocess  the generic kernel's (flash_bwd_generic.cuh): delta = rowsum(dO * O), the
//               log2-domain lse as hi + lo;
//   prologue    this block's K and V tiles (key block n of (b, query head h));
//   main loop   over the query blocks whose rows see any of the keys, per block:
//                 Q and dO tiles in (cp.async; with two query stages the next block's tiles
//                 load while this block's products run, FlashAttention-2's prefetch),
//                 S = Q K^T and dP = dO V^T (mma, fp32),
//                 P = exp2(S * scale log2(e) - lse2) (masked where the band, the key range or
//                 the row range cuts the tile), dS = P (dP - delta);
//                 P and dS to shared memory (16 bits), then dV += P^T dO and dK += dS^T Q
//                 (accumulated in registers over the loop) and dQ = dS K, added to the fp32
//                 dQ buffer with atomics;
//   epilogue    dK * scale and dV to the per-query-head fp32 buffers (the op sums each GQA
//               group and converts).
// The bf16 / fp16 backward by default since it ran green on an H100 (2026-11-27), with one query
// stage; under torch.use_deterministic_algorithms the generic kernel runs (dQ's atomics are
// unordered). Two query stages (Tr::kQStages) only when asked for and opted in
// (ATTN_EXT_CUDA_BWD_KERNEL=cute_prefetch, attention_cuda.cpp): compiled, not yet run on a GPU.
#include <cstdint>
#include <cutlass/numeric_conversion.h>
#include "common/constants.h"
#include "common/mask.h"
#include "common/cuda/elem.cuh"
#include "attention/cuda/flash/block_info.cuh"
#include "attention/cuda/flash/cute_traits.cuh"
#include "attention/cuda/flash/cute_utils.cuh"
#include "attention/cuda/flash/flash_bwd_generic.cuh"
#include "attention/cuda/flash/launch_templates.h"

namespace attn_ext::cuda {
namespace cute_bwd {

using namespace cute;
using cute_fwd::rowcol;
using cute_util::BlockKeys;
using cute_util::copy_rows;
using cute_util::exp2_ftz;
using cute_util::gemm_ss;

// Rows [m0, m0 + kBlockM) x keys [n0, n0 + kBlockN): true when every pair is inside the band,
// the rows and the keys (no element test needed).
__device__ __forceinline__ bool tile_free(const LocalBand& band, int64_t m0, int64_t m1, int64_t n0,
                                          int64_t n1, int64_t seqlen_q, int64_t seqlen_k) {
  return m1 <= seqlen_q && n1 <= seqlen_k && band.tile_unmasked(m0, m1, n0, n1);
}

// One block's P = exp2(S * scale log2 e - lse2) (lse2 as hi + lo) and dS = P (dP - delta), in
// place of S and dP (rows x cols views): kMasked tests each score against the rows, the keys
// and the band (cute_util::BlockKeys: 32-bit row bounds and column compares), the free blocks
// test nothing.
template <bool kMasked, int kBlockN, class S, class DP, class C>
__device__ __forceinline__ void probs_and_grads(S& s_rc, DP& dp_rc, C const& cs_rc,
                                                const float* lse2, const float* lse2_lo,
                                                const float* delta, const LocalBand& band,
                                                int64_t seqlen_q, int64_t seqlen_k, float s_scale,
                                                int64_t m0, int64_t n0) {
  const BlockKeys<kBlockN> block_keys(band, seqlen_k, m0, n0);
#pragma unroll
  for (int r = 0; r < size<0>(s_rc); ++r) {
    const int row = get<0>(cs_rc(r, 0));
    const int64_t i = m0 + row;
    const bool row_ok = i < seqlen_q;
    // a row that sees no key has lse = -inf and no probability at all
    const float hi = row_ok && lse2[i] != -INFINITY ? lse2[i] : INFINITY;
    const float lo = row_ok ? lse2_lo[i] : 0.f;
    const float d = row_ok ? delta[i] : 0.f;
    const auto keys = block_keys.row(row);
#pragma unroll
    for (int c = 0; c < size<1>(s_rc); ++c) {
      float prob = exp2_ftz(fmaf(s_rc(r, c), s_scale, -hi) - lo);
      if constexpr (kMasked) {
        const int col = get<1>(cs_rc(r, c));
        if (!row_ok || col < keys.lo || col >= keys.hi) prob = 0.f;
      }
      s_rc(r, c) = prob;
      dp_rc(r, c) = prob * (dp_rc(r, c) - d);
    }
  }
}

}  // namespace cute_bwd

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_bwd_cute_kernel(AttentionBwdParams p, BwdWorkspace ws) {
  using namespace cute;
  using namespace cute_bwd;
  using Elem = typename Tr::Elem;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int tid = threadIdx.x;

  const KeyBlockInfo<false> bi(p, kBlockN, blockIdx.x);
  const LocalBand band{p.key_offset, p.window_left, p.window_right};
  const float s_scale = static_cast<float>(p.scale * kLog2e);
  const float scale = static_cast<float>(p.scale);
  const int64_t head_rows = (bi.b * p.heads + bi.h) * p.seqlen_q;  // lse / workspace rows
  const float* delta = static_cast<const float*>(ws.delta) + head_rows;
  const float* lse2 = static_cast<const float*>(ws.lse2) + head_rows;
  const float* lse2_lo = static_cast<const float*>(ws.lse2_lo) + head_rows;

  // ---- global views
  const Elem* q_ptr =
      static_cast<const Elem*>(p.q) + bi.b * p.q_batch_stride + bi.h * p.q_head_stride;
  const Elem* do_ptr =
      static_cast<const Elem*>(p.dout) + bi.b * p.do_batch_stride + bi.h * p.do_head_stride;
  const Elem* k_ptr = static_cast<const Elem*>(p.k) + bi.b * p.k_batch_stride +
                      bi.hk * p.k_head_stride + bi.n0 * p.k_row_stride;
  const Elem* v_ptr = static_cast<const Elem*>(p.v) + bi.b * p.v_batch_stride +
                      bi.hk * p.v_head_stride + bi.n0 * p.v_row_stride;
  // (kBlockM, kHeadDim, query blocks)
  Tensor gQ = local_tile(make_tensor(make_gmem_ptr(q_ptr), make_shape(p.seqlen_q, Int<kHeadDim>{}),
                                     make_stride(p.q_row_stride, _1{})),
                         TileQ{}, make_coord(_, 0));
  Tensor gdO =
      local_tile(make_tensor(make_gmem_ptr(do_ptr), make_shape(p.seqlen_q, Int<kHeadDim>{}),
                             make_stride(p.do_row_stride, _1{})),
                 TileQ{}, make_coord(_, 0));
  Tensor gK = make_tensor(make_gmem_ptr(k_ptr), TileKV{}, make_stride(p.k_row_stride, _1{}));
  Tensor gV = make_tensor(make_gmem_ptr(v_ptr), TileKV{}, make_stride(p.v_row_stride, _1{}));

  // ---- shared tiles and their transposed views
  // Q's stages, then dO's, then K, V, P, dS; the views below are of stage 0 (staged() moves
  // them to another)
  constexpr int kQStages = Tr::kQStages;
  constexpr int kStageElems = cosize_v<typename Tr::SmemLayoutQ>;
  Elem* smem = reinterpret_cast<Elem*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Tr::SmemLayoutQ{});
  Tensor sdO = make_tensor(sQ.data() + kQStages * kStageElems, typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(sdO.data() + kQStages * kStageElems, typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Tr::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename Tr::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename Tr::SmemLayoutPdS{});
  Tensor sQt = make_tensor(sQ.data(), typename Tr::SmemLayoutQt{});
  Tensor sdOt = make_tensor(sdO.data(), typename Tr::SmemLayoutQt{});
  Tensor sKt = make_tensor(sK.data(), typename Tr::SmemLayoutKt{});
  Tensor sPt = make_tensor(sP.data(), typename Tr::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(sdS.data(), typename Tr::SmemLayoutPdSt{});
  // plain (unswizzled) layouts of the same shapes, for sizing register fragments
  const auto plain = [](auto const& t) {
    return make_tensor(t.data(), get_nonswizzle_portion(t.layout()));
  };

  // ---- global -> shared copies
  typename Tr::GmemCopy gmem_copy;
  auto gthr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gthr.partition_S(gQ);  // (CPY, CPY_M, CPY_K, query blocks)
  Tensor tQsQ = gthr.partition_D(sQ);
  Tensor tdOgdO = gthr.partition_S(gdO);
  Tensor tdOsdO = gthr.partition_D(sdO);
  Tensor tQcQ = gthr.partition_S(make_identity_tensor(TileQ{}));
  Tensor tKcK = gthr.partition_S(make_identity_tensor(TileKV{}));

  // ---- the five products' operands
  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmaKV mma_kv;
  typename Tr::TiledMmaQ mma_q;
  auto sdp_thr = mma_sdp.get_thread_slice(tid);
  auto kv_thr = mma_kv.get_thread_slice(tid);
  auto q_thr = mma_q.get_thread_slice(tid);
  using AtomN = typename Tr::SmemCopyAtom;
  using AtomT = typename Tr::SmemCopyAtomTransposed;
  // S = Q K^T, dP = dO V^T
  auto cp_sdp_a = make_tiled_copy_A(AtomN{}, mma_sdp);
  auto cp_sdp_b = make_tiled_copy_B(AtomN{}, mma_sdp);
  Tensor rQ = sdp_thr.partition_fragment_A(sQ);
  Tensor rK = sdp_thr.partition_fragment_B(sK);
  Tensor rdO = sdp_thr.partition_fragment_A(sdO);
  Tensor rV = sdp_thr.partition_fragment_B(sV);
  Tensor tSsQ = cp_sdp_a.get_thread_slice(tid).partition_S(sQ);
  Tensor tSsK = cp_sdp_b.get_thread_slice(tid).partition_S(sK);
  Tensor tPsdO = cp_sdp_a.get_thread_slice(tid).partition_S(sdO);
  Tensor tPsV = cp_sdp_b.get_thread_slice(tid).partition_S(sV);
  // dV += P^T dO, dK += dS^T Q
  auto cp_kv_a = make_tiled_copy_A(AtomT{}, mma_kv);
  auto cp_kv_b = make_tiled_copy_B(AtomT{}, mma_kv);
  Tensor rPt = kv_thr.partition_fragment_A(plain(sPt));
  Tensor rdOt = kv_thr.partition_fragment_B(plain(sdOt));
  Tensor rdSt = kv_thr.partition_fragment_A(plain(sdSt));
  Tensor rQt = kv_thr.partition_fragment_B(plain(sQt));
  Tensor tVsPt = cp_kv_a.get_thread_slice(tid).partition_S(sPt);
  Tensor tVsdOt = cp_kv_b.get_thread_slice(tid).partition_S(sdOt);
  Tensor tKsdSt = cp_kv_a.get_thread_slice(tid).partition_S(sdSt);
  Tensor tKsQt = cp_kv_b.get_thread_slice(tid).partition_S(sQt);
  // dQ = dS K
  auto cp_q_a = make_tiled_copy_A(AtomN{}, mma_q);
  auto cp_q_b = make_tiled_copy_B(AtomT{}, mma_q);
  Tensor rdS = q_thr.partition_fragment_A(sdS);
  Tensor rKt = q_thr.partition_fragment_B(plain(sKt));
  Tensor tQsdS = cp_q_a.get_thread_slice(tid).partition_S(sdS);
  Tensor tQsKt = cp_q_b.get_thread_slice(tid).partition_S(sKt);

  // accumulators and the coordinates of their elements
  Tensor acc_dk = partition_fragment_C(mma_kv, TileKV{});
  Tensor acc_dv = partition_fragment_C(mma_kv, TileKV{});
  clear(acc_dk);
  clear(acc_dv);
  Tensor cs = sdp_thr.partition_C(make_identity_tensor(TileS{}));
  Tensor cs_rc = make_tensor(cs.data(), rowcol(cs.layout()));
  Tensor cdq = q_thr.partition_C(make_identity_tensor(TileQ{}));
  Tensor ckv = kv_thr.partition_C(make_identity_tensor(TileKV{}));
  auto smem_copy_pds = make_tiled_copy_C(typename Tr::SmemCopyAtomPdS{}, mma_sdp);
  auto pds_thr = smem_copy_pds.get_thread_slice(tid);

  // A view of Q or dO (or a partition of one) moved to query stage st. A stage is a whole
  // number of swizzle periods, so its bytes are laid out (and bank-conflict free) as stage 0's.
  const auto staged = [](auto view, int st) {
    view.data() = view.data() + st * kStageElems;
    return view;
  };
  // Query block mb's Q and dO rows into stage st (cp.async; rows past seqlen_q zeroed).
  const auto load_q_do = [&](int64_t mb, int st) {
    const int64_t rows = p.seqlen_q - mb * kBlockM;
    auto q_dst = staged(tQsQ, st);
    auto do_dst = staged(tdOsdO, st);
    copy_rows(gmem_copy, tQgQ(_, _, _, mb), q_dst, tQcQ, rows);
    copy_rows(gmem_copy, tdOgdO(_, _, _, mb), do_dst, tQcQ, rows);
  };

  // ---- prologue: this block's keys and values (and with two stages the first query block)
  const int64_t mb_begin = bi.r_begin / kBlockM;
  const int64_t mb_end = bi.r_end > bi.r_begin ? ceil_div(bi.r_end, kBlockM) : mb_begin;
  Tensor tKsK = gthr.partition_D(sK);
  Tensor tVsV = gthr.partition_D(sV);
  copy_rows(gmem_copy, gthr.partition_S(gK), tKsK, tKcK, bi.keys);
  copy_rows(gmem_copy, gthr.partition_S(gV), tVsV, tKcK, bi.keys);
  if constexpr (kQStages == 2) {
    if (mb_begin < mb_end) load_q_do(mb_begin, 0);
  }
  cp_async_fence();

  // ---- main loop over the query blocks that see these keys
  for (int64_t mb = mb_begin; mb < mb_end; ++mb) {
    const int64_t m0 = mb * kBlockM;
    const int st = kQStages == 2 ? static_cast<int>((mb - mb_begin) & 1) : 0;
    if constexpr (kQStages == 1) {
      __syncthreads();  // every warp is done with the previous block's Q, dO, P and dS
      load_q_do(mb, 0);
      cp_async_fence();
    }
    cp_async_wait<0>();
    // This block's Q and dO have landed, and every warp is done with the previous block's
    // tiles: its P and dS, and with two stages its Q and dO, whose stage the next copy reuses.
    __syncthreads();
    if constexpr (kQStages == 2) {
      if (mb + 1 < mb_end) {
        load_q_do(mb + 1, st ^ 1);
        cp_async_fence();
      }
    }

    Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});
    clear(acc_s);
    clear(acc_dp);
    gemm_ss(mma_sdp, acc_s, rQ, rK, staged(tSsQ, st), tSsK, cp_sdp_a, cp_sdp_b);
    gemm_ss(mma_sdp, acc_dp, rdO, rV, staged(tPsdO, st), tPsV, cp_sdp_a, cp_sdp_b);

    // P and dS in registers, rows x cols
    Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
    Tensor dp_rc = make_tensor(acc_dp.data(), rowcol(acc_dp.layout()));
    if (tile_free(band, m0, m0 + kBlockM, bi.n0, bi.n0 + kBlockN, p.seqlen_q, p.seqlen_k)) {
      probs_and_grads<false, kBlockN>(s_rc, dp_rc, cs_rc, lse2, lse2_lo, delta, band, p.seqlen_q,
                                      p.seqlen_k, s_scale, m0, bi.n0);
    } else {
      probs_and_grads<true, kBlockN>(s_rc, dp_rc, cs_rc, lse2, lse2_lo, delta, band, p.seqlen_q,
                                     p.seqlen_k, s_scale, m0, bi.n0);
    }
    // both to 16 bits in shared memory: the next products read them transposed
    constexpr int kS = decltype(size(acc_s))::value;
    cutlass::NumericArrayConverter<Elem, float, kS> to_elem;
    cutlass::Array<Elem, kS> p_frag =
        to_elem(*reinterpret_cast<const cutlass::Array<float, kS>*>(acc_s.data()));
    cutlass::Array<Elem, kS> ds_frag =
        to_elem(*reinterpret_cast<const cutlass::Array<float, kS>*>(acc_dp.data()));
    copy(smem_copy_pds,
         pds_thr.retile_S(make_tensor(make_rmem_ptr<Elem>(p_frag.data()), acc_s.layout())),
         pds_thr.partition_D(sP));
    copy(smem_copy_pds,
         pds_thr.retile_S(make_tensor(make_rmem_ptr<Elem>(ds_frag.data()), acc_dp.layout())),
         pds_thr.partition_D(sdS));
    __syncthreads();

    gemm_ss(mma_kv, acc_dv, rPt, rdOt, tVsPt, staged(tVsdOt, st), cp_kv_a, cp_kv_b);
    gemm_ss(mma_kv, acc_dk, rdSt, rQt, tKsdSt, staged(tKsQt, st), cp_kv_a, cp_kv_b);

    // dQ share of these keys: dQ += scale dS K, added with atomics (blocks of other keys add
    // to the same rows)
    Tensor acc_dq = partition_fragment_C(mma_q, TileQ{});
    clear(acc_dq);
    gemm_ss(mma_q, acc_dq, rdS, rKt, tQsdS, tQsKt, cp_q_a, cp_q_b);
    // this thread's elements of the block's dQ rows (fp32, rows of kHeadDim): compile-time
    // offsets from one address; rows past seqlen_q add nothing (32-bit row test)
    Tensor tdQgdQ = q_thr.partition_C(
        make_tensor(make_gmem_ptr(static_cast<float*>(p.dq) + (head_rows + m0) * kHeadDim), TileQ{},
                    make_stride(Int<kHeadDim>{}, _1{})));
    const int rows_left = static_cast<int>(p.seqlen_q - m0 < kBlockM ? p.seqlen_q - m0 : kBlockM);
#pragma unroll
    for (int e = 0; e < size(acc_dq); ++e) {
      if (get<0>(cdq(e)) < rows_left) atomicAdd(&tdQgdQ(e), scale * acc_dq(e));
    }
  }

  // ---- epilogue: dK (times the scale) and dV of this query head's share. A block whose keys
  // no query row sees ran no iteration: its K / V copies are still in flight, so wait.
  cp_async_wait<0>();
  const int64_t key_rows = (bi.b * p.heads + bi.h) * p.seqlen_k + bi.n0;
  float* dk = static_cast<float*>(p.dk) + key_rows * kHeadDim;
  float* dv = static_cast<float*>(p.dv) + key_rows * kHeadDim;
#pragma unroll
  for (int e = 0; e < size(acc_dk); ++e) {
    const int j = get<0>(ckv(e)), c = get<1>(ckv(e));
    if (j < bi.keys) {
      dk[j * kHeadDim + c] = scale * acc_dk(e);
      dv[j * kHeadDim + c] = acc_dv(e);
    }
  }
}

template <typename T, int kHeadDim, int kQStages>
size_t bwd_cute_smem_bytes() {
  return BwdCuteTraits<T, kHeadDim, kQStages>::kSmemBytes;
}

template <typename T, int kHeadDim, int kQStages>
cudaError_t run_bwd_cute(const AttentionBwdParams& p, BwdWorkspace ws, cudaStream_t stream) {
  using Tr = BwdCuteTraits<T, kHeadDim, kQStages>;
  if (p.batch * p.heads * p.seqlen_q == 0 || p.seqlen_k == 0) return cudaSuccess;
  cudaError_t e = launch_bwd_preprocess<T, false>(p, ws, stream);
  if (e != cudaSuccess) return e;
  const int64_t blocks = p.batch * p.heads * ceil_div(p.seqlen_k, Tr::kBlockN);
  e = cudaFuncSetAttribute(flash_bwd_cute_kernel<Tr>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Tr::kSmemBytes));
  if (e != cudaSuccess) return e;
  flash_bwd_cute_kernel<Tr>
      <<<static_cast<unsigned>(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace attn_ext::cuda
