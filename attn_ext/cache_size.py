"""KV-cache size per token and layer of the attention variants attn_ext offers: what each
decoding cache (attn_ext.KVCache, attn_ext.LatentKVCache, attn_ext.TPAFactorCache) stores for
one token of one layer."""

from typing import Optional

import torch

__all__ = ["kv_cache_bytes"]

_KINDS = ("mha", "gqa", "mqa", "mla", "tpa")


def _positive(kind: str, **dims) -> None:
    for name, value in dims.items():
        if value is None:
            raise ValueError(f"attn_ext.kv_cache_bytes: kind={kind!r} needs {name}")
        if int(value) <= 0:
            raise ValueError(f"attn_ext.kv_cache_bytes: {name} must be positive, got {value}")


def kv_cache_bytes(
    kind: str,
    *,
    num_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    head_dim_v: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    kv_lora_rank: Optional[int] = None,
    qk_rope_head_dim: Optional[int] = None,
    r_k: Optional[int] = None,
    r_v: Optional[int] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Bytes of KV cache per token per layer.

    * ``"mha"``: keys and values of every head, ``num_heads * (head_dim + head_dim_v)``;
    * ``"gqa"``: ``num_kv_heads * (head_dim + head_dim_v)``; ``"mqa"``: one head,
      ``head_dim + head_dim_v``;
    * ``"mla"`` (DeepSeek-V2): the latent and the shared RoPE key,
      ``kv_lora_rank + qk_rope_head_dim`` (576 at the paper's dims);
    * ``"tpa"`` (Tensor Product Attention): the key and value factors,
      ``r_k * (num_heads + head_dim) + r_v * (num_heads + head_dim_v)``;

    values times the size of ``dtype``. ``head_dim_v`` defaults to ``head_dim``.
    """
    if kind not in _KINDS:
        raise ValueError(f"attn_ext.kv_cache_bytes: kind must be one of {_KINDS}, got {kind!r}")
    if head_dim_v is None:
        head_dim_v = head_dim
    if kind == "mha":
        _positive(kind, num_heads=num_heads, head_dim=head_dim, head_dim_v=head_dim_v)
        values = num_heads * (head_dim + head_dim_v)
    elif kind == "gqa":
        _positive(kind, num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v)
        if num_heads is not None and num_heads % num_kv_heads:
            raise ValueError(
                f"attn_ext.kv_cache_bytes: num_heads ({num_heads}) must be a "
                f"multiple of num_kv_heads ({num_kv_heads})"
            )
        values = num_kv_heads * (head_dim + head_dim_v)
    elif kind == "mqa":
        _positive(kind, head_dim=head_dim, head_dim_v=head_dim_v)
        values = head_dim + head_dim_v
    elif kind == "mla":
        _positive(kind, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
        values = kv_lora_rank + qk_rope_head_dim
    else:
        _positive(
            kind, num_heads=num_heads, head_dim=head_dim, head_dim_v=head_dim_v, r_k=r_k, r_v=r_v
        )
        values = r_k * (num_heads + head_dim) + r_v * (num_heads + head_dim_v)
    return values * torch.empty((), dtype=dtype).element_size()
