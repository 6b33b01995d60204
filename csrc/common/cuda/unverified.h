#pragma once
// CUDA code that compiles in CI but has not yet run green on a GPU stays off by default: the
// op raises, naming the feature, unless ATTN_EXT_UNVERIFIED_CUDA=1 opts in (the GPU session
// that verifies it sets the variable, then removes the gate). Never a silent fallback.
#include <cstdlib>
#include <cstring>
#include <c10/util/Exception.h>

namespace attn_ext::cuda {

inline bool unverified_cuda_enabled() {
  const char* v = std::getenv("ATTN_EXT_UNVERIFIED_CUDA");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

inline void require_verified_or_opt_in(const char* op, const char* feature) {
  TORCH_CHECK(unverified_cuda_enabled(), op, ": ", feature,
              " on CUDA is compiled but has not yet run on a GPU; set "
              "ATTN_EXT_UNVERIFIED_CUDA=1 to use it (dev/gpu_notes.md lists the runs left)");
}

}  // namespace attn_ext::cuda
