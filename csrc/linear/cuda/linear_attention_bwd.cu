// CUDA linear-attention backward, causal: the CPU kernel's gradients (linear/cpu/
// linear_attention_cpu.cpp) over the same 64-row chunks, from a recomputed forward (out and each
// row's inv = 1 / (den + eps), launch_linear_attention_fwd with LinearOutputs::inv).
//
// With gn_i = g_i inv_i and gz_i = -(g_i . out_i) inv_i (the numerator's and the denominator's
// gradients, v' = [v, 1] as in the forward), the chunk's dA_ij = gn_i . v_j + gz_i (j <= i) and
// its scores A_ij = phi(q_i) . phi(k_j) (j <= i):
//   dphi(q_i) = sum_{j<=i} dA_ij phi(k_j) + gn_i S_prev^T + gz_i z_prev      (S, z before chunk)
//   dphi(k_j) = sum_{i>=j} dA_ij phi(q_i) + v_j dS_next^T + dz_next          (grads after chunk)
//   dv_j      = sum_{i>=j} A_ij gn_i + phi(k_j) dS_next
// where dS = grad_final_kv + sum_i phi(q_i) gn_i^T and dz = grad_final_k + sum_i phi(q_i) gz_i
// over the rows after the chunk; over all rows they are the initial state's gradients.
//
//   prep  one warp per row: gn (element type) and gz (fp32);
//   dq    one block per (b, h, 64 feature columns), chunks in order, the 64 x Dv slice of S in
//         fp32 accumulators (rounded to the element type in shared memory for gn S^T);
//   dk    the same blocks, chunks in reverse order, carrying dS and dz; writes the initial
//         state's gradient;
//   dv    one block per (b, h, 64 value columns), chunks in reverse order, carrying the D x 64
//         slice of dS: the forward's causal kernel with the roles of q and k exchanged, the
//         mask transposed and no normalization.
// Then dq and dk are multiplied by phi'(x) of their own rows, from phi(x) (feature_map.h).
#include <cstdint>
#include <type_traits>
#include "linear/cuda/linear_launch.h"

#ifndef ATTN_EXT_CUDA_CUTE
#define ATTN_EXT_CUDA_CUTE 0
#endif

#if ATTN_EXT_CUDA_CUTE
#include "linear/cuda/linear_blocks.cuh"
#endif

