"""attn_ext.flash_attn against FlashAttention 2's documented semantics
(attn_ext/testing/flash_attn.py), every public function and argument; numerics rule as in
test_attention.py (error against the float64 truth at most 2x the plain reference's at the
input dtype, plus one rounding unit)."""

import pytest
import torch

import attn_ext.flash_attn as fa
from attn_ext.testing.attention import attention_weights_reference
from attn_ext.testing.flash_attn import (
    flash_attn_func_reference,
    flash_attn_varlen_func_reference,
    flash_attn_with_kvcache_reference,
)
from attn_ext.testing.numerics import (
    ALL_DTYPES,
    assert_error_rule,
    assert_lse_close,
    autograd_grads,
    grad_slack_ulps,
    ground_truth,
    ground_truth_grads,
)

DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in ALL_DTYPES]


# (name, kwargs, alibi kind): every option flash_attn_func takes
OPTIONS = [
    ("plain", {}, None),
    ("causal", dict(causal=True), None),
    ("window", dict(window_size=(6, 2)), None),
    ("causal_window_scale", dict(causal=True, window_size=(5, -1), softmax_scale=0.2), None),
    ("softcap", dict(softcap=3.0, causal=True), None),
    ("alibi_head", dict(causal=True), "head"),
    ("alibi_batch", {}, "batch"),
]


def _alibi(kind, B, H, device):
    if kind == "head":
        return torch.rand(H, device=device)
    if kind == "batch":
        return torch.rand(B, H, device=device)
    return None


def bshd(B, S, H, D, dtype, device):
    return torch.randn(B, S, H, D, device=device).to(dtype)


def check(actual, ref_fn, *args, name="out", **kw):
    ref = ref_fn(*args, **kw)
    tru = ground_truth(ref_fn, *args, **kw)
    assert_error_rule(actual, ref, tru, name=name)


# ------------------------------------------------------------------ flash_attn_func and packings
@pytest.mark.parametrize("option", OPTIONS, ids=[o[0] for o in OPTIONS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 19, 33, 4, 2, 32), (1, 40, 12, 6, 1, 80)])
def test_flash_attn_func(device, dtype, option, shape):
    B, Sq, Sk, H, Hkv, D = shape  # Sq != Sk both ways, GQA and MQA, an odd head dim
    _, kw, alibi = option
    q, k, v = bshd(B, Sq, H, D, dtype, device), bshd(B, Sk, Hkv, D, dtype, device), None
    v = bshd(B, Sk, Hkv, D, dtype, device)
    kw = dict(kw, alibi_slopes=_alibi(alibi, B, H, device))
    out = fa.flash_attn_func(q, k, v, **kw)
    assert out.shape == (B, Sq, H, D) and out.is_contiguous() and out.dtype == dtype
    check(out, flash_attn_func_reference, q, k, v, **kw)
    out2, lse, s_dmask = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert torch.equal(out2, out)
    # FlashAttention >= 2.6 returns probabilities only with dropout: an empty tensor here
    assert s_dmask.shape == (0,) and s_dmask.dtype == dtype and s_dmask.device == q.device
    ref, ref_lse = flash_attn_func_reference(q, k, v, return_lse=True, **kw)
    _, tru_lse = ground_truth(flash_attn_func_reference, q, k, v, return_lse=True, **kw)
    assert lse.shape == (B, H, Sq)
    assert_lse_close(lse, ref_lse, tru_lse)


@pytest.mark.parametrize("option", OPTIONS, ids=[o[0] for o in OPTIONS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_func_backward(device, dtype, option):
    B, S, H, Hkv, D = 2, 23, 4, 2, 32
    _, kw, alibi = option
    kw = dict(kw, alibi_slopes=_alibi(alibi, B, H, device))
    inputs = [bshd(B, S, h, D, dtype, device) for h in (H, Hkv, Hkv)]
    g = torch.randn(B, S, H, D, device=device).to(dtype)
    got = autograd_grads(lambda a, b, c: fa.flash_attn_func(a, b, c, **kw), inputs, g)
    ref = autograd_grads(lambda a, b, c: flash_attn_func_reference(a, b, c, **kw), inputs, g)
    tru = ground_truth_grads(flash_attn_func_reference, inputs, g, **kw)
    for name, a, r, t in zip(("dq", "dk", "dv"), got, ref, tru):
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(dtype))


def test_packed_forms_equal_the_unpacked(device):
    B, S, H, D = 2, 17, 4, 16
    qkv = torch.randn(B, S, 3, H, D, device=device, requires_grad=True)
    kw = dict(causal=True, softcap=2.0)
    q, k, v = qkv.unbind(2)
    out = fa.flash_attn_qkvpacked_func(qkv, **kw)
    torch.testing.assert_close(out, fa.flash_attn_func(q, k, v, **kw), rtol=0, atol=0)
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
    kv = torch.randn(B, 9, 2, 2, D, device=device)
    out = fa.flash_attn_kvpacked_func(q.detach(), kv, window_size=(3, 1))
    ref = fa.flash_attn_func(q.detach(), kv[:, :, 0], kv[:, :, 1], window_size=(3, 1))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _round128(n):
    return (n + 127) // 128 * 128


def _from_s_dmask(s_dmask, v, p):
    """The output a (B, H, Sq, Sk) S_dmask implies: |S| are the probabilities, a minus sign
    (also on -0.0) marks a dropped entry, the kept ones rescaled by 1 / (1 - p). v (B, Sk, Hkv,
    Dv), GQA by repeating the kv heads."""
    probs = s_dmask.abs() * ~torch.signbit(s_dmask) / (1 - p)
    vh = v.transpose(1, 2).repeat_interleave(s_dmask.size(1) // v.size(2), dim=1)
    return (probs @ vh).transpose(1, 2)


def _check_s_dmask_padding(s_dmask, rows, cols):
    """Zeros outside the top-left rows x cols."""
    assert not s_dmask[..., rows:, :].any() and not s_dmask[..., :, cols:].any()


FIXED_DROPOUT = {
    "func": lambda q, k, v, **kw: fa.flash_attn_func(q, k, v, **kw),
    "kvpacked": lambda q, k, v, **kw: fa.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), **kw),
    "qkvpacked": lambda q, k, v, **kw: fa.flash_attn_qkvpacked_func(
        torch.stack((q, k, v), 2), **kw
    ),
}


