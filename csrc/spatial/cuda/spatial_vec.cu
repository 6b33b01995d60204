// Vectorized CUDA kernels of the spatial-attention (CBAM) ops, sized to stream at memory
// bandwidth (compiled, not yet run on a GPU: spatial_cuda.cpp runs them only with
// ATTN_EXT_UNVERIFIED_CUDA=1). Each kernel reads x (and grad_out) once and writes its output
// once, in 16-byte accesses with several loads in flight per thread:
//   NCHW: a block covers kWarp pixel vectors (kWarp * kV pixels) of one image; its warps split
//         the channels (warp g reads channels g, g + G, ...; a warp load is 512 contiguous
//         bytes of one channel plane); reductions over channels meet in shared memory, merged in
//         warp order.
//   channels-last: a group of L lanes (a power of two) owns a pixel row of C contiguous
//         elements, each lane reading kLoads vectors of it at a time; reductions over channels
//         are shuffles within the group.
// kV = 16 bytes / sizeof(T) elements per access when the vectorized dimension (P for NCHW, C
// for channels-last) is a multiple of kV and every full-size tensor is 16-byte aligned, else
// kV = 1 (the same code, scalar accesses). Per-pixel maps (gate, pooled, argmax, grad_gate) are
// 1/C of the traffic and use scalar accesses. Accumulation and the sigmoid are fp32 (fp64 for
// fp64), in the same formulas as spatial.cu.
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include "common/cuda/elem.cuh"
#include "spatial/cuda/spatial_launch.h"

