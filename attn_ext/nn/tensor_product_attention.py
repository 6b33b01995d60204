"""Tensor Product Attention (TPA, "Tensor Product Attention Is All You Need", Zhang et al. 2025):
queries, keys and values factorized per token into sums of tensor products, and a decoding
cache that keeps the factors instead of the keys and values.

For token ``t`` the layer projects ``x_t`` to head-side factors ``a^Q_r(x_t) ∈ R^H`` and
feature-side factors ``b^Q_r(x_t) ∈ R^{d}`` (``r < R_Q``) and forms

    Q_t = (1 / R_Q) Σ_r a^Q_r(x_t) ⊗ b^Q_r(x_t)        (H × d), likewise K_t (R_K), V_t (R_V),

with RoPE applied to the feature-side factors of Q and K (``b^Q``, ``b^K``) at the token's
position, so that ``K_t`` of a cached token never needs rotating again. Attention is ordinary
scaled dot-product attention over positions, per head. The factors are formed into Q, K and V
in one pass by :func:`attn_ext.tpa_expand` (RoPE included), whose (B, S, H, d) output is read by
:func:`attn_ext.attention` as a (B, H, S, d) view.

Decoding (:class:`attn_ext.TPAFactorCache`) caches ``A_K, B_K, A_V, B_V`` (``B_K`` rotated):
``R_K (H + d) + R_V (H + d)`` values per token instead of ``2 H d``. A step scores the cached
keys without forming them: ``q_h · K_t[h] = (1/R_K) Σ_r A_K[t, r, h] (q_h · B_K[t, r])``, and
contracts the probabilities with ``A_V`` before the one product with ``B_V``.
"""

import math
from typing import Optional

import torch
from torch import nn

from ..caches import KVCache, TPAFactorCache
from ..decoding import rope
from ..functional import attention
from ..tpa import tpa_decode_attention, tpa_expand

__all__ = ["TensorProductAttention"]


