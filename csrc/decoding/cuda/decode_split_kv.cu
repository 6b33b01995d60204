// CUDA decode attention at memory speed (issue 21): Sq new queries per sequence against a
// contiguous or paged KV cache, one code path for both (the cache-row policy is a template
// parameter). Off by default until it has run on a GPU (decoding_cuda.cpp).
//
// One thread block owns up to kRows rows (the G query heads sharing a KV head, times the new
// tokens) of one (sequence, KV head) and one split of its keys:
//   prologue  each lane holds its slice of every row's query in registers;
//   main loop a key row is read by a group of kLanes lanes, one 16-byte vector each, the
//             groups of a warp reading adjacent rows (coalesced); each group keeps its own
//             online-softmax state and output slice for every row, so no lane waits on another
//             between tiles; kUnroll keys per group are loaded before any is used;
//   epilogue  the groups of a warp merge by shuffles, the warps through shared memory, into
//             the normalized output + lse, or the split's partial for merge_kernel (LSE merge
//             with SoftmaxState::merge).
// Score semantics are the CPU kernel's: LocalBand (causal / window), cache_leftpad, ScoreMod
// (softcap, ALiBi) and the sink (joins the first split's state once, in the epilogue).
#include <cstdint>
#include <type_traits>
#include "common/constants.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "attention/score_mod.h"
#include "common/cuda/elem.cuh"
#include "decoding/cuda/decoding_launch.h"
#include "decoding/cuda/decode_block.cuh"
#include "decoding/cuda/split_merge.cuh"

namespace attn_ext::cuda {
namespace {

constexpr int kWarp = 32;

template <typename T, int kHeadDim, int kRowsPerBlock>
struct SplitKvTraits {
  // Four warps: enough 16-byte loads in flight per block, and a cheap cross-warp merge.
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / kWarp;
  static constexpr int kRows = kRowsPerBlock;
  // One 16-byte vector per lane and load: the widest global access a thread issues.
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  static constexpr int kRowVecs = kHeadDim / kVec;
  // Lanes reading one key row (a whole warp at most; wider rows take several vectors a lane).
  static constexpr int kLanes = kRowVecs < kWarp ? kRowVecs : kWarp;
  static constexpr int kVecsPerLane = kRowVecs / kLanes;
  static constexpr int kElems = kVec * kVecsPerLane;  // features of a row each lane holds
  static constexpr int kGroups = kWarp / kLanes;      // key rows a warp reads per load
  // Keys each group loads before using any: 2 * kUnroll * kVecsPerLane vectors in flight per
  // lane. Halved for 8 rows, whose query slices and accumulators take twice the registers.
  static constexpr int kUnroll = kRows <= 4 ? 4 : 2;
  static constexpr int kTileKeys = kUnroll * kWarps * kGroups;
  static_assert(kHeadDim % (kVec * kLanes) == 0, "head dim must fill whole vectors per lane");
  static_assert(kWarp % kLanes == 0, "a warp holds whole lane groups");
};

// A 16-byte vector of T as kVec floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& u, float* f) {
  if constexpr (std::is_same_v<T, float>) {
    f[0] = __uint_as_float(u.x), f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z), f[3] = __uint_as_float(u.w);
  } else {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    const T2* h = reinterpret_cast<const T2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 x;
      if constexpr (std::is_same_v<T, __half>) {
        x = __half22float2(h[i]);
      } else {
        x = __bfloat1622float2(h[i]);
      }
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
}

// Grid: x = (sequence, KV head, row block), y = split. kMods: softcap / ALiBi (their own
// instantiation, so the kernel without them keeps its registers; the sink is in the epilogue).
template <typename T, int kHeadDim, int kRowsPerBlock, typename Rows, bool kMods>
__global__ void __launch_bounds__(SplitKvTraits<T, kHeadDim, kRowsPerBlock>::kThreads)
    split_kv_kernel(DecodeParams p, DecodeWorkspace ws) {
  using Tr = SplitKvTraits<T, kHeadDim, kRowsPerBlock>;
  constexpr int kRows = Tr::kRows, kVec = Tr::kVec, kLanes = Tr::kLanes;
  constexpr int kVecsPerLane = Tr::kVecsPerLane, kElems = Tr::kElems, kUnroll = Tr::kUnroll;
  __shared__ float o_s[Tr::kWarps][kRows][kHeadDim];
  __shared__ SoftmaxState<float> state_s[Tr::kWarps][kRows];

  // ---- prologue: this block's rows and keys, the query slices
  const DecodeBlock blk(p, kRows, Tr::kTileKeys);
  const int64_t G = blk.G, Sq = blk.Sq, rows = blk.rows, bk = blk.bk, r0 = blk.r0;
  const int64_t b = blk.b, hk = blk.hk, len = blk.len;
  const int m = blk.m;
  const int32_t splits = blk.splits, split = blk.split, j_begin = blk.j_begin, j_end = blk.j_end;

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int group = lane / kLanes, gl = lane % kLanes;
  const float log2e = static_cast<float>(kLog2e);
  const float s_scale = static_cast<float>(p.scale) * log2e;
  // Lane feature e of vector c is column (c * kLanes + gl) * kVec + e % kVec.
  const auto column = [&](int c, int e) { return (c * kLanes + gl) * kVec + e; };

  // Each row's keys of this split, [row_lo, row_hi): its band from the first key on, cut to
  // the split (empty for the rows past m), so a score needs two compares.
  float q[kRows][kElems];
  int32_t row_lo[kRows], row_hi[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t rg = r0 + (r < m ? r : 0), i = rg / G, h = hk * G + rg % G;
    row_lo[r] = blk.row_begin(r < m ? r : 0);
    row_hi[r] = r < m ? blk.row_end(r) : 0;
    const T* qr = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                  i * p.q_row_stride;
#pragma unroll
    for (int c = 0; c < kVecsPerLane; ++c)
#pragma unroll
      for (int e = 0; e < kVec; ++e) q[r][c * kVec + e] = Elem<T>::load(qr[column(c, e)]);
  }

  SoftmaxState<float> st[kRows];
  float o[kRows][kElems];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < kElems; ++e) o[r][e] = 0.f;

