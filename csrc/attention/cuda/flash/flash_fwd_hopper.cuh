#pragma once
// Flash-attention forward for Hopper (sm_90a), bf16 / fp16: TMA loads, wgmma, warp
// specialization (FlashAttention-3's structure, without its ping-pong and intra-warpgroup
// overlap yet). Serves what the sm_80 CuTe forward serves (fixed-length batches, D == Dv ==
// kHeadDim, the causal / window band, GQA, lse) where the strides are TMA-legal
// (attention_launch.cu's hopper_index); compiled to an empty kernel for every other
// architecture and routed on compute capability 9.x, where it is the default forward since it
// ran green on an H100 (2026-11-27).
// One block of 3 warpgroups owns kBlockM = 128 query rows of one (b, h):
//   producer   warpgroup 0, one thread: Q once (its own mbarrier), then K and V of each key
//              block, last to first, by TMA into 2-stage rings (PipelineTmaAsync: a stage is
//              refilled once both consumers released it). Registers given back (setmaxnreg).
//   consumers  warpgroups 1 and 2, 64 rows each: per key block S = Q K^T (wgmma SS), the
//              online softmax in registers (cute_fwd::softmax_block, shared with sm_80),
//              O = O * rescale + P V (wgmma RS, P converted to 16 bits in registers);
//   epilogue   each consumer: O / rowsum to 16 bits, through its half of Q's shared tile to
//              16-byte global stores; lse.
#include <cstdint>
#include <type_traits>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>
#include "attention/cuda/flash/flash_fwd_cute.cuh"
#include "attention/cuda/flash/hopper_traits.cuh"

