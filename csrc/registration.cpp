// Every operator attn_ext offers, in one place. Kernels register their implementations in
// their own files (TORCH_LIBRARY_IMPL); fake kernels in Python,
// autograd in each family's autograd.cpp (common/autograd.h says why).
//
// Shape legend:
//   B batch, H query heads, Hkv key/value heads (H % Hkv == 0; query head h reads
//   key/value head h // (H / Hkv)), Sq query length, Sk key length, D query/key head dim,
//   Dv value head dim. q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); any strides
//   with the last dimension contiguous.
//
// Masking: query row i is aligned with key position i + key_offset (default Sk - Sq:
//   bottom-right) and sees keys [i + key_offset - window_left, i + key_offset + window_right],
//   -1 meaning unbounded; causal sets window_right = 0. attn_mask is bool (true = keep) or
//   floating (additive), broadcastable to (B, H, Sq, Sk).
// Score modifiers (attention/score_mod.h), on the scaled scores in this order, before masking:
//   softcap > 0: s = softcap * tanh(s / softcap) (Gemma 2); alibi_slopes (H,) or (B, H):
//   s -= slope[b, h] * |i + key_offset - j|; sinks (H,): a logit per head that joins every
//   row's softmax denominator without a value (gpt-oss); lse includes it. Slopes and sinks
//   are floating (read in the accumulation type); grad_sinks has sinks' shape and dtype, or
//   is an empty float32 tensor without sinks.
// attention_backward also takes the gradient of lse (for callers that differentiate
//   through it, e.g. when merging partial results).
// attention_weights: P = softmax(scores) (B, H, Sq, Sk) in q's dtype, the scores and the
//   softmax those of attention (scale, softcap, ALiBi, band, mask; a sink joins the
//   denominator, so rows sum to 1 less its share), 0 in rows that saw no key.
//   attention_weights_backward: dq, dk of P from grad_weights (dS = P (dP - rowsum(P dP)),
//   through softcap's tanh, whose scores it recomputes); autograd adds the sinks' gradient
//   (-sum over rows of the sink's share times rowsum(P dP)); ALiBi slopes and masks take none.
// attention_probabilities: the probabilities of the attention call that returned lse,
//   P = exp(scores - lse) (B, H, Sq, Sk) in q's dtype, the scores as attention_weights forms
//   them, 0 where masked or where lse is -inf (a row that saw no key); rows sum to 1 less
//   the share of that call's sink (float64 recomputes lse in float64, as attention_backward
//   does, and reads sinks for it; the other dtypes read the sink in lse). dropout_p / rng_state:
//   the probabilities that call kept, scaled by 1 / (1 - dropout_p), 0 where it dropped (its mask:
//   the same rng_state). mean_heads: their mean over heads (B, Sq, Sk) instead, without the
//   per-head matrices. Differentiated as the softmax of the scores (attention_weights_backward on
//   the per-head P, through the dropout mask): lse is taken as theirs and takes no gradient.
// Merging attention states (split-KV parts, ring-attention blocks: partial results over
//   disjoint key sets): out_* (..., Dv), any floating dtype, with lse_* = out's shape without
//   Dv, float32 (or float64 with float64 outs). merge_attention_states returns
//   out = w_a out_a + w_b out_b and lse = log(e^lse_a + e^lse_b), w_x = e^(lse_x - lse),
//   weights and sums in fp32 (fp64 for fp64); a state with lse -inf is empty (its out is not
//   read); two empty states give out 0, lse -inf. merge_attention_states_ accumulates
//   out_other / lse_other into out / lse in place (out: out_other's dtype, or a float32
//   accumulator for bfloat16 / float16). merge_attention_states_backward takes the gradients
//   of the merged out and (optionally) lse.
// attention_varlen: FlashAttention's varlen layout. q (total_q, H, D), k (total_k, Hkv, D),
//   v (total_k, Hkv, Dv); cu_seqlens_q / cu_seqlens_k (B + 1,) int32 on q's device, sequence
//   b owning tokens [cu[b], cu[b + 1]) (empty sequences allowed); max_seqlen_q / _k bound the
//   lengths (the CUDA grid's size; the CPU checks them). causal / window are bottom-right per
//   sequence; out (total_q, H, Dv), lse (H, total_q) float32. No attn_mask or key_offset.
//   block_table (B, max_pages) int32 (CPU; FlashAttention's paged varlen): k / v are pages
//   (num_pages, page_size, Hkv, D / Dv) and key t of sequence b (t < its cu_seqlens_k length)
//   is row t % page_size of page block_table[b, t / page_size]; no backward.
// Tensor arguments precede the keyword-only tail (torch.library autograd needs them
//   positional).
// Dropout: rng_state is an int64 CPU tensor (seed, offset); the mask is a pure function
//   of it, so the backward regenerates it.
//
// Decoding:
//   rope rotates x (B, H, S, D): pair i < rotary_dim / 2 (features (i, i + rotary_dim/2) as
//   halves by default, the LLaMA / FlashAttention / FlashInfer layout, or (2i, 2i+1) with
//   interleaved=True) turns by pos * base^(-2i / rotary_dim), the angle in fp32;
//   pos = positions[b, s] (positions (B, S) or (S,), int) or offset + s.
//   rope_backward rotates by the negative angle (the rotation is orthogonal).
//   KV cache: k_cache (B, Hkv, L, D), v_cache (B, Hkv, L, Dv) with capacity L;
//   cache_seqlens (B,) int32/int64 counts each sequence's valid rows. kv_cache_append
//   writes the last n_b = new_lengths[b] (default S_new) of k/v (B, Hkv, S_new, *) at rows
//   [len_b, len_b + n_b) (batched generation pads on the left), optionally rotating keys
//   by RoPE at those positions, then adds n_b to cache_seqlens; if any sequence would
//   overflow L it raises and writes nothing.
//   latent_cache_append (MLA's cache): cache (B, Hkv, L, Dc + Dr) holds rows [c_kv, k_rope];
//   writes c_kv (B, Hkv, S_new, Dc) and k_rope (B, Hkv, S_new, Dr), the latter rotated by
//   RoPE (all Dr features) at the rows' positions, as kv_cache_append does (v = c_kv, k = k_rope);
//   paged (block_table given): cache (num_pages, Hkv, page_size, Dc + Dr), as below; a float8
//   cache holds the rows / kv_scale (one scale: the rows are both keys and values).
//   decode_attention: q (B, H, Sq, D) against the cache; query i of sequence b sits at
//   key position cache_seqlens[b] - Sq + i (bottom-right) and sees keys
//   [max(pos - window_left, leftpad_b), min(pos + window_right, len_b - 1)] (causal sets
//   window_right = 0); num_splits = 0 picks the split-KV factor. softcap / alibi_slopes /
//   sinks as for attention (ALiBi distances from pos). cache_batch_idx (B,) int32: sequence b
//   reads cache row cache_batch_idx[b]; cache_leftpad (B,) int32: sequence b's keys start at
//   cache_leftpad[b] (FlashAttention's with_kvcache arguments).
//   Float8 caches: k_cache / v_cache of float8_e4m3fn or float8_e5m2 (both the same) hold
//   K / k_scale and V / v_scale; kv_cache_append quantizes k / v (any floating dtype) with
//   saturation at the type's largest finite value, decode_attention (q of any floating dtype)
//   attends to k_scale * k_cache and v_scale * v_cache. Scales other than 1 need a float8
//   cache. CPU only so far.
//   Paged cache (block_table given to kv_cache_append / decode_attention): k_cache
//   (num_pages, Hkv, page_size, D), v_cache (num_pages, Hkv, page_size, Dv) (vLLM /
//   FlashAttention's (num_pages, page_size, Hkv, *) .transpose(1, 2) is read in place);
//   block_table (B, max_pages) int32 on the cache's device, rows contiguous: row t of sequence
//   b is row t % page_size of page block_table[b, t // page_size], capacity max_pages *
//   page_size replaces L; sequences may share pages. Not with cache_batch_idx. The CPU ops
//   check every entry they read or write (in [0, num_pages)) before touching the cache.
//
// Spatial attention (CBAM): x (N, C, H, W), dense NCHW or channels-last (read in place; other
//   strides are copied to NCHW), outputs shaped like x in x's layout. channel_pool reads x once
//   and returns pooled (N, 2, H, W) = [mean over channels; max over channels], ready for the
//   7x7 convolution (always channels-last, the layout oneDNN / cuDNN convolve fastest), and
//   argmax (N, 1, H, W) int32: the first maximal channel (a NaN counts as maximal), where the
//   max's gradient goes. channel_pool_backward_accumulate_ adds the pooling's gradient to a
//   dense grad_x in place (the gate's gradient of x, so the two need one pass, not a write and
//   a sum). spatial_gate returns x * sigmoid(gate) with gate (N, 1, H, W) broadcast over
//   channels, gate in x's dtype or float32 (for bf16 / fp16 x); its backward returns grad_x and
//   grad_gate = sigmoid'(gate) * sum_c grad_out * x in gate's dtype. Accumulation in fp32 (fp64
//   for fp64).
// Tensor Product Attention:
//   tpa_expand forms one of Q, K, V from its per-token factors: a (B, S, R, H) (head side),
//   b (B, S, R, D) (feature side), out (B, S, H, D) contiguous (out.transpose(1, 2) is the
//   (B, H, S, D) input of attention, read in place) with
//   out[b, s, h, :] = scale * sum_r a[b, s, r, h] * RoPE(b[b, s, r, :]), the RoPE (rope=True)
//   at positions[b, s] (positions (B, S) or (S,), int) or s, on the first rotary_dim features.
//   tpa_expand_backward returns the gradients of a and b.
//   tpa_decode_attention: queries q (B, H, S, D) against a factor cache of N tokens, a_k
//   (B, N, R_K, H), b_k (B, N, R_K, D), a_v (B, N, R_V, H), b_v (B, N, R_V, D), without forming
//   keys or values: score(h, i, t) = scale * k_scale * sum_r a_k[t, r, h] (q[h, i] . b_k[t, r]),
//   out[h, i] = sum_t softmax_t(score) * v_scale * sum_r a_v[t, r, h] b_v[t, r]; query i of
//   sequence b sits at cache_seqlens[b] - S + i and sees tokens t <= that position. Defaults:
//   scale 1/sqrt(D), k_scale 1/R_K, v_scale 1/R_V. out (B, H, S, D) in q's dtype, lse
//   (B, H, S) float32. tpa_decode_attention_backward returns the gradients of q, a_k, b_k,
//   a_v, b_v (grad_lse optional).
#include <torch/library.h>