  const T* k_base = static_cast<const T*>(p.k) + hk * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v) + hk * p.v_head_stride;

  // ---- main loop: tiles of kTileKeys keys; key u of a group is tile row
  // (u * kWarps + warp) * kGroups + group, so a warp's load covers kGroups adjacent rows.
  for (int32_t j0 = j_begin; j0 < j_end; j0 += Tr::kTileKeys) {
    uint4 kv[kUnroll][kVecsPerLane], vv[kUnroll][kVecsPerLane];
    int32_t jj[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      jj[u] = j0 + (u * Tr::kWarps + warp) * Tr::kGroups + group;
      if (jj[u] < j_end) {
        const CacheSlot s = Rows::slot(p, b, jj[u]);
        const T* kr = k_base + s.block * p.k_batch_stride + s.row * p.k_row_stride;
        const T* vr = v_base + s.block * p.v_batch_stride + s.row * p.v_row_stride;
#pragma unroll
        for (int c = 0; c < kVecsPerLane; ++c) {
          kv[u][c] = *reinterpret_cast<const uint4*>(kr + column(c, 0));
          vv[u][c] = *reinterpret_cast<const uint4*>(vr + column(c, 0));
        }
      } else {
#pragma unroll
        for (int c = 0; c < kVecsPerLane; ++c) kv[u][c] = vv[u][c] = make_uint4(0, 0, 0, 0);
      }
    }

    // scores: each lane's partial dot, summed over the group's lanes (log2 domain)
    float s[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kElems];
#pragma unroll
      for (int c = 0; c < kVecsPerLane; ++c) unpack<T>(kv[u][c], kf + c * kVec);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) dot = fmaf(q[r][e], kf[e], dot);
#pragma unroll
        for (int off = kLanes / 2; off > 0; off /= 2) dot += __shfl_xor_sync(~0u, dot, off);
        float sc = dot * s_scale;
        const bool ok = row_lo[r] <= jj[u] && jj[u] < row_hi[r];
        if constexpr (kMods) {
          if (ok) {
            const int64_t rg = r0 + r, h = hk * G + rg % G;
            sc = ScoreMod<float>::make(p, b, h, len - Sq, log2e).apply(sc, rg / G, jj[u]);
          }
        }
        s[u][r] = ok ? sc : -INFINITY;
      }
    }

    // online softmax per row and the value rows; a key a row does not see adds nothing, even
    // when its value row holds NaN / Inf (an underflowed weight of a seen key still multiplies)
    bool seen[kUnroll][kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = s[0][r];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) mx = fmaxf(mx, s[u][r]);
      const float factor = st[r].rescale_to(mx);
      const float shift = st[r].shift();
#pragma unroll
      for (int e = 0; e < kElems; ++e) o[r][e] *= factor;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        seen[u][r] = s[u][r] != -INFINITY;
        s[u][r] = seen[u][r] ? exp2f(s[u][r] - shift) : 0.f;
        st[r].sum += s[u][r];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float vf[kElems];
#pragma unroll
      for (int c = 0; c < kVecsPerLane; ++c) unpack<T>(vv[u][c], vf + c * kVec);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int e = 0; e < kElems; ++e)
          if (seen[u][r]) o[r][e] = fmaf(s[u][r], vf[e], o[r][e]);
    }
  }

  // ---- epilogue: merge the groups of a warp (shuffles), then the warps (shared memory)
#pragma unroll
  for (int off = kLanes; off < kWarp; off *= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      SoftmaxState<float> other;
      other.max = __shfl_xor_sync(~0u, st[r].max, off);
      other.sum = __shfl_xor_sync(~0u, st[r].sum, off);
      float self_f, other_f;
      st[r].merge(other, &self_f, &other_f);
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        const float oo = __shfl_xor_sync(~0u, o[r][e], off);
        o[r][e] = o[r][e] * self_f + oo * other_f;
      }
    }
  }
  if (group == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < kVecsPerLane; ++c)
