// CUDA op wrappers of the decoding family: validation (shared with the CPU ops), the
// current stream, a checked launch. Nothing here reads device memory on the host, so no op
// synchronizes: per-sequence lengths are checked and clamped by the kernels instead.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "decoding/decode_inputs.h"
#include "common/float8.h"
#include "attention/inputs.h"
#include "common/cuda/elem_kind.h"
#include "common/cuda/sm_count.h"
#include "common/cuda/unverified.h"
#include "decoding/cuda/decoding_launch.h"

namespace attn_ext::cuda {
namespace {

// A scaled RoPE variant (a frequency table or attention_scaling) has run only on the CPU: on
// CUDA it needs the opt-in until a GPU session has run test_rope_scaling.py's CUDA cases.
void require_scaled_rope_opt_in(const char* op, const RopeScaling& scaling) {
  if (rope_scaled(scaling)) {
    require_verified_or_opt_in(op, "RoPE with inv_freq / attention_scaling");
  }
}

at::Tensor rope_out(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& positions,
                    int64_t offset, double base, bool interleaved,
                    std::optional<int64_t> rotary_dim, const RopeScaling& scaling, bool inverse) {
  c10::cuda::CUDAGuard guard(x.device());
  require_scaled_rope_opt_in(op, scaling);
  PreparedRope r = prepare_rope(op, x, {positions, offset, base, interleaved, rotary_dim, scaling});
  at::Tensor out = at::empty_like(x);
  r.params.inverse = inverse;
  set_rope_output(r.params, out);
  C10_CUDA_CHECK(
      launch_rope(r.params, elem_kind(op, x.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor rope_cuda(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                     int64_t offset, double base, bool interleaved,
                     std::optional<int64_t> rotary_dim, const std::optional<at::Tensor>& inv_freq,
                     double attention_scaling) {
  return rope_out("attn_ext.rope", x, positions, offset, base, interleaved, rotary_dim,
                  {inv_freq, attention_scaling}, false);
}

at::Tensor rope_backward_cuda(const at::Tensor& grad_out,
                              const std::optional<at::Tensor>& positions, int64_t offset,
                              double base, bool interleaved, std::optional<int64_t> rotary_dim,
                              const std::optional<at::Tensor>& inv_freq, double attention_scaling) {
  return rope_out("attn_ext.rope_backward", grad_out, positions, offset, base, interleaved,
                  rotary_dim, {inv_freq, attention_scaling}, true);
}

void rope_inplace_cuda(at::Tensor& x, const std::optional<at::Tensor>& positions, int64_t offset,
                       double base, bool interleaved, std::optional<int64_t> rotary_dim,
                       const std::optional<at::Tensor>& inv_freq, double attention_scaling) {
  constexpr const char* kOp = "attn_ext.rope_";
  c10::cuda::CUDAGuard guard(x.device());
  require_scaled_rope_opt_in(kOp, {inv_freq, attention_scaling});
  PreparedRope r = prepare_rope(
      kOp, x, {positions, offset, base, interleaved, rotary_dim, {inv_freq, attention_scaling}});
  at::assert_no_internal_overlap(x);
  set_rope_output(r.params, x);
  C10_CUDA_CHECK(
      launch_rope(r.params, elem_kind(kOp, x.scalar_type()), c10::cuda::getCurrentCUDAStream()));
}

// Whether a block_table was passed: the argument is tested, not PageTable::paged(), because an
// empty table is still a paged call. The paged kernels (issue 21) need no opt-in since they ran
// green on an H100 (2026-11-27: tests/test_paged_cache.py, tests/test_decoding.py and
// compute-sanitizer's memcheck / racecheck over tools/sanitize_cuda.py --paged).
bool paged_call(const std::optional<at::Tensor>& block_table) {
  return block_table.has_value() && block_table->defined();
}

// Float8 caches (common/float8.h) have CPU kernels only so far; the CUDA kernels read the
// cache in q's dtype.
void refuse_float8_cache(const char* op, const at::Tensor& k_cache) {
  TORCH_CHECK_NOT_IMPLEMENTED(!is_float8_cache(k_cache.scalar_type()), op, ": ",
                              k_cache.scalar_type(),
                              " caches are supported on the CPU only; use a cache of q's dtype "
                              "on CUDA");
}

void kv_cache_append_cuda(at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& cache_seqlens,
                          const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& new_lengths, bool rope, double rope_base,
                          bool rope_interleaved, std::optional<int64_t> rotary_dim,
                          const std::optional<at::Tensor>& block_table, double k_scale,
                          double v_scale, const std::optional<at::Tensor>& rope_inv_freq,
                          double rope_attention_scaling) {
  constexpr const char* kOp = "attn_ext.kv_cache_append";
  c10::cuda::CUDAGuard guard(k_cache.device());
  refuse_float8_cache(kOp, k_cache);
  require_scaled_rope_opt_in(kOp, {rope_inv_freq, rope_attention_scaling});
  PreparedAppend r = prepare_kv_append(kOp, k_cache, v_cache, cache_seqlens, k, v, new_lengths,
                                       rope, rope_base, rope_interleaved, rotary_dim, block_table,
                                       /*check_values=*/false, {k_scale, v_scale}, {},
                                       {rope_inv_freq, rope_attention_scaling});
  TORCH_CHECK(cache_seqlens.is_contiguous(), kOp, ": cache_seqlens must be contiguous");
  C10_CUDA_CHECK(launch_kv_append(
      r.params, elem_kind(kOp, k.scalar_type()), cache_seqlens.data_ptr(),
      cache_seqlens.scalar_type() == at::kLong, c10::cuda::getCurrentCUDAStream()));
}

void latent_cache_append_cuda(at::Tensor& cache, at::Tensor& cache_seqlens, const at::Tensor& c_kv,
                              const at::Tensor& k_rope,
                              const std::optional<at::Tensor>& new_lengths, double rope_base,
                              bool rope_interleaved, const std::optional<at::Tensor>& block_table,
                              const std::optional<at::Tensor>& rope_inv_freq,
                              double rope_attention_scaling, double kv_scale) {
  constexpr const char* kOp = "attn_ext.latent_cache_append";
  c10::cuda::CUDAGuard guard(cache.device());
  refuse_float8_cache(kOp, cache);
  require_scaled_rope_opt_in(kOp, {rope_inv_freq, rope_attention_scaling});
  PreparedAppend r = prepare_latent_append(
      kOp, cache, cache_seqlens, c_kv, k_rope, new_lengths, rope_base, rope_interleaved,
      block_table, /*check_values=*/false, {rope_inv_freq, rope_attention_scaling}, kv_scale);
  TORCH_CHECK(cache_seqlens.is_contiguous(), kOp, ": cache_seqlens must be contiguous");
  C10_CUDA_CHECK(launch_kv_append(
      r.params, elem_kind(kOp, cache.scalar_type()), cache_seqlens.data_ptr(),
      cache_seqlens.scalar_type() == at::kLong, c10::cuda::getCurrentCUDAStream()));
}

// Split-KV factor of the SIMT kernel: about two blocks per SM, no split shorter than
// kMinSplitKeys keys of the cache's capacity (the lengths themselves live on the device).
int64_t auto_splits(int64_t blocks, int64_t capacity) {
  constexpr int64_t kBlocksPerSM = 2;
  constexpr int64_t kMinSplitKeys = 512;
  const int64_t sms = sm_count(c10::cuda::current_device());
  const int64_t want = (kBlocksPerSM * sms + blocks - 1) / std::max<int64_t>(blocks, 1);
  return std::clamp<int64_t>(want, 1, std::max<int64_t>(1, capacity / kMinSplitKeys));
}

// Split-KV factor of the split-KV and tensor-core kernels, from the blocks B * Hkv * row
// blocks, the capacity (the lengths live on the device), the SM count and the resident blocks
// per SM the grid should fill.
int64_t split_count(int64_t blocks, int64_t capacity, int64_t blocks_per_sm) {
  // A split reads at least this many keys: shorter ones spend more on the merge than they
  // gain (the partials are Dv floats per row and split).
  constexpr int64_t kMinSplitKeys = 256;
  // Bounds the workspace and the merge kernel's serial loop over a row's splits.
  constexpr int64_t kMaxSplits = 128;
  const int64_t sms = sm_count(c10::cuda::current_device());
  const int64_t want = (blocks_per_sm * sms + blocks - 1) / std::max<int64_t>(blocks, 1);
  return std::clamp<int64_t>(want, 1, std::clamp<int64_t>(capacity / kMinSplitKeys, 1, kMaxSplits));
}

// The split-KV kernel's 128-thread blocks each keep 2-4 KB of loads in flight, and an H100 SM
// needs about 20 KB in flight to stream at its share of bandwidth: 8 resident blocks.
int64_t split_kv_auto_splits(int64_t blocks, int64_t capacity) {
  constexpr int64_t kBlocksPerSM = 8;
  return split_count(blocks, capacity, kBlocksPerSM);
}

// The tensor-core kernel's blocks hold 66-160 KB of shared memory (one or two per H100 SM),
// each with a whole tile of 16-72 KB in flight: two waves of two blocks an SM balance the
// splits' lengths.
int64_t decode_mma_auto_splits(int64_t blocks, int64_t capacity) {
  constexpr int64_t kBlocksPerSM = 4;
  return split_count(blocks, capacity, kBlocksPerSM);
}

// Whether every row of a prepared 4-D tensor (q or a cache: its last dim contiguous, as
// prepare_decode's blas_rows leaves it) starts on a 16-byte boundary: the base, and the strides
// of the (batch or page, head, row) dims a kernel steps through. A dim of size 1 is never
// stepped through, and torch leaves its stride arbitrary (a view with one KV head, say).
bool rows_16_byte_aligned(const at::Tensor& t) {
  const int64_t vec = 16 / t.element_size();  // elements per 16-byte vector
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t dim = 0; dim < 3; ++dim)
    if (t.size(dim) > 1 && t.stride(dim) % vec != 0) return false;
  return true;
}

// Why the split-KV kernel cannot serve p (nullptr when it can): it reads 16-byte vectors of
// D = Dv features in bf16 / fp16 / fp32. k_cache / v_cache: the prepared caches p points into.
const char* split_kv_unsupported(const DecodeParams& p, ElemKind kind, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache) {
  if (kind == ElemKind::kFloat64) return "float64 inputs";
  if (p.head_dim != p.head_dim_v ||
      std::find(std::begin(kSplitKvHeadDims), std::end(kSplitKvHeadDims), p.head_dim) ==
          std::end(kSplitKvHeadDims))
    return "head dims other than D = Dv in {64, 128, 256}";
  if (!rows_16_byte_aligned(k_cache) || !rows_16_byte_aligned(v_cache))
    return "k_cache / v_cache rows that are not 16-byte aligned (pointer and strides)";
  if (p.seqlen_k >= kSplitKvMaxCapacity) return "capacities of 2^30 rows or more";
  return nullptr;
}

// Whether the tensor-core kernel (decode_mma.cu) serves p: only with ATTN_EXT_UNVERIFIED_CUDA=1
// until it has run on a GPU (dev/gpu_notes.md). bf16 / fp16 without softcap / ALiBi, 16-byte
// aligned q and cache rows, and either D = Dv in kSplitKvHeadDims with at least
// kDecodeMmaMinRows query rows per KV head, or MLA's latent head (D 576, Dv 512) whose values
// are the keys' first columns (v_cache a view of k_cache: `values_in_keys`).
bool decode_mma_serves(const DecodeParams& p, ElemKind kind, const PreparedDecode& in,
                       bool* values_in_keys) {
  *values_in_keys = false;
  if (!unverified_cuda_enabled()) return false;
  if (kind != ElemKind::kBFloat16 && kind != ElemKind::kFloat16) return false;
  if (p.softcap != 0.0 || p.alibi_slopes != nullptr) return false;
  if (p.seqlen_k >= kSplitKvMaxCapacity) return false;
  const at::Tensor &k = in.k_cache, &v = in.v_cache;
  const bool latent = p.head_dim == kDecodeMmaLatentDim && p.head_dim_v == kDecodeMmaLatentDimV &&
                      v.data_ptr() == k.data_ptr() && v.stride(0) == k.stride(0) &&
                      v.stride(1) == k.stride(1) && v.stride(2) == k.stride(2);
  const bool grouped = p.head_dim == p.head_dim_v &&
                       std::find(std::begin(kSplitKvHeadDims), std::end(kSplitKvHeadDims),
                                 p.head_dim) != std::end(kSplitKvHeadDims) &&
                       p.group() * p.seqlen_q >= kDecodeMmaMinRows;
  if (!latent && !grouped) return false;
  // q's rows too are read as 16-byte vectors (cp.async into shared memory).
  if (!rows_16_byte_aligned(in.q) || !rows_16_byte_aligned(k) || !rows_16_byte_aligned(v))
    return false;
  *values_in_keys = latent;
  return true;
}

// A paged cache (num_pages, Hkv, page_size, D) as the contiguous (B, Hkv, max_pages *
// page_size, D) rows of each sequence, its pages in table order: for the SIMT kernel, which
// reads no block table. Entries are clamped into the cache, as the split-KV kernel clamps them
// (checking them on the host would synchronize); rows past a sequence's length are never read.
at::Tensor gather_pages(const at::Tensor& cache, const at::Tensor& block_table) {
  const int64_t batch = block_table.size(0), pages = block_table.size(1);
  const int64_t heads = cache.size(1), page_size = cache.size(2), d = cache.size(3);
  // A cache of no pages holds no rows any length may cover (and index_select would fault).
  if (cache.size(0) == 0) return at::zeros({batch, heads, pages * page_size, d}, cache.options());
  const at::Tensor index = block_table.clamp(0, cache.size(0) - 1).reshape({-1}).to(at::kLong);
  return cache.index_select(0, index)
      .view({batch, pages, heads, page_size, d})
      .permute({0, 2, 1, 3, 4})
      .reshape({batch, heads, pages * page_size, d});
}

std::tuple<at::Tensor, at::Tensor> decode_attention_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, int64_t num_splits, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    double k_scale, double v_scale) {
  constexpr const char* kOp = "attn_ext.decode_attention";
  c10::cuda::CUDAGuard guard(q.device());
  refuse_float8_cache(kOp, k_cache);
  PreparedDecode in =
      prepare_decode(kOp, q, k_cache, v_cache, cache_seqlens,
                     {scale, causal, window_left, window_right, num_splits, softcap, alibi_slopes,
                      sinks, cache_batch_idx, cache_leftpad, block_table, k_scale, v_scale},
                     /*check_values=*/false);
  const bool paged = paged_call(block_table);
  DecodeParams& p = in.params;
  const ElemKind kind = elem_kind(kOp, q.scalar_type());
  // The split-KV kernel serves every call it can, paged or contiguous (the default since it ran
  // green on an H100, 2026-11-27); everything else runs the SIMT kernel, a paged call that the
  // split-KV kernel cannot serve (MLA's absorbed form, D != Dv; fp64; other head dims) on its
  // pages gathered into contiguous rows: one copy of the cache per call. With
  // ATTN_EXT_UNVERIFIED_CUDA=1 the tensor-core kernel takes the calls decode_mma_serves names
  // (many query rows per KV head, MLA's latent head, paged or not) from both.
  const char* unsupported = split_kv_unsupported(p, kind, in.k_cache, in.v_cache);
  bool values_in_keys = false;
  const bool mma = decode_mma_serves(p, kind, in, &values_in_keys);
  if (paged && unsupported != nullptr && !mma) {
    return decode_attention_cuda(
        q, gather_pages(k_cache, *block_table), gather_pages(v_cache, *block_table), cache_seqlens,
        scale, causal, window_left, window_right, num_splits, softcap, alibi_slopes, sinks,
        cache_batch_idx, cache_leftpad, std::nullopt, k_scale, v_scale);
  }
  const bool split_kv = !mma && unsupported == nullptr;
  TORCH_CHECK(p.head_dim <= kDecodeMaxHeadDim && p.head_dim_v <= kDecodeMaxHeadDimV, kOp,
              ": head dims up to D = ", kDecodeMaxHeadDim, ", Dv = ", kDecodeMaxHeadDimV,
              " are supported on CUDA, got D = ", p.head_dim, ", Dv = ", p.head_dim_v);
  auto [out, lse] = allocate_outputs(p, q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  const int64_t rows = p.group() * p.seqlen_q;
  const int64_t rows_per_block =
      mma        ? decode_mma_rows_per_block(p.group() * p.seqlen_q, p.head_dim_v)
      : split_kv ? split_kv_rows_per_block(p)
                 : kDecodeRowsPerBlock;
  const int64_t blocks = p.batch * p.kv_heads * ((rows + rows_per_block - 1) / rows_per_block);
  // SIMT kernel: the blocks on the grid's y axis (x holds the splits); split-KV kernel: the
  // splits on y. CUDA caps y at 65535 (x at 2^31 - 1).
  constexpr int64_t kMaxGridY = 65535;
  if (mma || split_kv) {
    TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), kOp,
                ": B * Hkv * ceil(H / Hkv * Sq / ", rows_per_block, ") = ", blocks,
                " thread blocks exceed CUDA's grid limit");
    TORCH_CHECK(p.num_splits <= kMaxGridY, kOp, ": num_splits must be <= ", kMaxGridY,
                " on CUDA, got ", p.num_splits);
    if (p.num_splits == 0) {
      p.num_splits = mma ? decode_mma_auto_splits(blocks, p.seqlen_k)
                         : split_kv_auto_splits(blocks, p.seqlen_k);
    }
  } else {
    TORCH_CHECK(blocks <= kMaxGridY, kOp, ": B * Hkv * ceil(H / Hkv * Sq / ", kDecodeRowsPerBlock,
                ") = ", blocks, " thread blocks exceed CUDA's grid limit of ", kMaxGridY,
                " on this path; split the batch (got B = ", p.batch, ", Hkv = ", p.kv_heads,
                ", rows per KV head = ", rows, ")");
    if (p.num_splits == 0) p.num_splits = auto_splits(blocks, p.seqlen_k);
  }
  DecodeWorkspace ws;
  at::Tensor ws_o, ws_stats;
  if (p.num_splits > 1) {
    // the accumulation type: fp64 for fp64 (SIMT kernel only), else fp32
    const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const int64_t slots = p.batch * p.kv_heads * rows * p.num_splits;
    ws_o = at::empty({slots * p.head_dim_v}, q.options().dtype(acc));
    ws_stats = at::empty({slots * 2}, q.options().dtype(acc));
    ws = {ws_o.data_ptr(), ws_stats.data_ptr()};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(mma        ? launch_decode_mma(p, kind, values_in_keys, ws, stream)
                 : split_kv ? launch_decode_split_kv(p, kind, ws, stream)
                            : launch_decode(p, kind, ws, stream));
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("rope", &rope_cuda);
  m.impl("rope_", &rope_inplace_cuda);
  m.impl("rope_backward", &rope_backward_cuda);
  m.impl("kv_cache_append", &kv_cache_append_cuda);
  m.impl("latent_cache_append", &latent_cache_append_cuda);
  m.impl("decode_attention", &decode_attention_cuda);
}

}  // namespace attn_ext::cuda
