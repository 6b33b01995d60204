// CUDA tpa_expand (Tensor Product Attention): one thread block per token. The block loads the
// token's R factor rows b (rotated by RoPE at the token's position) and its a factors into
// shared memory once; every (head, feature) output then reads them from there.
#include <cstdint>
#include <type_traits>
#include "common/rope.h"
#include "compression/tpa_params.h"
#include "common/cuda/elem.cuh"
#include "compression/cuda/tpa_launch.h"

namespace attn_ext::cuda {
namespace {

constexpr int kThreads = 128;

// Shared-memory layout of one token: rb (R, D), a (R, H), cos / sin (pairs each), then, in
// the backward, the gradient of b (R, D).
template <typename acc_t>
struct TokenSmem {
  acc_t *rb, *a, *cos_t, *sin_t, *gb;
  __device__ TokenSmem(acc_t* base, const TpaExpandParams& p) {
    rb = base;
    a = rb + p.rank * p.head_dim;
    cos_t = a + p.rank * p.heads;
    sin_t = cos_t + (p.rope ? p.policy.pairs() : 0);
    gb = sin_t + (p.rope ? p.policy.pairs() : 0);
  }
};

// cos / sin of every pair at `pos` (sin negated for the inverse rotation).
template <typename acc_t>
__device__ void token_table(const RopePolicy& pol, int64_t pos, bool inverse, acc_t* cos_t,
                            acc_t* sin_t) {
  for (int64_t i = threadIdx.x; i < pol.pairs(); i += blockDim.x) {
    const acc_t ang = static_cast<acc_t>(RopePolicy::angle(pos, pol.inv_freq(i)));
    cos_t[i] = cos(ang);
    sin_t[i] = inverse ? -sin(ang) : sin(ang);
  }
}

// Rotates the R rows of x (R, D) in shared memory in place by the table.
template <typename acc_t>
__device__ void rotate_rows(const RopePolicy& pol, acc_t* x, int64_t rows, int64_t d,
                            const acc_t* cos_t, const acc_t* sin_t) {
  const int64_t pairs = pol.pairs();
  for (int64_t idx = threadIdx.x; idx < rows * pairs; idx += blockDim.x) {
    const int64_t r = idx / pairs, i = idx % pairs;
    acc_t* xr = x + r * d;
    const int64_t f = pol.first(i), s = pol.second(i);
    acc_t y0, y1;
    rotate_pair(xr[f], xr[s], cos_t[i], sin_t[i], &y0, &y1);
    xr[f] = y0;
    xr[s] = y1;
  }
}

// Loads the token's a and rotated b factors into shared memory (ends synchronized).
template <typename T, typename acc_t>
__device__ void load_token(const TpaExpandParams& p, int64_t bi, int64_t s, TokenSmem<acc_t>& sm) {
  const T* b = static_cast<const T*>(p.b) + bi * p.b_batch_stride + s * p.b_row_stride;
  const T* a = static_cast<const T*>(p.a) + bi * p.a_batch_stride + s * p.a_row_stride;
  const int64_t R = p.rank, D = p.head_dim, H = p.heads;
  for (int64_t idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
    sm.rb[idx] = Elem<T>::load(b[(idx / D) * p.b_rank_stride + (idx % D) * p.b_col_stride]);
  }
  for (int64_t idx = threadIdx.x; idx < R * H; idx += blockDim.x) {
    sm.a[idx] = Elem<T>::load(a[(idx / H) * p.a_rank_stride + (idx % H) * p.a_col_stride]);
  }
  if (p.rope) token_table(p.policy, p.position(bi, s), false, sm.cos_t, sm.sin_t);
  __syncthreads();
  if (p.rope) {
    rotate_rows(p.policy, sm.rb, R, D, sm.cos_t, sm.sin_t);
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tpa_forward_kernel(TpaExpandParams p) {
  using acc_t = typename Elem<T>::acc_t;
  extern __shared__ unsigned char smem_raw[];
  TokenSmem<acc_t> sm(reinterpret_cast<acc_t*>(smem_raw), p);
  const int64_t bi = blockIdx.x / p.seqlen, s = blockIdx.x % p.seqlen;
  load_token<T>(p, bi, s, sm);
  const int64_t R = p.rank, D = p.head_dim, H = p.heads;
  const acc_t scale = static_cast<acc_t>(p.scale);
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(blockIdx.x) * H * D;
  for (int64_t idx = threadIdx.x; idx < H * D; idx += blockDim.x) {
    const int64_t h = idx / D, d = idx % D;
    acc_t acc = 0;
    for (int64_t r = 0; r < R; ++r) acc += sm.a[r * H + h] * sm.rb[r * D + d];
    out[idx] = Elem<T>::store(scale * acc);
  }
}

// grad_a[r, h] = scale * <grad_out[h], RoPE(b[r])>;
// grad_b[r] = RoPE^-1(scale * sum_h a[r, h] grad_out[h]).
template <typename T>
__global__ void __launch_bounds__(kThreads) tpa_backward_kernel(TpaExpandParams p) {
  using acc_t = typename Elem<T>::acc_t;
  extern __shared__ unsigned char smem_raw[];
  TokenSmem<acc_t> sm(reinterpret_cast<acc_t*>(smem_raw), p);
  const int64_t bi = blockIdx.x / p.seqlen, s = blockIdx.x % p.seqlen;
  load_token<T>(p, bi, s, sm);
  const int64_t R = p.rank, D = p.head_dim, H = p.heads;
  const acc_t scale = static_cast<acc_t>(p.scale);
  const T* g = static_cast<const T*>(p.grad_out) + bi * p.g_batch_stride + s * p.g_row_stride;
  T* ga = static_cast<T*>(p.grad_a) + static_cast<int64_t>(blockIdx.x) * R * H;
  T* gbo = static_cast<T*>(p.grad_b) + static_cast<int64_t>(blockIdx.x) * R * D;
  for (int64_t idx = threadIdx.x; idx < R * H; idx += blockDim.x) {
    const int64_t r = idx / H, h = idx % H;
    acc_t dot = 0;
    for (int64_t d = 0; d < D; ++d) {
      dot += Elem<T>::load(g[h * p.g_head_stride + d * p.g_col_stride]) * sm.rb[r * D + d];
    }
    ga[idx] = Elem<T>::store(scale * dot);
  }
  for (int64_t idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
    const int64_t r = idx / D, d = idx % D;
    acc_t acc = 0;
    for (int64_t h = 0; h < H; ++h) {
      acc += sm.a[r * H + h] * Elem<T>::load(g[h * p.g_head_stride + d * p.g_col_stride]);
    }
    sm.gb[idx] = scale * acc;
  }
  if (p.rope) {
    // load_token's last barrier: no thread reads the forward table any more.
    token_table(p.policy, p.position(bi, s), true, sm.cos_t, sm.sin_t);
    __syncthreads();
    rotate_rows(p.policy, sm.gb, R, D, sm.cos_t, sm.sin_t);
  }
  __syncthreads();
  for (int64_t idx = threadIdx.x; idx < R * D; idx += blockDim.x)
    gbo[idx] = Elem<T>::store(sm.gb[idx]);
}

template <bool kBackward>
cudaError_t launch(const TpaExpandParams& p, ElemKind kind, cudaStream_t stream) {
  if (p.batch * p.seqlen == 0) return cudaSuccess;
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using acc_t = typename Elem<T>::acc_t;
    const int64_t smem = tpa_shared_bytes(p, sizeof(acc_t), kBackward);
    if (smem > kTpaMaxSharedBytes) return cudaErrorInvalidValue;  // the wrapper checks first
    const unsigned blocks = static_cast<unsigned>(p.batch * p.seqlen);
    if constexpr (kBackward) {
      tpa_backward_kernel<T><<<blocks, kThreads, static_cast<size_t>(smem), stream>>>(p);
    } else {
      tpa_forward_kernel<T><<<blocks, kThreads, static_cast<size_t>(smem), stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t launch_tpa_expand(const TpaExpandParams& p, ElemKind kind, cudaStream_t stream) {
  return launch<false>(p, kind, stream);
}

cudaError_t launch_tpa_expand_backward(const TpaExpandParams& p, ElemKind kind,
                                       cudaStream_t stream) {
  return launch<true>(p, kind, stream);
}

}  // namespace attn_ext::cuda
