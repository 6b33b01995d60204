"""Decoding: RoPE, the KV cache and decode attention, against the references in
attn_ext/testing/decoding.py (documents 000 and 003), plus the incremental == full checks."""

import inspect

import pytest
import torch

import attn_ext
from attn_ext.compat import torchcode
from attn_ext.testing.decoding import (
    Doc000KVCacheAttention,
    decode_reference,
    doc000_apply_rope,
    page_out,
    rope_reference,
)
from attn_ext.testing.numerics import (
    ALL_DTYPES,
    assert_error_rule,
    assert_lse_close,
    ground_truth,
    rand,
)

ops = torch.ops.attn_ext


def _truth_rope(x, **kw):
    return rope_reference(x.detach().double(), compute_dtype=torch.float64, **kw)


# ------------------------------------------------------------------------ decoding state classes


def test_state_classes_live_in_caches_and_keep_their_old_paths():
    from attn_ext import caches, decoding
    from attn_ext.nn import linear_attention, tensor_product_attention

    for name in (
        "KVCache",
        "PagedKVCache",
        "LatentKVCache",
        "TPAFactorCache",
        "LinearAttentionState",
    ):
        cls = getattr(caches, name)
        assert cls.__module__ == "attn_ext.caches" and getattr(attn_ext, name) is cls
    # where users could import them from before they moved
    assert decoding.KVCache is caches.KVCache and decoding.LatentKVCache is caches.LatentKVCache
    assert (
        attn_ext.nn.TPAFactorCache
        is tensor_product_attention.TPAFactorCache
        is caches.TPAFactorCache
    )
    assert (
        attn_ext.nn.LinearAttentionState
        is linear_attention.LinearAttentionState
        is caches.LinearAttentionState
    )
    with pytest.raises(AttributeError, match="no attribute 'KVCach'"):
        decoding.KVCach  # noqa: B018


# --------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [None, 32])
@pytest.mark.parametrize("pos_kind", ["default", "offset", "shared", "per_batch"])
@pytest.mark.parametrize("layout", ["contiguous", "bshd", "noncontig"])
def test_rope_against_reference(device, dtype, interleaved, rotary_dim, pos_kind, layout):
    B, H, S, D = 2, 3, 37, 64
    x = rand((B, H, S, D), dtype, device, layout=layout)
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, base=10000.0)
    if pos_kind == "offset":
        kw["offset"] = 4093
    elif pos_kind == "shared":
        kw["positions"] = torch.randint(0, 32768, (S,), device=device, dtype=torch.int32)
    elif pos_kind == "per_batch":
        kw["positions"] = torch.randint(0, 32768, (B, S), device=device)
    out = attn_ext.rope(x, **kw)
    assert out.dtype == dtype and out.shape == x.shape
    if layout == "bshd":  # keeps the (B, S, H, D) memory layout, as ATen's pointwise ops do
        assert out.stride() == x.stride()
    assert_error_rule(out, rope_reference(x, **kw), _truth_rope(x, **kw), name="rope")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("D,rotary_dim", [(6, None), (46, 22), (80, None), (128, None), (128, 64)])
