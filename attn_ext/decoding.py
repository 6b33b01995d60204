"""Autoregressive decoding: rotary position embedding, a preallocated KV cache and attention of
new queries against it. Thin wrappers over the registered operators (shapes and arguments
only)."""
from typing import List, Optional, Tuple

import torch

from .functional import _as_4d

_ops = torch.ops.attn_ext

__all__ = ["rope", "rope_", "decode_attention", "KVCache", "LatentKVCache"]


def rope(x: torch.Tensor, *, positions: Optional[torch.Tensor] = None, offset: int = 0,
         base: float = 10000.0, interleaved: bool = False,
         rotary_dim: Optional[int] = None) -> torch.Tensor:
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
    out = _ops.rope(x4, positions, offset=offset, base=base, interleaved=interleaved,
                    rotary_dim=rotary_dim)
    return out.squeeze(1) if x.dim() == 3 else out


def rope_(x: torch.Tensor, *, positions: Optional[torch.Tensor] = None, offset: int = 0,
          base: float = 10000.0, interleaved: bool = False,
          rotary_dim: Optional[int] = None) -> torch.Tensor:
    """In-place :func:`rope`; returns ``x``. Not differentiable (use :func:`rope` in training)."""
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("attn_ext.rope_: in-place RoPE is not differentiable and x requires "
                           "grad; use attn_ext.rope (out of place) or torch.no_grad()")
    _ops.rope_(_as_4d("x", x), positions, offset=offset, base=base, interleaved=interleaved,
               rotary_dim=rotary_dim)
    return x


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, *, scale: Optional[float] = None,
                     causal: bool = True, window_left: int = -1, num_splits: int = 0,
                     return_lse: bool = False):
    """Attention of ``Sq`` new queries against a KV cache with per-sequence lengths.

    q: (B, H, Sq, D); k_cache: (B, Hkv, L, D); v_cache: (B, Hkv, L, Dv) (any strides with the
    last dimension contiguous, e.g. a view of a wider cache); cache_seqlens: (B,) int, the
    number of valid rows of each sequence, *including* the new tokens (append first). Query
    ``i`` of sequence ``b`` sits at key position ``cache_seqlens[b] - Sq + i`` (bottom-right) and
    sees keys ``[pos - window_left, pos]`` (``causal``) or all valid keys from
    ``pos - window_left`` (``causal=False``); ``-1`` is unbounded. GQA/MQA read each cache row
    once for all the query heads sharing it. ``num_splits`` splits the key sequence for short
    batches (0 = automatic); partial results are merged by their log-sum-exp.

    Returns ``out`` (B, H, Sq, Dv), or ``(out, lse)`` with lse float32 (B, H, Sq). Inference
    only: not differentiable.
    """
    out, lse = _ops.decode_attention(q, k_cache, v_cache, cache_seqlens, scale=scale,
                                     causal=causal, window_left=window_left,
                                     num_splits=num_splits)
    return (out, lse) if return_lse else out


