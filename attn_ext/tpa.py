"""Tensor Product Attention ("Tensor Product Attention Is All You Need", Zhang et al. 2025):
the operator that forms Q, K or V from the per-token factors, and attention against a cache of
factors. Thin wrappers (arguments only) over ``torch.ops.attn_ext.tpa_expand`` and
``torch.ops.attn_ext.tpa_decode_attention``."""

from typing import Optional

import torch

from ._ops import ops as _ops

__all__ = ["tpa_expand", "tpa_decode_attention"]


def tpa_expand(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    positions: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    rope: bool = False,
    rope_base: float = 10000.0,
    rope_interleaved: bool = False,
    rotary_dim: Optional[int] = None,
) -> torch.Tensor:
    """Per-head rows from tensor-product factors, in one pass.

    a: (B, S, R, H) head-side factors, b: (B, S, R, D) feature-side factors (any strides).
    Returns (B, S, H, D) contiguous with
    ``out[b, s, h] = scale * sum_r a[b, s, r, h] * RoPE(b[b, s, r])``; ``scale`` defaults to
    ``1 / R`` (the paper's ``1/R_Q``, ``1/R_K``, ``1/R_V``). ``rope=True`` rotates the b
    factors (the paper's RoPE on B, before the product) at ``positions`` (int (B, S) or (S,),
    default ``0..S-1``) on their first ``rotary_dim`` features (default D), in the pair layout of
    :func:`attn_ext.rope` (halves unless ``rope_interleaved=True``). ``out.transpose(1, 2)``
    is a (B, H, S, D) view that :func:`attn_ext.attention` reads in place. Differentiable in
    ``a`` and ``b``.
    """
    if scale is None:
        if a.dim() != 4:  # the op reports the shape error
            scale = 1.0
        else:
            if a.size(2) < 1:
                raise ValueError(
                    "attn_ext.tpa_expand: the rank R (dim 2 of a) must be >= 1, got shape "
                    f"{tuple(a.shape)}"
                )
            scale = 1.0 / a.size(2)
    return _ops.tpa_expand(
        a,
        b,
        positions,
        scale=scale,
        rope=rope,
        rope_base=rope_base,
        rope_interleaved=rope_interleaved,
        rotary_dim=rotary_dim,
    )


def tpa_decode_attention(
    q: torch.Tensor,
    a_k: torch.Tensor,
    b_k: torch.Tensor,
    a_v: torch.Tensor,
    b_v: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    scale: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Causal attention of q (B, H, S, D) against a cache of factors, never forming the keys
    or values.

    a_k (B, N, R_K, H), b_k (B, N, R_K, D), a_v (B, N, R_V, H), b_v (B, N, R_V, D): the factors
    of the first N cached tokens (b_k already rotated by RoPE), as :class:`attn_ext.TPAFactorCache`
    holds them. Query ``i`` of sequence ``b`` sits at position ``cache_seqlens[b] - S + i`` and
    sees tokens up to it; the key of token ``t`` for head ``h`` is
    ``k_scale * sum_r a_k[t, r, h] b_k[t, r]`` and its value
    ``v_scale * sum_r a_v[t, r, h] b_v[t, r]``
    (defaults ``1/R_K``, ``1/R_V``: the paper's), the softmax scale defaults to ``1/sqrt(D)``.
    Returns out (B, H, S, D) (and lse (B, H, S) float32 with ``return_lse``). Differentiable in
    q and the factors.
    """
    out, lse = _ops.tpa_decode_attention(
        q, a_k, b_k, a_v, b_v, cache_seqlens, scale=scale, k_scale=k_scale, v_scale=v_scale
    )
    return (out, lse) if return_lse else out
