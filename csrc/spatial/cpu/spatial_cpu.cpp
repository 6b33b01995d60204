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
#include <limits>
#include <type_traits>
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/cpu/cpu_support.h"
#include "common/cpu/vec_math.h"
#include "spatial/spatial_inputs.h"

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

int64_t num_tiles(const MapLayout& l) {
  return (l.pixels + kPixelTile - 1) / kPixelTile;
}

// Parallel over (image, pixel tile) tasks: fn(n, p0, len).
template <typename Fn>
void for_each_tile(const MapLayout& l, Fn&& fn) {
  const int64_t tiles = num_tiles(l);
  const int64_t grain =
      std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, l.channels * kPixelTile));
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

// Sum and (max, argmax) over the C contiguous channels of one channels-last pixel.
template <typename acc_t>
struct PixelPool {
  acc_t sum;
  MaxArg<acc_t> best;
};

// Channels from c on, one at a time (the tail after the lanes).
template <typename scalar_t, typename acc_t>
PixelPool<acc_t> pool_tail(const scalar_t* row, int64_t c, int64_t C, PixelPool<acc_t> acc) {
  for (; c < C; ++c) {
    const acc_t v = static_cast<acc_t>(row[c]);
    acc.sum += v;
    acc.best.update(v, static_cast<int32_t>(c));
  }
  return acc;
}

// The kLanes partial results of a pixel merged in lane order (index_t: the lanes' channel
// indices as the scan kept them, exact in either type).
template <typename acc_t, typename index_t>
PixelPool<acc_t> merge_lanes(const acc_t* s, const acc_t* m, const index_t* id) {
  PixelPool<acc_t> acc{s[0], MaxArg<acc_t>{m[0], static_cast<int32_t>(id[0])}};
  for (int j = 1; j < kLanes; ++j) {
    acc.best.merge(MaxArg<acc_t>{m[j], static_cast<int32_t>(id[j])});
    acc.sum += s[j];
  }
  return acc;
}

// kLanes lanes, lane j over channels j, j + kLanes, ... (the whole groups of kLanes), merged
// at the end. Lanes beyond C (C < kLanes) start as a copy of channel 0 with a zero sum, which
// the merge's tie rule (lowest channel) makes harmless.
template <typename scalar_t, typename acc_t>
PixelPool<acc_t> pool_pixel_scalar(const scalar_t* row, int64_t C) {
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
  return pool_tail(row, c, C, merge_lanes(s, m, id));
}

#ifdef ATTN_EXT_AVX2
// MaxArg::takes on lanes: v > m, or v NaN while m is not.
inline __m256 takes_ps(__m256 v, __m256 m) {
  const __m256 v_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256 m_nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
  return _mm256_or_ps(_mm256_cmp_ps(v, m, _CMP_GT_OQ), _mm256_andnot_ps(m_nan, v_nan));
}
inline __m256d takes_pd(__m256d v, __m256d m) {
  const __m256d v_nan = _mm256_cmp_pd(v, v, _CMP_UNORD_Q);
  const __m256d m_nan = _mm256_cmp_pd(m, m, _CMP_UNORD_Q);
  return _mm256_or_pd(_mm256_cmp_pd(v, m, _CMP_GT_OQ), _mm256_andnot_pd(m_nan, v_nan));
}

inline int32_t hmin_epi32(__m256i v) {
  __m128i x = _mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_min_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm_min_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(x);
}

