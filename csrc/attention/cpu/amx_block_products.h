#pragma once
// The bf16 kernels' block products on AMX tiles (Intel Sapphire Rapids and later):
// scores = scale * Q K^T and O = O * factor + P V, each a sum of 16 x 16 x 32 tile products
// (_tile_dpbf16ps: bf16 pairs multiplied, accumulated in fp32); the backward's five products
// are these two on other operands (flash_bwd.cpp's Bf16BwdProducts). Compiled into every x86-64
// build, called only where available() says the CPU and the OS allow tiles
// (block_kernels(): ATTN_EXT_CPU_KERNELS=amx).
//
// Numerics: Q, K and V are bf16 inputs, so their products are exact and only the fp32
// accumulation rounds, as in the fp32 panels. P is rounded to bf16 once before P V (torch's
// and FlashAttention's bf16 kernels do the same); the row sums of the softmax, and so the
// normalization and lse, use the unrounded fp32 P. The backward rounds P (for dV) and dS (for
// dQ, dK) to bf16 as well. tests/test_amx.py bounds the error this adds against torch's own
// bf16 SDPA, forward and backward.
#include <cstdint>
#include "attention/cpu/key_rows.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && \
    (defined(__GNUC__) || defined(__clang__))
#define ATTN_EXT_AMX_PRODUCTS 1

namespace attn_ext::cpu::amx {

constexpr int64_t kTileRows = 16;   // rows of every tile this file configures
constexpr int64_t kPairDepth = 32;  // bf16 reduction elements per tile row (16 pairs, 64 bytes)
constexpr int64_t kAccCols = 16;    // fp32 columns of an accumulator tile (64 bytes)
// A packed operand tile: kTileRows rows of kPairDepth bf16 (1 KiB).
constexpr int64_t kTileElems = kTileRows * kPairDepth;

inline int64_t round_up(int64_t n, int64_t to) {
  return (n + to - 1) / to * to;
}

// Whether this process may run AMX bf16 tiles: the CPU reports AMX-TILE, AMX-BF16 and
// AVX512-BF16 (which rounds P) and AVX512-DQ (the row pass), the OS enables the tile state in XCR0,
// and Linux grants the process permission for it (requested here on the first call; without it the
// first tile instruction faults).
bool available();

// Loads this file's tile configuration on the calling thread and releases the tiles when it
// goes out of scope. The configuration is per thread and other code (oneDNN inside torch) may
// change it between calls, so each worker holds one while it runs; it cannot move threads.
class ThreadTiles {
 public:
  ThreadTiles();
  ~ThreadTiles();
  ThreadTiles(const ThreadTiles&) = delete;
  ThreadTiles& operator=(const ThreadTiles&) = delete;
};

// Elements of the packed forms of n keys (features d) and n values (features dv).
inline int64_t key_tile_elems(int64_t n, int64_t d) {
  return round_up(n, kPairDepth) * round_up(d, kPairDepth);
}
inline int64_t value_tile_elems(int64_t n, int64_t dv) {
  return round_up(n, kPairDepth) * round_up(dv, kAccCols);
}

// Keys [0, n) of rows k (bf16 bits; strided or paged, key_rows.h) as B tiles of Q K^T: for each
// block of 16 keys and each 32-feature chunk, a tile whose row t holds features (2t, 2t + 1) of
// each of the 16 keys (the pair layout _tile_dpbf16ps reads). Keys from n to round_up(n, 32) and
// features past d are zero, so the tiles of keys j0.. (j0 a multiple of 32) start at dst + j0 *
// round_up(d, 32).
void pack_keys(const KeyRows<uint16_t>& k, int64_t n, int64_t d, uint16_t* dst);
inline void pack_keys(const uint16_t* k, int64_t ld, int64_t n, int64_t d, uint16_t* dst) {
  pack_keys(strided_rows(k, ld), n, d, dst);
}

// Values [0, n) (strided or paged) as B tiles of P V: for each chunk of 32 keys and each block of
// 16 features, a tile whose row t holds keys (2t, 2t + 1) of each of the 16 features; zero past n
// and dv. The tiles of keys j0.. (a multiple of 32) start at dst + j0 * round_up(dv, 16).
void pack_values(const KeyRows<uint16_t>& v, int64_t n, int64_t dv, uint16_t* dst);
inline void pack_values(const uint16_t* v, int64_t ld, int64_t n, int64_t dv, uint16_t* dst) {
  pack_values(strided_rows(v, ld), n, dv, dst);
}

// dst[r][c] = bf16(src[r][c]) (nearest even) for r < m, c < n; zero for c in
// [n, round_up(n, 32)) and for rows [m, round_up(m, 16)). dst holds that many rows of ldd.
void round_rows(const float* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst, int64_t ldd);

// The pack_values layout of bf16(src) for src[m x n] fp32 rows (ld), rounded to nearest even:
// the rows are the reduction (paired) and the columns the output features, so a P or dS tile
// becomes the B operand of a product that reduces over its query rows (the backward's
// dV^T += dO^T P and dK^T += Q^T dS). Zero past m (to round_up(m, 32)) and past n (to
// round_up(n, 16)).
void pack_row_pairs(const float* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst);

// dst[r][c] = src[r][c] for r < m, c < n (bf16 bits, ld / ldd), zero for c in [n, ldd) and for
// rows [m, rows): the A operand of scores from bf16 input rows, padded as the tiles read it.
void pad_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst, int64_t ldd,
              int64_t rows);

// dst[c][r] = src[r][c] for r < m, c < n, zero for r in [m, ldd) and for rows [n, rows): the
// transposed A operand (features x rows) of a product that reduces over rows.
void transpose_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst,
                    int64_t ldd, int64_t rows);

// S[m x n] = scale * Q K^T: q as round_rows wrote it (d padded to 32, ldq), key_tiles as
// pack_keys wrote them for these n keys. Columns past n are left alone.
void scores(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* key_tiles, int64_t n,
            int64_t d, float scale, float* s, int64_t lds);

// S = Q K^T, unscaled, as scores computes it, each 16 x 16 accumulator tile stored straight into
// s (no pass through a scratch tile): whole tiles, so s must hold round_up(m, 16) rows of
// round_up(n, 16) <= lds columns; the rows past m are 0 (q's zero rows) and the columns past n
// are products with whatever the key tiles hold there (unread). The scale is left to the softmax
// row pass (exp2_shift_sum_bf16), which takes it in its fused multiply-subtract.
void scores_unscaled(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* key_tiles,
                     int64_t n, int64_t d, float* s, int64_t lds);

// O[m x dv] = O * factor[row] + P V for P = p_bf16 (round_rows of the fp32 P, ldp) and
// value_tiles as pack_values wrote them. Only keys [0, n) count: a chunk that ends past n is
// copied into v_tail (round_up(dv, 16) * 32 elements) with those keys zeroed, so a value row a
// row never sees (NaN included) reaches no output.
void pv(const uint16_t* p_bf16, int64_t ldp, int64_t m, const uint16_t* value_tiles, int64_t n,
        int64_t dv, const float* factor, float* o, int64_t ldo, uint16_t* v_tail);

}  // namespace attn_ext::cpu::amx

#endif
