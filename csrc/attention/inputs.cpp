#include "attention/inputs.h"

#include <cmath>
#include <limits>
#include <utility>
#include <vector>
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>
#include "common/float8.h"

namespace attn_ext {
void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               bool float8_kv) {
  TORCH_CHECK(q.dim() == 4, op, ": q must be 4-D (B, H, Sq, D), got ", q.dim(), "-D ", q.sizes());
  TORCH_CHECK(k.dim() == 4, op, ": k must be 4-D (B, Hkv, Sk, D), got ", k.dim(), "-D ", k.sizes());
  TORCH_CHECK(v.dim() == 4, op, ": v must be 4-D (B, Hkv, Sk, Dv), got ", v.dim(), "-D ",
              v.sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), op,
              ": q must be float32, float64, bfloat16 or float16, got ", q.scalar_type());
  // A float8 cache's dtypes were checked by the caller (prepare_decode: v's against k's).
  if (!(float8_kv && is_float8_cache(k.scalar_type()))) {
    TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": k must have q's dtype ", q.scalar_type(),
                ", got ", k.scalar_type());
    TORCH_CHECK(v.scalar_type() == q.scalar_type(), op, ": v must have q's dtype ", q.scalar_type(),
                ", got ", v.scalar_type());
  }
  TORCH_CHECK(k.device() == q.device(), op, ": k must be on q's device ", q.device(), ", got ",
              k.device());
  TORCH_CHECK(v.device() == q.device(), op, ": v must be on q's device ", q.device(), ", got ",
              v.device());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), op,
              ": k and v batch size must equal q's ", q.size(0), ", got k ", k.sizes(), " and v ",
              v.sizes());
  TORCH_CHECK(v.size(1) == k.size(1), op, ": v must have k's number of heads ", k.size(1), ", got ",
              v.size(1));
  TORCH_CHECK(k.size(1) > 0 || q.size(1) == 0, op, ": k must have at least one head, got ",
              k.sizes());
  TORCH_CHECK(k.size(1) == 0 || q.size(1) % k.size(1) == 0, op,
              ": q heads must be a multiple of k heads (GQA), got H=", q.size(1),
              " and Hkv=", k.size(1));
  TORCH_CHECK(v.size(2) == k.size(2), op, ": v sequence length must equal k's ", k.size(2),
              ", got ", v.size(2));
  TORCH_CHECK(k.size(3) == q.size(3), op, ": k head dim must equal q's ", q.size(3), ", got ",
              k.size(3));
}

namespace {

at::Tensor prepare_mask(const char* op, const at::Tensor& mask, const at::Tensor& q, int64_t sk) {
  TORCH_CHECK(mask.device() == q.device(), op, ": attn_mask must be on q's device ", q.device(),
              ", got ", mask.device());
  const auto dt = mask.scalar_type();
  TORCH_CHECK(dt == at::kBool || at::isFloatingType(dt), op,
              ": attn_mask must be bool (true = keep) or floating (additive), got ", dt);
  TORCH_CHECK(mask.dim() <= 4, op, ": attn_mask must be broadcastable to (B, H, Sq, Sk) = (",
              q.size(0), ", ", q.size(1), ", ", q.size(2), ", ", sk, "), got shape ", mask.sizes());
  const std::vector<int64_t> target{q.size(0), q.size(1), q.size(2), sk};
  const int64_t lead = 4 - mask.dim();
  for (int64_t d = 0; d < mask.dim(); ++d) {
    const int64_t s = mask.size(d);
    TORCH_CHECK(s == 1 || s == target[lead + d], op,
                ": attn_mask must be broadcastable to (B, H, Sq, Sk) = (", target[0], ", ",
                target[1], ", ", target[2], ", ", target[3], "), got shape ", mask.sizes());
  }
  // An additive mask is read in the kernels' accumulation type (fp64 for fp64 inputs, else
  // fp32) or, by the CPU kernels, in q's own element type: converting a full-size bf16 / fp16
  // (B, H, Sq, Sk) mask on every call cost as much as the attention itself. Convert before
  // expanding, so a broadcast mask is never materialized at full size.
  const bool as_is = dt == at::kBool || dt == at::toOpMathType(q.scalar_type()) ||
                     (q.device().is_cpu() && dt == q.scalar_type());
  at::Tensor m = as_is ? mask : mask.to(at::toOpMathType(q.scalar_type()));
  return m.expand(target);
}

}  // namespace

