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
#include "linear/cuda/linear_blocks.cuh"
#endif

namespace attn_ext::cuda {

#if ATTN_EXT_CUDA_CUTE

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads)
    linear_causal_fwd_kernel(LinearAttentionParams p, LinearOutputs o) {
  using namespace linear_blocks;
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
    store_inv<Tr>(p, o, sl, i0, rows, inv);
  }
  write_state<Tr>(p, o, sl, acc_s, cs, z);
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads)
    linear_state_fwd_kernel(LinearAttentionParams p, LinearOutputs o) {
  using namespace linear_blocks;
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
  using namespace linear_blocks;
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
    store_inv<Tr>(p, o, sl, i0, rows, inv);
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

// gridDim.y's limit, the non-causal output pass's row blocks.
constexpr int64_t kMaxGridY = 65535;
// gridDim.x's limit, the (batch, head, value slice) blocks.
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1;

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
  constexpr int64_t kValueTile = LinearTileShape<kLinearHeadDims[0]>::kValueTile;
  constexpr int64_t kRowsPerBlock = LinearTileShape<kLinearHeadDims[0]>::kRowsPerOutputBlock;
  const int bytes = elem_bytes(kind);
  if (bytes == 0) return false;
  if (p.head_dim != kLinearHeadDims[0] && p.head_dim != kLinearHeadDims[1]) return false;
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
      return with_linear_head_dim<T>(p.head_dim, [&](auto* tr) {
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
