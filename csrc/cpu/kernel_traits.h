#pragma once
// Compile-time shape of the CPU flash kernels and the per-thread workspace they use.
#include <cstdint>
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
  // Forward query rows per task: each K/V block read (and converted) serves this many rows
  // and the 128 x 512 fp32 score tile (256 KiB) stays in a 512 KiB L2. Under a causal or
  // window band, tiles crossing the band's edge compute masked work, so they are halved.
  // (Measured on a 2-core Zen AVX2 machine: MKL reaches ~85% of its large-GEMM rate on
  // these tiles; 64x256 and 256x512 were within 5% but never better.)
  static constexpr int64_t kFwdBlockM = 128;
  static constexpr int64_t kFwdBlockMBanded = 64;
  static constexpr int64_t kFwdBlockN = 512;
  // Backward tiles are square and smaller: two score-sized tiles (P and dP) live at once.
  static constexpr int64_t kBwdBlockM = 64;
  static constexpr int64_t kBwdBlockN = 128;
};

// Per-thread scratch, allocated once per parallel chunk.
template <typename T>
struct Buffer {
  std::vector<T> data;
  explicit Buffer(int64_t n = 0) : data(static_cast<size_t>(n)) {}
  T* get() { return data.data(); }
};

// Row r of a strided (B, H, S, *) tensor.
template <typename T>
inline T* row_ptr(T* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride,
                  int64_t b, int64_t h, int64_t r) {
  return base + b * batch_stride + h * head_stride + r * row_stride;
}

}  // namespace attn_ext::cpu
