// Tensor-core decode (issue 21): Sq new queries per sequence against a contiguous or paged KV
// cache, when a KV head has many query rows (G query heads x Sq tokens) or is MLA's latent
// head (D 576, values its first 512 columns). bf16 / fp16 on CuTe's m16n8k16 MMAs, sm_80+.
// Off by default until it has run on a GPU (decoding_cuda.cpp).
//
// One thread block owns kBlockM rows of one (sequence, KV head) and one split of its keys
// (decode_mma_traits.cuh has the shapes and why):
//   prologue  each row's key bounds in shared memory; Q's rows gathered (cp.async) and the
//             first tiles' K / V rows (through the cache-row policy: a page table or not);
//   main loop per tile of kBlockN keys:
//               the tile kStages - 1 ahead is issued (cp.async, rows past the split zeroed);
//               S = Q K^T: warp w the keys [16 w, 16 w + 16), scaled, masked, to shared fp32;
//               the row pass: each row's online-softmax update over the whole tile, P in 16
//               bits to shared memory, the row's rescale factor;
//               O = O * factor + P V: warp w the value columns [w Dv / 4, (w + 1) Dv / 4);
//   epilogue  the sink (split 0), O / rowsum and lse, or the split's partial for the merge
//             kernel (split_merge.cuh), stored from the accumulator registers.
// Score semantics are the other decode kernels': LocalBand (causal / window) from each row's
// query position, cache_leftpad, the sink; softcap / ALiBi stay on the split-KV kernel.
// A key a row does not see contributes an exact 0 weight; rows past the split's keys are
// zeros in shared memory (never read from the cache), so uninitialized cache rows add nothing.
#include <cstdint>
#include <type_traits>
#include <cute/tensor.hpp>
#include "common/constants.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "attention/score_mod.h"
#include "common/cuda/elem.cuh"
#include "decoding/cuda/decode_block.cuh"
#include "decoding/cuda/decode_mma_traits.cuh"
#include "decoding/cuda/decoding_launch.h"
#include "decoding/cuda/split_merge.cuh"

