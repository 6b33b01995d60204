#pragma once
// Validation at the boundary of the decoding ops (rope, kv_cache_append, decode_attention)
// and construction of their parameter structs. Messages name the argument, the expected
// and the actual value; nothing is written before every check has passed.
#include <optional>
#include <ATen/core/Tensor.h>
#include "attention/inputs.h"
#include "decoding/decode_params.h"

namespace attn_ext {

// A scaled RoPE variant, as Hugging Face's rope_type functions give it (linear, dynamic NTK,
// YaRN, LongRoPE, Llama 3: `inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[type](config)`):
// the pairs' frequencies, (rotary_dim / 2,) floating on the op's device, used instead of
// base's, and the factor cos and sin are multiplied by.
struct RopeScaling {
  std::optional<at::Tensor> inv_freq;
  double attention_scaling = 1.0;
};

struct RopeOptions {
  std::optional<at::Tensor> positions;
  int64_t offset = 0;
  double base = 10000.0;
  bool interleaved = false;
  std::optional<int64_t> rotary_dim;
  RopeScaling scaling;
};

// Checks the RoPE options against a head dim and returns the policy.
// A floating 4-D tensor (float32, float64, bfloat16 or float16); `dims` names its axes.
void check_float_4d(const char* op, const char* name, const at::Tensor& t, const char* dims);

// RoPE positions of shape (S,) (shared by the batch) or (B, S), int32 / int64 on the device
// of `like`; returns them as contiguous int64 and sets the batch stride (0 when shared).
at::Tensor prepare_positions(const char* op, const at::Tensor& pos, const char* like_name,
                             const at::Tensor& like, int64_t batch, int64_t seqlen,
                             int64_t* batch_stride);

RopePolicy make_rope_policy(const char* op, int64_t head_dim, double base, bool interleaved,
                            std::optional<int64_t> rotary_dim);
// The same with a scaled variant: inv_freq checked against the pairs and `like`'s device and
// returned in *freqs as contiguous float32 (the policy points into it); attention_scaling
// positive and finite. `prefix` names the arguments in messages ("" or "rope_").
RopePolicy make_rope_policy(const char* op, int64_t head_dim, double base, bool interleaved,
                            std::optional<int64_t> rotary_dim, const RopeScaling& scaling,
                            const at::Tensor& like, const char* prefix, at::Tensor* freqs);
// Whether a call asks for a scaled variant (a frequency table or attention_scaling != 1).
bool rope_scaled(const RopeScaling& scaling);

struct PreparedRope {
  at::Tensor positions;  // int64, (1 or B, S) rows contiguous, or undefined
  at::Tensor inv_freq;   // float32 frequencies the policy points into, or undefined
  RopeParams params;     // everything but out
};
PreparedRope prepare_rope(const char* op, const at::Tensor& x, const RopeOptions& o);
void set_rope_output(RopeParams& p, const at::Tensor& out);

// Per-sequence lengths as int64 on their device, validated against (B,). With check_values
// (CPU) every value must lie in [0, hi]; a GPU op cannot read them without synchronizing,
// so its kernels clamp instead.
at::Tensor int64_lengths(const char* op, const char* name, const at::Tensor& lengths, int64_t batch,
                         const at::Tensor& like, int64_t hi, bool check_values);

struct PreparedAppend {
  at::Tensor lengths, appended;  // int64 copies on the cache's device
  at::Tensor inv_freq;           // the RoPE frequencies the policy points into, or undefined
  KVAppendParams params;
};
// The names error messages give the append's four tensors (the latent append passes its
// own: its "keys" are k_rope, its "values" c_kv, both caches column views of one buffer).
struct AppendNames {
  const char* k_cache = "k_cache";
  const char* v_cache = "v_cache";
  const char* k = "k";
  const char* v = "v";
};
// A float8 cache's scales (common/float8.h): the cache holds K / k and V / v.
struct CacheScales {
  double k = 1.0, v = 1.0;
};
PreparedAppend prepare_kv_append(const char* op, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                 const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& new_lengths, bool rope,
                                 double rope_base, bool rope_interleaved,
                                 std::optional<int64_t> rotary_dim,
                                 const std::optional<at::Tensor>& block_table, bool check_values,
                                 CacheScales scales = {}, const AppendNames& names = {},
                                 const RopeScaling& rope_scaling = {});

// The latent cache of MLA: one buffer (B, Hkv, L, Dc + Dr) whose rows are [c_kv, k_rope]
// (float8: [c_kv, k_rope] / kv_scale, the one scale of keys and values alike)
// (paged: (num_pages, Hkv, page_size, Dc + Dr) through block_table); the append writes c_kv
// (B, Hkv, S_new, Dc) and k_rope (B, Hkv, S_new, Dr) rotated by RoPE at the rows' positions
// (argument checks as kv_cache_append's, k = k_rope, v = c_kv).
PreparedAppend prepare_latent_append(
    const char* op, const at::Tensor& cache, const at::Tensor& cache_seqlens,
    const at::Tensor& c_kv, const at::Tensor& k_rope, const std::optional<at::Tensor>& new_lengths,
    double rope_base, bool rope_interleaved, const std::optional<at::Tensor>& block_table,
    bool check_values, const RopeScaling& rope_scaling = {}, double kv_scale = 1.0);

struct PreparedDecode {
  at::Tensor q, k_cache, v_cache, lengths, batch_idx, leftpad;
  PreparedInputs attention;  // keeps the modifiers' converted tensors alive
  DecodeParams params;       // everything but the outputs
};
struct DecodeOptions {
  std::optional<double> scale;
  bool causal = true;
  int64_t window_left = -1, window_right = -1, num_splits = 0;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes, sinks, cache_batch_idx, cache_leftpad, block_table;
  double k_scale = 1.0, v_scale = 1.0;  // a float8 cache's scales (common/float8.h)
};
PreparedDecode prepare_decode(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                              const DecodeOptions& o, bool check_values);

}  // namespace attn_ext
