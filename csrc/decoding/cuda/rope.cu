// CUDA RoPE and KV-cache append. One thread block per (sequence, token): the block builds the
// token's cos/sin table in shared memory and rotates every head's row with it.
#include <cstdint>
#include <type_traits>
#include "common/rope.h"
#include "common/cuda/elem.cuh"
#include "decoding/cuda/decoding_launch.h"

namespace attn_ext::cuda {
namespace {

constexpr int kThreads = 128;

// cos / sin of every pair at `pos` times the policy's attention_scaling into shared memory
// (sin negated for the inverse).
template <typename acc_t>
__device__ void rope_table(const RopePolicy& pol, int64_t pos, bool inverse, acc_t* cos_t,
                           acc_t* sin_t) {
  const acc_t scaling = static_cast<acc_t>(pol.attention_scaling);
  for (int64_t i = threadIdx.x; i < pol.pairs(); i += blockDim.x) {
    const acc_t a = static_cast<acc_t>(RopePolicy::angle(pos, pol.inv_freq(i)));
    cos_t[i] = cos(a) * scaling;
    sin_t[i] = (inverse ? -sin(a) : sin(a)) * scaling;
  }
  __syncthreads();
}

// Rotates `rows` rows (row h at x + h * x_row_stride) of one token; y may alias x.
template <typename T, typename acc_t>
__device__ void rope_rows(const RopePolicy& pol, const T* x, int64_t x_head, int64_t xs, T* y,
                          int64_t y_head, int64_t ys, int64_t rows, int64_t d, const acc_t* cos_t,
                          const acc_t* sin_t) {
  const int64_t pairs = pol.pairs();
  for (int64_t idx = threadIdx.x; idx < rows * pairs; idx += blockDim.x) {
    const int64_t h = idx / pairs, i = idx % pairs;
    const T* xr = x + h * x_head;
    T* yr = y + h * y_head;
    const int64_t f = pol.first(i), s = pol.second(i);
    acc_t y0, y1;
    rotate_pair(Elem<T>::load(xr[f * xs]), Elem<T>::load(xr[s * xs]), cos_t[i], sin_t[i], &y0, &y1);
    yr[f * ys] = Elem<T>::store(y0);
    yr[s * ys] = Elem<T>::store(y1);
  }
  if (x != y) {
    const int64_t rest = d - pol.rotary_dim;
    for (int64_t idx = threadIdx.x; idx < rows * rest; idx += blockDim.x) {
      const int64_t h = idx / rest, j = pol.rotary_dim + idx % rest;
      y[h * y_head + j * ys] = x[h * x_head + j * xs];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p) {
  using acc_t = typename Elem<T>::acc_t;
  extern __shared__ unsigned char smem_raw[];
  acc_t* cos_t = reinterpret_cast<acc_t*>(smem_raw);
  acc_t* sin_t = cos_t + p.policy.pairs();
  const int64_t b = blockIdx.x / p.seqlen, s = blockIdx.x % p.seqlen;
  rope_table(p.policy, p.position(b, s), p.inverse, cos_t, sin_t);
  const T* x = static_cast<const T*>(p.x) + b * p.x_batch_stride + s * p.x_row_stride;
  T* y = static_cast<T*>(p.out) + b * p.o_batch_stride + s * p.o_row_stride;
  rope_rows(p.policy, x, p.x_head_stride, p.x_col_stride, y, p.o_head_stride, p.o_col_stride,
            p.heads, p.head_dim, cos_t, sin_t);
}

// True when every sequence fits and, paged, every table entry its new rows land in names a
// page of the cache: the append is all or nothing. (The contiguous instantiation compiles to
// the kernels as they were before paged caches.)
template <bool kPaged>
__device__ bool append_fits(const KVAppendParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = p.lengths[b], add = p.appended[b];
    if (len < 0 || add < 0 || add > p.seqlen_new || len + add > p.capacity) return false;
    if constexpr (kPaged) {
      for (int64_t i = len / p.pages.page_size; add > 0 && i <= (len + add - 1) / p.pages.page_size;
           ++i) {
        const int64_t page = p.pages.table[b * p.pages.row_stride + i];
        if (page < 0 || page >= p.pages.num_pages) return false;
      }
    }
  }
  return true;
}

template <typename T, bool kPaged>
__global__ void __launch_bounds__(kThreads) kv_append_kernel(KVAppendParams p) {
  using acc_t = typename Elem<T>::acc_t;
  extern __shared__ unsigned char smem_raw[];
  acc_t* cos_t = reinterpret_cast<acc_t*>(smem_raw);
  acc_t* sin_t = cos_t + p.policy.pairs();
  if (!append_fits<kPaged>(p)) return;
  const int64_t b = blockIdx.x / p.seqlen_new, t = blockIdx.x % p.seqlen_new;
  const int64_t first = p.seqlen_new - p.appended[b];  // inputs are left-padded
  if (t < first) return;
  const int64_t row = p.lengths[b] + (t - first);
  // Where the row goes: row `row` of sequence b, or through the block table.
  const CacheSlot dst = kPaged ? p.pages.locate(b, row) : CacheSlot{b, row};
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + t * p.k_row_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + t * p.v_row_stride;
  T* kc = static_cast<T*>(p.k_cache) + dst.block * p.kc_batch_stride + dst.row * p.kc_row_stride;
  T* vc = static_cast<T*>(p.v_cache) + dst.block * p.vc_batch_stride + dst.row * p.vc_row_stride;
  if (p.rope) {
    rope_table(p.policy, row, false, cos_t, sin_t);
    rope_rows(p.policy, k, p.k_head_stride, p.k_col_stride, kc, p.kc_head_stride, 1, p.kv_heads,
              p.head_dim, cos_t, sin_t);
  } else {
    for (int64_t idx = threadIdx.x; idx < p.kv_heads * p.head_dim; idx += blockDim.x) {
      const int64_t h = idx / p.head_dim, j = idx % p.head_dim;
      kc[h * p.kc_head_stride + j] = k[h * p.k_head_stride + j * p.k_col_stride];
    }
  }
  for (int64_t idx = threadIdx.x; idx < p.kv_heads * p.head_dim_v; idx += blockDim.x) {
    const int64_t h = idx / p.head_dim_v, j = idx % p.head_dim_v;
    vc[h * p.vc_head_stride + j] = v[h * p.v_head_stride + j * p.v_col_stride];
  }
}

// Runs after the append on the same stream: advances every length, or none.
template <typename I, bool kPaged>
__global__ void advance_lengths_kernel(KVAppendParams p, I* cache_seqlens) {
  const bool fits = append_fits<kPaged>(p);
  __syncthreads();  // every thread has read the old lengths before any is written
  for (int64_t b = threadIdx.x; fits && b < p.batch; b += blockDim.x) {
    cache_seqlens[b] = static_cast<I>(p.lengths[b] + p.appended[b]);
  }
}

}  // namespace

cudaError_t launch_rope(const RopeParams& p, ElemKind kind, cudaStream_t stream) {
  if (p.batch * p.seqlen == 0 || p.heads == 0) return cudaSuccess;
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using acc_t = typename Elem<T>::acc_t;
    const size_t smem = 2 * p.policy.pairs() * sizeof(acc_t);
    rope_kernel<T><<<static_cast<unsigned>(p.batch * p.seqlen), kThreads, smem, stream>>>(p);
    return cudaGetLastError();
  });
}

