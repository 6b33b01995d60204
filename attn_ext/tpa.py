"""Tensor Product Attention ("Tensor Product Attention Is All You Need", Zhang et al. 2025):
the operator that forms Q, K or V from the per-token factors. A thin wrapper (arguments
only) over ``torch.ops.attn_ext.tpa_expand``."""
from typing import Optional

import torch

_ops = torch.ops.attn_ext

__all__ = ["tpa_expand"]


def tpa_expand(a: torch.Tensor, b: torch.Tensor, *, positions: Optional[torch.Tensor] = None,
               scale: Optional[float] = None, rope: bool = False, rope_base: float = 10000.0,
               rope_interleaved: bool = True, rotary_dim: Optional[int] = None) -> torch.Tensor:
    """Per-head rows from tensor-product factors, in one pass.

    a: (B, S, R, H) head-side factors, b: (B, S, R, D) feature-side factors (any strides).
    Returns (B, S, H, D) contiguous with
    ``out[b, s, h] = scale * sum_r a[b, s, r, h] * RoPE(b[b, s, r])``; ``scale`` defaults to
    ``1 / R`` (the paper's ``1/R_Q``, ``1/R_K``, ``1/R_V``). ``rope=True`` rotates the b
    factors (the paper's RoPE on B, before the product) at ``positions`` (int (B, S) or (S,),
    default ``0..S-1``) on their first ``rotary_dim`` features (default D). ``out.transpose(1, 2)``
    is a (B, H, S, D) view that :func:`attn_ext.attention` reads in place. Differentiable in
    ``a`` and ``b``.
    """
    if scale is None:
        if a.dim() != 4:  # the op reports the shape error
            scale = 1.0
        else:
            if a.size(2) < 1:
                raise ValueError(f"attn_ext.tpa_expand: the rank R (dim 2 of a) must be >= 1, got shape {tuple(a.shape)}")
            scale = 1.0 / a.size(2)
    return _ops.tpa_expand(a, b, positions, scale=scale, rope=rope, rope_base=rope_base,
                           rope_interleaved=rope_interleaved, rotary_dim=rotary_dim)