TORCH_LIBRARY(attn_ext, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? rng_state=None, "
      "Tensor? alibi_slopes=None, Tensor? sinks=None, *, float? scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1, SymInt? key_offset=None, float dropout_p=0.0, "
      "float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, *, Tensor? grad_lse=None, Tensor? attn_mask=None, float? scale=None, "
      "bool causal=False, int window_left=-1, int window_right=-1, SymInt? key_offset=None, "
      "float dropout_p=0.0, Tensor? rng_state=None, Tensor? alibi_slopes=None, "
      "Tensor? sinks=None, float softcap=0.0) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)");
  m.def(
      "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, Tensor? rng_state=None, Tensor? alibi_slopes=None, "
      "Tensor? sinks=None, Tensor? block_table=None, *, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, float? scale=None, bool causal=False, int window_left=-1, "
      "int window_right=-1, float dropout_p=0.0, float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, *, Tensor? grad_lse=None, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float? scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1, float dropout_p=0.0, Tensor? rng_state=None, "
      "Tensor? alibi_slopes=None, Tensor? sinks=None, float softcap=0.0) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)");
  m.def(
      "attention_weights(Tensor q, Tensor k, Tensor? attn_mask=None, "
      "Tensor? alibi_slopes=None, Tensor? sinks=None, *, float? scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1, SymInt? key_offset=None, float softcap=0.0) "
      "-> Tensor weights");
  m.def(
      "attention_weights_backward(Tensor grad_weights, Tensor weights, Tensor q, Tensor k, *, "
      "float? scale=None, float softcap=0.0) -> (Tensor grad_q, Tensor grad_k)");
  m.def(
      "attention_probabilities(Tensor q, Tensor k, Tensor lse, Tensor? attn_mask=None, "
      "Tensor? rng_state=None, Tensor? alibi_slopes=None, Tensor? sinks=None, *, "
      "float? scale=None, bool causal=False, int window_left=-1, int window_right=-1, "
      "SymInt? key_offset=None, float dropout_p=0.0, bool mean_heads=False, float softcap=0.0) "
      "-> Tensor weights");
  m.def(
      "merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "merge_attention_states_(Tensor(a!) out, Tensor(b!) lse, Tensor out_other, "
      "Tensor lse_other) -> ()");
  m.def(
      "merge_attention_states_backward(Tensor grad_out, Tensor? grad_lse, Tensor out_a, "
      "Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor grad_out_a, Tensor grad_lse_a, "
      "Tensor grad_out_b, Tensor grad_lse_b)");
  m.def(
      "dropout_mask(Tensor rng_state, SymInt batch, SymInt heads, SymInt sq, SymInt sk, "
      "float dropout_p) -> Tensor keep");

  m.def(
      "rope(Tensor x, Tensor? positions=None, *, SymInt offset=0, float base=10000.0, "
      "bool interleaved=False, SymInt? rotary_dim=None, Tensor? inv_freq=None, "
      "float attention_scaling=1.0) -> Tensor");
  m.def(
      "rope_(Tensor(a!) x, Tensor? positions=None, *, SymInt offset=0, float base=10000.0, "
      "bool interleaved=False, SymInt? rotary_dim=None, Tensor? inv_freq=None, "
      "float attention_scaling=1.0) -> ()");
  m.def(
      "rope_backward(Tensor grad_out, Tensor? positions=None, *, SymInt offset=0, "
      "float base=10000.0, bool interleaved=False, SymInt? rotary_dim=None, "
      "Tensor? inv_freq=None, float attention_scaling=1.0) -> Tensor grad_x");
  m.def(
      "kv_cache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) cache_seqlens, "
      "Tensor k, Tensor v, Tensor? new_lengths=None, *, bool rope=False, "
      "float rope_base=10000.0, bool rope_interleaved=False, SymInt? rotary_dim=None, "
      "Tensor? block_table=None, float k_scale=1.0, float v_scale=1.0, "
      "Tensor? rope_inv_freq=None, float rope_attention_scaling=1.0) -> ()");
  m.def(
      "latent_cache_append(Tensor(a!) cache, Tensor(b!) cache_seqlens, Tensor c_kv, "
      "Tensor k_rope, Tensor? new_lengths=None, *, float rope_base=10000.0, "
      "bool rope_interleaved=False, Tensor? block_table=None, Tensor? rope_inv_freq=None, "
      "float rope_attention_scaling=1.0, float kv_scale=1.0) -> ()");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, *, "
      "float? scale=None, bool causal=True, int window_left=-1, int window_right=-1, "
      "int num_splits=0, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, "
      "Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, Tensor? block_table=None, "
      "float k_scale=1.0, float v_scale=1.0) -> (Tensor out, Tensor lse)");

  m.def(
      "tpa_expand(Tensor a, Tensor b, Tensor? positions=None, *, float scale=1.0, "
      "bool rope=False, float rope_base=10000.0, bool rope_interleaved=False, "
      "SymInt? rotary_dim=None) -> Tensor out");
  m.def(
      "tpa_expand_backward(Tensor grad_out, Tensor a, Tensor b, Tensor? positions=None, *, "
      "float scale=1.0, bool rope=False, float rope_base=10000.0, bool rope_interleaved=False, "
      "SymInt? rotary_dim=None) -> (Tensor grad_a, Tensor grad_b)");
  m.def(
      "tpa_decode_attention(Tensor q, Tensor a_k, Tensor b_k, Tensor a_v, Tensor b_v, "
      "Tensor cache_seqlens, *, float? scale=None, float? k_scale=None, float? v_scale=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "tpa_decode_attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor a_k, "
      "Tensor b_k, Tensor a_v, Tensor b_v, Tensor cache_seqlens, *, float? scale=None, "
      "float? k_scale=None, float? v_scale=None) -> (Tensor grad_q, Tensor grad_a_k, "
      "Tensor grad_b_k, Tensor grad_a_v, Tensor grad_b_v)");

  // Linear attention (out_i = phi(q_i) S_i / (phi(q_i) . z_i + eps)):
  //   q (B, H, Sq, D), k (B, H, Sk, D), v (B, H, Sk, Dv), no grouped heads; causal needs
  //   Sq == Sk (position i sees keys j <= i). State: kv (B, H, D, Dv) = sum phi(k) v^T,
  //   k (B, H, D) = sum phi(k), float32 (float64 for float64 inputs); the initial state (both
  //   or neither) is added to the keys' sums, and the final state (initial + every key) is
  //   returned. feature_map: "elu+1" | "relu" | "identity". The backward also takes the
  //   gradient of the final state and returns that of the initial state.
  m.def(
      "linear_attention(Tensor q, Tensor k, Tensor v, Tensor? initial_state_kv=None, "
      "Tensor? initial_state_k=None, *, bool causal=False, float eps=1e-6, "
      "str feature_map=\"elu+1\") -> (Tensor out, Tensor state_kv, Tensor state_k)");
  m.def(
      "linear_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor? initial_state_kv=None, Tensor? initial_state_k=None, Tensor? grad_state_kv=None, "
      "Tensor? grad_state_k=None, *, bool causal=False, float eps=1e-6, "
      "str feature_map=\"elu+1\") -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
      "Tensor grad_initial_state_kv, Tensor grad_initial_state_k)");

  m.def("channel_pool(Tensor x) -> (Tensor pooled, Tensor argmax)");
  m.def(
      "channel_pool_backward(Tensor grad_pooled, Tensor argmax, SymInt channels, *, "
      "bool channels_last=False) -> Tensor grad_x");
  m.def(
      "channel_pool_backward_accumulate_(Tensor(a!) grad_x, Tensor grad_pooled, Tensor argmax) "
      "-> ()");
  m.def("spatial_gate(Tensor x, Tensor gate) -> Tensor out");
  m.def(
      "spatial_gate_backward(Tensor grad_out, Tensor x, Tensor gate) "
      "-> (Tensor grad_x, Tensor grad_gate)");
}
