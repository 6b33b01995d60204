"""Drop-ins for document 000 (TorchCode, chapter 3: attention mechanisms).

Same names, signatures, attribute and parameter names and return values as the document; the
attention is computed by attn_ext's operators. The document's plain (non-``nn.Module``) classes
``MultiHeadAttention`` and ``GroupQueryAttention`` become ``nn.Module``s: they keep the attributes
``num_heads``, ``dk`` (and ``num_kv_heads``, ``groups``) and the ``nn.Linear`` layers ``W_q``,
``W_k``, ``W_v``, ``W_o``, still answer ``.forward(...)``, and are also callable. Their
``state_dict`` keys are ``W_q.weight``, ``W_q.bias``, ... (the document's objects have no
``state_dict``; build one from their layers, e.g. ``{f"{n}.{p}": t for n in ("W_q", "W_k", "W_v",
"W_o") for p, t in getattr(doc, n).named_parameters()}``).

Every function returns the attention output only (the document's functions do not return the
weights).

Differences from the document's code (each only where the document fails or is inconsistent):

- ``causal_attention``: the document's mask is ``triu(-inf, diagonal=1)`` over the score matrix,
  i.e. *top-left* aligned when ``seq_q != seq_k``; the drop-in keeps that alignment (it calls
  :func:`attn_ext.scaled_dot_product_attention` with ``is_causal=True``).
- ``sliding_window_attention``: the document builds its mask on the CPU (``torch.arange(S)``), so
  it fails for CUDA inputs; the drop-in works on any device. It accepts only what the document
  accepts: 3-D ``(B, S, D)`` with ``seq_q == seq_k``, window ``|i - j| <= window_size``
  (attn_ext ``window_size=(w, w)``). A negative ``window_size`` (every key masked, NaN in the
  document) is a ``ValueError``.
- ``flash_attention``: the document loops over ``range(0, S, block_size)`` with ``S`` the *query*
  length and accumulates into ``zeros_like(Q)``, so it silently ignores keys past ``seq_q`` and
  needs ``d_v == d_k``; the drop-in attends to every key and allows ``d_v != d_k``. The result
  does not depend on ``block_size`` (exact attention either way); it must still be a positive
  integer. The output has ``Q``'s dtype (the document's float32 running statistics promote a
  float16/bfloat16 result to float32).
- ``KVCacheAttention``: the same tuple cache ``(k, v)`` of full (B, H, S_total, dk) tensors in
  and out, grown by concatenation as in the document (its contract); the attention over it is
  attn_ext's bottom-right causal kernel (the document's ``triu(diagonal=S_total - S_new + 1)``
  mask). For generation without per-step concatenation use :class:`attn_ext.KVCache`.
- ``apply_rope``: the document's interleaved pairs ``(2i, 2i + 1)``, positions ``0..S-1``,
  angles in fp32; the output has the input's dtype (the document's fp32 tables promote a
  float16/bfloat16 input to float32).
- ``linear_attention``: the same values and signature; for float16/bfloat16 inputs the features,
  sums and quotient are computed in float32 and rounded once (the document rounds after every
  step), so the result is closer to the exact one.
"""

import math

import torch
import torch.nn as nn

from .. import decoding as _decoding
from .. import functional as _F
from ..linear import linear_attention as _linear_attention
from . import _attend, _check_last, _check_rank

__all__ = [
    "scaled_dot_product_attention",
    "MultiHeadAttention",
    "causal_attention",
    "MultiHeadCrossAttention",
    "GroupQueryAttention",
    "sliding_window_attention",
    "flash_attention",
    "KVCacheAttention",
    "apply_rope",
    "linear_attention",
]


def scaled_dot_product_attention(Q, K, V):
    """``softmax(Q K^T / sqrt(d_k)) V`` over the last two dimensions.

    Q: (..., seq_q, d_k), K: (..., seq_k, d_k), V: (..., seq_k, d_v), leading dimensions
    broadcasting as in ``torch.matmul``; returns (..., seq_q, d_v)."""
    return _attend(Q, K, V, name="scaled_dot_product_attention")


