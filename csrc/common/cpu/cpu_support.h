#pragma once
// The CPU kernels are compiled for the vector ISA chosen at build time (AVX2 + FMA on
// x86-64 by default); running them on a CPU without it would fault, so refuse instead.
#include <c10/util/Exception.h>
#include "common/dispatch.h"

namespace attn_ext::cpu {

inline void check_cpu_support(const char* op) {
#if defined(__AVX2__) && defined(__FMA__) && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  TORCH_CHECK(ok, op,
              ": this build of attn_ext needs a CPU with AVX2 and FMA; rebuild with "
              "ATTN_EXT_CPU_ISA=generic for this machine");
#else
  (void)op;
#endif
}

}  // namespace attn_ext::cpu
