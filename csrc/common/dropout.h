#pragma once
// Counter-based dropout: the keep decision of element (b, h, i, j) is a pure function of
// (seed, offset, b, h, i, j), so the backward regenerates the forward's mask and the CPU
// and CUDA kernels agree bit for bit. Philox4x32-10 yields 4 draws per counter, so one
// counter covers 4 consecutive keys of a row.
#include <cstdint>
// PhiloxRNGEngine.h uses AT_ASSERT in device code without including its definition.
#include <c10/util/Exception.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/macros/Macros.h>

namespace attn_ext {

constexpr int kDrawsPerCounter = 4;
// Maps a uint32 draw to [0, 1).
constexpr float kUint32ToUnit = 2.3283064365386963e-10f;  // 2^-32

struct DropoutPolicy {
  uint64_t seed;
  uint64_t offset;
  float p;  // probability of dropping (the threshold the uniform draw is compared with)

  C10_HOST_DEVICE bool active() const { return p > 0.f; }

  // One Philox subsequence per query row of every (batch, head).
  C10_HOST_DEVICE uint64_t row_id(int64_t b, int64_t h, int64_t i, int64_t heads,
                                  int64_t sq) const {
    return static_cast<uint64_t>((b * heads + h) * sq + i);
  }

  // Whether a uniform uint32 draw keeps its element.
  C10_HOST_DEVICE bool kept(uint32_t draw) const {
    return static_cast<float>(draw) * kUint32ToUnit >= p;
  }

  // Fills keep[0..n) for keys [j0, j0 + n) of one row (keep[t] = 1 means kept).
  C10_HOST_DEVICE void row_keep(uint64_t row, int64_t j0, int64_t n, uint8_t* keep) const {
    at::philox_engine engine(seed, row, offset + static_cast<uint64_t>(j0 / kDrawsPerCounter));
    // Discard the draws of keys before j0 that share j0's counter.
    for (int64_t skip = 0; skip < j0 % kDrawsPerCounter; ++skip) engine();
    for (int64_t t = 0; t < n; ++t) keep[t] = kept(engine());
  }

  // Keep bits of the kDrawsPerCounter keys [4 g, 4 g + 4) of one row: bit t for key 4 g + t
  // (one Philox counter; what row_keep yields for the same keys).
  C10_HOST_DEVICE uint32_t group_keep_bits(uint64_t row, int64_t g) const {
    at::philox_engine engine(seed, row, offset + static_cast<uint64_t>(g));
    uint32_t bits = 0;
    for (int t = 0; t < kDrawsPerCounter; ++t) bits |= (kept(engine()) ? 1u : 0u) << t;
    return bits;
  }
};

}  // namespace attn_ext
