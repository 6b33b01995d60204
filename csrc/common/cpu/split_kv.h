#pragma once
// Split-KV decoding on the CPU: how many splits a short batch gets, which keys a split
// reads, and the merge of the splits' partial results. Shared by decode_attention and
// tpa_decode_attention.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <ATen/Parallel.h>

namespace attn_ext::cpu {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Enough (block, split) tasks to keep every thread busy (tasks_per_thread each), but no
// split shorter than min_split_keys keys of the longest sequence.
inline int64_t auto_splits(int64_t blocks, int64_t max_len, int64_t min_split_keys,
                           int64_t tasks_per_thread) {
  const int64_t want =
      ceil_div(tasks_per_thread * at::get_num_threads(), std::max<int64_t>(blocks, 1));
  const int64_t most = std::max<int64_t>(1, max_len / min_split_keys);
  return std::clamp<int64_t>(want, 1, most);
}

// Keys [begin, end) of split `split` of the range [lo, hi): equal shares rounded up to
// whole tiles, so that only the last split has a partial tile.
inline std::pair<int64_t, int64_t> split_range(int64_t lo, int64_t hi, int64_t splits,
                                               int64_t split, int64_t tile) {
  const int64_t chunk = std::max<int64_t>(ceil_div(ceil_div(hi - lo, splits), tile) * tile, tile);
  const int64_t begin = std::min(hi, lo + split * chunk);
  return {begin, std::min(hi, begin + chunk)};
}

// Folds one row's `splits` partial results (online-softmax states and unnormalized outputs
// of d values, split-major) into `acc`, in split order (deterministic); returns the merged
// state, whose inv_sum() normalizes `acc`.
template <typename acc_t, typename State>
State merge_row_splits(const State* states, const acc_t* outs, int64_t splits, int64_t d,
                       acc_t* acc) {
  State total;
  std::fill(acc, acc + d, acc_t(0));
  for (int64_t sp = 0; sp < splits; ++sp) {
    acc_t self_factor, other_factor;
    total.merge(states[sp], &self_factor, &other_factor);
    const acc_t* part = outs + sp * d;
    for (int64_t c = 0; c < d; ++c) acc[c] = acc[c] * self_factor + part[c] * other_factor;
  }
  return total;
}

}  // namespace attn_ext::cpu
