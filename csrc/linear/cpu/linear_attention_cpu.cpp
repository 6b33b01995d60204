// CPU linear attention, forward and backward, parallel over (batch * head, chunk).
//
// The value rows get an extra column of ones (v' = [v, 1], width Dp = Dv + 1), so the state
// (S, z) = sum phi(k) v'^T is one D x Dp matrix and the denominator phi(q) . z is the last
// column of phi(q) S'. Both passes work in three phases:
//   1. each key chunk's contribution phi(K_c)^T V'_c, all chunks in parallel;
//   2. per (batch, head), a scan over the chunks: causal turns them into the state each
//      chunk starts from (exclusive prefix), non-causal into one total; either adds the
//      initial state and yields the final state;
//   3. each query chunk's outputs from its state, plus, when causal, the masked
//      C x C quadratic term of the chunk itself.
// No S x S buffer and no per-position state is ever formed: the backward recomputes the
// chunk states, then runs the same three phases in reverse for dK and dV (the gradient of
// the state is scanned from the last chunk back). Chunk boundaries depend only on the
// shapes, and every reduction runs in a fixed order, so results are deterministic.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/tensors.h"
#include "common/cpu/blas.h"
#include "common/cpu/cpu_support.h"
#include "common/cpu/kernel_traits.h"
#include "common/cpu/vec_math.h"
#include "linear/feature_map.h"
#include "linear/linear_inputs.h"

namespace attn_ext::linear {
namespace {

using cpu::Buffer;
using cpu::gemm;
using cpu::load_row;
using cpu::store_row;

// ---------------------------------------------------------------------------- feature rows

// x[j] = phi(x[j]); the scalar loop defines the semantics (feature_map.h).
template <typename acc_t>
void apply_feature(acc_t* x, int64_t n, FeatureMap f) {
  for (int64_t j = 0; j < n; ++j) x[j] = feature(f, x[j]);
}

#ifdef ATTN_EXT_AVX2
// e^x for x <= 0 in float: n = round(x / ln2), r = x - n ln2 in two parts (Cody-Waite, so r
// is exact to ~1 ulp), e^r by its degree-7 Taylor polynomial on |r| <= ln2 / 2 (truncation
// < 5e-9 relative), 2^n added to the exponent bits. Below ln(2^-126) the result would be
// subnormal; it is flushed to 0 (phi is a sum term of size >= 1 ulp of 1 elsewhere, so the
// difference is invisible). NaN propagates.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 kFloor = _mm256_set1_ps(-87.33654f);  // ln(2^-126)
  const __m256 kLog2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 kLn2Hi = _mm256_set1_ps(0.693359375f);
  const __m256 kLn2Lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 underflow = _mm256_cmp_ps(x, kFloor, _CMP_LT_OQ);
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 xc = _mm256_max_ps(x, kFloor);
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(xc, kLog2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, kLn2Hi, xc);
  r = _mm256_fnmadd_ps(n, kLn2Lo, r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  y = _mm256_andnot_ps(underflow, y);
  return _mm256_blendv_ps(y, x, is_nan);
}

template <>
void apply_feature<float>(float* x, int64_t n, FeatureMap f) {
  constexpr int64_t kWidth = cpu::avx2::kWidth;
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
  int64_t j = 0;
  if (f == FeatureMap::kEluPlusOne) {
    for (; j + kWidth <= n; j += kWidth) {
      const __m256 xv = _mm256_loadu_ps(x + j);
      const __m256 pos = _mm256_cmp_ps(xv, zero, _CMP_GT_OQ);
      // min(0, x) returns x when x is NaN, so NaN reaches exp_nonpositive and propagates.
      const __m256 e = exp_nonpositive(_mm256_min_ps(zero, xv));
      _mm256_storeu_ps(x + j, _mm256_blendv_ps(e, _mm256_add_ps(xv, one), pos));
    }
  } else if (f == FeatureMap::kRelu) {
    // max(x, 0) returns 0 for NaN, as the scalar x > 0 ? x : 0 does.
    for (; j + kWidth <= n; j += kWidth)
      _mm256_storeu_ps(x + j, _mm256_max_ps(_mm256_loadu_ps(x + j), zero));
  }
  for (; j < n; ++j) x[j] = feature(f, x[j]);
}
#endif

// dst (rows x cols, leading dimension ld) = acc_t(rows r0.. of t at (b, h)).
template <typename scalar_t, typename acc_t>
void load_rows(const Rows& t, int64_t b, int64_t h, int64_t r0, int64_t rows, int64_t cols,
               acc_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    load_row(t.row<scalar_t>(b, h, r0 + r), dst + r * ld, cols, acc_t(1));
}

// phi of rows r0.. of t, (rows x cols) contiguous.
template <typename scalar_t, typename acc_t>
void load_features(const Rows& t, int64_t b, int64_t h, int64_t r0, int64_t rows, int64_t cols,
                   FeatureMap f, acc_t* dst) {
  load_rows<scalar_t>(t, b, h, r0, rows, cols, dst, cols);
  apply_feature(dst, rows * cols, f);
}

// v' rows: (rows x (Dv + 1)) contiguous, the last column 1.
template <typename scalar_t, typename acc_t>
void load_values(const Rows& v, int64_t b, int64_t h, int64_t r0, int64_t rows, int64_t dv,
                 acc_t* dst) {
  load_rows<scalar_t>(v, b, h, r0, rows, dv, dst, dv + 1);
  for (int64_t r = 0; r < rows; ++r) dst[r * (dv + 1) + dv] = acc_t(1);
}

// Zeroes the entries above the diagonal of an m x m tile (key j > query i: not yet seen).
template <typename acc_t>
void mask_future(acc_t* a, int64_t m, int64_t ld) {
  for (int64_t r = 0; r < m; ++r) std::fill(a + r * ld + r + 1, a + r * ld + m, acc_t(0));
}

// g[j] *= phi'(x_j), phi' taken from the feature values phi (feature_map.h).
template <typename acc_t>
void scale_by_feature_grad(acc_t* g, const acc_t* phi, int64_t n, FeatureMap f) {
  if (f == FeatureMap::kIdentity) return;
  for (int64_t j = 0; j < n; ++j) g[j] *= feature_grad_from_value(f, phi[j]);
}

// ---------------------------------------------------------------------------- chunking

// Waking the worker threads costs about as much as this many multiply-adds; smaller tasks
// (a decode step, a short sequence, the scans of a few chunks) are grouped until a thread's
// share is at least this large, so tiny calls run inline.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 17;

// at::parallel_for grain for tasks of `work` multiply-adds each.
inline int64_t grain_for(int64_t work) {
  return std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(work, 1));
}

struct Chunking {
  int64_t size;   // rows per chunk
  int64_t num_q;  // query chunks
  int64_t num_k;  // key chunks (== num_q when causal)
  int64_t state;  // elements of one D x Dp state
  int64_t dp;     // Dv + 1
  // Grains (tasks per thread at least) of the chunk phases and of the per-(batch, head) scans,
  // from the multiply-adds of one task (a full chunk, or the whole sequence if shorter).
  int64_t chunk_grain;
  int64_t scan_grain;

