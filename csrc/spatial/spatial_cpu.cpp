// CPU kernels of the spatial-attention (CBAM) ops: the fused channel pooling (mean and max in
// one read of x), the sigmoid gate x * sigmoid(a), and their backwards. Memory-bound: each
// kernel reads x (and grad_out) once and writes its output once.
//
// NCHW: a task is one tile of pixels of one image; it walks the channels, each a contiguous
// run of kPixelTile elements, keeping per-pixel state (sums, maxima, dot products) in a small
// buffer; the inner loops over pixels are branch-free so the compiler vectorizes them.
// Channels-last: a task is a run of pixels; each pixel's C channels are contiguous.
// Accumulation and the sigmoid run in fp32 (fp64 for fp64).
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/dispatch.h"
#include "../cpu/cpu_support.h"
#include "spatial_inputs.h"

namespace attn_ext::spatial {
namespace {

// Pixels per NCHW task: the per-pixel state (three arrays of 512 at most 8-byte values,
// 12 KiB) stays in L1 while each channel streams one 2 KiB (fp32) contiguous run.
constexpr int64_t kPixelTile = 512;
// Elements per parallel chunk: below this the threading overhead outweighs the work.
constexpr int64_t kGrainElems = 32768;
// Independent (max, argmax) lanes of a channels-last pixel: one AVX2 register of fp32, so the
// scan over contiguous channels vectorizes; the lanes merge at the end of the pixel.
constexpr int kLanes = 8;

template <typename acc_t>
inline acc_t sigmoid(acc_t a) {
  return acc_t(1) / (acc_t(1) + std::exp(-a));
}

int64_t num_tiles(const MapLayout& l) { return (l.pixels + kPixelTile - 1) / kPixelTile; }

// Parallel over (image, pixel tile) tasks: fn(n, p0, len).
template <typename Fn>
void for_each_tile(const MapLayout& l, Fn&& fn) {
  const int64_t tiles = num_tiles(l);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, l.channels * kPixelTile));
  at::parallel_for(0, l.batch * tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t / tiles, p0 = (t % tiles) * kPixelTile;
      fn(n, p0, std::min(kPixelTile, l.pixels - p0));
    }
  });
}

// Parallel over the N * P pixels of a channels-last map: fn(row) with row = n * P + p.
template <typename Fn>
void for_each_pixel(const MapLayout& l, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, l.channels));
  at::parallel_for(0, l.batch * l.pixels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

// ------------------------------------------------------------------------- channel pooling

template <typename scalar_t>
void channel_pool_kernel(const ChannelPoolParams& prm) {
  using acc_t = at::opmath_type<scalar_t>;
  const MapLayout& l = prm.x;
  const int64_t C = l.channels, P = l.pixels;
  const auto* x = static_cast<const scalar_t*>(prm.in);
  auto* pooled = static_cast<scalar_t*>(prm.pooled);
  if (!l.channels_last) {
    for_each_tile(l, [&](int64_t n, int64_t p0, int64_t len) {
      acc_t sum[kPixelTile], mx[kPixelTile];
      int32_t idx[kPixelTile];
      const scalar_t* xn = x + n * C * P + p0;
      for (int64_t i = 0; i < len; ++i) {
        sum[i] = mx[i] = static_cast<acc_t>(xn[i]);
        idx[i] = 0;
      }
      for (int64_t c = 1; c < C; ++c) {
        const scalar_t* xc = xn + c * P;
        for (int64_t i = 0; i < len; ++i) {
          const acc_t v = static_cast<acc_t>(xc[i]);
          sum[i] += v;
          const bool take = MaxArg<acc_t>::takes(v, mx[i]);
          mx[i] = take ? v : mx[i];
          idx[i] = take ? static_cast<int32_t>(c) : idx[i];
        }
      }
      scalar_t* out = pooled + 2 * (n * P + p0);
      int32_t* arg_out = prm.argmax + n * P + p0;
      for (int64_t i = 0; i < len; ++i) {
        out[2 * i] = static_cast<scalar_t>(sum[i] / static_cast<acc_t>(C));
        out[2 * i + 1] = static_cast<scalar_t>(mx[i]);
        arg_out[i] = idx[i];
      }
    });
    return;
  }
  for_each_pixel(l, [&](int64_t r) {
    const scalar_t* row = x + r * C;
    // Lane j scans channels j, j + kLanes, ...; lanes beyond C start as a copy of channel 0,
    // which the merge's tie rule (lowest channel) makes harmless.
    acc_t s[kLanes], m[kLanes];
    int32_t id[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      const int64_t c = j < C ? j : 0;
      m[j] = static_cast<acc_t>(row[c]);
      id[j] = static_cast<int32_t>(c);
      s[j] = j < C ? m[j] : acc_t(0);
    }
    int64_t c = kLanes;
    for (; c + kLanes <= C; c += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const acc_t v = static_cast<acc_t>(row[c + j]);
        s[j] += v;
        const bool take = MaxArg<acc_t>::takes(v, m[j]);
        m[j] = take ? v : m[j];
        id[j] = take ? static_cast<int32_t>(c + j) : id[j];
      }
    }
    MaxArg<acc_t> best{m[0], id[0]};
    acc_t sum = s[0];
    for (int j = 1; j < kLanes; ++j) {
      best.merge(MaxArg<acc_t>{m[j], id[j]});
      sum += s[j];
    }
    for (; c < C; ++c) {
      const acc_t v = static_cast<acc_t>(row[c]);
      sum += v;
      best.update(v, static_cast<int32_t>(c));
    }
    pooled[2 * r] = static_cast<scalar_t>(sum / static_cast<acc_t>(C));
    pooled[2 * r + 1] = static_cast<scalar_t>(best.value);
    prm.argmax[r] = best.index;
  });
}