namespace attn_ext::cuda {
namespace {

using spatial::ChannelPoolBackwardParams;
using spatial::ChannelPoolParams;
using spatial::MapLayout;
using spatial::MaxArg;
using spatial::SpatialGateParams;

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Threads per block (channels-last) and the most warps of an NCHW block, one per channel group.
constexpr int kThreads = 256;
constexpr int kMaxGroups = kThreads / kWarp;
// Bytes per vector access: the widest global load / store (LDG.128 / STG.128).
constexpr int kVecBytes = 16;
// Vectors each thread loads (per input) before using any: independent loads in flight.
constexpr int kLoads = 4;
// Grids are capped at this many resident threads per SM (an H100 SM holds 2048), then stride.
constexpr int64_t kThreadsPerSm = 2048;
// Index of a MaxArg that has seen no channel: any real channel's merge replaces it.
constexpr int32_t kNoChannel = 0x7fffffff;

template <typename T>
constexpr int kVecElems = kVecBytes / static_cast<int>(sizeof(T));

template <typename acc_t>
__device__ __forceinline__ acc_t sigmoid(acc_t a) {
  return acc_t(1) / (acc_t(1) + exp(-a));
}

template <typename acc_t>
__device__ __forceinline__ MaxArg<acc_t> no_max() {
  return MaxArg<acc_t>{acc_t(-INFINITY), kNoChannel};
}

// kV elements at p (16-byte aligned when kV > 1). `ro`: read-only for the kernel's lifetime,
// so through the non-coherent cache.
template <int kV, bool ro = true, typename T>
__device__ __forceinline__ void load_vec(const T* p, T (&v)[kV]) {
  if constexpr (kV == 1) {
    v[0] = *p;
  } else {
    static_assert(kV * sizeof(T) == kVecBytes, "a vector is 16 bytes");
    const uint4 u =
        ro ? __ldg(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
    memcpy(v, &u, kVecBytes);
  }
}

template <int kV, typename T>
__device__ __forceinline__ void store_vec(T* p, const T (&v)[kV]) {
  if constexpr (kV == 1) {
    *p = v[0];
  } else {
    uint4 u;
    memcpy(&u, v, kVecBytes);
    // An explicit 128-bit store (default write-back caching): a plain assignment of u is split
    // into scalar stores where the compiler cannot prove the address 16-byte aligned.
    __stwb(reinterpret_cast<uint4*>(p), u);
  }
}

// ------------------------------------------------------------------------------ NCHW tiles

// The NCHW block's share of the work: tile t is image n, pixels [p0, p0 + kWarp * kV); this
// thread's vector starts at pixel p, in range or not at all (P % kV == 0 when kV > 1).
template <int kV>
struct PlaneTile {
  int64_t n, p0, p;
  bool valid;

  __device__ PlaneTile(const MapLayout& l, int64_t t, int64_t tiles_per_image) {
    n = t / tiles_per_image;
    p0 = (t % tiles_per_image) * (kWarp * kV);
    p = p0 + threadIdx.x * kV;
    valid = p < l.pixels;
  }
  // Offset of channel c of this thread's vector.
  __device__ int64_t at(const MapLayout& l, int64_t c) const {
    return (n * l.channels + c) * l.pixels + p;
  }
};

__device__ __forceinline__ int64_t plane_tiles(const MapLayout& l, int kV) {
  return ceil_div(l.pixels, int64_t(kWarp) * kV);
}

template <typename T, int kV>
__global__ void __launch_bounds__(kThreads) pool_nchw(ChannelPoolParams prm) {
  using acc_t = typename Elem<T>::acc_t;
  constexpr int kTile = kWarp * kV;
  __shared__ acc_t sum_s[kMaxGroups][kTile];
  __shared__ acc_t max_s[kMaxGroups][kTile];
  __shared__ int32_t arg_s[kMaxGroups][kTile];
  const MapLayout l = prm.x;
  const T* __restrict__ x = static_cast<const T*>(prm.in);
  T* __restrict__ pooled = static_cast<T*>(prm.pooled);
  const int groups = blockDim.y, g = threadIdx.y;
  const int64_t per_image = plane_tiles(l, kV);
  for (int64_t t = blockIdx.x; t < l.batch * per_image; t += gridDim.x) {
    const PlaneTile<kV> tile(l, t, per_image);
    acc_t sum[kV];
    MaxArg<acc_t> best[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) sum[j] = acc_t(0), best[j] = no_max<acc_t>();
    if (tile.valid) {
      for (int64_t c0 = g; c0 < l.channels; c0 += int64_t(groups) * kLoads) {
        T v[kLoads][kV];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t c = c0 + int64_t(u) * groups;
          if (c < l.channels) load_vec<kV>(x + tile.at(l, c), v[u]);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t c = c0 + int64_t(u) * groups;
          if (c >= l.channels) break;
#pragma unroll
          for (int j = 0; j < kV; ++j) {
            const acc_t a = Elem<T>::load(v[u][j]);
            sum[j] += a;
            best[j].merge(MaxArg<acc_t>{a, static_cast<int32_t>(c)});
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      sum_s[g][threadIdx.x * kV + j] = sum[j];
      max_s[g][threadIdx.x * kV + j] = best[j].value;
      arg_s[g][threadIdx.x * kV + j] = best[j].index;
    }
    __syncthreads();
    for (int i = g * kWarp + threadIdx.x; i < kTile; i += groups * kWarp) {
      const int64_t px = tile.p0 + i;
      if (px >= l.pixels) continue;
      acc_t s = sum_s[0][i];
      MaxArg<acc_t> m{max_s[0][i], arg_s[0][i]};
      for (int h = 1; h < groups; ++h) {
        s += sum_s[h][i];
        m.merge(MaxArg<acc_t>{max_s[h][i], arg_s[h][i]});
      }
      const int64_t r = tile.n * l.pixels + px;
      pooled[2 * r] = Elem<T>::store(s / static_cast<acc_t>(l.channels));
      pooled[2 * r + 1] = Elem<T>::store(m.value);
      prm.argmax[r] = m.index;
    }
    __syncthreads();  // the next tile reuses the shared arrays
  }
}

template <typename T, typename G, int kV>
__global__ void __launch_bounds__(kThreads) gate_nchw(SpatialGateParams prm) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = prm.x;
  const T* __restrict__ x = static_cast<const T*>(prm.in);
  const G* __restrict__ a = static_cast<const G*>(prm.gate);
  T* __restrict__ out = static_cast<T*>(prm.out);
  const int groups = blockDim.y, g = threadIdx.y;
  const int64_t per_image = plane_tiles(l, kV);
  for (int64_t t = blockIdx.x; t < l.batch * per_image; t += gridDim.x) {
    const PlaneTile<kV> tile(l, t, per_image);
    if (!tile.valid) continue;
    acc_t s[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      s[j] = sigmoid(static_cast<acc_t>(Elem<G>::load(a[tile.n * l.pixels + tile.p + j])));
    }
    for (int64_t c0 = g; c0 < l.channels; c0 += int64_t(groups) * kLoads) {
      T v[kLoads][kV];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t c = c0 + int64_t(u) * groups;
        if (c < l.channels) load_vec<kV>(x + tile.at(l, c), v[u]);
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t c = c0 + int64_t(u) * groups;
        if (c >= l.channels) break;
#pragma unroll
        for (int j = 0; j < kV; ++j) v[u][j] = Elem<T>::store(Elem<T>::load(v[u][j]) * s[j]);
        store_vec<kV>(out + tile.at(l, c), v[u]);
      }
    }
  }
}

template <typename T, typename G, int kV>
__global__ void __launch_bounds__(kThreads) gate_backward_nchw(SpatialGateParams prm) {
  using acc_t = typename Elem<T>::acc_t;
  constexpr int kTile = kWarp * kV;
  __shared__ acc_t dot_s[kMaxGroups][kTile];
  const MapLayout l = prm.x;
  const T* __restrict__ x = static_cast<const T*>(prm.in);
  const G* __restrict__ a = static_cast<const G*>(prm.gate);
  const T* __restrict__ go = static_cast<const T*>(prm.grad_out);
  T* __restrict__ gx = static_cast<T*>(prm.out);
  G* __restrict__ ga = static_cast<G*>(prm.grad_gate);
  const int groups = blockDim.y, g = threadIdx.y;
  const int64_t per_image = plane_tiles(l, kV);
  for (int64_t t = blockIdx.x; t < l.batch * per_image; t += gridDim.x) {
    const PlaneTile<kV> tile(l, t, per_image);
    acc_t s[kV], dot[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      dot[j] = acc_t(0);
      s[j] = tile.valid
                 ? sigmoid(static_cast<acc_t>(Elem<G>::load(a[tile.n * l.pixels + tile.p + j])))
                 : acc_t(0);
    }
    if (tile.valid) {
      for (int64_t c0 = g; c0 < l.channels; c0 += int64_t(groups) * kLoads) {
        T vg[kLoads][kV], vx[kLoads][kV];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t c = c0 + int64_t(u) * groups;
          if (c < l.channels) {
            load_vec<kV>(go + tile.at(l, c), vg[u]);
            load_vec<kV>(x + tile.at(l, c), vx[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t c = c0 + int64_t(u) * groups;
          if (c >= l.channels) break;
#pragma unroll
          for (int j = 0; j < kV; ++j) {
            const acc_t gj = Elem<T>::load(vg[u][j]);
            dot[j] += gj * Elem<T>::load(vx[u][j]);
            vg[u][j] = Elem<T>::store(gj * s[j]);
          }
          store_vec<kV>(gx + tile.at(l, c), vg[u]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kV; ++j) dot_s[g][threadIdx.x * kV + j] = dot[j];
    __syncthreads();
    for (int i = g * kWarp + threadIdx.x; i < kTile; i += groups * kWarp) {
      const int64_t px = tile.p0 + i;
      if (px >= l.pixels) continue;
      acc_t d = dot_s[0][i];
      for (int h = 1; h < groups; ++h) d += dot_s[h][i];
      const int64_t r = tile.n * l.pixels + px;
      const acc_t sr = sigmoid(static_cast<acc_t>(Elem<G>::load(a[r])));
      ga[r] = Elem<G>::store(d * sr * (acc_t(1) - sr));
    }
    __syncthreads();  // the next tile reuses the shared array
  }
}

template <typename T, int kV>
__global__ void __launch_bounds__(kThreads) pool_backward_nchw(ChannelPoolBackwardParams prm) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = prm.grad_x;
  const T* __restrict__ gp = static_cast<const T*>(prm.grad_pooled);
  T* gx = static_cast<T*>(prm.out);  // read too when accumulating
  const acc_t inv_c = acc_t(1) / static_cast<acc_t>(l.channels);
  const int groups = blockDim.y, g = threadIdx.y;
  const int64_t per_image = plane_tiles(l, kV);
  for (int64_t t = blockIdx.x; t < l.batch * per_image; t += gridDim.x) {
    const PlaneTile<kV> tile(l, t, per_image);
    if (!tile.valid) continue;
    acc_t avg[kV], mx[kV];
    int32_t arg[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const int64_t r = tile.n * l.pixels + tile.p + j;
      avg[j] = Elem<T>::load(gp[2 * r]) * inv_c;
      mx[j] = Elem<T>::load(gp[2 * r + 1]);
      arg[j] = prm.argmax[r];
    }
    for (int64_t c0 = g; c0 < l.channels; c0 += int64_t(groups) * kLoads) {
      T v[kLoads][kV];
      if (prm.accumulate) {
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t c = c0 + int64_t(u) * groups;
          if (c < l.channels) load_vec<kV, /*ro=*/false>(gx + tile.at(l, c), v[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t c = c0 + int64_t(u) * groups;
        if (c >= l.channels) break;
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          acc_t d = avg[j];
          if (arg[j] == c) d += mx[j];
          if (prm.accumulate) d += Elem<T>::load(v[u][j]);
          v[u][j] = Elem<T>::store(d);
        }
        store_vec<kV>(gx + tile.at(l, c), v[u]);
      }
    }
  }
}

// ------------------------------------------------------------------- channels-last rows

// The channels-last thread's share: lane li of a group of L lanes owns row r (a pixel) and its
// vectors li, li + L, ...; the groups of a warp own consecutive rows. `first`/`stride` walk
// the rows of this warp's group over the grid; every lane of a warp runs the same iterations
// (the shuffles need the whole warp), a group past the last row has valid = false.
struct RowLanes {
  int L, li;
  int64_t first, stride;

  __device__ explicit RowLanes(int lanes) : L(lanes) {
    const int lane = threadIdx.x % kWarp;
    li = lane % L;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    const int64_t rows_per_warp = kWarp / L;
    first = warp * rows_per_warp + lane / L;
    stride = int64_t(gridDim.x) * (blockDim.x / kWarp) * rows_per_warp;
  }
  // Iterations every lane of the warp runs: those of the warp's first group.
  __device__ int64_t warp_first() const { return first - (threadIdx.x % kWarp) / L; }
};

template <typename acc_t>
__device__ __forceinline__ acc_t group_sum(acc_t v, int L) {
  for (int o = L / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

template <typename acc_t>
__device__ __forceinline__ MaxArg<acc_t> group_max_arg(MaxArg<acc_t> m, int L) {
  for (int o = L / 2; o > 0; o /= 2) {
    m.merge(MaxArg<acc_t>{__shfl_xor_sync(kFullMask, m.value, o),
                          __shfl_xor_sync(kFullMask, m.index, o)});
  }
  return m;
}

template <typename T, int kV>
__global__ void __launch_bounds__(kThreads) pool_nhwc(ChannelPoolParams prm, int lanes) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = prm.x;
  const T* __restrict__ x = static_cast<const T*>(prm.in);
  T* __restrict__ pooled = static_cast<T*>(prm.pooled);
  const int64_t rows = l.batch * l.pixels, vecs = l.channels / kV;
  const RowLanes rl(lanes);
  for (int64_t w = rl.warp_first(), r = rl.first; w < rows; w += rl.stride, r += rl.stride) {
    const bool valid = r < rows;
    acc_t sum = acc_t(0);
    MaxArg<acc_t> best = no_max<acc_t>();
    if (valid) {
      const T* row = x + r * l.channels;
      for (int64_t v0 = rl.li; v0 < vecs; v0 += int64_t(rl.L) * kLoads) {
        T v[kLoads][kV];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t vi = v0 + int64_t(u) * rl.L;
          if (vi < vecs) load_vec<kV>(row + vi * kV, v[u]);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t vi = v0 + int64_t(u) * rl.L;
          if (vi >= vecs) break;
#pragma unroll
          for (int j = 0; j < kV; ++j) {
            const acc_t a = Elem<T>::load(v[u][j]);
            sum += a;
            best.merge(MaxArg<acc_t>{a, static_cast<int32_t>(vi * kV + j)});
          }
        }
      }
    }
    sum = group_sum(sum, rl.L);
    best = group_max_arg(best, rl.L);
    if (valid && rl.li == 0) {
      pooled[2 * r] = Elem<T>::store(sum / static_cast<acc_t>(l.channels));
      pooled[2 * r + 1] = Elem<T>::store(best.value);
      prm.argmax[r] = best.index;
    }
  }
}

template <typename T, typename G, int kV>
__global__ void __launch_bounds__(kThreads) gate_nhwc(SpatialGateParams prm, int lanes) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = prm.x;
  const T* __restrict__ x = static_cast<const T*>(prm.in);
  const G* __restrict__ a = static_cast<const G*>(prm.gate);
  T* __restrict__ out = static_cast<T*>(prm.out);
  const int64_t rows = l.batch * l.pixels, vecs = l.channels / kV;
  const RowLanes rl(lanes);
  for (int64_t r = rl.first; r < rows; r += rl.stride) {  // no shuffles: lanes may leave
    const acc_t s = sigmoid(static_cast<acc_t>(Elem<G>::load(a[r])));
    const int64_t base = r * l.channels;
    for (int64_t v0 = rl.li; v0 < vecs; v0 += int64_t(rl.L) * kLoads) {
      T v[kLoads][kV];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t vi = v0 + int64_t(u) * rl.L;
        if (vi < vecs) load_vec<kV>(x + base + vi * kV, v[u]);
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t vi = v0 + int64_t(u) * rl.L;
        if (vi >= vecs) break;
#pragma unroll
        for (int j = 0; j < kV; ++j) v[u][j] = Elem<T>::store(Elem<T>::load(v[u][j]) * s);
        store_vec<kV>(out + base + vi * kV, v[u]);
      }
    }
  }
}

template <typename T, typename G, int kV>
__global__ void __launch_bounds__(kThreads) gate_backward_nhwc(SpatialGateParams prm, int lanes) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = prm.x;
  const T* __restrict__ x = static_cast<const T*>(prm.in);
  const G* __restrict__ a = static_cast<const G*>(prm.gate);
  const T* __restrict__ go = static_cast<const T*>(prm.grad_out);
  T* __restrict__ gx = static_cast<T*>(prm.out);
  G* __restrict__ ga = static_cast<G*>(prm.grad_gate);
  const int64_t rows = l.batch * l.pixels, vecs = l.channels / kV;
  const RowLanes rl(lanes);
  for (int64_t w = rl.warp_first(), r = rl.first; w < rows; w += rl.stride, r += rl.stride) {
    const bool valid = r < rows;
    const acc_t s = valid ? sigmoid(static_cast<acc_t>(Elem<G>::load(a[r]))) : acc_t(0);
    acc_t dot = acc_t(0);
    if (valid) {
      const int64_t base = r * l.channels;
      for (int64_t v0 = rl.li; v0 < vecs; v0 += int64_t(rl.L) * kLoads) {
        T vg[kLoads][kV], vx[kLoads][kV];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t vi = v0 + int64_t(u) * rl.L;
          if (vi < vecs) {
            load_vec<kV>(go + base + vi * kV, vg[u]);
            load_vec<kV>(x + base + vi * kV, vx[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t vi = v0 + int64_t(u) * rl.L;
          if (vi >= vecs) break;
#pragma unroll
          for (int j = 0; j < kV; ++j) {
            const acc_t gj = Elem<T>::load(vg[u][j]);
            dot += gj * Elem<T>::load(vx[u][j]);
            vg[u][j] = Elem<T>::store(gj * s);
          }
          store_vec<kV>(gx + base + vi * kV, vg[u]);
        }
      }
    }
    dot = group_sum(dot, rl.L);
    if (valid && rl.li == 0) ga[r] = Elem<G>::store(dot * s * (acc_t(1) - s));
  }
}

template <typename T, int kV>
__global__ void __launch_bounds__(kThreads)
    pool_backward_nhwc(ChannelPoolBackwardParams prm, int lanes) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = prm.grad_x;
  const T* __restrict__ gp = static_cast<const T*>(prm.grad_pooled);
  T* gx = static_cast<T*>(prm.out);  // read too when accumulating
  const acc_t inv_c = acc_t(1) / static_cast<acc_t>(l.channels);
  const int64_t rows = l.batch * l.pixels, vecs = l.channels / kV;
  const RowLanes rl(lanes);
  for (int64_t r = rl.first; r < rows; r += rl.stride) {  // no shuffles: lanes may leave
    const acc_t avg = Elem<T>::load(gp[2 * r]) * inv_c, mx = Elem<T>::load(gp[2 * r + 1]);
    const int32_t arg = prm.argmax[r];
    const int64_t base = r * l.channels;
    for (int64_t v0 = rl.li; v0 < vecs; v0 += int64_t(rl.L) * kLoads) {
      T v[kLoads][kV];
      if (prm.accumulate) {
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t vi = v0 + int64_t(u) * rl.L;
          if (vi < vecs) load_vec<kV, /*ro=*/false>(gx + base + vi * kV, v[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t vi = v0 + int64_t(u) * rl.L;
        if (vi >= vecs) break;
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          acc_t d = avg;
          if (arg == vi * kV + j) d += mx;
          if (prm.accumulate) d += Elem<T>::load(v[u][j]);
          v[u][j] = Elem<T>::store(d);
        }
        store_vec<kV>(gx + base + vi * kV, v[u]);
      }
    }
  }
}

// ------------------------------------------------------------------------------- launches

bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kVecBytes == 0;
}

// Whether the kV-wide kernels serve l with these full-size tensors: the vectorized dimension a
// multiple of kV (so no vector crosses a plane or a row) and every pointer 16-byte aligned.
bool vectorizable(const MapLayout& l, int kV, std::initializer_list<const void*> tensors) {
  if ((l.channels_last ? l.channels : l.pixels) % kV != 0) return false;
  for (const void* p : tensors) {
    if (!aligned(p)) return false;
  }
  return true;
}

unsigned capped_grid(int64_t blocks, int threads_per_block, int sm_count) {
  const int64_t cap = int64_t(sm_count) * kThreadsPerSm / threads_per_block;
  return static_cast<unsigned>(blocks < cap ? blocks : cap);
}

// NCHW: one warp per channel group, at most kMaxGroups and at most C (at least one).
dim3 plane_block(const MapLayout& l) {
  const int64_t groups = l.channels < kMaxGroups ? l.channels : kMaxGroups;
  return dim3(kWarp, static_cast<unsigned>(groups > 0 ? groups : 1));
}

template <int kV>
unsigned plane_grid(const MapLayout& l, dim3 block, int sm_count) {
  return capped_grid(l.batch * ceil_div(l.pixels, int64_t(kWarp) * kV),
                     static_cast<int>(block.x * block.y), sm_count);
}

// Channels-last: lanes per row, the smallest power of two giving each lane at most kLoads
// vectors of the row (a warp at most).
int row_lanes(int64_t vecs) {
  int lanes = 1;
  while (lanes < kWarp && int64_t(lanes) * kLoads < vecs) lanes *= 2;
  return lanes;
}

unsigned row_grid(const MapLayout& l, int lanes, int sm_count) {
  const int64_t rows_per_block = int64_t(kThreads / lanes);
  return capped_grid(ceil_div(l.batch * l.pixels, rows_per_block), kThreads, sm_count);
}

// fn(T*, std::integral_constant<int, kV>) for x's element type and the vector width the
// pointers and sizes allow.
template <typename Fn>
cudaError_t run_vec(ElemKind kind, const MapLayout& l, std::initializer_list<const void*> tensors,
                    Fn&& fn) {
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (vectorizable(l, kVecElems<T>, tensors)) {
      fn(tag, std::integral_constant<int, kVecElems<T>>{});
    } else {
      fn(tag, std::integral_constant<int, 1>{});
    }
    return cudaGetLastError();
  });
}

// fn(T*, G*, kV) with G the gate's element type: T's, or the accumulation type (`gate_is_acc`).
template <typename Fn>
cudaError_t run_gate_vec(const SpatialGateParams& p, ElemKind kind,
                         std::initializer_list<const void*> tensors, Fn&& fn) {
  return run_vec(kind, p.x, tensors, [&](auto* tag, auto vec) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using acc_t = typename Elem<T>::acc_t;
    if (p.gate_is_acc) {
      fn(tag, static_cast<acc_t*>(nullptr), vec);
    } else {
      fn(tag, static_cast<T*>(nullptr), vec);
    }
  });
}

}  // namespace

cudaError_t launch_channel_pool_vec(const ChannelPoolParams& p, ElemKind kind, int sm_count,
                                    cudaStream_t stream) {
  const MapLayout& l = p.x;
  if (l.batch * l.pixels == 0) return cudaSuccess;
  return run_vec(kind, l, {p.in}, [&](auto* tag, auto vec) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kV = decltype(vec)::value;
    if (l.channels_last) {
      const int lanes = row_lanes(l.channels / kV);
      pool_nhwc<T, kV><<<row_grid(l, lanes, sm_count), kThreads, 0, stream>>>(p, lanes);
    } else {
      const dim3 block = plane_block(l);
      pool_nchw<T, kV><<<plane_grid<kV>(l, block, sm_count), block, 0, stream>>>(p);
    }
  });
}

cudaError_t launch_channel_pool_backward_vec(const ChannelPoolBackwardParams& p, ElemKind kind,
                                             int sm_count, cudaStream_t stream) {
  const MapLayout& l = p.grad_x;
  if (l.batch * l.channels * l.pixels == 0) return cudaSuccess;
  return run_vec(kind, l, {p.out}, [&](auto* tag, auto vec) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kV = decltype(vec)::value;
    if (l.channels_last) {
      const int lanes = row_lanes(l.channels / kV);
      pool_backward_nhwc<T, kV><<<row_grid(l, lanes, sm_count), kThreads, 0, stream>>>(p, lanes);
    } else {
      const dim3 block = plane_block(l);
      pool_backward_nchw<T, kV><<<plane_grid<kV>(l, block, sm_count), block, 0, stream>>>(p);
    }
  });
}

