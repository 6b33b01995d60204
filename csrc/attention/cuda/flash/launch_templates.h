#pragma once
// The flash kernel templates' entry points (run_* and their shared-memory sizes), declared
// only: the explicit instantiations are the generated files of
// csrc/attention/cuda/instantiations/ (tools/gen_cuda_instantiations.py), the dispatch over them
// is attention_launch.cu. No ATen here: nvcc alone compiles every user of this file.
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>
#include "attention/params.h"
#include "attention/cuda/attention_launch.h"

namespace attn_ext::cuda {

// Tensor-core forward (bf16 / fp16): head dims up to kHeadDim (q/k zero-padded past D,
// v past Dv; stores masked to Dv).
template <typename T, int kHeadDim>
cudaError_t run_fwd_mma(const AttentionParams& p, cudaStream_t stream);

// The CuTe forwards' exp2 step (flash_fwd_cute.cuh): ScaleFirst, the verified default, and
// FoldScale, which needs scale > 0.
namespace cute_fwd {
struct ScaleFirst;
struct FoldScale;
}  // namespace cute_fwd

// CuTe tensor-core forward (bf16 / fp16): D == Dv == kHeadDim, 16-byte aligned rows, no mask,
// dropout or modifier (flash_fwd_cute.cuh); Exp one of the policies above.
template <typename T, int kHeadDim, class Exp>
cudaError_t run_fwd_cute(const AttentionParams& p, cudaStream_t stream);
// Its dynamic shared memory: more than some GPUs' per-block limit (99 KiB on sm_86 / sm_89 /
// sm_120) at D = 256, where the dispatch picks another kernel.
template <typename T, int kHeadDim>
size_t fwd_cute_smem_bytes();

// Hopper forward (bf16 / fp16, sm_90a: TMA, wgmma, warp specialization): the CuTe forward's
// inputs with TMA-legal strides (flash_fwd_hopper.cuh). An empty kernel on other architectures.
template <typename T, int kHeadDim>
cudaError_t run_fwd_hopper(const AttentionParams& p, cudaStream_t stream);

// CuTe tensor-core backward (bf16 / fp16): the CuTe forward's inputs at the head dims of
// kernel_set::kCuteBwdHeadDims; dQ's sums ordered by atomics (flash_bwd_cute.cuh). kQStages:
// the query tiles' shared-memory stages, 1 or 2 (2 prefetches the next query block).
template <typename T, int kHeadDim, int kQStages>
cudaError_t run_bwd_cute(const AttentionBwdParams& p, BwdWorkspace ws, cudaStream_t stream);
// Its dynamic shared memory (at D = 128, 128 KiB with one query stage and 160 KiB with two:
// over the limit of sm_86 / sm_89 / sm_120).
template <typename T, int kHeadDim, int kQStages>
size_t bwd_cute_smem_bytes();

// Generic (SIMT) forward: any dtype and head dims, exact accumulation in acc_t.
template <typename T>
cudaError_t run_fwd_generic(const AttentionParams& p, cudaStream_t stream);
template <typename T>
size_t fwd_generic_smem_bytes(int64_t head_dim, int64_t head_dim_v);

// Generic (SIMT) backward, deterministic: a dk/dv pass over key blocks and a dq pass over
// query blocks (BwdWorkspace: attention_launch.h).
template <typename T>
cudaError_t run_bwd_generic(const AttentionBwdParams& p, BwdWorkspace ws, cudaStream_t stream);
template <typename T>
size_t bwd_generic_smem_bytes(int64_t head_dim, int64_t head_dim_v);

}  // namespace attn_ext::cuda
