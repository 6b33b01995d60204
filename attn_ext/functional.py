"""The public attention functions: thin wrappers that adapt arguments and shapes
(views only) and call the registered operators."""

from typing import Optional, Tuple

import torch

from ._ops import ops as _ops

# Seeds are drawn below 2**63 so they fit the int64 rng_state tensor.
_SEED_BOUND = 2**63 - 1


def _rng_state(dropout_p: float, generator: Optional[torch.Generator]) -> Optional[torch.Tensor]:
    """(seed, offset) for the dropout mask, drawn from `generator` (or the default CPU
    generator); a fresh seed per call, offset 0."""
    if dropout_p == 0.0:
        return None
    seed = torch.randint(0, _SEED_BOUND, (1,), generator=generator, dtype=torch.int64)
    return torch.cat([seed, seed.new_zeros(1)])


def _as_4d(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        return x
    if x.dim() == 3:
        return x.unsqueeze(1)
    raise ValueError(
        f"attn_ext: {name} must be 3-D (B, S, D) or 4-D (B, H, S, D), got {x.dim()}-D "
        f"{tuple(x.shape)}"
    )


def _mask_as_4d(mask: Optional[torch.Tensor], three_d: bool) -> Optional[torch.Tensor]:
    # A 3-D call's mask broadcasts against (B, Sq, Sk): give it the head axis.
    if mask is None or not three_d:
        return mask
    return mask.unsqueeze(-3) if mask.dim() == 3 else mask


def _window(window_size) -> Tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(
            f"attn_ext: window_size must be a pair (left, right), got {window_size!r}"
        ) from None
    return int(left), int(right)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size=(-1, -1),
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    return_lse: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """Softmax attention ``softmax(scale * q k^T + mask) v`` without materializing the scores.

    q: (B, H, Sq, D) or (B, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv), H % Hkv == 0
    (query head h reads key/value head h // (H // Hkv)). ``causal`` and ``window_size`` are
    bottom-right aligned: query i sits at key position i + Sk - Sq and sees keys in
    [i + Sk - Sq - left, i + Sk - Sq + right] (-1 = unbounded; causal sets right = 0).
    ``attn_mask`` is bool (True = keep) or floating (added to the scores), broadcastable to
    (B, H, Sq, Sk). A row that sees no key returns zeros and lse = -inf. Dropout applies to
    the probabilities with 1/(1-p) rescaling; its mask is regenerated in the backward.

    Score modifiers, applied to the scaled scores in this order before the masks:
    ``softcap`` > 0 caps them as ``softcap * tanh(s / softcap)`` (Gemma 2); ``alibi_slopes``
    (H,) or (B, H) adds ``-slope * |i + Sk - Sq - j|`` (ALiBi, as FlashAttention); ``sinks``
    (H,) adds one logit per head to every row's softmax denominator with no value (attention
    sinks, gpt-oss), differentiable, and counted in lse (an empty row then has lse = sink;
    a ``+inf`` sink takes all the probability: out 0 and lse ``+inf`` for its head, the limit,
    where the eager formula gives NaN). ``alibi_slopes`` and ``sinks`` of another float dtype
    are read as float32; ``alibi_slopes`` takes no gradient (requires_grad raises).

    Returns ``out`` (B, H, Sq, Dv) in q's dtype, or ``(out, lse)`` with lse float32 (B, H, Sq),
    the natural-log log-sum-exp of the scaled, modified, masked scores.
    """
    three_d = q.dim() == 3
    q4, k4, v4 = _as_4d("q", q), _as_4d("k", k), _as_4d("v", v)
    left, right = _window(window_size)
    out, lse = _ops.attention(
        q4,
        k4,
        v4,
        attn_mask=_mask_as_4d(attn_mask, three_d),
        rng_state=_rng_state(dropout_p, generator),
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        dropout_p=dropout_p,
        softcap=softcap,
    )
    if three_d:
        out, lse = out.squeeze(1), lse.squeeze(1)
    return (out, lse) if return_lse else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size=(-1, -1),
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    block_table: Optional[torch.Tensor] = None,
):
    """:func:`attention` over a batch of sequences of different lengths, packed along one
    token axis (FlashAttention's varlen layout): no work and no memory for padding.

    q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) (any strides with the last
    dimension contiguous); ``cu_seqlens_q`` / ``cu_seqlens_k`` (B + 1,) int32 (int64 is
    converted) on q's device: sequence b owns tokens ``[cu[b], cu[b + 1])``, empty sequences
    allowed. ``max_seqlen_q`` / ``max_seqlen_k`` bound the lengths (Python ints, so that no
    device value is read; checked on the CPU). ``causal`` and ``window_size`` are bottom-right
    aligned within each sequence; ``alibi_slopes`` may be (B, H). Dropout streams are keyed
    by (head, token), so they differ from a padded call's.

    With ``block_table`` (B, max_pages) int32, k / v are pages (num_pages, page_size, Hkv, D /
    Dv), FlashAttention's paged layout (any strides with the last dimension contiguous), and
    key t of sequence b is row ``t % page_size`` of page ``block_table[b, t // page_size]``;
    ``cu_seqlens_k`` counts each sequence's keys. The pages are read where they lie (chunked
    prefill against a paged cache, with no gathered copy). CPU and inference only: CUDA and
    gradients raise (``attn_ext.flash_attn.flash_attn_varlen_func`` gathers the pages there).

    Returns ``out`` (total_q, H, Dv), or ``(out, lse)`` with lse float32 (H, total_q).
    """
    left, right = _window(window_size)
    out, lse = _ops.attention_varlen(
        q,
        k,
        v,
        _int32(cu_seqlens_q),
        _int32(cu_seqlens_k),
        rng_state=_rng_state(dropout_p, generator),
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        block_table=block_table,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        dropout_p=dropout_p,
        softcap=softcap,
    )
    return (out, lse) if return_lse else out