// The same lanes as one register each, for float-accumulated types and C >= kLanes.
// MaxArg::takes becomes compare masks (v > m, or v NaN while m is not) and blends, and the
// lanes merge in registers (the max, then the lowest channel holding it); NaN lanes, rare,
// take the scalar merge. Branch-free because with random data a lane's max changes at
// unpredictable channels: the branchy scalar loop made channels-last pooling 8x slower
// than NCHW.
template <typename scalar_t>
PixelPool<float> pool_pixel_avx2(const scalar_t* row, int64_t C) {
  static_assert(kLanes == cpu::avx2::kWidth, "one lane per fp32 element of a register");
  __m256 vs = cpu::avx2::load8(row), vm = vs;
  __m256i vid = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i vc = vid;
  const __m256i step = _mm256_set1_epi32(kLanes);
  int64_t c = kLanes;
  for (; c + kLanes <= C; c += kLanes) {
    const __m256 v = cpu::avx2::load8(row + c);
    vc = _mm256_add_epi32(vc, step);
    vs = _mm256_add_ps(vs, v);
    const __m256 take = takes_ps(v, vm);
    vm = _mm256_blendv_ps(vm, v, take);
    vid = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(vid), _mm256_castsi256_ps(vc), take));
  }
  if (_mm256_movemask_ps(_mm256_cmp_ps(vm, vm, _CMP_UNORD_Q)) != 0) {
    float s[kLanes], m[kLanes];
    int32_t id[kLanes];
    _mm256_storeu_ps(s, vs);
    _mm256_storeu_ps(m, vm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(id), vid);
    return pool_tail(row, c, C, merge_lanes(s, m, id));
  }
  const float mx = cpu::avx2::hmax(vm);
  const __m256 at_max = _mm256_cmp_ps(vm, _mm256_set1_ps(mx), _CMP_EQ_OQ);
  const __m256i none = _mm256_set1_epi32(std::numeric_limits<int32_t>::max());
  const int32_t first = hmin_epi32(_mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(none), _mm256_castsi256_ps(vid), at_max)));
  return pool_tail(row, c, C, PixelPool<float>{cpu::avx2::hsum(vs), MaxArg<float>{mx, first}});
}

// float64: the kLanes lanes as two registers of four, channel indices held as doubles
// (exact) so that one blend moves value and index alike; the lanes merge in scalar code.
inline PixelPool<double> pool_pixel_avx2(const double* row, int64_t C) {
  constexpr int kHalf = kLanes / 2;
  __m256d s0 = _mm256_loadu_pd(row), s1 = _mm256_loadu_pd(row + kHalf), m0 = s0, m1 = s1;
  __m256d c0 = _mm256_setr_pd(0, 1, 2, 3), c1 = _mm256_setr_pd(4, 5, 6, 7), i0 = c0, i1 = c1;
  const __m256d step = _mm256_set1_pd(kLanes);
  int64_t c = kLanes;
  for (; c + kLanes <= C; c += kLanes) {
    const __m256d v0 = _mm256_loadu_pd(row + c), v1 = _mm256_loadu_pd(row + c + kHalf);
    c0 = _mm256_add_pd(c0, step);
    c1 = _mm256_add_pd(c1, step);
    s0 = _mm256_add_pd(s0, v0);
    s1 = _mm256_add_pd(s1, v1);
    const __m256d t0 = takes_pd(v0, m0), t1 = takes_pd(v1, m1);
    m0 = _mm256_blendv_pd(m0, v0, t0);
    m1 = _mm256_blendv_pd(m1, v1, t1);
    i0 = _mm256_blendv_pd(i0, c0, t0);
    i1 = _mm256_blendv_pd(i1, c1, t1);
  }
  double s[kLanes], m[kLanes], id[kLanes];
  _mm256_storeu_pd(s, s0);
  _mm256_storeu_pd(s + kHalf, s1);
  _mm256_storeu_pd(m, m0);
  _mm256_storeu_pd(m + kHalf, m1);
  _mm256_storeu_pd(id, i0);
  _mm256_storeu_pd(id + kHalf, i1);
  return pool_tail(row, c, C, merge_lanes(s, m, id));
}
#endif

#ifdef ATTN_EXT_AVX2
// The NCHW loops over one channel's run of pixels, 8 pixels a step, for float-accumulated
// types. Each returns how many pixels it took (a multiple of 8); the scalar loop after it takes
// the rest. Every element gets the scalar loop's operations in its order.
//
// Each also asks for the next channel's run (`next` elements on, 0 for the last channel) into
// L1, a line per line consumed: a run is 1-2 KB at the channel stride, a fresh stream that the
// hardware prefetcher finds only by missing on it. Against the compiler's loops (one process,
// interleaved, Zen 5 VM, 2026-11-29): pooling 1.6-1.7x, pooling backward 1.35-1.9x, the gate
// and its backward 1.33-1.44x in bf16 and 1.05-1.16x in fp32, nn.SpatialAttention forward +
// backward 1.08-1.30x. The same loops without the prefetch ran 0.93-1.08x: the reads, not the
// arithmetic, were what the compiler's loops lost on.
template <typename T>
inline void prefetch_along(const T* ahead, int64_t i) {
  if ((i * static_cast<int64_t>(sizeof(T))) % cpu::avx2::kCacheLine == 0)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T0);
}