template <typename scalar_t>
void channel_pool_backward_kernel(const ChannelPoolBackwardParams& prm) {
  using acc_t = at::opmath_type<scalar_t>;
  const MapLayout& l = prm.grad_x;
  const int64_t C = l.channels, P = l.pixels;
  const acc_t inv_c = acc_t(1) / static_cast<acc_t>(C);
  const auto* gp = static_cast<const scalar_t*>(prm.grad_pooled);
  auto* gx = static_cast<scalar_t*>(prm.out);
  const bool acc = prm.accumulate;
  if (!l.channels_last) {
    for_each_tile(l, [&](int64_t n, int64_t p0, int64_t len) {
      acc_t g_avg[kPixelTile], g_max[kPixelTile];
      const scalar_t* g = gp + 2 * (n * P + p0);
      const int32_t* arg = prm.argmax + n * P + p0;
      for (int64_t i = 0; i < len; ++i) {
        g_avg[i] = static_cast<acc_t>(g[2 * i]) * inv_c;
        g_max[i] = static_cast<acc_t>(g[2 * i + 1]);
      }
      scalar_t* gxn = gx + n * C * P + p0;
      for (int64_t c = 0; c < C; ++c) {
        scalar_t* gxc = gxn + c * P;
        const int32_t c32 = static_cast<int32_t>(c);
        if (acc) {
          for (int64_t i = 0; i < len; ++i) {
            gxc[i] = static_cast<scalar_t>(static_cast<acc_t>(gxc[i]) + g_avg[i] +
                                           (arg[i] == c32 ? g_max[i] : acc_t(0)));
          }
        } else {
          for (int64_t i = 0; i < len; ++i) {
            gxc[i] = static_cast<scalar_t>(g_avg[i] + (arg[i] == c32 ? g_max[i] : acc_t(0)));
          }
        }
      }
    });
    return;
  }
  for_each_pixel(l, [&](int64_t r) {
    const acc_t g_avg = static_cast<acc_t>(gp[2 * r]) * inv_c;
    const acc_t g_max = static_cast<acc_t>(gp[2 * r + 1]);
    scalar_t* row = gx + r * C;
    const int32_t am = prm.argmax[r];
    if (acc) {
      for (int64_t c = 0; c < C; ++c) {
        row[c] = static_cast<scalar_t>(static_cast<acc_t>(row[c]) + g_avg +
                                       (c == am ? g_max : acc_t(0)));
      }
    } else {
      const scalar_t fill = static_cast<scalar_t>(g_avg);
      for (int64_t c = 0; c < C; ++c) row[c] = fill;
      row[am] = static_cast<scalar_t>(g_avg + g_max);
    }
  });
}

// ------------------------------------------------------------------------------ gate apply

