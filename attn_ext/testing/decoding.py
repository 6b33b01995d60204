"""References for the decoding family (RoPE, KV cache, decode attention), plain PyTorch
written for the tests (the documents' own code comes from attn_ext.testing.documents).

* document 000 ``apply_rope``: (B, S, D) inputs at positions ``0..S-1``; the frequencies
  ``1 / 10000 ** (2i / D)`` and the angles in float32; features ``(2i, 2i + 1)`` rotated as a
  pair and interleaved back;
* the "halves" layout of LLaMA / GPT-NeoX (HuggingFace ``rotate_half``): pair ``i`` is
  ``(i, i + d/2)``, computed as ``x * cos + rotate_half(x) * sin`` in the input dtype;
* document 000 ``KVCacheAttention``: the cache grows by ``torch.cat`` along the sequence, and
  a prefill of ``S_new > 1`` tokens adds ``triu(-inf, diagonal=S_total - S_new + 1)``;
* document 003 ``decode_step``: positions of new tokens continue at the cache length, and the
  grouped KV heads are expanded with ``repeat_kv`` before plain attention;
* paged caches: ``page_out`` copies a contiguous cache into shuffled pages behind a block table,
  ``gather_pages`` reads a block table back into a contiguous cache.
"""

from __future__ import annotations

import torch

from attn_ext.testing.attention import attention_reference, repeat_kv
from attn_ext.testing.documents import doc000


def rope_inv_freq(rotary_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """float32 frequencies 1 / base ** (2i / rotary_dim) as attn_ext defines them: the exponent
    formed in float32 (arange / d, as the documents and HuggingFace do), the power in float64,
    rounded once. (torch's own float32 pow is off by an ulp for ~1.5% of the exponents, which
    plain references inherit.) Formed on the CPU: torch's CUDA division by a scalar multiplies
    by its reciprocal, which rounds some exponents 2i / d differently from a true division."""
    exponent = torch.arange(0, rotary_dim, 2).float() / rotary_dim
    return (1.0 / (base ** exponent.double())).float().to(device)


def rope_angles(
    positions: torch.Tensor, rotary_dim: int, base: float = 10000.0, inv_freq=None
) -> torch.Tensor:
    """float32 angles (..., rotary_dim / 2) = float32(position) * inv_freq, one float32
    rounding; ``inv_freq`` defaults to :func:`rope_inv_freq`."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(rotary_dim, base, positions.device)
    return positions.float().unsqueeze(-1) * inv_freq


def torch_inv_freq(rotary_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """The frequencies as the documents compute them: every step in torch float32."""
    pairs = torch.arange(0, rotary_dim, 2, device=device).float()
    return 1.0 / (base ** (pairs / rotary_dim))


# Scaled RoPE variants as model configs give them (`rope_scaling` dicts), for a 64-wide rotation
# (longrope's factors are per pair): tests/test_rope_scaling.py, the rope fuzz family.
ROPE_SCALING_EXAMPLES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "llama3": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    # DeepSeek-V2's (its config says "type"; mscale / mscale_all_dim cancel in the factor)
    "yarn_deepseek": dict(
        type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
    "longrope": dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.01 * i for i in range(32)],
        long_factor=[1.5 + 0.1 * i for i in range(32)],
        original_max_position_embeddings=4096,
    ),
}


def _positions(x: torch.Tensor, positions, offset: int) -> torch.Tensor:
    """(B or 1, S) positions for x (B, H, S, D)."""
    S = x.size(-2)
    if positions is None:
        return (torch.arange(S, device=x.device) + offset).unsqueeze(0)
    return (positions.view(1, S) if positions.dim() == 1 else positions).to(x.device)


def rope_reference(
    x: torch.Tensor,
    *,
    positions=None,
    offset: int = 0,
    base: float = 10000.0,
    interleaved: bool = False,
    rotary_dim=None,
    inv_freq=None,
    attention_scaling: float = 1.0,
    compute_dtype=None,
) -> torch.Tensor:
    """RoPE of x (B, H, S, D) with fp32 angles. ``compute_dtype`` None: a plain implementation
    at x's dtype (torch's float32 frequencies, cos/sin cast to x's dtype, as HuggingFace
    does); float64: the ground truth (attn_ext's frequencies, cos/sin and rotation in
    float64). A scaled variant: ``inv_freq`` (read in float32) replaces the frequencies and
    cos / sin are multiplied by ``attention_scaling`` before the cast (HuggingFace's order)."""
    rot = x.size(-1) if rotary_dim is None else rotary_dim
    dt = compute_dtype or x.dtype
    truth = compute_dtype == torch.float64
    if inv_freq is not None:
        inv = inv_freq.detach().float().to(x.device)
    else:
        inv = (rope_inv_freq if truth else torch_inv_freq)(rot, base, x.device)
    ang = rope_angles(_positions(x, positions, offset), rot, base, inv_freq=inv)  # (B|1, S, rot/2)
    wide = ang.to(torch.float64) if dt == torch.float64 else ang
    cos = (torch.cos(wide) * attention_scaling).to(dt)[:, None]
    sin = (torch.sin(wide) * attention_scaling).to(dt)[:, None]
    xr, rest = x[..., :rot].to(dt), x[..., rot:].to(dt)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    else:
        cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        half = rot // 2
        rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)  # rotate_half
        y = xr * cos2 + rotated * sin2
    return torch.cat([y, rest], dim=-1)


