"""Autoregressive decoding: rotary position embedding and attention of new queries against a KV
cache. Thin wrappers over the registered operators (shapes and arguments only). The caches
themselves live in :mod:`attn_ext.caches`."""

import math
from typing import Any, Dict, Optional, Tuple

import torch

from ._ops import ops as _ops
from .functional import _as_4d

__all__ = ["rope", "rope_", "rope_parameters", "decode_attention"]


# The RoPE variants rope_parameters knows, by Hugging Face's rope_type names.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_parameters(
    rotary_dim: int,
    base: float = 10000.0,
    rope_scaling: Optional[Dict[str, Any]] = None,
    *,
    max_position_embeddings: Optional[int] = None,
    seq_len: Optional[int] = None,
    device=None,
) -> Tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a RoPE variant, for :func:`rope`, :func:`rope_`,
    ``KVCache.append`` and the layers' ``rope_scaling``: ``inv_freq`` (rotary_dim / 2,) float32
    and the factor cos and sin are multiplied by.

    ``rope_scaling`` is a model config's ``rope_scaling`` (or ``rope_parameters``) dict, its
    ``rope_type`` (or ``type``) one of ``ROPE_TYPES``: ``linear`` (``factor``), ``dynamic`` (NTK:
    ``factor``, the base grown for ``seq_len`` past ``max_position_embeddings``), ``yarn``
    (``factor``, ``original_max_position_embeddings``, optional ``beta_fast`` / ``beta_slow`` /
    ``mscale`` / ``mscale_all_dim`` / ``attention_factor`` / ``truncate``: DeepSeek-V2/V3, Qwen
    long context), ``longrope`` (``short_factor`` / ``long_factor`` per pair, chosen by
    ``seq_len``; Phi-3), ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``: Llama 3.1 and later). The arithmetic is Hugging Face
    transformers' (same fp32 operations in the same order, so the same frequencies bit for bit:
    tests/test_rope_scaling.py). ``None`` or ``default``: base's frequencies and 1.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_parameters: rotary_dim must be positive and even, got {rotary_dim}")
    cfg = dict(rope_scaling or {})
    kind = cfg.get("rope_type", cfg.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_parameters: rope_type must be one of {ROPE_TYPES}, got {kind!r}")

    def need(key):
        if cfg.get(key) is None:
            raise ValueError(f"rope_parameters: rope_type {kind!r} needs {key!r}")
        return cfg[key]

    def ramp_exponents():  # 2i / d in fp32, as transformers forms them
        return torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(
            device=device, dtype=torch.float
        )

    def plain(b):
        return 1.0 / (b ** (ramp_exponents() / rotary_dim))

    dim = rotary_dim
    if kind == "default":
        return plain(base), 1.0
    if kind == "linear":
        return plain(base) / need("factor"), 1.0
    if kind == "dynamic":
        factor = need("factor")
        if max_position_embeddings is None:
            raise ValueError("rope_parameters: rope_type 'dynamic' needs max_position_embeddings")
        n = max(seq_len or max_position_embeddings, max_position_embeddings)
        grown = base * ((factor * n / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return plain(grown), 1.0
    if kind == "llama3":
        factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
        old = need("original_max_position_embeddings")
        inv = plain(base)
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    original = need("original_max_position_embeddings")
    factor = cfg.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError(
                f"rope_parameters: rope_type {kind!r} without 'factor' needs "
                "max_position_embeddings"
            )
        factor = max_position_embeddings / original
    attention = cfg.get("attention_factor")
    if kind == "longrope":
        if attention is None:
            attention = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            )
        chosen = need("long_factor") if seq_len and seq_len > original else need("short_factor")
        ext = torch.tensor(chosen, dtype=torch.float32, device=device)
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        return 1.0 / (ext * base**shape), attention

    # yarn
    def mscale_of(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention is None:
        mscale, mscale_all = cfg.get("mscale"), cfg.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all))
        else:
            attention = mscale_of(factor)
    beta_fast, beta_slow = cfg.get("beta_fast") or 32, cfg.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extrapolation = (1 - ramp).to(device=device, dtype=torch.float)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


def _register_rope_variant(module, rotary_dim, base, rope_scaling, max_position_embeddings, device):
    """A layer's scaled RoPE: ``module.rope_inv_freq`` (a buffer, so that it moves with the
    layer; not saved, as it follows from the config; None without ``rope_scaling``) and
    ``module.rope_attention_scaling``."""
    inv_freq, module.rope_attention_scaling = (
        (None, 1.0)
        if rope_scaling is None
        else rope_parameters(
            rotary_dim,
            base,
            rope_scaling,
            max_position_embeddings=max_position_embeddings,
            device=device,
        )
    )
    module.register_buffer("rope_inv_freq", inv_freq, persistent=False)


def rope(
    x: torch.Tensor,
    *,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    base: float = 10000.0,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    inv_freq: Optional[torch.Tensor] = None,
    attention_scaling: float = 1.0,
) -> torch.Tensor:
    """Rotary position embedding of ``x`` (B, H, S, D) or (B, S, D), out of place.

    Pair ``i`` of the first ``rotary_dim`` features (default D) turns by the angle
    ``pos * base ** (-2i / rotary_dim)`` computed in fp32. By default (``interleaved=False``)
    pair ``i`` is the halves ``(i, i + rotary_dim/2)``, the layout of LLaMA, GPT-NeoX, HuggingFace
    ``rotate_half``, FlashAttention and FlashInfer; ``interleaved=True`` rotates the pairs
    ``(2i, 2i + 1)`` (document 000, GPT-J). Token ``s`` of sequence ``b`` is at
    ``pos = positions[b, s]`` (``positions`` int (B, S) or (S,)) or else ``offset + s``.
    Differentiable (the gradient is the inverse rotation); the output keeps ``x``'s strides.

    Scaled variants (linear, dynamic NTK, YaRN, LongRoPE, Llama 3): ``inv_freq``
    (rotary_dim / 2,) replaces ``base ** (-2i / rotary_dim)`` (read in fp32) and both cos and
    sin are multiplied by ``attention_scaling``, which is what Hugging Face's
    ``ROPE_INIT_FUNCTIONS[rope_type](config)`` returns and its rotary embedding applies
    (:func:`attn_ext.rope_parameters` computes both from a ``rope_scaling`` dict).
    """
    x4 = _as_4d("x", x)
    out = _ops.rope(
        x4,
        positions,
        offset=offset,
        base=base,
        interleaved=interleaved,
        rotary_dim=rotary_dim,
        inv_freq=inv_freq,
        attention_scaling=attention_scaling,
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
    inv_freq: Optional[torch.Tensor] = None,
    attention_scaling: float = 1.0,
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
        inv_freq=inv_freq,
        attention_scaling=attention_scaling,
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
