#pragma once
// Device building blocks of the CUDA linear-attention kernels (linear_attention_fwd.cu,
// linear_attention_bwd.cu): chunk loads with the feature map, shared-tile products on the
// traits' MMA, accumulators and their coordinates, the state's load and store.
#include <cstdint>
#include <cute/tensor.hpp>
#include "attention/cuda/flash/cute_utils.cuh"
#include "common/cuda/elem.cuh"
#include "linear/cuda/linear_launch.h"
#include "linear/cuda/linear_traits.cuh"

namespace attn_ext::cuda {

using linear::LinearAttentionParams;

namespace linear_blocks {

using namespace cute;
using cute_util::gemm_ss;
using linear::FeatureMap;

// The same bytes seen through a layout without its swizzle, for sizing register fragments.
template <class T>
__device__ __forceinline__ auto plain(T const& t) {
  return make_tensor(t.data(), get_nonswizzle_portion(t.layout()));
}

// (cols, rows) view of a (rows, cols) shared tile: an operand read transposed.
template <int kRows, int kCols, class T>
__device__ __forceinline__ auto transposed(T const& t) {
  return make_tensor(t.data(), composition(t.layout(), make_layout(Shape<Int<kCols>, Int<kRows>>{},
                                                                   GenRowMajor{})));
}

// acc += A B^T for shared tiles A (M x K) and B (N x K), read into registers with the copy atoms
// AtomA / AtomB (ldmatrix, transposing where the tile is a transposed view); the FMA atoms of
// the fp32 traits (kRolledK) read one k column of each at a time.
template <class Tr, class AtomA, class AtomB, class Acc, class SA, class SB>
__device__ __forceinline__ void mma_ss(Acc& acc, SA const& sA, SB const& sB) {
  typename Tr::TiledMma mma;
  auto thr = mma.get_thread_slice(threadIdx.x);
  if constexpr (Tr::kRolledK) {       // FMA atoms: one k per step (see the fp32 traits)
    Tensor tA = thr.partition_A(sA);  // (MMA, MMA_M, K)
    Tensor tB = thr.partition_B(sB);  // (MMA, MMA_N, K)
    Tensor rA = make_fragment_like(tA(_, _, 0));
    Tensor rB = make_fragment_like(tB(_, _, 0));
#pragma unroll Tr::kKUnroll
    for (int k = 0; k < size<2>(tA); ++k) {
      copy(tA(_, _, k), rA);
      copy(tB(_, _, k), rB);
      gemm(mma, rA, rB, acc);
    }
  } else {
    Tensor rA = thr.partition_fragment_A(plain(sA));
    Tensor rB = thr.partition_fragment_B(plain(sB));
    auto cpA = make_tiled_copy_A(AtomA{}, mma);
    auto cpB = make_tiled_copy_B(AtomB{}, mma);
    gemm_ss(mma, acc, rA, rB, cpA.get_thread_slice(threadIdx.x).partition_S(sA),
            cpB.get_thread_slice(threadIdx.x).partition_S(sB), cpA, cpB);
  }
}

// An fp32 accumulator of an (M x N) product and, per element, its (row, col) in the tile.
template <class Tr, int kM, int kN>
__device__ __forceinline__ auto accumulator() {
  typename Tr::TiledMma mma;
  return partition_fragment_C(mma, Shape<Int<kM>, Int<kN>>{});
}
template <class Tr, int kM, int kN>
__device__ __forceinline__ auto coordinates() {
  typename Tr::TiledMma mma;
  return mma.get_thread_slice(threadIdx.x)
      .partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
}
// The accumulator's elements in shared tile s (same shape), rounded to the element type.
template <class Tr, class Acc, class S>
__device__ __forceinline__ void store_accumulator(Acc const& acc, S& s) {
  using Elem = typename Tr::Elem;
  typename Tr::TiledMma mma;
  Tensor ts = mma.get_thread_slice(threadIdx.x).partition_C(s);
#pragma unroll
  for (int e = 0; e < size(acc); ++e) ts(e) = static_cast<Elem>(acc(e));
}

// Rows [0, rows) of a (kChunk x kCols) global tile into shared tile s through registers, phi
// applied when `features` (q and k rows); rows past `rows` become zeros.
template <class Tr, int kCols, class S>
__device__ __forceinline__ void load_chunk(const typename Tr::Elem* ptr, int64_t row_stride,
                                           int64_t rows, bool features, FeatureMap f, S& s) {
  using Elem = typename Tr::Elem;
  using Tile = Shape<Int<Tr::kChunk>, Int<kCols>>;
  Tensor g = make_tensor(make_gmem_ptr(ptr), Tile{}, make_stride(row_stride, _1{}));
  typename Tr::GmemCopy copy_op;
  auto thr = copy_op.get_thread_slice(threadIdx.x);
  Tensor tg = thr.partition_S(g);  // (CPY, CPY_M, CPY_N)
  Tensor ts = thr.partition_D(s);
  Tensor tc = thr.partition_S(make_identity_tensor(Tile{}));
  Tensor tr = make_fragment_like(ts);
#pragma unroll
  for (int m = 0; m < size<1>(tr); ++m) {
    const bool valid = get<0>(tc(0, m, 0)) < rows;
    if (valid) copy(copy_op, tg(_, m, _), tr(_, m, _));
#pragma unroll
    for (int v = 0; v < size<0>(tr); ++v) {
#pragma unroll
      for (int n = 0; n < size<2>(tr); ++n) {
        Elem& x = tr(v, m, n);
        if (!valid) {
          x = Elem(0.f);
        } else if (features) {
          x = static_cast<Elem>(linear::feature(f, static_cast<float>(x)));
        }
      }
    }
  }
  copy(tr, ts);
}

// The block's shared memory carved into its tiles (LinearSmem's order).
template <class Tr>
struct Tiles {
  using L = LinearSmem<Tr>;
  using Elem = typename Tr::Elem;
  Elem* base;
  __device__ explicit Tiles(unsigned char* raw) : base(reinterpret_cast<Elem*>(raw)) {}
  __device__ auto q() const { return make_tensor(make_smem_ptr(base), typename L::SmemQK{}); }
  __device__ auto k() const {
    return make_tensor(make_smem_ptr(base + L::kQK), typename L::SmemQK{});
  }
  __device__ auto v() const {
    return make_tensor(make_smem_ptr(base + 2 * L::kQK), typename L::SmemV{});
  }
  __device__ auto a() const {
    return make_tensor(make_smem_ptr(base + 2 * L::kQK + L::kV), typename L::SmemA{});
  }
  __device__ auto s() const {
    return make_tensor(make_smem_ptr(base + 2 * L::kQK + L::kV + L::kA), typename L::SmemS{});
  }
  __device__ float* z() const { return reinterpret_cast<float*>(base + L::kElems); }
  __device__ float* inv() const { return z() + Tr::kHeadDim; }
};

// Which (batch * head, value slice) a block of the grid's x dimension owns.
struct Slice {
  int64_t bh, b, h, col0;
  __device__ Slice(const LinearAttentionParams& p, int tiles, int tile_cols) {
    const int64_t x = blockIdx.x;
    bh = x / tiles;
    b = bh / p.heads;
    h = bh % p.heads;
    col0 = (x % tiles) * tile_cols;
  }
};

template <class Tr>
__device__ __forceinline__ const typename Tr::Elem* rows_ptr(const linear::Rows& t, const Slice& sl,
                                                             int64_t i0) {
  return static_cast<const typename Tr::Elem*>(t.data) + sl.b * t.batch_stride +
         sl.h * t.head_stride + i0 * t.row_stride;
}

// The state slice's accumulator from the initial state (zeros without one), and z.
template <class Tr, class Acc, class C>
__device__ __forceinline__ void init_state(const LinearAttentionParams& p, const Slice& sl,
                                           Acc& acc_s, C const& cs, float* z) {
  const auto* kv = static_cast<const float*>(p.initial_kv);
  const auto* k = static_cast<const float*>(p.initial_k);
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
#pragma unroll
  for (int e = 0; e < size(acc_s); ++e) {
    acc_s(e) = kv == nullptr ? 0.f : kv[(sl.bh * D + get<0>(cs(e))) * Dv + sl.col0 + get<1>(cs(e))];
  }
  if (threadIdx.x < Tr::kHeadDim) z[threadIdx.x] = k == nullptr ? 0.f : k[sl.bh * D + threadIdx.x];
}

// The final state: this slice's columns of kv, and k from the first slice.
template <class Tr, class Acc, class C>
__device__ __forceinline__ void write_state(const LinearAttentionParams& p, const LinearOutputs& o,
                                            const Slice& sl, Acc const& acc_s, C const& cs,
                                            const float* z) {
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
#pragma unroll
  for (int e = 0; e < size(acc_s); ++e)
    o.state_kv[(sl.bh * D + get<0>(cs(e))) * Dv + sl.col0 + get<1>(cs(e))] = acc_s(e);
  if (sl.col0 == 0 && threadIdx.x < Tr::kHeadDim)
    o.state_k[sl.bh * D + threadIdx.x] = z[threadIdx.x];
}

// z += the column sums of the chunk's phi(K) (rows past the sequence are zeros), each row
// weighted by weight[r] when given; kCols columns, one thread each. The chunk's rows go into
// kKeySumParts interleaved partial sums joined pairwise: a sum of 64 rows in one fp32 chain
// erred by up to ~2x the plain reference's (host emulation of the kernel against torch's
// reduction, 2026-11-27), which the error rule of the state_k checks does not allow.
constexpr int kKeySumParts = 4;
template <class Tr, int kCols = Tr::kHeadDim, class SK>
__device__ __forceinline__ void add_key_sums(SK const& sK, float* z,
                                             const float* weight = nullptr) {
  static_assert(kCols <= Tr::kThreads, "one thread per column");
  static_assert(Tr::kChunk % kKeySumParts == 0 && kKeySumParts == 4, "whole groups of 4 rows");
  if (threadIdx.x >= kCols) return;
  float part[kKeySumParts] = {};
#pragma unroll 2
  for (int r = 0; r < Tr::kChunk; r += kKeySumParts) {
#pragma unroll
    for (int i = 0; i < kKeySumParts; ++i)
      part[i] +=
          static_cast<float>(sK(r + i, threadIdx.x)) * (weight == nullptr ? 1.f : weight[r + i]);
  }
  z[threadIdx.x] += (part[0] + part[1]) + (part[2] + part[3]);
}

// inv[r] = 1 / (den_r + eps), den_r = (causal) the row's masked scores' sum + phi(q_r) . z,
// kThreadsPerRow threads per row, their partial sums joined by shuffles.
template <class Tr, bool kWithScores, class SQ, class SA>
__device__ __forceinline__ void denominators(SQ const& sQ, SA const& sA, const float* z, float eps,
                                             float* inv) {
  constexpr int kParts = Tr::kThreadsPerRow;
  const int r = threadIdx.x / kParts, part = threadIdx.x % kParts;
  float den = 0.f;
  if constexpr (kWithScores) {
#pragma unroll 8
    for (int j = part; j < Tr::kChunk; j += kParts) den += static_cast<float>(sA(r, j));
  }
#pragma unroll 8
  for (int d = part; d < Tr::kHeadDim; d += kParts) den += static_cast<float>(sQ(r, d)) * z[d];
#pragma unroll
  for (int o = kParts / 2; o > 0; o /= 2) den += __shfl_xor_sync(0xffffffffu, den, o);
  if (part == 0) inv[r] = linear::normalizer_inv(den, eps);
}

// out rows [i0, i0 + rows) of this slice: num / (den + eps).
template <class Tr, class Acc, class C>
__device__ __forceinline__ void store_out(const LinearAttentionParams& p, const LinearOutputs& o,
                                          const Slice& sl, int64_t i0, int64_t rows,
                                          Acc const& acc_o, C const& co, const float* inv) {
  using Elem = typename Tr::Elem;
  Elem* out = static_cast<Elem*>(o.out) + (sl.bh * p.seqlen_q + i0) * p.head_dim_v + sl.col0;
#pragma unroll
  for (int e = 0; e < size(acc_o); ++e) {
    const int r = get<0>(co(e));
    if (r < rows) out[r * p.head_dim_v + get<1>(co(e))] = static_cast<Elem>(acc_o(e) * inv[r]);
  }
}

// The rows' 1 / (den + eps) for the backward, from the first value slice, when asked for.
template <class Tr>
__device__ __forceinline__ void store_inv(const LinearAttentionParams& p, const LinearOutputs& o,
                                          const Slice& sl, int64_t i0, int64_t rows,
                                          const float* inv) {
  if (o.inv != nullptr && sl.col0 == 0 && threadIdx.x < rows)
    o.inv[sl.bh * p.seqlen_q + i0 + threadIdx.x] = inv[threadIdx.x];
}

}  // namespace linear_blocks

// The head dims D with instantiated kernels (Dv: any multiple of the 64-column slice).
constexpr int kLinearHeadDims[] = {64, 128};

// Runs fn with a LinearFwdTraits<T, D>* tag for the head dim d, or fails for another.
template <typename T, typename Fn>
cudaError_t with_linear_head_dim(int64_t d, Fn&& fn) {
  if (d == kLinearHeadDims[0])
    return fn(static_cast<LinearFwdTraits<T, kLinearHeadDims[0]>*>(nullptr));
  if (d == kLinearHeadDims[1])
    return fn(static_cast<LinearFwdTraits<T, kLinearHeadDims[1]>*>(nullptr));
  return cudaErrorInvalidValue;
}

}  // namespace attn_ext::cuda
