// Host-side checks of the CuTe forward's layouts and partitions (csrc/attention/cuda/flash/
// cute_traits.cuh, flash_fwd_cute.cuh), compiled with the host compiler and run by
// tests/test_cute_layouts.py: CuTe layouts and tiled copies / MMAs are host code too, so what
// can be wrong with them is caught without a GPU. Per instantiation (bf16 / fp16 x 64 / 128 /
// 256):
//   1. the shared-memory budget fits sm_80 and sm_90;
//   2. the swizzled Q and K/V layouts are bijections onto [0, size), and V^T reads V's bytes;
//   3. the global->shared copies cover every element of the Q and K/V tiles exactly once;
//   4. the MMA's accumulator partition covers the score and output tiles exactly once, and in
//      the kernel's rows x cols view every thread's row is one row, shared by exactly the four
//      lanes of its quad, which between them hold all of the row's columns (the softmax's
//      quad shuffles rely on this);
//   5. the score accumulator read as the P V product's A operand (acc_as_a) holds, element
//      for element, the (row, key) the MMA's A partition expects (P never leaves registers);
//   6. the output staging copy (registers -> shared) covers the output tile exactly once.
// The backward's traits (BwdCuteTraits, flash_bwd_cute.cuh), per instantiation (one and two query
// stages): the budget and the stage size; the
// Q/dO, K/V and P/dS layouts bijective and their transposed views reading the same bytes; the
// global copies covering the Q and K/V tiles once; the three MMAs' accumulators (S and dP,
// dK and dV, dQ) and the P/dS staging copy covering their tiles once.
// The Hopper forward's traits (FwdHopperTraits, flash_fwd_hopper.cuh), per instantiation: the
// budget (sm_90's 227 KB); the GMMA-swizzled Q and K/V rings bijective and V^T reading V's
// bytes in every stage; the two warpgroups' wgmma accumulators covering the score and output
// tiles once, with the quad property of 4 (hopper_fwd::rowcol); the score accumulator read as
// the P V wgmma's register A operand (hopper_fwd::acc_as_a) element for element; the output
// staging copy and one warpgroup's 16-byte global stores covering their tiles once.
// Prints one line per instantiation; exit status 1 on the first failure.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "attention/cuda/flash/cute_traits.cuh"
#include "attention/cuda/flash/hopper_traits.cuh"