class MultiHeadAttention(nn.Module):
    """Multi-head attention ``forward(Q, K, V)`` with inputs (B, S_q, d_model), (B, S_k, d_model),
    (B, S_k, d_model); returns (B, S_q, d_model). (A plain class in the document.)"""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.dk = d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)

    def _heads(self, proj: nn.Linear, x):
        """(B, S, d_model) projected and viewed as (B, num_heads, S, dk)."""
        B, S, _ = x.shape
        return proj(x).view(B, S, self.num_heads, self.dk).transpose(1, 2)

    def forward(self, Q, K, V):
        name = type(self).__name__
        d_model = self.W_q.in_features
        for n, t in (("Q", Q), ("K", K), ("V", V)):
            _check_rank(name, t, (3,), "(B, S, d_model)")
            _check_last(name, t, d_model, n)
        B, S_q, _ = Q.shape
        if V.shape[:2] != K.shape[:2] or K.shape[0] != B:
            raise ValueError(
                f"{name}: K and V must be (B, S_k, d_model) with Q's batch size {B}, "
                f"got K {tuple(K.shape)}, V {tuple(V.shape)}"
            )
        q, k, v = self._heads(self.W_q, Q), self._heads(self.W_k, K), self._heads(self.W_v, V)
        attn = _attend(q, k, v, scale=1.0 / math.sqrt(self.dk), name=name)
        out = attn.transpose(1, 2).reshape(B, S_q, -1)
        return self.W_o(out)


def causal_attention(Q, K, V):
    """Causal attention, ``softmax(Q K^T / sqrt(d_k) + triu(-inf, 1)) V``: query ``i`` sees keys
    ``j <= i`` (top-left aligned, as the document's ``triu`` mask). Inputs of any rank >= 2;
    returns (..., seq_q, d_v)."""
    for n, t in (("Q", Q), ("K", K), ("V", V)):
        if t.dim() < 2:
            raise ValueError(
                f"causal_attention: {n} must be at least 2-D (..., S, D), got {t.dim()}-D "
                f"{tuple(t.shape)}"
            )
    if Q.size(-1) != K.size(-1):
        raise ValueError(
            f"causal_attention: Q and K feature sizes differ: {tuple(Q.shape)} vs {tuple(K.shape)}"
        )
    return _F.scaled_dot_product_attention(Q, K, V, is_causal=True)


class MultiHeadCrossAttention(MultiHeadAttention):
    """Multi-head cross-attention ``forward(x_q, x_kv)``: x_q (B, S_q, d_model) queries
    x_kv (B, S_kv, d_model); returns (B, S_q, d_model). Same constructor and parameters
    (``W_q``, ``W_k``, ``W_v``, ``W_o``) as :class:`MultiHeadAttention`."""

    def forward(self, x_q, x_kv):
        name = type(self).__name__
        d_model = self.W_q.in_features
        for n, t in (("x_q", x_q), ("x_kv", x_kv)):
            _check_rank(name, t, (3,), "(B, S, d_model)")
            _check_last(name, t, d_model, n)
        B, S_q, _ = x_q.shape
        if x_kv.shape[0] != B:
            raise ValueError(
                f"{name}: x_kv batch size must equal x_q's {B}, got {tuple(x_kv.shape)}"
            )
        q, k, v = (
            self._heads(self.W_q, x_q),
            self._heads(self.W_k, x_kv),
            self._heads(self.W_v, x_kv),
        )
        attn = _attend(q, k, v, scale=1.0 / math.sqrt(self.dk), name=name)
        return self.W_o(attn.transpose(1, 2).reshape(B, S_q, -1))


class GroupQueryAttention(nn.Module):
    """Grouped-query self-attention ``forward(x)``, x (B, S, d_model) -> (B, S, d_model).

    ``num_heads`` query heads share ``num_kv_heads`` key/value heads; query head ``h`` reads
    kv head ``h // groups`` (the document's ``repeat_interleave``), which is attn_ext's GQA
    mapping, so K and V are never expanded. (A plain class in the document.)"""

    def __init__(self, d_model, num_heads, num_kv_heads):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.dk = d_model // num_heads
        self.groups = num_heads // num_kv_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, num_kv_heads * self.dk)
        self.W_v = nn.Linear(d_model, num_kv_heads * self.dk)
        self.W_o = nn.Linear(d_model, d_model)

    def forward(self, x):
        name = type(self).__name__
        _check_rank(name, x, (3,), "(B, S, d_model)")
        _check_last(name, x, self.W_q.in_features, "x")
        B, S, _ = x.shape
        q = self.W_q(x).view(B, S, self.num_heads, self.dk).transpose(1, 2)
        k = self.W_k(x).view(B, S, self.num_kv_heads, self.dk).transpose(1, 2)
        v = self.W_v(x).view(B, S, self.num_kv_heads, self.dk).transpose(1, 2)
        attn = _attend(q, k, v, scale=1.0 / math.sqrt(self.dk), gqa=True, name=name)
        return self.W_o(attn.transpose(1, 2).reshape(B, S, -1))