def _int32(cu: torch.Tensor) -> torch.Tensor:
    return cu if cu.dtype == torch.int32 else cu.to(torch.int32)


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Same arguments and semantics: (N, ..., L, E) inputs, ``is_causal`` aligned top-left,
    bool mask = keep, float mask = additive, ``enable_gqa`` for grouped key/value heads.
    Like torch 2.13 on the CPU, ``attn_mask`` together with ``is_causal`` applies both.
    One difference: a query row that can see no key returns zeros here (torch returns NaN).
    """
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise ValueError(
            "attn_ext.scaled_dot_product_attention: query, key and value must be at least 2-D"
        )
    batch_shape = query.shape[:-2]
    q, k, v = (_sdpa_4d(x) for x in (query, key, value))
    if not enable_gqa and q.size(1) != k.size(1) and k.size(1) != 1:
        raise RuntimeError(
            f"attn_ext.scaled_dot_product_attention: query heads ({q.size(1)}) differ from key "
            "heads "
            f"({k.size(1)}); pass enable_gqa=True for grouped-query attention"
        )
    if k.size(0) != q.size(0) and k.size(0) == 1:  # torch broadcasts a batch of one
        k, v = k.expand(q.size(0), *k.shape[1:]), v.expand(q.size(0), *v.shape[1:])
    mask = attn_mask
    if mask is not None and query.dim() > 4:
        mask = _sdpa_mask_4d(mask, batch_shape, query.size(-2), key.size(-2))
    out, _ = _ops.attention(
        q,
        k,
        v,
        attn_mask=mask,
        rng_state=_rng_state(dropout_p, None),
        scale=scale,
        causal=is_causal,
        key_offset=0 if is_causal else None,
        dropout_p=dropout_p,
    )
    return out.reshape(*batch_shape, out.size(-2), out.size(-1))


def _sdpa_4d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        return x
    if x.dim() < 4:
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    return x.flatten(0, x.dim() - 4)


def _sdpa_mask_4d(mask: torch.Tensor, batch_shape, sq: int, sk: int) -> torch.Tensor:
    """The mask of a >4-D call, whose leading query dims were flattened into one batch axis:
    broadcast to the full (*batch, Sq, Sk) and flattened the same way."""
    return mask.expand(*batch_shape, sq, sk).flatten(0, len(batch_shape) - 2)


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size=(-1, -1),
    attn_mask: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The attention probabilities ``softmax(scale * q k^T + mask)``, (B, H, Sq, Sk) (or
    (B, Sq, Sk) for 3-D inputs), with :func:`attention`'s masking semantics and score
    modifiers (``softcap``, ``alibi_slopes``; a sink joins each row's denominator, so the row
    sums to one less its share). The one op that materializes the score matrix; fully masked
    rows are all zero. Differentiable in q, k (through softcap's tanh) and ``sinks``;
    ``alibi_slopes`` takes no gradient (requires_grad raises)."""
    three_d = q.dim() == 3
    q4, k4 = _as_4d("q", q), _as_4d("k", k)
    left, right = _window(window_size)
    w = _ops.attention_weights(
        q4,
        k4,
        attn_mask=_mask_as_4d(attn_mask, three_d),
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=softcap,
    )
    return w.squeeze(1) if three_d else w