namespace {

using namespace cute;

int failures = 0;

#define CHECK(cond, ...)                               \
  do {                                                 \
    if (!(cond)) {                                     \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                        \
      std::printf("\n");                               \
      ++failures;                                      \
      return;                                          \
    }                                                  \
  } while (0)

// Every offset of [0, size) hit once by the layout over its whole domain.
template <class L>
bool bijective(L const& layout) {
  const int n = size(layout);
  if (cosize(layout) != n) return false;
  std::vector<int> hits(n, 0);
  for (int i = 0; i < n; ++i) {
    const int off = layout(i);
    if (off < 0 || off >= n || hits[off]++) return false;
  }
  return true;
}

// Each (row, col) of a rows x cols tile covered exactly once by the per-thread partitions that
// `part(tid)` returns (tensors of coordinates).
template <class Part>
bool covers_once(int threads, int rows, int cols, Part part) {
  std::vector<int> hits(rows * cols, 0);
  for (int tid = 0; tid < threads; ++tid) {
    auto t = part(tid);
    for (int i = 0; i < size(t); ++i) {
      const int r = get<0>(t(i)), c = get<1>(t(i));
      if (r < 0 || r >= rows || c < 0 || c >= cols) return false;
      ++hits[r * cols + c];
    }
  }
  for (int h : hits)
    if (h != 1) return false;
  return true;
}

using attn_ext::cuda::cute_fwd::acc_as_a;
using attn_ext::cuda::cute_fwd::rowcol;

template <typename T, int kHeadDim>
void check(const char* name) {
  using Tr = attn_ext::cuda::FwdCuteTraits<T, kHeadDim>;
  constexpr int M = Tr::kBlockM, N = Tr::kBlockN, D = Tr::kHeadDim, kThreads = Tr::kThreads;
  // 1
  CHECK(Tr::kSmemBytes <= 163 * 1024, "%s: %zu bytes of shared memory", name, Tr::kSmemBytes);
  // 2
  CHECK(bijective(typename Tr::SmemLayoutQ{}), "%s: Q layout not a bijection", name);
  CHECK(bijective(typename Tr::SmemLayoutKV{}), "%s: K/V layout not a bijection", name);
  {
    typename Tr::SmemLayoutKV kv;
    typename Tr::SmemLayoutVt vt;
    for (int n = 0; n < N; ++n)
      for (int d = 0; d < D; ++d)
        CHECK(vt(d, n) == kv(n, d), "%s: V^T(%d, %d) != V(%d, %d)", name, d, n, n, d);
  }
  // 3
  typename Tr::GmemCopyQKV gcopy;
  CHECK(covers_once(kThreads, M, D,
                    [&](int tid) {
                      return gcopy.get_thread_slice(tid).partition_S(
                          make_identity_tensor(Shape<Int<M>, Int<D>>{}));
                    }),
        "%s: Q tile copy", name);
  CHECK(covers_once(kThreads, N, D,
                    [&](int tid) {
                      return gcopy.get_thread_slice(tid).partition_S(
                          make_identity_tensor(Shape<Int<N>, Int<D>>{}));
                    }),
        "%s: K/V tile copy", name);
  // 4
  typename Tr::TiledMma mma;
  CHECK(size(mma) == kThreads, "%s: %d MMA threads", name, int(size(mma)));
  const auto cS = make_identity_tensor(Shape<Int<M>, Int<N>>{});
  const auto cO = make_identity_tensor(Shape<Int<M>, Int<D>>{});
  CHECK(covers_once(kThreads, M, N,
                    [&](int tid) { return mma.get_thread_slice(tid).partition_C(cS); }),
        "%s: score accumulator partition", name);
  CHECK(covers_once(kThreads, M, D,
                    [&](int tid) { return mma.get_thread_slice(tid).partition_C(cO); }),
        "%s: output accumulator partition", name);
  for (int tid = 0; tid < kThreads; ++tid) {
    auto c = mma.get_thread_slice(tid).partition_C(cS);
    auto rc = make_tensor(c.data(), rowcol(c.layout()));
    for (int r = 0; r < size<0>(rc); ++r) {
      const int row = get<0>(rc(r, 0));
      std::vector<int> cols_of_row(N, 0);
      for (int q = 0; q < 4; ++q) {  // the four lanes of tid's quad
        const int other = (tid & ~3) + q;
        auto oc = mma.get_thread_slice(other).partition_C(cS);
        auto orc = make_tensor(oc.data(), rowcol(oc.layout()));
        CHECK(get<0>(orc(r, 0)) == row, "%s: quad of thread %d disagrees on row %d", name, tid, r);
        for (int j = 0; j < size<1>(orc); ++j) {
          CHECK(get<0>(orc(r, j)) == row, "%s: thread %d row %d mixes rows", name, other, r);
          ++cols_of_row[get<1>(orc(r, j))];
        }
      }
      for (int j = 0; j < N; ++j)
        CHECK(cols_of_row[j] == 1, "%s: row %d key %d held %d times by its quad", name, row, j,
              cols_of_row[j]);
    }
  }
  // 5
  for (int tid = 0; tid < kThreads; ++tid) {
    auto thr = mma.get_thread_slice(tid);
    auto c = thr.partition_C(cS);  // (MMA, MMA_M, MMA_N)
    auto as_a = make_tensor(c.data(), acc_as_a(c.layout()));
    auto a = thr.partition_A(cS);  // P's (row, key) as the A operand
    CHECK(size(as_a) == size(a), "%s: %d vs %d A values", name, int(size(as_a)), int(size(a)));
    for (int i = 0; i < size(a); ++i)
      CHECK(get<0>(as_a(i)) == get<0>(a(i)) && get<1>(as_a(i)) == get<1>(a(i)),
            "%s: thread %d value %d of P is (%d, %d), the MMA reads (%d, %d)", name, tid, i,
            int(get<0>(as_a(i))), int(get<1>(as_a(i))), int(get<0>(a(i))), int(get<1>(a(i))));
  }
  // 6
  auto ocopy = make_tiled_copy_C(typename Tr::SmemCopyAtomO{}, mma);
  CHECK(covers_once(kThreads, M, D,
                    [&](int tid) { return ocopy.get_thread_slice(tid).partition_D(cO); }),
        "%s: output staging copy", name);
  std::printf("ok   %s: %d x %d tiles, %d threads, %zu bytes of shared memory\n", name, M, N,
              kThreads, Tr::kSmemBytes);
}

template <class Mma, class Shape2>
bool mma_covers(Mma const& mma, int threads, int rows, int cols, Shape2 shape) {
  return covers_once(threads, rows, cols, [&](int tid) {
    return mma.get_thread_slice(tid).partition_C(make_identity_tensor(shape));
  });
}

template <typename T, int kHeadDim, int kQStages>
void check_bwd(const char* name) {
  using Tr = attn_ext::cuda::BwdCuteTraits<T, kHeadDim, kQStages>;
  constexpr int M = Tr::kBlockM, N = Tr::kBlockN, D = Tr::kHeadDim, kThreads = Tr::kThreads;
  CHECK(Tr::kSmemBytes <= 163 * 1024, "%s: %zu bytes of shared memory", name, Tr::kSmemBytes);
  // A second query stage starts a whole Q tile further on: 128-byte aligned, so its cp.async /
  // ldmatrix addresses stay 16-byte aligned and its banks fall as stage 0's.
  CHECK(Tr::kSmemQ % 128 == 0, "%s: a Q stage of %zu bytes", name, Tr::kSmemQ);
  CHECK(bijective(typename Tr::SmemLayoutQ{}), "%s: Q layout", name);
  CHECK(bijective(typename Tr::SmemLayoutKV{}), "%s: K/V layout", name);
  CHECK(bijective(typename Tr::SmemLayoutPdS{}), "%s: P/dS layout", name);
  {
    typename Tr::SmemLayoutQ q;
    typename Tr::SmemLayoutQt qt;
    typename Tr::SmemLayoutKV k;
    typename Tr::SmemLayoutKt kt;
    typename Tr::SmemLayoutPdS pds;
    typename Tr::SmemLayoutPdSt pdst;
    for (int m = 0; m < M; ++m)
      for (int d = 0; d < D; ++d) CHECK(qt(d, m) == q(m, d), "%s: Q^T(%d, %d)", name, d, m);
    for (int n = 0; n < N; ++n)
      for (int d = 0; d < D; ++d) CHECK(kt(d, n) == k(n, d), "%s: K^T(%d, %d)", name, d, n);
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) CHECK(pdst(n, m) == pds(m, n), "%s: P^T(%d, %d)", name, n, m);
  }
  typename Tr::GmemCopy gcopy;
  CHECK(covers_once(kThreads, M, D,
                    [&](int tid) {
                      return gcopy.get_thread_slice(tid).partition_S(
                          make_identity_tensor(Shape<Int<M>, Int<D>>{}));
                    }),
        "%s: Q/dO tile copy", name);
  CHECK(covers_once(kThreads, N, D,
                    [&](int tid) {
                      return gcopy.get_thread_slice(tid).partition_S(
                          make_identity_tensor(Shape<Int<N>, Int<D>>{}));
                    }),
        "%s: K/V tile copy", name);
  typename Tr::TiledMmaSdP sdp;
  typename Tr::TiledMmaKV kv;
  typename Tr::TiledMmaQ dq;
  CHECK(size(sdp) == kThreads && size(kv) == kThreads && size(dq) == kThreads,
        "%s: MMA thread counts", name);
  CHECK(mma_covers(sdp, kThreads, M, N, Shape<Int<M>, Int<N>>{}), "%s: S / dP partition", name);
  CHECK(mma_covers(kv, kThreads, N, D, Shape<Int<N>, Int<D>>{}), "%s: dK / dV partition", name);
  CHECK(mma_covers(dq, kThreads, M, D, Shape<Int<M>, Int<D>>{}), "%s: dQ partition", name);
  auto pcopy = make_tiled_copy_C(typename Tr::SmemCopyAtomPdS{}, sdp);
  CHECK(covers_once(kThreads, M, N,
                    [&](int tid) {
                      return pcopy.get_thread_slice(tid).partition_D(
                          make_identity_tensor(Shape<Int<M>, Int<N>>{}));
                    }),
        "%s: P / dS staging copy", name);
  std::printf("ok   %s backward: %d x %d tiles, %d threads, %zu bytes of shared memory\n", name, M,
              N, kThreads, Tr::kSmemBytes);
}