#pragma unroll
        for (int e = 0; e < kVec; ++e) o_s[warp][r][column(c, e)] = o[r][c * kVec + e];
      if (gl == 0) state_s[warp][r] = st[r];
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < m * kHeadDim; idx += Tr::kThreads) {
    const int r = idx / kHeadDim, f = idx % kHeadDim;
    const int64_t rg = r0 + r, i = rg / G, h = hk * G + rg % G;
    SoftmaxState<float> total = state_s[0][r];
    float acc = o_s[0][r][f];
#pragma unroll
    for (int w = 1; w < Tr::kWarps; ++w) {
      float self_f, other_f;
      total.merge(state_s[w][r], &self_f, &other_f);
      acc = acc * self_f + o_s[w][r][f] * other_f;
    }
    if (split == 0 && p.sinks != nullptr) {  // the sink: one term of the denominator, once
      float self_f, other_f;
      total.merge(initial_state<float>(p, h, log2e), &self_f, &other_f);
      acc *= self_f;
    }
    if (splits == 1) {
      T* out =
          static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride;
      out[f] = Elem<T>::store(acc * total.inv_sum());
      if (f == 0) p.lse[(b * p.heads + h) * Sq + i] = total.lse();
    } else {
      const int64_t slot = (bk * rows + rg) * splits + split;
      static_cast<float*>(ws.o)[slot * kHeadDim + f] = acc;
      if (f == 0) {
        static_cast<float*>(ws.stats)[2 * slot] = total.max;
        static_cast<float*>(ws.stats)[2 * slot + 1] = total.sum;
      }
    }
  }
}

using Launch = cudaError_t (*)(const DecodeParams&, DecodeWorkspace, cudaStream_t);

template <typename T, int kHeadDim, int kRows, typename Rows, bool kMods>
cudaError_t run(const DecodeParams& p, DecodeWorkspace ws, cudaStream_t stream) {
  using Tr = SplitKvTraits<T, kHeadDim, kRows>;
  const int64_t rows = p.group() * p.seqlen_q;
  const dim3 grid(static_cast<unsigned>(p.batch * p.kv_heads * ceil_div(rows, kRows)),
                  static_cast<unsigned>(p.num_splits));
  split_kv_kernel<T, kHeadDim, kRows, Rows, kMods><<<grid, Tr::kThreads, 0, stream>>>(p, ws);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_split_merge<T, kHeadDim>(p, ws, stream);
}

// The variants of one dtype and head dim, indexed [8 rows][paged][modifiers]: the rows per
// block (the smallest that holds a KV head's rows, or 8 with several blocks), the cache-row
// policy, and softcap / ALiBi.
template <typename T, int kHeadDim>
cudaError_t run_variant(const DecodeParams& p, DecodeWorkspace ws, cudaStream_t stream) {
  constexpr int kSmall = static_cast<int>(kSplitKvSmallRows);
  constexpr int kLarge = static_cast<int>(kSplitKvRowsPerBlock);
  static constexpr Launch kVariants[2][2][2] = {
      {{run<T, kHeadDim, kSmall, ContiguousRows, false>,
        run<T, kHeadDim, kSmall, ContiguousRows, true>},
       {run<T, kHeadDim, kSmall, PagedRows, false>, run<T, kHeadDim, kSmall, PagedRows, true>}},
      {{run<T, kHeadDim, kLarge, ContiguousRows, false>,
        run<T, kHeadDim, kLarge, ContiguousRows, true>},
       {run<T, kHeadDim, kLarge, PagedRows, false>, run<T, kHeadDim, kLarge, PagedRows, true>}},
  };
  const bool large = split_kv_rows_per_block(p) == kSplitKvRowsPerBlock;
  const bool mods = p.softcap != 0.0 || p.alibi_slopes != nullptr;
  return kVariants[large][p.pages.paged()][mods](p, ws, stream);
}

}  // namespace

cudaError_t launch_decode_split_kv(const DecodeParams& p, ElemKind kind, DecodeWorkspace ws,
                                   cudaStream_t stream) {
  if (p.batch * p.kv_heads * p.group() * p.seqlen_q == 0) return cudaSuccess;
  return dispatch_elem(kind, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (std::is_same_v<T, double>) {
      return cudaErrorInvalidValue;  // fp64 stays on launch_decode (split_kv_supported)
    } else {
      switch (p.head_dim) {
        case 64:
          return run_variant<T, 64>(p, ws, stream);
        case 128:
          return run_variant<T, 128>(p, ws, stream);
        case 256:
          return run_variant<T, 256>(p, ws, stream);
        default:
          return cudaErrorInvalidValue;
      }
    }
  });
}

}  // namespace attn_ext::cuda
