#pragma once
// Compile-time shape of the tensor-core decode kernel (decode_mma.cu): tiles, the MMA and copy
// atoms, the swizzled shared layouts. Host code as well as device code, so that
// tests/cute_layout_check.cpp checks the partitions on a machine without a GPU.
//
// A decode step's query rows for one KV head are the G query heads sharing it times the Sq new
// tokens: at G * Sq >= 8 the SIMT kernels' FMAs, not the cache's bytes, bound the step (issue
// 21: "the grouped heads make decode a small GEMM: use mma"), and MLA's absorbed decode is the
// extreme case (16-128 heads over one 576-wide latent head whose first 512 columns are the
// values). One thread block owns kBlockM of those rows and one split of the keys; its four
// warps split the keys of a tile for S = Q K^T and the value columns for O += P V, so that the
// output accumulator stays at 64 fp32 registers a thread whatever Dv is (FlashDecoding / FlashMLA's
// split, not FlashAttention-2's rows-per-warp one, which would need 256 at Dv = 512).
#include <cstddef>
#include <type_traits>
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include "attention/cuda/flash/cute_traits.cuh"

namespace attn_ext::cuda {

// Rows per block when a KV head has at most this many query rows (decode with G <= 16 and one
// token, the common case): one MMA row tile, so that the row pass and the output's registers
// serve no padding rows.
constexpr int kDecodeMmaSmallBlockM = 16;
// The most rows per block at value width dv: as many as keep the output accumulator at 64 fp32
// registers a thread of 128 (64 at Dv <= 128, 32 at 256, 16 for MLA's 512), so that each K / V
// tile read serves as many query rows as fit.
constexpr int decode_mma_max_block_m(int dv) {
  return 64 * 128 / dv > 64 ? 64 : 64 * 128 / dv;
}

template <typename T, int kHeadDim_, int kHeadDimV_, bool kVInK_, int kBlockM_>
struct DecodeMmaTraits {
  using Scalar = T;  // the CUDA type of q, the cache and the output
  using Elem = typename CuteElem<T>::type;
  static constexpr int kHeadDim = kHeadDim_;    // D: q and key rows
  static constexpr int kHeadDimV = kHeadDimV_;  // Dv: value rows and the output
  // The values are the first Dv columns of the key rows (MLA's latent cache: v_cache is a view
  // of k_cache): only K tiles are loaded, and P V reads their first Dv columns.
  static constexpr bool kVInK = kVInK_;
  static_assert(!kVInK || kHeadDimV <= kHeadDim, "values inside the key rows");
  static_assert(kVInK || kHeadDimV == kHeadDim, "separate values have the keys' width");

  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // Rows per block: kDecodeMmaSmallBlockM or decode_mma_max_block_m(Dv) (the host picks from
  // the rows a KV head has: decode_mma_rows_per_block).
  static constexpr int kBlockM = kBlockM_;
  static_assert(kThreads == 128, "decode_mma_max_block_m counts 128 threads");
  static_assert(kBlockM >= 16 && kBlockM % 16 == 0 && kBlockM <= decode_mma_max_block_m(kHeadDimV),
                "whole MMA row tiles, at most 64 accumulator registers a thread");
  // Keys per tile: 64 (16 per warp in S = Q K^T). MLA's 576-wide rows take 32 (two warps form
  // S, all four P V): a 64-key tile would be 72 KB a stage, beyond sm_80's 163 KB with two.
  static constexpr int kBlockN = kHeadDim <= 256 ? 64 : 32;
  static constexpr int kKeysPerWarp = 16;
  static constexpr int kScoreWarps = kBlockN / kKeysPerWarp;
  static_assert(kScoreWarps >= 1 && kScoreWarps <= kWarps, "score slices per warp");
  // Value columns (of O) per warp.
  static constexpr int kColsPerWarp = kHeadDimV / kWarps;
  static_assert(kColsPerWarp % 16 == 0, "whole 16-column MMA tiles per warp");
  // Tiles in shared memory: the next tile loads while this one's products run. Two keep a
  // block's smem at 64-104 KB for D <= 128 (two blocks per H100 SM); tune on the device.
  static constexpr int kStages = 2;