void read_rng_state(const char* op, const std::optional<at::Tensor>& rng_state, double dropout_p,
                    AttentionParams& p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p must be in [0, 1), got ",
              dropout_p);
  p.dropout_p = dropout_p;
  if (dropout_p == 0.0) return;
  TORCH_CHECK(rng_state.has_value(), op,
              ": rng_state (int64 tensor [seed, offset]) is required when dropout_p > 0");
  const at::Tensor& s = *rng_state;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kLong && s.numel() == 2, op,
              ": rng_state must be a CPU int64 tensor of 2 elements, got ", s.scalar_type(), " ",
              s.sizes(), " on ", s.device());
  const at::Tensor c = s.contiguous();
  p.seed = static_cast<uint64_t>(c.data_ptr<int64_t>()[0]);
  p.rng_offset = static_cast<uint64_t>(c.data_ptr<int64_t>()[1]);
}

namespace {

// softcap, alibi_slopes and sinks: checked, and the tensors converted to the accumulation type
// (a copy of at most B * H values).
void prepare_score_mods(const char* op, PreparedInputs& r, const AttentionOptions& o) {
  AttentionParams& p = r.params;
  TORCH_CHECK(std::isfinite(o.softcap) && o.softcap >= 0.0, op,
              ": softcap must be finite and >= 0 (0 = off), got ", o.softcap);
  p.softcap = o.softcap;
  const auto acc = at::toOpMathType(r.q.scalar_type());
  const auto check_floating = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.device() == r.q.device(), op, ": ", name, " must be on q's device ", r.q.device(),
                ", got ", t.device());
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name, " must be floating, got ",
                t.scalar_type());
  };
  if (o.alibi_slopes.has_value() && o.alibi_slopes->defined()) {
    const at::Tensor& a = *o.alibi_slopes;
    check_floating("alibi_slopes", a);
    const bool per_head = a.dim() == 1 && a.size(0) == p.heads;
    const bool per_batch = a.dim() == 2 && a.size(0) == p.batch && a.size(1) == p.heads;
    TORCH_CHECK(per_head || per_batch, op, ": alibi_slopes must have shape (H,) = (", p.heads,
                ",) or (B, H) = (", p.batch, ", ", p.heads, "), got ", a.sizes());
    r.alibi_slopes = a.to(acc).contiguous();
    p.alibi_slopes = r.alibi_slopes.const_data_ptr();
    p.alibi_batch_stride = per_batch ? p.heads : 0;
  }
  if (o.sinks.has_value() && o.sinks->defined()) {
    const at::Tensor& t = *o.sinks;
    check_floating("sinks", t);
    TORCH_CHECK(t.dim() == 1 && t.size(0) == p.heads, op, ": sinks must have shape (H,) = (",
                p.heads, ",), got ", t.sizes());
    r.sinks = t.to(acc).contiguous();
    p.sinks = r.sinks.const_data_ptr();
  }
}

// The band of the options into the params (key_offset is the caller's business).
void set_band(const char* op, const AttentionOptions& o, AttentionParams& p) {
  TORCH_CHECK(o.window_left >= -1, op, ": window_size[0] (left) must be >= -1, got ",
              o.window_left);
  TORCH_CHECK(o.window_right >= -1, op, ": window_size[1] (right) must be >= -1, got ",
              o.window_right);
  p.window_left = o.window_left;
  p.window_right =
      o.causal ? (o.window_right < 0 ? 0 : std::min<int64_t>(o.window_right, 0)) : o.window_right;
}

void set_scale(const char* op, const AttentionOptions& o, AttentionParams& p) {
  const double scale =
      o.scale.has_value() ? *o.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  p.scale = scale;
}