template <typename scalar_t, typename gate_t>
void spatial_gate_kernel(const SpatialGateParams& prm) {
  using acc_t = at::opmath_type<scalar_t>;
  const MapLayout& l = prm.x;
  const int64_t C = l.channels, P = l.pixels;
  const auto* x = static_cast<const scalar_t*>(prm.in);
  const auto* a = static_cast<const gate_t*>(prm.gate);
  auto* out = static_cast<scalar_t*>(prm.out);
  if (!l.channels_last) {
    for_each_tile(l, [&](int64_t n, int64_t p0, int64_t len) {
      acc_t s[kPixelTile];
      for (int64_t i = 0; i < len; ++i) s[i] = sigmoid(static_cast<acc_t>(a[n * P + p0 + i]));
      for (int64_t c = 0; c < C; ++c) {
        const int64_t off = (n * C + c) * P + p0;
        for (int64_t i = 0; i < len; ++i) {
          out[off + i] = static_cast<scalar_t>(static_cast<acc_t>(x[off + i]) * s[i]);
        }
      }
    });
    return;
  }
  for_each_pixel(l, [&](int64_t r) {
    const acc_t s = sigmoid(static_cast<acc_t>(a[r]));
    const scalar_t* xr = x + r * C;
    scalar_t* o = out + r * C;
    for (int64_t c = 0; c < C; ++c) o[c] = static_cast<scalar_t>(static_cast<acc_t>(xr[c]) * s);
  });
}

template <typename scalar_t, typename gate_t>
void spatial_gate_backward_kernel(const SpatialGateParams& prm) {
  using acc_t = at::opmath_type<scalar_t>;
  const MapLayout& l = prm.x;
  const int64_t C = l.channels, P = l.pixels;
  const auto* x = static_cast<const scalar_t*>(prm.in);
  const auto* a = static_cast<const gate_t*>(prm.gate);
  const auto* go = static_cast<const scalar_t*>(prm.grad_out);
  auto* gx = static_cast<scalar_t*>(prm.out);
  auto* ga = static_cast<gate_t*>(prm.grad_gate);
  if (!l.channels_last) {
    for_each_tile(l, [&](int64_t n, int64_t p0, int64_t len) {
      acc_t s[kPixelTile], dot[kPixelTile];
      for (int64_t i = 0; i < len; ++i) {
        s[i] = sigmoid(static_cast<acc_t>(a[n * P + p0 + i]));
        dot[i] = acc_t(0);
      }
      for (int64_t c = 0; c < C; ++c) {
        const int64_t off = (n * C + c) * P + p0;
        for (int64_t i = 0; i < len; ++i) {
          const acc_t g = static_cast<acc_t>(go[off + i]);
          gx[off + i] = static_cast<scalar_t>(g * s[i]);
          dot[i] += g * static_cast<acc_t>(x[off + i]);
        }
      }
      for (int64_t i = 0; i < len; ++i) {
        ga[n * P + p0 + i] = static_cast<gate_t>(dot[i] * s[i] * (acc_t(1) - s[i]));
      }
    });
    return;
  }
  for_each_pixel(l, [&](int64_t r) {
    const acc_t s = sigmoid(static_cast<acc_t>(a[r]));
    const scalar_t* xr = x + r * C;
    const scalar_t* gr = go + r * C;
    scalar_t* o = gx + r * C;
    // kLanes partial dot products so the reduction vectorizes.
    acc_t part[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= C; c += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const acc_t g = static_cast<acc_t>(gr[c + j]);
        o[c + j] = static_cast<scalar_t>(g * s);
        part[j] += g * static_cast<acc_t>(xr[c + j]);
      }
    }
    acc_t dot = acc_t(0);
    for (int j = 0; j < kLanes; ++j) dot += part[j];
    for (; c < C; ++c) {
      const acc_t g = static_cast<acc_t>(gr[c]);
      o[c] = static_cast<scalar_t>(g * s);
      dot += g * static_cast<acc_t>(xr[c]);
    }
    ga[r] = static_cast<gate_t>(dot * s * (acc_t(1) - s));
  });
}

// ------------------------------------------------------------------------------------ ops

// fn(gate_t*) with gate_t x's element type or, for a float32 gate, the accumulation type.
template <typename scalar_t, typename Fn>
void with_gate_type(const SpatialGateParams& p, Fn&& fn) {
  using acc_t = at::opmath_type<scalar_t>;
  if (p.gate_is_acc) {
    fn(static_cast<acc_t*>(nullptr));
  } else {
    fn(static_cast<scalar_t*>(nullptr));
  }
}