class KVCache:
    """A preallocated key/value cache for incremental decoding.

    ``k`` (B, Hkv, max_len, D) and ``v`` (B, Hkv, max_len, Dv) are allocated once; ``lengths``
    (B,) int32 on the same device counts the valid rows of each sequence. :meth:`append` writes
    new keys/values in place at each sequence's length (optionally rotating the keys by RoPE at
    their cache positions) and raises, writing nothing, if a sequence would overflow
    ``max_len``. :meth:`attend` runs :func:`decode_attention` against the cache.

    Each (batch, head) block of rows is contiguous, so a step reads each sequence's keys and
    values as one stream; per-sequence lengths let a batch hold prompts of different lengths.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 head_dim_v: Optional[int] = None, *, dtype: Optional[torch.dtype] = None,
                 device=None):
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("max_len", max_len), ("head_dim", head_dim)):
            if int(value) < 0:
                raise ValueError(f"attn_ext.KVCache: {name} must be >= 0, got {value}")
        dv = head_dim if head_dim_v is None else head_dim_v
        self.k = torch.zeros(batch_size, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch_size, num_kv_heads, max_len, dv, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=self.k.device)
        # A GPU op cannot read the lengths without synchronizing, so on a GPU the cache keeps a
        # host copy to refuse an overflowing append with a clear error (the CPU op checks the
        # tensor itself). Change `lengths` through the methods only.
        self._host_lengths = [0] * batch_size

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    @property
    def batch_size(self) -> int:
        return self.k.size(0)

    def reset(self) -> None:
        """Forgets every sequence (the memory is kept)."""
        self.lengths.zero_()
        self._host_lengths = [0] * self.batch_size

    def _room_after(self, k: torch.Tensor, new_lengths: Optional[torch.Tensor]) -> Tuple[List[int], Optional[str]]:
        """The host lengths after appending k, and why the append must fail (None if it fits).
        Raised after the op has validated its inputs, so that a bad input gets the op's own
        error, as on the CPU (a GPU append that does not fit writes nothing)."""
        if k.dim() != 4:  # the op reports the shape error
            return self._host_lengths, None
        s_new = k.size(2)
        add = [s_new] * self.batch_size if new_lengths is None else [int(n) for n in new_lengths.cpu()]
        if len(add) != self.batch_size:
            return self._host_lengths, None
        for b, (n, a) in enumerate(zip(self._host_lengths, add)):
            if not 0 <= a <= s_new:
                return self._host_lengths, f"attn_ext.kv_cache_append: new_lengths[{b}] must be in [0, {s_new}], got {a}"
            if n + a > self.max_len:
                return self._host_lengths, (f"attn_ext.kv_cache_append: sequence {b} would overflow the cache: "
                                            f"length {n} + {a} new tokens > capacity {self.max_len} (nothing was written)")
        return [n + a for n, a in zip(self._host_lengths, add)], None

    def positions(self, seqlen: int, new_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, seqlen) int64 positions of the next ``seqlen`` tokens of each sequence, the
        first ``seqlen - new_lengths[b]`` of them left padding (negative positions)."""
        steps = torch.arange(seqlen, device=self.lengths.device, dtype=torch.int64)
        start = self.lengths.to(torch.int64)
        if new_lengths is not None:
            start = start - (seqlen - new_lengths.to(torch.int64))
        return start[:, None] + steps

    def append(self, k: torch.Tensor, v: torch.Tensor, *, new_lengths: Optional[torch.Tensor] = None,
               rope: bool = False, rope_base: float = 10000.0, rope_interleaved: bool = False,
               rotary_dim: Optional[int] = None) -> None:
        """Writes k (B, Hkv, S_new, D) and v (B, Hkv, S_new, Dv) at each sequence's length and
        advances ``lengths``. ``new_lengths`` (B,) int: sequence ``b`` appends only its last
        ``new_lengths[b]`` tokens (left-padded batches). ``rope=True`` rotates the keys at their
        cache positions on the way in, with the pair layout of :func:`attn_ext.rope` (halves by
        default, ``rope_interleaved=True`` for the pairs ``(2i, 2i + 1)``)."""
        on_host = self.k.device.type == "cpu"
        after, refusal = (None, None) if on_host else self._room_after(k, new_lengths)
        _ops.kv_cache_append(self.k, self.v, self.lengths, k, v, new_lengths, rope=rope,
                             rope_base=rope_base, rope_interleaved=rope_interleaved,
                             rotary_dim=rotary_dim)
        if refusal is not None:
            raise RuntimeError(refusal)
        if after is not None:
            self._host_lengths = after

    def attend(self, q: torch.Tensor, *, scale: Optional[float] = None, causal: bool = True,
               window_left: int = -1, num_splits: int = 0, return_lse: bool = False):
        """:func:`decode_attention` of q (B, H, Sq, D) against this cache."""
        return decode_attention(q, self.k, self.v, self.lengths, scale=scale, causal=causal,
                                window_left=window_left, num_splits=num_splits,
                                return_lse=return_lse)

    def __repr__(self) -> str:
        B, Hkv, L, D = self.k.shape
        return (f"KVCache(batch_size={B}, num_kv_heads={Hkv}, max_len={L}, head_dim={D}, "
                f"head_dim_v={self.v.size(3)}, dtype={self.k.dtype}, device={self.k.device})")