void set_qkv_pointers(PreparedInputs& r) {
  AttentionParams& p = r.params;
  p.q = r.q.data_ptr();
  p.k = r.k.data_ptr();
  p.v = r.v.data_ptr();
  p.q_batch_stride = p.varlen() ? 0 : r.q.stride(0);
  p.q_head_stride = r.q.stride(1);
  p.q_row_stride = blas_row_stride(r.q);
  p.k_batch_stride = p.varlen() ? 0 : r.k.stride(0);
  p.k_head_stride = r.k.stride(1);
  p.k_row_stride = blas_row_stride(r.k);
  p.v_batch_stride = p.varlen() ? 0 : r.v.stride(0);
  p.v_head_stride = r.v.stride(1);
  p.v_row_stride = blas_row_stride(r.v);
}

// A varlen tensor (total, heads, dim) as the (1, heads, total, dim) view the kernels address
// by (head, token) rows.
at::Tensor token_rows(const char* op, const char* name, const at::Tensor& t, const char* shape) {
  TORCH_CHECK(t.dim() == 3, op, ": ", name, " must be 3-D ", shape, ", got ", t.dim(), "-D ",
              t.sizes());
  return t.transpose(0, 1).unsqueeze(0);
}

// FlashAttention's pages (num_pages, page_size, heads, dim) as the (num_pages, heads, page_size,
// dim) view the kernels address by (page, head, row).
at::Tensor paged_rows(const char* op, const char* name, const at::Tensor& t, const char* shape) {
  TORCH_CHECK(t.dim() == 4, op, ": with a block_table, ", name, " must be 4-D ", shape, ", got ",
              t.dim(), "-D ", t.sizes());
  return t.transpose(1, 2);
}

// The block_table of a paged varlen batch (cu_seqlens_k already checked: on the CPU, so its
// values are read): each sequence's length within its table row's pages, and the entries it
// touches pages of k.
PageTable prepare_paged_keys(const char* op, const at::Tensor& block_table, int64_t batch,
                             const at::Tensor& k, const at::Tensor& cu_seqlens_k) {
  PageTable pages = prepare_page_table(op, block_table, batch, k, "k", /*page_dim=*/1);
  const int64_t capacity = block_table.size(1) * pages.page_size;
  const int32_t* cu = cu_seqlens_k.const_data_ptr<int32_t>();
  std::vector<int64_t> begin(batch, 0), end(batch);
  for (int64_t b = 0; b < batch; ++b) {
    end[b] = static_cast<int64_t>(cu[b + 1]) - cu[b];
    TORCH_CHECK(end[b] <= capacity, op, ": sequence ", b, " has ", end[b],
                " keys (cu_seqlens_k), more than its block_table row holds (max_pages ",
                block_table.size(1), " x page_size ", pages.page_size, " = ", capacity, ")");
  }
  check_page_entries(op, pages, batch, begin.data(), end.data());
  return pages;
}

void check_cu_seqlens(const char* op, const char* name, const at::Tensor& cu, const at::Tensor& q,
                      int64_t batch, int64_t total, const char* max_name, int64_t max_seqlen,
                      bool exact_total) {
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, op, ": ", name,
              " must be 1-D (B + 1,) with B >= 0, got shape ", cu.sizes());
  TORCH_CHECK(cu.size(0) == batch + 1, op, ": ", name, " must have B + 1 = ", batch + 1,
              " entries (as cu_seqlens_q), got ", cu.size(0));
  TORCH_CHECK(cu.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ",
              cu.scalar_type());
  TORCH_CHECK(cu.device() == q.device(), op, ": ", name, " must be on q's device ", q.device(),
              ", got ", cu.device());
  TORCH_CHECK(cu.is_contiguous(), op, ": ", name, " must be contiguous");
  if (!cu.device().is_cpu()) return;  // reading a device tensor's values would synchronize
  const int32_t* c = cu.const_data_ptr<int32_t>();
  TORCH_CHECK(c[0] == 0, op, ": ", name, "[0] must be 0, got ", c[0]);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = static_cast<int64_t>(c[b + 1]) - c[b];
    TORCH_CHECK(len >= 0, op, ": ", name, " must be non-decreasing, got ", name, "[", b,
                "] = ", c[b], " > ", name, "[", b + 1, "] = ", c[b + 1]);
    TORCH_CHECK(len <= max_seqlen, op, ": ", max_name, " = ", max_seqlen,
                " is less than the length of sequence ", b, " (", len, " in ", name, ")");
  }
  TORCH_CHECK(exact_total ? c[batch] == total : c[batch] <= total, op, ": ", name,
              "[B] = ", c[batch],
              exact_total ? " must equal the token count " : " exceeds the token count ", total);
}

}  // namespace