  static constexpr int kVec = 16 / sizeof(Elem);  // elements per 16-byte vector
  // 64-element (128-byte) panels, the 3-bit swizzle over 8 rows (cute_traits.cuh's reasoning:
  // an ldmatrix's 8 row addresses hit 8 distinct 16-byte chunks).
  static constexpr int kPanel = 64;
  static_assert(kHeadDim % kPanel == 0 && kHeadDimV % kPanel == 0, "whole 64-element panels");
  using SmemLayoutAtom = typename FwdCuteTraits<T, 64>::SmemLayoutAtom;
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  // (kBlockN, D, kStages): stage s is a whole (kBlockN, D) swizzled tile.
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemLayoutAtom{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutV = decltype(cute::tile_to_shape(
      SmemLayoutAtom{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>, cute::Int<kStages>>{}));
  // Row width of the tile V is read from: V's own, or K's when the values are K's columns.
  static constexpr int kVSourceDim = kVInK ? kHeadDim : kHeadDimV;
  using SmemLayoutVSource = std::conditional_t<kVInK, SmemLayoutK, SmemLayoutV>;
  // V^T (Dv, kBlockN, kStages), the B operand of O += P V: V's (or K's first Dv columns')
  // bytes through a transposed view, read with the transposing ldmatrix.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutVSource{},
      cute::make_layout(
          cute::Shape<cute::Int<kHeadDimV>, cute::Int<kBlockN>, cute::Int<kStages>>{},
          cute::Stride<cute::Int<kBlockN>, cute::_1, cute::Int<kBlockN * kVSourceDim>>{})));
  // P (kBlockM, kBlockN) in 16 bits, the A operand of P V for every warp: the swizzle over a
  // row of kBlockN elements (log2 of its 16-byte chunks).
  static constexpr int kPSwizzle = kBlockN == 64 ? 3 : 2;
  using SmemLayoutP = decltype(cute::tile_to_shape(
      cute::composition(cute::Swizzle<kPSwizzle, 3, 3>{},
                        cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockN>>,
                                     cute::Stride<cute::Int<kBlockN>, cute::_1>>{}),
      cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  // The scores in fp32 between the warps that form them and the row pass: rows padded by 4
  // floats so that a row's start moves 4 banks (the row pass reads down columns).
  static constexpr int kScoreStride = kBlockN + 4;

  // One warp's m16n8k16 MMAs; every warp runs its own (its slice of keys or value columns).
  // The 16-column N tile makes one B load (ldmatrix.x4) feed two MMAs.
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<typename CuteElem<T>::MmaOp>,
                                  cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>,
                                  cute::Tile<cute::_16, cute::_16, cute::_16>>;
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Elem>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Elem>;

  // Global -> shared: each thread moves 16-byte vectors, 8 threads a 64-element panel row; the
  // rows are gathered (query rows of two strides, cache rows through a page table), so each
  // vector's source is computed from its row (decode_mma.cu's gather_rows).
  static constexpr int kThreadsPerRow = kPanel / kVec;
  using GmemThreadLayout =
      cute::Layout<cute::Shape<cute::Int<kThreads / kThreadsPerRow>, cute::Int<kThreadsPerRow>>,
                   cute::Stride<cute::Int<kThreadsPerRow>, cute::_1>>;
  using GmemCopy = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Elem>{}, GmemThreadLayout{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kVec>>>{}));

  static constexpr size_t kSmemQ = cute::cosize_v<SmemLayoutQ> * sizeof(Elem);
  static constexpr size_t kSmemK = cute::cosize_v<SmemLayoutK> * sizeof(Elem);
  static constexpr size_t kSmemV = kVInK ? 0 : cute::cosize_v<SmemLayoutV> * sizeof(Elem);
  static constexpr size_t kSmemP = cute::cosize_v<SmemLayoutP> * sizeof(Elem);
  static constexpr size_t kSmemScores = size_t(kBlockM) * kScoreStride * sizeof(float);
  // Per row: the running (max, sum), its bounds [lo, hi) among the split's keys, the factor
  // the row pass sets for the output rows.
  static constexpr size_t kSmemRows =
      size_t(kBlockM) * (2 * sizeof(float) + 2 * sizeof(int) + sizeof(float));
  static constexpr size_t kSmemBytes = kSmemQ + kSmemK + kSmemV + kSmemP + kSmemScores + kSmemRows;

  static_assert(kBlockM % (kThreads / kThreadsPerRow) == 0 &&
                    kBlockN % (kThreads / kThreadsPerRow) == 0,
                "global copies tile the blocks exactly");
  static_assert(kThreads % kBlockM == 0 && kBlockN % (kThreads / kBlockM) == 0 &&
                    32 % (kThreads / kBlockM) == 0,
                "the row pass gives each row the same number of threads (lanes of one warp) "
                "and columns");
  // Every region starts 128-byte aligned (cp.async and ldmatrix want 16).
  static_assert(kSmemQ % 128 == 0 && kSmemK % 128 == 0 && kSmemV % 128 == 0 && kSmemP % 128 == 0,
                "shared regions stay aligned");
  static_assert(kSmemBytes <= 163 * 1024, "tiles fit the shared memory of sm_80 and sm_90");
};

namespace decode_mma {

// Global -> shared rows [0, rows) of a tile whose rows each have their own address
// (row_ptr(r): row r's first element; query rows of two strides, cache rows through a page
// table), zeros past them. `dst` is a thread's partition of the tile (CPY, CPY_M, CPY_K) by the
// traits' GmemCopy and `coords` the same partition of the tile's identity tensor; each (m, k)
// is one 16-byte vector, moved by VecCopy::copy (cp.async on the device).
template <class VecCopy, class Dst, class Coords, class RowPtr>
CUTE_HOST_DEVICE void gather_rows(Dst&& dst, Coords const& coords, int rows, RowPtr&& row_ptr) {
  using namespace cute;
  using Elem = typename std::remove_reference_t<Dst>::value_type;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    const int r = get<0>(coords(0, m, 0));
    if (r < rows) {
      const Elem* src = row_ptr(r);
      CUTE_UNROLL
      for (int k = 0; k < size<2>(dst); ++k) {
        VecCopy::copy(*reinterpret_cast<const uint128_t*>(src + get<1>(coords(0, m, k))),
                      *reinterpret_cast<uint128_t*>(&dst(0, m, k)));
      }
    } else {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(dst); ++k) {
        CUTE_UNROLL
        for (int e = 0; e < size<0>(dst); ++e) dst(e, m, k) = Elem(0.f);
      }
    }
  }
}

}  // namespace decode_mma

}  // namespace attn_ext::cuda
