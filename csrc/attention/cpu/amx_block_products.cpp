// The bf16 forward's block products on AMX tiles (contracts in amx_block_products.h).
//
// Shapes: every tile is 16 rows x 64 bytes. A micro-tile is 32 rows x 32 columns of output in
// the four accumulator tiles 0-3, fed by two A tiles (4, 5: 16 rows x 32 bf16 of Q or P) and two
// B tiles (6, 7: packed K or V), so each pair of loads feeds four tile products; a block edge
// with only 16 rows or columns left runs the same loop on fewer tiles. Accumulators leave
// through a 16 x 16 fp32 scratch in L1, where the scale (scores) or the online-softmax rescale
// (P V) is applied while writing the caller's row-major block, with masked stores at its edges.
//
// This file is compiled with the build's flags (AVX2) and switches to AVX-512/AMX with a target
// pragma after its includes (wide_target_begin.h), as avx512_block_products.cpp does, so no inline
// function it shares with the rest of the library is ever emitted with these instructions;
// block_kernels() calls it only where available() holds.
#include "attention/cpu/amx_block_products.h"

#ifdef ATTN_EXT_AMX_PRODUCTS
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ATTN_EXT_WIDE_TARGET "avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16"
#include "common/cpu/wide_target_begin.h"

namespace attn_ext::cpu::amx {
namespace {

// Linux (>= 5.16) keeps the 8 KiB tile data state off until a process asks for it
// (Documentation/arch/x86/xstate.rst); these are the arch_prctl codes and the state's bit.
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
// CPUID leaf 7 bits: EBX (subleaf 0) AVX512F, AVX512DQ (the bf16 row pass's vreduceps);
// EDX (subleaf 0) AMX-BF16, AMX-TILE; EAX (subleaf 1) AVX512-BF16. XCR0 bits: SSE/AVX/opmask/ZMM
// state and the two tile states.
constexpr unsigned kCpuidAvx512f = 1u << 16;
constexpr unsigned kCpuidAvx512dq = 1u << 17;
constexpr unsigned kCpuidAmxBf16 = 1u << 22;
constexpr unsigned kCpuidAmxTile = 1u << 24;
constexpr unsigned kCpuidAvx512Bf16 = 1u << 5;
constexpr unsigned kCpuidOsxsave = 1u << 27;  // leaf 1 ECX
constexpr uint64_t kXcr0Avx512 = 0xE6;        // bits 1, 2, 5, 6, 7
constexpr uint64_t kXcr0Tiles = 3ull << 17;   // XTILECFG, XTILEDATA

constexpr int kRowBytes = 64;  // every tile row: 32 bf16 or 16 fp32
constexpr int kPaletteTiles = 8;
constexpr uint8_t kPalette = 1;  // the one palette of AMX (8 tiles of up to 16 x 64 bytes)
constexpr int kLanes = 16;       // fp32 lanes of a zmm, one accumulator tile row

// The 64-byte operand of LDTILECFG (Intel SDM vol. 2, "LDTILECFG").
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads exactly 64 bytes");

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

bool probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & kCpuidOsxsave)) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const unsigned max_subleaf = a;
  if (!(b & kCpuidAvx512f) || !(b & kCpuidAvx512dq) || !(d & kCpuidAmxBf16) || !(d & kCpuidAmxTile))
    return false;
  if (max_subleaf < 1) return false;
  __cpuid_count(7, 1, a, b, c, d);
  if (!(a & kCpuidAvx512Bf16)) return false;
  const uint64_t x = xcr0();
  if ((x & kXcr0Avx512) != kXcr0Avx512 || (x & kXcr0Tiles) != kXcr0Tiles) return false;
  // Granted process-wide, threads started before or after included; asking again is harmless
  // (torch's oneDNN asks too).
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0) return false;
  return (granted >> kXfeatureXtiledata) & 1ul;
}

inline __mmask16 lane_mask(int64_t cols) {
  return cols >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1u);
}