namespace {

template <bool kPaged>
cudaError_t launch_kv_append_for(const KVAppendParams& p, ElemKind kind, void* cache_seqlens,
                                 bool seqlens_int64, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (p.seqlen_new > 0 && p.kv_heads > 0) {
    err = dispatch_elem(kind, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      using acc_t = typename Elem<T>::acc_t;
      const size_t smem = p.rope ? 2 * p.policy.pairs() * sizeof(acc_t) : 0;
      kv_append_kernel<T, kPaged>
          <<<static_cast<unsigned>(p.batch * p.seqlen_new), kThreads, smem, stream>>>(p);
      return cudaGetLastError();
    });
    if (err != cudaSuccess) return err;
  }
  // The lengths must not move before the append kernel has read them: launched after it on
  // the same stream. (p.lengths may be cache_seqlens itself, an int64 contiguous tensor being
  // used as it is; stream order alone keeps the two kernels apart.)
  if (seqlens_int64) {
    advance_lengths_kernel<int64_t, kPaged>
        <<<1, kThreads, 0, stream>>>(p, static_cast<int64_t*>(cache_seqlens));
  } else {
    advance_lengths_kernel<int32_t, kPaged>
        <<<1, kThreads, 0, stream>>>(p, static_cast<int32_t*>(cache_seqlens));
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_kv_append(const KVAppendParams& p, ElemKind kind, void* cache_seqlens,
                             bool seqlens_int64, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  return p.pages.paged()
             ? launch_kv_append_for<true>(p, kind, cache_seqlens, seqlens_int64, stream)
             : launch_kv_append_for<false>(p, kind, cache_seqlens, seqlens_int64, stream);
}

}  // namespace attn_ext::cuda
