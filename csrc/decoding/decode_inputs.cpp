#include "decoding/decode_inputs.h"

#include <cmath>
#include <vector>
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include "attention/inputs.h"
#include "common/float8.h"

namespace attn_ext {

void check_float_4d(const char* op, const char* name, const at::Tensor& t, const char* dims) {
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D ", dims, ", got ", t.dim(), "-D ",
              t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()) && !is_float8_cache(t.scalar_type()), op, ": ",
              name, " must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
}

namespace {

// A KV cache: 4-D, of a floating dtype (float8 ones included: common/float8.h).
void check_cache_4d(const char* op, const char* name, const at::Tensor& t, const char* dims) {
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D ", dims, ", got ", t.dim(), "-D ",
              t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must be float32, float64, bfloat16, float16, float8_e4m3fn or float8_e5m2, got ",
              t.scalar_type());
}

void check_same(const char* op, const char* name, const at::Tensor& t, const char* like_name,
                const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like_name, "'s device ",
              like.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have ", like_name,
              "'s dtype ", like.scalar_type(), ", got ", t.scalar_type());
}

void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                const char* what, int64_t expected) {
  TORCH_CHECK(t.size(dim) == expected, op, ": ", name, " ", what, " (dim ", dim, ") must be ",
              expected, ", got ", t.size(dim), " (shape ", t.sizes(), ")");
}

void check_index_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
}

// A cache's dtype against the tensor it meets (q, or the new keys / values): the same, or a
// float8 cache (common/float8.h).
void check_cache_dtype(const char* op, const char* name, const at::Tensor& cache,
                       const char* like_name, const at::Tensor& like) {
  TORCH_CHECK(cache.device() == like.device(), op, ": ", name, " must be on ", like_name,
              "'s device ", like.device(), ", got ", cache.device());
  TORCH_CHECK(cache.scalar_type() == like.scalar_type() || is_float8_cache(cache.scalar_type()), op,
              ": ", name, " must have ", like_name, "'s dtype ", like.scalar_type(),
              " or be float8_e4m3fn / float8_e5m2, got ", cache.scalar_type());
}

// A cache must be writable row by row: its last dimension contiguous.
void check_rows(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1, op, ": ", name,
              " must have a contiguous last dimension, got strides ", t.strides());
}

}  // namespace

RopePolicy make_rope_policy(const char* op, int64_t head_dim, double base, bool interleaved,
                            std::optional<int64_t> rotary_dim) {
  const int64_t rot = rotary_dim.value_or(head_dim);
  TORCH_CHECK(rot >= 0 && rot <= head_dim && rot % 2 == 0, op,
              ": rotary_dim must be even and in [0, head_dim = ", head_dim, "], got ", rot,
              rotary_dim.has_value() ? "" : " (the head dim, as rotary_dim was not given)");
  TORCH_CHECK(std::isfinite(base) && base > 0.0, op, ": base must be positive and finite, got ",
              base);
  return RopePolicy{base, rot, interleaved};
}

bool rope_scaled(const RopeScaling& scaling) {
  return (scaling.inv_freq.has_value() && scaling.inv_freq->defined()) ||
         scaling.attention_scaling != 1.0;
}

RopePolicy make_rope_policy(const char* op, int64_t head_dim, double base, bool interleaved,
                            std::optional<int64_t> rotary_dim, const RopeScaling& scaling,
                            const at::Tensor& like, const char* prefix, at::Tensor* freqs) {
  RopePolicy pol = make_rope_policy(op, head_dim, base, interleaved, rotary_dim);
  const double a = scaling.attention_scaling;
  TORCH_CHECK(std::isfinite(a) && a > 0.0, op, ": ", prefix,
              "attention_scaling must be positive and finite, got ", a);
  pol.attention_scaling = a;
  if (scaling.inv_freq.has_value() && scaling.inv_freq->defined()) {
    const at::Tensor& f = *scaling.inv_freq;
    TORCH_CHECK(f.dim() == 1 && f.size(0) == pol.pairs(), op, ": ", prefix,
                "inv_freq must have shape (rotary_dim / 2,) = (", pol.pairs(), ",), got ",
                f.sizes());
    TORCH_CHECK(at::isFloatingType(f.scalar_type()), op, ": ", prefix,
                "inv_freq must be floating point, got ", f.scalar_type());
    TORCH_CHECK(f.device() == like.device(), op, ": ", prefix, "inv_freq must be on ",
                like.device(), ", got ", f.device());
    *freqs = f.to(at::kFloat).contiguous();
    pol.freqs = freqs->data_ptr<float>();
  }
  return pol;
}