namespace attn_ext::cuda {
namespace {

using namespace cute;
using decode_mma::gather_rows;

// acc += A B over a k extent of kSteps 16-wide slices, both operands in shared memory, each
// slice read into one slice's registers (ldmatrix) just before its MMAs: the whole-K fragments
// of FlashAttention's gemm would be 144 registers for MLA's 576-wide Q rows.
template <int kSteps, class Mma, class Acc, class RA, class RB, class SA, class SB, class CpA,
          class CpB>
__device__ __forceinline__ void gemm_sliced(Mma const& mma, Acc& acc, RA& rA, RB& rB, SA const& sA,
                                            SB const& sB, CpA const& cpA, CpB const& cpB,
                                            int lane) {
  auto rA_view = cpA.get_slice(lane).retile_D(rA);
  auto rB_view = cpB.get_slice(lane).retile_D(rB);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    copy(cpA, sA(_, _, k), rA_view(_, _, 0));
    copy(cpB, sB(_, _, k), rB_view(_, _, 0));
    gemm(mma, rA(_, _, 0), rB(_, _, 0), acc);
  }
}

template <class Tr, class Rows>
__global__ void __launch_bounds__(Tr::kThreads)
    decode_mma_kernel(DecodeParams p, DecodeWorkspace ws) {
  using Elem = typename Tr::Elem;
  using T = typename Tr::Scalar;
  constexpr int M = Tr::kBlockM, N = Tr::kBlockN, D = Tr::kHeadDim, Dv = Tr::kHeadDimV;
  constexpr int kStages = Tr::kStages, kThreads = Tr::kThreads;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // ---- this block's rows and keys
  const DecodeBlock blk(p, M, N);
  const int64_t G = blk.G, Sq = blk.Sq, rows_all = blk.rows, bk = blk.bk, r0 = blk.r0;
  const int64_t b = blk.b, hk = blk.hk;
  const int m = blk.m;
  const int32_t splits = blk.splits, split = blk.split, j_begin = blk.j_begin, j_end = blk.j_end;
  const int num_tiles = (j_end - j_begin + N - 1) / N;
  const float log2e = static_cast<float>(kLog2e);
  const float s_scale = static_cast<float>(p.scale) * log2e;

  // ---- shared memory
  unsigned char* raw = smem_raw;
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(raw)), typename Tr::SmemLayoutQ{});
  raw += Tr::kSmemQ;
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(raw)), typename Tr::SmemLayoutK{});
  raw += Tr::kSmemK;
  Elem* v_base_smem = Tr::kVInK ? sK.data().get() : reinterpret_cast<Elem*>(raw);
  Tensor sV = make_tensor(make_smem_ptr(v_base_smem), typename Tr::SmemLayoutV{});  // !kVInK
  raw += Tr::kSmemV;
  Tensor sVt = make_tensor(make_smem_ptr(v_base_smem), typename Tr::SmemLayoutVt{});
  Tensor sVt_plain =
      make_tensor(make_smem_ptr(v_base_smem), get_nonswizzle_portion(typename Tr::SmemLayoutVt{}));
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(raw)), typename Tr::SmemLayoutP{});
  raw += Tr::kSmemP;
  float* scores = reinterpret_cast<float*>(raw);  // (M, kScoreStride)
  raw += Tr::kSmemScores;
  float* row_max = reinterpret_cast<float*>(raw);
  float* row_sum = row_max + M;
  float* row_factor = row_sum + M;
  int32_t* row_lo = reinterpret_cast<int32_t*>(row_factor + M);
  int32_t* row_hi = row_lo + M;

  // ---- prologue: each row's keys of this split [row_lo, row_hi) (empty past m), its state
  for (int r = tid; r < M; r += kThreads) {
    row_lo[r] = r < m ? blk.row_begin(r) : 0;
    row_hi[r] = r < m ? blk.row_end(r) : 0;
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
  }

  // Global -> shared: the query rows (row r: query r / G of head hk G + r % G), the cache rows
  // of a tile (row r: key j0 + r through the cache-row policy).
  typename Tr::GmemCopy gmem_copy;
  auto gthr = gmem_copy.get_thread_slice(tid);
  using VecCopy = SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>;
  const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride;
  gather_rows<VecCopy>(
      gthr.partition_D(sQ), gthr.partition_D(make_identity_tensor(Shape<Int<M>, Int<D>>{})), m,
      [&](int r) {
        const int64_t rg = r0 + r;
        return reinterpret_cast<const Elem*>(q_base + (hk * G + rg % G) * p.q_head_stride +
                                             (rg / G) * p.q_row_stride);
      });
  const T* k_head = static_cast<const T*>(p.k) + hk * p.k_head_stride;
  const T* v_head = static_cast<const T*>(p.v) + hk * p.v_head_stride;
  const auto load_tile = [&](int t) {
    const int32_t j0 = j_begin + t * N;
    const int keys = min(N, j_end - j0);
    const int stage = t % kStages;
    gather_rows<VecCopy>(gthr.partition_D(sK(_, _, stage)),
                         gthr.partition_D(make_identity_tensor(Shape<Int<N>, Int<D>>{})), keys,
                         [&](int r) {
                           const CacheSlot s = Rows::slot(p, b, j0 + r);
                           return reinterpret_cast<const Elem*>(
                               k_head + s.block * p.k_batch_stride + s.row * p.k_row_stride);
                         });
    if constexpr (!Tr::kVInK) {
      gather_rows<VecCopy>(gthr.partition_D(sV(_, _, stage)),
                           gthr.partition_D(make_identity_tensor(Shape<Int<N>, Int<Dv>>{})), keys,
                           [&](int r) {
                             const CacheSlot s = Rows::slot(p, b, j0 + r);
                             return reinterpret_cast<const Elem*>(
                                 v_head + s.block * p.v_batch_stride + s.row * p.v_row_stride);
                           });
    }
  };
  // Q joins the first tile's group; one group per tile slot, empty ones included, so that
  // cp_async_wait<kStages - 2> always means "tile t has landed".
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < num_tiles) load_tile(t);
    cp_async_fence();
  }

  // ---- the warps' MMAs and the shared -> register copies that feed them
  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(lane);
  auto smem_copy_a = make_tiled_copy_A(typename Tr::SmemCopyAtom{}, mma);
  auto smem_copy_b = make_tiled_copy_B(typename Tr::SmemCopyAtom{}, mma);
  auto smem_copy_vt = make_tiled_copy_B(typename Tr::SmemCopyAtomTransposed{}, mma);
  using Slice16 = Shape<_16, _16>;
  // One k slice of each operand in registers.
  Tensor rQ = thr_mma.partition_fragment_A(local_tile(sQ, Shape<Int<M>, _16>{}, make_coord(0, 0)));
  Tensor rK = thr_mma.partition_fragment_B(local_tile(sK(_, _, 0), Slice16{}, make_coord(0, 0)));
  Tensor rP = thr_mma.partition_fragment_A(local_tile(sP, Shape<Int<M>, _16>{}, make_coord(0, 0)));
  Tensor rVt = thr_mma.partition_fragment_B(
      local_tile(sVt_plain(_, _, 0), Shape<Int<Tr::kColsPerWarp>, _16>{}, make_coord(0, 0)));
  Tensor tSsQ = smem_copy_a.get_slice(lane).partition_S(sQ);  // (CPY, CPY_M, D / 16)
  Tensor tOsP = smem_copy_a.get_slice(lane).partition_S(sP);  // (CPY, CPY_M, N / 16)

  // Scores of warp w's 16 keys and the output of its value columns, with each element's (row,
  // col) in those tiles.
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<M>, Int<Tr::kColsPerWarp>>{});
  clear(acc_o);
  Tensor co = thr_mma.partition_C(make_identity_tensor(Shape<Int<M>, Int<Tr::kColsPerWarp>>{}));
  Tensor cs = thr_mma.partition_C(make_identity_tensor(Shape<Int<M>, _16>{}));

  constexpr int kRowThreads = kThreads / M;  // the row pass's threads per row, adjacent lanes
  constexpr int kRowCols = N / kRowThreads;
  const int prow = tid / kRowThreads, ppart = tid % kRowThreads;

  // ---- main loop
  for (int t = 0; t < num_tiles; ++t) {
    const int32_t j0 = j_begin + t * N;
    const int stage = t % kStages;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile t (and Q) landed; every warp is done with tile t - 1 and its P
    if (t + kStages - 1 < num_tiles) load_tile(t + kStages - 1);
    cp_async_fence();

    // S = Q K^T, warp w's keys, scaled to the log2 domain and masked, to shared memory
    if (warp < Tr::kScoreWarps) {
      Tensor sKw = local_tile(sK(_, _, stage), Shape<_16, Int<D>>{}, make_coord(warp, 0));
      Tensor acc_s = partition_fragment_C(mma, Shape<Int<M>, _16>{});
      clear(acc_s);
      gemm_sliced<D / 16>(mma, acc_s, rQ, rK, tSsQ, smem_copy_b.get_slice(lane).partition_S(sKw),
                          smem_copy_a, smem_copy_b, lane);
#pragma unroll
      for (int i = 0; i < size(acc_s); ++i) {
        const int row = get<0>(cs(i)), col = warp * Tr::kKeysPerWarp + get<1>(cs(i));
        const int32_t key = j0 + col;
        const bool seen = row_lo[row] <= key && key < row_hi[row];
        scores[row * Tr::kScoreStride + col] = seen ? acc_s(i) * s_scale : -INFINITY;
      }
    }
    __syncthreads();

    // the row pass: each row's running max over the tile, P = exp2(s - max) in 16 bits, the
    // sum, and the factor that rescales the row's output
    {
      float sv[kRowCols];
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < kRowCols; ++c) {
        sv[c] = scores[prow * Tr::kScoreStride + c * kRowThreads + ppart];
        mx = fmaxf(mx, sv[c]);
      }
#pragma unroll
      for (int off = kRowThreads / 2; off > 0; off /= 2)
        mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, off));
      SoftmaxState<float> st;
      st.max = row_max[prow];
      st.sum = row_sum[prow];
      const float factor = st.rescale_to(mx);
      const float shift = st.shift();
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kRowCols; ++c) {
        const float e = sv[c] == -INFINITY ? 0.f : exp2f(sv[c] - shift);
        sum += e;
        sP(prow, c * kRowThreads + ppart) = static_cast<Elem>(e);
      }
