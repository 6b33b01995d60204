#pragma once
// Plain parameter structs and policies of the spatial-attention ops (CBAM), shared by the CPU
// kernels, the CUDA kernels (nvcc-only: no ATen headers) and, through the documented rules,
// the tests' reference.
//
// A feature map x (N, C, H, W) is read as (N, C, P) with P = H * W pixels, in one of two
// dense layouts: NCHW (element (n, c, p) at (n * C + c) * P + p) or channels-last / NHWC
// (at (n * P + p) * C + c). Per-pixel maps are (N, P) planes, dense.
#include <cstdint>
#include <c10/macros/Macros.h>

namespace attn_ext::spatial {

struct MapLayout {
  int64_t batch = 0, channels = 0, pixels = 0;
  bool channels_last = false;

  C10_HOST_DEVICE int64_t index(int64_t n, int64_t c, int64_t p) const {
    return channels_last ? (n * pixels + p) * channels + c : (n * channels + c) * pixels + p;
  }
};

// pooled (N, P, 2): [mean over channels, max over channels] per pixel; argmax (N, P) int32,
// the channel the max came from.
struct ChannelPoolParams {
  MapLayout x;
  const void* in = nullptr;
  void* pooled = nullptr;
  int32_t* argmax = nullptr;
};

// grad_x (N, C, H, W) in `grad_x.channels_last` layout from grad_pooled (N, P, 2) and argmax
// (N, P): grad_x[n, c, p] (+)= g_avg / C + [c == argmax] g_max, added to what grad_x holds when
// `accumulate` (the gradient of x from the gate, one pass instead of a write and a sum).
struct ChannelPoolBackwardParams {
  MapLayout grad_x;
  const void* grad_pooled = nullptr;
  const int32_t* argmax = nullptr;
  void* out = nullptr;
  bool accumulate = false;
};

// out = x * sigmoid(a), a (N, P) broadcast over channels, in x's element type or in the
// accumulation type (`gate_is_acc`: a float32 gate for a bfloat16 / float16 x). The backward
// reads grad_out in x's layout and writes grad_x = grad_out * sigmoid(a) and
// grad_a[n, p] = sigmoid'(a) * sum_c grad_out[n, c, p] * x[n, c, p].
struct SpatialGateParams {
  MapLayout x;
  const void* in = nullptr;    // x
  const void* gate = nullptr;  // a (N, P)
  bool gate_is_acc = false;    // gate and grad_gate in the accumulation type
  void* out = nullptr;         // forward: out; backward: grad_x
  const void* grad_out = nullptr;
  void* grad_gate = nullptr;  // backward: grad_a (N, P)
};

// Running (max, argmax) over channels with torch.max's rules: the first maximal channel wins
// ties, and a NaN wins over every number (the first NaN when there are several), so the max
// propagates NaN and its gradient goes to the NaN's channel.
template <typename acc_t>
struct MaxArg {
  acc_t value;
  int32_t index;

  // True when v (at a later channel than the current one) replaces the current max.
  static C10_HOST_DEVICE bool takes(acc_t v, acc_t cur) {
    return v > cur || (v != v && cur == cur);
  }
  C10_HOST_DEVICE void update(acc_t v, int32_t c) {
    if (takes(v, value)) {
      value = v;
      index = c;
    }
  }
  // Combines two partial results over disjoint channel sets (either order).
  C10_HOST_DEVICE void merge(const MaxArg& o) {
    const bool o_nan = o.value != o.value, nan = value != value;
    const bool better = o_nan
                            ? (!nan || o.index < index)
                            : (!nan && (o.value > value || (o.value == value && o.index < index)));
    if (better) *this = o;
  }
};

}  // namespace attn_ext::spatial