  explicit Chunking(const LinearAttentionParams& p)
      : size(p.causal ? kCausalChunk : kNonCausalBlock),
        num_q((p.seqlen_q + size - 1) / size),
        num_k((p.seqlen_k + size - 1) / size),
        state(p.head_dim * (p.head_dim_v + 1)),
        dp(p.head_dim_v + 1) {
    const int64_t rows = std::min(size, std::max(p.seqlen_q, p.seqlen_k));
    const int64_t intra = p.causal ? rows * rows * (p.head_dim + dp) : 0;
    chunk_grain = grain_for(rows * state + intra);
    scan_grain = grain_for(std::max(num_q, num_k) * state);
  }
};

// A D x Dp scratch or state array of `count` states in acc_t, uninitialized.
at::Tensor state_buffer(int64_t count, const Chunking& ch, at::ScalarType acc) {
  return at::empty({count * ch.state}, at::TensorOptions().dtype(acc));
}

// Packs (kv (D, Dv), k (D)) into one D x Dp state, or zeroes it when kv is null.
template <typename acc_t>
void pack_state(const acc_t* kv, const acc_t* k, int64_t d, int64_t dv, acc_t* dst) {
  const int64_t dp = dv + 1;
  for (int64_t r = 0; r < d; ++r) {
    if (kv == nullptr) {
      std::fill(dst + r * dp, dst + (r + 1) * dp, acc_t(0));
    } else {
      std::copy(kv + r * dv, kv + (r + 1) * dv, dst + r * dp);
      dst[r * dp + dv] = k[r];
    }
  }
}

// Splits D x Dp states (one per batch * head) into kv (B, H, D, Dv) and k (B, H, D).
template <typename acc_t>
void unpack_states(const acc_t* src, int64_t count, int64_t d, int64_t dv, acc_t* kv, acc_t* k) {
  const int64_t dp = dv + 1;
  for (int64_t s = 0; s < count * d; ++s) {
    std::copy(src + s * dp, src + s * dp + dv, kv + s * dv);
    k[s] = src[s * dp + dv];
  }
}

// Phases 1 and 2 (shared by forward and backward). On return, for every (batch, head) bh:
//   final_state[bh] = initial + sum over all keys of phi(k) v'^T;
//   causal: chunk_states[bh * num_k + c] = initial + sum over the keys before chunk c
//   (non-causal: chunk_states is scratch; every query reads final_state).
template <typename scalar_t, typename acc_t>
void accumulate_states(const LinearAttentionParams& p, const Chunking& ch, acc_t* chunk_states,
                       acc_t* final_state) {
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Dp = ch.dp, C = ch.size;
  const int64_t BH = p.batch * p.heads;
  at::parallel_for(0, BH * ch.num_k, ch.chunk_grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> phik(C * D), vp(C * Dp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / ch.num_k, c = task % ch.num_k;
      const int64_t b = bh / p.heads, h = bh % p.heads, j0 = c * C;
      const int64_t n = std::min(C, p.seqlen_k - j0);
      load_features<scalar_t>(p.k, b, h, j0, n, D, p.feature_map, phik.get());
      load_values<scalar_t>(p.v, b, h, j0, n, Dv, vp.get());
      gemm(true, false, D, Dp, n, acc_t(1), phik.get(), D, vp.get(), Dp, acc_t(0),
           chunk_states + task * ch.state, Dp);
    }
  });
  const auto* init_kv = static_cast<const acc_t*>(p.initial_kv);
  const auto* init_k = static_cast<const acc_t*>(p.initial_k);
  at::parallel_for(0, BH, ch.scan_grain, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      acc_t* running = final_state + bh * ch.state;
      pack_state(init_kv ? init_kv + bh * D * Dv : nullptr, init_k ? init_k + bh * D : nullptr, D,
                 Dv, running);
      for (int64_t c = 0; c < ch.num_k; ++c) {
        acc_t* s = chunk_states + (bh * ch.num_k + c) * ch.state;
        for (int64_t e = 0; e < ch.state; ++e) {
          const acc_t delta = s[e];
          if (p.causal) s[e] = running[e];
          running[e] += delta;
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------- forward

template <typename scalar_t>
void linear_fwd(const LinearAttentionParams& p, scalar_t* out, at::Tensor& final_kv,
                at::Tensor& final_k) {
  using acc_t = at::opmath_type<scalar_t>;
  const Chunking ch(p);
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Dp = ch.dp, C = ch.size;
  const int64_t BH = p.batch * p.heads;
  const at::ScalarType acc = c10::CppTypeToScalarType<acc_t>::value;
  at::Tensor chunk_buf = state_buffer(BH * ch.num_k, ch, acc);
  at::Tensor final_buf = state_buffer(BH, ch, acc);
  acc_t* chunk_states = chunk_buf.data_ptr<acc_t>();
  acc_t* final_state = final_buf.data_ptr<acc_t>();
  accumulate_states<scalar_t>(p, ch, chunk_states, final_state);

  const acc_t eps = static_cast<acc_t>(p.eps);
  at::parallel_for(0, BH * ch.num_q, ch.chunk_grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> phiq(C * D), num(C * Dp);
    Buffer<acc_t> phik(p.causal ? C * D : 0), vp(p.causal ? C * Dp : 0), a(p.causal ? C * C : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / ch.num_q, c = task % ch.num_q;
      const int64_t b = bh / p.heads, h = bh % p.heads, i0 = c * C;
      const int64_t m = std::min(C, p.seqlen_q - i0);
      const acc_t* state = p.causal ? chunk_states + task * ch.state : final_state + bh * ch.state;
      load_features<scalar_t>(p.q, b, h, i0, m, D, p.feature_map, phiq.get());
      gemm(false, false, m, Dp, D, acc_t(1), phiq.get(), D, state, Dp, acc_t(0), num.get(), Dp);
      if (p.causal) {
        // The chunk's own keys: position i sees j <= i.
        load_features<scalar_t>(p.k, b, h, i0, m, D, p.feature_map, phik.get());
        load_values<scalar_t>(p.v, b, h, i0, m, Dv, vp.get());
        gemm(false, true, m, m, D, acc_t(1), phiq.get(), D, phik.get(), D, acc_t(0), a.get(), C);
        mask_future(a.get(), m, C);
        gemm(false, false, m, Dp, m, acc_t(1), a.get(), C, vp.get(), Dp, acc_t(1), num.get(), Dp);
      }
      scalar_t* o = out + (bh * p.seqlen_q + i0) * Dv;
      for (int64_t r = 0; r < m; ++r) {
        const acc_t* nr = num.get() + r * Dp;
        store_row(nr, o + r * Dv, Dv, normalizer_inv(nr[Dv], eps));
      }
    }
  });
  unpack_states(final_state, BH, D, Dv, final_kv.data_ptr<acc_t>(), final_k.data_ptr<acc_t>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_state_kv,
    const std::optional<at::Tensor>& initial_state_k, bool causal, double eps,
    c10::string_view feature_map) {
  constexpr const char* kOp = "attn_ext.linear_attention";
  cpu::check_cpu_support(kOp);
  LinearInputs in = prepare_linear_attention(kOp, q, k, v, initial_state_kv, initial_state_k,
                                             causal, eps, feature_map);
  const LinearAttentionParams& p = in.params;
  const auto acc = q.options().dtype(at::toOpMathType(q.scalar_type()));
  at::Tensor out =
      advise_huge_pages(at::empty({p.batch, p.heads, p.seqlen_q, p.head_dim_v}, q.options()));
  at::Tensor state_kv = at::empty({p.batch, p.heads, p.head_dim, p.head_dim_v}, acc);
  at::Tensor state_k = at::empty({p.batch, p.heads, p.head_dim}, acc);
  if (p.batch * p.heads == 0) return {out, state_kv, state_k};
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp, [&] {
    linear_fwd<scalar_t>(p, out.data_ptr<scalar_t>(), state_kv, state_k);
  });
  return {out, state_kv, state_k};
}

// ---------------------------------------------------------------------------- backward
//
// With n' = phi(q) S'_i (numerator and denominator) and out = n / (den + eps):
//   dn' = [g / (den + eps), -(g . n) / (den + eps)^2]           (per query row)
//   dphi(q_i) = S'_i dn'_i                                       (state seen by row i)
//   G_j = grad of the final state + sum over rows i that see key j of phi(q_i) dn'_i^T
//   dphi(k_j) = G_j v'_j,  dv_j = G_j[:, :Dv]^T phi(k_j)
// and the gradient of the initial state is G over every row. Causal chunks split each sum
// into the part of the chunk itself (masked C x C tiles) and the part carried by the states.

template <typename scalar_t>
void linear_bwd(const LinearAttentionParams& p, const Rows& dout, const at::Tensor& grad_final_kv,
                const at::Tensor& grad_final_k, scalar_t* dq, scalar_t* dk, scalar_t* dv,
                at::Tensor& grad_init_kv, at::Tensor& grad_init_k) {
  using acc_t = at::opmath_type<scalar_t>;
  const Chunking ch(p);
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Dp = ch.dp, C = ch.size;
  const int64_t BH = p.batch * p.heads;
  const at::ScalarType acc = c10::CppTypeToScalarType<acc_t>::value;
  const acc_t eps = static_cast<acc_t>(p.eps);
  at::Tensor chunk_buf = state_buffer(BH * ch.num_k, ch, acc);
  at::Tensor final_buf = state_buffer(BH, ch, acc);
  acc_t* chunk_states = chunk_buf.data_ptr<acc_t>();
  acc_t* final_state = final_buf.data_ptr<acc_t>();
  accumulate_states<scalar_t>(p, ch, chunk_states, final_state);

  // Each query chunk's phi(Q_c)^T dN'_c, then (scanned) the state gradient each key chunk uses.
  at::Tensor grad_chunk_buf = state_buffer(BH * ch.num_q, ch, acc);
  at::Tensor grad_total_buf = state_buffer(BH, ch, acc);
  acc_t* grad_chunks = grad_chunk_buf.data_ptr<acc_t>();
  acc_t* grad_total = grad_total_buf.data_ptr<acc_t>();
  // Causal chunks need dn' of their own rows again for dK/dV (O(S * Dv), not a state).
  at::Tensor dnum_buf =
      at::empty({p.causal ? BH * p.seqlen_q * Dp : 0}, at::TensorOptions().dtype(acc));
  acc_t* dnum_all = dnum_buf.data_ptr<acc_t>();

  // ---- phase 3: dn', dq and each query chunk's state-gradient contribution
  at::parallel_for(0, BH * ch.num_q, ch.chunk_grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> phiq(C * D), num(C * Dp), dphi(C * D), dnum_local(p.causal ? 0 : C * Dp);
    Buffer<acc_t> phik(p.causal ? C * D : 0), vp(p.causal ? C * Dp : 0), a(p.causal ? C * C : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / ch.num_q, c = task % ch.num_q;
      const int64_t b = bh / p.heads, h = bh % p.heads, i0 = c * C;
      const int64_t m = std::min(C, p.seqlen_q - i0);
      const acc_t* state = p.causal ? chunk_states + task * ch.state : final_state + bh * ch.state;
      acc_t* dnum = p.causal ? dnum_all + (bh * p.seqlen_q + i0) * Dp : dnum_local.get();
      load_features<scalar_t>(p.q, b, h, i0, m, D, p.feature_map, phiq.get());
      gemm(false, false, m, Dp, D, acc_t(1), phiq.get(), D, state, Dp, acc_t(0), num.get(), Dp);
      if (p.causal) {
        load_features<scalar_t>(p.k, b, h, i0, m, D, p.feature_map, phik.get());
        load_values<scalar_t>(p.v, b, h, i0, m, Dv, vp.get());
        gemm(false, true, m, m, D, acc_t(1), phiq.get(), D, phik.get(), D, acc_t(0), a.get(), C);
        mask_future(a.get(), m, C);
        gemm(false, false, m, Dp, m, acc_t(1), a.get(), C, vp.get(), Dp, acc_t(1), num.get(), Dp);
      }
      load_rows<scalar_t>(dout, b, h, i0, m, Dv, dnum, Dp);
      for (int64_t r = 0; r < m; ++r) {
        acc_t* g = dnum + r * Dp;
        const acc_t* nr = num.get() + r * Dp;
        const acc_t inv = normalizer_inv(nr[Dv], eps);
        acc_t g_dot_n = 0;
        for (int64_t x = 0; x < Dv; ++x) g_dot_n += g[x] * nr[x];
        cpu::scale_row(g, Dv, inv);
        g[Dv] = denominator_grad(g_dot_n, inv);
      }
      gemm(false, true, m, D, Dp, acc_t(1), dnum, Dp, state, Dp, acc_t(0), dphi.get(), D);
      if (p.causal) {
        // Reuses `a` for P = dN' V'^T, masked: row i's gradient reaches keys j <= i.
        gemm(false, true, m, m, Dp, acc_t(1), dnum, Dp, vp.get(), Dp, acc_t(0), a.get(), C);
        mask_future(a.get(), m, C);
        gemm(false, false, m, D, m, acc_t(1), a.get(), C, phik.get(), D, acc_t(1), dphi.get(), D);
      }
      scale_by_feature_grad(dphi.get(), phiq.get(), m * D, p.feature_map);
      store_row(dphi.get(), dq + (bh * p.seqlen_q + i0) * D, m * D, acc_t(1));
      gemm(true, false, D, Dp, m, acc_t(1), phiq.get(), D, dnum, Dp, acc_t(0),
           grad_chunks + task * ch.state, Dp);
    }
  });

  // ---- phase 4: scan from the last chunk back. Causal: each chunk gets the gradient of the
  // rows after it (exclusive suffix); every case ends with the gradient of the initial state.
  const bool has_grad_final = grad_final_kv.defined();
  at::parallel_for(0, BH, ch.scan_grain, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      acc_t* running = grad_total + bh * ch.state;
      pack_state(has_grad_final ? grad_final_kv.data_ptr<acc_t>() + bh * D * Dv : nullptr,
                 has_grad_final ? grad_final_k.data_ptr<acc_t>() + bh * D : nullptr, D, Dv,
                 running);
      for (int64_t c = ch.num_q - 1; c >= 0; --c) {
        acc_t* s = grad_chunks + (bh * ch.num_q + c) * ch.state;
        for (int64_t e = 0; e < ch.state; ++e) {
          const acc_t delta = s[e];
          if (p.causal) s[e] = running[e];
          running[e] += delta;
        }
      }
    }
  });