PreparedRope prepare_rope(const char* op, const at::Tensor& x, const RopeOptions& o) {
  check_float_4d(op, "x", x, "(B, H, S, D)");
  PreparedRope r;
  RopeParams& p = r.params;
  p.batch = x.size(0);
  p.heads = x.size(1);
  p.seqlen = x.size(2);
  p.head_dim = x.size(3);
  p.policy = make_rope_policy(op, p.head_dim, o.base, o.interleaved, o.rotary_dim, o.scaling, x, "",
                              &r.inv_freq);
  p.x = x.data_ptr();
  p.x_batch_stride = x.stride(0);
  p.x_head_stride = x.stride(1);
  p.x_row_stride = x.stride(2);
  p.x_col_stride = x.stride(3);
  p.offset = o.offset;
  if (o.positions.has_value() && o.positions->defined()) {
    TORCH_CHECK(o.offset == 0, op,
                ": give either positions or offset, not both (offset = ", o.offset, ")");
    r.positions =
        prepare_positions(op, *o.positions, "x", x, p.batch, p.seqlen, &p.pos_batch_stride);
    p.positions = r.positions.data_ptr<int64_t>();
  }
  return r;
}

at::Tensor prepare_positions(const char* op, const at::Tensor& pos, const char* like_name,
                             const at::Tensor& like, int64_t batch, int64_t seqlen,
                             int64_t* batch_stride) {
  check_index_dtype(op, "positions", pos);
  TORCH_CHECK(pos.device() == like.device(), op, ": positions must be on ", like_name, "'s device ",
              like.device(), ", got ", pos.device());
  const bool shared = pos.dim() == 1;
  TORCH_CHECK((shared && pos.size(0) == seqlen) ||
                  (pos.dim() == 2 && pos.size(0) == batch && pos.size(1) == seqlen),
              op, ": positions must have shape (S,) = (", seqlen, ",) or (B, S) = (", batch, ", ",
              seqlen, "), got ", pos.sizes());
  *batch_stride = shared ? 0 : seqlen;
  return pos.to(at::kLong).contiguous();
}

void set_rope_output(RopeParams& p, const at::Tensor& out) {
  p.out = out.data_ptr();
  p.o_batch_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.o_row_stride = out.stride(2);
  p.o_col_stride = out.stride(3);
}

at::Tensor int64_lengths(const char* op, const char* name, const at::Tensor& lengths, int64_t batch,
                         const at::Tensor& like, int64_t hi, bool check_values) {
  check_index_dtype(op, name, lengths);
  TORCH_CHECK(lengths.device() == like.device(), op, ": ", name, " must be on the cache's device ",
              like.device(), ", got ", lengths.device());
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == batch, op, ": ", name,
              " must have shape (B,) = (", batch, ",), got ", lengths.sizes());
  at::Tensor h = lengths.to(at::kLong).contiguous();
  if (!check_values) return h;
  const int64_t* d = h.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(d[b] >= 0 && d[b] <= hi, op, ": ", name, "[", b, "] must be in [0, ", hi, "], got ",
                d[b]);
  }
  return h;
}

