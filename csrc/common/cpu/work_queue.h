#pragma once
// Dynamic scheduling of uneven tasks over the intra-op threads.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <ATen/Parallel.h>

namespace attn_ext::cpu {

// Runs body(worker, task) for every task in [0, n), each thread making one worker with
// make_worker() and claiming the next task whenever it finishes one. With tasks ordered
// longest first, a batch of one long and many short sequences keeps every thread busy to the
// end, where a static split of the task range would leave one thread the long one's tail.
template <typename MakeWorker, typename Body>
void parallel_claim(int64_t n, MakeWorker make_worker, Body body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto worker = make_worker();
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) body(worker, t);
  });
}

}  // namespace attn_ext::cpu
