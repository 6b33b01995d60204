// Dispatch of attn_ext.attention / attention_backward to the flash kernels of this build:
// dtype (4 cases) -> tensor-core head dim (3 cases) or the generic kernel. setup.py may narrow
// the compiled instantiations (csrc/cuda/instantiations) and then passes the kept set as bit
// masks; a request for a kernel that is not built is reported by attention_cuda_unsupported,
// and no template that is not built is ever referenced (it would not link).
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include "elem.cuh"
#include "flash/flash_api.h"
#include "launch.h"

// Bit i set = kept. Dtypes: float32, float64, bfloat16, float16 (ElemKind order);
// head dims: kMmaHeadDims order. Everything when setup.py does not say otherwise.
#ifndef ATTN_EXT_CUDA_DTYPE_MASK
#define ATTN_EXT_CUDA_DTYPE_MASK 0xF
#endif
#ifndef ATTN_EXT_CUDA_HEAD_DIM_MASK
#define ATTN_EXT_CUDA_HEAD_DIM_MASK 0x7
#endif
#ifndef ATTN_EXT_CUDA_BACKWARD
#define ATTN_EXT_CUDA_BACKWARD 1
#endif

namespace attn_ext::cuda {
namespace {

// Head dims of the tensor-core forward, ascending; max(D, Dv) pads up to the first built one.
constexpr int kMmaHeadDims[] = {64, 128, 256};
constexpr int kNumMmaHeadDims = 3;

template <typename T> constexpr int dtype_bit();
template <> constexpr int dtype_bit<float>() { return 0; }
template <> constexpr int dtype_bit<double>() { return 1; }
template <> constexpr int dtype_bit<__nv_bfloat16>() { return 2; }
template <> constexpr int dtype_bit<__half>() { return 3; }

template <typename T>
constexpr bool dtype_built() { return (ATTN_EXT_CUDA_DTYPE_MASK >> dtype_bit<T>()) & 1; }
template <typename T>
constexpr bool has_mma() { return std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>; }
template <typename T, int kIdx>
constexpr bool mma_built() {
  return has_mma<T>() && dtype_built<T>() && ((ATTN_EXT_CUDA_HEAD_DIM_MASK >> kIdx) & 1);
}
constexpr bool kBackwardBuilt = ATTN_EXT_CUDA_BACKWARD != 0;

// The tensor-core head dim serving these inputs, or 0 for the generic kernel.
template <typename T>
int mma_head_dim(const AttentionParams& p) {
  const int64_t need = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  const bool built[kNumMmaHeadDims] = {mma_built<T, 0>(), mma_built<T, 1>(), mma_built<T, 2>()};
  for (int idx = 0; idx < kNumMmaHeadDims; ++idx)
    if (built[idx] && need <= kMmaHeadDims[idx]) return kMmaHeadDims[idx];
  return 0;
}

template <typename T, int kIdx>
cudaError_t fwd_mma_if_built(const AttentionParams& p, cudaStream_t stream) {
  if constexpr (mma_built<T, kIdx>()) {
    return run_fwd_mma<T, kMmaHeadDims[kIdx]>(p, stream);
  } else {
    return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t fwd(const AttentionParams& p, cudaStream_t stream) {
  switch (mma_head_dim<T>(p)) {
    case kMmaHeadDims[0]: return fwd_mma_if_built<T, 0>(p, stream);
    case kMmaHeadDims[1]: return fwd_mma_if_built<T, 1>(p, stream);
    case kMmaHeadDims[2]: return fwd_mma_if_built<T, 2>(p, stream);
    default: break;
  }
  if constexpr (dtype_built<T>()) {
    return run_fwd_generic<T>(p, stream);
  } else {
    return cudaErrorInvalidValue;
  }
}

// Shared memory of the generic kernel, 0 where it is not built.
template <typename T>
size_t generic_smem(const AttentionParams& p, bool backward) {
  if constexpr (dtype_built<T>()) {
    if (!backward) return fwd_generic_smem_bytes<T>(p.head_dim, p.head_dim_v);
    if constexpr (kBackwardBuilt) return bwd_generic_smem_bytes<T>(p.head_dim, p.head_dim_v);
  }
  return 0;
}

}  // namespace

const char* attention_cuda_unsupported(const AttentionParams& p, ElemKind kind, bool backward,
                                       size_t max_smem) {
  // Grids are 1-D; the finest is the backward's preprocess, 4 rows (one per warp) per block.
  constexpr int64_t kMaxBlocks = (int64_t(1) << 31) - 1;
  constexpr int64_t kFinestBlock = 4;
  const int64_t longest = p.seqlen_q > p.seqlen_k ? p.seqlen_q : p.seqlen_k;
  if (p.batch * p.heads * ceil_div(longest, kFinestBlock) > kMaxBlocks) {
    return "B * H * ceil(max(Sq, Sk) / 4) exceeds the 2^31 - 1 blocks of a CUDA grid";
  }
  const char* why = nullptr;
  dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (!backward && mma_head_dim<T>(p) != 0) return cudaSuccess;
    if (!dtype_built<T>() || (backward && !kBackwardBuilt)) {
      why = backward ? "this build has no CUDA attention backward for this dtype (setup.py: "
                       "ATTN_EXT_CUDA_DTYPES, ATTN_EXT_CUDA_BACKWARD)"
                     : "this build has no CUDA attention forward for this dtype (setup.py: "
                       "ATTN_EXT_CUDA_DTYPES, ATTN_EXT_CUDA_HEAD_DIMS)";
    } else if (generic_smem<T>(p, backward) > max_smem) {
      why = "head dims too large for the shared-memory tiles of the generic CUDA kernel";
    }
    return cudaSuccess;
  });
  return why;
}

cudaError_t launch_attention_fwd(const AttentionParams& p, ElemKind kind, cudaStream_t stream) {
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return fwd<T>(p, stream);
  });
}

cudaError_t launch_attention_bwd(const AttentionBwdParams& p, ElemKind kind, BwdWorkspace ws,
                                 cudaStream_t stream) {
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (dtype_built<T>() && kBackwardBuilt) {
      return run_bwd_generic<T>(p, ws, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

}  // namespace attn_ext::cuda
