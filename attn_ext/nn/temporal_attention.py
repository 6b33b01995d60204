"""Temporal attention (Rosin & Radinsky, "Temporal Attention for Language Models", 2022;
document 004) as a multi-head layer on :func:`attn_ext.attention`.

Per head, the scores are ``Q (T^T T / ||T||) K^T / sqrt(d)``, where the time matrix ``T``
(S, d) holds the time embedding of every token. ``M = T^T T / ||T||`` is only (d, d), so the
layer folds it into the queries (``Q' = Q M``, cost O(S d^2)) and runs the ordinary attention
operator on ``(Q', K, V)``: no S x S matrix is formed unless the weights are requested.
"""

import math

import torch
from torch import nn

from ..functional import attention, attention_with_weights

__all__ = ["TemporalAttention"]


def time_matrix(time_emb: torch.Tensor, seq_len: int, eps: float) -> torch.Tensor:
    """``M = T^T T / (||T||_F + eps)`` for the time matrix ``T`` whose rows are the token time
    embeddings, from ``time_emb`` (B, St, H, d) with ``St`` = 1 (one time point per sequence:
    ``T`` repeats it ``seq_len`` times) or ``St`` = ``seq_len`` (one per token). Returns
    (B, H, d, d). ``T`` itself is never formed."""
    repeat = seq_len if time_emb.size(1) == 1 else 1
    gram = torch.einsum("bthd,bthe->bhde", time_emb, time_emb) * repeat
    norm = torch.linalg.vector_norm(time_emb, dim=(1, 3)) * math.sqrt(repeat)  # (B, H)
    return gram / (norm[..., None, None] + eps)


class TemporalAttention(nn.Module):
    r"""Multi-head temporal self-attention.

    ``out_proj(concat_h softmax(Q_h M_h K_h^T / sqrt(d) + mask) V_h)``, with
    ``M_h = T_h^T T_h / (||T_h||_F + eps)`` and ``T_h`` (S, d) the head-``h`` slice of the
    projected time embeddings of the S tokens.

    Args:
        embed_dim: model width ``E``; ``num_heads`` heads of ``d = E // num_heads``.
        time_emb_dim: width of the time-point embeddings given to ``forward``.
        bias: whether the five projections have biases.
        eps: added to the norm (document 004 uses 1e-8).

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (E -> E) and ``time_proj``
    (time_emb_dim -> E), all :class:`torch.nn.Linear`.

    ``forward(x, time_points, *, causal=False, need_weights=False)``: ``x`` (B, S, E);
    ``time_points`` (B, time_emb_dim) or (B, 1, time_emb_dim) -- one time point per sequence, as in
    document 004 and the paper, where every token of a document shares its time -- or
    (B, S, time_emb_dim), one per token. A batch of 1 broadcasts. ``causal`` masks future
    positions. Returns ``out`` (B, S, E), or ``(out, weights)`` with the per-head attention
    probabilities (B, H, S, S) when ``need_weights=True``; without them memory is linear in S.

    Note (kept from the paper's formula): with one time point ``e`` per sequence,
    ``M = S e e^T / (sqrt(S) ||e|| + eps)``, so the scores grow like ``sqrt(S)``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        time_emb_dim: int,
        *,
        bias: bool = True,
        eps: float = 1e-8,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or time_emb_dim <= 0:
            raise ValueError(
                f"TemporalAttention: embed_dim, num_heads and time_emb_dim must be > 0, got "
                f"{embed_dim}, {num_heads}, {time_emb_dim}"
            )
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"TemporalAttention: embed_dim ({embed_dim}) must be divisible by num_heads "
                f"({num_heads})"
            )
        self.embed_dim, self.num_heads, self.time_emb_dim = embed_dim, num_heads, time_emb_dim
        self.head_dim = embed_dim // num_heads
        self.eps = eps
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, embed_dim, **kw)
        self.k_proj = nn.Linear(embed_dim, embed_dim, **kw)
        self.v_proj = nn.Linear(embed_dim, embed_dim, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **kw)
        self.time_proj = nn.Linear(time_emb_dim, embed_dim, **kw)

    def _check(self, x: torch.Tensor, time_points: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if x.dim() != 3:
            raise ValueError(
                f"{name}: x must be 3-D (B, S, embed_dim), got {x.dim()}-D {tuple(x.shape)}"
            )
        if x.size(-1) != self.embed_dim:
            raise ValueError(
                f"{name}: x must have last dimension embed_dim={self.embed_dim}, got shape "
                f"{tuple(x.shape)}"
            )
        if time_points.dim() == 2:
            time_points = time_points.unsqueeze(1)
        if time_points.dim() != 3:
            raise ValueError(
                f"{name}: time_points must be (B, time_emb_dim), (B, 1, time_emb_dim) or "
                f"(B, S, time_emb_dim), got {time_points.dim()}-D {tuple(time_points.shape)}"
            )
        if time_points.size(-1) != self.time_emb_dim:
            raise ValueError(
                f"{name}: time_points must have last dimension time_emb_dim={self.time_emb_dim}, "
                f"got shape {tuple(time_points.shape)}"
            )
        B, S = x.shape[:2]
        if time_points.size(1) not in (1, S) or time_points.size(0) not in (1, B):
            raise ValueError(
                f"{name}: time_points must be (B or 1, 1 or S, time_emb_dim) with B={B}, S={S}, "
                f"got shape {tuple(time_points.shape)}"
            )
        return time_points

    def forward(
        self,
        x: torch.Tensor,
        time_points: torch.Tensor,
        *,
        causal: bool = False,
        need_weights: bool = False,
    ):
        time_points = self._check(x, time_points)
        B, S, _ = x.shape
        H, d = self.num_heads, self.head_dim

        def heads(t):
            return t.view(t.size(0), t.size(1), H, d).transpose(1, 2)

        t = self.time_proj(time_points)
        M = time_matrix(t.view(t.size(0), t.size(1), H, d), S, self.eps)  # (B|1, H, d, d)
        q = torch.matmul(heads(self.q_proj(x)), M)  # the time matrix folded into the queries
        k, v = heads(self.k_proj(x)), heads(self.v_proj(x))
        weights = None
        if need_weights:
            out, weights = attention_with_weights(q, k, v, causal=causal)
        else:
            out = attention(q, k, v, causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(B, S, self.embed_dim))
        return out if weights is None else (out, weights)
