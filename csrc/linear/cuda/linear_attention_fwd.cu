// CUDA linear-attention forward: the CPU kernel's chunked algorithm (linear/cpu/
// linear_attention_cpu.cpp) in three kernels over chunks of C = 64 rows, each thread block owning
// one (batch, head, 64-column slice of v) and the matching D x 64 slice of the state S.
//
//   causal      one block walks the chunks in order, carrying S (fp32, in the MMA accumulator
//               registers) and the key sum z (fp32, shared) from chunk to chunk; per chunk:
//                 phi(Q), phi(K), V to shared memory (the feature map applied on the way);
//                 A = phi(Q) phi(K)^T, masked to keys j <= i, to shared memory;
//                 num = phi(Q) S + A V,  den = rowsum(A) + phi(Q) . z  (the state before the
//                 chunk), out = num / (den + eps);
//                 S += phi(K)^T V, z += colsum(phi(K)).
//   non-causal  two GEMM-shaped passes: the state pass (one block per slice, all key chunks)
//               accumulates S = S0 + phi(K)^T V and z = z0 + colsum(phi(K)) and writes the final
//               state; the output pass (one block per slice and 256 query rows) reads it back
//               and writes phi(Q) S / (phi(Q) . z + eps).
// The products run on tensor cores for bf16 / fp16 (m16n8k16, fp32 accumulation; the scores A
// and the state S enter the next product rounded to the input type, as in the reference at the
// same dtype) and on FMA atoms for fp32. z and the denominators are fp32 scalar work. Rows past
// the sequence load as zero features (phi of a zero row would not be zero for elu+1) and store
// nothing; the chunk boundaries depend only on the shapes, so results are deterministic.
#include <cstdint>
#include <type_traits>
#include "linear/cuda/linear_launch.h"

// Compiled only where setup.py found the CUTLASS headers (ATTN_EXT_CUDA_CUTE=1); elsewhere
// linear_attention_kernels_built() is false and the wrapper runs the composite.
#ifndef ATTN_EXT_CUDA_CUTE
#define ATTN_EXT_CUDA_CUTE 0
#endif

#if ATTN_EXT_CUDA_CUTE
#include <cute/tensor.hpp>
#include "attention/cuda/flash/cute_utils.cuh"
#include "common/cuda/elem.cuh"
#include "linear/cuda/linear_traits.cuh"
#endif