def attention_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size=(-1, -1),
    attn_mask: Optional[torch.Tensor] = None,
    mean_heads: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The probabilities of the :func:`attention` call that returned ``lse`` (same q, k, scale,
    masks and score modifiers): ``exp(scores - lse)``, (B, H, Sq, Sk) (or (B, Sq, Sk) for 3-D
    inputs) in q's dtype, zero where masked and in rows that saw no key. With ``sinks`` in
    that call the rows sum to one less the sink's share (lse counts it; float64 recomputes lse
    in float64, as attention's backward does, and reads ``sinks`` for it). Differentiated as
    the softmax of the scores and the sink, in q, k and ``sinks``; lse is taken as theirs and
    takes no gradient; ``alibi_slopes`` takes none (requires_grad raises).
    ``mean_heads=True`` returns their mean over heads, (B, Sq, Sk), without forming the
    per-head matrices (``average_attn_weights`` of torch's ``MultiheadAttention``)."""
    three_d = q.dim() == 3
    q4, k4 = _as_4d("q", q), _as_4d("k", k)
    lse3 = lse.unsqueeze(1) if three_d and lse.dim() == 2 else lse
    left, right = _window(window_size)
    w = _ops.attention_probabilities(
        q4,
        k4,
        lse3,
        attn_mask=_mask_as_4d(attn_mask, three_d),
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        mean_heads=mean_heads,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        softcap=softcap,
    )
    return w.squeeze(1) if three_d and not mean_heads else w


def attention_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size=(-1, -1),
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    mean_heads: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, weights)``: :func:`attention`'s output and the probabilities it was formed with,
    (B, H, Sq, Sk) in q's dtype, or with ``mean_heads=True`` their mean over heads (B, Sq, Sk)
    (``need_weights=True`` and ``average_attn_weights`` of torch's ``MultiheadAttention``).
    With dropout, the weights are the dropped and rescaled ones that ``out`` averaged, as torch
    returns them (the same mask, from the same random state). The output comes from the flash
    kernels and the weights from its lse in one more pass over the scores (the mean without
    forming the per-head matrices), so when only ``out`` takes a gradient the backward is
    :func:`attention`'s; a gradient of the weights adds the softmax backward of
    :func:`attention_weights`. The score modifiers are :func:`attention`'s; with ``sinks`` the
    weights' rows sum to one less the sink's share."""
    three_d = q.dim() == 3
    q4, k4, v4 = _as_4d("q", q), _as_4d("k", k), _as_4d("v", v)
    mask = _mask_as_4d(attn_mask, three_d)
    left, right = _window(window_size)
    state = _rng_state(dropout_p, generator)
    band = dict(scale=scale, causal=causal, window_left=left, window_right=right)
    out, lse = _ops.attention(
        q4,
        k4,
        v4,
        attn_mask=mask,
        rng_state=state,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        dropout_p=dropout_p,
        softcap=softcap,
        **band,
    )
    w = _ops.attention_probabilities(
        q4,
        k4,
        lse,
        mask,
        state,
        alibi_slopes,
        sinks,
        dropout_p=dropout_p,
        mean_heads=mean_heads,
        softcap=softcap,
        **band,
    )
    if three_d:
        out = out.squeeze(1)
        w = w if mean_heads else w.squeeze(1)
    return out, w


def dropout_keep_mask(
    batch: int,
    heads: int,
    sq: int,
    sk: int,
    dropout_p: float,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """The keep-mask (True = kept) that ``attention(..., dropout_p=dropout_p, generator=g)``
    applies when called with the same generator state; shape (batch, heads, sq, sk)."""
    state = _rng_state(dropout_p, generator)
    if state is None:
        return torch.ones((batch, heads, sq, sk), dtype=torch.bool)
    return _ops.dropout_mask(state, batch, heads, sq, sk, dropout_p)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets into the result over their union.

    ``out_*`` (..., Dv) with ``lse_*`` of shape ``out.shape[:-1]`` (float32; float64 allowed
    with float64 outs), e.g. ``attention(..., return_lse=True)``'s outputs for two halves of
    the keys. Returns ``out = w_a out_a + w_b out_b`` and ``lse = logaddexp(lse_a, lse_b)``
    with ``w_x = exp(lse_x - lse)``, weights and sums in fp32 (fp64 for fp64). A state with
    ``lse = -inf`` saw no key and contributes nothing (its out is not read); two such states
    give out 0 and lse -inf, never NaN. Differentiable in all four inputs.
    (FlashInfer's ``merge_state``.)
    """
    return _ops.merge_attention_states(out_a, lse_a, out_b, lse_b)


def merge_attention_states_(
    out: torch.Tensor, lse: torch.Tensor, out_other: torch.Tensor, lse_other: torch.Tensor
) -> None:
    """In-place :func:`merge_attention_states`: ``out`` / ``lse`` absorb ``out_other`` /
    ``lse_other``. ``out`` may be a float32 accumulator for bfloat16 / float16 ``out_other``
    (so that many partial results round once, at the end); start an accumulator with
    ``lse = -inf`` (then ``out`` is never read: ``torch.empty`` will do). Not differentiable
    (FlashInfer's ``merge_state_in_place``)."""
    _ops.merge_attention_states_(out, lse, out_other, lse_other)
