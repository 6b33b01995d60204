// Dispatch of attn_ext.attention, attention_varlen and their backwards to the flash kernels of
// this build: dtype -> tensor-core head dim or the generic kernel (which alone serves varlen
// batches and score modifiers). The instantiated dtypes and head dims are those of
// instantiations.json (kernel_set.h, generated from it). setup.py may narrow the compiled
// instantiations and then passes the kept set as bit masks; a request for a kernel that is not
// built is reported by attention_cuda_unsupported, and no template that is not built is ever
// referenced (it would not link).
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include "attention/cuda/attention_launch.h"
#include "attention/cuda/flash/launch_templates.h"
#include "attention/cuda/instantiations/kernel_set.h"
#include "common/cuda/elem.cuh"

// Bit i set = kept, in kernel_set.h's orders. Everything when setup.py does not say otherwise.
#ifndef ATTN_EXT_CUDA_DTYPE_MASK
#define ATTN_EXT_CUDA_DTYPE_MASK ((1 << kernel_set::kNumDtypes) - 1)
#endif
#ifndef ATTN_EXT_CUDA_HEAD_DIM_MASK
#define ATTN_EXT_CUDA_HEAD_DIM_MASK ((1 << kernel_set::kNumMmaHeadDims) - 1)
#endif
#ifndef ATTN_EXT_CUDA_BACKWARD
#define ATTN_EXT_CUDA_BACKWARD 1
#endif
// The CuTe forward's instantiations are compiled only where setup.py found the CUTLASS headers.
#ifndef ATTN_EXT_CUDA_CUTE
#define ATTN_EXT_CUDA_CUTE 0
#endif
// The Hopper forward's instantiations are compiled only where the architectures include
// sm_90a (setup.py's _builds_sm90a); elsewhere nothing routes there.
#ifndef ATTN_EXT_CUDA_HOPPER
#define ATTN_EXT_CUDA_HOPPER 0
#endif