namespace attn_ext::cuda {

#if ATTN_EXT_CUDA_CUTE
using linear::LinearAttentionParams;

namespace linear_fwd {

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
// AtomA / AtomB (ldmatrix, transposing where the tile is a transposed view).
template <class Tr, class AtomA, class AtomB, class Acc, class SA, class SB>
__device__ __forceinline__ void mma_ss(Acc& acc, SA const& sA, SB const& sB) {
  typename Tr::TiledMma mma;
  auto thr = mma.get_thread_slice(threadIdx.x);
  Tensor rA = thr.partition_fragment_A(plain(sA));
  Tensor rB = thr.partition_fragment_B(plain(sB));
  auto cpA = make_tiled_copy_A(AtomA{}, mma);
  auto cpB = make_tiled_copy_B(AtomB{}, mma);
  gemm_ss(mma, acc, rA, rB, cpA.get_thread_slice(threadIdx.x).partition_S(sA),
          cpB.get_thread_slice(threadIdx.x).partition_S(sB), cpA, cpB);
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

// z += the column sums of the chunk's phi(K) (rows past the sequence are zeros).
template <class Tr, class SK>
__device__ __forceinline__ void add_key_sums(SK const& sK, float* z) {
  if (threadIdx.x >= Tr::kHeadDim) return;
  float sum = 0.f;
#pragma unroll 8
  for (int r = 0; r < Tr::kChunk; ++r) sum += static_cast<float>(sK(r, threadIdx.x));
  z[threadIdx.x] += sum;
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

}  // namespace linear_fwd

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads)
    linear_causal_fwd_kernel(LinearAttentionParams p, LinearOutputs o) {
  using namespace linear_fwd;
  using Normal = typename Tr::SmemCopyAtom;
  using Trans = typename Tr::SmemCopyAtomTransposed;
  constexpr int C = Tr::kChunk, D = Tr::kHeadDim, T = Tr::kValueTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const Tiles<Tr> tiles(smem_raw);
  Tensor sQ = tiles.q();
  Tensor sK = tiles.k();
  Tensor sV = tiles.v();
  Tensor sA = tiles.a();
  Tensor sS = tiles.s();
  Tensor sKt = transposed<C, D>(sK);  // (D, C): phi(K)^T as the A operand of S += phi(K)^T V
  Tensor sVt = transposed<C, T>(sV);  // (T, C): V as a B operand
  Tensor sSt = transposed<D, T>(sS);  // (T, D): S as a B operand
  float* z = tiles.z();
  float* inv = tiles.inv();
  const Slice sl(p, static_cast<int>(p.head_dim_v / T), T);
  const float eps = static_cast<float>(p.eps);

  Tensor acc_s = accumulator<Tr, D, T>();
  Tensor cs = coordinates<Tr, D, T>();
  Tensor ca = coordinates<Tr, C, C>();
  Tensor co = coordinates<Tr, C, T>();
  init_state<Tr>(p, sl, acc_s, cs, z);
  store_accumulator<Tr>(acc_s, sS);

  for (int64_t i0 = 0; i0 < p.seqlen_q; i0 += C) {
    const int64_t rows = p.seqlen_q - i0 < C ? p.seqlen_q - i0 : C;
    __syncthreads();  // the previous chunk is done with every tile; S and z of it are visible
    load_chunk<Tr, D>(rows_ptr<Tr>(p.q, sl, i0), p.q.row_stride, rows, true, p.feature_map, sQ);
    load_chunk<Tr, D>(rows_ptr<Tr>(p.k, sl, i0), p.k.row_stride, rows, true, p.feature_map, sK);
    load_chunk<Tr, T>(rows_ptr<Tr>(p.v, sl, i0) + sl.col0, p.v.row_stride, rows, false,
                      p.feature_map, sV);
    __syncthreads();

    Tensor acc_a = accumulator<Tr, C, C>();
    clear(acc_a);
    mma_ss<Tr, Normal, Normal>(acc_a, sQ, sK);
#pragma unroll
    for (int e = 0; e < size(acc_a); ++e) {
      if (get<1>(ca(e)) > get<0>(ca(e))) acc_a(e) = 0.f;  // key j > query i: not yet seen
    }
    store_accumulator<Tr>(acc_a, sA);
    Tensor acc_o = accumulator<Tr, C, T>();
    clear(acc_o);
    mma_ss<Tr, Normal, Trans>(acc_o, sQ, sSt);  // the keys of earlier chunks
    __syncthreads();                            // A is complete
    mma_ss<Tr, Normal, Trans>(acc_o, sA, sVt);  // the chunk's own keys
    denominators<Tr, true>(sQ, sA, z, eps, inv);
    mma_ss<Tr, Trans, Trans>(acc_s, sKt, sVt);
    __syncthreads();  // every warp is done reading S and z of the previous chunks
    store_accumulator<Tr>(acc_s, sS);
    add_key_sums<Tr>(sK, z);
    __syncthreads();  // inv is complete
    store_out<Tr>(p, o, sl, i0, rows, acc_o, co, inv);
  }
  write_state<Tr>(p, o, sl, acc_s, cs, z);
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads)
    linear_state_fwd_kernel(LinearAttentionParams p, LinearOutputs o) {
  using namespace linear_fwd;
  using Trans = typename Tr::SmemCopyAtomTransposed;
  constexpr int C = Tr::kChunk, D = Tr::kHeadDim, T = Tr::kValueTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const Tiles<Tr> tiles(smem_raw);
  Tensor sK = tiles.k();
  Tensor sV = tiles.v();
  Tensor sKt = transposed<C, D>(sK);
  Tensor sVt = transposed<C, T>(sV);
  float* z = tiles.z();
  const Slice sl(p, static_cast<int>(p.head_dim_v / T), T);

  Tensor acc_s = accumulator<Tr, D, T>();
  Tensor cs = coordinates<Tr, D, T>();
  init_state<Tr>(p, sl, acc_s, cs, z);
  for (int64_t j0 = 0; j0 < p.seqlen_k; j0 += C) {
    const int64_t rows = p.seqlen_k - j0 < C ? p.seqlen_k - j0 : C;
    __syncthreads();  // every warp is done with the previous chunk's tiles
    load_chunk<Tr, D>(rows_ptr<Tr>(p.k, sl, j0), p.k.row_stride, rows, true, p.feature_map, sK);
    load_chunk<Tr, T>(rows_ptr<Tr>(p.v, sl, j0) + sl.col0, p.v.row_stride, rows, false,
                      p.feature_map, sV);
    __syncthreads();
    mma_ss<Tr, Trans, Trans>(acc_s, sKt, sVt);
    add_key_sums<Tr>(sK, z);
  }
  write_state<Tr>(p, o, sl, acc_s, cs, z);
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads)
    linear_output_fwd_kernel(LinearAttentionParams p, LinearOutputs o) {
  using namespace linear_fwd;
  using Elem = typename Tr::Elem;
  using Normal = typename Tr::SmemCopyAtom;
  using Trans = typename Tr::SmemCopyAtomTransposed;
  constexpr int C = Tr::kChunk, D = Tr::kHeadDim, T = Tr::kValueTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const Tiles<Tr> tiles(smem_raw);
  Tensor sQ = tiles.q();
  Tensor sS = tiles.s();
  Tensor sSt = transposed<D, T>(sS);
  float* z = tiles.z();
  float* inv = tiles.inv();
  const Slice sl(p, static_cast<int>(p.head_dim_v / T), T);
  const float eps = static_cast<float>(p.eps);

  // the final state (the state pass's output) as the B operand, z beside it
  const int64_t Dv = p.head_dim_v;
  const float* kv = o.state_kv + sl.bh * D * Dv + sl.col0;
  for (int e = threadIdx.x; e < D * T; e += Tr::kThreads)
    sS(e / T, e % T) = Elem(kv[(e / T) * Dv + e % T]);
  if (threadIdx.x < D) z[threadIdx.x] = o.state_k[sl.bh * D + threadIdx.x];

  Tensor co = coordinates<Tr, C, T>();
  const int64_t first = int64_t(blockIdx.y) * Tr::kRowsPerOutputBlock;
  const int64_t last =
      first + Tr::kRowsPerOutputBlock < p.seqlen_q ? first + Tr::kRowsPerOutputBlock : p.seqlen_q;
  for (int64_t i0 = first; i0 < last; i0 += C) {
    const int64_t rows = last - i0 < C ? last - i0 : C;
    __syncthreads();  // S and z are visible; every warp is done with the previous chunk
    load_chunk<Tr, D>(rows_ptr<Tr>(p.q, sl, i0), p.q.row_stride, rows, true, p.feature_map, sQ);
    __syncthreads();
    Tensor acc_o = accumulator<Tr, C, T>();
    clear(acc_o);
    mma_ss<Tr, Normal, Trans>(acc_o, sQ, sSt);
    denominators<Tr, false>(sQ, sQ, z, eps, inv);
    __syncthreads();  // inv is complete
    store_out<Tr>(p, o, sl, i0, rows, acc_o, co, inv);
  }
}

namespace {

template <auto* Kernel, class Tr>
cudaError_t launch(dim3 grid, const LinearAttentionParams& p, const LinearOutputs& o,
                   cudaStream_t stream) {
  constexpr size_t kBytes = LinearSmem<Tr>::kBytes;
  const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(kBytes));
  if (e != cudaSuccess) return e;
  Kernel<<<grid, Tr::kThreads, kBytes, stream>>>(p, o);
  return cudaGetLastError();
}

template <class Tr>
cudaError_t run_fwd(const LinearAttentionParams& p, const LinearOutputs& o, cudaStream_t stream) {
  const int64_t slices = p.batch * p.heads * (p.head_dim_v / Tr::kValueTile);
  if (slices == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(slices));
  if (p.causal) return launch<&linear_causal_fwd_kernel<Tr>, Tr>(grid, p, o, stream);
  cudaError_t e = launch<&linear_state_fwd_kernel<Tr>, Tr>(grid, p, o, stream);
  const int64_t row_blocks = ceil_div(p.seqlen_q, Tr::kRowsPerOutputBlock);
  if (e != cudaSuccess || row_blocks == 0) return e;
  return launch<&linear_output_fwd_kernel<Tr>, Tr>(dim3(grid.x, static_cast<unsigned>(row_blocks)),
                                                   p, o, stream);
}

// The head dims with instantiated kernels (Dv: any multiple of the 64-column slice).
constexpr int kHeadDims[] = {64, 128};
// gridDim.y's limit, the non-causal output pass's row blocks.
constexpr int64_t kMaxGridY = 65535;
// gridDim.x's limit, the (batch, head, value slice) blocks.
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1;

template <typename T, typename Fn>
cudaError_t with_head_dim(int64_t d, Fn&& fn) {
  if (d == kHeadDims[0]) return fn(static_cast<LinearFwdTraits<T, kHeadDims[0]>*>(nullptr));
  if (d == kHeadDims[1]) return fn(static_cast<LinearFwdTraits<T, kHeadDims[1]>*>(nullptr));
  return cudaErrorInvalidValue;
}

// bytes of one element, and whether the element kind has kernels
int elem_bytes(ElemKind kind) {
  switch (kind) {
    case ElemKind::kBFloat16:
    case ElemKind::kFloat16:
      return 2;
    case ElemKind::kFloat32:
      return 4;
    case ElemKind::kFloat64:  // stays on the composite
      return 0;
  }
  return 0;
}

}  // namespace

bool linear_attention_kernels_built() {
  return true;
}

bool linear_attention_fwd_supported(const LinearAttentionParams& p, ElemKind kind) {
  constexpr int64_t kVecBytes = 16;  // the global loads move 16-byte vectors
  constexpr int64_t kValueTile = LinearTileShape<kHeadDims[0]>::kValueTile;
  constexpr int64_t kRowsPerBlock = LinearTileShape<kHeadDims[0]>::kRowsPerOutputBlock;
  const int bytes = elem_bytes(kind);
  if (bytes == 0) return false;
  if (p.head_dim != kHeadDims[0] && p.head_dim != kHeadDims[1]) return false;
  if (p.head_dim_v <= 0 || p.head_dim_v % kValueTile != 0) return false;
  for (const linear::Rows* t : {&p.q, &p.k, &p.v}) {
    if (reinterpret_cast<uintptr_t>(t->data) % kVecBytes != 0) return false;
    for (const int64_t s : {t->batch_stride, t->head_stride, t->row_stride})
      if ((s * bytes) % kVecBytes != 0) return false;
  }
  return p.batch * p.heads * (p.head_dim_v / kValueTile) <= kMaxGridX &&
         ceil_div(p.seqlen_q, kRowsPerBlock) <= kMaxGridY;
}

cudaError_t launch_linear_attention_fwd(const LinearAttentionParams& p, const LinearOutputs& o,
                                        ElemKind kind, cudaStream_t stream) {
  if (!linear_attention_fwd_supported(p, kind)) return cudaErrorInvalidValue;
  return dispatch_elem(kind, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (std::is_same_v<T, double>) {
      return cudaErrorInvalidValue;  // unreachable: linear_attention_fwd_supported said no
    } else {
      return with_head_dim<T>(p.head_dim, [&](auto* tr) {
        return run_fwd<std::remove_pointer_t<decltype(tr)>>(p, o, stream);
      });
    }
  });
}

#else  // no CUTLASS headers: no kernels, the wrapper keeps the composite

bool linear_attention_kernels_built() {
  return false;
}
bool linear_attention_fwd_supported(const linear::LinearAttentionParams&, ElemKind) {
  return false;
}
cudaError_t launch_linear_attention_fwd(const linear::LinearAttentionParams&, const LinearOutputs&,
                                        ElemKind, cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace attn_ext::cuda