// sum += v; (max, argmax) <- (v, c) where MaxArg::takes.
template <typename scalar_t>
int64_t pool_run_avx2(const scalar_t* xc, int32_t c, int64_t len, float* sum, float* mx,
                      int32_t* idx, int64_t next) {
  const __m256i vc = _mm256_set1_epi32(c);
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    prefetch_along(xc + next, i);
    const __m256 v = cpu::avx2::load8(xc + i), m = _mm256_loadu_ps(mx + i);
    _mm256_storeu_ps(sum + i, _mm256_add_ps(_mm256_loadu_ps(sum + i), v));
    const __m256 take = takes_ps(v, m);
    _mm256_storeu_ps(mx + i, _mm256_blendv_ps(m, v, take));
    auto* id = reinterpret_cast<__m256i*>(idx + i);
    const __m256 old = _mm256_castsi256_ps(_mm256_loadu_si256(id));
    _mm256_storeu_si256(id,
                        _mm256_castps_si256(_mm256_blendv_ps(old, _mm256_castsi256_ps(vc), take)));
  }
  return i;
}

// out = x * s.
template <typename scalar_t>
int64_t gate_run_avx2(const scalar_t* x, const float* s, scalar_t* out, int64_t len, int64_t next) {
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    prefetch_along(x + next, i);
    cpu::avx2::store8(out + i, _mm256_mul_ps(cpu::avx2::load8(x + i), _mm256_loadu_ps(s + i)));
  }
  return i;
}

// gx = g * s; dot += g * x (one FMA, as the compiler contracts the scalar loop).
template <typename scalar_t>
int64_t gate_backward_run_avx2(const scalar_t* go, const scalar_t* x, const float* s, scalar_t* gx,
                               float* dot, int64_t len, int64_t next) {
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    prefetch_along(go + next, i);
    prefetch_along(x + next, i);
    const __m256 g = cpu::avx2::load8(go + i);
    cpu::avx2::store8(gx + i, _mm256_mul_ps(g, _mm256_loadu_ps(s + i)));
    _mm256_storeu_ps(dot + i,
                     _mm256_fmadd_ps(g, cpu::avx2::load8(x + i), _mm256_loadu_ps(dot + i)));
  }
  return i;
}

// gx = [gx +] g_avg + (arg == c ? g_max : 0), in that order.
template <typename scalar_t, bool kAccumulate>
int64_t pool_backward_run_avx2(const float* g_avg, const float* g_max, const int32_t* arg,
                               int32_t c, scalar_t* gx, int64_t len, int64_t next) {
  const __m256i vc = _mm256_set1_epi32(c);
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    if constexpr (kAccumulate) prefetch_along(gx + next, i);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(arg + i));
    const __m256 hit = _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, vc));
    const __m256 gm = _mm256_and_ps(hit, _mm256_loadu_ps(g_max + i));
    __m256 t = _mm256_loadu_ps(g_avg + i);
    if constexpr (kAccumulate) t = _mm256_add_ps(cpu::avx2::load8(gx + i), t);
    cpu::avx2::store8(gx + i, _mm256_add_ps(t, gm));
  }
  return i;
}

// One channels-last pixel's row of C channels: row[c] = row[c] + g_avg + (c == am ? g_max : 0).
template <typename scalar_t>
int64_t pool_backward_row_avx2(scalar_t* row, int64_t C, float g_avg, float g_max, int32_t am) {
  const __m256 avg = _mm256_set1_ps(g_avg), mxv = _mm256_set1_ps(g_max);
  const __m256i vam = _mm256_set1_epi32(am), step = _mm256_set1_epi32(kLanes);
  __m256i cs = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes, cs = _mm256_add_epi32(cs, step)) {
    const __m256 gm = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(cs, vam)), mxv);
    cpu::avx2::store8(row + c, _mm256_add_ps(_mm256_add_ps(cpu::avx2::load8(row + c), avg), gm));
  }
  return c;
}

// Whether the 8-pixel loops above serve scalar_t (float-accumulated types).
template <typename scalar_t>
constexpr bool kVectorRuns = std::is_same_v<at::opmath_type<scalar_t>, float>;
#endif

template <typename scalar_t, typename acc_t>
PixelPool<acc_t> pool_pixel(const scalar_t* row, int64_t C) {
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float> || std::is_same_v<scalar_t, double>) {
    if (C >= kLanes) return pool_pixel_avx2(row, C);
  }