def test_rope_strided_rows_give_the_contiguous_bits(device, dtype, interleaved, D, rotary_dim):
    """A row read with a feature stride takes the scalar loop, a contiguous one the vector loop
    where the CPU has one (8 pairs, or 4 interleaved, a step, then the scalar tail): both form
    rotate_pair's FMAs, so the bits agree, NaN / Inf included. Before the FMAs were written out,
    fp32 rows differed at every head dim here (GCC contracted each loop its own way)."""
    torch.manual_seed(0)
    wide = torch.randn(2, 3, 37, 2 * D, dtype=torch.float64) * 10
    wide[0, 0, 0, 2], wide[0, 1, 2, 4] = float("nan"), float("inf")
    strided = wide.to(device=device, dtype=dtype)[..., ::2]
    assert strided.stride(-1) == 2
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, offset=1000)
    a, b = attn_ext.rope(strided, **kw), attn_ext.rope(strided.contiguous(), **kw)
    # in place, each step's loads come before its stores: the same bits again
    c = attn_ext.rope_(strided.contiguous(), **kw)
    for other in (a, c):
        assert torch.equal(other.isnan(), b.isnan())
        assert torch.equal(other.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("D", [16, 64, 96, 128])
def test_apply_rope_matches_document(device, dtype, D):
    q = torch.randn(2, 300, D, device=device, dtype=dtype)
    k = torch.randn(2, 300, D, device=device, dtype=dtype)
    doc_q, doc_k = doc000_apply_rope(q, k)
    our_q, our_k = torchcode.apply_rope(q, k)
    for ours, doc, x in ((our_q, doc_q, q), (our_k, doc_k, k)):
        truth = _truth_rope(x.unsqueeze(1), interleaved=True).squeeze(1)  # the document's pairs
        if dtype == torch.float64:
            # The document's float32 frequency is an ulp off for some exponents: compare to it
            # at the scale that error allows, and to the truth exactly.
            torch.testing.assert_close(ours, doc, rtol=0, atol=300 * 2e-7)
        assert_error_rule(ours, doc.to(dtype), truth, name="apply_rope")
    # The document's own checks: shape and norm preserved.
    assert our_q.shape == q.shape
    torch.testing.assert_close(our_q.norm(dim=-1), q.norm(dim=-1), atol=1e-4, rtol=1e-5)


def test_apply_rope_bad_input():
    with pytest.raises(ValueError, match="3-D"):
        torchcode.apply_rope(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="even"):
        torchcode.apply_rope(torch.randn(1, 3, 5), torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match="same shape"):
        torchcode.apply_rope(torch.randn(1, 3, 4), torch.randn(1, 4, 4))


def test_rope_preserves_norm_and_relative_position(device):
    D = 64
    q = torch.randn(1, 1, 1, D, dtype=torch.float64, device=device)
    k = torch.randn(1, 1, 1, D, dtype=torch.float64, device=device)
    for interleaved in (True, False):
        rq = lambda p, il=interleaved: attn_ext.rope(q, offset=p, interleaved=il)  # noqa: E731
        rk = lambda p, il=interleaved: attn_ext.rope(k, offset=p, interleaved=il)  # noqa: E731
        torch.testing.assert_close(rq(1234).norm(), q.norm())
        # <rope(q, i), rope(k, j)> depends on i - j only, up to the fp32 rounding of the
        # angles (relative 2^-24 of each angle, at most position * inv_freq <= position)
        positions = (5, 17, 300, 4000)
        dots = [(rq(i) * rk(i - 5)).sum().item() for i in positions]
        tol = 2 * q.norm().item() * k.norm().item() * max(positions) * 2.0**-24
        assert max(dots) - min(dots) < tol, (dots, tol)
        assert abs((rq(5) * rk(0)).sum().item() - (rq(5) * rk(1)).sum().item()) > 1e-6


def test_rope_inplace_and_backward(device):
    x = torch.randn(2, 4, 9, 32, dtype=torch.float64, device=device)
    pos = torch.randint(0, 100, (2, 9), device=device)
    out = attn_ext.rope(x, positions=pos, interleaved=False)
    y = x.clone()
    assert attn_ext.rope_(y, positions=pos, interleaved=False) is y
    torch.testing.assert_close(y, out, rtol=0, atol=0)
    # the backward is the inverse rotation
    back = ops.rope_backward(out, pos, interleaved=False)
    torch.testing.assert_close(back, x)
    xg = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: attn_ext.rope(t, positions=pos, rotary_dim=16), (xg,))
    assert torch.autograd.gradcheck(
        lambda t: attn_ext.rope(t.transpose(1, 2), offset=7),
        (torch.randn(1, 5, 2, 8, dtype=torch.float64, device=device, requires_grad=True),),
    )
    with pytest.raises(RuntimeError, match="not differentiable"):
        attn_ext.rope_(xg)
    with pytest.raises(RuntimeError, match="memory location|internal overlap|overlap"):
        attn_ext.rope_(torch.randn(1, 1, 1, 8, device=device).expand(2, 3, 4, 8))


def test_rope_3d_and_empty(device):
    x = torch.randn(2, 5, 8, device=device)
    torch.testing.assert_close(
        attn_ext.rope(x, offset=3), attn_ext.rope(x.unsqueeze(1), offset=3).squeeze(1)
    )
    assert attn_ext.rope(torch.randn(0, 2, 3, 8, device=device)).shape == (0, 2, 3, 8)
    y = torch.randn(1, 1, 4, 8, device=device)
    torch.testing.assert_close(attn_ext.rope(y, rotary_dim=0), y, rtol=0, atol=0)


def test_rope_bad_input(device):
    x = torch.randn(1, 2, 3, 8, device=device)
    cases = [
        (dict(rotary_dim=5), "rotary_dim must be even"),
        (dict(rotary_dim=10), r"rotary_dim must be even and in \[0, head_dim = 8\]"),
        (
            dict(positions=torch.zeros(4, dtype=torch.long, device=device)),
            r"positions must have shape \(S,\)",
        ),
        (dict(positions=torch.zeros(3, device=device)), "positions must be int32 or int64"),
        (dict(positions=torch.zeros(3, dtype=torch.long, device=device), offset=2), "not both"),
        (dict(base=0.0), "base must be positive"),
    ]
    for kw, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            attn_ext.rope(x, **kw)
    with pytest.raises(RuntimeError, match="head dim 7|rotary_dim must be even"):
        attn_ext.rope(torch.randn(1, 1, 2, 7, device=device))
    with pytest.raises(RuntimeError, match="x must be 4-D"):
        ops.rope(torch.randn(2, 8, device=device))
    with pytest.raises(RuntimeError, match="x must be float"):
        ops.rope(torch.zeros(1, 1, 2, 8, dtype=torch.long, device=device))


# ----------------------------------------------------------------------------------- KV cache


def _cache(device, B=3, Hkv=2, L=16, D=8, Dv=None, dtype=torch.float32):
    return attn_ext.KVCache(B, Hkv, L, D, Dv, dtype=dtype, device=device)