# Document 000's apply_rope and KVCacheAttention (attn_ext.testing.documents reproduces the
# documents' code; its apply_rope computes the frequencies in torch float32 like the document).
doc000_apply_rope = doc000.apply_rope
Doc000KVCacheAttention = doc000.KVCacheAttention


def decode_reference(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    scale=None,
    causal=True,
    window_left=-1,
    window_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    cache_batch_idx=None,
    cache_leftpad=None,
):
    """Attention of q (B, H, Sq, D) against each sequence's cache rows [leftpad_b, lengths[b])
    of cache batch row cache_batch_idx[b] (default b), query i at key position
    lengths[b] - Sq + i (bottom-right), GQA by expanding the KV heads (document 003's
    repeat_kv); softcap / alibi_slopes ((H,) or (B, H)) / sinks as attention_reference.
    Returns (out, lse) like attention_reference."""
    outs, lses = [], []
    n_rep = q.size(1) // k_cache.size(1)
    sq = q.size(2)
    for b in range(q.size(0)):
        n = int(lengths[b])
        first = 0 if cache_leftpad is None else int(cache_leftpad[b])
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        k = repeat_kv(k_cache[row : row + 1, :, first:n], n_rep)
        v = repeat_kv(v_cache[row : row + 1, :, first:n], n_rep)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        out, lse = attention_reference(
            q[b : b + 1],
            k,
            v,
            scale=scale,
            causal=causal,
            window_size=(window_left, 0 if causal else window_right),
            softcap=softcap,
            alibi_slopes=slopes,
            sinks=sinks,
            key_offset=(n - first) - sq,
            return_lse=True,
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def page_out(k, v, page_size, *, shared_prefix_pages=0, seed=0, spare_pages=3):
    """The rows of a contiguous cache k (B, Hkv, L, D), v (B, Hkv, L, Dv) copied into pages of
    a paged cache (num_pages, Hkv, page_size, *) in shuffled order, with ``spare_pages`` unused
    pages of garbage (as are the rows of a last page past L). With ``shared_prefix_pages``,
    sequence 1's first pages are sequence 0's own (its rows there are made equal to sequence
    0's, in k and v, first). Returns (k_pages, v_pages, block_table (B, ceil(L / page_size))
    int32)."""
    B, Hkv, L, D = k.shape
    max_pages = -(-L // page_size)
    g = torch.Generator().manual_seed(seed)
    if shared_prefix_pages:
        rows = shared_prefix_pages * page_size
        k[1, :, :rows] = k[0, :, :rows]
        v[1, :, :rows] = v[0, :, :rows]
    num_pages = B * max_pages + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    table = perm[: B * max_pages].view(B, max_pages).to(torch.int32)
    if shared_prefix_pages:
        table[1, :shared_prefix_pages] = table[0, :shared_prefix_pages]
    k_pages = torch.randn(num_pages, Hkv, page_size, D, generator=g).to(k.dtype)
    v_pages = torch.randn(num_pages, Hkv, page_size, v.size(3), generator=g).to(v.dtype)
    for b in range(B):
        for i in range(max_pages):
            r0, r1 = i * page_size, min(L, (i + 1) * page_size)
            if b == 1 and i < shared_prefix_pages:
                continue
            k_pages[table[b, i], :, : r1 - r0] = k[b, :, r0:r1]
            v_pages[table[b, i], :, : r1 - r0] = v[b, :, r0:r1]
    return k_pages, v_pages, table


def gather_pages(pages, table, page_size):
    """The contiguous cache (B, Hkv, max_pages * page_size, *) a block table (B, max_pages)
    describes over ``pages`` (num_pages, Hkv, page_size, *); entries < 0 read page 0."""
    B, max_pages = table.shape
    got = pages[table.long().clamp(min=0)]  # (B, max_pages, Hkv, page_size, *)
    return got.transpose(1, 2).reshape(B, pages.size(1), max_pages * page_size, -1)
