#pragma once
// Compile-time shape of the CuTe tensor-core forward (flash_fwd_cute.cuh): tiles, the MMA and
// copy atoms, the swizzled shared layouts. Host code as well as device code, so that
// tests/cute_layout_check.cu can check the partitions on a machine without a GPU.
#include <cstddef>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>

namespace attn_ext::cuda {

// CuTe's names of the CUDA 16-bit types (same bits: the kernel reinterprets the pointers).
template <typename T>
struct CuteElem;
template <>
struct CuteElem<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
  using MmaOp = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};
template <>
struct CuteElem<__half> {
  using type = cutlass::half_t;
  using MmaOp = cute::SM80_16x8x16_F32F16F16F32_TN;
};

namespace cute_fwd {

using namespace cute;

// An accumulator layout ((2, 2), MMA_M, MMA_N) of m16n8 tiles viewed as (rows, cols):
// ((2, MMA_M), (2, MMA_N)). A thread's value (c, r) of a tile is (row r * 8 + lane / 4,
// col 2 * (lane % 4) + c): mode (0, 0) runs along a row, mode (0, 1) jumps 8 rows.
template <class L>
__host__ __device__ constexpr auto rowcol(L const& acc) {
  static_assert(rank_v<L> == 3 && rank_v<decltype(get<0>(acc))> == 2, "an m16n8 accumulator");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<2>(acc)));
}

// The same accumulator as the A operand of an m16n8k16 MMA: two adjacent n8 tiles of scores
// are one k16 slice of P, ((2, 2, 2), MMA_M, MMA_N / 2).
template <class L>
__host__ __device__ constexpr auto acc_as_a(L const& acc) {
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

}  // namespace cute_fwd

template <typename T, int kHeadDim_>
struct FwdCuteTraits {
  using Elem = typename CuteElem<T>::type;
  // The kernel serves head_dim == head_dim_v == kHeadDim exactly (attention_launch.cu routes
  // every other shape to the older kernels): rows are whole 16-byte vectors, no column
  // predicates.
  static constexpr int kHeadDim = kHeadDim_;
  // 128 query rows per block: each warp owns 16 * (kBlockM / (16 * kWarps)) rows for the whole
  // key loop, so the softmax needs no exchange between warps (FlashAttention-2's split) and
  // each K/V tile brought to shared memory serves 128 rows.
  static constexpr int kBlockM = 128;
  // 4 warps (2 MMA row tiles each). At D = 256 the output accumulator alone would be 256 fp32
  // registers per thread with 4 warps, so 8 warps (one row tile each, 128 registers).
  static constexpr int kWarps = kHeadDim <= 128 ? 4 : 8;
  static constexpr int kThreads = kWarps * 32;
  // Keys per block: the score fragment is kBlockM * kBlockN / kThreads fp32 registers beside
  // the output's kBlockM * kHeadDim / kThreads. D = 64 affords 128 keys (128 + 64 registers),
  // D = 128 and 256 take 64 (64 + 128, 32 + 128); fewer, larger blocks halve the softmax's
  // per-block rescale work.
  static constexpr int kBlockN = kHeadDim <= 64 ? 128 : 64;

  // 16-byte global loads (cp.async) and shared accesses: 8 elements.
  static constexpr int kVec = 16 / sizeof(Elem);
  // Shared rows are laid out in 64-element (128-byte) panels: one panel row spans the 32 banks
  // once; the 3-bit swizzle permutes the 8 16-byte chunks of a row by the row index mod 8, so
  // the 8 row addresses of an ldmatrix (same column, consecutive rows) hit 8 distinct chunks.
  static constexpr int kPanel = 64;
  static_assert(kHeadDim % kPanel == 0, "head dim must be whole 64-element panels");
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<3, 3, 3>{}, cute::Layout<cute::Shape<cute::_8, cute::Int<kPanel>>,
                                             cute::Stride<cute::Int<kPanel>, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V seen as V^T (kHeadDim x kBlockN), the B operand of O += P V: the same bytes, read with
  // the transposing ldmatrix.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                        cute::GenRowMajor{})));
  // The output tile is staged in Q's shared memory (Q is dead by then).
  using SmemLayoutO = SmemLayoutQ;

  // m16n8k16 MMAs, fp32 accumulation; warps stacked along the rows. The 16-column N tile
  // makes one B load (ldmatrix.x4) feed two MMAs.
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<typename CuteElem<T>::MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kWarps>, cute::_16, cute::_16>>;
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Elem>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Elem>;
  // Registers -> shared for the output: two adjacent elements (one 32-bit word) per store.
  using SmemCopyAtomO = cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Elem>;

