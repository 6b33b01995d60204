// Which packed block products the CPU flash kernels call (see block_kernels.h).
#include "attention/cpu/block_kernels.h"

#include <cstdlib>
#include <string>
#include <c10/util/Exception.h>

#include "common/cpu/vec_math.h"
#ifdef ATTN_EXT_AVX2
#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/avx512_block_products.h"
#endif

namespace attn_ext::cpu {
#ifdef ATTN_EXT_AVX2
namespace {

constexpr BlockKernels kAvx2{"avx2", &avx2::scores_tile, &avx2::pv_tile, &avx2::atb_tile};
#ifdef ATTN_EXT_AVX512_PRODUCTS
constexpr BlockKernels kAvx512{"avx512", &avx512::scores_tile, &avx512::pv_tile, &avx512::atb_tile};
#endif

// libgcc's check includes the OS: AVX-512 state must be enabled in XCR0, not only in CPUID.
bool cpu_has_avx512() {
#ifdef ATTN_EXT_AVX512_PRODUCTS
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// auto takes AVX-512 where the CPU has it. The AVX-512 kernels are checked bit for bit
// against AVX2 on Bochs's emulated Skylake-X (dev/avx512_check) and through scalar stand-ins
// for their intrinsics (tests/test_cpu_kernels.py); their speed on AVX-512 hardware is not
// yet measured (dev/gpu_session.sh's cpu phase does it): avx2 is the fallback to pin.
const BlockKernels* choose() {
  const char* env = std::getenv("ATTN_EXT_CPU_KERNELS");
  const std::string want = env && *env ? env : "auto";
  TORCH_CHECK(want == "auto" || want == "avx2" || want == "avx512",
              "ATTN_EXT_CPU_KERNELS: expected auto, avx2 or avx512, got '", want, "'");
  if (want == "avx2") return &kAvx2;
  const bool avx512 = cpu_has_avx512();
  TORCH_CHECK(want == "auto" || avx512,
              "ATTN_EXT_CPU_KERNELS=avx512, but this CPU reports no AVX-512F");
#ifdef ATTN_EXT_AVX512_PRODUCTS
  if (avx512) return &kAvx512;
#endif
  return &kAvx2;
}

}  // namespace

const BlockKernels& block_kernels() {
  // A throwing initializer leaves the static unset, so the next call raises again.
  static const BlockKernels* const chosen = choose();
  return *chosen;
}
#endif
}  // namespace attn_ext::cpu
