"""References for attn_ext.flash_attn: FlashAttention 2's documented semantics in plain
PyTorch (flash_attn_interface's docstrings), one function per public function, on the
``(B, S, H, D)`` / varlen layouts. No attn_ext import; the score math is
:func:`attn_ext.testing.attention.attention_reference` (materialized scores; bottom-right causal
and windows, softcap then ALiBi ``-slope * |i + Sk - Sq - j|``, as FlashAttention documents).
"""

from __future__ import annotations

import torch

from attn_ext.testing.attention import attention_reference, attention_varlen_reference


def flash_attn_func_reference(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    return_lse=False,
):
    """q (B, Sq, H, D), k / v (B, Sk, Hkv, *) -> out (B, Sq, H, Dv) [, lse (B, H, Sq)]."""
    out, lse = attention_reference(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_lse=True,
    )
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    return_lse=False,
):
    """(total, H, D) tokens, sequence b = tokens [cu[b], cu[b + 1]) -> out (total_q, H, Dv)
    [, lse (H, total_q)]."""
    return attention_varlen_reference(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_lse=return_lse,
    )


def rotary_reference(x, cos, sin, positions, interleaved):
    """Rotary embedding from tables, one token at a time: x (B, S, H, D); token s of batch b at
    positions[b][s]; pairs (2i, 2i+1) if interleaved, else (i, i + rd/2); rd = 2 * cos.size(1)."""
    out = x.clone()
    half = cos.size(1)
    for b in range(x.size(0)):
        for s in range(x.size(1)):
            p = int(positions[b][s])
            c, sn = cos[p].to(x.dtype), sin[p].to(x.dtype)
            t = x[b, s]
            if interleaved:
                x1, x2 = t[:, 0 : 2 * half : 2], t[:, 1 : 2 * half : 2]
                out[b, s, :, 0 : 2 * half : 2] = x1 * c - x2 * sn
                out[b, s, :, 1 : 2 * half : 2] = x2 * c + x1 * sn
            else:
                x1, x2 = t[:, :half], t[:, half : 2 * half]
                out[b, s, :, :half] = x1 * c - x2 * sn
                out[b, s, :, half : 2 * half] = x2 * c + x1 * sn
    return out


def flash_attn_with_kvcache_reference(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
):
    """Returns (out (B, Sq, H, Dv), lse (B, H, Sq), k_cache', v_cache'): the caches after the
    update, as new tensors (the arguments are not modified)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    B, sq = q.shape[:2]
    if cache_seqlens is None:
        lens = [k_cache.size(1)] * B
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * B
    else:
        lens = [int(x) for x in cache_seqlens]
    rows = list(range(B)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx]
    pads = [0] * B if cache_leftpad is None else [int(x) for x in cache_leftpad]
    s_new = 0
    if k is not None:
        s_new = k.size(1)
        if rotary_cos is not None:
            k = rotary_reference(
                k, rotary_cos, rotary_sin, [[n + i for i in range(s_new)] for n in lens],
                rotary_interleaved,
            )  # fmt: skip
            local = causal or tuple(window_size) != (-1, -1)
            q_pos = [[n + (i if local else 0) for i in range(sq)] for n in lens]
            q = rotary_reference(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        for b in range(B):
            k_cache[rows[b], lens[b] : lens[b] + s_new] = k[b]
            v_cache[rows[b], lens[b] : lens[b] + s_new] = v[b]
    outs, lses = [], []
    for b in range(B):
        keys = slice(pads[b], lens[b] + s_new)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b : b + 1]
        out, lse = flash_attn_func_reference(
            q[b : b + 1],
            k_cache[rows[b] : rows[b] + 1, keys],
            v_cache[rows[b] : rows[b] + 1, keys],
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            return_lse=True,
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache
