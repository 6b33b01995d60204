"""The attention core of a model layer, computed with context parallelism.

:class:`ContextParallelAttention` takes the place of the ``attention(q, k, v)`` call inside a
model's attention layer when each rank of a process group holds one shard of the sequence
(:func:`attn_ext.distributed.shard_sequence`); projections, RoPE (at
:func:`attn_ext.distributed.sequence_positions`) and everything else stay per token, so they
run on the local shard unchanged.
"""

from typing import Optional

import torch
from torch import nn

from .. import distributed

__all__ = ["ContextParallelAttention"]

METHODS = {"ring": distributed.ring_attention, "ulysses": distributed.ulysses_attention}


class ContextParallelAttention(nn.Module):
    r"""``attn_ext.attention`` over the whole sequence for sequence-sharded q, k, v.

    Args:
        group: the process group whose ranks hold the shards (default: the default group).
        method: ``"ring"`` (:func:`attn_ext.distributed.ring_attention`, any head count) or
            ``"ulysses"`` (:func:`attn_ext.distributed.ulysses_attention`, H divisible by the
            group size).
        layout: ``"zigzag"`` (balanced causal work) or ``"contiguous"``.
        causal, window_size, scale: as in :func:`attn_ext.attention`, on global positions.

    ``forward(q, k, v)``: q (B, H, L, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv), the local shard;
    returns the local rows (B, H, L, Dv). Under ``torch.compile`` the collectives run eagerly
    (point-to-point transfers are not traceable): the layer's other operations compile around
    them.

    Example, inside a decoder layer::

        self.attn = ContextParallelAttention(causal=True)
        ...
        q, k, v = (t.unflatten(-1, (-1, head_dim)).transpose(1, 2) for t in (q, k, v))
        out = self.attn(q, k, v).transpose(1, 2).flatten(2)
    """

    def __init__(
        self,
        *,
        group=None,
        method: str = "ring",
        layout: str = "zigzag",
        causal: bool = False,
        window_size=(-1, -1),
        scale: Optional[float] = None,
    ):
        super().__init__()
        if method not in METHODS:
            raise ValueError(
                f"ContextParallelAttention: method must be one of {tuple(METHODS)}, got {method!r}"
            )
        if layout not in distributed.LAYOUTS:
            raise ValueError(
                f"ContextParallelAttention: layout must be one of {distributed.LAYOUTS}, got "
                f"{layout!r}"
            )
        self.group = group
        self.method = method
        self.layout = layout
        self.causal = causal
        self.window_size = tuple(window_size)
        self.scale = scale

    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return METHODS[self.method](
            q,
            k,
            v,
            group=self.group,
            causal=self.causal,
            window_size=self.window_size,
            scale=self.scale,
            layout=self.layout,
        )

    def extra_repr(self) -> str:
        return (
            f"method={self.method!r}, layout={self.layout!r}, causal={self.causal}, "
            f"window_size={self.window_size}"
        )
