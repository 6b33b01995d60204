"""Drop-in for the public functions of FlashAttention 2 (``flash_attn``), on the CPU and CUDA.

Code written against ``flash_attn`` runs unchanged after swapping the import::

    from attn_ext.flash_attn import flash_attn_func, flash_attn_varlen_func

Same names, parameters (names, order, defaults: those of FlashAttention 2.6.1 to 2.8.x),
layouts and return conventions as ``flash_attn``'s ``flash_attn_interface``: q/k/v
``(B, S, H, D)`` (varlen: ``(total, H, D)`` with ``cu_seqlens``), causal and sliding windows
aligned bottom-right, GQA/MQA by fewer key/value heads, ``softcap``, ``alibi_slopes`` (H,) or
(B, H), ``softmax_lse`` ``(B, H, S)`` (varlen: ``(H, total_q)``), gradients through everything
but ``flash_attn_with_kvcache``. The inputs are read in place (the ``(B, S, H, D)`` views are
never copied); outputs are contiguous like FlashAttention's.

``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` with FlashAttention >= 2.6's
``S_dmask``: an empty tensor without dropout; with dropout, ``(B, H, round128(Sq),
round128(Sk))`` in q's dtype (varlen: ``max_seqlen_q`` / ``max_seqlen_k``), the probabilities of
sequence b in ``[b, :, :Sq_b, :Sk_b]``, negated where dropout dropped them (a dropped 0 is
``-0.0``: test ``torch.signbit``), zero elsewhere.

``flash_attn_with_kvcache`` follows FlashAttention's cache conventions: ``cache_seqlens`` are the
lengths *before* the new ``k`` / ``v`` are written there, and are not modified; rotary positions
are absolute cache rows (new key i at ``cache_seqlens + i``, also with ``cache_leftpad``, as
FlashAttention's kernel indexes its tables); with ``block_table`` the caches are
``(num_blocks, page_size, Hkv, D)`` pages, sequence b's row t in page ``block_table[b, t //
page_size]``.

FlashAttention's argument checks raise ``RuntimeError`` here as there (its ``TORCH_CHECK``s):
q/k/v ranks, shapes and dtypes that disagree, ``H % Hkv``, ``dropout_p`` outside ``[0, 1)``,
``v`` / ``cache_seqlens`` missing when ``k`` is appended, rotary tables without new keys or
shorter than the cache, ``rotary_dim`` > D, ``block_table`` not int32 or with
``cache_batch_idx`` / ``cache_leftpad``, a paged cache too small for the lengths. FlashAttention's
capability limits are lifted instead:

- CPU kernels (FlashAttention has none); every floating dtype (fp32 and fp64 too, not only
  fp16 / bf16; rotary tables and ALiBi slopes in any floating dtype), any head dim (not only
  <= 256), ``Dv`` != ``D``, an empty batch, int64 index tensors, softcap with dropout, any
  ``rotary_dim`` (even; FlashAttention: multiples of 16), any page size >= 16 (FlashAttention:
  multiples of 256), and a ``v`` without ``k`` is an error (FlashAttention ignores it).

Differences from FlashAttention, by design:

- Dropout draws from attn_ext's own counter-based stream (``attn_ext.dropout_keep_mask``), so
  masks differ from FlashAttention's for the same seed; ``deterministic`` is accepted and has no
  effect (attn_ext's backward is always deterministic).
- ``S_dmask`` holds the normalized probabilities; FlashAttention stores ``exp(s - running max)``
  per tile ("possibly with different scaling", its docstring says; its tests renormalize), and
  leaves the padding uninitialized. It is available with ``softcap`` too (an error in
  FlashAttention) and with ``alibi_slopes``.
- ``softmax_lse`` of a row that sees no key is ``-inf`` in every function; FlashAttention gives
  ``+inf`` from its non-split kernels and ``-inf`` from its split-KV ones.
- ``softmax_lse`` with ALiBi and ``causal=True`` is the log-sum-exp of the documented scores
  ``s - slope * |i + Sk - Sq - j|``; FlashAttention's causal kernel adds ``slope * j`` instead (the
  same softmax and output), so its lse is larger by ``slope * (i + Sk - Sq)``.
- ``flash_attn_with_kvcache`` applies ``rotary_cos`` / ``rotary_sin`` with torch element-wise
  ops (in fp32, fp64 for fp64 inputs) before appending through ``kv_cache_append`` (with
  ``cache_batch_idx`` by indexed writes: the op does not know it). With ``block_table`` on the
  CPU, ``kv_cache_append`` and ``decode_attention`` read and write the pages in place through
  the table, and so does ``attention_varlen`` for the varlen functions without gradients; on
  CUDA (not yet routed through the CUDA paged ops), and in the varlen functions when gradients
  flow or dropped probabilities are returned, the rows are written by index and the used pages
  gathered into a dense ``(B, max length, Hkv, D)`` copy (varlen: the used tokens, packed):
  correct, not fast. The largest length is read on the host, as FlashAttention's paged check
  does. On CUDA out-of-range block indices are clamped,
  not checked (no sync).
- ``flash_attn_with_kvcache`` takes FlashAttention 3's ``k_descale`` / ``v_descale`` for a float8
  cache (float8_e4m3fn / float8_e5m2, CPU): the cache holds ``K / k_descale`` and
  ``V / v_descale``, and new ``k`` / ``v`` are quantized into it (round to nearest even,
  saturated). One value per cache (a number, or a tensor of one repeated value: FlashAttention
  3's are (B, Hkv), and attn_ext's caches keep one scale, as vLLM's do); per-head values raise.
  ``q_descale`` (a float8 ``q``) is not taken.
- On CUDA, the varlen functions, ``softcap``, ``alibi_slopes`` and ``flash_attn_with_kvcache``'s
  ``cache_batch_idx`` / ``cache_leftpad`` / right windows run on kernel code that has not yet
  run on a GPU: they raise until ``ATTN_EXT_UNVERIFIED_CUDA=1`` opts in. (In
  ``flash_attn_with_kvcache`` only where ``decode_attention`` runs its SIMT kernel: float64,
  head dims other than ``D == Dv`` in {64, 128, 256}, rows not 16-byte aligned; its split-KV
  kernel runs them by default.)
"""

