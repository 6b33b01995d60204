// CUDA kernels of the spatial-attention (CBAM) ops. Memory-bound: every kernel reads x (and
// grad_out) once and writes its output once, with coalesced accesses in both layouts:
//   NCHW: a thread owns a pixel and walks the channels (neighbouring threads read neighbouring
//         pixels of the same channel plane);
//   channels-last: a warp owns a pixel and its lanes stride over the contiguous channels, then
//         reduce with shuffles;
//   elementwise passes (gate forward, pooling backward): one thread per element.
// Accumulation and the sigmoid are fp32 (fp64 for fp64).
#include <cstdint>
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

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Elementwise grids are capped (then grid-stride): enough blocks to fill any current GPU.
constexpr int64_t kMaxBlocks = 65535;
// Channel loads in flight per thread in the NCHW loops (independent loads hide latency).
constexpr int kUnroll = 4;

template <typename acc_t>
__device__ __forceinline__ acc_t sigmoid(acc_t a) {
  return acc_t(1) / (acc_t(1) + exp(-a));
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

template <typename acc_t>
__device__ __forceinline__ MaxArg<acc_t> warp_max_arg(MaxArg<acc_t> m) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    MaxArg<acc_t> other{__shfl_xor_sync(kFullMask, m.value, o),
                        __shfl_xor_sync(kFullMask, m.index, o)};
    m.merge(other);
  }
  return m;
}

unsigned grid_for(int64_t work, int64_t per_block) {
  const int64_t blocks = ceil_div(work, per_block);
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// ------------------------------------------------------------------------- channel pooling

template <typename T>
__global__ void __launch_bounds__(kThreads) channel_pool_nchw(ChannelPoolParams p) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = p.x;
  const T* x = static_cast<const T*>(p.in);
  T* pooled = static_cast<T*>(p.pooled);
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < l.batch * l.pixels;
       r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = r / l.pixels, px = r % l.pixels;
    const T* xp = x + n * l.channels * l.pixels + px;
    acc_t sum = Elem<T>::load(xp[0]);
    MaxArg<acc_t> best{sum, 0};
#pragma unroll kUnroll
    for (int64_t c = 1; c < l.channels; ++c) {
      const acc_t v = Elem<T>::load(xp[c * l.pixels]);
      sum += v;
      best.update(v, static_cast<int32_t>(c));
    }
    pooled[2 * r] = Elem<T>::store(sum / static_cast<acc_t>(l.channels));
    pooled[2 * r + 1] = Elem<T>::store(best.value);
    p.argmax[r] = best.index;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) channel_pool_nhwc(ChannelPoolParams p) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = p.x;
  const T* x = static_cast<const T*>(p.in);
  T* pooled = static_cast<T*>(p.pooled);
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; r < l.batch * l.pixels;
       r += warps) {
    const T* row = x + r * l.channels;
    // Lanes past C start from channel 0, which the merge's tie rule makes harmless.
    const int64_t c0 = lane < l.channels ? lane : 0;
    acc_t sum = lane < l.channels ? Elem<T>::load(row[c0]) : acc_t(0);
    MaxArg<acc_t> best{Elem<T>::load(row[c0]), static_cast<int32_t>(c0)};
    for (int64_t c = lane + kWarp; c < l.channels; c += kWarp) {
      const acc_t v = Elem<T>::load(row[c]);
      sum += v;
      best.update(v, static_cast<int32_t>(c));
    }
    sum = warp_sum(sum);
    best = warp_max_arg(best);
    if (lane == 0) {
      pooled[2 * r] = Elem<T>::store(sum / static_cast<acc_t>(l.channels));
      pooled[2 * r + 1] = Elem<T>::store(best.value);
      p.argmax[r] = best.index;
    }
  }
}

// One thread per element of grad_x: g_avg / C plus g_max at the argmax channel (added to
// grad_x's value when accumulating).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    channel_pool_backward_kernel(ChannelPoolBackwardParams p) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = p.grad_x;
  const T* gp = static_cast<const T*>(p.grad_pooled);
  T* gx = static_cast<T*>(p.out);
  const int64_t total = l.batch * l.channels * l.pixels;
  const acc_t inv_c = acc_t(1) / static_cast<acc_t>(l.channels);
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    int64_t c, r;  // channel, pixel row n * P + p
    if (l.channels_last) {
      c = e % l.channels;
      r = e / l.channels;
    } else {
      c = (e / l.pixels) % l.channels;
      r = (e / (l.channels * l.pixels)) * l.pixels + e % l.pixels;
    }
    acc_t g = Elem<T>::load(gp[2 * r]) * inv_c;
    if (p.argmax[r] == c) g += Elem<T>::load(gp[2 * r + 1]);
    if (p.accumulate) g += Elem<T>::load(gx[e]);
    gx[e] = Elem<T>::store(g);
  }
}

// ------------------------------------------------------------------------------ gate apply

template <typename T, typename G>
__global__ void __launch_bounds__(kThreads) spatial_gate_kernel(SpatialGateParams p) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = p.x;
  const T* x = static_cast<const T*>(p.in);
  const G* a = static_cast<const G*>(p.gate);
  T* out = static_cast<T*>(p.out);
  const int64_t total = l.batch * l.channels * l.pixels;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r =
        l.channels_last ? e / l.channels : (e / (l.channels * l.pixels)) * l.pixels + e % l.pixels;
    out[e] = Elem<T>::store(Elem<T>::load(x[e]) * sigmoid(static_cast<acc_t>(Elem<G>::load(a[r]))));
  }
}

