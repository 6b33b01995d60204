#pragma once
// Device pieces the CuTe forward and backward (flash_fwd_cute.cuh, flash_bwd_cute.cuh) share.
#include <cstdint>
#include <cute/tensor.hpp>

namespace attn_ext::cuda::cute_util {

using namespace cute;

// Global -> shared rows [0, rows) of a tile (cp.async), zeros past them (plain stores, made
// visible by the barrier that precedes every read). `coords` is the copy's partition of the
// tile's identity tensor: the row of each vector.
template <class TiledCopy, class Src, class Dst, class Coords>
__device__ __forceinline__ void copy_rows(TiledCopy const& copy_op, Src const& src, Dst& dst,
                                          Coords const& coords, int64_t rows) {
#pragma unroll
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coords(0, m, 0)) < rows) {
      copy(copy_op, src(_, m, _), dst(_, m, _));
    } else {
      clear(dst(_, m, _));
    }
  }
}

// acc += A B over the whole k extent, both operands in shared memory: slice k + 1 is read into
// registers (ldmatrix) while slice k multiplies.
template <class Mma, class Acc, class RA, class RB, class SA, class SB, class CpA, class CpB>
__device__ __forceinline__ void gemm_ss(Mma const& mma, Acc& acc, RA& rA, RB& rB, SA const& sA,
                                        SB const& sB, CpA const& cpA, CpB const& cpB) {
  auto rA_view = cpA.get_slice(threadIdx.x).retile_D(rA);
  auto rB_view = cpB.get_slice(threadIdx.x).retile_D(rB);
  copy(cpA, sA(_, _, 0), rA_view(_, _, 0));
  copy(cpB, sB(_, _, 0), rB_view(_, _, 0));
#pragma unroll
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(cpA, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(cpB, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

}  // namespace attn_ext::cuda::cute_util
