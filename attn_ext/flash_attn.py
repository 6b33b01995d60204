"""Drop-in for the public functions of FlashAttention 2 (``flash_attn``), on the CPU and CUDA.

Code written against ``flash_attn`` runs unchanged after swapping the import::

    from attn_ext.flash_attn import flash_attn_func, flash_attn_varlen_func

Same names, arguments, defaults, layouts and return conventions as ``flash_attn``
2.x's ``flash_attn_interface``: q/k/v ``(B, S, H, D)`` (varlen: ``(total, H, D)`` with int32
``cu_seqlens``), causal and sliding windows aligned bottom-right, GQA/MQA by fewer key/value
heads, ``softcap``, ``alibi_slopes`` (H,) or (B, H), ``softmax_lse`` ``(B, H, S)`` (varlen:
``(H, total_q)``), gradients through everything but ``flash_attn_with_kvcache``. The inputs are
read in place (the ``(B, S, H, D)`` views are never copied); outputs are contiguous like
FlashAttention's.

Differences from FlashAttention, by design:

- CPU kernels (FlashAttention has none); every dtype torch has (fp32 and fp64 too, not only
  fp16/bf16) and any head dim.
- Dropout draws from attn_ext's own counter-based stream (``attn_ext.dropout_keep_mask``), so
  masks differ from FlashAttention's for the same seed; ``deterministic`` is accepted and has no
  effect (attn_ext's backward is always deterministic).
- ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` like FlashAttention, with
  ``S_dmask`` None unless ``dropout_p > 0`` (as there); then it holds the probabilities (exactly
  scaled) with dropped entries negated, of shape (B, H, Sq, Sk) (FlashAttention pads it), and is
  not available together with ``softcap`` / ``alibi_slopes``.
- ``flash_attn_with_kvcache`` applies ``rotary_cos`` / ``rotary_sin`` with torch element-wise
  ops (in fp32, fp64 for fp64 inputs) before appending; ``block_table`` (paged KV cache) is not
  supported yet.
- On CUDA, the varlen functions, ``softcap``, ``alibi_slopes`` and ``flash_attn_with_kvcache``'s
  ``cache_batch_idx`` / ``cache_leftpad`` / right windows run on kernel code that has not yet
  run on a GPU: they raise until ``ATTN_EXT_UNVERIFIED_CUDA=1`` opts in.
"""

from typing import Optional, Tuple, Union

import torch

from .decoding import decode_attention
from .functional import _int32, _rng_state

_ops = torch.ops.attn_ext

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> the (B, H, S, D) view attn_ext's operators read in place."""
    if x.dim() != 4:
        raise ValueError(f"attn_ext.flash_attn: expected (B, S, H, D), got {tuple(x.shape)}")
    return x.transpose(1, 2)


def _no_paging(block_table):
    if block_table is not None:
        raise NotImplementedError(
            "attn_ext.flash_attn: block_table (paged KV cache) is not supported yet"
        )


def _probs(q4, k4, scale, causal, window, softcap, alibi_slopes, dropout_p, rng_state):
    """S_dmask as FlashAttention returns it: None without dropout, else the probabilities with
    the dropped entries negated (testing only, as in FlashAttention)."""
    if dropout_p == 0.0:
        return None
    if softcap or alibi_slopes is not None:
        raise NotImplementedError(
            "attn_ext.flash_attn: return_attn_probs with dropout is supported for the fixed-length "
            "functions without softcap / alibi_slopes"
        )
    w = _ops.attention_weights(
        q4.detach(),
        k4.detach(),
        scale=scale,
        causal=causal,
        window_left=window[0],
        window_right=window[1],
    )
    B, H, Sq, Sk = w.shape
    keep = _ops.dropout_mask(rng_state, B, H, Sq, Sk, dropout_p).to(w.device)
    return torch.where(keep, w, -w)