#pragma unroll
      for (int off = kRowThreads / 2; off > 0; off /= 2) sum += __shfl_xor_sync(~0u, sum, off);
      if (ppart == 0) {  // the row's other threads read the state before the shuffles above
        row_max[prow] = st.max;
        row_sum[prow] = st.sum + sum;
        row_factor[prow] = factor;
      }
    }
    __syncthreads();

    // O = O * factor + P V, warp w's value columns
#pragma unroll
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= row_factor[get<0>(co(i))];
    Tensor sVtw =
        local_tile(sVt(_, _, stage), Shape<Int<Tr::kColsPerWarp>, Int<N>>{}, make_coord(warp, 0));
    gemm_sliced<N / 16>(mma, acc_o, rP, rVt, tOsP, smem_copy_vt.get_slice(lane).partition_S(sVtw),
                        smem_copy_a, smem_copy_vt, lane);
  }

  // ---- epilogue: each row's total (the sink joins split 0's once), then the stores
  cp_async_wait<0>();
  __syncthreads();  // the last tile's products are done; row_max / row_sum are final
  for (int r = tid; r < m; r += kThreads) {
    const int64_t rg = r0 + r, h = hk * G + rg % G, i = rg / G;
    SoftmaxState<float> total;
    total.max = row_max[r];
    total.sum = row_sum[r];
    float scale = 1.f;
    if (split == 0 && p.sinks != nullptr) {
      float other;
      total.merge(initial_state<float>(p, h, log2e), &scale, &other);
    }
    if (splits == 1) {
      row_factor[r] = scale * total.inv_sum();
      p.lse[(b * p.heads + h) * Sq + i] = total.lse();
    } else {
      const int64_t slot = (bk * rows_all + rg) * splits + split;
      row_factor[r] = scale;
      static_cast<float*>(ws.stats)[2 * slot] = total.max;
      static_cast<float*>(ws.stats)[2 * slot + 1] = total.sum;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < size(acc_o); ++i) {
    const int r = get<0>(co(i));
    if (r >= m) continue;
    const int f = warp * Tr::kColsPerWarp + get<1>(co(i));
    const int64_t rg = r0 + r, h = hk * G + rg % G, q_i = rg / G;
    const float value = acc_o(i) * row_factor[r];
    if (splits == 1) {
      T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
               q_i * p.o_row_stride;
      out[f] = ::attn_ext::cuda::Elem<T>::store(value);
    } else {
      const int64_t slot = (bk * rows_all + rg) * splits + split;
      static_cast<float*>(ws.o)[slot * Dv + f] = value;
    }
  }
}