PreparedAppend prepare_kv_append(const char* op, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                 const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& new_lengths, bool rope,
                                 double rope_base, bool rope_interleaved,
                                 std::optional<int64_t> rotary_dim,
                                 const std::optional<at::Tensor>& block_table, bool check_values,
                                 CacheScales scales, const AppendNames& n,
                                 const RopeScaling& rope_scaling) {
  const bool paged = block_table.has_value() && block_table->defined();
  check_cache_4d(op, n.k_cache, k_cache,
                 paged ? "(num_pages, Hkv, page_size, D)" : "(B, Hkv, L, D)");
  check_cache_4d(op, n.v_cache, v_cache,
                 paged ? "(num_pages, Hkv, page_size, Dv)" : "(B, Hkv, L, Dv)");
  check_float_4d(op, n.k, k, "(B, Hkv, S_new, D)");
  check_float_4d(op, n.v, v, "(B, Hkv, S_new, Dv)");
  check_same(op, n.v_cache, v_cache, n.k_cache, k_cache);
  if (is_float8_cache(k_cache.scalar_type())) {  // k / v of any other floating dtype
    check_cache_dtype(op, n.k_cache, k_cache, n.k, k);
    check_same(op, n.v, v, n.k, k);
  } else {
    check_same(op, n.k, k, n.k_cache, k_cache);
    check_same(op, n.v, v, n.k_cache, k_cache);
  }
  check_cache_scales(op, k_cache.scalar_type(), scales.k, scales.v);
  // A paged cache's first axis holds pages, not sequences: the batch is k's, and each
  // sequence's capacity is its table row's pages.
  const int64_t B = paged ? k.size(0) : k_cache.size(0), Hkv = k_cache.size(1);
  check_size(op, n.v_cache, v_cache, 0, paged ? "pages" : "batch size", k_cache.size(0));
  check_size(op, n.v_cache, v_cache, 1, "heads", Hkv);
  check_size(op, n.v_cache, v_cache, 2, paged ? "page size" : "capacity", k_cache.size(2));
  check_size(op, n.k, k, 0, "batch size", B);
  check_size(op, n.k, k, 1, "heads", Hkv);
  check_size(op, n.k, k, 3, "head dim", k_cache.size(3));
  check_size(op, n.v, v, 0, "batch size", B);
  check_size(op, n.v, v, 1, "heads", Hkv);
  check_size(op, n.v, v, 2, "length", k.size(2));
  check_size(op, n.v, v, 3, "head dim", v_cache.size(3));
  check_rows(op, n.k_cache, k_cache);
  check_rows(op, n.v_cache, v_cache);

  PreparedAppend r;
  KVAppendParams& p = r.params;
  if (paged) p.pages = prepare_page_table(op, *block_table, B, k_cache, n.k_cache, /*page_dim=*/2);
  const int64_t L = paged ? block_table->size(1) * p.pages.page_size : k_cache.size(2);
  p.batch = B;
  p.kv_heads = Hkv;
  p.seqlen_new = k.size(2);
  p.capacity = L;
  p.head_dim = k_cache.size(3);
  p.head_dim_v = v_cache.size(3);
  r.lengths = int64_lengths(op, "cache_seqlens", cache_seqlens, B, k_cache, L, check_values);
  if (new_lengths.has_value() && new_lengths->defined()) {
    r.appended =
        int64_lengths(op, "new_lengths", *new_lengths, B, k_cache, p.seqlen_new, check_values);
  } else {
    r.appended = at::full({B}, p.seqlen_new, r.lengths.options());
  }
  const int64_t* len = r.lengths.data_ptr<int64_t>();
  const int64_t* add = r.appended.data_ptr<int64_t>();
  for (int64_t b = 0; check_values && b < B; ++b) {
    TORCH_CHECK(len[b] + add[b] <= L, op, ": sequence ", b,
                " would overflow the cache: cache_seqlens[", b, "] = ", len[b], " + ", add[b],
                " new tokens > capacity ", L, " (nothing was written)");
  }
  if (paged && check_values) {
    std::vector<int64_t> end(B);
    for (int64_t b = 0; b < B; ++b) end[b] = len[b] + add[b];
    check_page_entries(op, p.pages, B, len, end.data());
  }
  p.lengths = len;
  p.appended = add;
  p.k_scale = scales.k;
  p.v_scale = scales.v;
  p.rope = rope;
  TORCH_CHECK(rope || !rope_scaled(rope_scaling), op,
              ": rope_inv_freq / rope_attention_scaling need rope=True");
  if (rope) {
    p.policy = make_rope_policy(op, p.head_dim, rope_base, rope_interleaved, rotary_dim,
                                rope_scaling, k_cache, "rope_", &r.inv_freq);
  }

  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.k_col_stride = k.stride(3);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.v_col_stride = v.stride(3);
  p.kc_batch_stride = k_cache.stride(0), p.kc_head_stride = k_cache.stride(1);
  p.kc_row_stride = k_cache.stride(2);
  p.vc_batch_stride = v_cache.stride(0), p.vc_head_stride = v_cache.stride(1);
  p.vc_row_stride = v_cache.stride(2);
  return r;
}