PreparedInputs prepare_attention(const char* op, const at::Tensor& q_in, const at::Tensor& k_in,
                                 const at::Tensor& v_in, const AttentionOptions& o) {
  check_qkv(op, q_in, k_in, v_in, o.float8_kv);
  PreparedInputs r;
  r.q = blas_rows(q_in);
  r.k = blas_rows(k_in);
  r.v = blas_rows(v_in);
  AttentionParams& p = r.params;
  p.batch = r.q.size(0);
  p.heads = r.q.size(1);
  p.kv_heads = r.k.size(1);
  p.seqlen_q = r.q.size(2);
  p.seqlen_k = r.k.size(2);
  p.head_dim = r.q.size(3);
  p.head_dim_v = r.v.size(3);
  set_scale(op, o, p);
  set_band(op, o, p);
  p.key_offset = o.key_offset.has_value() ? *o.key_offset : p.seqlen_k - p.seqlen_q;

  if (o.attn_mask.has_value() && o.attn_mask->defined()) {
    r.mask = prepare_mask(op, *o.attn_mask, r.q, p.seqlen_k);
    const auto mt = r.mask.scalar_type();
    p.mask_kind = mt == at::kBool                             ? MaskKind::kBool
                  : mt == at::toOpMathType(r.q.scalar_type()) ? MaskKind::kAdditive
                                                              : MaskKind::kAdditiveInput;
    p.mask = r.mask.data_ptr();
    p.mask_batch_stride = r.mask.stride(0);
    p.mask_head_stride = r.mask.stride(1);
    p.mask_row_stride = r.mask.stride(2);
    p.mask_col_stride = r.mask.stride(3);
  }
  read_rng_state(op, o.rng_state, o.dropout_p, p);
  prepare_score_mods(op, r, o);
  set_qkv_pointers(r);
  return r;
}

PreparedInputs prepare_attention_varlen(const char* op, const at::Tensor& q_in,
                                        const at::Tensor& k_in, const at::Tensor& v_in,
                                        const at::Tensor& cu_seqlens_q,
                                        const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                        int64_t max_seqlen_k, const AttentionOptions& o) {
  const bool paged = o.block_table.has_value() && o.block_table->defined();
  const at::Tensor q4 = token_rows(op, "q", q_in, "(total_q, H, D)");
  // Pages are read as (num_pages, Hkv, page_size, *): a batch of pages for check_qkv's shapes.
  const at::Tensor k4 = paged ? paged_rows(op, "k", k_in, "(num_pages, page_size, Hkv, D)")
                              : token_rows(op, "k", k_in, "(total_k, Hkv, D)");
  const at::Tensor v4 = paged ? paged_rows(op, "v", v_in, "(num_pages, page_size, Hkv, Dv)")
                              : token_rows(op, "v", v_in, "(total_k, Hkv, Dv)");
  if (paged) {
    TORCH_CHECK_NOT_IMPLEMENTED(q_in.device().is_cpu(), op,
                                ": block_table (paged k / v) runs on the CPU only; on ",
                                q_in.device(), " gather the pages into (total_k, Hkv, D) rows");
    TORCH_CHECK(v4.size(0) == k4.size(0) && v4.size(2) == k4.size(2), op,
                ": v must have k's num_pages and page_size (", k4.size(0), ", ", k4.size(2),
                "), got shape ", v_in.sizes());
    check_qkv(op, q4.expand({k4.size(0), -1, -1, -1}), k4, v4);
  } else {
    check_qkv(op, q4, k4, v4);
  }
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, op,
              ": max_seqlen_q and max_seqlen_k must be >= 0, got ", max_seqlen_q, " and ",
              max_seqlen_k);
  const int64_t batch = cu_seqlens_q.dim() == 1 ? cu_seqlens_q.size(0) - 1 : -1;
  check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q_in, batch, q_in.size(0), "max_seqlen_q",
                   max_seqlen_q,
                   /*exact_total=*/true);
  // A paged batch's keys are not one token axis: its lengths are bounded by the pages below.
  check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, q_in, batch,
                   paged ? std::numeric_limits<int64_t>::max() : k_in.size(0), "max_seqlen_k",
                   max_seqlen_k,
                   /*exact_total=*/false);
  PreparedInputs r;
  r.q = blas_rows(q4);
  r.k = blas_rows(k4);
  r.v = blas_rows(v4);
  if (paged) r.params.pages = prepare_paged_keys(op, *o.block_table, batch, k_in, cu_seqlens_k);
  r.cu_seqlens_q = cu_seqlens_q;
  r.cu_seqlens_k = cu_seqlens_k;
  AttentionParams& p = r.params;
  p.cu_seqlens_q = cu_seqlens_q.const_data_ptr<int32_t>();
  p.cu_seqlens_k = cu_seqlens_k.const_data_ptr<int32_t>();
  p.batch = batch;
  p.heads = r.q.size(1);
  p.kv_heads = r.k.size(1);
  p.seqlen_q = max_seqlen_q;
  p.seqlen_k = max_seqlen_k;
  p.total_q = q_in.size(0);
  // Paged: the keys of all sequences (the CPU's checked offsets; no key row is addressed by it).
  p.total_k = paged ? cu_seqlens_k.const_data_ptr<int32_t>()[batch] : k_in.size(0);
  p.head_dim = r.q.size(3);
  p.head_dim_v = r.v.size(3);
  set_scale(op, o, p);
  set_band(op, o, p);
  TORCH_CHECK(!(o.attn_mask.has_value() && o.attn_mask->defined()), op,
              ": attn_mask is not supported by the varlen form");
  read_rng_state(op, o.rng_state, o.dropout_p, p);
  prepare_score_mods(op, r, o);
  set_qkv_pointers(r);
  if (paged) {  // the kernels step from page to page by the batch strides (params.h)
    p.k_batch_stride = r.k.stride(0);
    p.v_batch_stride = r.v.stride(0);
  }
  return r;
}