template <typename T, typename G>
__global__ void __launch_bounds__(kThreads) spatial_gate_backward_nchw(SpatialGateParams p) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = p.x;
  const T* x = static_cast<const T*>(p.in);
  const G* a = static_cast<const G*>(p.gate);
  const T* go = static_cast<const T*>(p.grad_out);
  T* gx = static_cast<T*>(p.out);
  G* ga = static_cast<G*>(p.grad_gate);
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < l.batch * l.pixels;
       r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = r / l.pixels, px = r % l.pixels;
    const acc_t s = sigmoid(static_cast<acc_t>(Elem<G>::load(a[r])));
    const int64_t base = n * l.channels * l.pixels + px;
    acc_t dot = acc_t(0);
#pragma unroll kUnroll
    for (int64_t c = 0; c < l.channels; ++c) {
      const int64_t i = base + c * l.pixels;
      const acc_t g = Elem<T>::load(go[i]);
      gx[i] = Elem<T>::store(g * s);
      dot += g * Elem<T>::load(x[i]);
    }
    ga[r] = Elem<G>::store(dot * s * (acc_t(1) - s));
  }
}

template <typename T, typename G>
__global__ void __launch_bounds__(kThreads) spatial_gate_backward_nhwc(SpatialGateParams p) {
  using acc_t = typename Elem<T>::acc_t;
  const MapLayout l = p.x;
  const T* x = static_cast<const T*>(p.in);
  const G* a = static_cast<const G*>(p.gate);
  const T* go = static_cast<const T*>(p.grad_out);
  T* gx = static_cast<T*>(p.out);
  G* ga = static_cast<G*>(p.grad_gate);
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; r < l.batch * l.pixels;
       r += warps) {
    const acc_t s = sigmoid(static_cast<acc_t>(Elem<G>::load(a[r])));
    acc_t dot = acc_t(0);
    for (int64_t c = lane; c < l.channels; c += kWarp) {
      const int64_t i = r * l.channels + c;
      const acc_t g = Elem<T>::load(go[i]);
      gx[i] = Elem<T>::store(g * s);
      dot += g * Elem<T>::load(x[i]);
    }
    dot = warp_sum(dot);
    if (lane == 0) ga[r] = Elem<G>::store(dot * s * (acc_t(1) - s));
  }
}

template <typename Fn>
cudaError_t run(ElemKind kind, Fn&& fn) {
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fn(static_cast<T*>(nullptr));
    return cudaGetLastError();
  });
}

// fn(T*, G*) with G the gate's element type: T's, or the accumulation type (`gate_is_acc`).
template <typename Fn>
cudaError_t run_gate(const SpatialGateParams& p, ElemKind kind, Fn&& fn) {
  return run(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using acc_t = typename Elem<T>::acc_t;
    if (p.gate_is_acc) {
      fn(tag, static_cast<acc_t*>(nullptr));
    } else {
      fn(tag, static_cast<T*>(nullptr));
    }
  });
}

}  // namespace

cudaError_t launch_channel_pool(const ChannelPoolParams& p, ElemKind kind, cudaStream_t stream) {
  const int64_t rows = p.x.batch * p.x.pixels;
  if (rows == 0) return cudaSuccess;
  return run(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (p.x.channels_last) {
      channel_pool_nhwc<T><<<grid_for(rows, kThreads / kWarp), kThreads, 0, stream>>>(p);
    } else {
      channel_pool_nchw<T><<<grid_for(rows, kThreads), kThreads, 0, stream>>>(p);
    }
  });
}

cudaError_t launch_channel_pool_backward(const ChannelPoolBackwardParams& p, ElemKind kind,
                                         cudaStream_t stream) {
  const int64_t total = p.grad_x.batch * p.grad_x.channels * p.grad_x.pixels;
  if (total == 0) return cudaSuccess;
  return run(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    channel_pool_backward_kernel<T><<<grid_for(total, kThreads), kThreads, 0, stream>>>(p);
  });
}

cudaError_t launch_spatial_gate(const SpatialGateParams& p, ElemKind kind, cudaStream_t stream) {
  const int64_t total = p.x.batch * p.x.channels * p.x.pixels;
  if (total == 0) return cudaSuccess;
  return run_gate(p, kind, [&](auto* tag, auto* gate_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using G = std::remove_pointer_t<decltype(gate_tag)>;
    spatial_gate_kernel<T, G><<<grid_for(total, kThreads), kThreads, 0, stream>>>(p);
  });
}

cudaError_t launch_spatial_gate_backward(const SpatialGateParams& p, ElemKind kind,
                                         cudaStream_t stream) {
  const int64_t rows = p.x.batch * p.x.pixels;
  if (rows == 0) return cudaSuccess;
  return run_gate(p, kind, [&](auto* tag, auto* gate_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using G = std::remove_pointer_t<decltype(gate_tag)>;
    if (p.x.channels_last) {
      spatial_gate_backward_nhwc<T, G>
          <<<grid_for(rows, kThreads / kWarp), kThreads, 0, stream>>>(p);
    } else {
      spatial_gate_backward_nchw<T, G><<<grid_for(rows, kThreads), kThreads, 0, stream>>>(p);
    }
  });
}

}  // namespace attn_ext::cuda