PreparedAppend prepare_latent_append(
    const char* op, const at::Tensor& cache, const at::Tensor& cache_seqlens,
    const at::Tensor& c_kv, const at::Tensor& k_rope, const std::optional<at::Tensor>& new_lengths,
    double rope_base, bool rope_interleaved, const std::optional<at::Tensor>& block_table,
    bool check_values, const RopeScaling& rope_scaling, double kv_scale) {
  const bool paged = block_table.has_value() && block_table->defined();
  check_cache_4d(op, "cache", cache,
                 paged ? "(num_pages, Hkv, page_size, Dc + Dr)" : "(B, Hkv, L, Dc + Dr)");
  check_float_4d(op, "c_kv", c_kv, "(B, Hkv, S_new, Dc)");
  check_float_4d(op, "k_rope", k_rope, "(B, Hkv, S_new, Dr)");
  check_cache_scale(op, "kv_scale", cache.scalar_type(), kv_scale);
  const int64_t dc = c_kv.size(3), dr = k_rope.size(3);
  TORCH_CHECK(dc + dr == cache.size(3), op,
              ": the cache row width (dim 3) must be c_kv's + "
              "k_rope's = ",
              dc, " + ", dr, " = ", dc + dr, ", got ", cache.size(3), " (shape ", cache.sizes(),
              ")");
  // The latent columns are the append's "values", the RoPE columns its rotated "keys": two
  // column views of the one buffer, written row by row without overlap.
  return prepare_kv_append(op, cache.narrow(3, dc, dr), cache.narrow(3, 0, dc), cache_seqlens,
                           k_rope, c_kv, new_lengths, /*rope=*/true, rope_base, rope_interleaved,
                           std::nullopt, block_table, check_values, CacheScales{kv_scale, kv_scale},
                           {"cache[..., Dc:]", "cache[..., :Dc]", "k_rope", "c_kv"}, rope_scaling);
}

