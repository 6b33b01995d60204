"""attn_ext.attention_weights: the probability matrix softmax(scale q k^T + mask)."""

import pytest
import torch

import attn_ext
from attn_ext.testing.attention import (
    attention_weights_reference,
    expand_kv_heads,
    logit_rounding_floor,
    window_keep,
)
from attn_ext.testing.numerics import (
    ALL_DTYPES,
    assert_error_rule,
    autograd_grads,
    grad_slack_ulps,
    ground_truth,
    ground_truth_grads,
    make_qkv,
    rand,
    random_bool_mask,
    random_float_mask,
)

DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in ALL_DTYPES]

CASES = {
    "plain": dict(shape=(2, 3, 3, 17, 23, 32)),
    "causal": dict(shape=(2, 2, 2, 19, 19, 32), causal=True),
    "causal_sq_gt_sk": dict(shape=(1, 2, 2, 21, 9, 16), causal=True),
    "window": dict(shape=(1, 2, 2, 33, 40, 16), window_size=(5, 3)),
    "bool_mask": dict(shape=(2, 2, 2, 15, 19, 32), mask="bool"),
    "float_mask": dict(shape=(2, 2, 2, 15, 19, 32), mask="float"),
    "gqa": dict(shape=(2, 4, 2, 17, 20, 64), causal=True),
    "mqa_scale": dict(shape=(1, 4, 1, 17, 20, 80), scale=0.3),
    "bshd": dict(shape=(2, 4, 2, 17, 17, 32), layout="bshd"),
    "long": dict(shape=(1, 1, 1, 65, 257, 128)),
}


def _setup(case, dtype, device):
    c = dict(CASES[case])
    B, H, Hkv, Sq, Sk, D = c.pop("shape")
    q, k, _ = make_qkv(
        B, H, Hkv, Sq, Sk, D, dtype=dtype, device=device, layout=c.pop("layout", "contiguous")
    )
    mask = c.pop("mask", None)
    if mask == "bool":
        m = random_bool_mask((B, H, Sq, Sk), device)
        m[0, 0, 3] = False  # one fully masked row
        c["attn_mask"] = m
    elif mask == "float":
        c["attn_mask"] = random_float_mask((B, 1, Sq, Sk), dtype, device)
    return q, k, c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_weights_forward(device, dtype, case):
    q, k, kw = _setup(case, dtype, device)
    w = attn_ext.attention_weights(q, k, **kw)
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    assert w.shape == (B, H, Sq, Sk) and w.dtype == dtype and w.device == q.device
    ref = attention_weights_reference(q, k, **kw)
    tru = ground_truth(attention_weights_reference, q, k, **kw)
    assert_error_rule(w, ref, tru, name="weights")
    # probabilities: non-negative, rows sum to 1, or are all zero when the row sees no key
    assert (w >= 0).all()
    empty = tru.sum(-1) == 0
    sums = w.double().sum(-1)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2 * (1 + Sk / 64))
    assert ((sums - 1).abs()[~empty] <= tol).all()
    assert (w[empty] == 0).all()
    # masked entries are exactly zero
    if kw.get("causal") or "window_size" in kw:
        keep = window_keep(
            Sq, Sk, kw.get("window_size", (-1, -1)), kw.get("causal", False), device=device
        )
        assert (w[..., ~keep] == 0).all()
    if "attn_mask" in kw:
        m = kw["attn_mask"]
        hidden = ~m if m.dtype == torch.bool else torch.isinf(m)
        assert (w.masked_select(hidden.expand_as(w)) == 0).all()


