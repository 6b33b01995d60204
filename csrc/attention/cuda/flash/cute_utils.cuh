#pragma once
// Device pieces the CuTe forward and backward (flash_fwd_cute.cuh, flash_bwd_cute.cuh) share.
#include <cstdint>
#include <cute/tensor.hpp>
#include "common/mask.h"

namespace attn_ext::cuda::cute_util {

using namespace cute;

// exp2 with denormal results flushed to zero: MUFU.EX2 alone. CUDA's exp2f (without -ftz,
// which this build does not pass: it would change every fp32 kernel) wraps each MUFU.EX2 in a
// range test and two multiplies so that results under 2^-126 come out denormal; here they are
// probabilities under 2^-126 (of the row's largest in the forward, absolute in the backward),
// which round to nothing in the 16-bit P / dS and the fp32 sums anyway. Neither CUDA C++ nor
// CUTLASS spells this instruction (CUTLASS's own softmax epilogue writes the same line), hence
// the one line of PTX.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Keys [lo, hi) of a key block that row i may see under the band and the key range, relative
// to the block's first key j0 and clipped to [0, kBlockN]: the masked blocks test each score's
// column against these (32-bit compares; the 64-bit band arithmetic is per row). The same set
// as LocalBand::allowed(i, j0 + col) && j0 + col < key_limit. BlockKeys below computes the same
// bounds with fewer registers; this one stays for the verified ScaleFirst forward (its SASS
// unchanged) and goes with it.
template <int kBlockN>
struct RowKeys {
  int lo, hi;
  __device__ __forceinline__ RowKeys(const LocalBand& band, int64_t key_limit, int64_t i,
                                     int64_t j0) {
    const int64_t center = i + band.key_offset;
    int64_t first = band.has_left() ? center - band.left : 0;
    int64_t last = band.has_right() ? center + band.right + 1 : key_limit;
    if (last > key_limit) last = key_limit;
    first -= j0;
    last -= j0;
    lo = static_cast<int>(first < 0 ? 0 : (first > kBlockN ? kBlockN : first));
    hi = static_cast<int>(last < 0 ? 0 : (last > kBlockN ? kBlockN : last));
  }
};

// The same key bounds for every row of a query block at once: the 64-bit band arithmetic done
// once per (query block, key block), each row's bounds in 32 bits from its index in the block.
// The block's bases are clamped to +-2^30 first, which changes no row's clipped bounds (a row
// index adds less than 2^8) and keeps the 32-bit sums from overflowing. Fewer live registers
// than a RowKeys per row: the CuTe forward's D 128 kernel spills 60 B instead of 108 (SASS,
// sm_90a).
template <int kBlockN>
struct BlockKeys {
  int lo_base, hi_base, limit;
  __device__ __forceinline__ BlockKeys(const LocalBand& band, int64_t key_limit, int64_t m0,
                                       int64_t j0) {
    constexpr int64_t kBig = int64_t(1) << 30;
    const auto clamp_big = [](int64_t x) {
      return static_cast<int>(x < -kBig ? -kBig : (x > kBig ? kBig : x));
    };
    const int64_t center = m0 + band.key_offset - j0;  // row m0's key position, from j0
    lo_base = band.has_left() ? clamp_big(center - band.left) : -static_cast<int>(kBig);
    hi_base = band.has_right() ? clamp_big(center + band.right + 1) : static_cast<int>(kBig);
    limit = clamp_big(key_limit - j0);
  }
  // Keys [lo, hi) that row m0 + r sees, relative to j0 and clipped to [0, kBlockN]: RowKeys'.
  struct Bounds {
    int lo, hi;
  };
  __device__ __forceinline__ Bounds row(int r) const {
    const int first = lo_base + r;
    int last = hi_base + r;
    last = last < limit ? last : limit;
    return {first < 0 ? 0 : (first > kBlockN ? kBlockN : first),
            last < 0 ? 0 : (last > kBlockN ? kBlockN : last)};
  }
};

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