namespace attn_ext::cuda {

#if ATTN_EXT_CUDA_CUTE
namespace linear_bwd {

using namespace cute;
using namespace linear_blocks;

// The prep pass: one warp per row, 8 rows per block.
constexpr int kWarp = 32;
constexpr int kPrepWarps = 8;
constexpr int kPrepThreads = kPrepWarps * kWarp;

// Shared memory of a dq / dk block: X = phi(K) or phi(Q) in its 64 feature columns (C x W), V and
// gn (C x Dv), dA (C x C), the state slice (W x Dv) in the element type; gz of the chunk's rows
// (C) and the fp32 key-sum slice z or dz (W).
template <class Tr, int kDv>
struct BwdSmem {
  static constexpr int kW = Tr::kValueTile;
  using SmemX = typename Tr::template Smem<Tr::kChunk, kW>;
  using SmemV = typename Tr::template Smem<Tr::kChunk, kDv>;
  using SmemA = typename Tr::template Smem<Tr::kChunk, Tr::kChunk>;
  using SmemS = typename Tr::template Smem<kW, kDv>;
  static constexpr size_t kX = cute::cosize_v<SmemX>;
  static constexpr size_t kV = cute::cosize_v<SmemV>;
  static constexpr size_t kA = cute::cosize_v<SmemA>;
  static constexpr size_t kS = cute::cosize_v<SmemS>;
  static constexpr size_t kElems = kX + 2 * kV + kA + kS;
  static constexpr size_t kBytes =
      kElems * sizeof(typename Tr::Elem) + (Tr::kChunk + kW) * sizeof(float);
  static_assert(kBytes <= 163 * 1024, "fits the shared memory of sm_80 and sm_90");
  static_assert((kElems * sizeof(typename Tr::Elem)) % 16 == 0, "the fp32 arrays stay aligned");
};

}  // namespace linear_bwd

template <typename Elem>
__global__ void __launch_bounds__(linear_bwd::kPrepThreads)
    linear_prep_bwd_kernel(LinearAttentionParams p, LinearBwdBuffers bb) {
  using namespace linear_bwd;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * kPrepWarps + threadIdx.x / kWarp;
  if (row >= p.batch * p.heads * p.seqlen_q) return;
  const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q;
  const int64_t Dv = p.head_dim_v;
  const Elem* g = static_cast<const Elem*>(bb.grad_out.data) +
                  (bh / p.heads) * bb.grad_out.batch_stride +
                  (bh % p.heads) * bb.grad_out.head_stride + i * bb.grad_out.row_stride;
  const Elem* out = static_cast<const Elem*>(bb.out) + row * Dv;
  Elem* gn = static_cast<Elem*>(bb.gn) + row * Dv;
  const float inv = bb.inv[row];
  float dot = 0.f;
  for (int64_t c = lane; c < Dv; c += kWarp) {
    const float gc = static_cast<float>(g[c]);
    dot += gc * static_cast<float>(out[c]);
    gn[c] = static_cast<Elem>(gc * inv);
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  // -(g . n) inv^2 with n = out / inv (linear::denominator_grad)
  if (lane == 0) bb.gz[row] = -dot * inv;
}

// dq (kDk false) or dk (kDk true) of one (b, h, 64 feature columns).
template <class Tr, int kDv, bool kDk>
__global__ void __launch_bounds__(Tr::kThreads)
    linear_dqk_bwd_kernel(LinearAttentionParams p, LinearBwdBuffers bb) {
  using namespace linear_blocks;
  using Elem = typename Tr::Elem;
  using L = linear_bwd::BwdSmem<Tr, kDv>;
  using Normal = typename Tr::SmemCopyAtom;
  using Trans = typename Tr::SmemCopyAtomTransposed;
  constexpr int C = Tr::kChunk, W = L::kW;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* base = reinterpret_cast<Elem*>(smem_raw);
  Tensor sX = make_tensor(make_smem_ptr(base), typename L::SmemX{});
  Tensor sV = make_tensor(make_smem_ptr(base + L::kX), typename L::SmemV{});
  Tensor sG = make_tensor(make_smem_ptr(base + L::kX + L::kV), typename L::SmemV{});
  Tensor sA = make_tensor(make_smem_ptr(base + L::kX + 2 * L::kV), typename L::SmemA{});
  Tensor sS = make_tensor(make_smem_ptr(base + L::kX + 2 * L::kV + L::kA), typename L::SmemS{});
  Tensor sXt = transposed<C, W>(sX);    // (W, C)
  Tensor sVt = transposed<C, kDv>(sV);  // (Dv, C)
  Tensor sGt = transposed<C, kDv>(sG);  // (Dv, C)
  Tensor sAt = transposed<C, C>(sA);    // dA^T
  float* gz = reinterpret_cast<float*>(base + L::kElems);
  float* zs = gz + C;  // z (dq) or dz (dk) of this block's feature columns

  const int64_t D = p.head_dim, S = p.seqlen_q;
  const Slice sl(p, static_cast<int>(D / W), W);  // col0: the first feature column
  // X: the other side's features (dq: phi(K), dk: phi(Q)); own: the rows whose gradient this
  // block forms (dq: q, dk: k), read again for phi'(x)
  const linear::Rows& feat = kDk ? p.q : p.k;
  const linear::Rows& own = kDk ? p.k : p.q;
  // the state slice starts from the initial state (dq) or the final state's gradient (dk)
  const auto* init_kv =
      static_cast<const float*>(kDk ? static_cast<const void*>(bb.grad_final_kv) : p.initial_kv);
  const auto* init_k =
      static_cast<const float*>(kDk ? static_cast<const void*>(bb.grad_final_k) : p.initial_k);

  Tensor acc_s = accumulator<Tr, W, kDv>();
  Tensor cs = coordinates<Tr, W, kDv>();
#pragma unroll
  for (int e = 0; e < size(acc_s); ++e) {
    acc_s(e) = init_kv == nullptr
                   ? 0.f
                   : init_kv[(sl.bh * D + sl.col0 + get<0>(cs(e))) * kDv + get<1>(cs(e))];
  }
  if (threadIdx.x < W)
    zs[threadIdx.x] = init_k == nullptr ? 0.f : init_k[sl.bh * D + sl.col0 + threadIdx.x];
  store_accumulator<Tr>(acc_s, sS);
  Tensor ca = coordinates<Tr, C, C>();
  Tensor co = coordinates<Tr, C, W>();
  Elem* grad = static_cast<Elem*>(kDk ? bb.dk : bb.dq);

  const int64_t chunks = ceil_div(S, C);
  for (int64_t n = 0; n < chunks; ++n) {
    const int64_t i0 = (kDk ? chunks - 1 - n : n) * C;
    const int64_t rows = S - i0 < C ? S - i0 : C;
    __syncthreads();  // the previous chunk is done with every tile; the state of it is visible
    load_chunk<Tr, W>(rows_ptr<Tr>(feat, sl, i0) + sl.col0, feat.row_stride, rows, true,
                      p.feature_map, sX);
    load_chunk<Tr, kDv>(rows_ptr<Tr>(p.v, sl, i0), p.v.row_stride, rows, false, p.feature_map, sV);
    load_chunk<Tr, kDv>(static_cast<const Elem*>(bb.gn) + (sl.bh * S + i0) * kDv, kDv, rows, false,
                        p.feature_map, sG);
    if (threadIdx.x < C)
      gz[threadIdx.x] = threadIdx.x < rows ? bb.gz[sl.bh * S + i0 + threadIdx.x] : 0.f;
    __syncthreads();

    // dA = gn V^T + gz (per row), keys j <= i
    Tensor acc_a = accumulator<Tr, C, C>();
    clear(acc_a);
    mma_ss<Tr, Normal, Normal>(acc_a, sG, sV);
#pragma unroll
    for (int e = 0; e < size(acc_a); ++e) {
      const int i = get<0>(ca(e));
      acc_a(e) = get<1>(ca(e)) <= i ? acc_a(e) + gz[i] : 0.f;
    }
    store_accumulator<Tr>(acc_a, sA);
    // the state's part: dq = gn S_prev^T, dk = v dS_next^T
    Tensor acc = accumulator<Tr, C, W>();
    clear(acc);
    if constexpr (kDk) {
      mma_ss<Tr, Normal, Normal>(acc, sV, sS);
    } else {
      mma_ss<Tr, Normal, Normal>(acc, sG, sS);
    }
    __syncthreads();  // dA is complete
    // the chunk's part: dq = dA phi(K), dk = dA^T phi(Q); then the state update
    if constexpr (kDk) {
      mma_ss<Tr, Trans, Trans>(acc, sAt, sXt);
      mma_ss<Tr, Trans, Trans>(acc_s, sXt, sGt);
    } else {
      mma_ss<Tr, Normal, Trans>(acc, sA, sXt);
      mma_ss<Tr, Trans, Trans>(acc_s, sXt, sVt);
    }
    // the key sum's part (dq: gz_i z_prev, dk: dz_next), then phi'(x) of the block's own rows
    // (from phi(x) in fp32, feature_map.h)
    const Elem* x = rows_ptr<Tr>(own, sl, i0) + sl.col0;
#pragma unroll
    for (int e = 0; e < size(acc); ++e) {
      const int r = get<0>(co(e)), d = get<1>(co(e));
      if (r < rows) {
        const float g = acc(e) + (kDk ? 1.f : gz[r]) * zs[d];
        const float phi =
            linear::feature(p.feature_map, static_cast<float>(x[r * own.row_stride + d]));
        grad[(sl.bh * S + i0 + r) * D + sl.col0 + d] =
            static_cast<Elem>(g * linear::feature_grad_from_value(p.feature_map, phi));
      }
    }
    __syncthreads();  // every warp is done reading the state slice and zs
    store_accumulator<Tr>(acc_s, sS);
    add_key_sums<Tr, W>(sX, zs, kDk ? gz : nullptr);
  }
  if constexpr (kDk) {
    // dS and dz over every row: the initial state's gradient
#pragma unroll
    for (int e = 0; e < size(acc_s); ++e)
      bb.grad_init_kv[(sl.bh * D + sl.col0 + get<0>(cs(e))) * kDv + get<1>(cs(e))] = acc_s(e);
    if (threadIdx.x < W) bb.grad_init_k[sl.bh * D + sl.col0 + threadIdx.x] = zs[threadIdx.x];
  }
}

// dv of one (b, h, 64 value columns): out'_j = phi(k_j) dS_next + sum_{i>=j} A_ij gn_i over the
// chunks in reverse order, in the forward causal kernel's tiles with the roles of q and k
// exchanged (the "query" tile holds phi(K), the "key" tile phi(Q), the value tile gn).
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads)
    linear_dv_bwd_kernel(LinearAttentionParams p, LinearBwdBuffers bb) {
  using namespace linear_blocks;
  using Elem = typename Tr::Elem;
  using Normal = typename Tr::SmemCopyAtom;
  using Trans = typename Tr::SmemCopyAtomTransposed;
  constexpr int C = Tr::kChunk, D = Tr::kHeadDim, T = Tr::kValueTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const Tiles<Tr> tiles(smem_raw);
  Tensor sK = tiles.q();  // phi(K): the rows whose gradient this pass forms
  Tensor sQ = tiles.k();  // phi(Q)
  Tensor sG = tiles.v();  // gn, this block's value columns
  Tensor sA = tiles.a();
  Tensor sS = tiles.s();  // dS_next, this block's value columns
  Tensor sQt = transposed<C, D>(sQ);
  Tensor sGt = transposed<C, T>(sG);
  Tensor sSt = transposed<D, T>(sS);
  const int64_t Dv = p.head_dim_v, S = p.seqlen_q;
  const Slice sl(p, static_cast<int>(Dv / T), T);

  Tensor acc_s = accumulator<Tr, D, T>();
  Tensor cs = coordinates<Tr, D, T>();
#pragma unroll
  for (int e = 0; e < size(acc_s); ++e) {
    acc_s(e) = bb.grad_final_kv == nullptr
                   ? 0.f
                   : bb.grad_final_kv[(sl.bh * D + get<0>(cs(e))) * Dv + sl.col0 + get<1>(cs(e))];
  }
  store_accumulator<Tr>(acc_s, sS);
  Tensor ca = coordinates<Tr, C, C>();
  Tensor co = coordinates<Tr, C, T>();
  Elem* dv = static_cast<Elem*>(bb.dv);

  const int64_t chunks = ceil_div(S, C);
  for (int64_t n = chunks - 1; n >= 0; --n) {
    const int64_t i0 = n * C;
    const int64_t rows = S - i0 < C ? S - i0 : C;
    __syncthreads();  // the previous chunk is done with every tile; dS of it is visible
    load_chunk<Tr, D>(rows_ptr<Tr>(p.k, sl, i0), p.k.row_stride, rows, true, p.feature_map, sK);
    load_chunk<Tr, D>(rows_ptr<Tr>(p.q, sl, i0), p.q.row_stride, rows, true, p.feature_map, sQ);
    load_chunk<Tr, T>(static_cast<const Elem*>(bb.gn) + (sl.bh * S + i0) * Dv + sl.col0, Dv, rows,
                      false, p.feature_map, sG);
    __syncthreads();

    // A^T: (key j, row i) = phi(k_j) . phi(q_i), rows i >= j
    Tensor acc_a = accumulator<Tr, C, C>();
    clear(acc_a);
    mma_ss<Tr, Normal, Normal>(acc_a, sK, sQ);
#pragma unroll
    for (int e = 0; e < size(acc_a); ++e) {
      if (get<1>(ca(e)) < get<0>(ca(e))) acc_a(e) = 0.f;  // row i < key j: does not see it
    }
    store_accumulator<Tr>(acc_a, sA);
    Tensor acc_o = accumulator<Tr, C, T>();
    clear(acc_o);
    mma_ss<Tr, Normal, Trans>(acc_o, sK, sSt);  // the rows of later chunks
    __syncthreads();                            // A^T is complete
    mma_ss<Tr, Normal, Trans>(acc_o, sA, sGt);  // the chunk's own rows
    mma_ss<Tr, Trans, Trans>(acc_s, sQt, sGt);
#pragma unroll
    for (int e = 0; e < size(acc_o); ++e) {
      const int r = get<0>(co(e));
      if (r < rows)
        dv[(sl.bh * S + i0 + r) * Dv + sl.col0 + get<1>(co(e))] = static_cast<Elem>(acc_o(e));
    }
    __syncthreads();  // every warp is done reading dS_next
    store_accumulator<Tr>(acc_s, sS);
  }
}

namespace {

template <auto* Kernel, size_t kBytes, int kThreads>
cudaError_t launch_bwd(unsigned blocks, const LinearAttentionParams& p, const LinearBwdBuffers& b,
                       cudaStream_t stream) {
  const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(kBytes));
  if (e != cudaSuccess) return e;
  Kernel<<<blocks, kThreads, kBytes, stream>>>(p, b);
  return cudaGetLastError();
}

template <class Tr, int kDv>
cudaError_t run_bwd(const LinearAttentionParams& p, const LinearBwdBuffers& b,
                    cudaStream_t stream) {
  using Elem = typename Tr::Elem;
  constexpr int W = Tr::kValueTile;
  const int64_t bh = p.batch * p.heads, rows = bh * p.seqlen_q;
  if (bh == 0) return cudaSuccess;
  using namespace linear_bwd;
  if (rows > 0) {  // with no rows the dk pass still writes the initial state's gradient
    const cudaError_t e = launch_bwd<&linear_prep_bwd_kernel<Elem>, 0, kPrepThreads>(
        static_cast<unsigned>(ceil_div(rows, kPrepWarps)), p, b, stream);
    if (e != cudaSuccess) return e;
  }
  constexpr size_t kQk = BwdSmem<Tr, kDv>::kBytes;
  const auto feature_blocks = static_cast<unsigned>(bh * (p.head_dim / W));
  cudaError_t e = launch_bwd<&linear_dqk_bwd_kernel<Tr, kDv, false>, kQk, Tr::kThreads>(
      feature_blocks, p, b, stream);
  if (e != cudaSuccess) return e;
  e = launch_bwd<&linear_dqk_bwd_kernel<Tr, kDv, true>, kQk, Tr::kThreads>(feature_blocks, p, b,
                                                                           stream);
  if (e != cudaSuccess) return e;
  return launch_bwd<&linear_dv_bwd_kernel<Tr>, LinearSmem<Tr>::kBytes, Tr::kThreads>(
      static_cast<unsigned>(bh * (p.head_dim_v / W)), p, b, stream);
}

// The value widths the dq / dk blocks are instantiated for (their state slice is 64 x Dv).
constexpr int kValueDims[] = {64, 128};

}  // namespace