namespace attn_ext::cuda {
namespace hopper_fwd {

// acc (+)= A B on one warpgroup's wgmmas, waited for before returning (the caller then reads
// acc, and the operands' shared stage may be released). kZeroInit: acc = A B.
template <bool kZeroInit, class Mma, class A, class B, class Acc>
__device__ __forceinline__ void wgmma(Mma& mma, A& a, B const& b, Acc& acc) {
  // A in registers (P) rather than shared-memory descriptors (Q): fenced as acc is
  constexpr bool kRegA = !std::is_same_v<typename A::iterator, GMMA::DescriptorIterator>;
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if constexpr (kRegA) warpgroup_fence_operand(a);
}

// The K and V rings' mbarriers: a stage's "full" barrier counts the TMA bytes in, its "empty"
// barrier the 256 consumer threads' releases.
template <class Tr>
using KVPipeline = cutlass::PipelineTmaAsync<Tr::kStages>;

template <class Tr>
struct SharedStorage {
  using Elem = typename Tr::Elem;
  // 1024-byte alignment: the period of the 128-byte swizzle, which TMA and wgmma assume.
  alignas(1024) cute::array_aligned<Elem, cosize_v<typename Tr::SmemLayoutQ>> q;
  alignas(1024) cute::array_aligned<Elem, cosize_v<typename Tr::SmemLayoutKV>> k;
  alignas(1024) cute::array_aligned<Elem, cosize_v<typename Tr::SmemLayoutKV>> v;
  cutlass::arch::ClusterTransactionBarrier q_full;
  typename KVPipeline<Tr>::SharedStorage pipe_k;
  typename KVPipeline<Tr>::SharedStorage pipe_v;
};

// The kernel's argument: the params and the TMA descriptors built from them on the host.
template <class Tr>
struct Args {
  AttentionParams p;
  typename Tr::TmaQ tma_q;
  typename Tr::TmaKV tma_k;
  typename Tr::TmaKV tma_v;
};

// The TMA coordinate tensors of Q, K, V: (rows, D, heads, batch), as the descriptors were made.
template <class Tr>
__host__ __device__ typename Tr::GmemShape gmem_shape(const AttentionParams& p, int64_t rows,
                                                      int64_t heads) {
  return {
      static_cast<int32_t>(rows), {}, static_cast<int32_t>(heads), static_cast<int32_t>(p.batch)};
}

}  // namespace hopper_fwd

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_hopper_kernel(const __grid_constant__ hopper_fwd::Args<Tr> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using namespace hopper_fwd;
  using Elem = typename Tr::Elem;
  using Pipeline = KVPipeline<Tr>;
  using PipelineState = typename cutlass::PipelineState<Tr::kStages>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  const AttentionParams& p = args.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<SharedStorage<Tr>*>(smem_raw);
  const int warpgroup = cutlass::canonical_warp_group_idx();

  // ---- barriers: Q's (one arrival, the producer's), the K and V rings'
  if (threadIdx.x == 0) ss.q_full.init(1);
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Tr::kKVBytes;
  pipe_params.role =
      warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Tr::kConsumerThreads;
  Pipeline pipe_k(ss.pipe_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipe_v(ss.pipe_v, pipe_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();  // every barrier initialized before any thread uses one

  const QueryBlockInfo<false> bi(p, kBlockM, blockIdx.x);
  const int64_t nb_begin = bi.n_begin / kBlockN;
  const int64_t nb_end = bi.n_end > bi.n_begin ? ceil_div(bi.n_end, kBlockN) : nb_begin;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutVt{});

  if (warpgroup == 0) {
    // ---- producer: one thread issues every copy
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (threadIdx.x != 0) return;
    Tensor mQ = args.tma_q.get_tma_tensor(gmem_shape<Tr>(p, p.seqlen_q, p.heads));
    Tensor mK = args.tma_k.get_tma_tensor(gmem_shape<Tr>(p, p.seqlen_k, p.kv_heads));
    Tensor mV = args.tma_v.get_tma_tensor(gmem_shape<Tr>(p, p.seqlen_k, p.kv_heads));
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
    Tensor gQ = local_tile(mQ(_, _, bi.h, bi.b), TileQ{}, make_coord(bi.m0 / kBlockM, _0{}));
    Tensor gK = local_tile(mK(_, _, bi.hk, bi.b), TileKV{}, make_coord(_, _0{}));  // (.., blocks)
    Tensor gV = local_tile(mV(_, _, bi.hk, bi.b), TileKV{}, make_coord(_, _0{}));
    auto [tQgQ, tQsQ] =
        tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKgK, tKsK] =
        tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] =
        tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    ss.q_full.arrive_and_expect_tx(Tr::kQBytes);
    copy(args.tma_q.with(reinterpret_cast<uint64_t&>(ss.q_full)), tQgQ, tQsQ);
    PipelineState state = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t nb = nb_end - 1; nb >= nb_begin; --nb, ++state) {
      pipe_k.producer_acquire(state);
      copy(args.tma_k.with(*pipe_k.producer_get_barrier(state)), tKgK(_, nb),
           tKsK(_, state.index()));
      pipe_v.producer_acquire(state);
      copy(args.tma_v.with(*pipe_v.producer_get_barrier(state)), tVgV(_, nb),
           tVsV(_, state.index()));
    }
    return;
  }

  // ---- consumers: thread tid of 256 (warpgroup 1 holds rows 0-63, warpgroup 2 rows 64-127)
  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int tid = threadIdx.x - 128;
  const LocalBand band{p.key_offset, p.window_left, p.window_right};
  const float s_scale = static_cast<float>(p.scale * kLog2e);
  typename Tr::TiledMmaS mma_s;
  typename Tr::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // descriptors (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
  Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (MMA, MMA_N(D), MMA_K(keys), stages)

  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor o_rc = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
  Tensor co = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor co_rc = make_tensor(co.data(), rowcol(co.layout()));
  Tensor cs = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cs_rc = make_tensor(cs.data(), rowcol(cs.layout()));
  constexpr int kRows = decltype(size<0>(o_rc))::value;
  SoftmaxState<float> st[kRows];

  // Q must have landed even without key blocks: the epilogue overwrites its tile.
  ss.q_full.wait(0);
  PipelineState state;
  for (int64_t nb = nb_end - 1; nb >= nb_begin; --nb, ++state) {
    const int64_t j0 = nb * kBlockN;
    Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    pipe_k.consumer_wait(state);
    wgmma<true>(mma_s, tSrQ, tSrK(_, _, _, state.index()), acc_s);
    pipe_k.consumer_release(state);

    Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
    if (j0 + kBlockN <= p.seqlen_k &&
        band.tile_unmasked(bi.m0, bi.m0 + bi.rows, j0, j0 + kBlockN)) {
      cute_fwd::softmax_block<cute_fwd::FoldScale, false, kBlockN>(s_rc, cs_rc, o_rc, st, band,
                                                                   p.seqlen_k, s_scale, bi.m0, j0);
    } else {
      cute_fwd::softmax_block<cute_fwd::FoldScale, true, kBlockN>(s_rc, cs_rc, o_rc, st, band,
                                                                  p.seqlen_k, s_scale, bi.m0, j0);
    }

    constexpr int kS = decltype(size(acc_s))::value;
    cutlass::NumericArrayConverter<Elem, float, kS> to_elem;
    cutlass::Array<Elem, kS> p_frag =
        to_elem(*reinterpret_cast<const cutlass::Array<float, kS>*>(acc_s.data()));
    Tensor tOrP = make_tensor(make_rmem_ptr<Elem>(p_frag.data()), acc_as_a(acc_s.layout()));
    pipe_v.consumer_wait(state);
    wgmma<false>(mma_o, tOrP, tOrV(_, _, _, state.index()), acc_o);
    pipe_v.consumer_release(state);
  }

  // ---- epilogue: the quad's partial sums, O / sum, lse
  cute_fwd::finish_rows(o_rc, co_rc, st, p, bi.b, bi.h, bi.m0);
  // O to 16 bits, into this warpgroup's 64 rows of Q's tile (its last wgmma reading them has
  // completed), then 16-byte stores of those rows once the warpgroup's writes are visible.
  constexpr int kO = decltype(size(acc_o))::value;
  cutlass::NumericArrayConverter<Elem, float, kO> to_elem_o;
  cutlass::Array<Elem, kO> o_frag =
      to_elem_o(*reinterpret_cast<const cutlass::Array<float, kO>*>(acc_o.data()));
  Tensor rO = make_tensor(make_rmem_ptr<Elem>(o_frag.data()), acc_o.layout());
  Tensor sO = make_tensor(sQ.data(), typename Tr::SmemLayoutO{});
  auto smem_copy_o = make_tiled_copy_C(typename Tr::SmemCopyAtomO{}, mma_o);
  auto sothr = smem_copy_o.get_thread_slice(tid);
  copy(smem_copy_o, sothr.retile_S(rO), sothr.partition_D(sO));
  const int consumer = warpgroup - 1;
  cutlass::arch::NamedBarrier::sync(128, consumer);  // ids past CUTLASS's reserved ones

  using TileRows = Shape<Int<Tr::kRowsPerWarpgroup>, Int<kHeadDim>>;
  Elem* o_ptr = static_cast<Elem*>(p.out) + bi.b * p.o_batch_stride + bi.h * p.o_head_stride +
                (bi.m0 + consumer * Tr::kRowsPerWarpgroup) * p.o_row_stride;
  Tensor gO = make_tensor(make_gmem_ptr(o_ptr), TileRows{}, make_stride(p.o_row_stride, _1{}));
  Tensor sOw = local_tile(sO, TileRows{}, make_coord(consumer, _0{}));
  typename Tr::GmemCopyO gmem_copy_o;
  auto othr = gmem_copy_o.get_thread_slice(threadIdx.x % 128);
  Tensor tOsO = othr.partition_S(sOw);
  Tensor tOgO = othr.partition_D(gO);
  Tensor tOcO = othr.partition_D(make_identity_tensor(TileRows{}));
  const int64_t rows = bi.rows - consumer * Tr::kRowsPerWarpgroup;
