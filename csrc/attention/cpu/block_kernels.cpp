// Which packed block products the CPU flash kernels call (see block_kernels.h).
#include "attention/cpu/block_kernels.h"

#include <cstdlib>
#include <string>
#include <c10/util/Exception.h>

#include "common/cpu/vec_math.h"
#ifdef ATTN_EXT_AVX2
#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/avx512_block_products.h"
#include "attention/cpu/avx512_softmax_rows.h"
#include "attention/cpu/amx_block_products.h"
#include "attention/cpu/avx512bf16_block_products.h"
#endif

namespace attn_ext::cpu {
#ifdef ATTN_EXT_AVX2
namespace {

constexpr BlockKernels kAvx2{"avx2",
                             &avx2::scores_tile,
                             &avx2::pv_tile,
                             &avx2::atb_tile,
                             &row_max<float>,
                             &exp2_shift_sum<float>,
                             &exp2_scale_shift2<float>,
                             &softmax_grad_row<float>,
                             &scale_row<float>,
                             Bf16Operands::kFp32,
                             /*avx512=*/false};
#ifdef ATTN_EXT_AVX512_PRODUCTS
// The AVX-512 sets differ only in how bf16 multiplies.
constexpr BlockKernels avx512_set(const char* name, Bf16Operands bf16_operands) {
  return {name,
          &avx512::scores_tile,
          &avx512::pv_tile,
          &avx512::atb_tile,
          &avx512::row_max,
          &avx512::exp2_shift_sum,
          &avx512::exp2_scale_shift2,
          &avx512::softmax_grad_row,
          &avx512::scale_row,
          bf16_operands,
          /*avx512=*/true};
}
constexpr BlockKernels kAvx512 = avx512_set("avx512", Bf16Operands::kFp32);
#ifdef ATTN_EXT_AMX_PRODUCTS
constexpr BlockKernels kAmx = avx512_set("amx", Bf16Operands::kAmx);
constexpr BlockKernels kAvx512Bf16 = avx512_set("avx512bf16", Bf16Operands::kAvx512Bf16);
#endif
#endif

// libgcc's check includes the OS: AVX-512 state must be enabled in XCR0, not only in CPUID.
bool cpu_has_avx512() {
#ifdef ATTN_EXT_AVX512_PRODUCTS
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

bool cpu_has_avx512bf16() {
#if defined(ATTN_EXT_AVX512_PRODUCTS) && defined(ATTN_EXT_AVX512BF16_PRODUCTS)
  return cpu_has_avx512() && avx512bf16::available();
#else
  return false;
#endif
}

bool cpu_has_amx() {
#if defined(ATTN_EXT_AVX512_PRODUCTS) && defined(ATTN_EXT_AMX_PRODUCTS)
  return cpu_has_avx512() && amx::available();
#else
  return false;
#endif
}

// auto takes AMX where the CPU and OS offer it; else AVX512-BF16 on AMD CPUs that have it (Zen 4
// and later); else AVX-512 where the CPU has it. The AVX-512 kernels are checked bit for bit
// against AVX2 on Bochs's emulated Skylake-X (dev/avx512_check) and through scalar stand-ins for
// their intrinsics (tests/test_cpu_kernels.py); avx2 is the fallback to pin. The AMX and
// AVX512-BF16 bf16 kernels are checked against float64 and torch's bf16 flash kernel where the
// CPU has them (tests/test_amx.py, tests/test_avx512bf16.py), and their products and packing
// through the same stand-ins everywhere else (tests/test_cpu_kernels.py). Why this order, by
// what each set ran (docs/performance.md):
// - AMX ran 2.0-2.9x the AVX-512 bf16 forward and 1.6-2.4x its forward+backward on a Sapphire
//   Rapids VM (2026-11-26), so it comes first where both run;
// - on a Zen 5 VM (2026-11-29) vdpbf16ps issued at the FMA's rate, twice the multiply-adds, and
//   avx512bf16 ran the bf16 forward 1.5-1.9x and forward+backward 1.5-1.8x faster than avx512;
// - on that Sapphire Rapids core vdpbf16ps issued at a quarter of the FMA's rate and avx512bf16
//   ran the bf16 forward at 0.29x SDPA against avx512's 0.45x, so Intel CPUs without usable AMX
//   (Cooper Lake, or AMX withheld by the OS) keep avx512 until one measures otherwise.
const BlockKernels* choose() {
  const char* env = std::getenv("ATTN_EXT_CPU_KERNELS");
  const std::string want = env && *env ? env : "auto";
  TORCH_CHECK(
      want == "auto" || want == "avx2" || want == "avx512" || want == "avx512bf16" || want == "amx",
      "ATTN_EXT_CPU_KERNELS: expected auto, avx2, avx512, avx512bf16 or amx, got '", want, "'");
  if (want == "avx2") return &kAvx2;
  if (want == "amx") {
    TORCH_CHECK(cpu_has_amx(),
                "ATTN_EXT_CPU_KERNELS=amx, but this CPU or OS offers no AMX-BF16 tiles "
                "(or Linux refused the tile state)");
#if defined(ATTN_EXT_AVX512_PRODUCTS) && defined(ATTN_EXT_AMX_PRODUCTS)
    return &kAmx;
#endif
  }
  if (want == "avx512bf16") {
    TORCH_CHECK(cpu_has_avx512bf16(),
                "ATTN_EXT_CPU_KERNELS=avx512bf16, but this CPU reports no AVX512-BF16 "
                "(with AVX-512F and AVX-512BW)");
#if defined(ATTN_EXT_AVX512_PRODUCTS) && defined(ATTN_EXT_AVX512BF16_PRODUCTS)
    return &kAvx512Bf16;
#endif
  }
  const bool avx512 = cpu_has_avx512();
  TORCH_CHECK(want == "auto" || avx512,
              "ATTN_EXT_CPU_KERNELS=avx512, but this CPU reports no AVX-512F");
#if defined(ATTN_EXT_AVX512_PRODUCTS) && defined(ATTN_EXT_AMX_PRODUCTS)
  if (want == "auto" && cpu_has_amx()) return &kAmx;
  if (want == "auto" && cpu_has_avx512bf16() && __builtin_cpu_is("amd")) return &kAvx512Bf16;
#endif
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