PreparedInputs prepare_probabilities(const char* op, const at::Tensor& q, const at::Tensor& k,
                                     const AttentionOptions& opts) {
  return prepare_attention(op, q, k, k, opts);
}

PreparedInputs prepare_probabilities(const char* op, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& lse, const AttentionOptions& opts) {
  PreparedInputs r = prepare_attention(op, q, k, k, opts);
  const AttentionParams& p = r.params;
  check_companion(op, "lse", lse, q, {p.batch, p.heads, p.seqlen_q}, at::kFloat);
  return r;
}

PreparedInputs prepare_probabilities_backward(const char* op, const at::Tensor& grad_weights,
                                              const at::Tensor& weights, const at::Tensor& q,
                                              const at::Tensor& k, double softcap) {
  AttentionOptions opts;
  opts.softcap = softcap;
  PreparedInputs r = prepare_attention(op, q, k, k, opts);
  const AttentionParams& p = r.params;
  const std::vector<int64_t> w_shape{p.batch, p.heads, p.seqlen_q, p.seqlen_k};
  check_companion(op, "grad_weights", grad_weights, q, w_shape, q.scalar_type());
  check_companion(op, "weights", weights, q, w_shape, q.scalar_type());
  return r;
}

std::tuple<at::Tensor, at::Tensor> allocate_outputs(AttentionParams& p, const at::Tensor& q) {
  at::Tensor out, lse, out4;
  if (p.varlen()) {
    // On a GPU the offsets are not checked (a sync): tokens outside every sequence, which the
    // kernels never write, read as zeros and -inf rather than as garbage.
    const bool unchecked = !q.device().is_cpu();
    out = unchecked ? at::zeros({p.total_q, p.heads, p.head_dim_v}, q.options())
                    : at::empty({p.total_q, p.heads, p.head_dim_v}, q.options());
    lse = unchecked ? at::full({p.heads, p.total_q}, -INFINITY, q.options().dtype(at::kFloat))
                    : at::empty({p.heads, p.total_q}, q.options().dtype(at::kFloat));
    out4 = out.transpose(0, 1).unsqueeze(0);
  } else {
    out = at::empty({p.batch, p.heads, p.seqlen_q, p.head_dim_v}, q.options());
    lse = at::empty({p.batch, p.heads, p.seqlen_q}, q.options().dtype(at::kFloat));
    out4 = out;
  }
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_batch_stride = p.varlen() ? 0 : out4.stride(0);
  p.o_head_stride = out4.stride(1);
  p.o_row_stride = std::max<int64_t>(out4.stride(2), 1);
  return {out, lse};
}

