"""Fake (meta) kernels of the C++ operators of attn_ext._C: they only describe output shapes.

Autograd is registered in C++ (csrc/<family>/autograd.cpp, csrc/common/autograd.h says why):
each backward calls a registered backward operator, so these fakes serve it too.
"""

import torch

_ops = torch.ops.attn_ext


@torch.library.register_fake("attn_ext::attention")
def _attention_fake(q, k, v, attn_mask=None, rng_state=None, alibi_slopes=None, sinks=None, **kw):
    B, H, Sq, _ = q.shape
    out = q.new_empty((B, H, Sq, v.size(3)))
    lse = q.new_empty((B, H, Sq), dtype=torch.float32)
    return out, lse


def _grad_sinks_fake(q, sinks):
    return q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)


@torch.library.register_fake("attn_ext::attention_backward")
def _attention_backward_fake(grad_out, q, k, v, out, lse, *, sinks=None, **kw):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        _grad_sinks_fake(q, sinks),
    )


@torch.library.register_fake("attn_ext::attention_varlen")
def _attention_varlen_fake(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    rng_state=None,
    alibi_slopes=None,
    sinks=None,
    block_table=None,
    **kw,
):
    total_q, H, _ = q.shape
    out = q.new_empty((total_q, H, v.size(-1)))  # v: (total_k, Hkv, Dv) or pages
    lse = q.new_empty((H, total_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("attn_ext::attention_varlen_backward")
def _attention_varlen_backward_fake(
    grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, sinks=None, **kw
):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        _grad_sinks_fake(q, sinks),
    )


@torch.library.register_fake("attn_ext::attention_weights")
def _attention_weights_fake(q, k, attn_mask=None, alibi_slopes=None, sinks=None, **kw):
    return q.new_empty((q.size(0), q.size(1), q.size(2), k.size(2)))


@torch.library.register_fake("attn_ext::attention_weights_backward")
def _attention_weights_backward_fake(grad_weights, weights, q, k, **kw):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake("attn_ext::attention_probabilities")
def _attention_probabilities_fake(
    q,
    k,
    lse,
    attn_mask=None,
    rng_state=None,
    alibi_slopes=None,
    sinks=None,
    *,
    mean_heads=False,
    **kw,
):
    if mean_heads:
        return q.new_empty((q.size(0), q.size(2), k.size(2)))
    return q.new_empty((q.size(0), q.size(1), q.size(2), k.size(2)))


@torch.library.register_fake("attn_ext::dropout_mask")
def _dropout_mask_fake(rng_state, batch, heads, sq, sk, dropout_p):
    return rng_state.new_empty((batch, heads, sq, sk), dtype=torch.bool)


@torch.library.register_fake("attn_ext::merge_attention_states")
def _merge_fake(out_a, lse_a, out_b, lse_b):
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), torch.empty_like(
        lse_a, memory_format=torch.contiguous_format
    )


@torch.library.register_fake("attn_ext::merge_attention_states_")
def _merge_inplace_fake(out, lse, out_other, lse_other):
    return None


@torch.library.register_fake("attn_ext::merge_attention_states_backward")
def _merge_backward_fake(grad_out, grad_lse, out_a, lse_a, out_b, lse_b):
    dense = torch.contiguous_format
    return (
        torch.empty_like(out_a, memory_format=dense),
        torch.empty_like(lse_a, memory_format=dense),
        torch.empty_like(out_b, memory_format=dense),
        torch.empty_like(lse_b, memory_format=dense),
    )


# ------------------------------------------------------------------------------- decoding ops


@torch.library.register_fake("attn_ext::rope")
def _rope_fake(x, positions=None, **kw):
    return torch.empty_like(x)


@torch.library.register_fake("attn_ext::rope_")
def _rope_inplace_fake(x, positions=None, **kw):
    return None


@torch.library.register_fake("attn_ext::rope_backward")
def _rope_backward_fake(grad_out, positions=None, **kw):
    return torch.empty_like(grad_out)


@torch.library.register_fake("attn_ext::kv_cache_append")
def _kv_cache_append_fake(
    k_cache,
    v_cache,
    cache_seqlens,
    k,
    v,
    new_lengths=None,
    *,
    rope=False,
    rope_base=10000.0,
    rope_interleaved=False,
    rotary_dim=None,
    block_table=None,
    k_scale=1.0,
    v_scale=1.0,
    rope_inv_freq=None,
    rope_attention_scaling=1.0,
):
    return None


@torch.library.register_fake("attn_ext::latent_cache_append")
def _latent_cache_append_fake(
    cache,
    cache_seqlens,
    c_kv,
    k_rope,
    new_lengths=None,
    *,
    rope_base=10000.0,
    rope_interleaved=False,
    block_table=None,
    rope_inv_freq=None,
    rope_attention_scaling=1.0,
    kv_scale=1.0,
):
    return None


@torch.library.register_fake("attn_ext::decode_attention")
def _decode_attention_fake(q, k_cache, v_cache, cache_seqlens, **kw):
    B, H, Sq, _ = q.shape
    return q.new_empty((B, H, Sq, v_cache.size(3))), q.new_empty((B, H, Sq), dtype=torch.float32)


