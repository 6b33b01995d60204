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

Decoding (:class:`TPAFactorCache`) caches ``A_K, B_K, A_V, B_V`` (``B_K`` rotated):
``R_K (H + d) + R_V (H + d)`` values per token instead of ``2 H d``. A step scores the cached
keys without forming them: ``q_h · K_t[h] = (1/R_K) Σ_r A_K[t, r, h] (q_h · B_K[t, r])``, and
contracts the probabilities with ``A_V`` before the one product with ``B_V``.
"""
import math
from typing import Optional

import torch
from torch import nn

from ..decoding import KVCache, rope
from ..functional import attention
from ..tpa import tpa_decode_attention, tpa_expand

_ops = torch.ops.attn_ext

__all__ = ["TensorProductAttention", "TPAFactorCache"]


class TPAFactorCache:
    """Preallocated factor cache of :class:`TensorProductAttention`: ``a_k`` (B, max_len, R_K, H),
    ``b_k`` (B, max_len, R_K, d) rotated by RoPE at each row's position, ``a_v``
    (B, max_len, R_V, H), ``b_v`` (B, max_len, R_V, d), and ``lengths`` (B,) int32. Rows are
    written at each sequence's length by ``attn_ext::kv_cache_append`` (a (row, rank)
    factor block is one cache row); nothing is ever moved. The lengths are mirrored on the
    host, as :class:`attn_ext.KVCache` does, so that appending and decoding on a GPU never
    wait for the device."""

    def __init__(self, batch_size: int, max_len: int, num_heads: int, head_dim: int, r_k: int,
                 r_v: int, *, dtype=None, device=None):
        for name, value in (("batch_size", batch_size), ("max_len", max_len), ("num_heads", num_heads),
                            ("head_dim", head_dim), ("r_k", r_k), ("r_v", r_v)):
            if int(value) < 0 or (name.startswith("r_") and int(value) < 1):
                raise ValueError(f"attn_ext.TPAFactorCache: {name} must be "
                                 f"{'>= 1' if name.startswith('r_') else '>= 0'}, got {value}")
        kw = dict(dtype=dtype, device=device)
        self.a_k = torch.zeros(batch_size, max_len, r_k, num_heads, **kw)
        self.b_k = torch.zeros(batch_size, max_len, r_k, head_dim, **kw)
        self.a_v = torch.zeros(batch_size, max_len, r_v, num_heads, **kw)
        self.b_v = torch.zeros(batch_size, max_len, r_v, head_dim, **kw)
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=self.a_k.device)
        self._host_lengths = [0] * batch_size

    @property
    def max_len(self) -> int:
        return self.a_k.size(1)

    def max_length(self) -> int:
        """The longest sequence's length (from the host mirror: no device read)."""
        return max(self._host_lengths, default=0)

    def positions(self, seqlen: int) -> torch.Tensor:
        """(B, seqlen) int64 positions of the next tokens of each sequence."""
        return self.lengths.to(torch.int64)[:, None] + torch.arange(seqlen, device=self.lengths.device)

    def append(self, a_k, b_k, a_v, b_v) -> None:
        """Writes the factors (B, S, R, *) of S new tokens at each sequence's length (b_k
        already rotated) and advances ``lengths``; raises, writing nothing, on overflow."""
        S = a_k.size(1)
        for b, n in enumerate(self._host_lengths):
            if n + S > self.max_len:
                raise RuntimeError(f"attn_ext.TPAFactorCache: sequence {b} would overflow the cache: "
                                   f"length {n} + {S} new tokens > capacity {self.max_len} "
                                   "(nothing was written)")

        def rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            # (B, S, R, n) -> the op's (B, 1, S, R * n) layout, one row per token
            return t.to(like.dtype).flatten(2).unsqueeze(1)

        # Both pairs start at the same lengths: the key pair advances a scratch copy, the
        # value pair the cache's own.
        _ops.kv_cache_append(rows(self.a_k, self.a_k), rows(self.b_k, self.b_k), self.lengths.clone(),
                             rows(a_k, self.a_k), rows(b_k, self.b_k))
        _ops.kv_cache_append(rows(self.a_v, self.a_v), rows(self.b_v, self.b_v), self.lengths,
                             rows(a_v, self.a_v), rows(b_v, self.b_v))
        self._host_lengths = [n + S for n in self._host_lengths]

    def nbytes_per_token(self) -> int:
        return sum(t[0, 0].numel() * t.element_size() for t in (self.a_k, self.b_k, self.a_v, self.b_v))


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
    :class:`TPAFactorCache` (``new_cache``) they continue each sequence and attend to the cached
    factors; with an :class:`attn_ext.KVCache` (``new_cache(..., materialize=True)``) the keys and
    values are formed and cached instead (the conventional decode, for comparison).
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, r_q: int = 6, r_k: int = 2,
                 r_v: int = 2, bias: bool = True, causal: bool = True, rope: bool = True,
                 rope_base: float = 10000.0, rope_interleaved: bool = False, device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        for arg, value in (("d_model", d_model), ("num_heads", num_heads), ("head_dim", head_dim),
                           ("r_q", r_q), ("r_k", r_k), ("r_v", r_v)):
            if int(value) < 1:
                raise ValueError(f"{name}: {arg} must be >= 1, got {value}")
        if rope and head_dim % 2:
            raise ValueError(f"{name}: RoPE rotates pairs of features, so head_dim must be even, "
                             f"got {head_dim} (or pass rope=False)")
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

    def new_cache(self, batch_size: int, max_len: int, *, materialize: bool = False, dtype=None,
                  device=None):
        """An empty :class:`TPAFactorCache`, or with ``materialize=True`` an
        :class:`attn_ext.KVCache` of formed keys and values (default: the weights' dtype and
        device)."""
        w = self.W_a_k.weight
        kw = dict(dtype=dtype or w.dtype, device=device or w.device)
        if materialize:
            return KVCache(batch_size, self.num_heads, max_len, self.head_dim, **kw)
        return TPAFactorCache(batch_size, max_len, self.num_heads, self.head_dim, self.r_k,
                              self.r_v, **kw)

    def factors(self, x: torch.Tensor):
        """The per-token factors of x (B, S, d_model): ``(a_q, b_q, a_k, b_k, a_v, b_v)``,
        a_* (B, S, R, H) and b_* (B, S, R, d), views of the projections (no RoPE yet)."""
        H, d = self.num_heads, self.head_dim
        out = []
        for W_a, W_b, R in ((self.W_a_q, self.W_b_q, self.r_q), (self.W_a_k, self.W_b_k, self.r_k),
                            (self.W_a_v, self.W_b_v, self.r_v)):
            out += [W_a(x).unflatten(-1, (R, H)), W_b(x).unflatten(-1, (R, d))]
        return tuple(out)

    def _expand(self, a, b, positions, rotate: bool) -> torch.Tensor:
        # (B, S, H, d) from the factors; (B, H, S, d) as a view.
        return tpa_expand(a, b, positions=positions if rotate else None, rope=rotate,
                          rope_base=self.rope_base, rope_interleaved=self.rope_interleaved).transpose(1, 2)

    def _merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))

    def _check_x(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.size(-1) != self.d_model:
            raise ValueError(f"{type(self).__name__}: x must be (B, S, d_model = {self.d_model}), "
                             f"got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor, cache=None, *,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        name = type(self).__name__
        self._check_x(x)
        if cache is None:
            return self._full(x, positions, self.scale, self.rope)
        if positions is not None:
            raise ValueError(f"{name}: with a cache the positions follow the cache's lengths; "
                             "do not pass positions")
        if not self.causal:
            raise ValueError(f"{name}: decoding with a cache needs causal=True")
        if isinstance(cache, TPAFactorCache):
            return self._decode_factors(x, cache)
        if isinstance(cache, KVCache):
            return self._decode_materialized(x, cache)
        raise TypeError(f"{name}: cache must be a TPAFactorCache or an attn_ext.KVCache "
                        f"(from new_cache), got {type(cache).__name__}")

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
        q = tpa_expand(a_q, b_q, positions=pos if self.rope else None, rope=self.rope,
                       rope_base=self.rope_base, rope_interleaved=self.rope_interleaved)  # (B, S, H, d)
        if self.rope:  # B_K is cached rotated at its position
            b_k = rope(b_k.transpose(1, 2), positions=pos, base=self.rope_base,
                       interleaved=self.rope_interleaved).transpose(1, 2)
        cache.append(a_k, b_k, a_v, b_v)
        n = cache.max_length()
        factors = (t[:, :n] for t in (cache.a_k, cache.b_k, cache.a_v, cache.b_v))
        out = tpa_decode_attention(q.transpose(1, 2), *factors, cache.lengths, scale=self.scale)
        return self._merge_heads(out)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"r_q={self.r_q}, r_k={self.r_k}, r_v={self.r_v}, causal={self.causal}, "
                f"rope={self.rope}, rope_base={self.rope_base}, rope_interleaved={self.rope_interleaved}")