PreparedBackward prepare_attention_backward(const char* op, const at::Tensor& grad_out,
                                            const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& out,
                                            const at::Tensor& lse,
                                            const std::optional<at::Tensor>& grad_lse,
                                            const AttentionOptions& opts) {
  return prepare_backward_of(op, prepare_attention(op, q, k, v, opts), grad_out, out, lse,
                             grad_lse);
}

AttentionOptions varlen_options(std::optional<double> scale, bool causal, int64_t window_left,
                                int64_t window_right, double dropout_p,
                                const std::optional<at::Tensor>& rng_state, double softcap,
                                const std::optional<at::Tensor>& alibi_slopes,
                                const std::optional<at::Tensor>& sinks,
                                const std::optional<at::Tensor>& block_table) {
  AttentionOptions o{std::nullopt, scale,     causal,  window_left,  window_right, std::nullopt,
                     dropout_p,    rng_state, softcap, alibi_slopes, sinks};
  o.block_table = block_table;
  return o;
}

AttentionOptions weights_options(const std::optional<at::Tensor>& attn_mask,
                                 std::optional<double> scale, bool causal, int64_t window_left,
                                 int64_t window_right, std::optional<int64_t> key_offset,
                                 double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                 const std::optional<at::Tensor>& sinks) {
  return {attn_mask,         scale,        causal,  window_left,  window_right, key_offset,
          /*dropout_p=*/0.0, std::nullopt, softcap, alibi_slopes, sinks};
}

PreparedBackward prepare_attention_varlen_backward(
    const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const std::optional<at::Tensor>& grad_lse, const AttentionOptions& opts) {
  return prepare_backward_of(op,
                             prepare_attention_varlen(op, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                      max_seqlen_q, max_seqlen_k, opts),
                             grad_out, out, lse, grad_lse);
}

PreparedBackward prepare_backward_of(const char* op, PreparedInputs in, const at::Tensor& grad_out,
                                     const at::Tensor& out, const at::Tensor& lse,
                                     const std::optional<at::Tensor>& grad_lse) {
  PreparedBackward r{std::move(in)};
  AttentionBwdParams& p = r.params;
  static_cast<AttentionParams&>(p) = r.in.params;
  const at::Tensor& q = r.in.q;
  const bool varlen = p.varlen();
  const std::vector<int64_t> o_shape =
      varlen ? std::vector<int64_t>{p.total_q, p.heads, p.head_dim_v}
             : std::vector<int64_t>{p.batch, p.heads, p.seqlen_q, p.head_dim_v};
  const std::vector<int64_t> row_shape = varlen
                                             ? std::vector<int64_t>{p.heads, p.total_q}
                                             : std::vector<int64_t>{p.batch, p.heads, p.seqlen_q};
  check_companion(op, "grad_out", grad_out, q, o_shape, q.scalar_type());
  check_companion(op, "out", out, q, o_shape, q.scalar_type());
  check_companion(op, "lse", lse, q, row_shape, at::kFloat);
  const bool has_glse = grad_lse.has_value() && grad_lse->defined();
  if (has_glse) check_companion(op, "grad_lse", *grad_lse, q, row_shape, at::kFloat);

  // The kernels read grad_out / out by rows (through BLAS on the CPU), lse by index.
  const auto rows_view = [&](const at::Tensor& t) {
    return varlen ? t.transpose(0, 1).unsqueeze(0) : t;
  };
  r.grad_out = blas_rows(rows_view(grad_out));
  r.out = blas_rows(rows_view(out));
  r.lse = lse.contiguous();
  if (has_glse) r.grad_lse = grad_lse->contiguous();
  p.grad_lse = has_glse ? r.grad_lse.const_data_ptr<float>() : nullptr;
  p.dout = r.grad_out.const_data_ptr();
  p.do_batch_stride = varlen ? 0 : r.grad_out.stride(0);
  p.do_head_stride = r.grad_out.stride(1);
  p.do_row_stride = blas_row_stride(r.grad_out);
  p.out = const_cast<void*>(r.out.const_data_ptr());
  p.o_batch_stride = varlen ? 0 : r.out.stride(0);
  p.o_head_stride = r.out.stride(1);
  p.o_row_stride = blas_row_stride(r.out);
  p.lse = const_cast<float*>(r.lse.const_data_ptr<float>());
  return r;
}

