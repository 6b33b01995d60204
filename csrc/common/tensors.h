#pragma once
// Tensor checks and layouts the input checks of every op family share (attention, decoding,
// compression, linear, spatial), and the advice their fresh outputs take.
#include <cstdint>
#include <ATen/core/Tensor.h>
#include "common/page_table.h"

namespace attn_ext {

// Checks a tensor the op receives alongside q/k/v (grad_out, out, lse) for device, dtype
// and shape.
void check_companion(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                     at::IntArrayRef shape, at::ScalarType dtype);

// A 4-D tensor whose rows BLAS can address (last dim contiguous, row stride >= row
// length): the tensor itself when it already is, else one contiguous copy.
at::Tensor blas_rows(const at::Tensor& t);
// The row stride to hand to BLAS (any valid value for a single-row tensor).
int64_t blas_row_stride(const at::Tensor& t);

// Below this many bytes a fresh CPU tensor may come from glibc's heap, whose pages are reused
// already faulted; from it on, a new mmap (glibc's largest mmap threshold) unless the heap has a
// free stretch that large.
constexpr int64_t kHugePageMinBytes = int64_t(32) << 20;
// t itself, with the whole 2 MB pages inside its bytes advised onto transparent huge pages when
// it is a CPU tensor of at least kHugePageMinBytes (tensors.cpp says why): for the fresh
// outputs that a memory-bound op's kernel writes whole (not the attention kernels': bound by
// their products, they gained nothing and lost on a VM, docs/performance.md).
// ATTN_EXT_HUGE_PAGES=0 turns the advice off.
at::Tensor advise_huge_pages(at::Tensor t);

// A paged cache's block_table: (B, max_pages) int32 on the cache's device with contiguous
// rows; `cache` (num_pages first, the page size in dim page_dim: 2 for the decoding caches'
// (num_pages, Hkv, page_size, *), 1 for FlashAttention's (num_pages, page_size, Hkv, *)) is
// named `cache_name` in messages and must have page_size >= 1. The table is read in place (the
// returned PageTable points into it).
PageTable prepare_page_table(const char* op, const at::Tensor& block_table, int64_t batch,
                             const at::Tensor& cache, const char* cache_name, int64_t page_dim);
// CPU: every entry of sequence b's table row that covers its rows [begin[b], end[b]) must name
// a page of the cache (in [0, num_pages)); the error names block_table[b, i].
void check_page_entries(const char* op, const PageTable& pages, int64_t batch, const int64_t* begin,
                        const int64_t* end);

}  // namespace attn_ext