template <typename T, int kHeadDim>
void check_hopper(const char* name) {
  namespace hf = attn_ext::cuda::hopper_fwd;
  using Tr = attn_ext::cuda::FwdHopperTraits<T, kHeadDim>;
  constexpr int M = Tr::kBlockM, N = Tr::kBlockN, D = Tr::kHeadDim;
  constexpr int kThreads = Tr::kConsumerThreads;
  CHECK(Tr::kSmemBytes <= 227 * 1024, "%s: %zu bytes of shared memory", name, Tr::kSmemBytes);
  CHECK(bijective(typename Tr::SmemLayoutQ{}), "%s: Q layout not a bijection", name);
  CHECK(bijective(typename Tr::SmemLayoutKV{}), "%s: K/V ring not a bijection", name);
  {
    typename Tr::SmemLayoutKV kv;
    typename Tr::SmemLayoutVt vt;
    for (int s = 0; s < Tr::kStages; ++s)
      for (int n = 0; n < N; ++n)
        for (int d = 0; d < D; ++d)
          CHECK(vt(d, n, s) == kv(n, d, s), "%s: V^T(%d, %d, %d) != V", name, d, n, s);
  }
  typename Tr::TiledMmaS mma_s;
  typename Tr::TiledMmaO mma_o;
  CHECK(size(mma_s) == kThreads && size(mma_o) == kThreads, "%s: MMA threads", name);
  const auto cS = make_identity_tensor(Shape<Int<M>, Int<N>>{});
  const auto cO = make_identity_tensor(Shape<Int<M>, Int<D>>{});
  CHECK(covers_once(kThreads, M, N,
                    [&](int tid) { return mma_s.get_thread_slice(tid).partition_C(cS); }),
        "%s: score accumulator partition", name);
  CHECK(covers_once(kThreads, M, D,
                    [&](int tid) { return mma_o.get_thread_slice(tid).partition_C(cO); }),
        "%s: output accumulator partition", name);
  for (int tid = 0; tid < kThreads; ++tid) {
    auto c = mma_s.get_thread_slice(tid).partition_C(cS);
    auto rc = make_tensor(c.data(), hf::rowcol(c.layout()));
    for (int r = 0; r < size<0>(rc); ++r) {
      const int row = get<0>(rc(r, 0));
      CHECK(row / 64 == tid / 128, "%s: thread %d holds row %d of the other warpgroup", name, tid,
            row);
      std::vector<int> cols_of_row(N, 0);
      for (int q = 0; q < 4; ++q) {  // the four lanes of tid's quad
        const int other = (tid & ~3) + q;
        auto oc = mma_s.get_thread_slice(other).partition_C(cS);
        auto orc = make_tensor(oc.data(), hf::rowcol(oc.layout()));
        for (int j = 0; j < size<1>(orc); ++j) {
          CHECK(get<0>(orc(r, j)) == row, "%s: thread %d row %d mixes rows", name, other, r);
          ++cols_of_row[get<1>(orc(r, j))];
        }
      }
      for (int j = 0; j < N; ++j)
        CHECK(cols_of_row[j] == 1, "%s: row %d key %d held %d times by its quad", name, row, j,
              cols_of_row[j]);
    }
    auto oc = mma_o.get_thread_slice(tid).partition_C(cO);
    auto orc = make_tensor(oc.data(), hf::rowcol(oc.layout()));
    for (int r = 0; r < size<0>(orc); ++r)
      CHECK(get<0>(orc(r, 0)) == get<0>(rc(r, 0)), "%s: thread %d: O row %d is not S row %d", name,
            tid, r, r);
    auto as_a = make_tensor(c.data(), hf::acc_as_a(c.layout()));
    auto a = mma_o.get_thread_slice(tid).partition_A(cS);  // P's (row, key) as wgmma's A
    CHECK(size(as_a) == size(a), "%s: %d vs %d A values", name, int(size(as_a)), int(size(a)));
    for (int i = 0; i < size(a); ++i)
      CHECK(get<0>(as_a(i)) == get<0>(a(i)) && get<1>(as_a(i)) == get<1>(a(i)),
            "%s: thread %d value %d of P is (%d, %d), the wgmma reads (%d, %d)", name, tid, i,
            int(get<0>(as_a(i))), int(get<1>(as_a(i))), int(get<0>(a(i))), int(get<1>(a(i))));
  }
  auto ocopy = make_tiled_copy_C(typename Tr::SmemCopyAtomO{}, mma_o);
  CHECK(covers_once(kThreads, M, D,
                    [&](int tid) { return ocopy.get_thread_slice(tid).partition_D(cO); }),
        "%s: output staging copy", name);
  typename Tr::GmemCopyO gcopy;
  CHECK(covers_once(128, Tr::kRowsPerWarpgroup, D,
                    [&](int tid) {
                      return gcopy.get_thread_slice(tid).partition_D(
                          make_identity_tensor(Shape<Int<Tr::kRowsPerWarpgroup>, Int<D>>{}));
                    }),
        "%s: a warpgroup's output stores", name);
  std::printf("ok   %s hopper: %d x %d tiles, %d consumer threads, %zu bytes of shared memory\n",
              name, M, N, kThreads, Tr::kSmemBytes);
}

}  // namespace

int main() {
  check<__nv_bfloat16, 64>("bf16 d64");
  check<__nv_bfloat16, 128>("bf16 d128");
  check<__nv_bfloat16, 256>("bf16 d256");
  check<__half, 64>("f16 d64");
  check<__half, 128>("f16 d128");
  check<__half, 256>("f16 d256");
  check_bwd<__nv_bfloat16, 64, 1>("bf16 d64");
  check_bwd<__nv_bfloat16, 128, 1>("bf16 d128");
  check_bwd<__half, 128, 1>("f16 d128");
  check_bwd<__nv_bfloat16, 64, 2>("bf16 d64, two query stages");
  check_bwd<__nv_bfloat16, 128, 2>("bf16 d128, two query stages");
  check_hopper<__nv_bfloat16, 64>("bf16 d64");
  check_hopper<__nv_bfloat16, 128>("bf16 d128");
  check_hopper<__nv_bfloat16, 256>("bf16 d256");
  check_hopper<__half, 128>("f16 d128");
  std::printf("%s\n", failures ? "CUTE LAYOUT CHECK FAIL" : "CUTE LAYOUT CHECK PASS");
  return failures ? 1 : 0;
}
