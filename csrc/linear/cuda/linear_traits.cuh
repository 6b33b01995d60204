#pragma once
// Compile-time shape of the CUDA linear-attention forward (linear_attention_fwd.cu): the chunk,
// the value-column tile, the thread-level MMAs and the shared layouts, for the tensor-core path
// (bf16 / fp16: m16n8k16 MMAs, fp32 accumulation) and the SIMT path (fp32: FMA atoms, so that
// fp32 keeps fp32 products; tf32 would round the operands to 10 mantissa bits).
#include <cstddef>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include "attention/cuda/flash/cute_traits.cuh"
#include "linear/feature_map.h"

namespace attn_ext::cuda {

// What both paths share: the chunk and tile extents of one thread block.
template <int kHeadDim_>
struct LinearTileShape {
  // D: the K extent of phi(Q) phi(K)^T and phi(Q) S, the rows of the state S (D x Dv).
  static constexpr int kHeadDim = kHeadDim_;
  // Rows per chunk, the CPU kernel's causal chunk (feature_map.h): the C x C intra-chunk tile
  // and its operands stay in shared memory, and the quadratic work (S C (D + Dv)) stays
  // comparable to the state work (S D Dv).
  static constexpr int kChunk = static_cast<int>(linear::kCausalChunk);
  // Value columns per block: one block owns a 64-column slice of v, of the output and of the
  // state, so the D x 64 fp32 state slice lives in registers across all chunks (64 per thread
  // at D = 128) and Dv = 128 gives two blocks per head (more blocks in flight). The slices of
  // one head recompute phi(Q) phi(K)^T each (C x C x D per chunk, small beside the rest).
  static constexpr int kValueTile = 64;
  // Non-causal output pass: rows per block, the CPU kernel's non-causal block, so that reading
  // the D x kValueTile state into shared memory is amortized over 4 chunks.
  static constexpr int kRowsPerOutputBlock = static_cast<int>(linear::kNonCausalBlock);
  static_assert(kRowsPerOutputBlock % kChunk == 0, "whole chunks per output block");
  // 4 warps: one MMA row tile of 16 each over the chunk's 64 rows.
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // The feature-sum z (D floats) is updated by one thread per column.
  static_assert(kHeadDim <= kThreads, "one thread per column of the key-sum state");
  // The denominator pass gives each chunk row kThreads / kChunk threads.
  static constexpr int kThreadsPerRow = kThreads / kChunk;
  static_assert(kThreads % kChunk == 0 && (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                "a power-of-two number of threads per chunk row (shuffle reduction)");
};

template <typename T, int kHeadDim_>
struct LinearFwdTraits : LinearTileShape<kHeadDim_> {
  using Base = LinearTileShape<kHeadDim_>;
  using Base::kChunk;
  using Base::kHeadDim;
  using Base::kThreads;
  using Base::kValueTile;
  using Base::kWarps;
  using Elem = typename CuteElem<T>::type;

  // Shared rows in 64-element (128-byte) panels with the 3-bit swizzle of the attention
  // kernels (cute_traits.cuh): the 8 rows of an ldmatrix hit 8 distinct 16-byte chunks.
  static constexpr int kPanel = 64;
  static_assert(kHeadDim % kPanel == 0 && kValueTile % kPanel == 0 && kChunk % kPanel == 0,
                "whole 64-element panels");
  using SmemLayoutAtom = typename FwdCuteTraits<T, kPanel>::SmemLayoutAtom;
  template <int kRows, int kCols>
  using Smem = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                            cute::Shape<cute::Int<kRows>, cute::Int<kCols>>{}));

  // m16n8k16 MMAs, fp32 accumulation, 4 warps stacked along M (16 rows each); the 16-wide N
  // tile makes one ldmatrix.x4 of B feed two MMAs. Every product's M (C or D) is a multiple
  // of 64 and its N (C or kValueTile) a multiple of 16.
  // The products' K loop is 4 MMA steps (64 / 16) at most: unrolled whole, each step's
  // ldmatrix issued under the previous step's MMAs (cute_util::gemm_ss).
  static constexpr bool kRolledK = false;
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<typename CuteElem<T>::MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kWarps>, cute::_16, cute::_16>>;
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Elem>;
  // The transposed operands (phi(K)^T, V^T, S^T) read the same bytes with ldmatrix.trans.
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Elem>;