#endif
  return pool_pixel_scalar<scalar_t, acc_t>(row, C);
}

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
        int64_t i = 0;
#ifdef ATTN_EXT_AVX2
        if constexpr (kVectorRuns<scalar_t>)
          i = pool_run_avx2(xc, static_cast<int32_t>(c), len, sum, mx, idx, c + 1 < C ? P : 0);
#endif
        for (; i < len; ++i) {
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
    const PixelPool<acc_t> acc = pool_pixel<scalar_t, acc_t>(x + r * C, C);
    pooled[2 * r] = static_cast<scalar_t>(acc.sum / static_cast<acc_t>(C));
    pooled[2 * r + 1] = static_cast<scalar_t>(acc.best.value);
    prm.argmax[r] = acc.best.index;
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
        const int64_t next = c + 1 < C ? P : 0;
        int64_t i = 0;
#ifdef ATTN_EXT_AVX2
        if constexpr (kVectorRuns<scalar_t>)
          i = acc ? pool_backward_run_avx2<scalar_t, true>(g_avg, g_max, arg, c32, gxc, len, next)
                  : pool_backward_run_avx2<scalar_t, false>(g_avg, g_max, arg, c32, gxc, len, next);
#endif
        if (acc) {
          for (; i < len; ++i) {
            gxc[i] = static_cast<scalar_t>(static_cast<acc_t>(gxc[i]) + g_avg[i] +
                                           (arg[i] == c32 ? g_max[i] : acc_t(0)));
          }
        } else {
          for (; i < len; ++i) {
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
      int64_t c = 0;
#ifdef ATTN_EXT_AVX2
      if constexpr (kVectorRuns<scalar_t>) c = pool_backward_row_avx2(row, C, g_avg, g_max, am);
#endif
      for (; c < C; ++c) {
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
        int64_t i = 0;
#ifdef ATTN_EXT_AVX2
        if constexpr (kVectorRuns<scalar_t>)
          i = gate_run_avx2(x + off, s, out + off, len, c + 1 < C ? P : 0);
#endif
        for (; i < len; ++i) {
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

// sum_c a[c] * b[c] over C contiguous channels, in kLanes partial sums so the reduction
// vectorizes (explicitly for float-accumulated types, whose bf16 / fp16 conversions the
// compiler left scalar).
template <typename scalar_t, typename acc_t>
acc_t channel_dot(const scalar_t* a, const scalar_t* b, int64_t C) {
  int64_t c = 0;
  acc_t dot = acc_t(0);
#ifdef ATTN_EXT_AVX2
  if constexpr (std::is_same_v<acc_t, float>) {
    __m256 part = _mm256_setzero_ps();
    for (; c + kLanes <= C; c += kLanes) {
      part = _mm256_fmadd_ps(cpu::avx2::load8(a + c), cpu::avx2::load8(b + c), part);
    }
    dot = cpu::avx2::hsum(part);
  } else
#endif
  {
    acc_t part[kLanes] = {};
    for (; c + kLanes <= C; c += kLanes) {
      for (int j = 0; j < kLanes; ++j)
        part[j] += static_cast<acc_t>(a[c + j]) * static_cast<acc_t>(b[c + j]);
    }
    for (int j = 0; j < kLanes; ++j) dot += part[j];
  }
  for (; c < C; ++c) dot += static_cast<acc_t>(a[c]) * static_cast<acc_t>(b[c]);
  return dot;
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
        int64_t i = 0;
#ifdef ATTN_EXT_AVX2
        if constexpr (kVectorRuns<scalar_t>)
          i = gate_backward_run_avx2(go + off, x + off, s, gx + off, dot, len, c + 1 < C ? P : 0);
#endif
        for (; i < len; ++i) {
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
    // Two passes over the pixel's channels (in L1): one fused loop did not vectorize for
    // bf16 / fp16 (4x slower than the NCHW kernel).
    for (int64_t c = 0; c < C; ++c) o[c] = static_cast<scalar_t>(static_cast<acc_t>(gr[c]) * s);
    const acc_t dot = channel_dot<scalar_t, acc_t>(gr, xr, C);
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
    ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), kOp,
                               [&] { channel_pool_kernel<scalar_t>(in.params); });
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
  at::Tensor grad_x =
      empty_map(l, channels, grad_pooled.size(2), grad_pooled.size(3), grad_pooled.options());
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