Grads allocate_grads(AttentionBwdParams& p, const at::Tensor& q, int64_t dq_partials, bool zeroed,
                     FinalGrads final) {
  const auto acc = q.options().dtype(at::toOpMathType(q.scalar_type()));
  const int64_t B = p.batch, H = p.heads, D = p.head_dim, Dv = p.head_dim_v;
  TORCH_INTERNAL_ASSERT(!final.dq || dq_partials == 1, "a final dq is one partial");
  TORCH_INTERNAL_ASSERT(!final.dkv || H == p.kv_heads, "a final dk / dv has no group to sum");
  const auto make = [&](at::IntArrayRef shape, bool is_final) {
    const auto opts = is_final ? q.options() : acc;
    return zeroed ? at::zeros(shape, opts) : at::empty(shape, opts);
  };
  Grads g;
  g.final = final;
  if (p.varlen()) {
    g.dq = final.dq ? make({p.total_q, H, D}, true) : make({dq_partials, p.total_q, H, D}, false);
    g.dk = make({p.total_k, H, D}, final.dkv);
    g.dv = make({p.total_k, H, Dv}, final.dkv);
  } else {
    g.dq = final.dq ? make({B, H, p.seqlen_q, D}, true)
                    : make({dq_partials, B, H, p.seqlen_q, D}, false);
    g.dk = make({B, H, p.seqlen_k, D}, final.dkv);
    g.dv = make({B, H, p.seqlen_k, Dv}, final.dkv);
  }
  p.dq = g.dq.data_ptr();
  p.dk = g.dk.data_ptr();
  p.dv = g.dv.data_ptr();
  if (p.sinks != nullptr) {
    g.dsinks = at::zeros({H}, acc);
    p.dsinks = g.dsinks.data_ptr();
  }
  return g;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> finish_grads(
    const AttentionBwdParams& p, Grads g, at::ScalarType dtype,
    const std::optional<at::Tensor>& sinks) {
  at::Tensor dq = g.final.dq ? g.dq : g.dq.size(0) == 1 ? g.dq.squeeze(0) : g.dq.sum(0);
  at::Tensor dk = g.dk, dv = g.dv;
  const int64_t H = p.heads, Hkv = p.kv_heads, D = p.head_dim, Dv = p.head_dim_v;
  if (H != Hkv) {      // (never final: allocate_grads)
    if (p.varlen()) {  // (total_k, H, *) -> (total_k, Hkv, *)
      const int64_t T = p.total_k;
      dk = Hkv == 0 ? dk.new_zeros({T, 0, D}) : dk.view({T, Hkv, H / Hkv, D}).sum(2);
      dv = Hkv == 0 ? dv.new_zeros({T, 0, Dv}) : dv.view({T, Hkv, H / Hkv, Dv}).sum(2);
    } else {
      const int64_t B = p.batch, Sk = p.seqlen_k;
      dk = Hkv == 0 ? dk.new_zeros({B, 0, Sk, D}) : dk.view({B, Hkv, H / Hkv, Sk, D}).sum(2);
      dv = Hkv == 0 ? dv.new_zeros({B, 0, Sk, Dv}) : dv.view({B, Hkv, H / Hkv, Sk, Dv}).sum(2);
    }
  }
  const bool has_sinks = sinks.has_value() && sinks->defined();
  at::Tensor dsinks = has_sinks ? g.dsinks.to(sinks->scalar_type())
                                : at::empty({0}, dq.options().dtype(at::kFloat));
  return {dq.to(dtype), dk.to(dtype), dv.to(dtype), dsinks};
}

}  // namespace attn_ext