@pytest.mark.parametrize("fn", list(FIXED_DROPOUT))
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(3, 2))], ids=["c", "w"])
def test_dropout_and_s_dmask(device, fn, mask):
    """With dropout, S_dmask is FlashAttention's: padded to whole 128 tiles, the probabilities
    with the dropped ones negated; the output equals what that mask implies, and the gradients
    the reference's for the same keep-mask."""
    B, S, H, Hkv, D, p = 2, 13, 4, 2, 8, 0.3
    if fn == "qkvpacked":
        Hkv = H
    q = torch.randn(B, S, H, D, dtype=torch.float64, device=device)
    k, v = (torch.randn(B, S, Hkv, D, dtype=torch.float64, device=device) for _ in range(2))
    torch.manual_seed(7)
    out, lse, s = FIXED_DROPOUT[fn](q, k, v, dropout_p=p, return_attn_probs=True, **mask)
    assert s.dtype == q.dtype and s.shape == (B, H, _round128(S), _round128(S))
    _check_s_dmask_padding(s, S, S)
    s = s[..., :S, :S]
    assert torch.signbit(s).any() and (~torch.signbit(s)).any()
    torch.testing.assert_close(out, _from_s_dmask(s, v, p), rtol=1e-10, atol=1e-10)
    keep = ~torch.signbit(s)
    probs = flash_attn_weights_reference(q, k, **mask)
    torch.testing.assert_close(s.abs(), probs, rtol=1e-10, atol=1e-12)
    _, ref_lse = flash_attn_func_reference(q, k, v, return_lse=True, **mask)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-6, atol=1e-6)  # lse is fp32
    torch.manual_seed(7)  # the same seed gives the same mask
    again = FIXED_DROPOUT[fn](q, k, v, dropout_p=p, **mask)
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    torch.manual_seed(8)
    assert not torch.equal(out, FIXED_DROPOUT[fn](q, k, v, dropout_p=p, **mask))
    # backward: the same mask, regenerated
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    g = torch.randn_like(out)
    torch.manual_seed(7)
    got = torch.autograd.grad(FIXED_DROPOUT[fn](qg, kg, vg, dropout_p=p, **mask), (qg, kg, vg), g)
    want_out = _from_s_dmask_reference(qg, kg, vg, keep, p, **mask)
    want = torch.autograd.grad(want_out, (qg, kg, vg), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def flash_attn_weights_reference(q, k, causal=False, window_size=(-1, -1)):
    """(B, H, Sq, Sk) probabilities of the reference (GQA by repeated kv heads)."""
    B, Sq, H, _ = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    eye = torch.eye(Sk, dtype=q.dtype, device=q.device)
    # out of v = one-hot rows is the probability matrix itself
    v = eye.reshape(1, Sk, 1, Sk).expand(B, Sk, Hkv, Sk)
    return flash_attn_func_reference(q, k, v, causal=causal, window_size=window_size).transpose(
        1, 2
    )


def _from_s_dmask_reference(q, k, v, keep, p, **mask):
    probs = flash_attn_weights_reference(q, k, **mask) * keep / (1 - p)
    vh = v.transpose(1, 2).repeat_interleave(q.size(2) // v.size(2), dim=1)
    return (probs @ vh).transpose(1, 2)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_s_dmask_with_score_modifiers(device, varlen):
    """S_dmask with softcap and ALiBi (FlashAttention refuses softcap here): the probabilities
    of the modified scores, the dropped ones negated, implying the output."""
    B, S, H, Hkv, D, p = 2, 11, 4, 2, 8, 0.3
    q = 3 * torch.randn(B, S, H, D, dtype=torch.float64, device=device)  # softcap 2 bends them
    k, v = (torch.randn(B, S, Hkv, D, dtype=torch.float64, device=device) for _ in range(2))
    slopes = torch.rand(B, H, dtype=torch.float64, device=device)
    mods = dict(softcap=2.0, alibi_slopes=slopes, causal=True, dropout_p=p, return_attn_probs=True)
    if varlen:
        cu = _cu([S] * B, device)
        out, lse, s = fa.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, S, S, **mods
        )
        out = out.unflatten(0, (B, S))
    else:
        out, lse, s = fa.flash_attn_func(q, k, v, **mods)
    s = s[..., :S, :S]
    assert torch.signbit(s).any() and (~torch.signbit(s)).any()
    torch.testing.assert_close(out, _from_s_dmask(s, v, p), rtol=1e-10, atol=1e-10)
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    probs = attention_weights_reference(qh, kh, softcap=2.0, alibi_slopes=slopes, causal=True)
    torch.testing.assert_close(s.abs(), probs, rtol=1e-10, atol=1e-12)
    plain = attention_weights_reference(qh, kh, causal=True)
    assert (probs - plain).abs().max() > 0.1  # the modifiers changed the probabilities


def test_rows_without_keys_give_zeros_and_minus_inf_lse(device):
    """Sq > Sk with causal (bottom-right): the first Sq - Sk rows see no key; out 0 and lse
    -inf (FlashAttention's non-split kernels give +inf there; design.md pins -inf)."""
    q = torch.randn(1, 6, 2, 8, device=device)
    k, v = (torch.randn(1, 2, 2, 8, device=device) for _ in range(2))
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert not out[:, :4].any() and out[:, 4:].abs().sum() > 0
    assert torch.equal(lse[..., :4], torch.full_like(lse[..., :4], -torch.inf))
    k_cache = torch.randn(2, 8, 2, 8, device=device)
    lens = torch.tensor([0, 3], dtype=torch.int32, device=device)
    out, lse = fa.flash_attn_with_kvcache(
        q[:, :1].expand(2, 1, 2, 8), k_cache, k_cache, cache_seqlens=lens, return_softmax_lse=True
    )
    assert not out[0].any() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


# ---------------------------------------------------------------------------------- varlen forms
VARLEN_LENGTHS = [([4, 0, 31, 1, 9], [4, 2, 31, 1, 20]), ([1, 2, 3, 2, 1, 90], [1, 2, 3, 2, 1, 90])]


def _cu(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)


@pytest.mark.parametrize("lengths", VARLEN_LENGTHS, ids=["mixed", "short_and_long"])
@pytest.mark.parametrize("option", OPTIONS, ids=[o[0] for o in OPTIONS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attn_varlen_func(device, dtype, option, lengths):
    lq, lk = lengths
    H, Hkv, D = 4, 2, 32
    _, kw, alibi = option
    kw = dict(kw, alibi_slopes=_alibi(alibi, len(lq), H, device))
    q = torch.randn(sum(lq), H, D, device=device).to(dtype)
    k, v = (torch.randn(sum(lk), Hkv, D, device=device).to(dtype) for _ in range(2))
    cq, ck = _cu(lq, device), _cu(lk, device)
    out, lse, s = fa.flash_attn_varlen_func(
        q, k, v, cq, ck, max(lq), max(lk), return_attn_probs=True, **kw
    )
    assert s.shape == (0,) and s.dtype == dtype and lse.shape == (H, sum(lq))
    check(out, flash_attn_varlen_func_reference, q, k, v, cq, ck, **kw)
    assert torch.equal(out, fa.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), **kw))


def test_varlen_packed_forms_and_backward(device):
    lens = [5, 12, 1]
    cu = _cu(lens, device)
    qkv = torch.randn(sum(lens), 3, 4, 16, dtype=torch.float64, device=device, requires_grad=True)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 12, causal=True, softcap=2.0)
    q, k, v = qkv.unbind(1)
    ref = flash_attn_varlen_func_reference(q, k, v, cu, cu, causal=True, softcap=2.0)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, qkv, g)
    (want,) = torch.autograd.grad(ref, qkv, g)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    kv = torch.randn(sum(lens), 2, 2, 16, dtype=torch.float64, device=device)
    out = fa.flash_attn_varlen_kvpacked_func(q.detach(), kv, cu, cu, 12, 12, window_size=(2, 2))
    ref = flash_attn_varlen_func_reference(
        q.detach(), kv[:, 0], kv[:, 1], cu, cu, window_size=(2, 2)
    )
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_dropout_and_s_dmask(device, causal):
    """The varlen functions return S_dmask too: (B, H, round128(max_seqlen_q),
    round128(max_seqlen_k)), sequence b's probabilities in its top-left corner."""
    lq, lk, H, Hkv, D, p = [3, 0, 7], [5, 2, 7], 4, 2, 8, 0.25
    cq, ck = _cu(lq, device), _cu(lk, device)
    q = torch.randn(sum(lq), H, D, dtype=torch.float64, device=device)
    k, v = (torch.randn(sum(lk), Hkv, D, dtype=torch.float64, device=device) for _ in range(2))
    out, lse, s = fa.flash_attn_varlen_func(
        q, k, v, cq, ck, 9, 8, dropout_p=p, causal=causal, return_attn_probs=True
    )
    assert s.shape == (3, H, 128, 128) and s.dtype == q.dtype
    for b in range(3):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        sb = s[b : b + 1, :, : q1 - q0, : k1 - k0]
        _check_s_dmask_padding(s[b], int(q1 - q0), int(k1 - k0))
        want = _from_s_dmask(sb, v[k0:k1].unsqueeze(0), p)[0]
        torch.testing.assert_close(out[q0:q1], want, rtol=1e-10, atol=1e-10)
        probs = flash_attn_weights_reference(q[None, q0:q1], k[None, k0:k1], causal=causal)
        torch.testing.assert_close(sb.abs(), probs, rtol=1e-10, atol=1e-12)
    assert torch.signbit(s).any()
    ref_lse = flash_attn_varlen_func_reference(q, k, v, cq, ck, causal=causal, return_lse=True)[1]
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-6, atol=1e-6)  # lse is fp32
    # the packed forms take the same path
    qkv = torch.randn(sum(lk), 3, H, D, dtype=torch.float64, device=device)
    torch.manual_seed(3)
    out, _, s = fa.flash_attn_varlen_qkvpacked_func(qkv, ck, 7, dropout_p=p, return_attn_probs=True)
    assert s.shape == (3, H, 128, 128) and torch.signbit(s).any()
    torch.manual_seed(3)
    again = fa.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], ck, ck, 7, 7, dropout_p=p)
    torch.testing.assert_close(out, again, rtol=0, atol=0)


