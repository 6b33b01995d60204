#pragma once
// Plain parameters of the attention-state merge ops (merge_attention_states and its backward
// and in-place forms), shared by the CPU kernel and, through nvcc, any CUDA one (no ATen).
//
// A state is an output row out (Dv,) with its natural-log log-sum-exp lse; a tensor of states
// is out (..., Dv) with lse (...) = out's shape without the last dimension. The rows are the
// product of the leading sizes; every tensor is addressed through its own strides (the last
// dimension of out-like tensors is contiguous), so strided views are read and written in place.
#include <cstdint>
#include <c10/macros/Macros.h>

namespace attn_ext::merge {

// Leading dimensions a row index is decomposed into; more are rejected at the boundary
// (attention states are (B, H, S, Dv) or (S, H, Dv): three).
constexpr int kMaxLeadingDims = 5;

// One tensor's leading strides, in elements.
struct RowStrides {
  int64_t s[kMaxLeadingDims] = {0, 0, 0, 0, 0};
};

struct RowShape {
  int ndim = 0;                                     // leading dimensions (0: a single row)
  int64_t size[kMaxLeadingDims] = {1, 1, 1, 1, 1};  // leading sizes
  int64_t rows = 1;                                 // their product
  int64_t dv = 0;                                   // elements per row

  // Offset of row r in a tensor with leading strides st.
  C10_HOST_DEVICE int64_t offset(int64_t r, const RowStrides& st) const {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      off += (r % size[d]) * st.s[d];
      r /= size[d];
    }
    return off;
  }
};

// out = (w_a out_a + w_b out_b), lse = log(e^lse_a + e^lse_b), w_x = e^(lse_x - lse); a state
// with lse = -inf is empty and contributes nothing (its out is never read), two empty states
// give out 0 and lse -inf. In place (merge_attention_states_): out_a / lse_a are also the
// destination, the accumulator (out may be float32 for bfloat16 / float16 out_b).
struct MergeParams {
  RowShape shape;
  const void* out_a = nullptr;
  const void* lse_a = nullptr;
  const void* out_b = nullptr;
  const void* lse_b = nullptr;
  void* out = nullptr;
  void* lse = nullptr;
  RowStrides out_a_st, lse_a_st, out_b_st, lse_b_st, out_st, lse_st;
};

// Backward of the out-of-place merge, with g = grad_out and gl = grad_lse (zero when absent):
//   grad_out_a = w_a g, grad_lse_a = w_a w_b (g . out_a - g . out_b) + w_a gl, and the same
//   with a and b swapped (d out / d lse_a = w_a (out_a - out), d lse / d lse_a = w_a).
struct MergeBackwardParams {
  MergeParams fwd;  // out_a, lse_a, out_b, lse_b as in the forward; out / lse unused
  const void* grad_out = nullptr;
  const void* grad_lse = nullptr;  // or null
  void* grad_out_a = nullptr;
  void* grad_lse_a = nullptr;
  void* grad_out_b = nullptr;
  void* grad_lse_b = nullptr;
  RowStrides grad_out_st, grad_lse_st;  // the gradients written are dense
};

}  // namespace attn_ext::merge