// A permutation of 32 16-bit elements: elements 0-15 (one row) and 16-31 (the next) into the
// pairs (e0, o0), (e1, o1), ... of a tile row in the pair layout.
alignas(64) constexpr uint16_t kInterleave[2 * kLanes] = {
    0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// 16 bf16 of a row (even) and of the row ld below, interleaved into (even, odd) pairs by
// kInterleave: one tile row of the pair layout, or 16 32-bit words of row pairs.
inline __m512i interleave_rows(__m256i even, __m256i odd) {
  const __m512i rows = _mm512_inserti64x4(_mm512_zextsi256_si512(even), odd, 1);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), rows);
}
inline __m512i pair_rows(const uint16_t* even, const uint16_t* odd) {
  return interleave_rows(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even)),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd)));
}
inline __m512i pair_rows(const uint16_t* even, int64_t ld) {
  return pair_rows(even, even + ld);
}

// The first `elems` of 32 bf16 lanes (all for elems >= 32).
inline __mmask32 pair_mask(int64_t elems) {
  return elems >= kPairDepth ? ~__mmask32(0) : __mmask32((1u << elems) - 1u);
}
// 16 bf16 of `row` under `cols`, or zeros for a row that does not exist (nullptr): a partial
// tile's rows, read without touching memory past the keys or features.
inline __m256i row16_or_zero(const uint16_t* row, __mmask16 cols) {
  return row ? _mm256_maskz_loadu_epi16(cols, row) : _mm256_setzero_si256();
}