def _paged(dense, page, seed=0):
    """A (B, L, Hkv, D) cache as pages (num_blocks, page, Hkv, D) in shuffled order, one spare
    page, and the (B, L / page) int32 block_table that addresses them."""
    B, L = dense.shape[:2]
    per_seq = L // page
    order = torch.randperm(B * per_seq + 1, generator=torch.Generator().manual_seed(seed))
    table = order[: B * per_seq].view(B, per_seq)
    pages = torch.zeros(B * per_seq + 1, page, *dense.shape[2:], dtype=dense.dtype)
    pages = pages.to(dense.device)
    pages[table.flatten()] = dense.reshape(B * per_seq, page, *dense.shape[2:])
    return pages, table.to(torch.int32).to(dense.device)


def _unpaged(pages, table):
    return pages[table.long()].flatten(1, 2)


def test_varlen_block_table(device):
    """flash_attn_varlen_func with block_table: k / v are pages, cu_seqlens_k counts each
    sequence's keys in its pages; equals the packed keys, forward and backward."""
    lq, lk, H, Hkv, D, P = [3, 1, 6], [17, 0, 40], 4, 2, 16, 16
    cq, ck = _cu(lq, device), _cu(lk, device)
    q = torch.randn(sum(lq), H, D, dtype=torch.float64, device=device)
    dense = torch.randn(3, 48, Hkv, D, dtype=torch.float64, device=device)
    k_pages, table = _paged(dense, P)
    v_pages, _ = _paged(dense.flip(-1), P)
    packed = torch.cat([dense[b, :n] for b, n in enumerate(lk)])
    packed_v = torch.cat([dense.flip(-1)[b, :n] for b, n in enumerate(lk)])
    kw = dict(causal=True, softcap=3.0)
    qg, kg = q.clone().requires_grad_(), k_pages.clone().requires_grad_()
    out = fa.flash_attn_varlen_func(qg, kg, v_pages, cq, ck, 6, 40, block_table=table, **kw)
    ref = flash_attn_varlen_func_reference(q, packed, packed_v, cq, ck, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dq, dk = torch.autograd.grad(out.sum(), (qg, kg))
    qr, kr = q.clone().requires_grad_(), dense.clone().requires_grad_()
    packed_r = torch.cat([kr[b, :n] for b, n in enumerate(lk)])
    ref = flash_attn_varlen_func_reference(qr, packed_r, packed_v, cq, ck, **kw)
    dq_r, dk_r = torch.autograd.grad(ref.sum(), (qr, kr))
    torch.testing.assert_close(dq, dq_r, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(_unpaged(dk, table), dk_r, rtol=1e-9, atol=1e-9)


def test_varlen_block_table_inference_reads_pages_in_place(device, monkeypatch):
    """Without gradients the CPU operator reads the pages where they lie (no gathered copy: the
    gather is made to fail) and returns the packed keys' bits; on CUDA, and with gradients
    (test_varlen_block_table), the pages are gathered first."""
    lq, lk, H, Hkv, D, P = [5, 1, 9], [17, 0, 40], 4, 2, 16, 16
    cq, ck = _cu(lq, device), _cu(lk, device)
    q = torch.randn(sum(lq), H, D, device=device).bfloat16()
    dense = torch.randn(3, 48, Hkv, D, device=device).bfloat16()
    k_pages, table = _paged(dense, P)
    v_pages, _ = _paged(dense.flip(-1), P)
    packed = torch.cat([dense[b, :n] for b, n in enumerate(lk)])
    packed_v = torch.cat([dense.flip(-1)[b, :n] for b, n in enumerate(lk)])
    kw = dict(causal=True, window_size=(11, 0), return_attn_probs=True)
    want = fa.flash_attn_varlen_func(q, packed, packed_v, cq, ck, 9, 40, **kw)
    if device == "cpu":
        monkeypatch.setattr(fa, "_unpage_tokens", lambda *a: pytest.fail("pages were gathered"))
    got = fa.flash_attn_varlen_func(q, k_pages, v_pages, cq, ck, 9, 40, block_table=table, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------ flash_attn_with_kvcache
KVCACHE_CASES = {
    "append_causal": dict(causal=True),
    "no_append": dict(causal=True, append=False),
    "rotary_interleaved": dict(causal=True, rotary=True, rotary_interleaved=True),
    "rotary_halves_noncausal": dict(rotary=True, rotary_interleaved=False),
    "rotary_partial_window": dict(rotary=True, rotary_dim=16, window_size=(7, 0)),
    "batch_idx": dict(causal=True, cache_batch_idx=True),
    "batch_idx_rotary_no_append": dict(cache_batch_idx=True, append=False),
    "batch_idx_rotary_halves": dict(
        cache_batch_idx=True, rotary=True, rotary_interleaved=False, window_size=(4, 1)
    ),
    "leftpad": dict(causal=True, cache_leftpad=True, rotary=True),
    "window_both_sides": dict(window_size=(5, 3)),
    "softcap_alibi": dict(causal=True, softcap=2.0, alibi="batch"),
    "int_seqlens_splits": dict(causal=True, int_seqlens=True, num_splits=3),
    "whole_cache": dict(causal=True, append=False, no_seqlens=True),
    "int64_seqlens_mqa_leftpad": dict(int64_seqlens=True, cache_leftpad=True, hkv=1),
}


def _kvcache_args(case, dtype, device, sq):
    c = dict(KVCACHE_CASES[case])
    B, H, Hkv, D, L, s_new = 3, 4, c.pop("hkv", 2), 32, 64, sq
    rows = 5 if c.pop("cache_batch_idx", False) else B
    k_cache = torch.randn(rows, L, Hkv, D, device=device).to(dtype)
    v_cache = torch.randn(rows, L, Hkv, D, device=device).to(dtype)
    q = torch.randn(B, sq, H, D, device=device).to(dtype)
    args = dict(causal=c.pop("causal", False), window_size=c.pop("window_size", (-1, -1)))
    if c.pop("append", True):
        args["k"] = torch.randn(B, s_new, Hkv, D, device=device).to(dtype)
        args["v"] = torch.randn(B, s_new, Hkv, D, device=device).to(dtype)
    if c.pop("rotary", False):
        rd = c.pop("rotary_dim", D)
        angles = torch.rand(L, rd // 2, dtype=torch.float64) * 6.28
        args["rotary_cos"] = angles.cos().float().to(device)
        args["rotary_sin"] = angles.sin().float().to(device)
        args["rotary_interleaved"] = c.pop("rotary_interleaved", True)
    if c.pop("int_seqlens", False):
        args["cache_seqlens"] = 20
    elif c.pop("int64_seqlens", False):
        args["cache_seqlens"] = torch.tensor([30, 5, 0], device=device)
    elif not c.pop("no_seqlens", False):
        args["cache_seqlens"] = torch.tensor([30, 5, 0], dtype=torch.int32, device=device)
    if rows != B:
        args["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    if c.pop("cache_leftpad", False):
        args["cache_leftpad"] = torch.tensor([3, 5, 0], dtype=torch.int32, device=device)
    if c.pop("alibi", None):
        args["alibi_slopes"] = torch.rand(B, H, device=device)
    args.update(c)
    return q, k_cache, v_cache, args


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(KVCACHE_CASES))
def test_flash_attn_with_kvcache(dtype, case, sq):
    """CPU: on CUDA, cache_batch_idx / cache_leftpad / softcap / alibi / right windows in
    decoding are not supported yet."""
    q, k_cache, v_cache, args = _kvcache_args(case, dtype, "cpu", sq)
    num_splits = args.pop("num_splits", 0)
    ref_args = dict(args)
    ref_out, ref_lse, ref_k, ref_v = flash_attn_with_kvcache_reference(q, k_cache, v_cache, **args)
    tru_out, tru_lse, tru_k, _ = ground_truth(
        flash_attn_with_kvcache_reference, q, k_cache, v_cache, **ref_args
    )
    seqlens_before = args.get("cache_seqlens")
    seqlens_before = seqlens_before.clone() if torch.is_tensor(seqlens_before) else seqlens_before
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, num_splits=num_splits, return_softmax_lse=True, **args
    )
    assert out.shape == q.shape and out.is_contiguous()
    assert_error_rule(out, ref_out, tru_out, name="out")
    assert_lse_close(lse, ref_lse, tru_lse)
    # the caches were updated in place as the reference updates them (the new keys rotated in
    # fp32 then rounded: the rule against the float64 truth), cache_seqlens left alone
    assert_error_rule(k_cache, ref_k, tru_k, name="k_cache")
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0)
    if torch.is_tensor(seqlens_before):
        assert torch.equal(args["cache_seqlens"], seqlens_before)


def test_with_kvcache_on_a_decode_loop_equals_full_attention():
    """Prefill then token-by-token decoding through the cache equals causal attention over the
    whole sequence (the use FlashAttention documents for this function)."""
    B, S, H, Hkv, D, L = 2, 12, 4, 2, 16, 32
    q, k, v = (torch.randn(B, S, h, D, dtype=torch.float64) for h in (H, Hkv, Hkv))
    k_cache = torch.zeros(B, L, Hkv, D, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    lens = torch.zeros(B, dtype=torch.int32)
    outs = [fa.flash_attn_with_kvcache(q[:, :5], k_cache, v_cache, k[:, :5], v[:, :5],
                                       cache_seqlens=lens, causal=True)]  # fmt: skip
    lens += 5
    for t in range(5, S):
        step = slice(t, t + 1)
        o = fa.flash_attn_with_kvcache(q[:, step], k_cache, v_cache, k[:, step], v[:, step],
                                       cache_seqlens=lens, causal=True)  # fmt: skip
        outs.append(o)
        lens += 1
    full = flash_attn_func_reference(q, k, v, causal=True)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize(
    "case", ["append_causal", "no_append", "rotary_interleaved", "softcap_alibi", "whole_cache"]
)
def test_with_kvcache_block_table(case, page):
    """A paged cache (pages shuffled, one spare) gives what the dense cache gives: out, lse and
    the appended rows, written into the right pages."""
    q, k_cache, v_cache, args = _kvcache_args(case, torch.float32, "cpu", 3)
    args.pop("num_splits", None)
    ref_out, ref_lse, ref_k, ref_v = flash_attn_with_kvcache_reference(q, k_cache, v_cache, **args)
    k_pages, table = _paged(k_cache, page, seed=1)
    v_pages, _ = _paged(v_cache, page, seed=1)
    out, lse = fa.flash_attn_with_kvcache(
        q, k_pages, v_pages, block_table=table, return_softmax_lse=True, **args
    )
    torch.testing.assert_close(out, ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(_unpaged(k_pages, table), ref_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_unpaged(v_pages, table), ref_v, rtol=0, atol=0)
    spare = sorted(set(range(k_pages.size(0))) - set(table.flatten().tolist()))
    assert not k_pages[spare].any()  # the spare page was not written


def test_cache_seqlens_and_caller_tensors_are_left_alone():
    """cache_seqlens are the lengths before the append, on entry and on return (FlashAttention
    does not advance them), for the kv_cache_append path and the indexed ones."""
    q, k_cache, v_cache, args = _kvcache_args("append_causal", torch.float32, "cpu", 2)
    lens = args["cache_seqlens"]
    before = lens.clone()
    k, v = args["k"].clone(), args["v"].clone()
    fa.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    assert torch.equal(lens, before) and torch.equal(args["k"], k) and torch.equal(args["v"], v)
    # a second call with the same lengths overwrites the same rows: same result
    once = k_cache.clone()
    fa.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    assert torch.equal(k_cache, once)


# ------------------------------------------------------------------------- signatures and checks
# FlashAttention 2.6.1 - 2.8.x's flash_attn_interface (the signatures did not change in that
# range; 2.6.0 lacked cache_leftpad): every parameter's name, order and default.
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": "(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False)",
    "flash_attn_qkvpacked_func": "(qkv, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False)",
    "flash_attn_kvpacked_func": "(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False)",
    "flash_attn_varlen_func": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
    "max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
    "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, "
    "block_table=None)",
    "flash_attn_varlen_qkvpacked_func": "(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, "
    "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
    "deterministic=False, return_attn_probs=False)",
    "flash_attn_varlen_kvpacked_func": "(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
    "max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
    "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)",
    "flash_attn_with_kvcache": "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, "
    "rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, "
    "block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)",
}


# Keyword-only additions after FlashAttention 2's parameters (every FlashAttention 2 call binds
# as before): FlashAttention 3's names for a float8 cache's scales.
KEYWORD_EXTENSIONS = {"flash_attn_with_kvcache": ("k_descale", "v_descale")}


@pytest.mark.parametrize("name", list(FLASH_ATTN_SIGNATURES))
def test_signature_equals_flash_attn(name):
    import inspect

    sig = inspect.signature(getattr(fa, name))
    params = list(sig.parameters.values())
    fa2 = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    plain = sig.replace(
        parameters=[p.replace(annotation=p.empty) for p in fa2], return_annotation=sig.empty
    )
    assert str(plain) == FLASH_ATTN_SIGNATURES[name]
    extra = params[len(fa2) :]
    assert all(p.kind == p.KEYWORD_ONLY and p.default is None for p in extra)
    assert tuple(p.name for p in extra) == KEYWORD_EXTENSIONS.get(name, ())


def test_module_exports_flash_attn_names():
    assert sorted(fa.__all__) == sorted(FLASH_ATTN_SIGNATURES)


def _x(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


_CU = torch.tensor([0, 2], dtype=torch.int32)
_LENS = torch.tensor([1], dtype=torch.int32)
_COS = _x(16, 4)
_PAGES = _x(3, 16, 1, 8)
_TABLE = torch.zeros(1, 2, dtype=torch.int32)
# (id, call, message): FlashAttention's argument checks, each a RuntimeError naming what is
# wrong (expected and got)
ARGUMENT_ERRORS = [
    (
        "q_rank",
        lambda: fa.flash_attn_func(_x(2, 8), _x(1, 2, 1, 8), _x(1, 2, 1, 8)),
        "q must be 4-D",
    ),
    (
        "k_dtype",
        lambda: fa.flash_attn_func(
            _x(1, 2, 1, 8), _x(1, 2, 1, 8, dtype=torch.float64), _x(1, 2, 1, 8)
        ),
        "k must have q's dtype",
    ),
    (
        "v_dtype",
        lambda: fa.flash_attn_func(
            _x(1, 2, 1, 8), _x(1, 2, 1, 8), _x(1, 2, 1, 8, dtype=torch.bfloat16)
        ),
        "v must have q's dtype",
    ),
    (
        "batch",
        lambda: fa.flash_attn_func(_x(1, 2, 1, 8), _x(2, 2, 1, 8), _x(2, 2, 1, 8)),
        "k batch size .* must be 1, got 2",
    ),
    (
        "kv_length",
        lambda: fa.flash_attn_func(_x(1, 2, 1, 8), _x(1, 3, 1, 8), _x(1, 2, 1, 8)),
        "v length .* must be 3, got 2",
    ),
    (
        "head_dim",
        lambda: fa.flash_attn_func(_x(1, 2, 1, 8), _x(1, 2, 1, 4), _x(1, 2, 1, 8)),
        "k head dim .* must be 8, got 4",
    ),
    (
        "gqa",
        lambda: fa.flash_attn_func(_x(1, 2, 3, 8), _x(1, 2, 2, 8), _x(1, 2, 2, 8)),
        r"k/v heads \(2\) must divide q's heads \(3\)",
    ),
    (
        "dropout",
        lambda: fa.flash_attn_func(_x(1, 2, 1, 8), _x(1, 2, 1, 8), _x(1, 2, 1, 8), dropout_p=1.0),
        r"dropout_p must be in \[0, 1\), got 1.0",
    ),
    (
        "window",
        lambda: fa.flash_attn_func(
            _x(1, 2, 1, 8), _x(1, 2, 1, 8), _x(1, 2, 1, 8), window_size=(1,)
        ),
        "window_size must be",
    ),
    (
        "qkv_packing",
        lambda: fa.flash_attn_qkvpacked_func(_x(1, 2, 2, 1, 8)),
        "qkv q/k/v .* must be 3, got 2",
    ),
    (
        "kv_packing",
        lambda: fa.flash_attn_kvpacked_func(_x(1, 2, 1, 8), _x(1, 2, 3, 1, 8)),
        "kv k/v .* must be 2, got 3",
    ),
    (
        "varlen_rank",
        lambda: fa.flash_attn_varlen_func(_x(2, 1, 8), _x(1, 2, 1, 8), _x(2, 1, 8), _CU, _CU, 2, 2),
        "k must be 3-D",
    ),
    (
        "varlen_cu",
        lambda: fa.flash_attn_varlen_func(
            _x(2, 1, 8),
            _x(2, 1, 8),
            _x(2, 1, 8),
            _CU,
            torch.tensor([0, 1, 2], dtype=torch.int32),
            2,
            2,
        ),
        r"cu_seqlens_k must be 1-D \(B \+ 1,\) = \(2,\), got shape \(3,\)",
    ),
    (
        "varlen_packing",
        lambda: fa.flash_attn_varlen_kvpacked_func(_x(2, 1, 8), _x(2, 3, 1, 8), _CU, _CU, 2, 2),
        "kv k/v .* must be 2, got 3",
    ),
    (
        "kvcache_dtype",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8), _x(1, 4, 1, 8, dtype=torch.float64), _x(1, 4, 1, 8)
        ),
        "k_cache must have q's dtype",
    ),
    (
        "kvcache_heads",
        lambda: fa.flash_attn_with_kvcache(_x(1, 1, 3, 8), _x(1, 4, 2, 8), _x(1, 4, 2, 8)),
        "must divide q's heads",
    ),
    (
        "kvcache_v_shape",
        lambda: fa.flash_attn_with_kvcache(_x(1, 1, 1, 8), _x(1, 4, 1, 8), _x(1, 5, 1, 8)),
        "v_cache length .* must be 4, got 5",
    ),
    (
        "k_without_v",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8), _x(1, 4, 1, 8), _x(1, 4, 1, 8), k=_x(1, 1, 1, 8), cache_seqlens=_LENS
        ),
        "k was given without v",
    ),
    (
        "v_without_k",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8), _x(1, 4, 1, 8), _x(1, 4, 1, 8), v=_x(1, 1, 1, 8), cache_seqlens=_LENS
        ),
        "v was given without k",
    ),
    (
        "k_without_seqlens",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8), _x(1, 4, 1, 8), _x(1, 4, 1, 8), _x(1, 1, 1, 8), _x(1, 1, 1, 8)
        ),
        "needs cache_seqlens",
    ),
    (
        "new_k_heads",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 2, 8),
            _x(1, 4, 1, 8),
            _x(1, 4, 1, 8),
            _x(1, 1, 2, 8),
            _x(1, 1, 1, 8),
            cache_seqlens=_LENS,
        ),
        "k heads .* must be 1, got 2",
    ),
    (
        "rotary_without_k",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8),
            _x(1, 16, 1, 8),
            _x(1, 16, 1, 8),
            rotary_cos=_COS,
            rotary_sin=_COS,
            cache_seqlens=_LENS,
        ),
        "need the new k / v",
    ),
    (
        "rotary_cos_only",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8),
            _x(1, 16, 1, 8),
            _x(1, 16, 1, 8),
            _x(1, 1, 1, 8),
            _x(1, 1, 1, 8),
            rotary_cos=_COS,
            cache_seqlens=_LENS,
        ),
        "got only one of them",
    ),
    (
        "rotary_dim",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8),
            _x(1, 16, 1, 8),
            _x(1, 16, 1, 8),
            _x(1, 1, 1, 8),
            _x(1, 1, 1, 8),
            _x(16, 8),
            _x(16, 8),
            cache_seqlens=_LENS,
        ),
        r"rotary_dim \(16\) must be <= head dim 8",
    ),
    (
        "rotary_short",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8),
            _x(1, 32, 1, 8),
            _x(1, 32, 1, 8),
            _x(1, 1, 1, 8),
            _x(1, 1, 1, 8),
            _COS,
            _COS,
            cache_seqlens=_LENS,
        ),
        "must cover the cache's 32 positions, got 16",
    ),
    (
        "table_dtype",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8), _PAGES, _PAGES, cache_seqlens=_LENS, block_table=_TABLE.long()
        ),
        "block_table must have dtype torch.int32, got torch.int64",
    ),
    (
        "table_shape",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8), _PAGES, _PAGES, cache_seqlens=_LENS, block_table=_TABLE.view(2, 1)
        ),
        r"block_table must be 2-D \(B, max_blocks\) with B = 1",
    ),
    (
        "table_batch_idx",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8),
            _PAGES,
            _PAGES,
            cache_seqlens=_LENS,
            block_table=_TABLE,
            cache_batch_idx=_LENS,
        ),
        "takes no cache_batch_idx",
    ),
    (
        "table_leftpad",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8),
            _PAGES,
            _PAGES,
            cache_seqlens=_LENS,
            block_table=_TABLE,
            cache_leftpad=_LENS,
        ),
        "takes no cache_leftpad",
    ),
    (
        "page_size",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8), _x(3, 8, 1, 8), _x(3, 8, 1, 8), cache_seqlens=_LENS, block_table=_TABLE
        ),
        "page size .* must be >= 16, got 8",
    ),
    (
        "table_capacity",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8),
            _PAGES,
            _PAGES,
            cache_seqlens=30,
            block_table=_TABLE,
            k=_x(1, 3, 1, 8),
            v=_x(1, 3, 1, 8),
        ),
        r"longest sequence \(33 keys\) exceeds .* = 32\)",
    ),
    (
        "table_index",
        lambda: fa.flash_attn_with_kvcache(
            _x(1, 1, 1, 8),
            _PAGES,
            _PAGES,
            cache_seqlens=20,
            block_table=torch.tensor([[0, 3]], dtype=torch.int32),
        ),
        r"block_table\[0, 1\] must be in \[0, 3\), got 3",
    ),
    (
        "varlen_table",
        lambda: fa.flash_attn_varlen_func(
            _x(2, 1, 8), _PAGES, _PAGES, _CU, _CU, 2, 2, block_table=_TABLE.long()
        ),
        "block_table must have dtype torch.int32",
    ),
]


