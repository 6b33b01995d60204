#pragma once
// Compile-time shape of the tensor-core forward kernel.
#include <cstddef>

namespace attn_ext::cuda {

template <typename T, int kHeadDim_>
struct FwdMmaTraits {
  using Elem = T;
  static constexpr int kHeadDim = kHeadDim_;  // q/k/v rows are zero-padded up to this
  // The MMA instruction's shape (m16n8k16): a warp multiplies 16 rows at a time.
  static constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;
  static constexpr int kWarp = 32;
  // Four warps, each owning 16 query rows for the whole key loop (FlashAttention-2's split:
  // no reduction across warps, so no shared-memory round trip of the scores).
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarp;
  static constexpr int kBlockM = kWarps * kMmaM;
  // Keys per block: 64 keeps the score fragment at 32 fp32 registers per thread beside the
  // output's D / 2; at D = 256 the output already takes 128 registers, so 32 keys.
  static constexpr int kBlockN = kHeadDim <= 128 ? 64 : 32;
  // Shared-memory rows padded by 16 bytes: the eight row addresses of one ldmatrix then
  // start in eight different 16-byte bank groups (no bank conflicts, no swizzle needed).
  static constexpr int kPad = 8;
  static constexpr int kPitch = kHeadDim + kPad;
  // Elements per 16-byte global load / shared store.
  static constexpr int kVec = 8;
  static constexpr int kTilesS = kBlockN / kMmaN;   // score fragments per thread
  static constexpr int kTilesO = kHeadDim / kMmaN;  // output fragments per thread
  static constexpr size_t kSmemBytes =
      static_cast<size_t>(kBlockM + 2 * kBlockN) * kPitch * sizeof(T);

  static_assert(kHeadDim % kMmaK == 0 && kBlockN % kMmaK == 0, "tiles must be whole MMA steps");
  static_assert(kTilesS % 2 == 0 && kTilesO % 2 == 0, "ldmatrix.x4 loads two n-tiles at once");
};

}  // namespace attn_ext::cuda