std::tuple<at::Tensor, at::Tensor> channel_pool_cpu(const at::Tensor& x) {
  constexpr const char* kOp = "attn_ext.channel_pool";
  cpu::check_cpu_support(kOp);
  PreparedPool in = prepare_channel_pool(kOp, x);
  const MapLayout& l = in.params.x;
  at::Tensor pooled = at::empty({l.batch, 2, x.size(2), x.size(3)},
                                x.options().memory_format(at::MemoryFormat::ChannelsLast));
  at::Tensor argmax = at::empty({l.batch, 1, x.size(2), x.size(3)}, x.options().dtype(at::kInt));
  in.params.pooled = pooled.data_ptr();
  in.params.argmax = argmax.data_ptr<int32_t>();
  if (pooled.numel() > 0) {
    ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), kOp, [&] { channel_pool_kernel<scalar_t>(in.params); });
  }
  return {pooled, argmax};
}

at::Tensor channel_pool_backward_cpu(const at::Tensor& grad_pooled, const at::Tensor& argmax,
                                     int64_t channels, bool channels_last) {
  constexpr const char* kOp = "attn_ext.channel_pool_backward";
  cpu::check_cpu_support(kOp);
  PreparedPoolBackward in =
      prepare_channel_pool_backward(kOp, grad_pooled, argmax, channels, channels_last);
  const MapLayout& l = in.params.grad_x;
  at::Tensor grad_x = empty_map(l, channels, grad_pooled.size(2), grad_pooled.size(3),
                                grad_pooled.options());
  in.params.out = grad_x.data_ptr();
  if (grad_x.numel() > 0) {
    ATTN_EXT_DISPATCH_FLOATING(grad_pooled.scalar_type(), kOp,
                               [&] { channel_pool_backward_kernel<scalar_t>(in.params); });
  }
  return grad_x;
}

void channel_pool_backward_accumulate_cpu(at::Tensor& grad_x, const at::Tensor& grad_pooled,
                                          const at::Tensor& argmax) {
  constexpr const char* kOp = "attn_ext.channel_pool_backward_accumulate_";
  cpu::check_cpu_support(kOp);
  PreparedPoolBackward in = prepare_channel_pool_accumulate(kOp, grad_x, grad_pooled, argmax);
  if (grad_x.numel() > 0) {
    ATTN_EXT_DISPATCH_FLOATING(grad_x.scalar_type(), kOp,
                               [&] { channel_pool_backward_kernel<scalar_t>(in.params); });
  }
}

at::Tensor spatial_gate_cpu(const at::Tensor& x, const at::Tensor& gate) {
  constexpr const char* kOp = "attn_ext.spatial_gate";
  cpu::check_cpu_support(kOp);
  PreparedGate in = prepare_spatial_gate(kOp, x, gate, at::Tensor());
  at::Tensor out = empty_map(in.params.x, x.size(1), x.size(2), x.size(3), x.options());
  in.params.out = out.data_ptr();
  if (out.numel() > 0) {
    ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), kOp, [&] {
      with_gate_type<scalar_t>(in.params, [&](auto* tag) {
        spatial_gate_kernel<scalar_t, std::remove_pointer_t<decltype(tag)>>(in.params);
      });
    });
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> spatial_gate_backward_cpu(const at::Tensor& grad_out,
                                                             const at::Tensor& x,
                                                             const at::Tensor& gate) {
  constexpr const char* kOp = "attn_ext.spatial_gate_backward";
  cpu::check_cpu_support(kOp);
  PreparedGate in = prepare_spatial_gate(kOp, x, gate, grad_out);
  const MapLayout& l = in.params.x;
  at::Tensor grad_x = empty_map(l, x.size(1), x.size(2), x.size(3), x.options());
  at::Tensor grad_gate =
      at::empty({l.batch, 1, x.size(2), x.size(3)}, x.options().dtype(gate.scalar_type()));
  in.params.out = grad_x.data_ptr();
  in.params.grad_gate = grad_gate.data_ptr();
  if (grad_x.numel() > 0) {
    ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), kOp, [&] {
      with_gate_type<scalar_t>(in.params, [&](auto* tag) {
        spatial_gate_backward_kernel<scalar_t, std::remove_pointer_t<decltype(tag)>>(in.params);
      });
    });
  } else {
    grad_gate.zero_();  // no channels: the gate received no gradient
  }
  return {grad_x, grad_gate};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("channel_pool", &channel_pool_cpu);
  m.impl("channel_pool_backward", &channel_pool_backward_cpu);
  m.impl("channel_pool_backward_accumulate_", &channel_pool_backward_accumulate_cpu);
  m.impl("spatial_gate", &spatial_gate_cpu);
  m.impl("spatial_gate_backward", &spatial_gate_backward_cpu);
}

}  // namespace attn_ext::spatial
