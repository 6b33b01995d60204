#pragma once
// Compile-time shape of the CPU flash kernels and the per-thread workspace they use.
#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>
#include <vector>
#include <ATen/OpMathType.h>

namespace attn_ext::cpu {

template <typename scalar_t>
struct FlashTraits {
  // Scores, softmax and accumulation run in fp32 for bf16/fp16/fp32 and in fp64 for fp64.
  using acc_t = at::opmath_type<scalar_t>;
  // Inputs of another type are converted block by block into acc_t buffers before the GEMMs.
  static constexpr bool kConvert = !std::is_same_v<scalar_t, acc_t>;
  // Forward tiles: each K/V block read (and converted) serves kFwdBlockM query rows, and the
  // 128 x 256 fp32 score tile (128 KiB) stays in L2 beside its K/V blocks. Under a causal or
  // window band the tiles crossing the band's edge compute masked work; while rows see few
  // keys (Sk <= kShortBand) that waste matters more than GEMM efficiency, so tiles are halved.
  // (Measured on a 2-core Zen AVX2 machine against 64..256 x 256..512: MKL runs these tiles
  // at ~85% of its large-GEMM rate; the choices below were best or within 2% in every cell.)
  static constexpr int64_t kFwdBlockM = 128;
  static constexpr int64_t kFwdBlockMShortBand = 64;
  static constexpr int64_t kShortBand = 2048;
  static constexpr int64_t kFwdBlockN = 256;
  static constexpr int64_t fwd_block_m(bool banded, int64_t seqlen_k) {
    return banded && seqlen_k <= kShortBand ? kFwdBlockMShortBand : kFwdBlockM;
  }
  // Reduced-precision K/V are converted once per (batch, kv head) into per-thread fp32
  // copies that the thread's consecutive query blocks reuse (converting per tile cost ~3%
  // of the bf16 forward); heads larger than this many elements fall back to per-tile
  // conversion so that a long context cannot claim gigabytes of per-thread scratch.
  static constexpr int64_t kMaxConvertedHeadElems = int64_t(1) << 21;  // 8 MiB of fp32
  // The AVX2 forward packs K and V into panels once per (batch, kv head) and thread, up to
  // this many floats (16 MiB: S = 32768 at D = 64); a larger head is packed tile by tile.
  static constexpr int64_t kMaxPackedHeadElems = int64_t(1) << 22;
  // Below this many query rows a head's panels serve too few rows to repay packing them,
  // unless (fp32) the head has at most kPackedFewKeys keys: packing those costs less than a
  // BLAS call's fixed overhead (MKL's sgemm setup was ~12% of an fp32 forward at B 1, H 8,
  // S 8; docs/performance.md, "Per-call overhead"). bf16 / fp16 keep BLAS there: their packed
  // products round P to bf16 where BLAS keeps it in fp32, which moves the few-row errors their
  // regression tests are built on (not re-derived yet).
  static constexpr int64_t kPackedMinQueries = 16;
  static constexpr int64_t kPackedFewKeys = 64;
  // Backward tiles: two score-sized tiles (P and dP, 64 KiB each) live at once beside the
  // packed K/V block and Q/dO tile. 128 x 128 was 8% faster than 64 x 128 at D = 128
  // (fp32 S = 2048 forward + backward, 2-core Zen 3) and equal at D = 64.
  static constexpr int64_t kBwdBlockM = 128;
  static constexpr int64_t kBwdBlockN = 128;
  // Decode: the query heads of one KV head (and their Sq new rows) form one row block, so
  // each key/value row is read once per block; decode is bound by reading the cache, and
  // 256-key tiles keep a K tile, a V tile and the scores in L2 while MKL streams them.
  static constexpr int64_t kDecodeBlockM = 128;
  static constexpr int64_t kDecodeBlockN = 256;
  // Blocks of a few rows on the cache rows in place (decoding/cpu/decode_rows.h) take 128-key
  // tiles: a paged task that reads every KV head of a page holds the tile of every head (8
  // heads x 128 keys x 256 B of bf16 K and V at D 128: 512 KB), which at 256 keys outgrew the
  // 1 MB L2 of the Zen 5 VM measured (2026-11-29, H 32, Hkv 8, D 128, 4k-16k keys, cold
  // caches). FlashAttention's (page, rows, Hkv, D) pages of 16 rows went from 1.45-1.8x the
  // contiguous step to 1.06-1.39x in bf16 and from 1.39-1.49x to 1.16-1.32x in fp32. With the
  // next tile's keys asked for ahead (decode_attention.cpp) the contiguous step stayed within
  // 0.93-1.07x of the 256-key one. 64 keys cost the contiguous step 7-26%.
  static constexpr int64_t kDecodeRowsBlockN = 128;
  // Split-KV: a split below 512 keys costs more in its merge and task overhead than it
  // gains in parallelism; aim for two tasks per thread so uneven lengths balance.
  static constexpr int64_t kMinSplitKeys = 512;
  static constexpr int64_t kTasksPerThread = 2;
};

// Allocates on cache-line (64-byte) boundaries. Packed operands are read in 64-byte rows (AMX
// tile rows, zmm loads); a row that straddles two lines costs two loads: the AMX block products
// ran 1.5-2x faster on aligned operands than on malloc's 16-byte alignment (Sapphire Rapids VM,
// 2026-11-26, dev/cpu_forward_experiments.md).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const {
    return false;
  }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// Resizes buf to hold at least elems (never shrinks): scratch sized by the largest block seen.
template <typename T>
inline void grow(AlignedVector<T>& buf, int64_t elems) {
  if (static_cast<int64_t>(buf.size()) < elems) buf.resize(static_cast<size_t>(elems));
}

// Per-thread scratch, allocated once per parallel chunk, cache-line aligned.
template <typename T>
struct Buffer {
  AlignedVector<T> data;
  explicit Buffer(int64_t n = 0) : data(static_cast<size_t>(n)) {}
  T* get() { return data.data(); }
  const T* get() const { return data.data(); }
};

// Row r of a strided (B, H, S, *) tensor.
template <typename T>
inline T* row_ptr(T* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride, int64_t b,
                  int64_t h, int64_t r) {
  return base + b * batch_stride + h * head_stride + r * row_stride;
}

}  // namespace attn_ext::cpu