// w[j][t] -> w[t][j] for a 16 x 16 matrix of 32-bit words, one row per register: words paired
// within 128-bit lanes (unpack 32, then 64 bits: u[4i + c] lane L holds column 4L + c of rows
// 4i..4i+3), then the lanes gathered (shuffle_i32x4 twice).
inline void transpose_words(__m512i (&w)[kLanes]) {
  __m512i t[kLanes], u[kLanes];
  for (int i = 0; i < kLanes / 2; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(w[2 * i], w[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(w[2 * i], w[2 * i + 1]);
  }
  for (int i = 0; i < kLanes / 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    // Lanes 0-1 (then 2-3) of the four row groups' column-c registers, then split by lane.
    const __m512i lo01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i hi01 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i lo23 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i hi23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    w[c] = _mm512_shuffle_i32x4(lo01, hi01, 0x88);
    w[4 + c] = _mm512_shuffle_i32x4(lo01, hi01, 0xDD);
    w[8 + c] = _mm512_shuffle_i32x4(lo23, hi23, 0x88);
    w[12 + c] = _mm512_shuffle_i32x4(lo23, hi23, 0xDD);
  }
}

// Accumulator tile t (0-3) of a micro-tile, stored as 16 x 16 fp32.
using TileScratch = float[4][kTileRows * kAccCols];

// Tiles 0-3 += A (tiles 4, 5: rows a, a + 16 rows) x B (tiles 6, 7: b0, b1), over `steps`
// reduction steps: step i reads A at a + i * a_step (bf16 elements) and B at b_at(i) and
// b_at(i) + b_next; then accumulator t is stored at out[t], rows out_bytes apart. R2 / C2:
// whether the second row / column block exists.
template <bool R2, bool C2, typename BAt>
inline void micro_tile(const uint16_t* a, int64_t lda, int64_t a_step, int64_t steps, BAt b_at,
                       int64_t b_next, float* const (&out)[4], int64_t out_bytes) {
  const int64_t a_bytes = lda * int64_t(sizeof(uint16_t));
  _tile_zero(0);
  if constexpr (C2) _tile_zero(1);
  if constexpr (R2) _tile_zero(2);
  if constexpr (R2 && C2) _tile_zero(3);
  for (int64_t i = 0; i < steps; ++i) {
    const uint16_t* b = b_at(i);
    _tile_loadd(4, a + i * a_step, a_bytes);
    _tile_loadd(6, b, kRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (C2) {
      _tile_loadd(7, b + b_next, kRowBytes);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (R2) {
      _tile_loadd(5, a + kTileRows * lda + i * a_step, a_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (C2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out[0], out_bytes);
  if constexpr (C2) _tile_stored(1, out[1], out_bytes);
  if constexpr (R2) _tile_stored(2, out[2], out_bytes);
  if constexpr (R2 && C2) _tile_stored(3, out[3], out_bytes);
}

// micro_tile into the 16 x 16 scratch tiles of acc.
template <bool R2, bool C2, typename BAt>
inline void micro_tile(const uint16_t* a, int64_t lda, int64_t a_step, int64_t steps, BAt b_at,
                       int64_t b_next, TileScratch& acc) {
  float* const out[4] = {acc[0], acc[1], acc[2], acc[3]};
  micro_tile<R2, C2>(a, lda, a_step, steps, b_at, b_next, out, kRowBytes);
}

// Runs micro_tile over an m x n output in 32 x 32 micro-tiles (16 at the edges), then
// epilogue(tile, r0, c0) for each accumulator tile it filled.
template <typename Micro, typename Epilogue>
inline void for_micro_tiles(int64_t m, int64_t n, Micro micro, Epilogue epilogue) {
  TileScratch acc;
  const int64_t row_blocks = (m + kTileRows - 1) / kTileRows;
  const int64_t col_blocks = (n + kAccCols - 1) / kAccCols;
  for (int64_t rb = 0; rb < row_blocks; rb += 2) {
    const bool r2 = rb + 1 < row_blocks;
    for (int64_t cb = 0; cb < col_blocks; cb += 2) {
      const bool c2 = cb + 1 < col_blocks;
      if (r2 && c2)
        micro(std::true_type{}, std::true_type{}, rb, cb, acc);
      else if (r2)
        micro(std::true_type{}, std::false_type{}, rb, cb, acc);
      else if (c2)
        micro(std::false_type{}, std::true_type{}, rb, cb, acc);
      else
        micro(std::false_type{}, std::false_type{}, rb, cb, acc);
      for (int t = 0; t < 4; ++t) {
        const int64_t r0 = (rb + t / 2) * kTileRows, c0 = (cb + t % 2) * kAccCols;
        if (r0 < m && c0 < n && (t / 2 == 0 || r2) && (t % 2 == 0 || c2)) epilogue(acc[t], r0, c0);
      }
    }
  }
}

}  // namespace

bool available() {
  static const bool ok = probe();
  return ok;
}

// GCC 12 does not apply the target pragma to constructors and destructors (an always_inline
// mismatch on _tile_loadconfig): they call these plain functions instead.
void load_tile_config() {
  TileConfig cfg{};
  cfg.palette_id = kPalette;
  for (int t = 0; t < kPaletteTiles; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = kRowBytes;
  }
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of cfg, so the stores to the
  // rest were dropped as dead (tilezero then faulted on an unconfigured thread); the empty asm
  // with a memory clobber keeps all 64 bytes written.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

void release_tiles() {
  _tile_release();
}

ThreadTiles::ThreadTiles() {
  load_tile_config();
}

ThreadTiles::~ThreadTiles() {
  release_tiles();
}

namespace {

// The key tiles of one block of `rows` <= 16 keys (key j's row at key(j)).
template <typename Rows>
inline void pack_key_block(Rows key, int64_t rows, int64_t d, int64_t chunks, uint16_t* tiles) {
  for (int64_t c = 0; c < chunks; ++c) {
    uint16_t* tile = tiles + c * kTileElems;
    const int64_t f0 = c * kPairDepth;
    // A 16 x 16 transpose of feature pairs (32-bit words) in registers. A partial tile (the
    // keys past n, the features past d) loads its rows masked and zeros the missing ones: a
    // short sequence's only tile took the element-by-element path, 7% of a bf16 fwd+bwd at
    // S = 8 (docs/performance.md, "Per-call overhead").
    __m512i words[kTileRows];
    if (rows == kTileRows && f0 + kPairDepth <= d) {
      for (int64_t j = 0; j < kTileRows; ++j) words[j] = _mm512_loadu_si512(key(j) + f0);
    } else {
      const __mmask32 feats = pair_mask(d - f0);
      for (int64_t j = 0; j < kTileRows; ++j)
        words[j] = j < rows ? _mm512_maskz_loadu_epi16(feats, key(j) + f0) : _mm512_setzero_si512();
    }
    transpose_words(words);
    for (int64_t t = 0; t < kTileRows; ++t) _mm512_storeu_si512(tile + t * kPairDepth, words[t]);
  }
}

// The value tiles of one chunk of 32 keys, `rows` of them present (value j's row at value(j)).
template <typename Rows>
inline void pack_value_chunk(Rows value, int64_t rows, int64_t dv, int64_t blocks,
                             uint16_t* tiles) {
  for (int64_t b = 0; b < blocks; ++b) {
    uint16_t* tile = tiles + b * kTileElems;
    const int64_t f0 = b * kAccCols;
    // Rows 2t and 2t + 1 (16 bf16 each) interleaved by one permute; a partial tile loads its
    // rows masked and zeros the keys past n (as pack_keys).
    if (rows == kPairDepth && f0 + kAccCols <= dv) {
      for (int64_t t = 0; t < kTileRows; ++t)
        _mm512_storeu_si512(tile + t * kPairDepth,
                            pair_rows(value(2 * t) + f0, value(2 * t + 1) + f0));
      continue;
    }
    const __mmask16 cols = lane_mask(dv - f0);
    auto row = [&](int64_t j) { return j < rows ? value(j) + f0 : nullptr; };
    for (int64_t t = 0; t < kTileRows; ++t) {
      _mm512_storeu_si512(
          tile + t * kPairDepth,
          interleave_rows(row16_or_zero(row(2 * t), cols), row16_or_zero(row(2 * t + 1), cols)));
    }
  }
}

}  // namespace

// Strided rows are addressed from the block's first row; paged ones through the block's
// pointers (KeyRows::fill; avx2::pack_key_panels says why the two differ).
void pack_keys(const KeyRows<uint16_t>& k, int64_t n, int64_t d, uint16_t* dst) {
  const int64_t chunks = round_up(d, kPairDepth) / kPairDepth;
  const uint16_t* key[kTileRows];
  for (int64_t j0 = 0; j0 < round_up(n, kPairDepth); j0 += kTileRows) {
    const int64_t rows = std::clamp<int64_t>(n - j0, 0, kTileRows);
    uint16_t* tiles = dst + j0 / kTileRows * chunks * kTileElems;
    if (k.pages == nullptr) {
      const uint16_t* first = k.base + j0 * k.ld;
      const int64_t ld = k.ld;
      pack_key_block([=](int64_t j) { return first + j * ld; }, rows, d, chunks, tiles);
    } else {
      k.fill(j0, rows, key);
      pack_key_block([&](int64_t j) { return key[j]; }, rows, d, chunks, tiles);
    }
  }
}

void pack_values(const KeyRows<uint16_t>& v, int64_t n, int64_t dv, uint16_t* dst) {
  const int64_t blocks = round_up(dv, kAccCols) / kAccCols;
  const uint16_t* value[kPairDepth];
  for (int64_t j0 = 0; j0 < round_up(n, kPairDepth); j0 += kPairDepth) {
    const int64_t rows = std::clamp<int64_t>(n - j0, 0, kPairDepth);
    uint16_t* tiles = dst + j0 / kPairDepth * blocks * kTileElems;
    if (v.pages == nullptr) {
      const uint16_t* first = v.base + j0 * v.ld;
      const int64_t ld = v.ld;
      pack_value_chunk([=](int64_t j) { return first + j * ld; }, rows, dv, blocks, tiles);
    } else {
      v.fill(j0, rows, value);
      pack_value_chunk([&](int64_t j) { return value[j]; }, rows, dv, blocks, tiles);
    }
  }
}

void round_rows(const float* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst, int64_t ldd) {
  const int64_t n_pad = round_up(n, kPairDepth);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n_pad; c += kLanes) {
      const __m512 x =
          _mm512_maskz_loadu_ps(lane_mask(std::max<int64_t>(n - c, 0)), src + r * ld + c);
      const __m256bh y = _mm512_cvtneps_pbh(x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldd + c), (__m256i)y);
    }
  }
  for (int64_t r = m; r < round_up(m, kTileRows); ++r)
    std::memset(dst + r * ldd, 0, n_pad * sizeof(uint16_t));
}

void pack_row_pairs(const float* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst) {
  // cvtne2ps_pbh(odd, even) holds even row's 16 columns, then odd row's; kInterleave
  // interleaves them into the tile row's (even, odd) pairs, column by column.
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const int64_t blocks = round_up(n, kAccCols) / kAccCols;
  for (int64_t r0 = 0; r0 < round_up(m, kPairDepth); r0 += kPairDepth) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t* tile = dst + (r0 / kPairDepth * blocks + b) * kTileElems;
      const int64_t c0 = b * kAccCols;
      const __mmask16 cols = lane_mask(n - c0);
      for (int64_t t = 0; t < kTileRows; ++t) {
        const int64_t even = r0 + 2 * t, odd = even + 1;
        const __m512 e =
            even < m ? _mm512_maskz_loadu_ps(cols, src + even * ld + c0) : _mm512_setzero_ps();
        const __m512 o =
            odd < m ? _mm512_maskz_loadu_ps(cols, src + odd * ld + c0) : _mm512_setzero_ps();
        const __m512i pairs =
            _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(o, e));
        _mm512_storeu_si512(tile + t * kPairDepth, pairs);
      }
    }
  }
}

void pad_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst, int64_t ldd,
              int64_t rows) {
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(dst + r * ldd, src + r * ld, n * sizeof(uint16_t));
    std::memset(dst + r * ldd + n, 0, (ldd - n) * sizeof(uint16_t));
  }
  if (rows > m) std::memset(dst + m * ldd, 0, (rows - m) * ldd * sizeof(uint16_t));
}

