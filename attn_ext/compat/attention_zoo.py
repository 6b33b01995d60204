"""Drop-ins for document 004 ("Transformer 之 各种 Attention 原理和实现", the attention zoo).

Same names, constructor signatures, parameter names (``W_q``, ``W_k``, ``W_v``, ``W_o``),
forward signatures, accepted input ranks and return values as the document; the attention is
computed by :func:`attn_ext.attention`. The document scales by
``torch.sqrt(torch.tensor(n).float())``, a float32 square root; the drop-ins use that same number,
computed the same way (MKL's float32 sqrt is not always correctly rounded: see ``_float32_sqrt``).

Differences from the document's code:

- ``GroupedAttention``: the document reshapes Q to ``(B, num_groups, num_heads // num_groups, S,
  head_dim)`` and multiplies it with K of shape ``(B, num_heads // num_groups, S, head_dim)``;
  broadcasting then aligns Q's *group* axis with K's *batch* axis, so query group ``g`` of every
  batch element reads the keys and values of batch element ``g`` (and the call fails unless
  ``batch_size`` is 1 or ``num_groups``). The drop-in keeps the document's head mapping — query
  head ``h`` reads kv head ``h % (num_heads // num_groups)`` — but each batch element reads its
  own keys and values. With ``batch_size == 1`` the two agree exactly.
- ``SpatialAttention`` returns the gate map, as the document's does (the document multiplies
  ``x`` by it outside the module); the channel pooling is one fused read of ``x``
  (:func:`attn_ext.channel_pool`). For the gated map in one fused pass use
  :class:`attn_ext.nn.SpatialAttention`.
- ``TemporalAttention`` keeps the document's formula (see the class).
- ``TensorProductAttention``: the document forms Q, K, V as ``(B, S, H, d_k)`` and multiplies
  ``Q @ K.transpose(2, 3)``, which attends across *heads* at each position; it sums the rank
  terms without the paper's ``1/R``; and it "applies RoPE" by multiplying ``B_Q`` and ``B_K``
  elementwise with ``rope_pos``. The drop-in computes the paper's definition with the
  document's parameters: ``Q_t = (1/R_Q) Σ_r a_r ⊗ b_r`` (likewise K, V), attention over
  *positions* per head (no mask, as in the document), and when ``rope_pos`` is given it is
  taken as the tokens' integer positions ((S,) or (B, S)) and RoPE rotates the ``B`` factors
  of Q and K. A floating ``(S, d_k)`` ``rope_pos`` (the document's multiplier, what its own
  script passes) is taken as RoPE at positions ``0..S-1``, with a warning.
"""

import math
import warnings

import torch
import torch.nn as nn

from .. import functional as _F
from ..nn.tensor_product_attention import TensorProductAttention as _TPA
from ..spatial import channel_pool
from . import _attend, _check_last, _check_rank, _float32_sqrt

__all__ = [
    "SelfAttention",
    "MultiHeadAttention",
    "SpatialAttention",
    "TemporalAttention",
    "CrossAttention",
    "GroupedAttention",
    "TensorProductAttention",
]