@pytest.mark.parametrize("rope", [False, True])
def test_kv_cache_append_layout_and_rope(device, rope):
    c = _cache(device, Dv=6)
    chunks = []
    for s in (5, 1, 1, 3):
        k = torch.randn(3, 2, s, 8, device=device).transpose(-1, -2).contiguous().transpose(-1, -2)
        v = torch.randn(3, 2, s, 6, device=device)
        c.append(k, v, rope=rope, rope_interleaved=False)
        chunks.append((k, v))
    assert c.lengths.tolist() == [10, 10, 10]
    k_all = torch.cat([k for k, _ in chunks], 2)
    v_all = torch.cat([v for _, v in chunks], 2)
    if rope:
        k_all = attn_ext.rope(k_all, interleaved=False)
    torch.testing.assert_close(c.k[:, :, :10], k_all, rtol=0, atol=0)
    torch.testing.assert_close(c.v[:, :, :10], v_all, rtol=0, atol=0)
    assert (c.k[:, :, 10:] == 0).all() and (c.v[:, :, 10:] == 0).all()


def test_kv_cache_append_left_padded(device):
    c = _cache(device)
    c.append(
        torch.randn(3, 2, 7, 8, device=device),
        torch.randn(3, 2, 7, 8, device=device),
        new_lengths=torch.tensor([0, 3, 7], device=device),
    )
    c.k[:, :, :7].zero_()  # only the positions matter below
    k = torch.randn(3, 2, 4, 8, device=device)
    v = torch.randn(3, 2, 4, 8, device=device)
    n = torch.tensor([4, 1, 0], device=device)
    c.append(k, v, new_lengths=n, rope=True)
    assert c.lengths.tolist() == [4, 4, 7]
    torch.testing.assert_close(c.k[0, :, :4], attn_ext.rope(k[0:1], offset=0)[0])
    torch.testing.assert_close(c.k[1, :, 3:4], attn_ext.rope(k[1:2, :, 3:], offset=3)[0])
    torch.testing.assert_close(c.v[1, :, 3], v[1, :, 3])
    assert (c.k[2] == 0).all()


def _snapshot(c):
    return c.k.clone(), c.v.clone(), c.lengths.clone()


def test_kv_cache_errors_leave_cache_untouched(device):
    c = _cache(device)
    c.append(torch.randn(3, 2, 10, 8, device=device), torch.randn(3, 2, 10, 8, device=device))
    before = _snapshot(c)
    k7, v7 = torch.randn(3, 2, 7, 8, device=device), torch.randn(3, 2, 7, 8, device=device)
    bad = [
        (
            (k7, v7),
            {},
            "sequence 0 would overflow the cache: "
            "cache_seqlens\\[0\\] = 10 \\+ 7 new tokens > capacity 16",
        ),
        ((k7.double(), v7.double()), {}, "k must have k_cache's dtype"),
        (
            (torch.randn(3, 4, 1, 8, device=device), torch.randn(3, 4, 1, 8, device=device)),
            {},
            "k heads",
        ),
        (
            (torch.randn(3, 2, 1, 6, device=device), torch.randn(3, 2, 1, 8, device=device)),
            {},
            "k head dim",
        ),
        (
            (torch.randn(2, 2, 1, 8, device=device), torch.randn(2, 2, 1, 8, device=device)),
            {},
            "k batch size",
        ),
        (
            (torch.randn(3, 2, 1, 8, device=device), torch.randn(3, 2, 2, 8, device=device)),
            {},
            "v length",
        ),
        (
            (k7[:, :, :1], v7[:, :, :1]),
            dict(new_lengths=torch.tensor([1, 2, 0], device=device)),
            r"new_lengths\[1\] must be in \[0, 1\]",
        ),
        ((k7[:, :, :1], v7[:, :, :1]), dict(rope=True, rotary_dim=3), "rotary_dim must be even"),
    ]
    for (k, v), kw, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            c.append(k, v, **kw)
        for a, b in zip(before, _snapshot(c)):
            assert torch.equal(a, b), msg
    with pytest.raises(RuntimeError, match="cache_seqlens must have shape"):
        ops.kv_cache_append(c.k, c.v, c.lengths[:2], k7, v7)
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32 or int64"):
        ops.kv_cache_append(c.k, c.v, c.lengths.float(), k7, v7)


# ----------------------------------------------------------------------------- decode attention


def _filled_cache(device, B, Hkv, L, D, Dv, dtype, lengths, v_view=False):
    k = rand((B, Hkv, L, D), dtype, device)
    if v_view:  # values as a strided view of a wider cache (MLA-style), never copied
        wide = rand((B, Hkv, L, Dv + 16), dtype, device)
        v = wide[..., :Dv]
    else:
        v = rand((B, Hkv, L, Dv), dtype, device)
    return k, v, torch.tensor(lengths, dtype=torch.int32, device=device)