namespace attn_ext::cuda {
namespace {

using kernel_set::kMmaHeadDims;
using kernel_set::kNumMmaHeadDims;

template <typename T>
constexpr bool dtype_built() {
  static_assert(kernel_set::kDtypeBit<T> >= 0, "element type missing from instantiations.json");
  return (ATTN_EXT_CUDA_DTYPE_MASK >> kernel_set::kDtypeBit<T>)&1;
}
template <typename T>
constexpr bool mma_built(int idx) {
  return kernel_set::kHasMma<T> && dtype_built<T>() && ((ATTN_EXT_CUDA_HEAD_DIM_MASK >> idx) & 1);
}
constexpr bool kBackwardBuilt = ATTN_EXT_CUDA_BACKWARD != 0;
constexpr bool kCuteBuilt = ATTN_EXT_CUDA_CUTE != 0;
constexpr bool kHopperBuilt = kCuteBuilt && ATTN_EXT_CUDA_HOPPER != 0;

// Whether the CuTe backward is instantiated at this head dim, at compile time.
constexpr bool cute_bwd_head_dim(int head_dim) {
  for (int i = 0; i < kernel_set::kNumCuteBwdHeadDims; ++i)
    if (kernel_set::kCuteBwdHeadDims[i] == head_dim) return true;
  return false;
}

// fn(std::integral_constant<int, kMmaHeadDims[idx]>{}) by a compile-time walk over the head
// dims built for T, so that only instantiated kernels are referenced; `none` when idx names no
// built head dim or the kernel family is not built (kBuilt). fn may return `none` itself for
// head dims its family lacks.
template <typename T, bool kBuilt, int kIdx = 0, class Fn, class R>
R visit_head_dim(int idx, Fn fn, R none) {
  if constexpr (kIdx == kNumMmaHeadDims || !kBuilt) {
    return none;
  } else {
    if constexpr (mma_built<T>(kIdx)) {
      if (idx == kIdx) return fn(std::integral_constant<int, kMmaHeadDims[kIdx]>{});
    }
    return visit_head_dim<T, kBuilt, kIdx + 1>(idx, fn, none);
  }
}

// 16-byte vectors: cp.async and the output's stores move 8 16-bit elements at a time.
constexpr int64_t kCuteVec = 8;

// The index into kMmaHeadDims of the CuTe forward serving these inputs, or -1: what
// flash_fwd_cute.cuh serves (no explicit mask, dropout, varlen batch or score modifier;
// D == Dv == an instantiated head dim; every row 16-byte aligned).
template <typename T>
int cute_index(const AttentionParams& p) {
  if (!kCuteBuilt || varlen_or_mods(p) || p.mask_kind != MaskKind::kNone || p.dropout_p > 0.0 ||
      p.head_dim != p.head_dim_v) {
    return -1;
  }
  const auto aligned = [](const void* ptr, std::initializer_list<int64_t> strides) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
    for (const int64_t s : strides)
      if (s % kCuteVec != 0) return false;
    return true;
  };
  if (!aligned(p.q, {p.q_batch_stride, p.q_head_stride, p.q_row_stride}) ||
      !aligned(p.k, {p.k_batch_stride, p.k_head_stride, p.k_row_stride}) ||
      !aligned(p.v, {p.v_batch_stride, p.v_head_stride, p.v_row_stride}) ||
      !aligned(p.out, {p.o_batch_stride, p.o_head_stride, p.o_row_stride})) {
    return -1;
  }
  for (int idx = 0; idx < kNumMmaHeadDims; ++idx)
    if (mma_built<T>(idx) && p.head_dim == kMmaHeadDims[idx]) return idx;
  return -1;
}

// A (rows, D, heads, batch) tensor the copy engine can address (cuTensorMapEncodeTiled's rules,
// which CuTe's make_tma_copy asserts instead of reporting): 32-bit extents (the coordinates
// are signed 32-bit), positive strides that are multiples of 16 bytes (cute_index checked the
// 16-byte part and the base's alignment) and below 2^40 bytes. Expanded (stride-0) heads or
// batches fail here and run on the sm_80 kernel.
bool tma_legal(int64_t rows, int64_t heads, int64_t batch, std::initializer_list<int64_t> strides) {
  constexpr int64_t kMaxExtent = (int64_t(1) << 31) - 1;
  constexpr int64_t kMaxStrideBytes = int64_t(1) << 40;
  constexpr int64_t kElemBytes = 2;  // bf16 / fp16
  if (rows < 1 || rows > kMaxExtent || heads > kMaxExtent || batch > kMaxExtent) return false;
  for (const int64_t s : strides)
    if (s <= 0 || s * kElemBytes >= kMaxStrideBytes) return false;
  return true;
}

// The index into kMmaHeadDims of the Hopper forward serving these inputs, or -1: the CuTe
// forward's conditions (cute_index) with TMA-legal Q, K and V (the output is written by
// 16-byte stores, which cute_index's alignment covers) and scale > 0 (its exp2 step is
// cute_fwd::FoldScale, which takes the row max over unscaled scores).
template <typename T>
int hopper_index(const AttentionParams& p) {
  if (!kHopperBuilt || !(p.scale > 0.0)) return -1;
  const int idx = cute_index<T>(p);
  if (idx < 0 ||
      !tma_legal(p.seqlen_q, p.heads, p.batch,
                 {p.q_row_stride, p.q_head_stride, p.q_batch_stride}) ||
      !tma_legal(p.seqlen_k, p.kv_heads, p.batch,
                 {p.k_row_stride, p.k_head_stride, p.k_batch_stride}) ||
      !tma_legal(p.seqlen_k, p.kv_heads, p.batch,
                 {p.v_row_stride, p.v_head_stride, p.v_batch_stride})) {
    return -1;
  }
  return idx;
}

// The index into kMmaHeadDims of the head dim whose CuTe backward serves these inputs, or -1:
// the forward's conditions (cute_index) for the head dims of kCuteBwdHeadDims, dO's rows
// 16-byte aligned too.
template <typename T>
int cute_bwd_index(const AttentionBwdParams& p) {
  if (!kBackwardBuilt) return -1;
  const int idx = cute_index<T>(p);
  if (idx < 0 || reinterpret_cast<uintptr_t>(p.dout) % 16 != 0 ||
      p.do_batch_stride % kCuteVec != 0 || p.do_head_stride % kCuteVec != 0 ||
      p.do_row_stride % kCuteVec != 0) {
    return -1;
  }
  return cute_bwd_head_dim(kMmaHeadDims[idx]) ? idx : -1;
}

// The index into kMmaHeadDims of the tensor-core kernel serving these inputs, or -1 for the
// generic kernel (which serves every varlen batch and score modifier).
template <typename T>
int mma_index(const AttentionParams& p) {
  if (varlen_or_mods(p)) return -1;  // not in the tensor-core kernel yet (flash_fwd_mma.cuh)
  const int64_t need = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  for (int idx = 0; idx < kNumMmaHeadDims; ++idx)
    if (mma_built<T>(idx) && need <= kMmaHeadDims[idx]) return idx;
  return -1;
}

// The CuTe kernels' tiles at D = 256 (forward) and D = 128 (backward) take 128 KiB of shared
// memory: more than sm_86 / sm_89 / sm_120 give a block (99 KiB), where the next kernel runs.
template <typename T>
cudaError_t fwd(const AttentionParams& p, FwdKernel kernel, size_t max_smem, cudaStream_t stream) {
  if (kernel == FwdKernel::kHopper) {
    if (const int idx = hopper_index<T>(p); idx >= 0) {
      return visit_head_dim<T, kHopperBuilt>(
          idx, [&](auto hd) { return run_fwd_hopper<T, hd.value>(p, stream); },
          cudaErrorInvalidValue);
    }
  }
  if (kernel != FwdKernel::kMma) {
    const int idx = cute_index<T>(p);
    const size_t smem = visit_head_dim<T, kCuteBuilt>(
        idx, [](auto hd) { return fwd_cute_smem_bytes<T, hd.value>(); }, size_t(0));
    // FoldScale (one FFMA and a flush-to-zero exp2 a score: 1.06-1.18x ScaleFirst on an H100,
    // same errors, 2026-11-27) takes the row max over unscaled scores: the same max only when
    // scale > 0, so other scales keep ScaleFirst.
    const bool fold = p.scale > 0.0;
    if (idx >= 0 && smem <= max_smem) {
      return visit_head_dim<T, kCuteBuilt>(
          idx,
          [&](auto hd) {
            return fold ? run_fwd_cute<T, hd.value, cute_fwd::FoldScale>(p, stream)
                        : run_fwd_cute<T, hd.value, cute_fwd::ScaleFirst>(p, stream);
          },
          cudaErrorInvalidValue);
    }
  }
  if (const int idx = mma_index<T>(p); idx >= 0) {
    return visit_head_dim<T, true>(
        idx, [&](auto hd) { return run_fwd_mma<T, hd.value>(p, stream); }, cudaErrorInvalidValue);
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
  // Grids are 1-D; the finest is the backward's preprocess, 4 rows (one per warp) per block
  // (a varlen batch: one per token and head, however short max_seqlen_q says they are).
  constexpr int64_t kMaxBlocks = (int64_t(1) << 31) - 1;
  constexpr int64_t kFinestBlock = 4;
  const int64_t longest = p.seqlen_q > p.seqlen_k ? p.seqlen_q : p.seqlen_k;
  if (p.batch * p.heads * ceil_div(longest, kFinestBlock) > kMaxBlocks) {
    return "B * H * ceil(max(Sq, Sk) / 4) exceeds the 2^31 - 1 blocks of a CUDA grid";
  }
  if (p.varlen() && ceil_div(p.heads * p.total_q, kFinestBlock) > kMaxBlocks) {
    return "ceil(H * total_q / 4) exceeds the 2^31 - 1 blocks of a CUDA grid";
  }
  const char* why = nullptr;
  dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (!backward && mma_index<T>(p) >= 0) return cudaSuccess;
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

cudaError_t launch_attention_fwd(const AttentionParams& p, ElemKind kind, FwdKernel kernel,
                                 size_t max_smem, cudaStream_t stream) {
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return fwd<T>(p, kernel, max_smem, stream);
  });
}

// The CuTe backward with kQStages query stages where it serves the inputs and its tiles fit
// max_smem; nullopt where not.
template <typename T, int kQStages>
std::optional<cudaError_t> try_bwd_cute(const AttentionBwdParams& p, BwdWorkspace ws,
                                        size_t max_smem, cudaStream_t stream) {
  constexpr bool kBuilt = kCuteBuilt && kBackwardBuilt;
  const int idx = cute_bwd_index<T>(p);
  const size_t smem = visit_head_dim<T, kBuilt>(
      idx,
      [](auto hd) {
        if constexpr (cute_bwd_head_dim(hd.value))
          return bwd_cute_smem_bytes<T, hd.value, kQStages>();
        return size_t(0);
      },
      size_t(0));
  if (idx < 0 || smem > max_smem) return std::nullopt;
  return visit_head_dim<T, kBuilt>(
      idx,
      [&](auto hd) {
        if constexpr (cute_bwd_head_dim(hd.value)) {
          return run_bwd_cute<T, hd.value, kQStages>(p, ws, stream);
        }
        return cudaErrorInvalidValue;
      },
      cudaErrorInvalidValue);
}

cudaError_t launch_attention_bwd(const AttentionBwdParams& p, ElemKind kind, BwdWorkspace ws,
                                 BwdKernel kernel, size_t max_smem, cudaStream_t stream) {
  return dispatch_elem(kind, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (kernel == BwdKernel::kCutePrefetch) {
      if (auto e = try_bwd_cute<T, 2>(p, ws, max_smem, stream)) return *e;
    }
    if (kernel != BwdKernel::kGeneric) {
      if (auto e = try_bwd_cute<T, 1>(p, ws, max_smem, stream)) return *e;
    }
    if constexpr (dtype_built<T>() && kBackwardBuilt) {
      return run_bwd_generic<T>(p, ws, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

}  // namespace attn_ext::cuda
