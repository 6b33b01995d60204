"""The canonical multi-head attention layer of attn_ext, for new code.

:class:`MultiHeadAttention` is self or cross attention with grouped key/value heads
(GQA/MQA), bottom-right causal and sliding-window masks, optional bias and attention dropout,
computed by :func:`attn_ext.attention` (or :func:`attn_ext.attention_weights` when the
probabilities are asked for). Heads are split and merged with views: the projected
``(B, S, H * D)`` tensors are read by the kernel as ``(B, H, S, D)`` through
``unflatten(-1, (H, D)).transpose(1, 2)``, never copied; the only copy is the head merge before
the output projection.
"""

from typing import Optional, Tuple

import torch
from torch import nn

from ..functional import attention, attention_with_weights

__all__ = ["MultiHeadAttention"]


def _check_window(window_size) -> Tuple[int, int]:
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(
            f"MultiHeadAttention: window_size must be a pair (left, right), got {window_size!r}"
        ) from None
    if left < -1 or right < -1:
        raise ValueError(
            "MultiHeadAttention: window_size entries must be >= -1 (-1 = unbounded), got "
            f"{window_size!r}"
        )
    return left, right


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention
    ``out_proj(concat_h softmax(q_h k_{g(h)}^T / sqrt(D) + mask) v_{g(h)})``.

    Args:
        embed_dim: model width ``E`` (query input and output features).
        num_heads: query heads ``H``; the head dim is ``D = E // H`` (``E % H == 0``).
        num_kv_heads: key/value heads ``Hkv`` (``H % Hkv == 0``); ``None`` means ``H`` (plain
            multi-head), ``1`` is multi-query attention. Query head ``h`` reads key/value head
            ``h // (H // Hkv)``.
        kdim, vdim: features of the key and value inputs (default ``embed_dim``), for cross
            attention from another model's states.
        bias: whether the four projections have a bias.
        dropout: dropout probability on the attention probabilities, applied in training mode
            only, with ``1/(1-p)`` rescaling.
        causal: bottom-right aligned causal mask: query ``i`` sits at key position
            ``i + Sk - Sq`` (equal to the usual top-left mask when ``Sq == Sk``; what a
            KV-cache prefill needs when ``Sq < Sk``).
        window_size: ``(left, right)`` sliding window around that position, ``-1`` unbounded;
            combined with ``causal`` (which sets ``right = 0``).
        batch_first: inputs and output are ``(B, S, E)`` if True (default), else ``(S, B, E)``.

    Parameters: ``q_proj`` (E -> H*D), ``k_proj`` (kdim -> Hkv*D), ``v_proj`` (vdim -> Hkv*D),
    ``out_proj`` (H*D -> E), all :class:`torch.nn.Linear`. Weights are initialized with
    ``xavier_uniform_`` and biases with zeros, as ``torch.nn.MultiheadAttention`` does.

    ``forward(query, key=None, value=None, *, attn_mask=None, need_weights=False)``:
    ``key`` defaults to ``query`` (self attention) and ``value`` to ``key``. ``attn_mask`` follows
    :func:`attn_ext.attention`: bool with **True = attend** (the opposite of
    ``torch.nn.MultiheadAttention``'s convention) or floating (added to the scores),
    broadcastable to ``(B, H, Sq, Sk)``; it is combined with ``causal``/``window_size``.
    Returns ``out`` with the layout of ``query``, or ``(out, weights)`` when ``need_weights``,
    ``weights`` being the per-head probabilities ``(B, H, Sq, Sk)`` (after dropout in training
    mode, as torch returns them). A query row that can see no key gets zero attention output
    (so ``out`` is the output projection's bias there) and zero gradients, never NaN.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: Optional[int] = None,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        window_size=(-1, -1),
        batch_first: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"MultiHeadAttention: embed_dim and num_heads must be > 0, "
                f"got embed_dim={embed_dim}, num_heads={num_heads}"
            )
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"MultiHeadAttention: embed_dim ({embed_dim}) must be divisible by "
                f"num_heads ({num_heads})"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"MultiHeadAttention: num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout}")
        for name, dim in (("kdim", kdim), ("vdim", vdim)):
            if dim is not None and dim <= 0:
                raise ValueError(f"MultiHeadAttention: {name} must be > 0, got {dim}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout = float(dropout)
        self.causal = bool(causal)
        self.window_size = _check_window(window_size)
        self.batch_first = batch_first
        kw = dict(device=device, dtype=dtype)
        kv_width = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(self.kdim, kv_width, bias=bias, **kw)
        self.v_proj = nn.Linear(self.vdim, kv_width, bias=bias, **kw)
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
            f"num_kv_heads={self.num_kv_heads}"
        )
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.causal:
            s += ", causal=True"
        if self.window_size != (-1, -1):
            s += f", window_size={self.window_size}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if not self.batch_first:
            s += ", batch_first=False"
        return s

    def _check_inputs(self, query, key, value):
        layout = "(B, S, E)" if self.batch_first else "(S, B, E)"
        for name, x, width, attr in (
            ("query", query, self.embed_dim, "embed_dim"),
            ("key", key, self.kdim, "kdim"),
            ("value", value, self.vdim, "vdim"),
        ):
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"MultiHeadAttention: {name} must be a Tensor, got {type(x).__name__}"
                )
            if x.dim() != 3:
                raise ValueError(
                    f"MultiHeadAttention: {name} must be 3-D {layout}, "
                    f"got {x.dim()}-D with shape {tuple(x.shape)}"
                )
            if x.size(-1) != width:
                raise ValueError(
                    f"MultiHeadAttention: {name} must have {width} features ({attr}) in its last "
                    f"dimension, got {x.size(-1)} (shape {tuple(x.shape)})"
                )
        b = 0 if self.batch_first else 1
        if not query.size(b) == key.size(b) == value.size(b):
            raise ValueError(
                f"MultiHeadAttention: query, key and value must have the same batch size, got "
                f"{query.size(b)}, {key.size(b)} and {value.size(b)}"
            )
        s = 1 - b
        if key.size(s) != value.size(s):
            raise ValueError(
                f"MultiHeadAttention: key and value must have the same sequence length, got "
                f"{key.size(s)} and {value.size(s)}"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        *,
        attn_mask: Optional[torch.Tensor] = None,
        need_weights: bool = False,
    ):
        if key is None:
            key = query
        if value is None:
            value = key
        self._check_inputs(query, key, value)
        if not self.batch_first:  # (S, B, E) -> (B, S, E) views
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        # (B, S, H*D) -> (B, H, S, D): views, read in place by the kernel.
        q = self.q_proj(query).unflatten(-1, (H, D)).transpose(1, 2)
        k = self.k_proj(key).unflatten(-1, (Hkv, D)).transpose(1, 2)
        v = self.v_proj(value).unflatten(-1, (Hkv, D)).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            out, weights = attention_with_weights(
                q,
                k,
                v,
                causal=self.causal,
                window_size=self.window_size,
                attn_mask=attn_mask,
                dropout_p=p,
            )
        else:
            out = attention(
                q,
                k,
                v,
                causal=self.causal,
                window_size=self.window_size,
                attn_mask=attn_mask,
                dropout_p=p,
            )
        out = self.out_proj(out.transpose(1, 2).flatten(2))  # merge heads (one copy)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, weights) if need_weights else out