def sliding_window_attention(Q, K, V, window_size):
    """Attention where position ``i`` sees keys ``j`` with ``|i - j| <= window_size``.

    Q, K: (B, S, d_k), V: (B, S, d_v) (one sequence length, as in the document); returns
    (B, S, d_v). ``window_size = 0`` returns V; ``window_size >= S`` is full attention."""
    name = "sliding_window_attention"
    for t in (Q, K, V):
        _check_rank(name, t, (3,), "(B, S, D)")
    if not (Q.size(1) == K.size(1) == V.size(1)):
        raise ValueError(
            f"{name}: Q, K and V must have the same sequence length, got "
            f"{tuple(Q.shape)}, {tuple(K.shape)}, {tuple(V.shape)}"
        )
    w = int(window_size)
    if w != window_size or w < 0:
        raise ValueError(f"{name}: window_size must be a non-negative integer, got {window_size!r}")
    return _attend(Q, K, V, window_size=(w, w), name=name)


def flash_attention(Q, K, V, block_size=32):
    """Exact attention ``softmax(Q K^T / sqrt(D)) V`` (the document's tiled online-softmax loop;
    attn_ext's kernel tiles on its own, so ``block_size`` does not change the result).

    Q: (B, S, D), K: (B, S_k, D), V: (B, S_k, D_v); returns (B, S, D_v) in Q's dtype."""
    name = "flash_attention"
    for t in (Q, K, V):
        _check_rank(name, t, (3,), "(B, S, D)")
    bs = int(block_size)
    if bs != block_size or bs <= 0:
        raise ValueError(f"{name}: block_size must be a positive integer, got {block_size!r}")
    return _attend(Q, K, V, name=name)


class KVCacheAttention(MultiHeadAttention):
    """Multi-head self-attention with a key/value cache, ``forward(x, cache=None)``.

    x (B, S_new, d_model); ``cache`` is ``None`` or the ``(k, v)`` tuple a previous call
    returned, each (B, num_heads, S_past, dk). Returns ``(out, (k, v))``: out
    (B, S_new, d_model) and the cache grown by the new tokens. The new queries sit at the end
    of the sequence (causal, bottom-right), so prefill followed by single-token steps equals
    one full causal forward. Same constructor and parameters (``W_q``, ``W_k``, ``W_v``,
    ``W_o``) as :class:`MultiHeadAttention`."""

    def forward(self, x, cache=None):
        name = type(self).__name__
        _check_rank(name, x, (3,), "(B, S_new, d_model)")
        _check_last(name, x, self.W_q.in_features, "x")
        B, S_new, _ = x.shape
        q, k, v = self._heads(self.W_q, x), self._heads(self.W_k, x), self._heads(self.W_v, x)
        if cache is not None:
            try:
                k_past, v_past = cache
            except (TypeError, ValueError):
                raise ValueError(
                    f"{name}: cache must be the (k, v) tuple a previous call returned, "
                    f"got {type(cache).__name__}"
                ) from None
            want = (B, self.num_heads, self.dk)
            for n, t in (("k", k_past), ("v", v_past)):
                if t.dim() != 4 or (t.size(0), t.size(1), t.size(3)) != want:
                    raise ValueError(
                        f"{name}: cache {n} must be (B, num_heads, S_past, dk) = "
                        f"({B}, {self.num_heads}, S_past, {self.dk}), got {tuple(t.shape)}"
                    )
            k = torch.cat([k_past, k], dim=2)
            v = torch.cat([v_past, v], dim=2)
        attn = _F.attention(q, k, v, scale=1.0 / math.sqrt(self.dk), causal=True)
        return self.W_o(attn.transpose(1, 2).reshape(B, S_new, -1)), (k, v)


def apply_rope(q, k):
    """Rotary position embedding of q and k (B, S, D) at positions ``0..S-1``: pairs
    ``(2i, 2i + 1)`` turn by ``pos / 10000 ** (2i / D)``. Returns ``(q_rot, k_rot)``."""
    name = "apply_rope"
    for t in (q, k):
        _check_rank(name, t, (3,), "(B, S, D)")
    if q.shape != k.shape:
        raise ValueError(
            f"{name}: q and k must have the same shape (B, S, D), got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.size(-1) % 2:
        raise ValueError(f"{name}: the feature size D must be even, got {q.size(-1)}")
    # The document's layout, not attn_ext's default halves.
    return _decoding.rope(q, interleaved=True), _decoding.rope(k, interleaved=True)


def linear_attention(Q, K, V):
    """Linear attention with the feature map ``elu(x) + 1``:
    ``phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j) + 1e-6)`` (non-causal), in O(S * D * D_v).

    Q: (B, S_q, D_k), K: (B, S_k, D_k), V: (B, S_k, D_v) (``torch.bmm`` operands, as in the
    document); returns (B, S_q, D_v)."""
    name = "linear_attention"
    for t in (Q, K, V):
        _check_rank(name, t, (3,), "(B, S, D)")
    return _linear_attention(Q, K, V, eps=1e-6, feature_map="elu+1")