@pytest.mark.parametrize(
    "call,message", [a[1:] for a in ARGUMENT_ERRORS], ids=[a[0] for a in ARGUMENT_ERRORS]
)
def test_argument_errors(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_unused_block_table_entries_are_not_read():
    """Blocks past a sequence's length may hold anything (FlashAttention never reads them)."""
    q = torch.randn(1, 1, 1, 8)
    pages = torch.randn(3, 16, 1, 8)
    table = torch.tensor([[2, -7]], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=16, block_table=table)
    ref = fa.flash_attn_with_kvcache(q, pages[2:], pages[2:], cache_seqlens=16)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


# ----------------------------------------------------------------------- swap and torch.compile
FLASH_ATTN_USER_CODE = """
from flash_attn import flash_attn_func, flash_attn_varlen_func

def layer(q, k, v, cu, max_len):
    a = flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=30.0)
    b = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                               max_len, max_len, causal=True, window_size=(8, 0), softcap=30.0)
    return a, b.view_as(a)
"""


def test_import_swap_runs_flash_attn_code_unchanged(monkeypatch):
    """Code written against flash_attn runs with attn_ext.flash_attn in its place."""
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    namespace = {}
    exec(compile(FLASH_ATTN_USER_CODE, "user_code", "exec"), namespace)
    q, k, v = (torch.randn(2, 16, 4, 32) for _ in range(3))
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    a, b = namespace["layer"](q, k, v, cu, 16)
    torch.testing.assert_close(a, b)


def test_compile_flash_attn_functions(device):
    import torch._dynamo

    torch._dynamo.reset()

    def fn(q, k, v, cu, m):
        a = fa.flash_attn_func(q, k, v, causal=True, softcap=5.0)
        b = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                      m, m, causal=True, softcap=5.0)  # fmt: skip
        return (a.flatten(0, 1) - b).abs().max()

    cfn = torch.compile(fn, fullgraph=True, dynamic=True)
    for S in (37, 52):
        q, k, v = (torch.randn(2, S, 4, 16, device=device) for _ in range(3))
        cu = torch.tensor([0, S, 2 * S], dtype=torch.int32, device=device)
        assert cfn(q, k, v, cu, S).item() < 1e-5
    torch._dynamo.reset()
