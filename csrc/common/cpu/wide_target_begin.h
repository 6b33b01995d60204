// Opens the target region of a wide source (the AVX-512, AVX512-BF16 and AMX kernels). A source
// includes it once, after its other includes, with ATTN_EXT_WIDE_TARGET defined as its
// instruction sets (a string literal, as in __attribute__((target))), and closes the region with
// wide_target_end.h at its end. What the source defines in between is compiled for those sets;
// the inline functions of the headers included before keep the build's flags (AVX2), so none
// of them is ever emitted with the wider instructions, and block_kernels() calls the source
// only on CPUs that have them. No include guard: each source includes it once.
//
// Under ATTN_EXT_AVX512_EMULATION (tests/test_cpu_kernels.py) no target is set: the scalar
// stand-ins of tests/avx512_emulation.h replace the intrinsics instead.
//
// GCC 12's AVX-512 intrinsics pass a self-initialized undefined register as the unused merge
// operand of some instructions (unpacks, widening conversions), which -Wuninitialized and
// -Wmaybe-uninitialized report once inlined: a false positive of those headers (the
// instructions write every lane), silenced inside the region.
#ifndef ATTN_EXT_WIDE_TARGET
#error "define ATTN_EXT_WIDE_TARGET (the region's instruction sets) before this header"
#endif
#include <immintrin.h>

#ifdef ATTN_EXT_AVX512_EMULATION
#include ATTN_EXT_AVX512_EMULATION
#else
// #pragma does not expand macros; _Pragma of the expanded, then stringized, text does.
#define ATTN_EXT_WIDE_PRAGMA_TEXT(...) _Pragma(#__VA_ARGS__)
#define ATTN_EXT_WIDE_PRAGMA(...) ATTN_EXT_WIDE_PRAGMA_TEXT(__VA_ARGS__)
#if defined(__clang__)
ATTN_EXT_WIDE_PRAGMA(clang attribute push(__attribute__((target(ATTN_EXT_WIDE_TARGET))),
                                          apply_to = function))
#else
#pragma GCC push_options
ATTN_EXT_WIDE_PRAGMA(GCC target(ATTN_EXT_WIDE_TARGET))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#undef ATTN_EXT_WIDE_PRAGMA
#undef ATTN_EXT_WIDE_PRAGMA_TEXT
#endif
