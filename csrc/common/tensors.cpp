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

}  // namespace attn_ext