cudaError_t launch_spatial_gate_vec(const SpatialGateParams& p, ElemKind kind, int sm_count,
                                    cudaStream_t stream) {
  const MapLayout& l = p.x;
  if (l.batch * l.channels * l.pixels == 0) return cudaSuccess;
  return run_gate_vec(p, kind, {p.in, p.out}, [&](auto* tag, auto* gate_tag, auto vec) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using G = std::remove_pointer_t<decltype(gate_tag)>;
    constexpr int kV = decltype(vec)::value;
    if (l.channels_last) {
      const int lanes = row_lanes(l.channels / kV);
      gate_nhwc<T, G, kV><<<row_grid(l, lanes, sm_count), kThreads, 0, stream>>>(p, lanes);
    } else {
      const dim3 block = plane_block(l);
      gate_nchw<T, G, kV><<<plane_grid<kV>(l, block, sm_count), block, 0, stream>>>(p);
    }
  });
}

cudaError_t launch_spatial_gate_backward_vec(const SpatialGateParams& p, ElemKind kind,
                                             int sm_count, cudaStream_t stream) {
  const MapLayout& l = p.x;
  // C = 0 still writes grad_gate (zeros): only the pixel count bounds the work.
  if (l.batch * l.pixels == 0) return cudaSuccess;
  return run_gate_vec(p, kind, {p.in, p.out, p.grad_out}, [&](auto* tag, auto* gate_tag, auto vec) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using G = std::remove_pointer_t<decltype(gate_tag)>;
    constexpr int kV = decltype(vec)::value;
    if (l.channels_last) {
      const int lanes = row_lanes(l.channels / kV);
      gate_backward_nhwc<T, G, kV><<<row_grid(l, lanes, sm_count), kThreads, 0, stream>>>(p, lanes);
    } else {
      const dim3 block = plane_block(l);
      gate_backward_nchw<T, G, kV><<<plane_grid<kV>(l, block, sm_count), block, 0, stream>>>(p);
    }
  });
}

}  // namespace attn_ext::cuda
