"""The state a model keeps between decoding steps, in one place: a preallocated key/value cache
(:class:`KVCache`), MLA's compressed latent cache (:class:`LatentKVCache`), Tensor Product
Attention's factor cache (:class:`TPAFactorCache`) and linear attention's fixed-size running sums
(:class:`LinearAttentionState`, the linear-attention counterpart of a cache).

The caches allocate their memory once and are written in place by the registered append
operators (``kv_cache_append``, ``latent_cache_append``); each keeps a host copy of the lengths
so that an append on a GPU can refuse an overflow without waiting for the device. All four are
importable from the package top level (``attn_ext.KVCache``, ...).
"""

import math
from typing import List, NamedTuple, Optional, Tuple

import torch

from ._ops import ops as _ops
from .decoding import decode_attention

__all__ = [
    "KVCache",
    "PagedKVCache",
    "LatentKVCache",
    "PagedLatentKVCache",
    "TPAFactorCache",
    "LinearAttentionState",
]

# A block_table entry past a sequence's pages: never read (the ops read only the entries that
# cover a sequence's rows), and out of range, so a bug that did read it would be caught.
_NO_PAGE = -1
# The sizes of a paged cache that must be at least 1 (the others at least 0).
_PAGE_POOL_SIZES = ("num_pages", "page_size")


def _check_sizes(owner: str, positive: Tuple[str, ...] = (), **sizes) -> None:
    """Raises ValueError naming the first size below its least value: 1 for the names in
    ``positive`` (a page pool needs a page, a page a row), 0 for the others."""
    for name, value in sizes.items():
        least = 1 if name in positive else 0
        if int(value) < least:
            raise ValueError(f"attn_ext.{owner}: {name} must be >= {least}, got {value}")


_FLOAT8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_scales(owner: str, dtype: torch.dtype, **scales) -> Tuple[float, ...]:
    """A cache's scales (by name, in order) as floats: positive and finite, and 1 unless the
    cache is float8 (the append and decode ops check the same, at the first call)."""
    checked = []
    for name, s in scales.items():
        s = float(s)
        if not (math.isfinite(s) and s > 0.0):
            raise ValueError(f"{owner}: {name} must be positive and finite, got {s}")
        if s != 1.0 and dtype not in _FLOAT8_CACHE_DTYPES:
            raise ValueError(
                f"{owner}: {name} applies to float8_e4m3fn / float8_e5m2 caches only, got "
                f"{name}={s} with dtype {dtype}"
            )
        checked.append(s)
    return tuple(checked)


def _room_after(
    host_lengths: List[int], capacity: int, k: torch.Tensor, new_lengths: Optional[torch.Tensor]
) -> Tuple[List[int], Optional[str]]:
    """The host lengths after appending k, and why the append must fail (None if it fits).
    Raised after the op has validated its inputs, so that a bad input gets the op's own
    error, as on the CPU (a GPU append that does not fit writes nothing)."""
    if k.dim() != 4:  # the op reports the shape error
        return host_lengths, None
    s_new, batch = k.size(2), len(host_lengths)
    add = [s_new] * batch if new_lengths is None else [int(n) for n in new_lengths.cpu()]
    if len(add) != batch:
        return host_lengths, None
    for b, (n, a) in enumerate(zip(host_lengths, add)):
        if not 0 <= a <= s_new:
            return (
                host_lengths,
                f"attn_ext.kv_cache_append: new_lengths[{b}] must be in [0, {s_new}], got {a}",
            )
        if n + a > capacity:
            return host_lengths, (
                f"attn_ext.kv_cache_append: sequence {b} would overflow the cache: "
                f"cache_seqlens[{b}] = {n} + {a} new tokens > capacity {capacity} "
                "(nothing was written)"
            )
    return [n + a for n, a in zip(host_lengths, add)], None


