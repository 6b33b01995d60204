#include "common/tensors.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <c10/util/Exception.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attn_ext {

// BLAS needs the last dimension contiguous and a row stride >= the row length; a row
// stride of 0 (a sequence-expanded view) or an odd layout gets one copy, never a rejection.
at::Tensor blas_rows(const at::Tensor& t) {
  const int64_t rows = t.size(2), cols = t.size(3);
  const bool last_ok = t.stride(3) == 1 || cols <= 1;
  const bool rows_ok = rows <= 1 || t.stride(2) >= cols;
  return (last_ok && rows_ok) ? t : t.contiguous();
}

// Stride of a dimension, made harmless when the dimension has size 1 (PyTorch leaves
// those strides arbitrary and BLAS validates leading dimensions even for one row).
int64_t blas_row_stride(const at::Tensor& t) {
  return t.size(2) <= 1 ? std::max<int64_t>(t.size(3), 1) : t.stride(2);
}

void check_companion(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                     at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on q's device ", like.device(),
              ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

// A fresh CPU tensor of kHugePageMinBytes or more is, as a rule, a new mmap (torch's CPU allocator
// does not cache), so the kernel's first write to each 4 KB page takes a page fault. In the
// memory-bound ops that cost more than their reads and writes: a fresh 64 MB tensor took 20 ms to
// fill against 1 ms for a reused one, the spatial gate on x (32, 256, 56, 56) fp32 ran 30 ms
// against 8.6 ms with its output advised, the merge of two (1, 32, 8192, 128) fp32 states 45
// against 17 ms (Zen 5 VM, 2026-11-29, docs/performance.md). On 2 MB pages the kernel takes 512x
// fewer faults. torch gives every allocation of 2 MB or more the same advice only under
// THP_MEM_ALLOC_ENABLE=1; here it is the op's large outputs alone. Advice only: where Linux
// refuses it (THP disabled) the pages stay 4 KB and nothing else changes.
at::Tensor advise_huge_pages(at::Tensor t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;  // x86-64 / arm64 with 4 KB base pages
  const auto bytes = static_cast<int64_t>(t.nbytes());
  // Only a dense tensor's bytes are its allocation's, from data_ptr on.
  if (!t.is_cpu() || bytes < kHugePageMinBytes || !t.is_non_overlapping_and_dense()) return t;
  const char* env = std::getenv("ATTN_EXT_HUGE_PAGES");
  TORCH_CHECK(!env || !*env || std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0,
              "ATTN_EXT_HUGE_PAGES: expected 0 or 1, got '", env, "'");
  if (env && std::strcmp(env, "0") == 0) return t;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (begin + static_cast<uintptr_t>(bytes)) & ~(kHugePage - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return t;
}

PageTable prepare_page_table(const char* op, const at::Tensor& block_table, int64_t batch,
                             const at::Tensor& cache, const char* cache_name, int64_t page_dim) {
  TORCH_CHECK(block_table.scalar_type() == at::kInt, op, ": block_table must be int32, got ",
              block_table.scalar_type());
  TORCH_CHECK(block_table.device() == cache.device(), op, ": block_table must be on ", cache_name,
              "'s device ", cache.device(), ", got ", block_table.device());
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch, op,
              ": block_table must have shape (B, max_pages) with B = ", batch, ", got ",
              block_table.sizes());
  // Rows contiguous: the kernels step through a sequence's pages one int32 at a time.
  TORCH_CHECK(block_table.size(1) <= 1 || block_table.stride(1) == 1, op,
              ": block_table must have contiguous rows (stride 1 in dim 1), got strides ",
              block_table.strides());
  TORCH_CHECK(cache.size(page_dim) >= 1, op, ": the page size (", cache_name, " dim ", page_dim,
              ") must be >= 1 with a block_table, got ", cache.size(page_dim), " (shape ",
              cache.sizes(), ")");
  PageTable pages;
  pages.table = block_table.const_data_ptr<int32_t>();
  pages.row_stride = block_table.stride(0);
  pages.page_size = cache.size(page_dim);
  pages.num_pages = cache.size(0);
  return pages;
}

void check_page_entries(const char* op, const PageTable& pages, int64_t batch, const int64_t* begin,
                        const int64_t* end) {
  for (int64_t b = 0; b < batch; ++b) {
    if (end[b] <= begin[b]) continue;
    for (int64_t i = begin[b] / pages.page_size; i <= (end[b] - 1) / pages.page_size; ++i) {
      const int64_t page = pages.table[b * pages.row_stride + i];
      TORCH_CHECK(page >= 0 && page < pages.num_pages, op, ": block_table[", b, ", ", i,
                  "] must be a page of the cache, in [0, num_pages = ", pages.num_pages, "), got ",
                  page, " (it holds rows [", i * pages.page_size, ", ", (i + 1) * pages.page_size,
                  ") of sequence ", b, ")");
    }
  }
}

}  // namespace attn_ext
