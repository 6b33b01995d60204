"""Reference implementations the attn_ext kernels are tested against.

Everything here is plain PyTorch written for the tests (no attn_ext import).
It reproduces what the source documents under ``shared/seeds`` compute:

* document 000 (TorchCode, chapter 3): scaled dot-product attention on
  (B, S, D) tensors, self and cross attention (Sq != Sk, Dv != D), the causal
  mask built from ``triu`` of ``-inf``, the KV-cache prefill mask
  (``triu(..., diagonal=S_total - S_new + 1)``, i.e. bottom-right causal),
  grouped-query attention that expands the KV heads with
  ``repeat_interleave`` on dim 1, the symmetric sliding window
  ``|i - j| <= w`` and the tiled "flash attention" that walks over key blocks
  with an online softmax (running max, running sum, rescaled accumulator);
* document 001 (LLMs from scratch, chapter 3): causal attention that fills the
  strict upper triangle with ``-inf`` before the softmax and applies dropout
  to the attention weights;
* document 003 (textbook 4.2): masked stable attention with a bool mask
  (True = visible), the softmax taken in float32 and cast back, dropout on the
  probabilities, ``repeat_kv`` (expand + reshape) and temperature
  ``softmax(s / tau)`` where ``s = q.k / sqrt(d_h)``;
* document 004 (attention zoo): self / cross attention are plain scaled
  dot-product attention; ``GroupedAttention`` maps query head ``h`` to KV head
  ``h % (num_heads // num_groups)``.

Corrections of the documents (see design.md, "Where a document's code is
wrong"): a query row that can see no key yields zeros (document 003 would
give a uniform average because it fills with ``finfo.min``; documents 000/001
would give NaN), and document 004's ``GroupedAttention`` lets query group
``g`` read the keys of *batch element* ``g``; the reference below keeps only
its head mapping, applied within each batch element.

Mask conventions are those of attn_ext (SPEC): causal and windows are
bottom-right aligned, query ``i`` sits at key position ``i + Sk - Sq``;
``window_size=(left, right)`` keeps keys ``j`` in
``[i + Sk - Sq - left, i + Sk - Sq + right]`` with ``-1`` = unbounded; causal
means ``right = 0``. A bool ``attn_mask`` keeps True entries, a floating one is
added to the scaled scores.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

import attn_ext
from attn_ext.testing.documents import doc000
from attn_ext.testing.numerics import LOW_PRECISION, ground_truth, to_f64


# --------------------------------------------------------------------------- #
# Masks
# --------------------------------------------------------------------------- #
def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def window_keep(
    sq: int, sk: int, window_size=(-1, -1), causal: bool = False, device=None, key_offset=None
) -> torch.Tensor:
    """Bool (sq, sk), True where query i may read key j (query i at key i + key_offset,
    default sk - sq: bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(sq, device=device).unsqueeze(1) + (
        sk - sq if key_offset is None else key_offset
    )
    j = torch.arange(sk, device=device).unsqueeze(0)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def top_left_causal_keep(sq: int, sk: int, device=None) -> torch.Tensor:
    """torch SDPA's ``is_causal``: query i reads keys j <= i (top-left aligned)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def symmetric_window_keep(s: int, w: int, device=None) -> torch.Tensor:
    """Document 000's sliding window: position i reads j iff |i - j| <= w."""
    pos = torch.arange(s, device=device)
    return (pos.unsqueeze(0) - pos.unsqueeze(1)).abs() <= w


def kv_cache_additive_mask(
    s_new: int, s_total: int, device=None, dtype=torch.float32
) -> torch.Tensor:
    """Document 000's KV-cache prefill mask: -inf strictly above the diagonal
    that is shifted by the cached length (s_total - s_new)."""
    full = torch.full((s_new, s_total), float("-inf"), device=device, dtype=dtype)
    return torch.triu(full, diagonal=s_total - s_new + 1)


# --------------------------------------------------------------------------- #
# GQA helpers
# --------------------------------------------------------------------------- #
def expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Document 000: repeat each KV head (dim 1) H // Hkv times, so that query
    head h reads KV head h // (H // Hkv)."""
    hkv = x.shape[1]
    assert num_q_heads % hkv == 0, (num_q_heads, hkv)
    if hkv == num_q_heads:
        return x
    return x.repeat_interleave(num_q_heads // hkv, dim=1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Document 003: the same expansion as a stride trick (expand + reshape)."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x.unsqueeze(2).expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


# --------------------------------------------------------------------------- #
# The general reference
# --------------------------------------------------------------------------- #
def attention_reference(
    q,
    k,
    v,
    *,
    scale=None,
    causal=False,
    window_size=(-1, -1),
    attn_mask=None,
    dropout_p: float = 0.0,
    dropout_keep: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    return_probs: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    key_offset: Optional[int] = None,
):
    """Plain scaled dot-product attention with attn_ext's semantics.

    Runs at the dtype of its inputs, like document 003's masked stable
    attention: the scores and both matmuls in the input dtype, the softmax in
    float32 for float16/bfloat16 (float32/float64 keep their own dtype).
    Call it on float64 tensors (``ground_truth``) to get the float64 truth.

    q (B, H, Sq, D) or (B, Sq, D); k (B, Hkv, Sk, D); v (B, Hkv, Sk, Dv).
    ``dropout_keep``: bool keep mask broadcastable to (B, H, Sq, Sk) applied
    after the softmax with 1 / (1 - dropout_p) rescaling (for 3-D inputs a
    (B, Sq, Sk) or (B, 1, Sq, Sk) mask is accepted).
    Score modifiers, on the scaled scores in this order before the masks (Gemma 2's
    logit soft-capping, ALiBi as FlashAttention defines it, gpt-oss's sinks):
    ``softcap`` > 0: ``s = softcap * tanh(s / softcap)``; ``alibi_slopes`` (H,) or (B, H):
    ``s -= slope * |i + key_offset - j|``; ``sinks`` (H,): one more logit per head in every
    row's softmax denominator, with no value (lse includes it). ``key_offset`` (default
    Sk - Sq) aligns query i with key i + key_offset for the band and ALiBi.
    Returns out, and optionally the lse (natural log, scale included, -inf for
    empty rows) and the post-dropout-free probabilities.
    """
    three_d = q.dim() == 3
    if three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
        if dropout_keep is not None and dropout_keep.dim() == 3:
            dropout_keep = dropout_keep.unsqueeze(1)
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    k = expand_kv_heads(k, H)
    v = expand_kv_heads(v, H)
    if scale is None:
        scale = default_scale(D)

    scores = (q @ k.transpose(-2, -1)) * scale  # input dtype
    neg_inf = float("-inf")
    offset = Sk - Sq if key_offset is None else key_offset
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)
        slopes = slopes.view(1, H, 1, 1) if slopes.dim() == 1 else slopes.view(B, H, 1, 1)
        i = torch.arange(Sq, device=q.device).view(-1, 1)
        j = torch.arange(Sk, device=q.device).view(1, -1)
        scores = scores - slopes * (i + offset - j).abs().to(scores.dtype)
    if causal or tuple(window_size) != (-1, -1):
        keep = window_keep(Sq, Sk, window_size, causal, device=q.device, key_offset=offset)
        scores = scores.masked_fill(~keep, neg_inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, neg_inf)
        else:
            scores = scores + attn_mask
    work = scores.float() if scores.dtype in LOW_PRECISION else scores
    if sinks is not None:  # the sink joins as a last column, dropped after the softmax
        sink_col = sinks.to(work.dtype).view(1, H, 1, 1).expand(B, H, Sq, 1)
        full = torch.cat([work, sink_col], dim=-1)
        probs = torch.softmax(full, dim=-1)[..., :Sk]
        lse = torch.logsumexp(full, dim=-1)
    elif Sk == 0:
        probs = work * 0  # (B, H, Sq, 0), keeps the autograd graph
        lse = torch.full(work.shape[:-1], neg_inf, dtype=work.dtype, device=work.device)
    else:
        row_max = work.amax(dim=-1, keepdim=True)
        empty = row_max == neg_inf  # row sees no key
        # Stable softmax with empty rows sent to 0 without producing NaN
        # (neither in the forward nor in the backward).
        probs = torch.softmax(work.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        lse = torch.logsumexp(work, dim=-1)
    weights = probs
    if dropout_p > 0.0 or dropout_keep is not None:
        assert dropout_keep is not None, "pass the keep mask explicitly"
        probs = probs * dropout_keep.to(probs.dtype) / (1.0 - dropout_p)
    out = probs.to(v.dtype) @ v
    if three_d:
        out = out.squeeze(1)
        lse = lse.squeeze(1)
        weights = weights.squeeze(1)
    res = [out]
    if return_lse:
        res.append(lse)
    if return_probs:
        res.append(weights.to(q.dtype))
    return res[0] if len(res) == 1 else tuple(res)


def attention_varlen_reference(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_keep=None, **kw
):
    """FlashAttention's varlen layout through :func:`attention_reference`, one sequence at a
    time: q (total_q, H, D), k / v (total_k, Hkv, *), cu_seqlens (B + 1,). Sequence b is
    attention over its own tokens (causal / window bottom-right within it); ``alibi_slopes``
    (H,) or (B, H); ``dropout_keep`` (H, total_q, max Sk) keep mask indexed by token and
    key within the sequence. Returns out (total_q, H, Dv) and, with return_lse, lse
    (H, total_q)."""
    return_lse = kw.pop("return_lse", False)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qs = q[cq[b] : cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        keep = None
        if dropout_keep is not None:
            keep = dropout_keep[:, cq[b] : cq[b + 1], : ck[b + 1] - ck[b]].unsqueeze(0)
        o, lse = attention_reference(
            qs, ks, vs, alibi_slopes=slopes, dropout_keep=keep, return_lse=True, **kw
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, 0) if outs else q.new_zeros((0, q.size(1), v.size(2)))
    lse = torch.cat(lses, 1) if lses else q.new_zeros((q.size(1), 0))
    return (out, lse) if return_lse else out


def paged_varlen_kv(k, v, lens_k, page, layout="flash_attn", seed=0):
    """Packed (total_k, Hkv, *) keys / values of sequences `lens_k` as pages of `page` rows in
    shuffled order, with one spare page; every page row no sequence owns (a last page's tail,
    the spare page) is NaN, so a read past a sequence's keys poisons the output. `layout`
    "flash_attn": (num_pages, page, Hkv, *) contiguous; "heads_first": a view of
    (num_pages, Hkv, page, *) storage. Returns (k_pages, v_pages, block_table)."""
    per_seq = [(n + page - 1) // page for n in lens_k]
    width = max(max(per_seq, default=0), 1)
    order = torch.randperm(sum(per_seq) + 1, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(lens_k), width, dtype=torch.int32)
    pages = []
    for x in (k, v):
        shape = (sum(per_seq) + 1, page, *x.shape[1:])
        if layout == "heads_first":
            store = torch.full((shape[0], shape[2], page, shape[3]), float("nan"), dtype=x.dtype)
            pg = store.to(x.device).transpose(1, 2)
        else:
            pg = torch.full(shape, float("nan"), dtype=x.dtype).to(x.device)
        pages.append(pg)
    used, start = 0, 0
    for b, n in enumerate(lens_k):
        for i in range(per_seq[b]):
            page_id = int(order[used])
            table[b, i] = page_id
            rows = slice(start + i * page, start + min(n, (i + 1) * page))
            count = rows.stop - rows.start
            for pg, x in zip(pages, (k, v)):
                pg[page_id, :count] = x[rows]
            used += 1
        start += n
    return pages[0], pages[1], table.to(k.device)


# kernel_traits.h: a query block of fewer rows than kPackedMinQueries runs on BLAS unless (fp32)
# its head has at most kPackedFewKeys keys.
PACKED_MIN_QUERIES, PACKED_FEW_KEYS = 16, 64


def assert_paged_like_packed(paged, packed, max_seqlen_q, max_seqlen_k):
    """A paged varlen call's output (or lse) against the same call on packed keys: bit for bit
    where the CPU forward runs its own products (the packed panels and bf16 pairs read each key
    row from its page in the order they read it from its token), within the output dtype's
    rounding (assert_close's defaults) where BLAS runs (fp64; few query rows), whose summation
    order follows its operands' alignment and leading dimension (MKL)."""
    own = (
        attn_ext._C.cpu_block_kernels() != "blas"
        and packed.dtype != torch.float64
        and (
            max_seqlen_q >= PACKED_MIN_QUERIES
            or (packed.dtype == torch.float32 and max_seqlen_k <= PACKED_FEW_KEYS)
        )
    )
    if own:
        diff = (paged.double() - packed.double()).abs().max() if paged.numel() else 0
        assert torch.equal(paged, packed), f"max diff {diff}"
    else:
        torch.testing.assert_close(paged, packed, equal_nan=True)


def attention_weights_reference(q, k, **kw):
    """Probability matrix (B, H, Sq, Sk) in q's dtype (softmax in fp32)."""
    v = q.new_zeros(*k.shape[:-1], 1)
    return attention_reference(q, k, v, return_probs=True, **kw)[1]


def logit_rounding_floor(q, k, dtype, *, scale=None, attn_mask=None, ulps: float = 1.0, **kw):
    """An absolute floor for the error of attention probabilities computed at ``dtype`` from
    fp32 logits: ``ulps`` times the largest change of a probability when each logit moves by one
    rounding unit of the sum of its terms (eps * scale * log2(e) * sum_d |q_d k_d|, plus the
    additive mask's value). A kernel sums each logit's D products in fp32 and scales it into the
    log2 domain, so its logits carry that rounding whatever the order; the plain reference can
    be exact by luck. The probabilities' derivative gives the bound:
    |dP_ij| <= ln 2 * P_ij * (e_ij + sum_k P_ik e_ik) for logit errors e. Large logits (an explicit
    scale of 2.5, D 61: 7 float32 ulps of P, found by tests/test_fuzz.py's --fuzz) are where it
    exceeds a few ulps of P. q (B, H, Sq, D) or (B, Sq, D), k with Hkv heads; the options of
    attention_weights_reference. The other additive terms of a logit count as the mask's value
    does: ALiBi's ``slope * distance`` (one key 24 positions away with slope ~1, float32 under
    the avx2 kernel set: 7 ulps of P = 1, found by --fuzz) and a sink's logit, which the row's
    float32 lse carries."""
    q64, k64, mask = to_f64(q), to_f64(k), to_f64(attn_mask)
    if q64.dim() == 3:
        q64, k64 = q64.unsqueeze(1), k64.unsqueeze(1)
        if isinstance(mask, torch.Tensor) and mask.dim() == 3:
            mask = mask.unsqueeze(1)
    probs = ground_truth(attention_weights_reference, q64, k64, scale=scale, attn_mask=mask, **kw)
    sc = scale if scale is not None else default_scale(q64.shape[-1])
    terms = q64.abs() @ expand_kv_heads(k64, q64.shape[1]).abs().transpose(-1, -2)
    mag = sc * terms
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mag = mag + mask.abs().nan_to_num(0.0, posinf=0.0)
    B, H, Sq, Sk = mag.shape
    slopes = kw.get("alibi_slopes")
    if slopes is not None:
        offset = Sk - Sq if kw.get("key_offset") is None else kw["key_offset"]
        i = torch.arange(Sq, dtype=torch.float64, device=mag.device)[:, None]
        j = torch.arange(Sk, dtype=torch.float64, device=mag.device)[None, :]
        per_head = to_f64(slopes).abs().reshape(-1, H)[:, :, None, None]
        mag = mag + per_head * (i + offset - j).abs()
    sinks = kw.get("sinks")
    if sinks is not None:
        mag = mag + to_f64(sinks).abs().view(1, H, 1, 1)
    err = torch.finfo(dtype).eps * math.log2(math.e) * mag.masked_fill(probs == 0, 0.0)
    bound = math.log(2) * probs * (err + (probs * err).sum(-1, keepdim=True))
    return ulps * bound.max().item() if bound.numel() else 0.0


def stored_output_grad_floors(q, k, out, out_true, grad_out, *, scale=None, **kw):
    """The part of dq and dk that comes from the stored output's rounding, bounded per element:
    (bound of dq (B, H, Sq, D), bound of dk (B, Hkv, Sk, D)).

    FlashAttention's backward, ours and torch's take delta = rowsum(dO * O) from the output O as
    stored (bf16 / fp16 rounded), so dS = P (dP - delta) carries -P_ij d_i with
    d_i = rowsum(dO * (O_stored - O)), which autograd through the plain reference does not: in a
    row that sees one key P is 1, the true dS exactly 0, and the reference's dq exactly 0 (21 bf16
    ulps of dq at Dv 29 with dropout, found by tests/test_fuzz.py's --fuzz). Then
    |ddq_i| <= scale |d_i| sum_j P_ij |k_j| and |ddk_j| <= scale sum_i P_ij |d_i| |q_i| (softcap's
    derivative is at most 1; dropout does not enter delta's term). q, out, out_true, grad_out
    (B, H, Sq, *), k (B, Hkv, Sk, D); the attention options but dropout."""
    q64, k64 = to_f64(q), to_f64(k)
    b, h, sq, d = q64.shape
    hkv, sk = k64.shape[1], k64.shape[2]
    probs = ground_truth(attention_weights_reference, q64, k64, scale=scale, **kw)
    sc = scale if scale is not None else default_scale(d)
    rows = ((to_f64(out) - to_f64(out_true)) * to_f64(grad_out)).sum(-1).abs()  # |d_i|, (B, H, Sq)
    dq = sc * rows[..., None] * (probs @ expand_kv_heads(k64, h).abs())
    dk = sc * torch.einsum("bhij,bhi,bhid->bhjd", probs, rows, q64.abs())
    return dq, dk.reshape(b, hkv, h // hkv, sk, d).sum(2)


def sdpa_reference(
    query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False
):
    """torch.nn.functional.scaled_dot_product_attention semantics (top-left
    is_causal), with empty rows -> 0 (attn_ext's documented difference)."""
    sq, sk = query.shape[-2], key.shape[-2]
    mask = attn_mask
    if is_causal:
        tl = top_left_causal_keep(sq, sk, device=query.device)
        if mask is None:
            mask = tl
        elif mask.dtype == torch.bool:
            mask = mask & tl
        else:
            mask = mask.masked_fill(~tl, float("-inf"))
    if not enable_gqa:
        assert query.dim() < 4 or query.shape[-3] == key.shape[-3]
    return attention_reference(query, key, value, scale=scale, attn_mask=mask)


# --------------------------------------------------------------------------- #
# Document-specific references
# --------------------------------------------------------------------------- #
# Document 000's own functions, as attn_ext.testing.documents reproduces them; the helpers below
# are the documents' cores at shapes their classes do not expose (4-D heads, an explicit dropout
# keep mask, Sq != Sk).
doc000_sdpa = doc000.scaled_dot_product_attention
doc000_causal_attention = doc000.causal_attention


def doc000_gqa_attention(q, k, v):
    """000 GroupQueryAttention core: q (B,H,S,dk), k/v (B,Hkv,S,dk)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


def doc000_sliding_window_attention(Q, K, V, w: int):
    """000: position i attends to j iff |i - j| <= w (Sq == Sk)."""
    scores = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    far = ~symmetric_window_keep(Q.shape[-2], w, device=Q.device)
    scores = scores.masked_fill(far, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


def doc000_kv_cache_attention(q, k, v):
    """000 KVCacheAttention core: q holds the S_new newest positions, k/v all
    S_total positions; prefill (S_new > 1) adds the shifted triu mask."""
    s_new, s_total = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if s_new > 1:
        scores = scores + kv_cache_additive_mask(s_new, s_total, q.device, scores.dtype)
    return torch.softmax(scores, dim=-1) @ v


def doc000_tiled_flash_attention(
    q, k, v, *, block_size: int = 32, scale=None, keep: Optional[torch.Tensor] = None
):
    """000 flash_attention: one pass over key blocks with an online softmax.

    Generalised to any leading dims, Sq != Sk, Dv != D and an optional bool
    keep mask (broadcastable to (..., Sq, Sk)). Per key block: new running max,
    rescale accumulator and running sum by exp(old_max - new_max), add
    exp(s - new_max) @ V_block. Returns (out, lse); empty rows give 0 / -inf.
    """
    *lead, sq, d = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    if scale is None:
        scale = default_scale(d)
    if keep is not None:
        keep = torch.broadcast_to(keep, (*lead, sq, sk))
    neg_inf = float("-inf")
    acc = q.new_zeros(*lead, sq, dv)
    row_max = q.new_full((*lead, sq, 1), neg_inf)
    row_sum = q.new_zeros(*lead, sq, 1)
    for start in range(0, sk, block_size):
        end = min(start + block_size, sk)
        s = (q @ k[..., start:end, :].transpose(-1, -2)) * scale
        if keep is not None:
            s = s.masked_fill(~keep[..., start:end], neg_inf)
        new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
        # a row that has seen no visible key yet keeps max -inf; measure
        # its exponentials from 0 so that they are exactly 0 and not NaN.
        ref_point = new_max.masked_fill(new_max == neg_inf, 0.0)
        correction = torch.exp(row_max - ref_point)
        p = torch.exp(s - ref_point)
        acc = acc * correction + p @ v[..., start:end, :]
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        row_max = new_max
    seen = row_sum > 0
    out = torch.where(seen, acc / torch.where(seen, row_sum, torch.ones_like(row_sum)), 0.0)
    lse = torch.where(
        seen, row_max + torch.log(torch.where(seen, row_sum, torch.ones_like(row_sum))), neg_inf
    ).squeeze(-1)
    return out, lse


def doc001_causal_attention(queries, keys, values, *, dropout_keep=None, dropout_p=0.0):
    """001 CausalAttention core: scores.masked_fill(triu(ones, 1), -inf), softmax
    of scores / sqrt(d_k), dropout on the weights, weights @ values.
    Dropout is given as an explicit keep mask (nn.Dropout scales by 1/(1-p))."""
    n = queries.shape[-2]
    scores = queries @ keys.transpose(-2, -1)
    future = torch.triu(torch.ones(n, keys.shape[-2], device=queries.device), diagonal=1).bool()
    scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
    if dropout_keep is not None:
        weights = weights * dropout_keep.to(weights.dtype) / (1.0 - dropout_p)
    return weights @ values


def doc003_masked_stable_attention(q, k, v, mask=None, *, dropout_keep=None, dropout_p=0.0):
    """003 ``attention``: scores / sqrt(Dh), masked_fill(~mask, finfo.min)
    (mask True = visible), softmax in float32 cast back to q's dtype, dropout on
    the probabilities, probs @ v. Correction: a row with no visible key -> 0
    (the document's finfo.min fill would average every value there)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    # "softmax in a stable dtype": at least float32 (float64 stays float64)
    work = scores.float() if scores.dtype in LOW_PRECISION else scores
    probs = torch.softmax(work, dim=-1).to(q.dtype)
    if mask is not None:
        empty = ~mask.any(dim=-1, keepdim=True)
        probs = probs.masked_fill(empty, 0.0)
    if dropout_keep is not None:
        probs = probs * dropout_keep.to(probs.dtype) / (1.0 - dropout_p)
    return probs @ v


def doc003_temperature_attention(q, k, v, tau: float):
    """003: alpha = softmax(s / tau) with s = q.k / sqrt(d_h); the same as
    scaled attention with scale = 1 / (tau * sqrt(d_h))."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s / tau
    work = s.float() if s.dtype in LOW_PRECISION else s
    return torch.softmax(work, dim=-1).to(q.dtype) @ v


def doc004_grouped_attention_heads(q, k, v):
    """004 GroupedAttention's head mapping, applied within each batch element:
    q (B, H, S, d), k/v (B, Hkv, S, d); query head h reads KV head h % Hkv
    (the document tiles the KV heads instead of repeat_interleave)."""
    reps = q.shape[1] // k.shape[1]
    k = k.repeat(1, reps, 1, 1)
    v = v.repeat(1, reps, 1, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v
