#pragma once
// The two ways the CPU kernels multiply bf16 operands (block_kernels().bf16_operands), on the
// same packed forms (amx::pack_keys / pack_values / pack_row_pairs) and bf16 rows
// (amx::round_rows): AMX tiles or AVX512-BF16's vdpbf16ps. The forward and the backward take
// one of them as a policy; both products accumulate in fp32.
#include <cstdint>

#include "common/cpu/kernel_traits.h"
#include "attention/cpu/amx_block_products.h"
#include "attention/cpu/avx512bf16_block_products.h"

#ifdef ATTN_EXT_AMX_PRODUCTS
namespace attn_ext::cpu {

// AMX tiles: each worker loads the tile configuration on its thread and keeps a scratch chunk
// for pv's zeroed tail (amx_block_products.h), wide enough for the widest product it runs.
struct AmxPairs {
  amx::ThreadTiles tiles;  // this thread's tile configuration, while the worker lives
  Buffer<uint16_t> v_tail;

  explicit AmxPairs(int64_t max_cols) : v_tail(amx::value_tile_elems(amx::kPairDepth, max_cols)) {}
  void scores(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* kt, int64_t n, int64_t d,
              float scale, float* s, int64_t lds) {
    amx::scores(q, ldq, m, kt, n, d, scale, s, lds);
  }
  // Q K^T straight from the tiles into s (amx::scores_unscaled: whole tiles, unscaled).
  void scores_unscaled(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* kt, int64_t n,
                       int64_t d, float* s, int64_t lds) {
    amx::scores_unscaled(q, ldq, m, kt, n, d, s, lds);
  }
  void pv(const uint16_t* p, int64_t ldp, int64_t m, const uint16_t* vt, int64_t n, int64_t dv,
          const float* factor, float* o, int64_t ldo) {
    amx::pv(p, ldp, m, vt, n, dv, factor, o, ldo, v_tail.get());
  }
};

// vdpbf16ps on zmm registers (avx512bf16_block_products.h): no per-thread state.
struct Avx512Bf16Pairs {
  explicit Avx512Bf16Pairs(int64_t /*max_cols*/) {}
  void scores(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* kt, int64_t n, int64_t d,
              float scale, float* s, int64_t lds) {
    avx512bf16::scores(q, ldq, m, kt, n, d, scale, s, lds);
  }
  void scores_unscaled(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* kt, int64_t n,
                       int64_t d, float* s, int64_t lds) {
    avx512bf16::scores(q, ldq, m, kt, n, d, 1.f, s, lds);  // times 1: exact
  }
  void pv(const uint16_t* p, int64_t ldp, int64_t m, const uint16_t* vt, int64_t n, int64_t dv,
          const float* factor, float* o, int64_t ldo) {
    avx512bf16::pv(p, ldp, m, vt, n, dv, factor, o, ldo);
  }
};

}  // namespace attn_ext::cpu
#endif
