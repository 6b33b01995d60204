"""Autoregressive decoding: rotary position embedding and attention of new queries against a KV
cache. Thin wrappers over the registered operators (shapes and arguments only). The caches
themselves live in :mod:`attn_ext.caches`."""

from typing import Optional

import torch

from ._ops import ops as _ops
from .functional import _as_4d

__all__ = ["rope", "rope_", "decode_attention"]


def rope(
    x: torch.Tensor,
    *,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    base: float = 10000.0,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
) -> torch.Tensor:
    """Rotary position embedding of ``x`` (B, H, S, D) or (B, S, D), out of place.

    Pair ``i`` of the first ``rotary_dim`` features (default D) turns by the angle
    ``pos * base ** (-2i / rotary_dim)`` computed in fp32. By default (``interleaved=False``)
    pair ``i`` is the halves ``(i, i + rotary_dim/2)``, the layout of LLaMA, GPT-NeoX, HuggingFace
    ``rotate_half``, FlashAttention and FlashInfer; ``interleaved=True`` rotates the pairs
    ``(2i, 2i + 1)`` (document 000, GPT-J). Token ``s`` of sequence ``b`` is at
    ``pos = positions[b, s]`` (``positions`` int (B, S) or (S,)) or else ``offset + s``.
    Differentiable (the gradient is the inverse rotation); the output keeps ``x``'s strides.
    """
    x4 = _as_4d("x", x)
    out = _ops.rope(
        x4, positions, offset=offset, base=base, interleaved=interleaved, rotary_dim=rotary_dim
    )
    return out.squeeze(1) if x.dim() == 3 else out


def rope_(
    x: torch.Tensor,
    *,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    base: float = 10000.0,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
) -> torch.Tensor:
    """In-place :func:`rope`; returns ``x``. Not differentiable (use :func:`rope` in training)."""
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "attn_ext.rope_: in-place RoPE is not differentiable and x requires "
            "grad; use attn_ext.rope (out of place) or torch.no_grad()"
        )
    _ops.rope_(
        _as_4d("x", x),
        positions,
        offset=offset,
        base=base,
        interleaved=interleaved,
        rotary_dim=rotary_dim,
    )
    return x


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    window_left: int = -1,
    num_splits: int = 0,
    return_lse: bool = False,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """Attention of ``Sq`` new queries against a KV cache with per-sequence lengths.

    q: (B, H, Sq, D); k_cache: (B, Hkv, L, D); v_cache: (B, Hkv, L, Dv) (any strides with the
    last dimension contiguous, e.g. a view of a wider cache); cache_seqlens: (B,) int, the
    number of valid rows of each sequence, *including* the new tokens (append first). Query
    ``i`` of sequence ``b`` sits at key position ``cache_seqlens[b] - Sq + i`` (bottom-right) and
    sees keys ``[pos - window_left, pos]`` (``causal``) or all valid keys from
    ``pos - window_left`` (``causal=False``); ``-1`` is unbounded. GQA/MQA read each cache row
    once for all the query heads sharing it. ``num_splits`` splits the key sequence for short
    batches (0 = automatic); partial results are merged by their log-sum-exp.

    ``window_right`` (``causal=False`` only; ``causal`` ends the band at ``pos`` whatever it
    says) bounds the keys after ``pos``: keys ``[pos - window_left, min(pos + window_right,
    len_b - 1)]``. ``softcap``, ``alibi_slopes`` ((H,) or (B, H); bias ``-slope * |pos - j|``
    for key ``j``) and ``sinks`` (H,) as in :func:`attention`: lse includes the sink, and a row
    that sees no key gives out 0 and lse = its head's sink (``-inf`` without sinks).
    FlashAttention's ``with_kvcache`` arguments: ``cache_batch_idx`` (B,) int32 (or int64),
    sequence b reads cache batch row ``cache_batch_idx[b]`` (the cache may hold more rows than
    B); ``cache_leftpad`` (B,) int32 (or int64), sequence b's keys are cache rows
    ``[cache_leftpad[b], cache_seqlens[b])`` (its queries still sit at ``cache_seqlens[b] - Sq +
    i``; the keys before are never seen). The CPU op checks their values; a CUDA op cannot read
    them without a sync and clamps them into range instead. (On CUDA, where the SIMT kernel runs
    the call (float64, head dims other than ``D == Dv`` in {64, 128, 256}, rows not 16-byte
    aligned), ``window_right``, the score modifiers and these two raise until
    ``ATTN_EXT_UNVERIFIED_CUDA=1`` opts in: that kernel code has not yet run on a GPU. The
    split-KV kernel, which serves the other calls, runs them by default.)

    Paged cache (``block_table`` (B, max_pages) int32 on the cache's device, rows contiguous):
    k_cache (num_pages, Hkv, page_size, D) and v_cache (num_pages, Hkv, page_size, Dv) (vLLM /
    FlashAttention's ``(num_pages, page_size, Hkv, D)`` pages ``.transpose(1, 2)`` are read in
    place); row ``t`` of sequence ``b`` is row ``t % page_size`` of page ``block_table[b, t //
    page_size]``, so each sequence holds up to ``max_pages * page_size`` rows and two sequences
    may share a page. Not together with ``cache_batch_idx``. The CPU op checks that every entry
    covering ``[0, cache_seqlens[b])`` is a page of the cache (a CUDA op clamps the entries into
    the cache instead); :class:`attn_ext.PagedKVCache` manages the pages. On CUDA the split-KV
    kernel reads the pages in place; a call it does not serve gathers them into contiguous rows
    for the SIMT kernel (one copy of the cache per call).

    Float8 cache (CPU): k_cache and v_cache of ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``
    (both the same; q of any floating dtype) hold ``K / k_scale`` and ``V / v_scale``, as
    ``kv_cache_append`` with the same scales writes them; the call attends to ``k_scale *
    k_cache`` and ``v_scale * v_cache`` (each row read and widened where it lies: half the
    bytes of a bf16 cache per step). ``k_scale`` / ``v_scale`` other than 1 need a float8 cache.

    Returns ``out`` (B, H, Sq, Dv), or ``(out, lse)`` with lse float32 (B, H, Sq). Inference
    only: not differentiable.
    """
    out, lse = _ops.decode_attention(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        scale=scale,
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        num_splits=num_splits,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=block_table,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return (out, lse) if return_lse else out


def __getattr__(name: str):
    # KVCache and LatentKVCache were defined here before the decoding state moved to
    # attn_ext.caches; resolved on first use because attn_ext.caches imports this module.
    if name in ("KVCache", "LatentKVCache"):
        from . import caches

        return getattr(caches, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
