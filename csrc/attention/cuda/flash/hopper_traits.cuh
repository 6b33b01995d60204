#pragma once
// Compile-time shape of the Hopper (sm_90a) forward (flash_fwd_hopper.cuh): tiles, the wgmma
// atoms, the GMMA-swizzled shared layouts, the TMA copy types and the shared-memory budget.
// Host code as well as device code: run_fwd_hopper builds the TMA descriptors from these types,
// tests/cute_layout_check.cpp checks the layouts with the host compiler (so no device-only
// header here: the pipeline and the shared storage are flash_fwd_hopper.cuh's).
#include <cstddef>
#include <cstdint>
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include "attention/cuda/flash/cute_traits.cuh"

namespace attn_ext::cuda {
namespace hopper_fwd {

using namespace cute;

// The accumulator of a 64 x N wgmma, per thread ((2, 2, N / 8), MMA_M, MMA_N), viewed as
// (rows, cols) = ((2, MMA_M), (2, N / 8, MMA_N)). Thread t of the warpgroup (warp w = t / 32,
// lane l) holds value (c, r, j) at row 16 w + l / 4 + 8 r, col 8 j + 2 (l % 4) + c: as in an
// m16n8 tile, the four lanes of a quad share a row, so the sm_80 softmax's quad shuffles
// (cute_fwd::softmax_block) reduce a row here too.
template <class L>
__host__ __device__ constexpr auto rowcol(L const& acc) {
  static_assert(rank_v<L> == 3 && rank_v<decltype(get<0>(acc))> == 3, "a wgmma accumulator");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The same accumulator as the register A operand of a 64 x N x 16 wgmma: a thread's A values of
// one k16 slice are (c, r, kk) at row l / 4 + 8 r, col 8 kk + 2 (l % 4) + c, i.e. two
// consecutive n8 column groups of the accumulator: ((2, 2, 2), MMA_M, N / 16 * MMA_N).
template <class L>
__host__ __device__ constexpr auto acc_as_a(L const& acc) {
  auto cols = logical_divide(get<0, 2>(acc), Layout<_2>{});  // (2, N / 16)
  static_assert(rank_v<decltype(cols)> == 2, "two n8 groups per k16 slice");
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0>(cols)), get<1>(acc),
                     coalesce(make_layout(get<1>(cols), get<2>(acc))));
}

template <typename T, int kHeadDim_>
struct FwdHopperTraits {
  using Elem = typename CuteElem<T>::type;
  // D == Dv == kHeadDim (attention_launch.cu's hopper_index routes every other shape away).
  static constexpr int kHeadDim = kHeadDim_;
  // Two consumer warpgroups, each owning 64 query rows (one wgmma M) for the whole key loop:
  // the softmax needs no exchange between warpgroups, and each K/V tile serves 128 rows.
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kRowsPerWarpgroup = 64;
  static constexpr int kBlockM = kConsumerWarpgroups * kRowsPerWarpgroup;
  // Keys per block. A consumer thread holds O (64 x D / 128 fp32), S (64 x kBlockN / 128 fp32)
  // and P (half as many 32-bit registers as S) within its 240 registers: D = 64 and 128 afford
  // 128 keys (O 32 / 64, S 64, P 32). At D = 256, O alone is 128 registers and the shared
  // memory is Q (64 KB) + 2 stages of K and V (2 * 2 * kBlockN * 512 B): 64 keys fill 192 KB and
  // leave S at 32 registers. (FlashAttention-3 takes 80 keys there, 224 KB, at the edge of the
  // 227 KB; 64 keeps the tile a power of two and whole 64-row TMA boxes; to measure.)
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  // K and V each in a 2-stage ring: the producer loads block n - 1 while the consumers compute
  // on block n.
  static constexpr int kStages = 2;
  static constexpr int kProducerWarpgroups = 1;
  static constexpr int kThreads = (kProducerWarpgroups + kConsumerWarpgroups) * 128;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
  // setmaxnreg budgets (multiples of 8, 65536 registers per SM at one block): the producer
  // only issues TMA (24), the consumers hold the fragments above (240): 128 * 24 + 256 * 240 =
  // 64512.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536,
                "register budgets exceed the register file");

