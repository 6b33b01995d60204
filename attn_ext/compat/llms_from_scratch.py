"""Drop-ins for document 001 ("LLMs from scratch", chapter 3: attention).

Same names, constructor signatures, parameter and buffer names (``load_state_dict(strict=True)``
of the document's weights works), forward signatures, accepted input ranks and dropout
behaviour (``nn.Dropout`` on the attention weights in training mode, none in eval mode); the
attention is computed by :func:`attn_ext.attention`.

Differences from the document's code:

- ``SelfAttention_v1`` calls ``torch.soft`` (a typo that raises ``AttributeError``); it means
  ``torch.softmax``, which is what the drop-in computes.
- ``CausalAttention`` / ``MultiHeadAttention`` keep the registered ``mask`` buffer (the
  ``triu(ones(context_length, context_length), 1)`` matrix) for state-dict compatibility, but
  apply the causal mask with the kernel's ``causal=True``, which is the same matrix; the buffer is
  not read, so editing it in place has no effect.
- A sequence longer than ``context_length`` raises a ``ValueError`` naming both lengths (the
  document's class fails with a broadcasting error from ``masked_fill_``).
- Dropout draws its mask from attn_ext's Philox generator (seeded from torch's default
  generator), not from ``nn.Dropout``'s: same distribution and ``1/(1-p)`` scaling, not the same
  mask for a given seed.
"""

import torch
import torch.nn as nn

from . import _attend, _check_last, _check_rank, _dropout_p

__all__ = [
    "simplified_self_attention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
]


def simplified_self_attention(inputs: torch.Tensor) -> torch.Tensor:
    """The document's first example: ``softmax(inputs @ inputs.T) @ inputs`` (no projections,
    no scaling). ``inputs``: 2-D ``(num_tokens, d)``; returns the context vectors
    ``(num_tokens, d)``."""
    _check_rank("simplified_self_attention", inputs, (2,), "(num_tokens, d)")
    return _attend(inputs, inputs, inputs, scale=1.0, name="simplified_self_attention")


class SelfAttention_v1(nn.Module):
    """Self-attention with ``nn.Parameter`` weights ``W_query``, ``W_key``, ``W_value`` of shape
    ``(d_in, d_out)`` (initialized with ``torch.rand`` as in the document); input 2-D
    ``(num_tokens, d_in)``, output ``(num_tokens, d_out)``.

    The document writes ``torch.soft(...)`` (an ``AttributeError``); the drop-in computes the
    ``torch.softmax`` it means, with scale ``1/sqrt(d_out)``.
    """

    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        _check_rank(type(self).__name__, x, (2,), "(num_tokens, d_in)")
        _check_last(type(self).__name__, x, self.W_query.size(0), "x")
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        return _attend(
            queries, keys, values, scale=keys.shape[-1] ** -0.5, name=type(self).__name__
        )