# decode_attention is inference only. Without an Autograd registration torch would record a
# node that, in a backward, only warns and hands back no gradient; a fallthrough instead makes
# the result a plain tensor (requires_grad False), as for any non-differentiable op.
_DECODE_LIB = torch.library.Library("attn_ext", "IMPL")
_DECODE_LIB.impl("decode_attention", torch.library.fallthrough_kernel, "Autograd")


def _state_dtype(q):
    # The state accumulates in float32, or float64 for float64 inputs.
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.register_fake("attn_ext::linear_attention")
def _linear_attention_fake(
    q,
    k,
    v,
    initial_state_kv=None,
    initial_state_k=None,
    *,
    causal=False,
    eps=1e-6,
    feature_map="elu+1",
):
    B, H, Sq, D = q.shape
    out = q.new_empty((B, H, Sq, v.size(3)))
    state_kv = q.new_empty((B, H, D, v.size(3)), dtype=_state_dtype(q))
    state_k = q.new_empty((B, H, D), dtype=_state_dtype(q))
    return out, state_kv, state_k


@torch.library.register_fake("attn_ext::linear_attention_backward")
def _linear_attention_backward_fake(
    grad_out,
    q,
    k,
    v,
    initial_state_kv=None,
    initial_state_k=None,
    grad_state_kv=None,
    grad_state_k=None,
    *,
    causal=False,
    eps=1e-6,
    feature_map="elu+1",
):
    B, H, _, D = q.shape
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        q.new_empty((B, H, D, v.size(3)), dtype=_state_dtype(q)),
        q.new_empty((B, H, D), dtype=_state_dtype(q)),
    )


# ------------------------------------------------------------------------- spatial attention


def _channels_last(x):
    # The kernels' layout rule (csrc/spatial/spatial_inputs.cpp): dense channels-last and not
    # also dense NCHW; everything else is (or is copied to) NCHW.
    return (not x.is_contiguous()) and x.is_contiguous(memory_format=torch.channels_last)


def _map_format(channels_last):
    return torch.channels_last if channels_last else torch.contiguous_format


@torch.library.register_fake("attn_ext::channel_pool")
def _channel_pool_fake(x):
    N, _, H, W = x.shape
    # pooled is channels-last whatever x's layout (the convolution's fastest input)
    pooled = torch.empty(
        (N, 2, H, W), dtype=x.dtype, device=x.device, memory_format=torch.channels_last
    )
    return pooled, x.new_empty((N, 1, H, W), dtype=torch.int32)


@torch.library.register_fake("attn_ext::channel_pool_backward")
def _channel_pool_backward_fake(grad_pooled, argmax, channels, *, channels_last=False):
    N, _, H, W = grad_pooled.shape
    return grad_pooled.new_empty((N, channels, H, W)).contiguous(
        memory_format=_map_format(channels_last)
    )


@torch.library.register_fake("attn_ext::channel_pool_backward_accumulate_")
def _channel_pool_backward_accumulate_fake(grad_x, grad_pooled, argmax):
    return None


@torch.library.register_fake("attn_ext::spatial_gate")
def _spatial_gate_fake(x, gate):
    return x.new_empty(x.shape).contiguous(memory_format=_map_format(_channels_last(x)))


@torch.library.register_fake("attn_ext::spatial_gate_backward")
def _spatial_gate_backward_fake(grad_out, x, gate):
    N, _, H, W = x.shape
    return (
        x.new_empty(x.shape).contiguous(memory_format=_map_format(_channels_last(x))),
        x.new_empty((N, 1, H, W), dtype=gate.dtype),
    )


# ------------------------------------------------------------------- tensor product attention


@torch.library.register_fake("attn_ext::tpa_expand")
def _tpa_expand_fake(
    a,
    b,
    positions=None,
    *,
    scale=1.0,
    rope=False,
    rope_base=10000.0,
    rope_interleaved=False,
    rotary_dim=None,
):
    B, S, _, H = a.shape
    return a.new_empty((B, S, H, b.size(3)))


@torch.library.register_fake("attn_ext::tpa_expand_backward")
def _tpa_expand_backward_fake(
    grad_out,
    a,
    b,
    positions=None,
    *,
    scale=1.0,
    rope=False,
    rope_base=10000.0,
    rope_interleaved=False,
    rotary_dim=None,
):
    return a.new_empty(a.shape), b.new_empty(b.shape)


@torch.library.register_fake("attn_ext::tpa_decode_attention")
def _tpa_decode_fake(
    q, a_k, b_k, a_v, b_v, cache_seqlens, *, scale=None, k_scale=None, v_scale=None
):
    B, H, S, D = q.shape
    return q.new_empty((B, H, S, D)), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.register_fake("attn_ext::tpa_decode_attention_backward")
def _tpa_decode_backward_fake(
    grad_out,
    grad_lse,
    q,
    a_k,
    b_k,
    a_v,
    b_v,
    cache_seqlens,
    *,
    scale=None,
    k_scale=None,
    v_scale=None,
):
    return tuple(t.new_empty(t.shape) for t in (q, a_k, b_k, a_v, b_v))
