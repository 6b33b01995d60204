"""The canonical multi-head linear-attention layer of attn_ext.

:class:`LinearAttention` projects ``x`` to per-head queries, keys and values and runs
:func:`attn_ext.linear_attention` on them (non-causal or causal), with recurrent decoding through a
:class:`LinearAttentionState`: a prompt returns the state, and each later call (one token or a
chunk) continues from it at a cost independent of how much came before.
"""

from typing import Optional

import torch
from torch import nn

from ..caches import LinearAttentionState
from ..linear import FEATURE_MAPS, linear_attention

__all__ = ["LinearAttention"]


class LinearAttention(nn.Module):
    r"""Multi-head linear attention ``out_proj(concat_h LinAttn(q_h, k_h, v_h))`` with
    ``LinAttn(q, k, v)_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i)^T sum_j phi(k_j) + eps)``.

    Args:
        embed_dim: model width ``E`` (input and output features).
        num_heads: heads ``H``; the head dim is ``D = E // H`` (``E % H == 0``).
        causal: position ``i`` sums over ``j <= i`` only (language models); else over every
            position of the input.
        feature_map: ``"elu+1"`` (default, document 000), ``"relu"`` or ``"identity"``.
        eps: added to the denominator.
        bias: whether the four projections have a bias.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (E -> E, :class:`torch.nn.Linear`),
    initialized with ``xavier_uniform_`` and zero biases.

    ``forward(x, state=None, *, return_state=False)``: ``x`` (B, S, E). ``state`` (a
    :class:`LinearAttentionState` from an earlier call) is the summary of the positions before
    ``x``; every position of ``x`` also sees them. With ``return_state=True`` the call returns
    ``(out, new_state)``. For a causal layer, running a sequence in pieces (e.g. the prompt, then
    one token per call) gives the same outputs as one call on the whole sequence. (For a non-causal
    layer each piece sees itself entirely plus the earlier pieces.)
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        causal: bool = False,
        feature_map: str = "elu+1",
        eps: float = 1e-6,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"LinearAttention: embed_dim and num_heads must be > 0, "
                f"got embed_dim={embed_dim}, num_heads={num_heads}"
            )
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"LinearAttention: embed_dim ({embed_dim}) must be divisible by num_heads "
                f"({num_heads})"
            )
        if feature_map not in FEATURE_MAPS:
            raise ValueError(
                "LinearAttention: feature_map must be one of "
                f"{', '.join(map(repr, FEATURE_MAPS))}, "
                f"got {feature_map!r}"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.causal = bool(causal)
        self.feature_map = feature_map
        self.eps = float(eps)
        kw = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def extra_repr(self) -> str:
        s = (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"feature_map={self.feature_map!r}"
        )
        if self.causal:
            s += ", causal=True"
        return s

    def forward(
        self,
        x: torch.Tensor,
        state: Optional[LinearAttentionState] = None,
        *,
        return_state: bool = False,
    ):
        if x.dim() != 3 or x.size(-1) != self.embed_dim:
            raise ValueError(
                f"LinearAttention: x must be 3-D (B, S, {self.embed_dim}), got shape "
                f"{tuple(x.shape)}"
            )
        H, D = self.num_heads, self.head_dim
        # (B, S, H*D) -> (B, H, S, D): views, read in place by the kernel.
        q, k, v = (
            proj(x).unflatten(-1, (H, D)).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out, (kv, ks) = linear_attention(
            q,
            k,
            v,
            causal=self.causal,
            eps=self.eps,
            feature_map=self.feature_map,
            initial_state=state,
            return_state=True,
        )
        out = self.out_proj(out.transpose(1, 2).flatten(2))  # merge heads (one copy)
        return (out, LinearAttentionState(kv, ks)) if return_state else out