class SelfAttention_v2(nn.Module):
    """Self-attention with ``nn.Linear`` projections (with bias, as in the document); input 2-D
    ``(num_tokens, d_in)``, output ``(num_tokens, d_out)``."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out)
        self.W_key = nn.Linear(d_in, d_out)
        self.W_value = nn.Linear(d_in, d_out)

    def forward(self, x):
        _check_rank(type(self).__name__, x, (2,), "(num_tokens, d_in)")
        _check_last(type(self).__name__, x, self.W_query.in_features, "x")
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        return _attend(
            queries, keys, values, scale=keys.shape[-1] ** -0.5, name=type(self).__name__
        )


def _check_tokens(name: str, x: torch.Tensor, d_in: int, context_length: int) -> None:
    """x must be (b, num_tokens, d_in) with num_tokens <= context_length."""
    _check_rank(name, x, (3,), "(b, num_tokens, d_in)")
    _check_last(name, x, d_in, "x")
    num_tokens = x.size(1)
    if num_tokens > context_length:
        raise ValueError(
            f"{name}: the sequence has {num_tokens} tokens, more than context_length "
            f"= {context_length} (the size of the registered causal mask)"
        )


class CausalAttention(nn.Module):
    """Single-head causal attention with dropout on the attention weights.

    Input 3-D ``(b, num_tokens, d_in)`` with ``num_tokens <= context_length``; output
    ``(b, num_tokens, d_out)``. Keeps the ``mask`` buffer ``(context_length, context_length)``.
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        name = type(self).__name__
        _check_tokens(name, x, self.W_query.in_features, self.mask.size(0))
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        return _attend(
            queries,
            keys,
            values,
            scale=keys.shape[-1] ** -0.5,
            causal=True,
            dropout_p=_dropout_p(self.dropout, self.training),
            name=name,
        )


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent :class:`CausalAttention` heads (``self.heads``, an
    ``nn.ModuleList``) whose outputs are concatenated: ``(b, num_tokens, num_heads * d_out)``.

    When the heads agree (same bias setting, same dropout probability) the drop-in runs them as
    one multi-head kernel call over the stacked projection weights; otherwise head by head."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [
                CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
                for _ in range(num_heads)
            ]
        )

    def _fusable(self) -> bool:
        heads = list(self.heads)
        if not heads or not all(type(h) is CausalAttention for h in heads):
            return False
        h0 = heads[0]
        has_bias = h0.W_query.bias is not None
        return all(
            h.dropout.p == h0.dropout.p
            and (h.W_query.bias is not None) == has_bias
            and (h.W_key.bias is not None) == has_bias
            and (h.W_value.bias is not None) == has_bias
            and h.W_query.weight.shape == h0.W_query.weight.shape
            for h in heads
        )

    def forward(self, x):
        if not self._fusable():
            return torch.cat([head(x) for head in self.heads], dim=-1)
        name = type(self).__name__
        heads = list(self.heads)
        h0 = heads[0]
        _check_tokens(name, x, h0.W_query.in_features, min(h.mask.size(0) for h in heads))
        b, num_tokens, _ = x.shape
        n, d_out = len(heads), h0.W_query.out_features

        def project(attr):
            weight = torch.cat([getattr(h, attr).weight for h in heads], dim=0)
            bias = getattr(h0, attr).bias
            if bias is not None:
                bias = torch.cat([getattr(h, attr).bias for h in heads], dim=0)
            # (b, T, n * d_out) -> (b, n, T, d_out), a view
            return (
                nn.functional.linear(x, weight, bias).view(b, num_tokens, n, d_out).transpose(1, 2)
            )

        queries, keys, values = project("W_query"), project("W_key"), project("W_value")
        ctx = _attend(
            queries,
            keys,
            values,
            scale=d_out**-0.5,
            causal=True,
            dropout_p=_dropout_p(h0.dropout, self.training),
            name=name,
        )
        return ctx.transpose(1, 2).reshape(b, num_tokens, n * d_out)


class MultiHeadAttention(nn.Module):
    """Causal multi-head attention with an output projection (the document's batched v2).

    Input 3-D ``(b, num_tokens, d_in)`` with ``num_tokens <= context_length``; output
    ``(b, num_tokens, d_out)``. Parameters ``W_query``, ``W_key``, ``W_value`` (bias iff
    ``qkv_bias``), ``out_proj`` (with bias); buffer ``mask``.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        name = type(self).__name__
        _check_tokens(name, x, self.W_query.in_features, self.mask.size(0))
        b, num_tokens, d_in = x.shape
        # (b, T, d_out) -> (b, num_heads, T, head_dim): views, read in place by the kernel
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        context_vec = _attend(
            queries,
            keys,
            values,
            scale=self.head_dim**-0.5,
            causal=True,
            dropout_p=_dropout_p(self.dropout, self.training),
            name=name,
        )
        context_vec = context_vec.transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)