void transpose_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst,
                    int64_t ldd, int64_t rows) {
  for (int64_t c = 0; c < rows; ++c)
    std::memset(dst + c * ldd + m, 0, (ldd - m) * sizeof(uint16_t));
  // Whole blocks of 32 rows x 16 columns in registers: rows 2i and 2i + 1 interleaved column by
  // column (as pack_values pairs keys), so that 32-bit word c of register i is column c of the
  // pair; then a 16 x 16 transpose of those words gives column c's 32 rows in register c.
  const int64_t m_full = m / kPairDepth * kPairDepth, n_full = n / kLanes * kLanes;
  for (int64_t r0 = 0; r0 < m_full; r0 += kPairDepth) {
    for (int64_t c0 = 0; c0 < n_full; c0 += kLanes) {
      __m512i words[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) words[i] = pair_rows(src + (r0 + 2 * i) * ld + c0, ld);
      transpose_words(words);
      for (int64_t c = 0; c < kLanes; ++c) _mm512_storeu_si512(dst + (c0 + c) * ldd + r0, words[c]);
    }
  }
  // The rest element by element: the rows past the whole blocks, then the columns past them.
  for (int64_t c = 0; c < n; ++c)
    for (int64_t r = m_full; r < m; ++r) dst[c * ldd + r] = src[r * ld + c];
  for (int64_t c = n_full; c < n; ++c)
    for (int64_t r = 0; r < m_full; ++r) dst[c * ldd + r] = src[r * ld + c];
  for (int64_t c = n; c < rows; ++c) std::memset(dst + c * ldd, 0, m * sizeof(uint16_t));
}