class KVCache:
    """A preallocated key/value cache for incremental decoding.

    ``k`` (B, Hkv, max_len, D) and ``v`` (B, Hkv, max_len, Dv) are allocated once; ``lengths``
    (B,) int32 on the same device counts the valid rows of each sequence. :meth:`append` writes
    new keys/values in place at each sequence's length (optionally rotating the keys by RoPE at
    their cache positions) and raises, writing nothing, if a sequence would overflow
    ``max_len``. :meth:`attend` runs :func:`decode_attention` against the cache.

    Each (batch, head) block of rows is contiguous, so a step reads each sequence's keys and
    values as one stream; per-sequence lengths let a batch hold prompts of different lengths.

    ``dtype=torch.float8_e4m3fn`` (or ``torch.float8_e5m2``) keeps a quantized cache (CPU): the
    cache holds ``K / k_scale`` and ``V / v_scale``, rounded and saturated at the format's
    largest value by :meth:`append` (keys and values of any floating dtype), and :meth:`attend`
    attends to the scaled values; half the memory and the bytes per step of a bf16 cache.
    ``k_scale`` / ``v_scale`` should put the largest magnitudes near the format's range (448
    for e4m3fn); 1 by default, as vLLM's fp8 caches.
    """

    # The rows are found by position, not through a page table (PagedKVCache has one).
    block_table: Optional[torch.Tensor] = None
    # A float8 cache's scales (1: the cache holds the values themselves, as the latent caches').
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        head_dim_v: Optional[int] = None,
        *,
        dtype: Optional[torch.dtype] = None,
        device=None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ):
        _check_sizes(
            "KVCache",
            batch_size=batch_size,
            num_kv_heads=num_kv_heads,
            max_len=max_len,
            head_dim=head_dim,
        )
        dv = head_dim if head_dim_v is None else head_dim_v
        self.k = torch.zeros(
            batch_size, num_kv_heads, max_len, head_dim, dtype=dtype, device=device
        )
        self.v = torch.zeros(batch_size, num_kv_heads, max_len, dv, dtype=dtype, device=device)
        self.k_scale, self.v_scale = _check_scales(
            "KVCache", self.k.dtype, k_scale=k_scale, v_scale=v_scale
        )
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

    def _room_after(
        self, k: torch.Tensor, new_lengths: Optional[torch.Tensor]
    ) -> Tuple[List[int], Optional[str]]:
        return _room_after(self._host_lengths, self.max_len, k, new_lengths)

    def positions(self, seqlen: int, new_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, seqlen) int64 positions of the next ``seqlen`` tokens of each sequence, the
        first ``seqlen - new_lengths[b]`` of them left padding (negative positions)."""
        steps = torch.arange(seqlen, device=self.lengths.device, dtype=torch.int64)
        start = self.lengths.to(torch.int64)
        if new_lengths is not None:
            start = start - (seqlen - new_lengths.to(torch.int64))
        return start[:, None] + steps

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        new_lengths: Optional[torch.Tensor] = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        rope_interleaved: bool = False,
        rotary_dim: Optional[int] = None,
        rope_inv_freq: Optional[torch.Tensor] = None,
        rope_attention_scaling: float = 1.0,
    ) -> None:
        """Writes k (B, Hkv, S_new, D) and v (B, Hkv, S_new, Dv) at each sequence's length and
        advances ``lengths``. ``new_lengths`` (B,) int: sequence ``b`` appends only its last
        ``new_lengths[b]`` tokens (left-padded batches). ``rope=True`` rotates the keys at their
        cache positions on the way in, with the pair layout of :func:`attn_ext.rope` (halves by
        default, ``rope_interleaved=True`` for the pairs ``(2i, 2i + 1)``) and, for a scaled
        variant, its ``rope_inv_freq`` / ``rope_attention_scaling`` (:func:`attn_ext.rope`'s
        ``inv_freq`` / ``attention_scaling``)."""
        on_host = self.k.device.type == "cpu"
        after, refusal = (None, None) if on_host else self._room_after(k, new_lengths)
        _ops.kv_cache_append(
            self.k,
            self.v,
            self.lengths,
            k,
            v,
            new_lengths,
            rope=rope,
            rope_base=rope_base,
            rope_interleaved=rope_interleaved,
            rotary_dim=rotary_dim,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            rope_inv_freq=rope_inv_freq,
            rope_attention_scaling=rope_attention_scaling,
        )
        if refusal is not None:
            raise RuntimeError(refusal)
        if after is not None:
            self._host_lengths = after

    def attend(
        self,
        q: torch.Tensor,
        *,
        scale: Optional[float] = None,
        causal: bool = True,
        window_left: int = -1,
        num_splits: int = 0,
        return_lse: bool = False,
    ):
        """:func:`decode_attention` of q (B, H, Sq, D) against this cache (through its block
        table if it has one)."""
        return decode_attention(
            q,
            self.k,
            self.v,
            self.lengths,
            scale=scale,
            causal=causal,
            window_left=window_left,
            num_splits=num_splits,
            return_lse=return_lse,
            block_table=self.block_table,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def __repr__(self) -> str:
        B, Hkv, L, D = self.k.shape
        return (
            f"KVCache(batch_size={B}, num_kv_heads={Hkv}, max_len={L}, head_dim={D}, "
            f"head_dim_v={self.v.size(3)}, dtype={self.k.dtype}, device={self.k.device})"
        )


class PagedKVCache:
    """A paged key/value cache (vLLM's PagedAttention layout): a pool of ``num_pages`` pages of
    ``page_size`` rows, handed to sequences as they grow, so that memory follows the tokens
    actually held instead of ``max_len`` per sequence.

    ``k`` (num_pages, Hkv, page_size, D) and ``v`` (num_pages, Hkv, page_size, Dv) are allocated
    once; ``block_table`` (max_batch, max_pages_per_seq) int32 maps sequence ``b``'s row ``t`` to
    row ``t % page_size`` of page ``block_table[b, t // page_size]`` (entries past a sequence's
    pages are -1); ``lengths`` (max_batch,) int32 counts each sequence's rows. The pages are
    allocated on the host, before the operator runs: :meth:`append` takes the pages the new
    rows need from the free list and then writes through ``kv_cache_append``; it raises,
    writing nothing and taking no page, if a sequence would pass ``max_pages_per_seq *
    page_size`` rows or the pool has too few free pages. :meth:`release` returns a finished
    sequence's pages; :meth:`attend` runs :func:`decode_attention` through the table.

    Prefix sharing / beam search: two sequences may point at the same page (a page is free
    again once no sequence holds it). :meth:`fork` shares a sequence's full pages with another
    slot and copies only its partly filled last page, so both may append. A page shared any
    other way (a block_table edited by hand) is written by whichever sequence appends into it,
    and every sharer sees the write: copy-on-write is the caller's business.

    On CUDA the paged kernels read the pages in place for bf16 / fp16 / fp32 with ``head_dim ==
    head_dim_v`` in {64, 128, 256}; other decode calls gather the pages into contiguous rows
    first (one copy of the cache per call).

    ``dtype``, ``k_scale``, ``v_scale``: a float8 cache (CPU), as for :class:`KVCache`.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        head_dim_v: Optional[int] = None,
        *,
        max_batch: int,
        max_pages_per_seq: int,
        dtype: Optional[torch.dtype] = None,
        device=None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ):
        _check_sizes(
            "PagedKVCache",
            _PAGE_POOL_SIZES,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_batch=max_batch,
            max_pages_per_seq=max_pages_per_seq,
        )
        dv = head_dim if head_dim_v is None else head_dim_v
        kw = dict(dtype=dtype, device=device)
        self.k = torch.zeros(num_pages, num_kv_heads, page_size, head_dim, **kw)
        self.v = torch.zeros(num_pages, num_kv_heads, page_size, dv, **kw)
        self.k_scale, self.v_scale = _check_scales(
            "PagedKVCache", self.k.dtype, k_scale=k_scale, v_scale=v_scale
        )
        self._init_table(max_batch, max_pages_per_seq, self.k.device)

    def _init_table(self, max_batch: int, max_pages_per_seq: int, device) -> None:
        """The block table and lengths of ``max_batch`` empty sequences (the pages exist)."""
        self.block_table = torch.full(
            (max_batch, max_pages_per_seq), _NO_PAGE, dtype=torch.int32, device=device
        )
        self.lengths = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.reset()

    @property
    def page_size(self) -> int:
        return self.k.size(2)

    @property
    def num_pages(self) -> int:
        return self.k.size(0)

    @property
    def batch_size(self) -> int:
        return self.block_table.size(0)

    @property
    def max_len(self) -> int:
        """The rows one sequence can hold: ``max_pages_per_seq * page_size``."""
        return self.block_table.size(1) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages(self, b: int) -> List[int]:
        """The pages of sequence ``b``, in row order (a copy)."""
        return list(self._pages[b])

    def reset(self) -> None:
        """Forgets every sequence and returns every page to the pool (the memory is kept)."""
        self.lengths.zero_()
        self.block_table.fill_(_NO_PAGE)
        self._host_lengths = [0] * self.batch_size
        self._pages: List[List[int]] = [[] for _ in range(self.batch_size)]
        # Lowest page ids first (popped from the end), so a fresh cache fills pages in order.
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._holders = [0] * self.num_pages  # sequences holding each page

    def release(self, b: int) -> None:
        """Ends sequence ``b``: its length becomes 0 and the pages no other sequence holds go
        back to the free list."""
        for page in self._pages[b]:
            self._drop(page)
        self._pages[b] = []
        self._host_lengths[b] = 0
        self.lengths[b] = 0
        self.block_table[b].fill_(_NO_PAGE)

    def fork(self, src: int, dst: int) -> None:
        """Starts sequence ``dst`` as a copy of ``src`` (beam search, a shared prompt): the full
        pages of ``src`` are shared, its partly filled last page (if any) is copied to a new
        page, so either sequence may append without changing the other. ``dst``'s previous
        pages are released first."""
        if src == dst:
            return
        n = self._host_lengths[src]
        shared = n // self.page_size
        tail = n % self.page_size != 0
        if tail and not self._free:
            raise RuntimeError(
                "attn_ext.PagedKVCache.fork: out of pages: copying the last, partly filled page "
                "needs 1 free page, 0 are free (nothing was changed)"
            )
        self.release(dst)
        pages = self._pages[src][:shared]
        for page in pages:
            self._holders[page] += 1
        if tail:
            page = self._take()
            self._copy_page(self._pages[src][shared], page)
            pages = pages + [page]
        self._pages[dst] = pages
        self.block_table[dst, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self._host_lengths[dst] = n
        self.lengths[dst] = n

    def _copy_page(self, src: int, dst: int) -> None:
        self.k[dst].copy_(self.k[src])
        self.v[dst].copy_(self.v[src])

    positions = KVCache.positions

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        new_lengths: Optional[torch.Tensor] = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        rope_interleaved: bool = False,
        rotary_dim: Optional[int] = None,
        rope_inv_freq: Optional[torch.Tensor] = None,
        rope_attention_scaling: float = 1.0,
    ) -> None:
        """Writes k (B, Hkv, S_new, D) and v (B, Hkv, S_new, Dv) at each sequence's length,
        taking new pages from the free list as the sequences cross page boundaries, and
        advances ``lengths``; arguments as :meth:`KVCache.append` (B = ``max_batch``)."""

        def write():
            _ops.kv_cache_append(
                self.k,
                self.v,
                self.lengths,
                k,
                v,
                new_lengths,
                rope=rope,
                rope_base=rope_base,
                rope_interleaved=rope_interleaved,
                rotary_dim=rotary_dim,
                block_table=self.block_table,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                rope_inv_freq=rope_inv_freq,
                rope_attention_scaling=rope_attention_scaling,
            )

        self._append_through(write, k, new_lengths)

    def _append_through(self, write, x: torch.Tensor, new_lengths) -> None:
        """Takes the pages that appending ``x`` (B, Hkv, S_new, *) needs, runs ``write`` (the
        append op through the table) and advances the host lengths; gives the pages back if
        the op raises, and raises the overflow refusal after the op validated its inputs."""
        after, refusal = _room_after(self._host_lengths, self.max_len, x, new_lengths)
        taken = [] if refusal is not None else self._allocate(after)
        try:
            write()
        except Exception:
            self._give_back(taken)
            raise
        if refusal is not None:
            raise RuntimeError(refusal)
        self._host_lengths = after

    attend = KVCache.attend  # through self.block_table
    k_scale: float = 1.0
    v_scale: float = 1.0

    def _take(self) -> int:
        page = self._free.pop()
        self._holders[page] = 1
        return page

    def _drop(self, page: int) -> None:
        self._holders[page] -= 1
        if self._holders[page] == 0:
            self._free.append(page)

    def _allocate(self, after: List[int]) -> List[Tuple[int, int]]:
        """Gives each sequence the pages its new length needs, all or none; returns the
        (sequence, page) pairs taken (for :meth:`_give_back` if the append then fails)."""
        need = [
            max(0, -(-n // self.page_size) - len(pages)) for n, pages in zip(after, self._pages)
        ]
        if sum(need) > len(self._free):
            raise RuntimeError(
                f"attn_ext.PagedKVCache: out of pages: the append needs {sum(need)} new pages of "
                f"{self.page_size} rows, {len(self._free)} are free (nothing was written; "
                "release finished sequences or make the cache larger)"
            )
        taken, rows, cols = [], [], []
        for b, n in enumerate(need):
            for _ in range(n):
                page = self._take()
                rows.append(b)
                cols.append(len(self._pages[b]))
                self._pages[b].append(page)
                taken.append((b, page))
        if taken:
            dev = self.block_table.device
            index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
            pages = torch.tensor([page for _, page in taken], dtype=torch.int32, device=dev)
            self.block_table.index_put_(index, pages)
        return taken

    def _give_back(self, taken: List[Tuple[int, int]]) -> None:
        for b, page in reversed(taken):
            self._pages[b].pop()
            self.block_table[b, len(self._pages[b])] = _NO_PAGE
            self._drop(page)

    def __repr__(self) -> str:
        P, Hkv, ps, D = self.k.shape
        return (
            f"PagedKVCache(num_pages={P}, page_size={ps}, num_kv_heads={Hkv}, head_dim={D}, "
            f"head_dim_v={self.v.size(3)}, max_batch={self.batch_size}, "
            f"max_pages_per_seq={self.block_table.size(1)}, dtype={self.k.dtype}, "
            f"device={self.k.device})"
        )


class _LatentBuffer:
    """What MLA's two latent caches share: one buffer ``kv`` (rows or pages on its first axis,
    1 head, rows, ``kv_lora_rank + rope_dim``) of rows ``[c_kv, k_rope]``, read as the single
    key head (``k``) whose first ``kv_lora_rank`` columns are the values (``v``), and whether
    anything was appended since construction or :meth:`reset`."""

    kv: torch.Tensor
    kv_lora_rank: int

    def _readable(self, rows: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
        """rows as stored, or in ``dtype``: a float8 cache's rows dequantized (times
        ``kv_scale``), for the layer's prompt and decompressed paths."""
        if dtype is None:
            return rows
        if rows.dtype in _FLOAT8_CACHE_DTYPES:
            return rows.to(dtype) * self.k_scale
        return rows.to(dtype)

    @property
    def kv_scale(self) -> float:
        """A float8 cache's one scale (keys and values are the same rows): it holds
        ``[c_kv, k_rope] / kv_scale``; 1 otherwise."""
        return self.k_scale

    @property
    def v_scale(self) -> float:
        """The values' scale: the keys' (the values are the keys' first columns)."""
        return self.k_scale

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
        """The key head [c_kv, k_rope]: the buffer."""
        return self.kv

    @property
    def v(self) -> torch.Tensor:
        """The values: the ``c_kv`` columns of the buffer, a view."""
        return self.kv[..., : self.kv_lora_rank]


class LatentKVCache(_LatentBuffer, KVCache):
    """The compressed cache of Multi-head Latent Attention (DeepSeek-V2 §2.1): per token only
    the latent ``c_kv`` (``kv_lora_rank`` values) and the RoPE-rotated shared key ``k_rope``
    (``rope_dim`` values), in one buffer ``kv`` (B, 1, max_len, kv_lora_rank + rope_dim) laid
    out ``[c_kv, k_rope]``.

    ``dtype=torch.float8_e4m3fn`` (or ``float8_e5m2``) with ``kv_scale`` keeps the rows as
    ``[c_kv, k_rope] / kv_scale`` in one byte each (CPU; one scale, since the rows are both the
    keys and the values): half a bf16 cache, as vLLM's fp8 MLA caches.

    The buffer is the single key head of width ``kv_lora_rank + rope_dim`` that the absorbed
    decode attends to (``self.k``), and its first ``kv_lora_rank`` columns are the values
    (``self.v``, a strided view of the same memory, never a copy). :meth:`append` writes both
    parts with one ``kv_cache_append`` call whose "keys" are the ``k_rope`` columns (rotated at
    the cache positions on the way in) and whose "values" are the ``c_kv`` columns.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        *,
        dtype: Optional[torch.dtype] = None,
        device=None,
        kv_scale: float = 1.0,
    ):
        _check_sizes(
            "LatentKVCache",
            batch_size=batch_size,
            max_len=max_len,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
        )
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.kv = torch.zeros(
            batch_size, 1, max_len, kv_lora_rank + rope_dim, dtype=dtype, device=device
        )
        (self.k_scale,) = _check_scales("LatentKVCache", self.kv.dtype, kv_scale=kv_scale)
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=self.kv.device)
        self._host_lengths = [0] * batch_size
        # Host-side: no append since construction or reset (a prompt can then skip the cache;
        # kept off the device so that checking it neither synchronizes nor breaks a graph).
        self._empty = True

    @property
    def latent(self) -> torch.Tensor:
        """The ``c_kv`` columns (B, 1, max_len, kv_lora_rank), a view (same as :attr:`v`)."""
        return self.v

    @property
    def rope_key(self) -> torch.Tensor:
        """The rotated ``k_rope`` columns (B, 1, max_len, rope_dim), a view."""
        return self.kv[..., self.kv_lora_rank :]

    def rows(self, n: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The first ``n`` rows of every sequence, (B, 1, n, kv_lora_rank + rope_dim), a view
        (the same call as :meth:`PagedLatentKVCache.rows`); with ``dtype``, a copy in that
        dtype (a float8 cache's rows dequantized)."""
        return self._readable(self.kv[:, :, :n], dtype)

    def append(
        self,
        c_kv: torch.Tensor,
        k_rope: torch.Tensor,
        *,
        new_lengths: Optional[torch.Tensor] = None,
        rope_base: float = 10000.0,
        rope_interleaved: bool = False,
        rope_inv_freq: Optional[torch.Tensor] = None,
        rope_attention_scaling: float = 1.0,
    ) -> None:
        """Writes c_kv (B, 1, S_new, kv_lora_rank) and the not yet rotated k_rope
        (B, 1, S_new, rope_dim) at each sequence's length, rotating k_rope by RoPE at its
        cache position (halves by default; DeepSeek-V2 checkpoints need
        ``rope_interleaved=True``, which :class:`attn_ext.nn.MultiHeadLatentAttention` passes; a
        scaled variant's ``rope_inv_freq`` / ``rope_attention_scaling``, e.g. DeepSeek's YaRN), and
        advances ``lengths`` (``new_lengths`` as in :meth:`KVCache.append`)."""
        on_host = self.kv.device.type == "cpu"
        after, refusal = (None, None) if on_host else self._room_after(c_kv, new_lengths)
        _ops.latent_cache_append(
            self.kv,
            self.lengths,
            c_kv,
            k_rope,
            new_lengths,
            rope_base=rope_base,
            rope_interleaved=rope_interleaved,
            rope_inv_freq=rope_inv_freq,
            rope_attention_scaling=rope_attention_scaling,
            kv_scale=self.k_scale,
        )
        if refusal is not None:
            raise RuntimeError(refusal.replace("kv_cache_append", "latent_cache_append"))
        self._empty = False
        if after is not None:
            self._host_lengths = after

    def __repr__(self) -> str:
        B, _, L, _ = self.kv.shape
        return (
            f"LatentKVCache(batch_size={B}, max_len={L}, kv_lora_rank={self.kv_lora_rank}, "
            f"rope_dim={self.rope_dim}, dtype={self.kv.dtype}, device={self.kv.device})"
        )


class PagedLatentKVCache(_LatentBuffer, PagedKVCache):
    """MLA's latent cache (:class:`LatentKVCache`) in pages: one buffer ``kv`` (num_pages, 1,
    page_size, kv_lora_rank + rope_dim) of rows ``[c_kv, k_rope]``, handed out page by page
    through ``block_table`` as :class:`PagedKVCache` does (free list, :meth:`release`,
    :meth:`fork`, prefix sharing). ``k`` is the buffer and ``v`` its first ``kv_lora_rank``
    columns (a view): the absorbed decode attends to them through the table (:meth:`attend`).
    :meth:`rows` gathers each sequence's first rows, for the layer's prompt and decompressed
    paths.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        rope_dim: int,
        *,
        max_batch: int,
        max_pages_per_seq: int,
        dtype: Optional[torch.dtype] = None,
        device=None,
        kv_scale: float = 1.0,
    ):
        _check_sizes(
            "PagedLatentKVCache",
            _PAGE_POOL_SIZES,
            num_pages=num_pages,
            page_size=page_size,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            max_batch=max_batch,
            max_pages_per_seq=max_pages_per_seq,
        )
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.kv = torch.zeros(
            num_pages, 1, page_size, kv_lora_rank + rope_dim, dtype=dtype, device=device
        )
        (self.k_scale,) = _check_scales("PagedLatentKVCache", self.kv.dtype, kv_scale=kv_scale)
        self._init_table(max_batch, max_pages_per_seq, self.kv.device)

    def _copy_page(self, src: int, dst: int) -> None:
        self.kv[dst].copy_(self.kv[src])

    def rows(self, n: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The first ``n`` rows of every sequence, (max_batch, 1, n, kv_lora_rank + rope_dim),
        gathered through the table (a copy; with ``dtype``, in that dtype, a float8 cache's
        rows dequantized). Rows past a sequence's length are not its own (they read page 0
        where it has no page): mask them by ``lengths``, as decoding does."""
        n_pages = -(-n // self.page_size)
        table = self.block_table[:, :n_pages].clamp(min=0).long()
        pages = self.kv[table]  # (B, n_pages, 1, page_size, W)
        B, W = table.size(0), self.kv.size(3)
        gathered = pages.transpose(1, 2).reshape(B, 1, n_pages * self.page_size, W)[:, :, :n]
        return self._readable(gathered, dtype)

    def append(
        self,
        c_kv: torch.Tensor,
        k_rope: torch.Tensor,
        *,
        new_lengths: Optional[torch.Tensor] = None,
        rope_base: float = 10000.0,
        rope_interleaved: bool = False,
        rope_inv_freq: Optional[torch.Tensor] = None,
        rope_attention_scaling: float = 1.0,
    ) -> None:
        """As :meth:`LatentKVCache.append`, taking new pages from the free list as the
        sequences cross page boundaries (B = ``max_batch``)."""

        def write():
            _ops.latent_cache_append(
                self.kv,
                self.lengths,
                c_kv,
                k_rope,
                new_lengths,
                rope_base=rope_base,
                rope_interleaved=rope_interleaved,
                block_table=self.block_table,
                rope_inv_freq=rope_inv_freq,
                rope_attention_scaling=rope_attention_scaling,
                kv_scale=self.k_scale,
            )

        self._append_through(write, c_kv, new_lengths)
        self._empty = False

    def __repr__(self) -> str:
        P, _, ps, _ = self.kv.shape
        return (
            f"PagedLatentKVCache(num_pages={P}, page_size={ps}, "
            f"kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, "
            f"max_batch={self.batch_size}, max_pages_per_seq={self.block_table.size(1)}, "
            f"dtype={self.kv.dtype}, device={self.kv.device})"
        )


class TPAFactorCache:
    """Preallocated factor cache of :class:`attn_ext.nn.TensorProductAttention`: ``a_k``
    (B, max_len, R_K, H), ``b_k`` (B, max_len, R_K, d) rotated by RoPE at each row's position,
    ``a_v`` (B, max_len, R_V, H), ``b_v`` (B, max_len, R_V, d), and ``lengths`` (B,) int32. Rows are
    written at each sequence's length by ``attn_ext::kv_cache_append`` (a (row, rank)
    factor block is one cache row); nothing is ever moved. The lengths are mirrored on the
    host, as :class:`attn_ext.KVCache` does, so that appending and decoding on a GPU never
    wait for the device."""

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_heads: int,
        head_dim: int,
        r_k: int,
        r_v: int,
        *,
        dtype=None,
        device=None,
    ):
        for name, value in (
            ("batch_size", batch_size),
            ("max_len", max_len),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("r_k", r_k),
            ("r_v", r_v),
        ):
            if int(value) < 0 or (name.startswith("r_") and int(value) < 1):
                raise ValueError(
                    f"attn_ext.TPAFactorCache: {name} must be "
                    f"{'>= 1' if name.startswith('r_') else '>= 0'}, got {value}"
                )
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
        return self.lengths.to(torch.int64)[:, None] + torch.arange(
            seqlen, device=self.lengths.device
        )

    def append(self, a_k, b_k, a_v, b_v) -> None:
        """Writes the factors (B, S, R, *) of S new tokens at each sequence's length (b_k
        already rotated) and advances ``lengths``; raises, writing nothing, on overflow."""
        S = a_k.size(1)
        for b, n in enumerate(self._host_lengths):
            if n + S > self.max_len:
                raise RuntimeError(
                    f"attn_ext.TPAFactorCache: sequence {b} would overflow the cache: "
                    f"length {n} + {S} new tokens > capacity {self.max_len} "
                    "(nothing was written)"
                )

        def rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            # (B, S, R, n) -> the op's (B, 1, S, R * n) layout, one row per token
            return t.to(like.dtype).flatten(2).unsqueeze(1)

        # Both pairs start at the same lengths: the key pair advances a scratch copy, the
        # value pair the cache's own.
        _ops.kv_cache_append(
            rows(self.a_k, self.a_k),
            rows(self.b_k, self.b_k),
            self.lengths.clone(),
            rows(a_k, self.a_k),
            rows(b_k, self.b_k),
        )
        _ops.kv_cache_append(
            rows(self.a_v, self.a_v),
            rows(self.b_v, self.b_v),
            self.lengths,
            rows(a_v, self.a_v),
            rows(b_v, self.b_v),
        )
        self._host_lengths = [n + S for n in self._host_lengths]

    def nbytes_per_token(self) -> int:
        return sum(
            t[0, 0].numel() * t.element_size() for t in (self.a_k, self.b_k, self.a_v, self.b_v)
        )


class LinearAttentionState(NamedTuple):
    """What a :class:`attn_ext.nn.LinearAttention` layer has seen so far, per batch element and
    head: ``kv`` (B, H, D, D) = ``sum phi(k) v^T`` and ``k`` (B, H, D) = ``sum phi(k)``, float32
    (float64 for a float64 layer). A pair, so it is also :func:`attn_ext.linear_attention`'s
    ``initial_state``."""

    kv: torch.Tensor
    k: torch.Tensor