PreparedDecode prepare_decode(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                              const DecodeOptions& o, bool check_values) {
  TORCH_CHECK(o.num_splits >= 0, op, ": num_splits must be >= 0 (0 = automatic), got ",
              o.num_splits);
  const bool indexed = o.cache_batch_idx.has_value() && o.cache_batch_idx->defined();
  const bool paged = o.block_table.has_value() && o.block_table->defined();
  TORCH_CHECK(!(indexed && paged), op,
              ": give either block_table or cache_batch_idx, not both (a paged cache finds each "
              "sequence's rows through block_table)");
  check_float_4d(op, "q", q, "(B, H, Sq, D)");
  check_cache_4d(op, "k_cache", k_cache,
                 paged ? "(num_pages, Hkv, page_size, D)" : "(B, Hkv, L, D)");
  check_cache_4d(op, "v_cache", v_cache,
                 paged ? "(num_pages, Hkv, page_size, Dv)" : "(B, Hkv, L, Dv)");
  check_cache_dtype(op, "k_cache", k_cache, "q", q);
  check_same(op, "v_cache", v_cache, "k_cache", k_cache);
  check_cache_scales(op, k_cache.scalar_type(), o.k_scale, o.v_scale);
  if (!indexed && !paged) check_size(op, "k_cache", k_cache, 0, "batch size", q.size(0));
  check_size(op, "v_cache", v_cache, 0, paged ? "pages" : "batch size", k_cache.size(0));
  check_size(op, "v_cache", v_cache, 1, "heads", k_cache.size(1));
  check_size(op, "v_cache", v_cache, 2, paged ? "page size" : "capacity", k_cache.size(2));
  check_size(op, "k_cache", k_cache, 3, "head dim", q.size(3));
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, op,
              ": q heads must be a multiple of the cache's kv heads (GQA), got H=", q.size(1),
              " and Hkv=", k_cache.size(1));
  TORCH_CHECK(!indexed || k_cache.size(0) > 0 || q.size(0) == 0, op,
              ": cache_batch_idx needs a cache with at least one batch row");
  TORCH_CHECK(!paged || k_cache.size(0) > 0 || q.size(0) == 0, op,
              ": block_table needs a cache with at least one page, got k_cache of shape ",
              k_cache.sizes());
  PageTable pages;
  if (paged)
    pages = prepare_page_table(op, *o.block_table, q.size(0), k_cache, "k_cache", /*page_dim=*/2);
  // Each sequence's capacity: the cache's rows, or its table row's pages.
  const int64_t capacity = paged ? o.block_table->size(1) * pages.page_size : k_cache.size(2);
  // The cache is the key/value input of an ordinary attention call with Sk = capacity;
  // the per-sequence lengths then narrow what each sequence sees. With cache_batch_idx the
  // cache's batch differs from q's: validation sees row 0 broadcast over q's batch, and the
  // kernels then step over the cache's own rows. (An empty batch may index an empty cache:
  // both have zero rows then.) A paged cache is validated the same way, page 0 standing for
  // every sequence; its capacity then replaces the page size.
  const bool remapped = indexed || paged;
  const auto per_query_batch = [&](const at::Tensor& c) {
    return remapped && c.size(0) > 0 ? c.narrow(0, 0, 1).expand({q.size(0), -1, -1, -1}) : c;
  };
  PreparedDecode r;
  r.attention =
      prepare_attention(op, q, per_query_batch(k_cache), per_query_batch(v_cache),
                        {std::nullopt, o.scale, o.causal, o.window_left, o.window_right,
                         std::nullopt, 0.0, std::nullopt, o.softcap, o.alibi_slopes, o.sinks,
                         /*float8_kv=*/true});
  r.q = r.attention.q;
  r.k_cache = remapped ? blas_rows(k_cache) : r.attention.k;
  r.v_cache = remapped ? blas_rows(v_cache) : r.attention.v;
  static_cast<AttentionParams&>(r.params) = r.attention.params;
  if (remapped) {
    DecodeParams& p = r.params;
    p.k = r.k_cache.data_ptr();
    p.v = r.v_cache.data_ptr();
    p.k_batch_stride = r.k_cache.stride(0);
    p.v_batch_stride = r.v_cache.stride(0);
    p.k_head_stride = r.k_cache.stride(1);
    p.v_head_stride = r.v_cache.stride(1);
    p.k_row_stride = blas_row_stride(r.k_cache);
    p.v_row_stride = blas_row_stride(r.v_cache);
  }
  if (paged) {
    r.params.pages = pages;
    r.params.seqlen_k = capacity;
    r.params.key_offset = capacity - q.size(2);
  }
  if (indexed) {
    DecodeParams& p = r.params;
    r.batch_idx = int64_lengths(op, "cache_batch_idx", *o.cache_batch_idx, q.size(0), k_cache,
                                k_cache.size(0) - 1, check_values);
    p.batch_idx = r.batch_idx.data_ptr<int64_t>();
    p.cache_batch = k_cache.size(0);
  }
  r.lengths =
      int64_lengths(op, "cache_seqlens", cache_seqlens, q.size(0), k_cache, capacity, check_values);
  r.params.lengths = r.lengths.data_ptr<int64_t>();
  if (paged && check_values) {
    // Every page holding a valid row: a superset of the rows the band lets the kernel read.
    const std::vector<int64_t> begin(q.size(0), 0);
    check_page_entries(op, pages, q.size(0), begin.data(), r.params.lengths);
  }
  if (o.cache_leftpad.has_value() && o.cache_leftpad->defined()) {
    r.leftpad = int64_lengths(op, "cache_leftpad", *o.cache_leftpad, q.size(0), k_cache, capacity,
                              check_values);
    if (check_values) {
      const int64_t* lp = r.leftpad.data_ptr<int64_t>();
      for (int64_t b = 0; b < q.size(0); ++b)
        TORCH_CHECK(lp[b] <= r.params.lengths[b], op, ": cache_leftpad[", b, "] = ", lp[b],
                    " exceeds cache_seqlens[", b, "] = ", r.params.lengths[b]);
    }
    r.params.leftpad = r.leftpad.data_ptr<int64_t>();
  }
  r.params.num_splits = o.num_splits;
  r.params.k_scale = o.k_scale;
  r.params.v_scale = o.v_scale;
  return r;
}

}  // namespace attn_ext
