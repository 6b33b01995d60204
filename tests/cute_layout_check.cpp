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
// The tensor-core decode's traits (DecodeMmaTraits, decoding/cuda/decode_mma.cu), per
// instantiation (D = Dv 64 / 128 / 256, and MLA's 576-wide keys holding 512 value columns): the
// budget; the Q, K/V and P layouts bijective, V^T reading V's (or K's first Dv columns') bytes
// in every stage; the global copies covering the Q and K/V tiles once with each thread's
// 16-byte vector contiguous in shared memory; gather_rows, run on the host with plain copies,
// landing every gathered row (and zeros past the rows) where the tile's layout says; the one-
// warp MMA covering a warp's score and output tiles once; the warps' key and value-column
// slices reading the tile elements they name.
// Prints one line per instantiation; exit status 1 on the first failure.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "attention/cuda/flash/cute_traits.cuh"
#include "attention/cuda/flash/hopper_traits.cuh"
#include "decoding/cuda/decode_mma_traits.cuh"

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

// gather_rows' copy on the host: a plain 16-byte assignment where the device issues cp.async.
struct HostVecCopy {
  static void copy(cute::uint128_t const& src, cute::uint128_t& dst) { dst = src; }
};

// Each thread's 16-byte vectors of the copy partition `dst_offsets(tid)` (offsets in shared
// memory, (CPY, CPY_M, CPY_K)) are kVec consecutive elements.
template <int kVec, class Part>
bool vectors_contiguous(int threads, Part part) {
  for (int tid = 0; tid < threads; ++tid) {
    auto t = part(tid);
    if (size<0>(t) != kVec) return false;
    for (int m = 0; m < size<1>(t); ++m)
      for (int k = 0; k < size<2>(t); ++k)
        for (int e = 0; e < kVec; ++e)
          if (t(e, m, k) != t(0, m, k) + e) return false;
  }
  return true;
}