class TensorProductAttention(nn.Module):
    r"""Tensor Product Attention with causal masking and a factor cache for decoding.

    Args:
        d_model: model width.
        num_heads: heads ``H``.
        head_dim: per-head width ``d``.
        r_q / r_k / r_v: ranks of the query / key / value factorizations.
        bias: whether the factor projections and ``out_proj`` have a bias.
        causal: causal masking (a query sees itself and earlier positions).
        rope: rotate the feature-side factors of Q and K by RoPE.
        rope_base / rope_interleaved: RoPE base; pairs ``(2i, 2i + 1)`` (``True``) or halves
            ``(i, i + d/2)`` (``False``).

    Parameters (document 004's names): ``W_a_q`` (d_model -> R_Q*H, read as (R_Q, H)),
    ``W_b_q`` (d_model -> R_Q*d, read as (R_Q, d)), likewise ``W_a_k``, ``W_b_k``, ``W_a_v``,
    ``W_b_v``, and ``out_proj`` (H*d -> d_model).

    ``forward(x, cache=None, *, positions=None)``: x (B, S, d_model) -> (B, S, d_model). Without
    a cache the tokens sit at ``positions`` (int (B, S) or (S,), default ``0..S-1``). With a
    :class:`attn_ext.TPAFactorCache` (``new_cache``) they continue each sequence and attend to
    the cached factors; with an :class:`attn_ext.KVCache` (``new_cache(..., materialize=True)``)
    the keys and values are formed and cached instead (the conventional decode, for comparison).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        r_q: int = 6,
        r_k: int = 2,
        r_v: int = 2,
        bias: bool = True,
        causal: bool = True,
        rope: bool = True,
        rope_base: float = 10000.0,
        rope_interleaved: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        name = type(self).__name__
        for arg, value in (
            ("d_model", d_model),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("r_q", r_q),
            ("r_k", r_k),
            ("r_v", r_v),
        ):
            if int(value) < 1:
                raise ValueError(f"{name}: {arg} must be >= 1, got {value}")
        if rope and head_dim % 2:
            raise ValueError(
                f"{name}: RoPE rotates pairs of features, so head_dim must be even, "
                f"got {head_dim} (or pass rope=False)"
            )
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        self.r_q, self.r_k, self.r_v = r_q, r_k, r_v
        self.causal, self.rope = causal, rope
        self.rope_base, self.rope_interleaved = float(rope_base), rope_interleaved
        self.scale = 1.0 / math.sqrt(head_dim)
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.W_a_q = nn.Linear(d_model, num_heads * r_q, **kw)
        self.W_b_q = nn.Linear(d_model, head_dim * r_q, **kw)
        self.W_a_k = nn.Linear(d_model, num_heads * r_k, **kw)
        self.W_b_k = nn.Linear(d_model, head_dim * r_k, **kw)
        self.W_a_v = nn.Linear(d_model, num_heads * r_v, **kw)
        self.W_b_v = nn.Linear(d_model, head_dim * r_v, **kw)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, **kw)

    def new_cache(
        self, batch_size: int, max_len: int, *, materialize: bool = False, dtype=None, device=None
    ):
        """An empty :class:`attn_ext.TPAFactorCache`, or with ``materialize=True`` an
        :class:`attn_ext.KVCache` of formed keys and values (default: the weights' dtype and
        device)."""
        w = self.W_a_k.weight
        kw = dict(dtype=dtype or w.dtype, device=device or w.device)
        if materialize:
            return KVCache(batch_size, self.num_heads, max_len, self.head_dim, **kw)
        return TPAFactorCache(
            batch_size, max_len, self.num_heads, self.head_dim, self.r_k, self.r_v, **kw
        )

    def factors(self, x: torch.Tensor):
        """The per-token factors of x (B, S, d_model): ``(a_q, b_q, a_k, b_k, a_v, b_v)``,
        a_* (B, S, R, H) and b_* (B, S, R, d), views of the projections (no RoPE yet)."""
        H, d = self.num_heads, self.head_dim
        out = []
        for W_a, W_b, R in (
            (self.W_a_q, self.W_b_q, self.r_q),
            (self.W_a_k, self.W_b_k, self.r_k),
            (self.W_a_v, self.W_b_v, self.r_v),
        ):
            out += [W_a(x).unflatten(-1, (R, H)), W_b(x).unflatten(-1, (R, d))]
        return tuple(out)

    def _expand(self, a, b, positions, rotate: bool) -> torch.Tensor:
        # (B, S, H, d) from the factors; (B, H, S, d) as a view.
        return tpa_expand(
            a,
            b,
            positions=positions if rotate else None,
            rope=rotate,
            rope_base=self.rope_base,
            rope_interleaved=self.rope_interleaved,
        ).transpose(1, 2)

    def _merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))

    def _check_x(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.size(-1) != self.d_model:
            raise ValueError(
                f"{type(self).__name__}: x must be (B, S, d_model = {self.d_model}), "
                f"got {tuple(x.shape)}"
            )

    def forward(
        self, x: torch.Tensor, cache=None, *, positions: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        name = type(self).__name__
        self._check_x(x)
        if cache is None:
            return self._full(x, positions, self.scale, self.rope)
        if positions is not None:
            raise ValueError(
                f"{name}: with a cache the positions follow the cache's lengths; "
                "do not pass positions"
            )
        if not self.causal:
            raise ValueError(f"{name}: decoding with a cache needs causal=True")
        if isinstance(cache, TPAFactorCache):
            return self._decode_factors(x, cache)
        if isinstance(cache, KVCache):
            return self._decode_materialized(x, cache)
        raise TypeError(
            f"{name}: cache must be a TPAFactorCache or an attn_ext.KVCache "
            f"(from new_cache), got {type(cache).__name__}"
        )

    def _full(self, x, positions, scale: float, rotate: bool) -> torch.Tensor:
        a_q, b_q, a_k, b_k, a_v, b_v = self.factors(x)
        q = self._expand(a_q, b_q, positions, rotate)
        k = self._expand(a_k, b_k, positions, rotate)
        v = self._expand(a_v, b_v, None, False)
        return self._merge_heads(attention(q, k, v, causal=self.causal, scale=scale))

    def _decode_materialized(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        a_q, b_q, a_k, b_k, a_v, b_v = self.factors(x)
        pos = cache.positions(x.size(1))
        q = self._expand(a_q, b_q, pos, self.rope)
        cache.append(self._expand(a_k, b_k, pos, self.rope), self._expand(a_v, b_v, None, False))
        return self._merge_heads(cache.attend(q, scale=self.scale))

    def _decode_factors(self, x: torch.Tensor, cache: TPAFactorCache) -> torch.Tensor:
        B, S, _ = x.shape
        a_q, b_q, a_k, b_k, a_v, b_v = self.factors(x)
        pos = cache.positions(S)
        q = tpa_expand(
            a_q,
            b_q,
            positions=pos if self.rope else None,
            rope=self.rope,
            rope_base=self.rope_base,
            rope_interleaved=self.rope_interleaved,
        )  # (B, S, H, d)
        if self.rope:  # B_K is cached rotated at its position
            b_k = rope(
                b_k.transpose(1, 2),
                positions=pos,
                base=self.rope_base,
                interleaved=self.rope_interleaved,
            ).transpose(1, 2)
        cache.append(a_k, b_k, a_v, b_v)
        n = cache.max_length()
        factors = (t[:, :n] for t in (cache.a_k, cache.b_k, cache.a_v, cache.b_v))
        out = tpa_decode_attention(q.transpose(1, 2), *factors, cache.lengths, scale=self.scale)
        return self._merge_heads(out)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"r_q={self.r_q}, r_k={self.r_k}, r_v={self.r_v}, causal={self.causal}, "
            f"rope={self.rope}, rope_base={self.rope_base}, "
            f"rope_interleaved={self.rope_interleaved}"
        )