  // Global <-> shared: each thread moves 16-byte vectors; a row of one panel is 8 threads, so a
  // warp covers 4 rows x 128 contiguous bytes (full 128-byte transactions).
  static constexpr int kThreadsPerRow = kPanel / kVec;
  using GmemThreadLayout =
      cute::Layout<cute::Shape<cute::Int<kThreads / kThreadsPerRow>, cute::Int<kThreadsPerRow>>,
                   cute::Stride<cute::Int<kThreadsPerRow>, cute::_1>>;
  using GmemValLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kVec>>>;
  // cp.async.cg: 16 bytes, bypassing L1 (each K/V tile is read once per block).
  using GmemCopyQKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Elem>{}, GmemThreadLayout{},
      GmemValLayout{}));
  using GmemCopyO =
      decltype(cute::make_tiled_copy(cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Elem>{},
                                     GmemThreadLayout{}, GmemValLayout{}));

  static constexpr size_t kSmemQ = cute::cosize_v<SmemLayoutQ> * sizeof(Elem);
  static constexpr size_t kSmemKV = cute::cosize_v<SmemLayoutKV> * sizeof(Elem);
  // One Q tile, one K tile, one V tile: the next K tile loads while this block's softmax and
  // P V run, V while Q K^T runs (FlashAttention-2's overlap with single buffers).
  static constexpr size_t kSmemBytes = kSmemQ + 2 * kSmemKV;

  static_assert(kBlockM % (16 * kWarps) == 0, "whole MMA row tiles per warp");
  static_assert(kBlockN % 16 == 0, "whole MMA k steps in P V");
  static_assert(kBlockM % (kThreads / kThreadsPerRow) == 0 &&
                    kBlockN % (kThreads / kThreadsPerRow) == 0,
                "global copies tile the blocks exactly");
  // 227 KB: the opt-in shared memory per block of sm_90 (sm_80: 163 KB; D = 256 takes 128 KB).
  static_assert(kSmemBytes <= 163 * 1024, "tiles fit the shared memory of sm_80 and sm_90");
};

// Compile-time shape of the CuTe tensor-core backward (flash_bwd_cute.cuh), FlashAttention-2's
// algorithm: one block per (b, query head, key block) accumulates dK and dV in registers over
// the query blocks that see its keys, and adds each query block's dQ share to an fp32 buffer
// with atomics.
template <typename T, int kHeadDim_, int kQStages_>
struct BwdCuteTraits {
  using Elem = typename CuteElem<T>::type;
  static constexpr int kHeadDim = kHeadDim_;  // D == Dv == kHeadDim (attention_launch.cu)
  // Shared-memory stages of the query block's Q and dO: 1 loads each block's tiles when the
  // block starts (the shipped default), 2 loads the next block's while this one's products run.
  static constexpr int kQStages = kQStages_;
  static_assert(kQStages == 1 || kQStages == 2, "one query block in flight at most");
  // 128 keys per block, 64 query rows per step, 8 warps: dK and dV of 128 keys stay in
  // registers for the whole loop (2 * 128 * D / 256 fp32 per thread: 128 at D = 128), beside
  // the 64 x 128 score and dP fragments (32 each).
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 128;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kVec = 16 / sizeof(Elem);
  static constexpr int kPanel = 64;
  static_assert(kHeadDim % kPanel == 0 && kBlockN % kPanel == 0, "whole 64-element panels");

  using SmemLayoutAtom = typename FwdCuteTraits<T, kHeadDim>::SmemLayoutAtom;
  using SmemLayoutQ = decltype(cute::tile_to_shape(  // Q and dO: (kBlockM, kHeadDim)
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(  // K and V: (kBlockN, kHeadDim)
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutPdS = decltype(cute::tile_to_shape(  // P and dS: (kBlockM, kBlockN)
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  // The transposed operands read the same bytes through a (cols, rows) view with the
  // transposing ldmatrix: Q^T and dO^T (kHeadDim, kBlockM), K^T (kHeadDim, kBlockN), P^T and
  // dS^T (kBlockN, kBlockM).
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{},
                                       cute::GenRowMajor{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                        cute::GenRowMajor{})));
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{},
                                         cute::GenRowMajor{})));

  using MmaAtom = cute::MMA_Atom<typename CuteElem<T>::MmaOp>;
  // S = Q K^T and dP = dO V^T, (kBlockM x kBlockN): 2 x 4 warps.
  using TiledMmaSdP =
      cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::_2, cute::_4, cute::_1>>,
                     cute::Tile<cute::_32, cute::_64, cute::_16>>;
  // dV += P^T dO and dK += dS^T Q, (kBlockN x kHeadDim): 4 x 2 warps.
  using TiledMmaKV =
      cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::_4, cute::_2, cute::_1>>,
                     cute::Tile<cute::_64, cute::_32, cute::_16>>;
  // dQ = dS K, (kBlockM x kHeadDim): 4 x 2 warps.
  using TiledMmaQ = TiledMmaKV;
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Elem>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Elem>;
  // Registers -> shared for P and dS: two adjacent elements per 32-bit store.
  using SmemCopyAtomPdS = cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Elem>;

  static constexpr int kThreadsPerRow = kPanel / kVec;
  using GmemThreadLayout =
      cute::Layout<cute::Shape<cute::Int<kThreads / kThreadsPerRow>, cute::Int<kThreadsPerRow>>,
                   cute::Stride<cute::Int<kThreadsPerRow>, cute::_1>>;
  using GmemCopy = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Elem>{}, GmemThreadLayout{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kVec>>>{}));

  static constexpr size_t kSmemQ = cute::cosize_v<SmemLayoutQ> * sizeof(Elem);
  static constexpr size_t kSmemKV = cute::cosize_v<SmemLayoutKV> * sizeof(Elem);
  static constexpr size_t kSmemPdS = cute::cosize_v<SmemLayoutPdS> * sizeof(Elem);
  // Q and dO per stage, K, V, P, dS: 128 KB at D = 128 with one query stage, 160 KB with two.
  static constexpr size_t kSmemBytes = kQStages * 2 * kSmemQ + 2 * kSmemKV + 2 * kSmemPdS;

  static_assert(kBlockM % (kThreads / kThreadsPerRow) == 0 &&
                    kBlockN % (kThreads / kThreadsPerRow) == 0,
                "global copies tile the blocks exactly");
  static_assert(kSmemBytes <= 163 * 1024, "tiles fit the shared memory of sm_80 and sm_90");
};

}  // namespace attn_ext::cuda
