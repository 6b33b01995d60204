// Closes the target region wide_target_begin.h opened (included once, at the end of the source).
#ifndef ATTN_EXT_AVX512_EMULATION
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
#endif
#undef ATTN_EXT_WIDE_TARGET