void scores(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* key_tiles, int64_t n,
            int64_t d, float scale, float* s, int64_t lds) {
  if (m <= 0 || n <= 0) return;
  const int64_t chunks = round_up(d, kPairDepth) / kPairDepth;
  const __m512 sv = _mm512_set1_ps(scale);
  for_micro_tiles(
      m, n,
      [&](auto r2, auto c2, int64_t rb, int64_t cb, TileScratch& acc) {
        const uint16_t* keys = key_tiles + cb * chunks * kTileElems;
        micro_tile<decltype(r2)::value, decltype(c2)::value>(
            q + rb * kTileRows * ldq, ldq, kPairDepth, chunks,
            [&](int64_t c) { return keys + c * kTileElems; }, chunks * kTileElems, acc);
      },
      [&](const float* tile, int64_t r0, int64_t c0) {
        const __mmask16 cols = lane_mask(n - c0);
        const int64_t rows = std::min<int64_t>(kTileRows, m - r0);
        for (int64_t r = 0; r < rows; ++r)
          _mm512_mask_storeu_ps(s + (r0 + r) * lds + c0, cols,
                                _mm512_mul_ps(_mm512_loadu_ps(tile + r * kAccCols), sv));
      });
}

void scores_unscaled(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* key_tiles,
                     int64_t n, int64_t d, float* s, int64_t lds) {
  if (m <= 0 || n <= 0) return;
  const int64_t chunks = round_up(d, kPairDepth) / kPairDepth;
  const int64_t s_bytes = lds * int64_t(sizeof(float));
  for_micro_tiles(
      m, n,
      [&](auto r2, auto c2, int64_t rb, int64_t cb, TileScratch&) {
        const uint16_t* keys = key_tiles + cb * chunks * kTileElems;
        float* const corner = s + rb * kTileRows * lds + cb * kAccCols;
        float* const out[4] = {corner, corner + kAccCols, corner + kTileRows * lds,
                               corner + kTileRows * lds + kAccCols};
        micro_tile<decltype(r2)::value, decltype(c2)::value>(
            q + rb * kTileRows * ldq, ldq, kPairDepth, chunks,
            [&](int64_t c) { return keys + c * kTileElems; }, chunks * kTileElems, out, s_bytes);
      },
      [](const float*, int64_t, int64_t) {});
}

