"""Fake (meta) kernels and autograd for the C++ operators of attn_ext._C.

Python does no attention math here: the fakes only describe output shapes, and every
backward calls a registered backward operator.
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
    q, k, v, cu_seqlens_q, cu_seqlens_k, rng_state=None, alibi_slopes=None, sinks=None, **kw
):
    total_q, H, _ = q.shape
    out = q.new_empty((total_q, H, v.size(2)))
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
def _attention_weights_fake(
    q,
    k,
    attn_mask=None,
    *,
    scale=None,
    causal=False,
    window_left=-1,
    window_right=-1,
    key_offset=None,
):
    return q.new_empty((q.size(0), q.size(1), q.size(2), k.size(2)))


@torch.library.register_fake("attn_ext::attention_weights_backward")
def _attention_weights_backward_fake(grad_weights, weights, q, k, *, scale=None):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake("attn_ext::attention_probabilities")
def _attention_probabilities_fake(
    q, k, lse, attn_mask=None, rng_state=None, *, mean_heads=False, **kw
):
    if mean_heads:
        return q.new_empty((q.size(0), q.size(2), k.size(2)))
    return q.new_empty((q.size(0), q.size(1), q.size(2), k.size(2)))


@torch.library.register_fake("attn_ext::dropout_mask")
def _dropout_mask_fake(rng_state, batch, heads, sq, sk, dropout_p):
    return rng_state.new_empty((batch, heads, sq, sk), dtype=torch.bool)


def _refuse_slopes_grad(op, alibi_slopes):
    # ALiBi slopes are fixed per head (never trained), and the kernels form no gradient for
    # them: refusing beats returning None, which autograd would read as a zero gradient.
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise NotImplementedError(
            f"{op}: the gradient with respect to alibi_slopes is not supported; "
            "pass alibi_slopes.detach()"
        )


def _attention_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask, rng_state, alibi_slopes, sinks = inputs
    ctx.kw = dict(
        keyword_only_inputs,
        attn_mask=mask,
        rng_state=rng_state,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
    if mask is not None and mask.requires_grad:
        raise NotImplementedError(
            "attn_ext.attention: the gradient with respect to attn_mask is not supported; "
            "pass attn_mask.detach() or compute the bias gradient separately"
        )
    _refuse_slopes_grad("attn_ext.attention", alibi_slopes)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _attention_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks = _ops.attention_backward(
        grad_out, q, k, v, out, lse, grad_lse=grad_lse, **ctx.kw
    )
    return dq, dk, dv, None, None, None, (dsinks if ctx.kw["sinks"] is not None else None)


torch.library.register_autograd(
    "attn_ext::attention", _attention_backward, setup_context=_attention_setup_context
)


def _varlen_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, cu_q, cu_k, rng_state, alibi_slopes, sinks = inputs
    ctx.kw = dict(keyword_only_inputs, rng_state=rng_state, alibi_slopes=alibi_slopes, sinks=sinks)
    _refuse_slopes_grad("attn_ext.attention_varlen", alibi_slopes)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks = _ops.attention_varlen_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, grad_lse=grad_lse, **ctx.kw
    )
    dsinks = dsinks if ctx.kw["sinks"] is not None else None
    return dq, dk, dv, None, None, None, None, dsinks


torch.library.register_autograd(
    "attn_ext::attention_varlen", _varlen_backward, setup_context=_varlen_setup_context
)


def _weights_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, mask = inputs
    ctx.scale = keyword_only_inputs.get("scale")
    if mask is not None and mask.requires_grad:
        raise NotImplementedError(
            "attn_ext.attention_weights: the gradient with respect to attn_mask is not supported"
        )
    ctx.save_for_backward(q, k, output)


def _weights_backward(ctx, grad_weights):
    q, k, weights = ctx.saved_tensors
    dq, dk = _ops.attention_weights_backward(grad_weights, weights, q, k, scale=ctx.scale)
    return dq, dk, None


torch.library.register_autograd(
    "attn_ext::attention_weights", _weights_backward, setup_context=_weights_setup_context
)


def _recomputes(kw):
    """Whether the backward rebuilds the per-head probabilities (the output is their mean over
    heads, or dropped) rather than reading them from the output."""
    return kw.get("mean_heads", False) or kw.get("dropout_p", 0.0) > 0.0


def _probabilities_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, lse, mask, rng_state = inputs
    ctx.kw = dict(keyword_only_inputs)
    if mask is not None and mask.requires_grad:
        raise NotImplementedError(
            "attn_ext.attention_probabilities: the gradient with respect to attn_mask is not "
            "supported"
        )
    # The backward takes the per-head probabilities before dropout: the output itself, or
    # (for a mean over heads, or dropped weights) what recomputes them.
    if _recomputes(ctx.kw):
        ctx.save_for_backward(q, k, lse, mask, rng_state)
    else:
        ctx.save_for_backward(q, k, output)


def _probabilities_backward(ctx, grad_weights):
    # The softmax's backward, as attention_weights has it: lse is the scores' own log-sum-exp,
    # so it takes no gradient (a float32 lse gradient would also cap float64 at ~1e-7).
    kw = dict(ctx.kw)
    mean_heads, p = kw.pop("mean_heads", False), kw.pop("dropout_p", 0.0)
    if _recomputes(ctx.kw):
        q, k, lse, mask, rng_state = ctx.saved_tensors
        weights = _ops.attention_probabilities(q, k, lse, mask, **kw)
        if mean_heads:  # d mean_h P_h / d P_h = 1 / H for every head
            grad_weights = (grad_weights / q.size(1)).unsqueeze(1).expand(weights.shape)
        if p > 0.0:  # the dropped P_h is P_h * keep / (1 - p)
            B, H, Sq, Sk = weights.shape
            keep = _ops.dropout_mask(rng_state, B, H, Sq, Sk, p).to(weights.device)
            grad_weights = grad_weights * keep.to(grad_weights.dtype) * (1.0 / (1.0 - p))
    else:
        q, k, weights = ctx.saved_tensors
    dq, dk = _ops.attention_weights_backward(grad_weights, weights, q, k, scale=kw.get("scale"))
    return dq, dk, None, None, None


torch.library.register_autograd(
    "attn_ext::attention_probabilities",
    _probabilities_backward,
    setup_context=_probabilities_setup_context,
)


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


def _merge_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _merge_backward(ctx, grad_out, grad_lse):
    out_a, lse_a, out_b, lse_b = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out_a)
    return _ops.merge_attention_states_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b)


torch.library.register_autograd(
    "attn_ext::merge_attention_states", _merge_backward, setup_context=_merge_setup_context
)


# ------------------------------------------------------------------------------- decoding ops


@torch.library.register_fake("attn_ext::rope")
def _rope_fake(x, positions=None, *, offset=0, base=10000.0, interleaved=False, rotary_dim=None):
    return torch.empty_like(x)


@torch.library.register_fake("attn_ext::rope_")
def _rope_inplace_fake(
    x, positions=None, *, offset=0, base=10000.0, interleaved=False, rotary_dim=None
):
    return None


@torch.library.register_fake("attn_ext::rope_backward")
def _rope_backward_fake(
    grad_out, positions=None, *, offset=0, base=10000.0, interleaved=False, rotary_dim=None
):
    return torch.empty_like(grad_out)


def _rope_setup_context(ctx, inputs, keyword_only_inputs, output):
    _, positions = inputs
    ctx.positions = positions
    ctx.kw = keyword_only_inputs


def _rope_backward(ctx, grad):
    # RoPE is a rotation: its gradient is the inverse rotation of the incoming gradient.
    return _ops.rope_backward(grad, ctx.positions, **ctx.kw), None


torch.library.register_autograd("attn_ext::rope", _rope_backward, setup_context=_rope_setup_context)


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


def _linear_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.kw = dict(keyword_only_inputs)
    ctx.save_for_backward(*inputs)


def _linear_backward(ctx, grad_out, grad_state_kv, grad_state_k):
    q, k, v, init_kv, init_k = ctx.saved_tensors
    if grad_out is None:
        grad_out = q.new_zeros((*q.shape[:3], v.size(3)))
    # The op takes the final state's gradient as a pair or not at all.
    if (grad_state_kv is None) != (grad_state_k is None):
        B, H, _, D = q.shape
        if grad_state_kv is None:
            grad_state_kv = grad_state_k.new_zeros((B, H, D, v.size(3)))
        else:
            grad_state_k = grad_state_kv.new_zeros((B, H, D))
    dq, dk, dv, d_init_kv, d_init_k = _ops.linear_attention_backward(
        grad_out, q, k, v, init_kv, init_k, grad_state_kv, grad_state_k, **ctx.kw
    )
    if init_kv is None:
        d_init_kv = d_init_k = None
    return dq, dk, dv, d_init_kv, d_init_k


torch.library.register_autograd(
    "attn_ext::linear_attention", _linear_backward, setup_context=_linear_setup_context
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


def _channel_pool_setup_context(ctx, inputs, output):
    (x,) = inputs
    ctx.channels = x.size(1)
    ctx.channels_last = _channels_last(x)
    ctx.save_for_backward(output[1])


def _channel_pool_backward(ctx, grad_pooled, grad_argmax):
    if grad_pooled is None:
        return None
    (argmax,) = ctx.saved_tensors
    return _ops.channel_pool_backward(
        grad_pooled, argmax, ctx.channels, channels_last=ctx.channels_last
    )


torch.library.register_autograd(
    "attn_ext::channel_pool", _channel_pool_backward, setup_context=_channel_pool_setup_context
)


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


def _spatial_gate_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _spatial_gate_backward(ctx, grad_out):
    x, gate = ctx.saved_tensors
    return _ops.spatial_gate_backward(grad_out, x, gate)


torch.library.register_autograd(
    "attn_ext::spatial_gate", _spatial_gate_backward, setup_context=_spatial_gate_setup_context
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


def _tpa_setup_context(ctx, inputs, keyword_only_inputs, output):
    a, b, positions = inputs
    ctx.positions = positions
    ctx.kw = keyword_only_inputs
    ctx.save_for_backward(a, b)


def _tpa_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    grad_a, grad_b = _ops.tpa_expand_backward(grad_out, a, b, ctx.positions, **ctx.kw)
    return grad_a, grad_b, None


torch.library.register_autograd(
    "attn_ext::tpa_expand", _tpa_backward, setup_context=_tpa_setup_context
)


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


def _tpa_decode_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.kw = keyword_only_inputs
    ctx.save_for_backward(*inputs)


def _tpa_decode_backward(ctx, grad_out, grad_lse):
    q, a_k, b_k, a_v, b_v, cache_seqlens = ctx.saved_tensors
    grads = _ops.tpa_decode_attention_backward(
        grad_out, grad_lse, q, a_k, b_k, a_v, b_v, cache_seqlens, **ctx.kw
    )
    return (*grads, None)


torch.library.register_autograd(
    "attn_ext::tpa_decode_attention", _tpa_decode_backward, setup_context=_tpa_decode_setup_context
)