bool linear_attention_bwd_supported(const LinearAttentionParams& p, ElemKind kind) {
  return p.causal && linear_attention_fwd_supported(p, kind) &&
         (p.head_dim_v == kValueDims[0] || p.head_dim_v == kValueDims[1]);
}

cudaError_t launch_linear_attention_bwd(const LinearAttentionParams& p, const LinearBwdBuffers& b,
                                        ElemKind kind, cudaStream_t stream) {
  if (!linear_attention_bwd_supported(p, kind)) return cudaErrorInvalidValue;
  return dispatch_elem(kind, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (std::is_same_v<T, double>) {
      return cudaErrorInvalidValue;  // linear_attention_bwd_supported said no
    } else {
      return with_linear_head_dim<T>(p.head_dim, [&](auto* tr) -> cudaError_t {
        using Tr = std::remove_pointer_t<decltype(tr)>;
        return p.head_dim_v == kValueDims[0] ? run_bwd<Tr, kValueDims[0]>(p, b, stream)
                                             : run_bwd<Tr, kValueDims[1]>(p, b, stream);
      });
    }
  });
}

#else  // no CUTLASS headers: no kernels (linear_attention_kernels_built() is false)

bool linear_attention_bwd_supported(const linear::LinearAttentionParams&, ElemKind) {
  return false;
}
cudaError_t launch_linear_attention_bwd(const linear::LinearAttentionParams&,
                                        const LinearBwdBuffers&, ElemKind, cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace attn_ext::cuda