template <class Tr, class Rows>
cudaError_t run(const DecodeParams& p, DecodeWorkspace ws, cudaStream_t stream) {
  const int64_t rows = p.group() * p.seqlen_q;
  const dim3 grid(static_cast<unsigned>(p.batch * p.kv_heads * ceil_div(rows, Tr::kBlockM)),
                  static_cast<unsigned>(p.num_splits));
  const auto kernel = decode_mma_kernel<Tr, Rows>;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(Tr::kSmemBytes));
  if (e != cudaSuccess) return e;
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p, ws);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_split_merge<typename Tr::Scalar, Tr::kHeadDimV>(p, ws, stream);
}

template <class Tr>
cudaError_t run_rows(const DecodeParams& p, DecodeWorkspace ws, cudaStream_t stream) {
  return p.pages.paged() ? run<Tr, PagedRows>(p, ws, stream)
                         : run<Tr, ContiguousRows>(p, ws, stream);
}

// The rows-per-block instantiations of one shape: the host's decode_mma_rows_per_block picks,
// and the grid it sizes is the kernel's.
template <typename T, int kD, int kDv, bool kVInK>
cudaError_t run_shape(const DecodeParams& p, DecodeWorkspace ws, cudaStream_t stream) {
  constexpr int kSmall = kDecodeMmaSmallBlockM, kLarge = decode_mma_max_block_m(kDv);
  static_assert(kSmall == kDecodeMmaSmallRows &&
                    decode_mma_rows_per_block(kDecodeMmaSmallRows + 1, kDv) == kLarge,
                "the host's rows per block are the kernel's");
  const int64_t rows = decode_mma_rows_per_block(p.group() * p.seqlen_q, kDv);
  if (rows == kSmall) return run_rows<DecodeMmaTraits<T, kD, kDv, kVInK, kSmall>>(p, ws, stream);
  if constexpr (kLarge != kSmall) {
    if (rows == kLarge) return run_rows<DecodeMmaTraits<T, kD, kDv, kVInK, kLarge>>(p, ws, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_decode_mma(const DecodeParams& p, ElemKind kind, bool values_in_keys,
                              DecodeWorkspace ws, cudaStream_t stream) {
  if (p.batch * p.kv_heads * p.group() * p.seqlen_q == 0) return cudaSuccess;
  return dispatch_elem(kind, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      return cudaErrorInvalidValue;  // 16-bit MMAs only (decode_mma_unsupported)
    } else {
      if (values_in_keys) {
        if (p.head_dim == kDecodeMmaLatentDim && p.head_dim_v == kDecodeMmaLatentDimV)
          return run_shape<T, kDecodeMmaLatentDim, kDecodeMmaLatentDimV, true>(p, ws, stream);
        return cudaErrorInvalidValue;
      }
      if (p.head_dim != p.head_dim_v) return cudaErrorInvalidValue;
      switch (p.head_dim) {
        case 64:
          return run_shape<T, 64, 64, false>(p, ws, stream);
        case 128:
          return run_shape<T, 128, 128, false>(p, ws, stream);
        case 256:
          return run_shape<T, 256, 256, false>(p, ws, stream);
        default:
          return cudaErrorInvalidValue;
      }
    }
  });
}

}  // namespace attn_ext::cuda
