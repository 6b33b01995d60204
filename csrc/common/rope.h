#pragma once
// Rotary position embedding (RoPE) as a policy shared by the CPU kernels, the CUDA kernels
// and the KV-cache append: which features form a rotated pair, and the rotation angle.
//
// Pair i (0 <= i < rotary_dim / 2) rotates features (first(i), second(i)) by the angle
// pos * inv_freq(i), inv_freq(i) = base^(-2i / rotary_dim) or the caller's table `freqs` (the
// scaled variants: linear, NTK, YaRN, LongRoPE, Llama 3), and the rotated pair is multiplied by
// attention_scaling (YaRN's and LongRoPE's factor on cos and sin; 1 otherwise):
//   halves (LLaMA, GPT-NeoX; the default): features (i, i + rotary_dim / 2);
//   interleaved (document 000, GPT-J):     features (2i, 2i + 1).
// Features at and beyond rotary_dim pass through unchanged.
#include <cmath>
#include <cstdint>
#include <c10/macros/Macros.h>

namespace attn_ext {

struct RopePolicy {
  double base = 10000.0;
  int64_t rotary_dim = 0;  // even, <= head dim
  bool interleaved = false;
  // pairs() fp32 frequencies in the op's device memory, or null for base's; kept alive by the
  // op's prepared inputs.
  const float* freqs = nullptr;
  // Hugging Face's attention_scaling: cos and sin are multiplied by it in the compute type
  // (exactly 1: unchanged).
  double attention_scaling = 1.0;

  C10_HOST_DEVICE int64_t pairs() const { return rotary_dim / 2; }
  C10_HOST_DEVICE int64_t first(int64_t i) const { return interleaved ? 2 * i : i; }
  C10_HOST_DEVICE int64_t second(int64_t i) const {
    return interleaved ? 2 * i + 1 : i + rotary_dim / 2;
  }
  // The float32 frequency 1 / base ** (2i / d): the exponent in fp32 as the references form
  // it (arange / d), then the power in double rounded once, so the value is the correctly
  // rounded fp32 one on every device (fp32 pow implementations differ by an ulp, which a
  // position in the tens of thousands turns into a visible angle error).
  C10_HOST_DEVICE float inv_freq(int64_t i) const {
    if (freqs != nullptr) return freqs[i];
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    return static_cast<float>(1.0 / ::pow(base, static_cast<double>(exponent)));
  }
  // Angles are formed in fp32 (position * inv_freq, one fp32 rounding) as the references
  // and checkpoints trained with them do; cos / sin of that angle are then exact to the
  // compute type.
  C10_HOST_DEVICE static float angle(int64_t pos, float inv_freq) {
    return static_cast<float>(pos) * inv_freq;
  }
};

// a * b + c, rounded once, on the host and on the device.
template <typename T>
C10_HOST_DEVICE inline T fused_multiply_add(T a, T b, T c) {
#ifdef __CUDA_ARCH__
  return fma(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin); the backward rotates by -angle, which is
// the same formula with sin negated (the rotation is orthogonal). Each output is one FMA over
// the other product rounded, written out: left to the compiler, GCC contracted the two
// products of the C++ source into FMAs differently in each loop it generated, so a strided row
// and a contiguous one came out a bit apart. The 8-lane CPU rotation (rope_rows.h) forms the
// same FMAs.
template <typename acc_t>
C10_HOST_DEVICE inline void rotate_pair(acc_t x0, acc_t x1, acc_t c, acc_t s, acc_t* y0,
                                        acc_t* y1) {
  *y0 = fused_multiply_add(x0, c, -(x1 * s));
  *y1 = fused_multiply_add(x1, c, x0 * s);
}

}  // namespace attn_ext