def _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, probs):
    q4, k4, v4 = _heads_first(q), _heads_first(k), _heads_first(v)
    left, right = (int(w) for w in window_size)
    rng_state = _rng_state(dropout_p, None)
    out, lse = _ops.attention(
        q4,
        k4,
        v4,
        None,
        rng_state,
        alibi_slopes,
        None,
        scale=softmax_scale,
        causal=causal,
        window_left=left,
        window_right=right,
        dropout_p=dropout_p,
        softcap=softcap,
    )
    out = out.transpose(1, 2).contiguous()  # (B, Sq, H, Dv), contiguous like FlashAttention's
    if not probs:
        return out
    args = (softmax_scale, causal, (left, right), softcap, alibi_slopes, dropout_p, rng_state)
    return out, lse, _probs(q4, k4, *args)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, H, Dv); with
    return_attn_probs, (out, softmax_lse (B, H, Sq), S_dmask)."""
    return _attn(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs,
    )  # fmt: skip


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (B, S, 3, H, D); otherwise as :func:`flash_attn_func`."""
    q, k, v = qkv.unbind(dim=2)
    return _attn(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, Sq, H, D), kv (B, Sk, 2, Hkv, D); otherwise as :func:`flash_attn_func`."""
    k, v = kv.unbind(dim=2)
    return _attn(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs,
    )  # fmt: skip


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap, alibi,
            probs):  # fmt: skip
    left, right = (int(w) for w in window)
    out, lse = _ops.attention_varlen(
        q,
        k,
        v,
        _int32(cu_q),
        _int32(cu_k),
        _rng_state(dropout_p, None),
        alibi,
        None,
        max_seqlen_q=int(max_q),
        max_seqlen_k=int(max_k),
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        dropout_p=dropout_p,
        softcap=softcap,
    )
    if not probs:
        return out
    if dropout_p > 0.0:
        raise NotImplementedError(
            "attn_ext.flash_attn: return_attn_probs with dropout is supported for the "
            "fixed-length functions only"
        )
    return out, lse, None


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens (B + 1,) int32
    -> out (total_q, H, Dv); with return_attn_probs, (out, softmax_lse (H, total_q), S_dmask)."""
    _no_paging(block_table)
    return _varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (total, 3, H, D); otherwise as :func:`flash_attn_varlen_func`."""
    q, k, v = qkv.unbind(dim=1)
    return _varlen(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (total_q, H, D), kv (total_k, 2, Hkv, D); otherwise as :func:`flash_attn_varlen_func`."""
    k, v = kv.unbind(dim=1)
    return _varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, return_attn_probs,
    )  # fmt: skip


def _rotate(x, cos, sin, positions, interleaved):
    """FlashAttention's rotary embedding from tables: x (B, S, H, D), cos / sin (S_ro, rd / 2),
    token s of batch b at positions[b, s]; the first rd features rotate, in fp32 (fp64 for fp64
    inputs)."""
    half = cos.size(1)
    rd = 2 * half
    work = torch.promote_types(x.dtype, torch.float32)
    c = cos.to(work)[positions].unsqueeze(2)  # (B, S, 1, rd / 2)
    s = sin.to(work)[positions].unsqueeze(2)
    xr = x[..., :rd].to(work)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Incremental decoding against a KV cache, FlashAttention's semantics: q (B, Sq, H, D),
    k_cache / v_cache (B_cache, S_cache, Hkv, D), updated in place with k / v (B, S_new, Hkv, D)
    at rows ``cache_seqlens`` (which is not modified); keys of sequence b are cache rows
    ``[cache_leftpad[b], cache_seqlens[b] + S_new)`` of cache batch row ``cache_batch_idx[b]``;
    with ``rotary_cos`` / ``rotary_sin`` (S_ro, rotary_dim / 2) the new keys rotate at positions
    ``cache_seqlens + i``, and q at the same positions if causal or windowed, else all at
    ``cache_seqlens``. Returns out (B, Sq, H, Dv), with return_softmax_lse also lse (B, H, Sq).
    Not differentiable."""
    _no_paging(block_table)
    B, sq = q.shape[0], q.shape[1]
    dev = k_cache.device
    if cache_seqlens is None:  # the whole cache
        lens = torch.full((B,), k_cache.size(1), dtype=torch.int32, device=dev)
    elif isinstance(cache_seqlens, int):
        lens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=dev)
    else:
        lens = cache_seqlens
    left, right = (int(w) for w in window_size)
    s_new = 0
    if k is not None and v is not None:
        s_new = k.size(1)
        if rotary_cos is not None and rotary_sin is not None:
            steps = torch.arange(s_new, device=dev)
            k = _rotate(k, rotary_cos, rotary_sin, lens.long()[:, None] + steps, rotary_interleaved)
            q_steps = torch.arange(sq, device=dev) if causal or (left, right) != (-1, -1) else None
            q_pos = lens.long()[:, None] + (q_steps if q_steps is not None else 0)
            q = _rotate(q, rotary_cos, rotary_sin, q_pos.expand(B, sq), rotary_interleaved)
        rows = lens.long()[:, None] + torch.arange(s_new, device=dev)  # (B, S_new)
        batch = (
            torch.arange(B, device=dev) if cache_batch_idx is None else cache_batch_idx.long()
        )[:, None].expand_as(rows)
        with torch.no_grad():
            k_cache[batch, rows] = k.to(k_cache.dtype)
            v_cache[batch, rows] = v.to(v_cache.dtype)
    out, lse = decode_attention(
        q.transpose(1, 2),
        k_cache.transpose(1, 2),
        v_cache.transpose(1, 2),
        lens + s_new,
        scale=softmax_scale,
        causal=causal,
        window_left=left,
        window_right=-1 if causal else right,  # causal already ends the band at the query
        num_splits=num_splits,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        return_lse=True,
    )
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out