void pv(const uint16_t* p_bf16, int64_t ldp, int64_t m, const uint16_t* value_tiles, int64_t n,
        int64_t dv, const float* factor, float* o, int64_t ldo, uint16_t* v_tail) {
  if (m <= 0) return;
  const int64_t blocks = round_up(dv, kAccCols) / kAccCols;
  const int64_t chunk_elems = blocks * kTileElems;  // the tiles of one 32-key chunk
  const int64_t full = n / kPairDepth, chunks = round_up(n, kPairDepth) / kPairDepth;
  if (chunks > full) {
    // Keys [n, end of chunk) may be keys these rows never see (past the band, past the
    // sequence): zero them in a copy rather than trust P's zeros (0 * NaN is NaN).
    const int64_t keep = n - full * kPairDepth;
    std::memcpy(v_tail, value_tiles + full * chunk_elems, chunk_elems * sizeof(uint16_t));
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t t = 0; t < kTileRows; ++t)
        for (int64_t e = 0; e < 2; ++e)
          if (2 * t + e >= keep)
            for (int64_t col = 0; col < kAccCols; ++col)
              v_tail[b * kTileElems + (t * kAccCols + col) * 2 + e] = 0;
  }
  for_micro_tiles(
      m, dv,
      [&](auto r2, auto c2, int64_t rb, int64_t cb, TileScratch& acc) {
        micro_tile<decltype(r2)::value, decltype(c2)::value>(
            p_bf16 + rb * kTileRows * ldp, ldp, kPairDepth, chunks,
            [&](int64_t c) {
              return (c < full ? value_tiles + c * chunk_elems : v_tail) + cb * kTileElems;
            },
            kTileElems, acc);
      },
      [&](const float* tile, int64_t r0, int64_t c0) {
        const __mmask16 cols = lane_mask(dv - c0);
        const int64_t rows = std::min<int64_t>(kTileRows, m - r0);
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = o + (r0 + r) * ldo + c0;
          const __m512 acc = _mm512_loadu_ps(tile + r * kAccCols);
          const __m512 ov = _mm512_maskz_loadu_ps(cols, dst);
          const __m512 res = factor ? _mm512_fmadd_ps(ov, _mm512_set1_ps(factor[r0 + r]), acc)
                                    : _mm512_add_ps(ov, acc);
          _mm512_mask_storeu_ps(dst, cols, res);
        }
      });
}

}  // namespace attn_ext::cpu::amx

#include "common/cpu/wide_target_end.h"

#endif  // ATTN_EXT_AMX_PRODUCTS