template <typename T, int kD, int kDv, bool kVInK, int kBlockM>
void check_decode_mma(const char* name) {
  using Tr = attn_ext::cuda::DecodeMmaTraits<T, kD, kDv, kVInK, kBlockM>;
  using Elem = typename Tr::Elem;
  constexpr int M = Tr::kBlockM, N = Tr::kBlockN, S = Tr::kStages, kThreads = Tr::kThreads;
  constexpr int kCols = Tr::kColsPerWarp;
  CHECK(Tr::kSmemBytes <= 163 * 1024, "%s: %zu bytes of shared memory", name, Tr::kSmemBytes);
  CHECK(bijective(typename Tr::SmemLayoutQ{}), "%s: Q layout", name);
  CHECK(bijective(typename Tr::SmemLayoutK{}), "%s: K stages", name);
  CHECK(bijective(typename Tr::SmemLayoutV{}), "%s: V stages", name);
  CHECK(bijective(typename Tr::SmemLayoutP{}), "%s: P layout", name);
  {
    typename Tr::SmemLayoutVSource src;
    typename Tr::SmemLayoutVt vt;
    for (int s = 0; s < S; ++s)
      for (int n = 0; n < N; ++n)
        for (int d = 0; d < kDv; ++d)
          CHECK(vt(d, n, s) == src(n, d, s), "%s: V^T(%d, %d, %d) != V(%d, %d, %d)", name, d, n, s,
                n, d, s);
  }
  typename Tr::GmemCopy gcopy;
  CHECK(covers_once(kThreads, M, kD,
                    [&](int tid) {
                      return gcopy.get_thread_slice(tid).partition_D(
                          make_identity_tensor(Shape<Int<M>, Int<kD>>{}));
                    }),
        "%s: Q tile copy", name);
  CHECK(covers_once(kThreads, N, kD,
                    [&](int tid) {
                      return gcopy.get_thread_slice(tid).partition_D(
                          make_identity_tensor(Shape<Int<N>, Int<kD>>{}));
                    }),
        "%s: K tile copy", name);
  // offsets through a tensor over a counting "pointer" (an integer iterator)
  const auto offsets = [](auto layout) { return make_tensor(counting_iterator<int>{0}, layout); };
  CHECK(vectors_contiguous<Tr::kVec>(kThreads,
                                     [&](int tid) {
                                       return gcopy.get_thread_slice(tid).partition_D(
                                           offsets(typename Tr::SmemLayoutQ{}));
                                     }),
        "%s: Q vectors not contiguous", name);
  for (int s = 0; s < S; ++s) {
    CHECK(vectors_contiguous<Tr::kVec>(kThreads,
                                       [&](int tid) {
                                         return gcopy.get_thread_slice(tid).partition_D(
                                             offsets(typename Tr::SmemLayoutK{})(_, _, s));
                                       }),
          "%s: K stage %d vectors not contiguous", name, s);
    CHECK(vectors_contiguous<Tr::kVec>(kThreads,
                                       [&](int tid) {
                                         return gcopy.get_thread_slice(tid).partition_D(
                                             offsets(typename Tr::SmemLayoutV{})(_, _, s));
                                       }),
          "%s: V stage %d vectors not contiguous", name, s);
  }
  // gather_rows into stage 1 of K: row r from source row (r * 7 + 3) % N of a host array,
  // `rows` rows, zeros past them
  {
    constexpr int kRows = N - 5;
    std::vector<Elem> src(size_t(N) * kD), smem(cosize(typename Tr::SmemLayoutK{}), Elem(-1.f));
    for (size_t i = 0; i < src.size(); ++i) src[i] = Elem(float(i % 251) + 1.f);
    Tensor sK = make_tensor(smem.data(), typename Tr::SmemLayoutK{});
    const auto source_row = [](int r) { return (r * 7 + 3) % N; };
    for (int tid = 0; tid < kThreads; ++tid) {
      auto thr = gcopy.get_thread_slice(tid);
      attn_ext::cuda::decode_mma::gather_rows<HostVecCopy>(
          thr.partition_D(sK(_, _, 1)),
          thr.partition_D(make_identity_tensor(Shape<Int<N>, Int<kD>>{})), kRows,
          [&](int r) { return src.data() + size_t(source_row(r)) * kD; });
    }
    for (int n = 0; n < N; ++n)
      for (int d = 0; d < kD; ++d) {
        const float want = n < kRows ? float(src[size_t(source_row(n)) * kD + d]) : 0.f;
        CHECK(float(sK(n, d, 1)) == want, "%s: gathered K(%d, %d) = %g, want %g", name, n, d,
              float(sK(n, d, 1)), want);
        CHECK(float(sK(n, d, 0)) == -1.f, "%s: gather wrote stage 0", name);
      }
  }
  // one warp's MMA over its score and output tiles
  typename Tr::TiledMma mma;
  CHECK(size(mma) == 32, "%s: %d MMA threads", name, int(size(mma)));
  CHECK(mma_covers(mma, 32, M, 16, Shape<Int<M>, _16>{}), "%s: a warp's score tile", name);
  CHECK(mma_covers(mma, 32, M, kCols, Shape<Int<M>, Int<kCols>>{}), "%s: a warp's output tile",
        name);
  // the warps' slices: keys [16 w, 16 w + 16) of a K stage, value columns [w kCols, ...) of V^T
  {
    auto k_off = offsets(typename Tr::SmemLayoutK{});
    auto vt_off = offsets(typename Tr::SmemLayoutVt{});
    for (int s = 0; s < S; ++s)
      for (int w = 0; w < Tr::kWarps; ++w) {
        if (w < Tr::kScoreWarps) {
          auto kw = local_tile(k_off(_, _, s), Shape<_16, Int<kD>>{}, make_coord(w, 0));
          for (int n = 0; n < 16; ++n)
            for (int d = 0; d < kD; ++d)
              CHECK(kw(n, d) == k_off(16 * w + n, d, s), "%s: warp %d's key slice", name, w);
        }
        auto vw = local_tile(vt_off(_, _, s), Shape<Int<kCols>, Int<N>>{}, make_coord(w, 0));
        for (int d = 0; d < kCols; ++d)
          for (int n = 0; n < N; ++n)
            CHECK(vw(d, n) == vt_off(w * kCols + d, n, s), "%s: warp %d's value slice", name, w);
      }
  }
  std::printf("ok   %s decode mma: %d rows x %d keys, %d stages, %zu bytes of shared memory\n",
              name, M, N, S, Tr::kSmemBytes);
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
  check_decode_mma<__nv_bfloat16, 64, 64, false, 16>("bf16 d64, 16 rows");
  check_decode_mma<__nv_bfloat16, 64, 64, false, 64>("bf16 d64, 64 rows");
  check_decode_mma<__nv_bfloat16, 128, 128, false, 16>("bf16 d128, 16 rows");
  check_decode_mma<__nv_bfloat16, 128, 128, false, 64>("bf16 d128, 64 rows");
  check_decode_mma<__nv_bfloat16, 256, 256, false, 16>("bf16 d256, 16 rows");
  check_decode_mma<__nv_bfloat16, 256, 256, false, 32>("bf16 d256, 32 rows");
  check_decode_mma<__half, 128, 128, false, 16>("f16 d128, 16 rows");
  check_decode_mma<__half, 128, 128, false, 64>("f16 d128, 64 rows");
  check_decode_mma<__nv_bfloat16, 576, 512, true, 16>("bf16 MLA 576/512");
  check_decode_mma<__half, 576, 512, true, 16>("f16 MLA 576/512");
  std::printf("%s\n", failures ? "CUTE LAYOUT CHECK FAIL" : "CUTE LAYOUT CHECK PASS");
  return failures ? 1 : 0;
}