DECODE_CASES = [
    # B, H, Hkv, Sq, L, D, Dv, lengths, extra
    (3, 8, 2, 1, 700, 64, 64, [700, 517, 1], {}),
    (2, 8, 1, 1, 600, 64, 48, [0, 600], dict(v_view=True)),
    (2, 4, 4, 3, 300, 32, 32, [300, 2], {}),
    (1, 32, 8, 1, 2100, 128, 128, [2050], {}),
    (2, 6, 3, 5, 257, 16, 16, [257, 256], dict(window_left=7)),
    (2, 4, 2, 2, 90, 16, 16, [90, 33], dict(causal=False)),
    (2, 4, 2, 130, 200, 16, 16, [200, 140], {}),  # row blocks of 128 rows
]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_attention(device, dtype, num_splits, case):
    B, H, Hkv, Sq, L, D, Dv, lengths, extra = DECODE_CASES[case]
    extra = dict(extra)
    v_view = extra.pop("v_view", False)
    k, v, lens = _filled_cache(device, B, Hkv, L, D, Dv, dtype, lengths, v_view)
    q = rand((B, H, Sq, D), dtype, device, layout="bshd")
    out, lse = attn_ext.decode_attention(
        q, k, v, lens, num_splits=num_splits, return_lse=True, **extra
    )
    ref_out, ref_lse = decode_reference(q, k, v, lens, **extra)
    t_out, t_lse = ground_truth(decode_reference, q, k, v, lens, **extra)
    assert_error_rule(out, ref_out, t_out, name="decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="decode lse")


# FlashAttention's with_kvcache arguments and the score modifiers, each alone and combined.
# Sequence lengths 300, 41, 1, 0 (the last two: one key; no key, so every row sees nothing and
# gives out 0, lse = the sink or -inf); with cache_leftpad 40 for the last, all of whose keys
# lie before its start, and 39 for the second, where Sq = 4 puts two queries before it.
FA_LENGTHS = [300, 41, 1, 0]
FA_LEFTPAD_LENGTHS = [300, 41, 1, 40]
FA_LEFTPAD = [3, 39, 0, 40]


def _fa_case_args(kind, B, H, rows, device):
    g = torch.Generator().manual_seed(3)

    def ints(values):
        return torch.tensor(values[:B], dtype=torch.int32, device=device)

    if kind == "window_right":
        return dict(causal=False, window_left=5, window_right=3)
    if kind == "window_right_only":  # no left bound: keys [0, pos + 2]
        return dict(causal=False, window_right=2)
    if kind == "softcap":
        return dict(softcap=2.0)
    if kind == "alibi_head":
        return dict(alibi_slopes=torch.rand(H, generator=g).to(device))
    if kind == "alibi_batch_noncausal":
        return dict(alibi_slopes=torch.rand(B, H, generator=g).to(device), causal=False)
    if kind == "sinks":
        return dict(sinks=torch.randn(H, generator=g).to(device))
    if kind == "batch_idx":  # a cache row may serve two sequences
        return dict(cache_batch_idx=ints([4, 1, 5, 1]))
    if kind == "leftpad":
        return dict(cache_leftpad=ints(FA_LEFTPAD))
    if kind == "everything":
        return dict(
            softcap=3.0,
            alibi_slopes=torch.rand(B, H, generator=g).to(device),
            sinks=torch.randn(H, generator=g).to(device),
            cache_batch_idx=ints([4, 1, 2, 0]),
            cache_leftpad=ints(FA_LEFTPAD),
            window_left=50,
        )
    if kind == "everything_noncausal":
        return dict(
            causal=False,
            window_left=30,
            window_right=7,
            softcap=2.5,
            alibi_slopes=torch.rand(H, generator=g).to(device),
            sinks=torch.randn(H, generator=g).to(device),
            cache_batch_idx=ints([0, 5, 3, 2]),
            cache_leftpad=ints(FA_LEFTPAD),
        )
    raise ValueError(kind)


FA_DECODE_KINDS = [
    "window_right",
    "window_right_only",
    "softcap",
    "alibi_head",
    "alibi_batch_noncausal",
    "sinks",
    "batch_idx",
    "leftpad",
    "everything",
    "everything_noncausal",
]


def _check_fa_case(device, dtype, num_splits, sq, kind, H, Hkv, D, Dv, L=300):
    B, rows = 4, 6
    extra = _fa_case_args(kind, B, H, rows, device)
    indexed = "cache_batch_idx" in extra
    k, v, _ = _filled_cache(device, rows if indexed else B, Hkv, L, D, Dv, dtype, [0])
    lengths = FA_LEFTPAD_LENGTHS if "cache_leftpad" in extra else FA_LENGTHS
    lens = torch.tensor([min(n, L) for n in lengths], dtype=torch.int32, device=device)
    q = rand((B, H, sq, D), dtype, device, layout="bshd")
    out, lse = attn_ext.decode_attention(
        q, k, v, lens, num_splits=num_splits, return_lse=True, **extra
    )
    assert out.shape == (B, H, sq, Dv) and lse.shape == (B, H, sq)
    ref_out, ref_lse = decode_reference(q, k, v, lens, **extra)
    t_out, t_lse = ground_truth(decode_reference, q, k, v, lens, **extra)
    assert_error_rule(out, ref_out, t_out, name="decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="decode lse")


# Queries per step: decode steps (1, 4), and a chunk of 20, which the CPU runs on the flash
# forward (at least kPackedMinQueries rows per head; decoding/cpu/decode_attention.cpp).
DECODE_SQ = [1, 4, 20]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sq", DECODE_SQ)
@pytest.mark.parametrize("kind", FA_DECODE_KINDS)
def test_decode_flash_attn_arguments(device, dtype, num_splits, sq, kind):
    """On CUDA (D = 32, Dv = 24: the SIMT kernel) this is what verifies the kernel code of
    these arguments there (on by default since it ran green on an H100, 2026-11-27)."""
    _check_fa_case(device, dtype, num_splits, sq, kind, H=8, Hkv=2, D=32, Dv=24)


# Head dims and head groupings (MHA, MQA, GQA with odd G; Dv != D) with every argument (each
# combination once split, once not; test_decode_flash_attn_arguments has both for each).
FA_SHAPES = [(4, 4, 64, 64), (8, 1, 128, 128), (6, 2, 96, 40), (3, 3, 8, 16)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("sq", DECODE_SQ)
@pytest.mark.parametrize("shape", FA_SHAPES, ids=lambda s: "H{}_Hkv{}_D{}_Dv{}".format(*s))
@pytest.mark.parametrize("kind,num_splits", [("everything", 1), ("everything_noncausal", 4)])
def test_decode_flash_attn_arguments_shapes(device, dtype, sq, shape, kind, num_splits):
    H, Hkv, D, Dv = shape
    _check_fa_case(device, dtype, num_splits, sq, kind, H, Hkv, D, Dv, L=160)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", ["contiguous", "batch_idx", "leftpad", "paged"])
def test_decode_chunks_run_on_the_flash_forward(dtype, where):
    """A step of at least 16 queries per head is the flash forward's: each sequence's output
    and lse are the bits of `attention` on that sequence's own keys (bottom-right), through
    cache_batch_idx, cache_leftpad or a block table alike."""
    torch.manual_seed(0)
    B, H, Hkv, D, L, sq = 3, 8, 2, 64, 96, 24
    lens, pad = [90, 24, 61], [0, 0, 0]
    kw = {}
    rows = torch.arange(B)
    if where == "batch_idx":
        rows = torch.tensor([4, 0, 2])
        kw["cache_batch_idx"] = rows.int()
    if where == "leftpad":
        pad = [7, 0, 30]
        kw["cache_leftpad"] = torch.tensor(pad, dtype=torch.int32)
    k = torch.randn(5, Hkv, L, D).to(dtype)
    v = torch.randn(5, Hkv, L, D).to(dtype)
    k_in, v_in = (k, v) if where == "batch_idx" else (k[:B], v[:B])
    if where == "paged":
        k_in, v_in, kw["block_table"] = page_out(k[:B], v[:B], 16, seed=3)
    q = torch.randn(B, H, sq, D).to(dtype)
    lengths = torch.tensor(lens, dtype=torch.int32)
    out, lse = attn_ext.decode_attention(q, k_in, v_in, lengths, return_lse=True, **kw)
    for b in range(B):
        keys = slice(pad[b], lens[b])
        want, want_lse = attn_ext.attention(
            q[b : b + 1], k[rows[b] : rows[b] + 1, :, keys], v[rows[b] : rows[b] + 1, :, keys],
            causal=True, return_lse=True,
        )  # fmt: skip
        assert torch.equal(out[b : b + 1], want), (b, (out[b] - want[0]).abs().max())
        assert torch.equal(lse[b : b + 1], want_lse)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rows_without_keys(device, num_splits):
    """A row that sees no key (length 0, all keys before cache_leftpad, or a query before the
    first key) gives out 0 exactly and lse = its head's sink (-inf without sinks)."""
    k, v, _ = _filled_cache(device, 3, 2, 64, 16, 16, torch.float32, [0])
    q = torch.randn(3, 4, 4, 16, device=device)
    lens = torch.tensor([0, 20, 30], dtype=torch.int32, device=device)
    leftpad = torch.tensor([0, 20, 28], dtype=torch.int32, device=device)
    sinks = torch.randn(4, device=device)
    for s in (None, sinks):
        out, lse = attn_ext.decode_attention(
            q, k, v, lens, sinks=s, cache_leftpad=leftpad, num_splits=num_splits, return_lse=True
        )
        empty = torch.zeros(3, 4, 4, dtype=torch.bool, device=device)
        empty[0], empty[1] = True, True
        empty[2, :, :2] = True  # positions 26, 27 lie before the first key, 28
        want = torch.full_like(lse, float("-inf")) if s is None else s[None, :, None].expand_as(lse)
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        # the sink goes to the log2 domain and back: an ulp of float32 rounding
        torch.testing.assert_close(lse[empty], want[empty], rtol=3e-7, atol=0)
        assert torch.isfinite(lse[~empty]).all() and out[~empty].abs().sum() > 0


def test_decode_flash_attn_empty_batch(device):
    q = torch.randn(0, 4, 2, 8, device=device)
    idx = torch.zeros(0, dtype=torch.int32, device=device)
    for rows in (0, 3):  # an empty cache, or one with rows nobody reads
        k = torch.randn(rows, 2, 10, 8, device=device)
        out, lse = attn_ext.decode_attention(
            q, k, k, idx, cache_batch_idx=idx, cache_leftpad=idx, return_lse=True
        )
        assert out.shape == (0, 4, 2, 8) and lse.shape == (0, 4, 2)


def test_decode_flash_attn_argument_errors():
    k, v, lens = _filled_cache("cpu", 2, 2, 10, 8, 8, torch.float32, [5, 6])
    q = torch.randn(2, 4, 1, 8)
    cases = [
        (dict(cache_batch_idx=torch.tensor([0, 2])), r"cache_batch_idx\[1\] must be in \[0, 1\]"),
        (dict(cache_batch_idx=torch.tensor([-1, 0])), r"cache_batch_idx\[0\] must be in"),
        (dict(cache_batch_idx=torch.tensor([0.0, 1.0])), "cache_batch_idx must be int32 or int64"),
        (dict(cache_batch_idx=torch.tensor([0])), r"cache_batch_idx must have shape \(B,\)"),
        (dict(cache_leftpad=torch.tensor([6, 0])), r"cache_leftpad\[0\] = 6 exceeds cache_seqlens"),
        (dict(cache_leftpad=torch.tensor([0, -1])), r"cache_leftpad\[1\] must be in \[0, 10\]"),
        (dict(sinks=torch.zeros(3)), "sinks must have shape"),
        (dict(sinks=torch.zeros(4, dtype=torch.int32)), "sinks must be floating"),
        (dict(alibi_slopes=torch.zeros(3, 4)), r"alibi_slopes must have shape \(H,\)"),
        (dict(softcap=-1.0), "softcap must be finite and >= 0"),
        (dict(causal=False, window_right=-2), r"window_size\[1\] \(right\) must be >= -1"),
    ]
    for kw, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            attn_ext.decode_attention(q, k, v, lens, **kw)
    # Without cache_batch_idx the cache's batch must be q's.
    k3, v3, _ = _filled_cache("cpu", 3, 2, 10, 8, 8, torch.float32, [5])
    with pytest.raises(RuntimeError, match=r"k_cache batch size \(dim 0\) must be 2, got 3"):
        attn_ext.decode_attention(q, k3, v3, lens)


def test_decode_split_invariance(device):
    """The split-KV merge changes the summation order only."""
    k, v, lens = _filled_cache(device, 1, 2, 5000, 64, 64, torch.float64, [4999])
    q = torch.randn(1, 8, 1, 64, dtype=torch.float64, device=device)
    outs = [attn_ext.decode_attention(q, k, v, lens, num_splits=s) for s in (1, 2, 7, 40)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-12, atol=1e-12)


def test_decode_bad_input(device):
    k, v, lens = _filled_cache(device, 2, 2, 10, 8, 8, torch.float32, [3, 10])
    q = torch.randn(2, 4, 1, 8, device=device)
    cases = [
        ((q, k, v, lens[:1]), {}, r"cache_seqlens must have shape \(B,\)"),
        ((q, k.double(), v, lens), {}, "k_cache must have q's dtype"),
        (
            (torch.randn(2, 3, 1, 8, device=device), k, v, lens),
            {},
            "multiple of the cache's kv heads",
        ),
        ((torch.randn(2, 4, 1, 4, device=device), k, v, lens), {}, "k_cache head dim"),
        ((q, k, v[:, :, :5], lens), {}, "v_cache capacity"),
        ((q, k, v, lens), dict(num_splits=-1), "num_splits must be >= 0"),
        ((q, k, v, lens), dict(window_left=-2), "window_size\\[0\\]"),
    ]
    if device == "cpu":  # a GPU op cannot read the lengths without a sync: its kernel clamps
        cases.append(
            (
                (q, k, v, torch.tensor([3, 11], device=device)),
                {},
                r"cache_seqlens\[1\] must be in \[0, 10\], got 11",
            )
        )
    for args, kw, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            attn_ext.decode_attention(*args, **kw)


# ---------------------------------------------------------- incremental decoding == full forward


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_decoder_incremental_equals_full(device, heads, interleaved):
    H, Hkv = heads
    m = attn_ext.nn.DecoderAttention(
        64, H, Hkv, rope_interleaved=interleaved, device=device, dtype=torch.float64
    )
    x = torch.randn(2, 40, 64, dtype=torch.float64, device=device)
    full = m(x)
    with torch.no_grad():
        c = m.new_cache(2, 64)
        outs = [m(x[:, :9], c)] + [m(x[:, t : t + 1], c) for t in range(9, 40)]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-12)
    assert c.lengths.tolist() == [40, 40]


def test_decoder_positions_must_continue(device):
    """Document 003's pitfall: restarting the positions at every step changes the result, so
    the equality above checks the offsets."""
    m = attn_ext.nn.DecoderAttention(32, 4, 2, device=device, dtype=torch.float64)
    x = torch.randn(1, 6, 32, dtype=torch.float64, device=device)
    full = m(x)
    with torch.no_grad():
        c = m.new_cache(1, 8)
        m(x[:, :5], c)
        q = m._heads(m.q_proj(x[:, 5:]), 4)
        k = m._heads(m.k_proj(x[:, 5:]), 2)
        c.append(k, m._heads(m.v_proj(x[:, 5:]), 2), rope=True, rope_interleaved=False)
        restarted = c.attend(attn_ext.rope(q, interleaved=False))  # position 0 instead of 5
        last = m.o_proj(restarted.transpose(1, 2).reshape(1, 1, 32))
    assert (last - full[:, 5:]).abs().max() > 1e-3


def test_decoder_ragged_left_padded(device):
    m = attn_ext.nn.DecoderAttention(64, 8, 2, window_left=6, device=device, dtype=torch.float64)
    lens = [17, 9, 1]
    x = torch.randn(3, 17, 64, dtype=torch.float64, device=device)
    y = torch.randn(3, 12, 64, dtype=torch.float64, device=device)
    xp = torch.zeros_like(x)
    for b, n in enumerate(lens):
        xp[b, 17 - n :] = x[b, :n]
    with torch.no_grad():
        c = m.new_cache(3, 40)
        pre = m(xp, c, new_lengths=torch.tensor(lens, device=device))
        steps = torch.cat([m(y[:, t : t + 1], c) for t in range(12)], 1)
    assert c.lengths.tolist() == [n + 12 for n in lens]
    for b, n in enumerate(lens):
        full = m(torch.cat([x[b : b + 1, :n], y[b : b + 1]], 1))
        torch.testing.assert_close(pre[b : b + 1, 17 - n :], full[:, :n], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(steps[b : b + 1], full[:, n:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_low_precision_generation(device, dtype):
    """A long prefill + many steps in reduced precision stays as close to the float64 full
    forward as the full forward at that precision is."""
    torch.manual_seed(1)
    m64 = attn_ext.nn.DecoderAttention(128, 8, 2, device=device, dtype=torch.float64)
    m = attn_ext.nn.DecoderAttention(128, 8, 2, device=device, dtype=dtype)
    m.load_state_dict(m64.state_dict())
    x = torch.randn(2, 300, 128, dtype=torch.float64, device=device)
    truth = m64(x)
    with torch.no_grad():
        full = m(x.to(dtype))
        c = m.new_cache(2, 512)
        inc = torch.cat(
            [m(x[:, :200].to(dtype), c)]
            + [m(x[:, t : t + 1].to(dtype), c) for t in range(200, 300)],
            1,
        )
    err_full = (full.double() - truth).abs().max().item()
    err_inc = (inc.double() - truth).abs().max().item()
    assert err_inc <= 2 * err_full + torch.finfo(dtype).eps, (err_inc, err_full)


def test_kv_cache_attention_matches_document(device):
    torch.manual_seed(0)
    doc = Doc000KVCacheAttention(64, 4).to(device)
    ours = torchcode.KVCacheAttention(64, 4).to(device)
    ours.load_state_dict(doc.state_dict(), strict=True)
    x = torch.randn(2, 6, 64, device=device)
    # the document's own check: incremental decoding equals the full forward
    full, _ = ours(x)
    o1, cache = ours(x[:, :4])
    o2, cache = ours(x[:, 4:5], cache=cache)
    o3, cache = ours(x[:, 5:6], cache=cache)
    torch.testing.assert_close(torch.cat([o1, o2, o3], 1), full, atol=1e-5, rtol=1e-5)
    # and each call equals the document's, cache tuple included
    d1, dcache = doc(x[:, :4])
    d2, dcache = doc(x[:, 4:5], cache=dcache)
    o1, ocache = ours(x[:, :4])
    o2, ocache = ours(x[:, 4:5], cache=ocache)
    for a, b in ((o1, d1), (o2, d2), (ocache[0], dcache[0]), (ocache[1], dcache[1])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # gradients of every parameter agree with the document's (float64)
    doc64, ours64 = doc.double(), ours.double()
    x64 = torch.randn(2, 5, 64, dtype=torch.float64, device=device)
    for mod in (doc64, ours64):
        mod.zero_grad()
        _, cache = mod(x64[:, :3])
        out, _ = mod(x64[:, 3:], cache=cache)
        out.square().sum().backward()
    for (n, p), (_, q) in zip(doc64.named_parameters(), ours64.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-10, msg=n)
    with pytest.raises(ValueError, match="cache must be the \\(k, v\\) tuple"):
        ours(x.double(), cache=torch.zeros(1))
    with pytest.raises(ValueError, match="cache k must be"):
        ours(x.double(), cache=(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16)))


# ------------------------------------------------------------------------ default RoPE pair layout
# Every entry point defaults to the halves (i, i + rotary_dim/2) of LLaMA, FlashAttention and
# FlashInfer. Exceptions by design: the document-000 drop-in torchcode.apply_rope (the document's
# pairs, checked in test_apply_rope_matches_document) and MultiHeadLatentAttention (DeepSeek-V2's
# checkpoints are interleaved).

ROPE_FLAG_OPS = {
    "rope": "interleaved",
    "rope_": "interleaved",
    "rope_backward": "interleaved",
    "kv_cache_append": "rope_interleaved",
    "latent_cache_append": "rope_interleaved",
    "tpa_expand": "rope_interleaved",
    "tpa_expand_backward": "rope_interleaved",
}


def test_op_schemas_default_to_halves():
    # Every attn_ext schema with a layout flag, so that a new op with the old default fails too.
    flags = {
        s.name.split("::")[1]: (a.name, a.default_value)
        for s in torch._C._jit_get_all_schemas()
        if s.name.startswith("attn_ext::")
        for a in s.arguments
        if a.name in ("interleaved", "rope_interleaved")
    }
    assert set(ROPE_FLAG_OPS) <= set(flags)
    assert flags == {op: (flag, False) for op, (flag, _) in flags.items()}
    assert all(flags[op][0] == flag for op, flag in ROPE_FLAG_OPS.items())


def _layout_entry_points(device):
    """name -> (layout flag, fn(**flag) -> tensor): each public way to rotate by RoPE."""
    x = torch.randn(2, 3, 5, 8, device=device)
    pos = torch.tensor([4, 9, 1, 0, 30], device=device)
    a, b = torch.randn(2, 5, 3, 4, device=device), torch.randn(2, 5, 3, 8, device=device)
    grad = torch.randn(2, 5, 4, 8, device=device)
    lengths = torch.tensor([0, 2], dtype=torch.int32, device=device)

    def in_place(op):
        def run(**kw):
            y = x.clone()
            op(y, pos, **kw)
            return y

        return run

    def cache_append(**kw):
        c = attn_ext.KVCache(2, 3, 8, 8, device=device)
        c.append(x, x, rope=True, **kw)
        return c.k

    def op_cache_append(**kw):
        kc, vc = x.new_zeros(2, 3, 8, 8), x.new_zeros(2, 3, 8, 8)
        ops.kv_cache_append(kc, vc, lengths.clone(), x, x, rope=True, **kw)
        return kc

    def latent_append(**kw):
        c = attn_ext.LatentKVCache(2, 8, 6, 8, device=device)
        c.append(x[:, :1, :, :6], x[:, 1:2], **kw)
        return c.kv

    def op_latent_append(**kw):
        kv = x.new_zeros(2, 1, 8, 14)
        ops.latent_cache_append(kv, lengths.clone(), x[:, :1, :, :6], x[:, 1:2], **kw)
        return kv

    def tpa_backward(**kw):
        grads = ops.tpa_expand_backward(grad, a, b, rope=True, **kw)
        return torch.cat([g.flatten() for g in grads])

    return {
        "attn_ext.rope": ("interleaved", lambda **kw: attn_ext.rope(x, positions=pos, **kw)),
        "attn_ext.rope_": (
            "interleaved",
            in_place(lambda y, p, **kw: attn_ext.rope_(y, positions=p, **kw)),
        ),
        "ops.rope": ("interleaved", lambda **kw: ops.rope(x, pos, **kw)),
        "ops.rope_": ("interleaved", in_place(ops.rope_)),
        "ops.rope_backward": ("interleaved", lambda **kw: ops.rope_backward(x, pos, **kw)),
        "KVCache.append": ("rope_interleaved", cache_append),
        "ops.kv_cache_append": ("rope_interleaved", op_cache_append),
        "LatentKVCache.append": ("rope_interleaved", latent_append),
        "ops.latent_cache_append": ("rope_interleaved", op_latent_append),
        "attn_ext.tpa_expand": (
            "rope_interleaved",
            lambda **kw: attn_ext.tpa_expand(a, b, rope=True, **kw),
        ),
        "ops.tpa_expand": ("rope_interleaved", lambda **kw: ops.tpa_expand(a, b, rope=True, **kw)),
        "ops.tpa_expand_backward": ("rope_interleaved", tpa_backward),
    }


@pytest.mark.parametrize("entry", list(_layout_entry_points("cpu")))
def test_default_rope_layout_is_halves(device, entry):
    flag, fn = _layout_entry_points(device)[entry]
    halves, pairs = fn(**{flag: False}), fn(**{flag: True})
    assert not torch.equal(halves, pairs)  # the two layouts differ on these inputs
    torch.testing.assert_close(fn(), halves, rtol=0, atol=0)


@pytest.mark.parametrize(
    "module, interleaved",
    [
        (attn_ext.nn.DecoderAttention, False),
        (attn_ext.nn.TensorProductAttention, False),
        (attn_ext.nn.MultiHeadLatentAttention, True),
    ],
)
def test_module_rope_layout_defaults(module, interleaved):
    assert inspect.signature(module).parameters["rope_interleaved"].default is interleaved