  // Global -> registers (the feature map is applied there) -> shared: 16-byte vectors, 8
  // threads per 64-element panel row, a warp covering 4 rows x 128 contiguous bytes.
  static constexpr int kVec = 16 / sizeof(Elem);
  static constexpr int kGmemThreadsPerRow = kPanel / kVec;
  using GmemCopy = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Elem>{},
      cute::Layout<
          cute::Shape<cute::Int<kThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
          cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kVec>>>{}));
};

template <int kHeadDim_>
struct LinearFwdTraits<float, kHeadDim_> : LinearTileShape<kHeadDim_> {
  using Base = LinearTileShape<kHeadDim_>;
  using Base::kChunk;
  using Base::kHeadDim;
  using Base::kThreads;
  using Base::kValueTile;
  using Elem = float;

  // Row-major rows padded by one 16-byte vector: consecutive rows start 4 banks apart, so the
  // column-wise reads of the transposed operands spread over the banks, and every row start
  // stays 16-byte aligned for the vector stores.
  static constexpr int kPad = 4;
  template <int kRows, int kCols>
  using Smem = cute::Layout<cute::Shape<cute::Int<kRows>, cute::Int<kCols>>,
                            cute::Stride<cute::Int<kCols + kPad>, cute::_1>>;

  // FMA atoms on a 16 x 8 thread grid: each thread owns (M / 16) x (N / 8) outputs.
  // One FMA step takes one k, so a product's K loop is 64 or 128 steps: unrolled whole (with
  // register fragments for every k, as gemm_ss holds them) it made cicc spend ~4 minutes per
  // architecture on the fp32 kernels of linear_attention_bwd.cu alone, and the fragments
  // (M / 16 + N / 8) x K floats per thread do not fit the register file. The loop stays rolled
  // instead, kKUnroll steps per iteration, each step's operands loaded into a fragment of its own.
  static constexpr bool kRolledK = true;
  static constexpr int kKUnroll = 4;
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<cute::UniversalFMA<float, float, float, float>>,
                                  cute::Layout<cute::Shape<cute::_16, cute::_8, cute::_1>>>;
  using SmemCopyAtom = cute::Copy_Atom<cute::UniversalCopy<float>, float>;
  using SmemCopyAtomTransposed = SmemCopyAtom;

  static constexpr int kVec = 4;  // 16 bytes
  // 16 threads x 4 floats = 64 columns per thread row: the tile widths are multiples of 64.
  static constexpr int kGmemThreadsPerRow = 16;
  static_assert(kHeadDim % (kGmemThreadsPerRow * kVec) == 0 &&
                    kValueTile % (kGmemThreadsPerRow * kVec) == 0,
                "global copies tile the columns exactly");
  using GmemCopy = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, float>{},
      cute::Layout<
          cute::Shape<cute::Int<kThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
          cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kVec>>>{}));
};

// Shared memory of one block: phi(Q), phi(K) (C x D), V (C x kValueTile), the masked scores
// A (C x C), the state S (D x kValueTile) in the element type, and the fp32 key-sum z (D) and
// per-row 1 / (den + eps) (C).
template <class Tr>
struct LinearSmem {
  using SmemQK = typename Tr::template Smem<Tr::kChunk, Tr::kHeadDim>;
  using SmemV = typename Tr::template Smem<Tr::kChunk, Tr::kValueTile>;
  using SmemA = typename Tr::template Smem<Tr::kChunk, Tr::kChunk>;
  using SmemS = typename Tr::template Smem<Tr::kHeadDim, Tr::kValueTile>;
  static constexpr size_t kQK = cute::cosize_v<SmemQK>;
  static constexpr size_t kV = cute::cosize_v<SmemV>;
  static constexpr size_t kA = cute::cosize_v<SmemA>;
  static constexpr size_t kS = cute::cosize_v<SmemS>;
  static constexpr size_t kElems = 2 * kQK + kV + kA + kS;
  static constexpr size_t kBytes =
      kElems * sizeof(typename Tr::Elem) + (Tr::kHeadDim + Tr::kChunk) * sizeof(float);
  // 163 KB: the opt-in shared memory per block of sm_80 (fp32 at D = 128 takes about 130 KB).
  static_assert(kBytes <= 163 * 1024, "fits the shared memory of sm_80 and sm_90");
  static_assert((kElems * sizeof(typename Tr::Elem)) % 16 == 0, "the fp32 arrays stay aligned");
};

}  // namespace attn_ext::cuda