#pragma unroll
  for (int m = 0; m < size<1>(tOgO); ++m) {
    if (get<0>(tOcO(0, m, 0)) < rows) copy(gmem_copy_o, tOsO(_, m, _), tOgO(_, m, _));
  }
#else
  // An image without wgmma (sm_80, or plain sm_90 beside sm_90a in one build, where the
  // driver may pick it): a launch error rather than out and lse left unwritten.
  __trap();
#endif
}

// The descriptors of Q, K and V from the params' strides (hopper_index checked that they are
// TMA-legal: 16-byte aligned bases and strides, positive, 32-bit extents), then the launch.
template <typename T, int kHeadDim>
cudaError_t run_fwd_hopper(const AttentionParams& p, cudaStream_t stream) {
  using namespace cute;
  using Tr = FwdHopperTraits<T, kHeadDim>;
  static_assert(sizeof(hopper_fwd::SharedStorage<Tr>) == Tr::kSmemBytes, "the traits' budget");
  const int64_t blocks = p.batch * p.heads * ceil_div(p.seqlen_q, Tr::kBlockM);
  if (blocks == 0) return cudaSuccess;
  using Stride = typename Tr::GmemStride;
  const auto q = Tr::gmem_tensor(p.q, hopper_fwd::gmem_shape<Tr>(p, p.seqlen_q, p.heads),
                                 Stride{p.q_row_stride, {}, p.q_head_stride, p.q_batch_stride});
  const auto k = Tr::gmem_tensor(p.k, hopper_fwd::gmem_shape<Tr>(p, p.seqlen_k, p.kv_heads),
                                 Stride{p.k_row_stride, {}, p.k_head_stride, p.k_batch_stride});
  const auto v = Tr::gmem_tensor(p.v, hopper_fwd::gmem_shape<Tr>(p, p.seqlen_k, p.kv_heads),
                                 Stride{p.v_row_stride, {}, p.v_head_stride, p.v_batch_stride});
  const hopper_fwd::Args<Tr> args{
      p, make_tma_copy(SM90_TMA_LOAD{}, q, typename Tr::SmemLayoutQ{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename Tr::SmemLayoutKV{})),
      make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Tr::SmemLayoutKV{}))};
  const cudaError_t e =
      cudaFuncSetAttribute(flash_fwd_hopper_kernel<Tr>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Tr::kSmemBytes));
  if (e != cudaSuccess) return e;
  flash_fwd_hopper_kernel<Tr>
      <<<static_cast<unsigned>(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace attn_ext::cuda