from typing import Optional, Tuple, Union

import torch

from ._ops import ops as _ops
from .caches import _FLOAT8_CACHE_DTYPES
from .decoding import decode_attention
from .functional import _int32, _rng_state

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]

# FlashAttention allocates S_dmask in whole tiles of 128 query rows and 128 keys.
S_DMASK_MULTIPLE = 128
# design.md: the paged cache takes any page size from 16 (FlashAttention-2: multiples of 256).
MIN_PAGE_SIZE = 16
NO_WINDOW = (-1, -1)


def _fail(fn: str, message: str):
    raise RuntimeError(f"attn_ext.flash_attn.{fn}: {message}")


def _ndim(layout: str) -> int:
    return layout.count(",") + 1


def _check_rank(fn, name, x, layout):
    if x.dim() != _ndim(layout):
        _fail(fn, f"{name} must be {_ndim(layout)}-D {layout}, got shape {tuple(x.shape)}")


def _check_like(fn, name, x, q):
    if x.dtype != q.dtype:
        _fail(fn, f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if x.device != q.device:
        _fail(fn, f"{name} must be on q's device {q.device}, got {x.device}")


def _check_size(fn, name, x, dim, what, expected):
    if x.size(dim) != expected:
        _fail(fn, f"{name} {what} (dim {dim}) must be {expected}, got {x.size(dim)}")


def _check_heads(fn, heads, kv_heads):
    if kv_heads == 0 or heads % kv_heads != 0:
        _fail(fn, f"k/v heads ({kv_heads}) must divide q's heads ({heads})")


def _check_common(fn, dropout_p, window_size):
    if not 0.0 <= dropout_p < 1.0:
        _fail(fn, f"dropout_p must be in [0, 1), got {dropout_p}")
    if len(window_size) != 2:
        _fail(fn, f"window_size must be (left, right), got {tuple(window_size)}")


def _check_qkv(fn, q, k, v, layout, seq_dims):
    """q / k / v in one layout, `seq_dims` the leading dims k and v share with each other
    (batch and keys, or tokens) and that q shares with them in its batch dim, if any."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rank(fn, name, x, layout)
    _check_like(fn, "k", k, q)
    _check_like(fn, "v", v, q)
    heads = _ndim(layout) - 2
    if seq_dims == 2:  # (B, S, H, D): one batch
        _check_size(fn, "k", k, 0, "batch size", q.size(0))
        _check_size(fn, "v", v, 0, "batch size", q.size(0))
    _check_size(fn, "v", v, seq_dims - 1, "length", k.size(seq_dims - 1))
    _check_size(fn, "v", v, heads, "heads", k.size(heads))
    _check_size(fn, "k", k, -1, "head dim", q.size(-1))
    _check_heads(fn, q.size(heads), k.size(heads))


def _s_dmask_buffer(like, batch, heads, rows, cols):
    def up(n):
        return (n + S_DMASK_MULTIPLE - 1) // S_DMASK_MULTIPLE * S_DMASK_MULTIPLE

    return like.new_zeros(batch, heads, up(rows), up(cols))


def _marked(weights, keep):
    """FlashAttention's encoding: a dropped probability carries a minus sign."""
    return torch.where(keep, weights, -weights)


def _attn(fn, q, k, v, dropout_p, scale, causal, window_size, softcap, alibi_slopes, probs):
    _check_common(fn, dropout_p, window_size)
    _check_qkv(fn, q, k, v, "(B, S, H, D)", seq_dims=2)
    q4, k4, v4 = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # read in place
    left, right = (int(w) for w in window_size)
    rng_state = _rng_state(dropout_p, None)
    out, lse = _ops.attention(
        q4,
        k4,
        v4,
        None,
        rng_state,
        alibi_slopes,
        None,
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        dropout_p=dropout_p,
        softcap=softcap,
    )
    out = out.transpose(1, 2).contiguous()  # (B, Sq, H, Dv), contiguous like FlashAttention's
    if not probs:
        return out
    if dropout_p == 0.0:  # FlashAttention >= 2.6 returns probabilities only with dropout
        return out, lse, q.new_empty(0)
    B, H, Sq, Sk = q4.size(0), q4.size(1), q4.size(2), k4.size(2)
    w = _ops.attention_weights(
        q4.detach(),
        k4.detach(),
        alibi_slopes=alibi_slopes,
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=softcap,
    )
    keep = _ops.dropout_mask(rng_state, B, H, Sq, Sk, dropout_p).to(w.device)
    s_dmask = _s_dmask_buffer(q, B, H, Sq, Sk)
    s_dmask[:, :, :Sq, :Sk] = _marked(w, keep)
    return out, lse, s_dmask


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, H, Dv); with
    return_attn_probs, (out, softmax_lse (B, H, Sq), S_dmask)."""
    return _attn(
        "flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, return_attn_probs,
    )  # fmt: skip


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (B, S, 3, H, D); otherwise as :func:`flash_attn_func`."""
    fn = "flash_attn_qkvpacked_func"
    _check_rank(fn, "qkv", qkv, "(B, S, 3, H, D)")
    _check_size(fn, "qkv", qkv, 2, "q/k/v", 3)
    q, k, v = qkv.unbind(dim=2)
    return _attn(
        fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, Sq, H, D), kv (B, Sk, 2, Hkv, D); otherwise as :func:`flash_attn_func`."""
    fn = "flash_attn_kvpacked_func"
    _check_rank(fn, "kv", kv, "(B, S, 2, Hkv, D)")
    _check_size(fn, "kv", kv, 2, "k/v", 2)
    k, v = kv.unbind(dim=2)
    return _attn(
        fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs,
    )  # fmt: skip


def _check_offsets(fn, name, cu, batch, device):
    if cu.dim() != 1 or cu.numel() != batch + 1:
        _fail(fn, f"{name} must be 1-D (B + 1,) = ({batch + 1},), got shape {tuple(cu.shape)}")
    if cu.device != device:
        _fail(fn, f"{name} must be on q's device {device}, got {cu.device}")


def _unpage_tokens(fn, pages, block_table, cu_k):
    """The packed (total_k, Hkv, D) keys or values of a paged varlen batch: token t of sequence
    b is row t % page_size of page block_table[b, t // page_size]."""
    lens = (cu_k[1:] - cu_k[:-1]).long()
    batch = torch.arange(lens.numel(), device=pages.device).repeat_interleave(lens)
    token = torch.arange(batch.numel(), device=pages.device) - cu_k[:-1].long()[batch]
    page = _page_index(fn, block_table, pages, lens)[batch, token // pages.size(1)]
    return pages[page, token % pages.size(1)]


def _reads_pages_in_place(q, k, v, dropout_p, probs):
    """Whether the operator reads a paged batch's pages where they lie (its CPU kernels, an
    inference call) rather than a gathered copy: CUDA's varlen kernels read token rows, the
    backward needs rows to scatter into, and the dropped probabilities slice keys by token."""
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return q.device.type == "cpu" and not grads and not (probs and dropout_p > 0.0)


def _varlen(fn, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap,
            alibi, probs, block_table=None):  # fmt: skip
    _check_common(fn, dropout_p, window)
    batch = cu_q.numel() - 1
    _check_offsets(fn, "cu_seqlens_q", cu_q, batch, q.device)
    _check_offsets(fn, "cu_seqlens_k", cu_k, batch, q.device)
    cu_q, cu_k = _int32(cu_q), _int32(cu_k)
    pages_in_place = None
    if block_table is not None:
        for name, x in (("k", k), ("v", v)):
            _check_rank(fn, name, x, "(num_blocks, page_size, Hkv, D)")
        _check_block_table(fn, block_table, k, v, batch, cu_k[1:] - cu_k[:-1])
        if _reads_pages_in_place(q, k, v, dropout_p, probs):
            _check_rank(fn, "q", q, "(total, H, D)")
            _check_like(fn, "k", k, q)
            _check_like(fn, "v", v, q)
            _check_size(fn, "k", k, -1, "head dim", q.size(-1))
            _check_heads(fn, q.size(1), k.size(2))
            pages_in_place = block_table
        else:
            k, v = (_unpage_tokens(fn, x, block_table, cu_k) for x in (k, v))
    if pages_in_place is None:
        _check_qkv(fn, q, k, v, "(total, H, D)", seq_dims=1)
    left, right = (int(w) for w in window)
    rng_state = _rng_state(dropout_p, None)
    out, lse = _ops.attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        rng_state,
        alibi,
        None,
        pages_in_place,
        max_seqlen_q=int(max_q),
        max_seqlen_k=int(max_k),
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        dropout_p=dropout_p,
        softcap=softcap,
    )
    if not probs:
        return out
    if dropout_p == 0.0:  # FlashAttention >= 2.6 returns probabilities only with dropout
        return out, lse, q.new_empty(0)
    heads = q.size(1)
    # A varlen batch's dropout rows are (head, token) of one batch; keys count from each
    # sequence's first.
    keep = _ops.dropout_mask(rng_state, 1, heads, q.size(0), int(max_k), dropout_p)[0]
    keep = keep.to(q.device)
    s_dmask = _s_dmask_buffer(q, batch, heads, int(max_q), int(max_k))
    # S_dmask is for testing (FlashAttention's docstring): reading the offsets on the host and
    # one attention_weights call per sequence is fine here.
    bounds = list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))
    for b, (q0, q1, k0, k1) in enumerate(bounds):
        w = _ops.attention_weights(
            q[q0:q1].detach().transpose(0, 1).unsqueeze(0),
            k[k0:k1].detach().transpose(0, 1).unsqueeze(0),
            alibi_slopes=alibi if alibi is None or alibi.dim() == 1 else alibi[b],
            scale=scale,
            causal=causal,
            window_left=left,
            window_right=right,
            softcap=softcap,
        )[0]
        s_dmask[b, :, : q1 - q0, : k1 - k0] = _marked(w, keep[:, q0:q1, : k1 - k0])
    return out, lse, s_dmask


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens (B + 1,) int32
    -> out (total_q, H, Dv); with return_attn_probs, (out, softmax_lse (H, total_q), S_dmask).
    With block_table (B, max_blocks) int32, k / v are (num_blocks, page_size, Hkv, D) pages and
    cu_seqlens_k counts each sequence's keys in its pages."""
    return _varlen(
        "flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
        block_table,
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (total, 3, H, D); otherwise as :func:`flash_attn_varlen_func`."""
    fn = "flash_attn_varlen_qkvpacked_func"
    _check_rank(fn, "qkv", qkv, "(total, 3, H, D)")
    _check_size(fn, "qkv", qkv, 1, "q/k/v", 3)
    q, k, v = qkv.unbind(dim=1)
    return _varlen(
        fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (total_q, H, D), kv (total_k, 2, Hkv, D); otherwise as :func:`flash_attn_varlen_func`."""
    fn = "flash_attn_varlen_kvpacked_func"
    _check_rank(fn, "kv", kv, "(total, 2, Hkv, D)")
    _check_size(fn, "kv", kv, 1, "k/v", 2)
    k, v = kv.unbind(dim=1)
    return _varlen(
        fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
    )  # fmt: skip


# ------------------------------------------------------------------------------ paged caches
def _check_block_table(fn, block_table, k_pages, v_pages, batch, lengths):
    """FlashAttention's block_table checks, and the capacity check its paged path makes on the
    host (lengths: (B,) keys each sequence needs, after any append)."""
    if block_table.dtype != torch.int32:
        _fail(fn, f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.size(0) != batch:
        _fail(
            fn,
            f"block_table must be 2-D (B, max_blocks) with B = {batch}, "
            f"got shape {tuple(block_table.shape)}",
        )
    if block_table.device != k_pages.device:
        _fail(fn, f"block_table must be on the cache's device {k_pages.device}, got "
                  f"{block_table.device}")  # fmt: skip
    page_size = k_pages.size(1)
    if page_size < MIN_PAGE_SIZE:
        _fail(fn, f"the page size (k_cache dim 1) must be >= {MIN_PAGE_SIZE}, got {page_size}")
    for dim, what in ((0, "blocks"), (1, "page size"), (2, "heads")):
        _check_size(fn, "v_cache", v_pages, dim, what, k_pages.size(dim))
    capacity = block_table.size(1) * page_size
    longest = int(lengths.max()) if batch > 0 else 0  # a host read, as FlashAttention's check
    if longest > capacity:
        _fail(
            fn,
            f"the longest sequence ({longest} keys) exceeds what block_table addresses "
            f"(max_blocks {block_table.size(1)} * page_size {page_size} = {capacity})",
        )


def _check_page_range(fn, block_table, pages, lengths):
    """On the CPU, the blocks that hold keys must be in range; on CUDA nothing is checked (that
    would sync): the kernels and _page_index clamp every entry, so a bad index reads a wrong
    page but never out of bounds."""
    if pages.device.type != "cpu":
        return
    num_blocks, page_size = pages.size(0), pages.size(1)
    used = torch.arange(block_table.size(1)) * page_size < lengths.long()[:, None].cpu()
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        _fail(
            fn, f"block_table[{b}, {j}] must be in [0, {num_blocks}), got {int(block_table[b, j])}"
        )


def _page_index(fn, block_table, pages, lengths):
    """block_table as int64 indices into pages, checked (_check_page_range) and clamped."""
    _check_page_range(fn, block_table, pages, lengths)
    return block_table.long().clamp(0, max(pages.size(0) - 1, 0))


# ------------------------------------------------------------------------ with_kvcache
def _rotate(x, cos, sin, positions, interleaved):
    """FlashAttention's rotary embedding from tables: x (B, S, H, D), cos / sin (S_ro, rd / 2),
    token s of batch b at positions[b, s]; the first rd features rotate, in fp32 (fp64 for fp64
    inputs)."""
    half = cos.size(1)
    rd = 2 * half
    work = torch.promote_types(x.dtype, torch.float32)
    c = cos.to(work)[positions].unsqueeze(2)  # (B, S, 1, rd / 2)
    s = sin.to(work)[positions].unsqueeze(2)
    xr = x[..., :rd].to(work)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _check_kvcache(fn, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, paged):
    """FlashAttention's checks of flash_attn_with_kvcache's tensors; returns the keys a
    sequence can have (seqlen_k: the cache's rows, or max_blocks * page_size)."""
    _check_rank(fn, "q", q, "(B, Sq, H, D)")
    layout = "(num_blocks, page_size, Hkv, D)" if paged else "(B_cache, S_cache, Hkv, D)"
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_rank(fn, name, x, layout)
        if x.dtype in _FLOAT8_CACHE_DTYPES:  # a float8 cache under q of another dtype (k_descale)
            if x.dtype != k_cache.dtype or x.device != q.device:
                _fail(fn, f"{name} must have k_cache's dtype and q's device, got {x.dtype} on "
                          f"{x.device}")  # fmt: skip
        else:
            _check_like(fn, name, x, q)
    _check_size(fn, "k_cache", k_cache, 3, "head dim", q.size(3))
    for dim, what in ((0, "batch size"), (1, "length"), (2, "heads")):
        _check_size(fn, "v_cache", v_cache, dim, what, k_cache.size(dim))
    _check_heads(fn, q.size(2), k_cache.size(2))
    if k is None and v is not None:
        _fail(fn, "v was given without k: pass both to append, or neither")
    if k is not None:
        if v is None:
            _fail(fn, "k was given without v: pass both to append, or neither")
        if cache_seqlens is None:
            _fail(fn, "appending k / v needs cache_seqlens (where to write them)")
        for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
            _check_rank(fn, name, x, "(B, S_new, Hkv, D)")
            _check_like(fn, name, x, q)
            _check_size(fn, name, x, 0, "batch size", q.size(0))
            _check_size(fn, name, x, 1, "length", k.size(1))
            _check_size(fn, name, x, 2, "heads", cache.size(2))
            _check_size(fn, name, x, 3, "head dim", cache.size(3))
    if (rotary_cos is None) != (rotary_sin is None):
        _fail(fn, "rotary_cos and rotary_sin go together: got only one of them")
    if rotary_cos is not None:
        if k is None:
            _fail(fn, "rotary_cos / rotary_sin need the new k / v to append (they rotate them)")
        if rotary_cos.dim() != 2 or rotary_sin.shape != rotary_cos.shape:
            _fail(
                fn,
                "rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), got "
                f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}",
            )
        if 2 * rotary_cos.size(1) > q.size(3):
            _fail(fn, f"rotary_dim ({2 * rotary_cos.size(1)}) must be <= head dim {q.size(3)}")
    return k_cache.size(1)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    k_descale=None,
    v_descale=None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Incremental decoding against a KV cache, FlashAttention's semantics: q (B, Sq, H, D),
    k_cache / v_cache (B_cache, S_cache, Hkv, D) (paged: (num_blocks, page_size, Hkv, D) with
    block_table (B, max_blocks) int32), updated in place with k / v (B, S_new, Hkv, D) at rows
    ``cache_seqlens`` (the lengths before the append; not modified); keys of sequence b are
    cache rows ``[cache_leftpad[b], cache_seqlens[b] + S_new)`` of cache batch row
    ``cache_batch_idx[b]``; with ``rotary_cos`` / ``rotary_sin`` (S_ro, rotary_dim / 2) the new
    keys rotate at positions ``cache_seqlens + i``, and q at the same positions if causal or
    windowed, else all at ``cache_seqlens``. Returns out (B, Sq, H, Dv), with
    return_softmax_lse also lse (B, H, Sq). ``k_descale`` / ``v_descale``: a float8 cache's
    scales (FlashAttention 3's; one value per cache). Not differentiable."""
    fn = "flash_attn_with_kvcache"
    paged = block_table is not None
    seqlen_k = _check_kvcache(
        fn, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, paged
    )
    k_scale, v_scale = (_cache_scale(fn, n, d) for n, d in (("k", k_descale), ("v", v_descale)))
    _check_common(fn, 0.0, window_size)
    B, sq = q.shape[0], q.shape[1]
    dev = k_cache.device
    if paged:
        if cache_batch_idx is not None:
            _fail(fn, "a paged cache (block_table) takes no cache_batch_idx")
        if cache_leftpad is not None:
            _fail(fn, "a paged cache (block_table) takes no cache_leftpad")
        seqlen_k = block_table.size(-1) * k_cache.size(1)
    if rotary_cos is not None and rotary_cos.size(0) < seqlen_k:
        _fail(fn, f"rotary_cos / rotary_sin must cover the cache's {seqlen_k} positions, got "
                  f"{rotary_cos.size(0)}")  # fmt: skip
    if cache_seqlens is None:  # the whole cache
        lens = torch.full((B,), seqlen_k, dtype=torch.int32, device=dev)
    elif isinstance(cache_seqlens, int):
        lens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=dev)
    else:
        lens = cache_seqlens
    s_new = 0 if k is None else k.size(1)
    if paged:
        _check_block_table(fn, block_table, k_cache, v_cache, B, lens + s_new)
        _check_page_range(fn, block_table, k_cache, lens + s_new)
    # The ops read and write the (num_blocks, Hkv, page_size, D) view of the pages through the
    # table (whose rows they need contiguous), on the CPU and on CUDA: nothing is gathered and
    # no length is read on the host.
    table = block_table.contiguous() if paged else None
    left, right = (int(w) for w in window_size)
    lens_after = lens
    if k is not None:
        if rotary_cos is not None:
            steps = torch.arange(s_new, device=dev)
            k = _rotate(k, rotary_cos, rotary_sin, lens.long()[:, None] + steps, rotary_interleaved)
            q_steps = torch.arange(sq, device=dev) if causal or (left, right) != NO_WINDOW else 0
            q_pos = (lens.long()[:, None] + q_steps).expand(B, sq)
            q = _rotate(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        if cache_batch_idx is not None:
            # kv_cache_append writes sequence b at cache row b of a dense cache; this cache
            # places it at row cache_batch_idx[b], so the rows are written by index.
            rows = lens.long()[:, None] + torch.arange(s_new, device=dev)  # (B, S_new)
            where = (cache_batch_idx.long()[:, None].expand_as(rows), rows)
            with torch.no_grad():  # not differentiable, as in FlashAttention
                k_cache[where] = _stored(k, k_cache.dtype, k_scale)
                v_cache[where] = _stored(v, v_cache.dtype, v_scale)
            lens_after = lens + s_new
        else:
            # kv_cache_append advances the lengths it is given; FlashAttention's cache_seqlens
            # stay the lengths before the append, so it works on a copy.
            lens_after = lens.to(torch.int32, copy=True)
            with torch.no_grad():
                _ops.kv_cache_append(
                    k_cache.transpose(1, 2),
                    v_cache.transpose(1, 2),
                    lens_after,
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    block_table=table,
                    k_scale=k_scale,
                    v_scale=v_scale,
                )
    out, lse = decode_attention(
        q.transpose(1, 2),
        k_cache.transpose(1, 2),
        v_cache.transpose(1, 2),
        lens_after,
        scale=softmax_scale,
        causal=causal,
        window_left=left,
        window_right=-1 if causal else right,  # causal already ends the band at the query
        num_splits=num_splits,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=table,
        return_lse=True,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out


def _cache_scale(fn, name, descale) -> float:
    """FlashAttention 3's ``{name}_descale`` as the one float attn_ext's caches keep: a number,
    or a tensor whose values are all equal (read on the host); 1.0 when not given."""
    if descale is None:
        return 1.0
    if not isinstance(descale, torch.Tensor):
        return float(descale)
    if descale.numel() == 0:
        _fail(fn, f"{name}_descale is empty")
    flat = descale.detach().flatten()
    if not bool((flat == flat[0]).all()):
        _fail(
            fn,
            f"{name}_descale must hold one value per cache (attn_ext's float8 caches keep one "
            f"scale, as vLLM's do), got {flat.unique().numel()} distinct values",
        )
    return float(flat[0])


def _stored(x, cache_dtype, scale):
    """x as a cache of ``cache_dtype`` stores it: a float8 cache holds x / scale, rounded to
    nearest even and saturated at the format's largest value (kv_cache_append's quantization);
    any other cache x itself."""
    if cache_dtype not in _FLOAT8_CACHE_DTYPES:
        return x
    big = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-big, big).to(cache_dtype)
