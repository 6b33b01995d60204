"""Causal self-attention for decoder-only models, with RoPE and a preallocated KV cache.

:class:`DecoderAttention` is the attention layer of a LLaMA/Mistral-style decoder: grouped
key/value heads, rotary position embedding, an optional sliding window, and two ways to run:

* without a cache (training, scoring): causal attention over the whole sequence with
  :func:`attn_ext.attention`;
* with an :class:`attn_ext.KVCache` (generation): the new tokens' keys and values are rotated
  and written into the cache in place by one op, then :func:`attn_ext.decode_attention` reads
  the cache. The cache never grows or moves, so a generation loop allocates nothing per step
  but the projections' outputs.
"""

from typing import Any, Dict, Optional

import torch
from torch import nn

from ..caches import KVCache
from ..decoding import _register_rope_variant, rope, rope_
from ..functional import attention

__all__ = ["DecoderAttention"]


class DecoderAttention(nn.Module):
    r"""Causal multi-head self-attention with GQA/MQA, RoPE and a KV cache.

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (``H % Hkv == 0``; default ``H``; 1 is MQA). Query
            head ``h`` reads key/value head ``h // (H // Hkv)``.
        head_dim: per-head width ``D`` (default ``E // H``).
        bias: whether the projections have a bias (LLaMA: no; Qwen2: q/k/v yes).
        rope_base: RoPE base (``rope_theta``).
        rope_interleaved: ``False`` rotates halves (LLaMA, Mistral, HuggingFace), ``True``
            rotates the pairs ``(2i, 2i + 1)`` (document 000, GPT-J).
        rotary_dim: features rotated per head (default ``D``; partial rotary as in GPT-NeoX).
        rope_scaling: a scaled RoPE variant as a model config's ``rope_scaling`` dict
            (``{"rope_type": "llama3", "factor": 8.0, ...}``; :func:`attn_ext.rope_parameters`
            lists the types), applied by every rotation of this layer; ``None``: plain RoPE.
        max_position_embeddings: the model's context length, for the variants that read it
            (``dynamic``, which is evaluated at this length, and ``yarn`` / ``longrope``
            without ``factor``).
        window_left: sliding window: a query at position ``p`` sees keys ``[p - window_left, p]``
            (``-1`` unbounded; Mistral's ``sliding_window = W`` is ``window_left = W - 1``).
        dropout: attention dropout in training mode (the cache path is inference only).

    Parameters: ``q_proj`` (E -> H*D), ``k_proj`` / ``v_proj`` (E -> Hkv*D), ``o_proj``
    (H*D -> E), all :class:`torch.nn.Linear` (HuggingFace LLaMA's names and shapes).

    ``forward(x, cache=None, *, positions=None, new_lengths=None)``: x (B, S, E) -> (B, S, E).
    Without ``cache`` the tokens are at ``positions`` (int (B, S) or (S,), default ``0..S-1``).
    With ``cache`` (from :meth:`new_cache`) the tokens continue each sequence where it stands;
    ``new_lengths`` (B,) int marks a left-padded prefill, sequence ``b`` owning its last
    ``new_lengths[b]`` tokens (the padding rows' outputs are meaningless).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        *,
        head_dim: Optional[int] = None,
        bias: bool = False,
        rope_base: float = 10000.0,
        rope_interleaved: bool = False,
        rotary_dim: Optional[int] = None,
        rope_scaling: Optional[Dict[str, Any]] = None,
        max_position_embeddings: Optional[int] = None,
        window_left: int = -1,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        name = type(self).__name__
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"{name}: num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"{name}: embed_dim ({embed_dim}) must be divisible by num_heads "
                    f"({num_heads}) when head_dim is not given"
                )
            head_dim = embed_dim // num_heads
        rot = head_dim if rotary_dim is None else rotary_dim
        if rot % 2 or not 0 <= rot <= head_dim:
            raise ValueError(
                f"{name}: rotary_dim must be even and in [0, head_dim = {head_dim}], got {rot}"
            )
        if window_left < -1:
            raise ValueError(
                f"{name}: window_left must be >= -1 (-1 = unbounded), got {window_left}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"{name}: dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim, self.rotary_dim, self.window_left = head_dim, rot, window_left
        self.rope_base, self.rope_interleaved, self.dropout = (
            float(rope_base),
            rope_interleaved,
            dropout,
        )
        _register_rope_variant(self, rot, rope_base, rope_scaling, max_position_embeddings, device)
        kw = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **kw)

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype=None,
        device=None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> KVCache:
        """An empty :class:`attn_ext.KVCache` sized for this layer (default: its weights' dtype
        and device; ``dtype=torch.float8_e4m3fn`` with ``k_scale`` / ``v_scale`` for a float8
        cache on the CPU)."""
        w = self.k_proj.weight
        return KVCache(
            batch_size,
            self.num_kv_heads,
            max_len,
            self.head_dim,
            dtype=dtype or w.dtype,
            device=device or w.device,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def _rope_kw(self):
        return dict(
            base=self.rope_base,
            interleaved=self.rope_interleaved,
            rotary_dim=self.rotary_dim,
            inv_freq=self.rope_inv_freq,
            attention_scaling=self.rope_attention_scaling,
        )

    def _heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        # (B, S, heads * D) -> (B, heads, S, D) as a view: the kernels read it strided.
        return t.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[KVCache] = None,
        *,
        positions: Optional[torch.Tensor] = None,
        new_lengths: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        name = type(self).__name__
        if x.dim() != 3 or x.size(-1) != self.embed_dim:
            raise ValueError(
                f"{name}: x must be (B, S, embed_dim = {self.embed_dim}), got {tuple(x.shape)}"
            )
        B, S, _ = x.shape
        q = self._heads(self.q_proj(x), self.num_heads)
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        if cache is None:
            if new_lengths is not None:
                raise ValueError(f"{name}: new_lengths needs a cache")
            q = rope(q, positions=positions, **self._rope_kw())
            k = rope(k, positions=positions, **self._rope_kw())
            p = self.dropout if self.training else 0.0
            out = attention(q, k, v, causal=True, window_size=(self.window_left, 0), dropout_p=p)
        else:
            if positions is not None:
                raise ValueError(
                    f"{name}: with a cache the positions follow the cache's lengths; "
                    "do not pass positions"
                )
            pos = cache.positions(S, new_lengths)
            if torch.is_grad_enabled() and q.requires_grad:
                q = rope(q, positions=pos, **self._rope_kw())
            else:  # q is this call's own projection: rotate it where it lies
                rope_(q, positions=pos, **self._rope_kw())
            cache.append(
                k,
                v,
                new_lengths=new_lengths,
                rope=True,
                rope_base=self.rope_base,
                rope_interleaved=self.rope_interleaved,
                rotary_dim=self.rotary_dim,
                rope_inv_freq=self.rope_inv_freq,
                rope_attention_scaling=self.rope_attention_scaling,
            )
            out = cache.attend(q, window_left=self.window_left)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"rotary_dim={self.rotary_dim}, rope_base={self.rope_base}, "
            f"rope_interleaved={self.rope_interleaved}, window_left={self.window_left}"
        )