@pytest.mark.parametrize("case", ["plain", "causal_sq_gt_sk", "bool_mask", "gqa"])
def test_weights_times_v_is_attention(device, case):
    """weights @ V (with the KV heads expanded) is attn_ext.attention's output."""
    q, k, kw = _setup(case, torch.float64, device)
    v = torch.randn(*k.shape[:-1], 24, dtype=torch.float64, device=device)
    w = attn_ext.attention_weights(q, k, **kw)
    out = attn_ext.attention(q, k, v, **kw)
    torch.testing.assert_close(w @ expand_kv_heads(v, q.shape[1]), out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_3d(device, dtype):
    q = rand((3, 13, 16), dtype, device)
    k = rand((3, 17, 16), dtype, device)
    m = random_bool_mask((3, 13, 17), device)
    w = attn_ext.attention_weights(q, k, causal=True, attn_mask=m)
    assert w.shape == (3, 13, 17)
    ref = attention_weights_reference(q, k, causal=True, attn_mask=m)
    tru = ground_truth(attention_weights_reference, q, k, causal=True, attn_mask=m)
    assert_error_rule(w, ref, tru, name="weights")


@pytest.mark.parametrize("B,H,Sq,Sk", [(0, 2, 5, 7), (2, 2, 0, 7), (2, 2, 5, 0)])
def test_weights_empty(device, B, H, Sq, Sk):
    q, k, _ = make_qkv(B, H, H, Sq, Sk, 8, device=device)
    q.requires_grad_(True), k.requires_grad_(True)
    w = attn_ext.attention_weights(q, k, causal=True)
    assert w.shape == (B, H, Sq, Sk)
    w.sum().backward()
    assert (q.grad == 0).all() and (k.grad == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    ["plain", "causal_sq_gt_sk", "window", "bool_mask", "float_mask", "gqa", "mqa_scale", "bshd"],
)
def test_weights_backward(device, dtype, case):
    q, k, kw = _setup(case, dtype, device)
    g = torch.randn(q.shape[0], q.shape[1], q.shape[2], k.shape[2], device=device).to(dtype)
    fn = lambda a, b: attn_ext.attention_weights(a, b, **kw)  # noqa: E731
    ref_fn = lambda a, b: attention_weights_reference(a, b, **kw)  # noqa: E731
    got = autograd_grads(fn, [q, k], g)
    ref = autograd_grads(ref_fn, [q, k], g)
    tru = ground_truth_grads(attention_weights_reference, [q, k], g, **kw)
    for name, a, r, t in zip(("dq", "dk"), got, ref, tru):
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(a.dtype))


GRADCHECK = {
    "plain": dict(shape=(1, 2, 2, 5, 6, 4)),
    "causal": dict(shape=(1, 2, 2, 7, 5, 6), causal=True),
    "window": dict(shape=(1, 2, 2, 8, 8, 4), window_size=(2, 1)),
    "bool_mask": dict(shape=(1, 2, 2, 6, 7, 5), mask="bool"),
    "float_mask": dict(shape=(1, 2, 2, 6, 7, 5), mask="float"),
    "gqa": dict(shape=(1, 4, 2, 5, 6, 4), causal=True, scale=0.7),
    "3d": dict(shape=(2, None, None, 5, 6, 4)),
}


@pytest.mark.parametrize("case", list(GRADCHECK))
def test_weights_gradcheck(device, case):
    c = dict(GRADCHECK[case])
    B, H, Hkv, Sq, Sk, D = c.pop("shape")
    f64 = dict(dtype=torch.float64, device=device, requires_grad=True)
    if H is None:
        q, k = rand((B, Sq, D), **f64), rand((B, Sk, D), **f64)
    else:
        q, k = rand((B, H, Sq, D), **f64), rand((B, Hkv, Sk, D), **f64)
    mask = c.pop("mask", None)
    if mask == "bool":
        m = random_bool_mask((B, 1, Sq, Sk), device)
        m[0, 0, 1] = False
        c["attn_mask"] = m
    elif mask == "float":
        c["attn_mask"] = random_float_mask((1, H, Sq, Sk), torch.float64, device)

    def fn(q, k):
        return attn_ext.attention_weights(q, k, **c)

    assert torch.autograd.gradcheck(fn, (q, k), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_weights_large_logits_fuzz_regression():
    """tests/test_fuzz.py --fuzz (2026-11-29): float32, explicit scale 2.5 at D 61, logits ~18 in
    log2 units. The kernel's probabilities were 7 float32 ulps off (8.5e-7), over the plain
    rule's 4 while the reference was exact by luck: the logits' own rounding, which
    logit_rounding_floor bounds. The kernel stays within that floor, and the floor stays far
    below what a wrong mask or scale would give."""
    torch.manual_seed(925)
    q = rand((2, 3, 34, 61), torch.float32, "cpu", "bshd")
    k = rand((2, 1, 3, 61), torch.float32, "cpu", "bshd")
    kw = dict(window_size=(-1, 1), scale=2.5)
    w = attn_ext.attention_weights(q, k, **kw)
    floor = logit_rounding_floor(q, k, torch.float32, **kw)
    assert floor < 1e-4
    truth = ground_truth(lambda a, b: attention_weights_reference(a, b, **kw), q, k)
    ref = attention_weights_reference(q, k, **kw)
    assert_error_rule(w, ref, truth, name="weights", slack_ulps=4.0, floor=floor)