class SelfAttention(nn.Module):
    """Single-head self-attention; x (..., S, input_dim) of any rank >= 2 -> (..., S, d_k)."""

    def __init__(self, input_dim, d_k):
        super(SelfAttention, self).__init__()
        self.W_q = nn.Linear(input_dim, d_k)
        self.W_k = nn.Linear(input_dim, d_k)
        self.W_v = nn.Linear(input_dim, d_k)

    def forward(self, x):
        name = type(self).__name__
        if x.dim() < 2:
            raise ValueError(
                f"{name}: x must be at least 2-D (..., S, input_dim), got {x.dim()}-D "
                f"{tuple(x.shape)}"
            )
        _check_last(name, x, self.W_q.in_features, "x")
        Q = self.W_q(x)
        K = self.W_k(x)
        V = self.W_v(x)
        return _attend(Q, K, V, scale=1.0 / _float32_sqrt(Q.size(-1)), name=name)


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention; x (B, S, input_dim) -> (B, S, input_dim), ``num_heads`` heads
    of size ``d_k // num_heads``."""

    def __init__(self, input_dim, num_heads, d_k):
        super(MultiHeadAttention, self).__init__()
        self.input_dim = input_dim
        self.num_heads = num_heads
        self.d_k = d_k
        self.head_dim = d_k // num_heads
        self.W_q = nn.Linear(input_dim, d_k)
        self.W_k = nn.Linear(input_dim, d_k)
        self.W_v = nn.Linear(input_dim, d_k)
        self.W_o = nn.Linear(d_k, input_dim)

    def forward(self, x):
        name = type(self).__name__
        _check_rank(name, x, (3,), "(batch_size, seq_len, input_dim)")
        _check_last(name, x, self.input_dim, "x")
        batch_size, seq_len, _ = x.size()
        Q = self.W_q(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        K = self.W_k(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        V = self.W_v(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        output = _attend(Q, K, V, scale=1.0 / _float32_sqrt(self.head_dim), name=name)
        output = output.transpose(1, 2).reshape(batch_size, seq_len, -1)
        return self.W_o(output)


class CrossAttention(nn.Module):
    """Single-head cross-attention ``forward(x1, x2)``: queries from x1 (..., S1, input_dim),
    keys and values from x2 (..., S2, input_dim) -> (..., S1, d_k)."""

    def __init__(self, input_dim, d_k):
        super(CrossAttention, self).__init__()
        self.W_q = nn.Linear(input_dim, d_k)
        self.W_k = nn.Linear(input_dim, d_k)
        self.W_v = nn.Linear(input_dim, d_k)

    def forward(self, x1, x2):
        name = type(self).__name__
        for n, t in (("x1", x1), ("x2", x2)):
            if t.dim() < 2:
                raise ValueError(
                    f"{name}: {n} must be at least 2-D (..., S, input_dim), got {t.dim()}-D "
                    f"{tuple(t.shape)}"
                )
            _check_last(name, t, self.W_q.in_features, n)
        Q = self.W_q(x1)
        K = self.W_k(x2)
        V = self.W_v(x2)
        return _attend(Q, K, V, scale=1.0 / _float32_sqrt(Q.size(-1)), name=name)


class GroupedAttention(nn.Module):
    """Grouped-query self-attention; x (B, S, input_dim) -> (B, S, input_dim).

    ``num_heads`` query heads of size ``d_k // num_heads``; ``num_heads // num_groups`` key/value
    heads (``W_k``, ``W_v`` project to ``d_k // num_groups``); query head ``h`` reads kv head
    ``h % (num_heads // num_groups)`` (the document's mapping). See the module docstring for the
    document's batch bug, which is not reproduced."""

    def __init__(self, input_dim, d_k, num_heads, num_groups):
        super(GroupedAttention, self).__init__()
        assert num_heads % num_groups == 0
        self.num_heads = num_heads
        self.num_groups = num_groups
        self.head_dim = d_k // num_heads
        self.W_q = nn.Linear(input_dim, d_k)
        self.W_k = nn.Linear(input_dim, d_k // num_groups)
        self.W_v = nn.Linear(input_dim, d_k // num_groups)
        self.W_o = nn.Linear(d_k, input_dim)

    def forward(self, x):
        name = type(self).__name__
        _check_rank(name, x, (3,), "(batch_size, seq_len, input_dim)")
        _check_last(name, x, self.W_q.in_features, "x")
        batch_size, seq_len, _ = x.size()
        G, H = self.num_groups, self.num_heads
        Hkv, hd = H // G, self.head_dim
        # Query head h = g * Hkv + r reads kv head r. attn_ext maps head h' to kv head h' // G,
        # so order the query heads as h' = r * G + g (one copy of Q when G > 1 and Hkv > 1).
        Q = self.W_q(x).view(batch_size, seq_len, G, Hkv, hd).transpose(2, 3)
        Q = Q.reshape(batch_size, seq_len, H, hd).transpose(1, 2)
        K = self.W_k(x).view(batch_size, seq_len, Hkv, hd).transpose(1, 2)
        V = self.W_v(x).view(batch_size, seq_len, Hkv, hd).transpose(1, 2)
        output = _attend(
            Q, K, V, scale=1.0 / _float32_sqrt(hd), gqa=True, name=name
        )  # (B, H', S, hd)
        # back to the document's head order h = g * Hkv + r, concatenated over heads
        output = output.transpose(1, 2).reshape(batch_size, seq_len, Hkv, G, hd).transpose(2, 3)
        output = output.reshape(batch_size, seq_len, -1)
        return self.W_o(output)


class SpatialAttention(nn.Module):
    """CBAM's spatial attention map as document 004 computes it:
    ``sigmoid(conv1([mean_c(x); max_c(x)]))``, x (N, C, H, W) -> (N, 1, H, W), NCHW or
    channels-last. ``kernel_size`` is 3 or 7 (padding 1 or 3), ``conv1`` has no bias; the
    document's ``sigmoid`` attribute is kept (it holds no parameters)."""

    def __init__(self, kernel_size=7):
        super(SpatialAttention, self).__init__()
        assert kernel_size in (3, 7), "kernel size must be 3 or 7"
        padding = 3 if kernel_size == 7 else 1
        self.conv1 = nn.Conv2d(2, 1, kernel_size, padding=padding, bias=False)
        self.sigmoid = nn.Sigmoid()

    def forward(self, x):
        name = type(self).__name__
        _check_rank(name, x, (4,), "(batch_size, channels, height, width)")
        return self.sigmoid(self.conv1(channel_pool(x)))


class TemporalAttention(nn.Module):
    r"""Single-head temporal attention as document 004 writes it; ``forward(x, time_points)``
    with x (B, S, input_dim) and time_points (B or 1, n_t, time_emb_dim) returns
    ``(output (B, S, d_k), attn_weights (B, S, S))``.

    The document repeats the projected time embedding ``E = W_t(time_points)`` (n_t, d_k) ``S``
    times into ``T`` (n_t S, d_k) and scores ``Q (T^T T / (||T||_F + 1e-8)) K^T / sqrt(d_k)``.
    Since ``T^T T = S E^T E`` and ``||T||_F = sqrt(S) ||E||_F``, the drop-in forms the (d_k, d_k)
    matrix from ``E`` alone, folds it into the queries and calls :func:`attn_ext.attention`
    (:func:`attn_ext.attention_with_weights` for the returned weights): the same numbers
    without the (n_t S, d_k) repeat.

    Kept from the document (it differs from the paper's per-token time matrix): with one time
    point ``e``, ``T^T T / ||T||`` is ``sqrt(S) e e^T / ||e||``, so the scores scale with the
    square root of the sequence length, and several time points per sequence are summed into
    one matrix rather than assigned to tokens. The multi-head :class:`attn_ext.nn.TemporalAttention`
    accepts one time point per token.
    """

    def __init__(self, input_dim, d_k, time_emb_dim):
        super(TemporalAttention, self).__init__()
        self.input_dim = input_dim
        self.d_k = d_k
        self.time_emb_dim = time_emb_dim
        self.W_q = nn.Linear(input_dim, d_k)
        self.W_k = nn.Linear(input_dim, d_k)
        self.W_v = nn.Linear(input_dim, d_k)
        self.W_t = nn.Linear(time_emb_dim, d_k)

    def forward(self, x, time_points, need_weights=True):
        """``need_weights=False`` (not in the document) returns ``(output, None)`` without
        forming the (B, S, S) weights: memory linear in S."""
        name = type(self).__name__
        _check_rank(name, x, (3,), "x (batch_size, seq_len, input_dim)")
        _check_last(name, x, self.input_dim, "x")
        _check_rank(
            name, time_points, (3,), "time_points (batch_size, num_time_points, time_emb_dim)"
        )
        _check_last(name, time_points, self.time_emb_dim, "time_points")
        batch_size, seq_len, _ = x.size()
        if time_points.size(0) not in (1, batch_size):
            raise ValueError(
                f"{name}: time_points must have batch size 1 or {batch_size} (x's), "
                f"got shape {tuple(time_points.shape)}"
            )
        Q = self.W_q(x)
        K = self.W_k(x)
        V = self.W_v(x)
        time_emb = self.W_t(time_points)  # (B, n_t, d_k)
        gram = torch.matmul(time_emb.transpose(1, 2), time_emb) * seq_len  # T^T T
        t_norm = torch.linalg.vector_norm(time_emb, dim=(1, 2), keepdim=True) * math.sqrt(
            seq_len
        )  # ||T||_F
        Q = torch.matmul(Q, gram / (t_norm + 1e-8))
        K, V = K.expand(Q.size(0), -1, -1), V.expand(Q.size(0), -1, -1)
        scale = 1.0 / _float32_sqrt(self.d_k)
        if not need_weights:
            return _F.attention(Q, K, V, scale=scale), None
        return _F.attention_with_weights(Q, K, V, scale=scale)


class TensorProductAttention(_TPA):
    """Tensor Product Attention with document 004's constructor and parameters (``W_a_q``,
    ``W_b_q``, ``W_a_k``, ``W_b_k``, ``W_a_v``, ``W_b_v``, ``out_proj``), computing the paper's
    definition (see the module docstring for the differences from the document's code);
    x (B, S, d_model) -> (B, S, d_model), ``d_k`` the per-head width. The scores are divided by
    the document's float32 ``sqrt(d_k)``. ``forward(x, rope_pos=None)``: with integer positions
    ``rope_pos`` ((S,) or (B, S)) RoPE (base 10000, LLaMA's halves layout) rotates the ``B``
    factors of Q and K; without, no position encoding (as the document)."""

    def __init__(self, d_model, num_heads, d_k, r_q=6, r_k=2, r_v=2):
        super().__init__(
            d_model, num_heads, d_k, r_q=r_q, r_k=r_k, r_v=r_v, causal=False, rope=d_k % 2 == 0
        )
        self.d_k = d_k

    def _document_multiplier_positions(self, x, rope_pos):
        """Document 004's script passes a float (S, d_k) tensor that its code multiplies into
        B_Q and B_K and calls RoPE; what it means is RoPE at the tokens' positions, so such a
        tensor stands for positions 0..S-1 (with a warning: its values are not used)."""
        name = type(self).__name__
        seq_len = x.shape[1]
        if tuple(rope_pos.shape) != (seq_len, self.d_k):
            raise TypeError(
                f"{name}: rope_pos must hold integer token positions ((S,) or (B, S)) "
                f"or be document 004's float (seq_len, d_k) = ({seq_len}, {self.d_k}) "
                f"placeholder, got {rope_pos.dtype} of shape {tuple(rope_pos.shape)}"
            )
        warnings.warn(
            f"{name}: a float rope_pos (document 004's elementwise multiplier) is taken "
            "as RoPE at positions 0..S-1; its values are ignored. Pass integer positions.",
            stacklevel=3,
        )
        return torch.arange(seq_len, device=x.device)

    def forward(self, x, rope_pos=None):
        name = type(self).__name__
        _check_rank(name, x, (3,), "x (batch, seq_len, d_model)")
        self._check_x(x)
        if rope_pos is not None and rope_pos.is_floating_point():
            rope_pos = self._document_multiplier_positions(x, rope_pos)
        if rope_pos is not None and not self.rope:
            raise ValueError(f"{name}: RoPE needs an even d_k, got {self.d_k}")
        return self._full(x, rope_pos, 1.0 / _float32_sqrt(self.d_k), rotate=rope_pos is not None)