  using TileS = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S = Q K^T: M, N, K
  using TileO = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // O += P V: M, N, K
  // S: both operands from shared memory, K-major (D contiguous in Q and K).
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Elem, Elem, float,
                           Shape<Int<kRowsPerWarpgroup>, Int<kBlockN>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
  // O: P from registers (16-bit, converted from S), V^T from shared memory, MN-major (V's rows
  // are D-contiguous, so V^T's N = D is the contiguous mode).
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Elem, Elem, float,
                           Shape<Int<kRowsPerWarpgroup>, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));

  // 128-byte swizzle (64 16-bit elements per row chunk, 8-row atom): the layout wgmma reads
  // without bank conflicts and TMA writes natively; kHeadDim % 64 == 0.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Elem>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T (kHeadDim, kBlockN, stages): the same bytes as V, D the stride-1 mode.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // The output tile is staged in Q's shared memory: each warpgroup overwrites only its own 64
  // rows, after its last wgmma that reads them has completed.
  using SmemLayoutO = SmemLayoutQ;
  // Registers -> shared for the output: two adjacent elements (one 32-bit word) per store.
  using SmemCopyAtomO = Copy_Atom<UniversalCopy<uint32_t>, Elem>;
  // Shared -> global for one warpgroup's 64 output rows: 16-byte vectors, 8 threads per
  // 64-element row panel, so a warp writes 4 rows x 128 contiguous bytes.
  static constexpr int kVec = 16 / sizeof(Elem);
  static constexpr int kThreadsPerRow = 64 / kVec;
  using GmemCopyO =
      decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Elem>{},
                               Layout<Shape<Int<128 / kThreadsPerRow>, Int<kThreadsPerRow>>,
                                      Stride<Int<kThreadsPerRow>, _1>>{},
                               Layout<Shape<_1, Int<kVec>>>{}));

  // TMA over the whole (rows, D, heads, batch) tensor of Q, K or V: rows past the sequence are
  // zero-filled by the copy engine, so the last partial block needs no predicate.
  using GmemShape = Shape<int32_t, Int<kHeadDim>, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  static auto gmem_tensor(void const* ptr, GmemShape shape, GmemStride stride) {
    return make_tensor(make_gmem_ptr(static_cast<Elem const*>(ptr)), shape, stride);
  }
  using TmaQ =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor(nullptr, {}, {}), SmemLayoutQ{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor(nullptr, {}, {}),
                                       take<0, 2>(SmemLayoutKV{})));

  // The bytes each TMA load delivers (out-of-bounds zeros count): the mbarriers' transaction
  // counts.
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Elem);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Elem);

  // Shared memory: Q, the K ring, the V ring (each a whole number of 1024-byte swizzle periods,
  // so each stays aligned), then the mbarriers (Q's, a full / empty pair per stage of each
  // ring) padded to the 1024-byte alignment of the kernel's SharedStorage.
  static constexpr size_t kSmemTiles =
      (cosize_v<SmemLayoutQ> + 2 * cosize_v<SmemLayoutKV>)*sizeof(Elem);
  static constexpr size_t kSmemBarriers = 1024;
  static_assert((1 + 2 * 2 * kStages) * sizeof(uint64_t) <= kSmemBarriers, "barriers fit");
  static constexpr size_t kSmemBytes = kSmemTiles + kSmemBarriers;
  // 227 KB: the opt-in shared memory per block of sm_90.
  static_assert(kSmemBytes <= 227 * 1024, "tiles fit the shared memory of sm_90");
  static_assert(kHeadDim % 64 == 0 && kBlockN % 64 == 0, "whole 128-byte swizzle atoms");
};

}  // namespace hopper_fwd

using hopper_fwd::FwdHopperTraits;

}  // namespace attn_ext::cuda
