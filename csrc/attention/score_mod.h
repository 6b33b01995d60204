#pragma once
// Score-modifier policies shared by the CPU kernels, the CUDA kernels and (in Python) the
// reference: logit soft-capping (Gemma 2), ALiBi position biases and attention sinks. Kernels
// apply them in their own score units (`unit`: log2(e) for kernels that work in the log2
// domain, 1 for natural-log ones), to the scaled scores, before the band and attn_mask.
#include <cmath>
#include <cstdint>
#include <c10/macros/Macros.h>
#include "attention/params.h"
#include "common/online_softmax.h"

namespace attn_ext {

template <typename acc_t>
struct ScoreMod {
  acc_t cap = 0;    // softcap in score units; 0 = off
  acc_t slope = 0;  // ALiBi slope of this (batch, head) in score units; 0 = off
  int64_t key_offset = 0;

  // The modifiers of (b, h) for a sequence whose query i sits at key i + key_offset.
  C10_HOST_DEVICE static ScoreMod make(const AttentionParams& p, int64_t b, int64_t h,
                                       int64_t key_offset, acc_t unit) {
    ScoreMod m;
    m.cap = static_cast<acc_t>(p.softcap) * unit;
    if (p.alibi_slopes != nullptr) {
      m.slope = static_cast<const acc_t*>(p.alibi_slopes)[b * p.alibi_batch_stride + h] * unit;
    }
    m.key_offset = key_offset;
    return m;
  }
  C10_HOST_DEVICE bool active() const { return cap != acc_t(0) || slope != acc_t(0); }
  C10_HOST_DEVICE bool softcapped() const { return cap != acc_t(0); }

  // cap * tanh(s / cap): bounded scores, gradient 1 - tanh^2 (softcap_grad).
  C10_HOST_DEVICE acc_t softcap(acc_t s) const { return cap * std::tanh(s / cap); }
  // The ALiBi bias of query i and key j: -slope * distance between the key and the query's
  // aligned position (bottom-right: i + Sk - Sq), symmetric as in FlashAttention.
  C10_HOST_DEVICE acc_t alibi(int64_t i, int64_t j) const {
    const int64_t d = i + key_offset - j;
    return -slope * static_cast<acc_t>(d < 0 ? -d : d);
  }
  C10_HOST_DEVICE acc_t apply(acc_t s, int64_t i, int64_t j) const {
    if (cap != acc_t(0)) s = softcap(s);
    if (slope != acc_t(0)) s += alibi(i, j);
    return s;
  }
  // d softcap(s) / d s from the capped value c = softcap(s).
  C10_HOST_DEVICE acc_t softcap_grad(acc_t capped) const {
    const acc_t t = capped / cap;
    return acc_t(1) - t * t;
  }
};

// The online-softmax state a row starts from: empty, or holding head h's sink logit (one
// term exp(sink) in the denominator, nothing in the output).
template <typename acc_t>
C10_HOST_DEVICE inline SoftmaxState<acc_t> initial_state(const AttentionParams& p, int64_t h,
                                                         acc_t unit) {
  SoftmaxState<acc_t> st;
  if (p.sinks != nullptr) {
    st.max = static_cast<const acc_t*>(p.sinks)[h] * unit;
    st.sum = acc_t(1);
  }
  return st;
}

}  // namespace attn_ext
