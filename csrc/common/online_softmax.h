#pragma once
// Online-softmax state of one query row, in the log2 domain (scores pre-multiplied by
// log2(e)). Serves the blocked forward, split-KV decode and any merge of partial results.
#include <cmath>
#include <limits>
#include <c10/macros/Macros.h>
#include "common/constants.h"

namespace attn_ext {

template <typename acc_t>
struct SoftmaxState {
  acc_t max = -std::numeric_limits<acc_t>::infinity();  // running max (log2 domain)
  acc_t sum = 0;                                        // running sum of exp2(s - max)

  // Raise the running max to cover a new block whose max is `block_max`.
  // Returns the factor by which the accumulated sum / output must be rescaled.
  C10_HOST_DEVICE acc_t rescale_to(acc_t block_max) {
    const acc_t new_max = block_max > max ? block_max : max;
    // An all-masked row keeps max = -inf; the factor 1 avoids exp2(-inf - -inf) = NaN.
    const acc_t factor = (new_max == max) ? acc_t(1) : exp2_(max - new_max);
    sum *= factor;
    max = new_max;
    return factor;
  }
  // Reference point that block scores are shifted by before exp2 (0 for an empty row).
  C10_HOST_DEVICE acc_t shift() const {
    return max == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : max;
  }
  // Fold another partial state (e.g. another KV split) into this one; returns the factors
  // by which this and the other accumulator must be scaled before adding them.
  C10_HOST_DEVICE void merge(const SoftmaxState& o, acc_t* self_factor, acc_t* other_factor) {
    const acc_t new_max = o.max > max ? o.max : max;
    const bool empty = new_max == -std::numeric_limits<acc_t>::infinity();
    *self_factor = empty ? acc_t(0) : exp2_(max - new_max);
    *other_factor = empty ? acc_t(0) : exp2_(o.max - new_max);
    sum = sum * *self_factor + o.sum * *other_factor;
    max = new_max;
  }
  C10_HOST_DEVICE bool empty() const { return !(sum > acc_t(0)); }
  // 1 / sum, or 0 for a row that saw no key (its output is then zero).
  C10_HOST_DEVICE acc_t inv_sum() const { return sum > acc_t(0) ? acc_t(1) / sum : acc_t(0); }
  // Natural-log log-sum-exp of the scaled scores; -inf for an empty row.
  C10_HOST_DEVICE float lse() const {
    if (!(sum > acc_t(0)) && !std::isnan(static_cast<double>(sum))) {
      return -std::numeric_limits<float>::infinity();
    }
    // In double, so that the only rounding is the final one to float32: the backward
    // rebuilds every probability from this value.
    return static_cast<float>((static_cast<double>(max) + std::log2(static_cast<double>(sum))) *
                              kLn2);
  }

 private:
  C10_HOST_DEVICE static acc_t exp2_(acc_t x) { return std::exp2(x); }
};

}  // namespace attn_ext
