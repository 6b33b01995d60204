"""Dropout on the attention probabilities (after the softmax, kept entries
scaled by 1 / (1 - p)).

attn_ext.dropout_keep_mask(B, H, Sq, Sk, p, generator) draws the RNG state
exactly as attn_ext.attention does, so the same generator state gives the
mask that attention applies; the tests pass that mask to the reference
(documents 001 and 003 apply dropout to the attention weights) and expect the
same numbers, forward and backward.
"""

import math

import pytest
import torch

import attn_ext
from attn_ext.testing.attention import (
    attention_reference,
    doc001_causal_attention,
    doc003_masked_stable_attention,
)
from attn_ext.testing.numerics import (
    assert_error_rule,
    autograd_grads,
    grad_slack_ulps,
    ground_truth,
    ground_truth_grads,
    make_qkv,
    rand,
    random_bool_mask,
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def keep_mask(B, H, Sq, Sk, p, seed, device):
    return attn_ext.dropout_keep_mask(B, H, Sq, Sk, p, generator=gen(seed)).to(device)


# --------------------------------------------------------------------------- #
# The mask itself
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_keep_rate(p):
    B, H, Sq, Sk = 4, 4, 64, 128
    m = attn_ext.dropout_keep_mask(B, H, Sq, Sk, p, generator=gen(1))
    assert m.dtype == torch.bool and m.shape == (B, H, Sq, Sk)
    n = m.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(m.float().mean().item() - (1 - p)) < 5 * sigma
    # every (batch, head) plane has about the right rate too
    plane = Sq * Sk
    rates = m.float().mean(dim=(2, 3))
    assert ((rates - (1 - p)).abs() < 6 * math.sqrt(p * (1 - p) / plane)).all()
    # and the rate does not drift along the keys or the queries
    col = m.float().mean(dim=(0, 1, 2))
    assert ((col - (1 - p)).abs() < 6 * math.sqrt(p * (1 - p) / (B * H * Sq))).all()


def test_mask_has_no_visible_structure():
    """Different heads, batches and rows get different masks, and neighbouring
    entries are uncorrelated (lag-1 correlation within a few sigma of 0)."""
    B, H, Sq, Sk, p = 2, 4, 64, 96, 0.3
    m = attn_ext.dropout_keep_mask(B, H, Sq, Sk, p, generator=gen(2))
    assert not torch.equal(m[:, 0], m[:, 1])
    assert not torch.equal(m[0], m[1])
    assert not torch.equal(m[:, :, 0], m[:, :, 1])
    x = m.float() - m.float().mean()
    var = (x * x).mean()
    for dim in (-1, -2, 1):
        a = x.narrow(dim, 0, x.shape[dim] - 1)
        b = x.narrow(dim, 1, x.shape[dim] - 1)
        corr = (a * b).mean() / var
        assert abs(corr.item()) < 5 / math.sqrt(a.numel()), (dim, corr.item())


def test_seed_reproducibility():
    a = attn_ext.dropout_keep_mask(2, 3, 17, 33, 0.25, generator=gen(7))
    b = attn_ext.dropout_keep_mask(2, 3, 17, 33, 0.25, generator=gen(7))
    c = attn_ext.dropout_keep_mask(2, 3, 17, 33, 0.25, generator=gen(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    g = gen(7)
    first = attn_ext.dropout_keep_mask(2, 3, 17, 33, 0.25, generator=g)
    second = attn_ext.dropout_keep_mask(2, 3, 17, 33, 0.25, generator=g)
    assert torch.equal(first, a)
    assert not torch.equal(first, second)  # the generator advanced


def test_default_generator():
    torch.manual_seed(11)
    a = attn_ext.dropout_keep_mask(1, 2, 9, 9, 0.5)
    torch.manual_seed(11)
    b = attn_ext.dropout_keep_mask(1, 2, 9, 9, 0.5)
    assert torch.equal(a, b)


def test_p_zero_keeps_everything():
    m = attn_ext.dropout_keep_mask(2, 2, 8, 8, 0.0, generator=gen(0))
    assert m.all()


def test_attention_applies_the_returned_mask(device):
    """The keep mask attention applies on `device` is the one dropout_keep_mask
    returns (read back through v = identity)."""
    B, H, S, p = 1, 2, 16, 0.4
    q = rand((B, H, S, 8), torch.float64, device)
    k = rand((B, H, S, 8), torch.float64, device)
    eye = torch.eye(S, dtype=torch.float64, device=device).expand(B, H, S, S)
    out = attn_ext.attention(q, k, eye, dropout_p=p, generator=gen(5))
    assert torch.equal(out != 0, keep_mask(B, H, S, S, p, 5, device))


# --------------------------------------------------------------------------- #
# attention with dropout
# --------------------------------------------------------------------------- #
DTYPES = [
    pytest.param(torch.float64, id="float64"),
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.bfloat16, id="bfloat16"),
    pytest.param(torch.float16, id="float16"),
]

CASES = {
    "plain": dict(shape=(2, 2, 2, 17, 17, 32)),
    "causal_cross": dict(shape=(1, 3, 3, 9, 21, 16), causal=True),
    "causal_sq_gt_sk": dict(shape=(1, 2, 2, 21, 9, 16), causal=True),
    "gqa": dict(shape=(2, 4, 2, 13, 13, 32), causal=True),
    "mask_window": dict(shape=(1, 2, 2, 33, 33, 16), window_size=(6, 2), mask=True),
    "long": dict(shape=(1, 1, 1, 70, 200, 64)),
}


def _setup(case, dtype, device):
    c = dict(CASES[case])
    B, H, Hkv, Sq, Sk, D = c.pop("shape")
    q, k, v = make_qkv(B, H, Hkv, Sq, Sk, D, dtype=dtype, device=device)
    if c.pop("mask", False):
        c["attn_mask"] = random_bool_mask((B, 1, Sq, Sk), device)
    return q, k, v, c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("p", [0.2, 0.6])
def test_dropout_forward_matches_reference(device, dtype, case, p):
    q, k, v, kw = _setup(case, dtype, device)
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    keep = keep_mask(B, H, Sq, Sk, p, 42, device)
    out, lse = attn_ext.attention(q, k, v, dropout_p=p, generator=gen(42), return_lse=True, **kw)
    ref = attention_reference(q, k, v, dropout_p=p, dropout_keep=keep, **kw)
    tru = ground_truth(attention_reference, q, k, v, dropout_p=p, dropout_keep=keep, **kw)
    assert_error_rule(out, ref, tru)
    # the lse describes the softmax, which dropout does not change
    _, lse0 = attn_ext.attention(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(lse, lse0, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_dropout_backward_matches_reference(device, dtype, case):
    """The backward regenerates the forward's mask: gradients equal the
    reference's with the identical mask."""
    p = 0.3
    q, k, v, kw = _setup(case, dtype, device)
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    keep = keep_mask(B, H, Sq, Sk, p, 9, device)
    g = torch.randn(B, H, Sq, v.shape[-1], device=device).to(dtype)
    got = autograd_grads(
        lambda a, b, c: attn_ext.attention(a, b, c, dropout_p=p, generator=gen(9), **kw),
        [q, k, v],
        g,
    )
    ref = autograd_grads(
        lambda a, b, c: attention_reference(a, b, c, dropout_p=p, dropout_keep=keep, **kw),
        [q, k, v],
        g,
    )
    tru = ground_truth_grads(
        attention_reference, [q, k, v], g, dropout_p=p, dropout_keep=keep, **kw
    )
    for name, a, r, t in zip(("dq", "dk", "dv"), got, ref, tru):
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(a.dtype))


def test_backward_does_not_reread_the_generator(device):
    """The mask is regenerated from the seed saved by the forward: reseeding
    or advancing the generator between forward and backward changes nothing."""
    p = 0.5
    q, k, v = make_qkv(1, 2, 2, 12, 12, 16, dtype=torch.float64, device=device)
    keep = keep_mask(1, 2, 12, 12, p, 3, device)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    g = gen(3)
    out = attn_ext.attention(*leaves, dropout_p=p, generator=g, causal=True)
    g.manual_seed(1234)
    torch.manual_seed(4321)
    attn_ext.dropout_keep_mask(4, 4, 32, 32, 0.5, generator=g)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad_out)
    ref = autograd_grads(
        lambda a, b, c: attention_reference(a, b, c, dropout_p=p, dropout_keep=keep, causal=True),
        [q, k, v],
        grad_out,
    )
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_dropout_3d(device):
    p = 0.35
    q = rand((3, 10, 16), torch.float64, device)
    k = rand((3, 12, 16), torch.float64, device)
    v = rand((3, 12, 8), torch.float64, device)
    keep = keep_mask(3, 1, 10, 12, p, 21, device)  # one head
    out = attn_ext.attention(q, k, v, dropout_p=p, generator=gen(21), causal=True)
    ref = attention_reference(q, k, v, dropout_p=p, dropout_keep=keep, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_scaling(device, p):
    """With v = identity the output *is* the dropped probability matrix:
    kept entries are weights / (1 - p), dropped entries are 0."""
    B, H, S = 2, 2, 24
    q = rand((B, H, S, 16), torch.float64, device)
    k = rand((B, H, S, 16), torch.float64, device)
    eye = torch.eye(S, dtype=torch.float64, device=device).expand(B, H, S, S)
    out = attn_ext.attention(q, k, eye, dropout_p=p, generator=gen(13), causal=True)
    w = attn_ext.attention_weights(q, k, causal=True)
    keep = keep_mask(B, H, S, S, p, 13, device)
    torch.testing.assert_close(out, torch.where(keep, w / (1 - p), 0.0), rtol=1e-12, atol=1e-14)
    # expectation: averaged over many seeds the dropped matrix approaches w
    acc = torch.zeros_like(w)
    n = 200
    for s in range(n):
        acc += attn_ext.attention(q, k, eye, dropout_p=p, generator=gen(1000 + s), causal=True)
    sd = (w * w * p / (1 - p) / n).sqrt()  # std of the mean of n draws
    assert ((acc / n - w).abs() <= 6 * sd + 1e-12).all()


def test_dropout_zero_is_no_dropout(device):
    q, k, v = make_qkv(2, 2, 2, 15, 18, 32, device=device)
    a = attn_ext.attention(q, k, v, causal=True)
    b = attn_ext.attention(q, k, v, causal=True, dropout_p=0.0, generator=gen(1))
    assert torch.equal(a, b)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    attn_ext.attention(qq, kk, vv, causal=True, dropout_p=0.0).sum().backward()
    q2, k2, v2 = (x.clone().requires_grad_(True) for x in (q, k, v))
    attn_ext.attention(q2, k2, v2, causal=True).sum().backward()
    for a_, b_ in ((qq, q2), (kk, k2), (vv, v2)):
        assert torch.equal(a_.grad, b_.grad)


def test_dropout_changes_output(device):
    q, k, v = make_qkv(1, 2, 2, 15, 18, 32, device=device)
    a = attn_ext.attention(q, k, v)
    b = attn_ext.attention(q, k, v, dropout_p=0.5, generator=gen(1))
    c = attn_ext.attention(q, k, v, dropout_p=0.5, generator=gen(2))
    assert not torch.equal(a, b) and not torch.equal(b, c)


def test_default_generator_for_attention(device):
    q, k, v = make_qkv(1, 2, 2, 10, 10, 16, dtype=torch.float64, device=device)
    torch.manual_seed(77)
    a = attn_ext.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(77)
    keep = attn_ext.dropout_keep_mask(1, 2, 10, 10, 0.3).to(device)
    ref = attention_reference(q, k, v, dropout_p=0.3, dropout_keep=keep)
    torch.testing.assert_close(a, ref, rtol=1e-10, atol=1e-10)


def test_dropout_gradcheck(device):
    f64 = dict(dtype=torch.float64, device=device, requires_grad=True)
    q, k, v = rand((1, 4, 6, 4), **f64), rand((1, 2, 7, 4), **f64), rand((1, 2, 7, 5), **f64)

    def fn(q, k, v):  # a fresh generator per call: the same mask every evaluation
        return attn_ext.attention(q, k, v, dropout_p=0.4, generator=gen(17), causal=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_dropout_p_one_is_all_dropped_or_refused(device):
    """p = 1 either raises or drops everything (never NaN / inf from 1/(1-p))."""
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8, device=device)
    try:
        out = attn_ext.attention(q, k, v, dropout_p=1.0, generator=gen(0))
    except (RuntimeError, ValueError) as e:
        assert "dropout" in str(e)
        return
    assert (out == 0).all()


# --------------------------------------------------------------------------- #
# The documents' dropout
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_doc001_causal_attention_with_dropout(device, dtype):
    """001 CausalAttention: triu(-inf) mask, softmax(scores / sqrt(d_k)), dropout
    on the weights (here with the mask attn_ext draws), weights @ values."""
    p = 0.1
    b, n, d = 2, 6, 16
    x = [rand((b, n, d), dtype, device) for _ in range(3)]
    keep = keep_mask(b, 1, n, n, p, 123, device).squeeze(1)
    out = attn_ext.attention(*x, causal=True, dropout_p=p, generator=gen(123))
    ref = doc001_causal_attention(*x, dropout_keep=keep, dropout_p=p)
    tru = ground_truth(doc001_causal_attention, *x, dropout_keep=keep, dropout_p=p)
    assert_error_rule(out, ref, tru)
    # 001's multi-head version: (b, heads, n, head_dim)
    q, k, v = make_qkv(2, 8, 8, n, n, 8, dtype=dtype, device=device)
    keep = keep_mask(2, 8, n, n, p, 5, device)
    out = attn_ext.attention(q, k, v, causal=True, dropout_p=p, generator=gen(5))
    ref = doc001_causal_attention(q, k, v, dropout_keep=keep, dropout_p=p)
    tru = ground_truth(doc001_causal_attention, q, k, v, dropout_keep=keep, dropout_p=p)
    assert_error_rule(out, ref, tru)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_doc003_masked_attention_with_dropout(device, dtype):
    p = 0.25
    q, k, v = make_qkv(2, 2, 2, 14, 14, 32, dtype=dtype, device=device)
    mask = random_bool_mask((2, 1, 14, 14), device)
    keep = keep_mask(2, 2, 14, 14, p, 31, device)
    out = attn_ext.attention(q, k, v, attn_mask=mask, dropout_p=p, generator=gen(31))
    ref = doc003_masked_stable_attention(q, k, v, mask, dropout_keep=keep, dropout_p=p)
    tru = ground_truth(
        doc003_masked_stable_attention, q, k, v, mask, dropout_keep=keep, dropout_p=p
    )
    assert_error_rule(out, ref, tru)