  // ---- phase 5: dk, dv per key chunk
  at::parallel_for(0, BH * ch.num_k, ch.chunk_grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> phik(C * D), vp(C * Dp), dphi(C * D), dvb(C * Dv);
    Buffer<acc_t> phiq(p.causal ? C * D : 0), a(p.causal ? C * C : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / ch.num_k, c = task % ch.num_k;
      const int64_t b = bh / p.heads, h = bh % p.heads, j0 = c * C;
      const int64_t n = std::min(C, p.seqlen_k - j0);
      const acc_t* grad = p.causal ? grad_chunks + task * ch.state : grad_total + bh * ch.state;
      load_features<scalar_t>(p.k, b, h, j0, n, D, p.feature_map, phik.get());
      load_values<scalar_t>(p.v, b, h, j0, n, Dv, vp.get());
      gemm(false, true, n, D, Dp, acc_t(1), vp.get(), Dp, grad, Dp, acc_t(0), dphi.get(), D);
      gemm(false, false, n, Dv, D, acc_t(1), phik.get(), D, grad, Dp, acc_t(0), dvb.get(), Dv);
      if (p.causal) {
        const acc_t* dnum = dnum_all + (bh * p.seqlen_q + j0) * Dp;
        load_features<scalar_t>(p.q, b, h, j0, n, D, p.feature_map, phiq.get());
        gemm(false, true, n, n, Dp, acc_t(1), dnum, Dp, vp.get(), Dp, acc_t(0), a.get(), C);
        mask_future(a.get(), n, C);
        gemm(true, false, n, D, n, acc_t(1), a.get(), C, phiq.get(), D, acc_t(1), dphi.get(), D);
        gemm(false, true, n, n, D, acc_t(1), phiq.get(), D, phik.get(), D, acc_t(0), a.get(), C);
        mask_future(a.get(), n, C);
        gemm(true, false, n, Dv, n, acc_t(1), a.get(), C, dnum, Dp, acc_t(1), dvb.get(), Dv);
      }
      scale_by_feature_grad(dphi.get(), phik.get(), n * D, p.feature_map);
      store_row(dphi.get(), dk + (bh * p.seqlen_k + j0) * D, n * D, acc_t(1));
      store_row(dvb.get(), dv + (bh * p.seqlen_k + j0) * Dv, n * Dv, acc_t(1));
    }
  });
  unpack_states(grad_total, BH, D, Dv, grad_init_kv.data_ptr<acc_t>(),
                grad_init_k.data_ptr<acc_t>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_attention_backward_cpu(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v,
                              const std::optional<at::Tensor>& initial_state_kv,
                              const std::optional<at::Tensor>& initial_state_k,
                              const std::optional<at::Tensor>& grad_state_kv,
                              const std::optional<at::Tensor>& grad_state_k, bool causal,
                              double eps, c10::string_view feature_map) {
  constexpr const char* kOp = "attn_ext.linear_attention_backward";
  cpu::check_cpu_support(kOp);
  const LinearBackwardInputs in =
      prepare_linear_attention_backward(kOp, grad_out, q, k, v, initial_state_kv, initial_state_k,
                                        grad_state_kv, grad_state_k, causal, eps, feature_map);
  const LinearAttentionParams& p = in.fwd.params;
  const at::Tensor& grad_final_kv = in.grad_final_kv;
  const at::Tensor& grad_final_k = in.grad_final_k;
  const at::Tensor g = blas_rows(grad_out);
  const Rows dout{g.data_ptr(), g.stride(0), g.stride(1), blas_row_stride(g)};
  const auto acc = q.options().dtype(at::toOpMathType(q.scalar_type()));
  at::Tensor dq = advise_huge_pages(at::empty(q.sizes(), q.options()));
  at::Tensor dk = advise_huge_pages(at::empty(k.sizes(), k.options()));
  at::Tensor dv = advise_huge_pages(at::empty(v.sizes(), v.options()));
  at::Tensor grad_init_kv = at::empty({p.batch, p.heads, p.head_dim, p.head_dim_v}, acc);
  at::Tensor grad_init_k = at::empty({p.batch, p.heads, p.head_dim}, acc);
  if (p.batch * p.heads == 0) return {dq, dk, dv, grad_init_kv, grad_init_k};
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), kOp, [&] {
    linear_bwd<scalar_t>(p, dout, grad_final_kv, grad_final_k, dq.data_ptr<scalar_t>(),
                         dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), grad_init_kv,
                         grad_init_k);
  });
  return {dq, dk, dv, grad_init_kv, grad_init_k};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("linear_attention", &linear_attention_cpu);
  m.impl("linear_attention_backward", &linear_attention_backward_cpu);
}

}  // namespace attn_ext::linear