class LatentKVCache(KVCache):
    """The compressed cache of Multi-head Latent Attention (DeepSeek-V2 §2.1): per token only
    the latent ``c_kv`` (``kv_lora_rank`` values) and the RoPE-rotated shared key ``k_rope``
    (``rope_dim`` values), in one buffer ``kv`` (B, 1, max_len, kv_lora_rank + rope_dim) laid
    out ``[c_kv, k_rope]``.

    The buffer is the single key head of width ``kv_lora_rank + rope_dim`` that the absorbed
    decode attends to (``self.k``), and its first ``kv_lora_rank`` columns are the values
    (``self.v``, a strided view of the same memory, never a copy). :meth:`append` writes both
    parts with one ``kv_cache_append`` call whose "keys" are the ``k_rope`` columns (rotated at
    the cache positions on the way in) and whose "values" are the ``c_kv`` columns.
    """

    def __init__(self, batch_size: int, max_len: int, kv_lora_rank: int, rope_dim: int, *,
                 dtype: Optional[torch.dtype] = None, device=None):
        for name, value in (("batch_size", batch_size), ("max_len", max_len),
                            ("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
            if int(value) < 0:
                raise ValueError(f"attn_ext.LatentKVCache: {name} must be >= 0, got {value}")
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.kv = torch.zeros(batch_size, 1, max_len, kv_lora_rank + rope_dim, dtype=dtype,
                              device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=self.kv.device)
        self._host_lengths = [0] * batch_size
        # Host-side: no append since construction or reset (a prompt can then skip the cache;
        # kept off the device so that checking it neither synchronizes nor breaks a graph).
        self._empty = True

    @property
    def empty(self) -> bool:
        """True until the first :meth:`append` after construction or :meth:`reset`."""
        return self._empty

    def reset(self) -> None:
        super().reset()
        self._empty = True

    # The views are taken on access, not stored: a view kept across an in-place append would
    # have to be replayed by torch.compile's functionalization, which fails for these strides.
    @property
    def k(self) -> torch.Tensor:
        """The key head [c_kv, k_rope] (B, 1, max_len, kv_lora_rank + rope_dim): the buffer."""
        return self.kv

    @property
    def v(self) -> torch.Tensor:
        """The values: the ``c_kv`` columns (B, 1, max_len, kv_lora_rank), a view."""
        return self.kv[..., :self.kv_lora_rank]

    @property
    def latent(self) -> torch.Tensor:
        """The ``c_kv`` columns (B, 1, max_len, kv_lora_rank), a view (same as :attr:`v`)."""
        return self.v

    @property
    def rope_key(self) -> torch.Tensor:
        """The rotated ``k_rope`` columns (B, 1, max_len, rope_dim), a view."""
        return self.kv[..., self.kv_lora_rank:]

    def append(self, c_kv: torch.Tensor, k_rope: torch.Tensor, *,
               new_lengths: Optional[torch.Tensor] = None, rope_base: float = 10000.0,
               rope_interleaved: bool = False) -> None:
        """Writes c_kv (B, 1, S_new, kv_lora_rank) and the not yet rotated k_rope
        (B, 1, S_new, rope_dim) at each sequence's length, rotating k_rope by RoPE at its
        cache position (halves by default; DeepSeek-V2 checkpoints need
        ``rope_interleaved=True``, which :class:`attn_ext.nn.MultiHeadLatentAttention` passes), and
        advances ``lengths`` (``new_lengths`` as in :meth:`KVCache.append`)."""
        on_host = self.kv.device.type == "cpu"
        after, refusal = (None, None) if on_host else self._room_after(c_kv, new_lengths)
        _ops.latent_cache_append(self.kv, self.lengths, c_kv, k_rope, new_lengths,
                                 rope_base=rope_base, rope_interleaved=rope_interleaved)
        if refusal is not None:
            raise RuntimeError(refusal.replace("kv_cache_append", "latent_cache_append"))
        self._empty = False
        if after is not None:
            self._host_lengths = after

    def __repr__(self) -> str:
        B, _, L, _ = self.kv.shape
        return (f"LatentKVCache(batch_size={B}, max_len={L}, kv_lora_rank={self.kv_lora_rank}, "
                f"rope_dim={self.rope_dim}, dtype={self.kv.dtype}, device={self.kv.device})")
