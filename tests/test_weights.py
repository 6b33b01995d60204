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
    # attention's score modifiers (softcap 1: below the scores' spread, so the tanh bends them)
    "softcap": dict(shape=(2, 3, 3, 17, 23, 32), softcap=1.0),
    "alibi": dict(shape=(1, 4, 2, 19, 23, 32), alibi="head", causal=True),
    "alibi_batch_softcap": dict(
        shape=(2, 2, 2, 15, 19, 16), alibi="batch", softcap=1.5, window_size=(6, 2)
    ),
    "sinks": dict(shape=(2, 4, 2, 13, 17, 32), sinks=True, causal=True),
}
# The masking cases the backward tests take (each adds its score-modifier cases).
BACKWARD_CASES = [
    "plain",
    "causal_sq_gt_sk",
    "window",
    "bool_mask",
    "float_mask",
    "gqa",
    "mqa_scale",
    "bshd",
]
# The slopes are ALiBi's geometric ones for 8 heads (2^-1 ... 2^-8), a head's distance bias
# spanning ~0.1-10 over these lengths; the sinks span a share from negligible to most of a row.
ALIBI_SLOPES = [2.0**-i for i in range(1, 9)]
SINKS = [0.5, 3.0, -2.0, 1.0]


def _score_mods(c, B, H, device):
    """A case's alibi / sinks markers as the tensors attention takes (float32, detached)."""
    alibi = c.pop("alibi", None)
    if alibi is not None:
        slopes = torch.tensor(ALIBI_SLOPES[:H], device=device)
        c["alibi_slopes"] = slopes if alibi == "head" else slopes * torch.rand(B, 1, device=device)
    if c.pop("sinks", False):
        c["sinks"] = torch.tensor(SINKS[:H], device=device)
    return c


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
    return q, k, _score_mods(c, B, H, device)


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
    # probabilities: non-negative, rows sum to 1 (less a sink's share), or are all zero when
    # the row sees no key
    assert (w >= 0).all()
    empty = tru.sum(-1) == 0
    sums = w.double().sum(-1)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2 * (1 + Sk / 64))
    want = tru.sum(-1) if "sinks" in kw else torch.ones_like(sums)
    assert ((sums - want).abs()[~empty] <= tol).all()
    if "sinks" in kw:
        assert (want[~empty] < 1 - 1e-3).all()  # every row gave the sink a visible share
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
@pytest.mark.parametrize("case", BACKWARD_CASES + ["softcap", "alibi_batch_softcap", "sinks"])
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
    "softcap": dict(shape=(1, 2, 2, 6, 7, 5), softcap=0.8),
    "alibi_softcap_gqa": dict(shape=(2, 4, 2, 5, 6, 4), alibi="batch", softcap=1.2, causal=True),
    "sinks_softcap": dict(shape=(1, 4, 1, 5, 6, 4), sinks=True, softcap=2.0, window_size=(3, 0)),
}


def _gradcheck_inputs(case, device):
    """float64 leaves q, k, v (v with 3 features) of a GRADCHECK case, and its keywords."""
    c = dict(GRADCHECK[case])
    B, H, Hkv, Sq, Sk, D = c.pop("shape")
    f64 = dict(dtype=torch.float64, device=device, requires_grad=True)
    if H is None:
        q, k, v = rand((B, Sq, D), **f64), rand((B, Sk, D), **f64), rand((B, Sk, 3), **f64)
    else:
        q, k = rand((B, H, Sq, D), **f64), rand((B, Hkv, Sk, D), **f64)
        v = rand((B, Hkv, Sk, 3), **f64)
    mask = c.pop("mask", None)
    if mask == "bool":
        m = random_bool_mask((B, 1, Sq, Sk), device)
        m[0, 0, 1] = False
        c["attn_mask"] = m
    elif mask == "float":
        c["attn_mask"] = random_float_mask((1, H, Sq, Sk), torch.float64, device)
    return q, k, v, _score_mods(c, B, H, device)


@pytest.mark.parametrize("case", list(GRADCHECK))
def test_weights_gradcheck(device, case):
    q, k, _, c = _gradcheck_inputs(case, device)

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


def test_with_weights_alibi_one_key_fuzz_regression():
    """tests/test_fuzz.py --fuzz under ATTN_EXT_CPU_KERNELS=avx2 (2026-11-29): float32, one key,
    25 query rows with ALiBi, so each row's only logit carries slope * distance up to ~24. The
    probability is exactly 1; the kernel's was 7 float32 ulps off, the rounding of the float32
    lse of a logit that large. logit_rounding_floor now counts ALiBi's term as it counts an
    additive mask's value; the kernel stays within it, and it stays far below what a wrong
    slope or distance would give (a factor e^(slope) per position)."""
    torch.manual_seed(0)
    q, k, v = (
        rand(shape, torch.float32, "cpu") for shape in ((1, 1, 25, 2), (1, 1, 1, 2), (1, 1, 1, 1))
    )
    kw = dict(alibi_slopes=torch.rand(1))
    _, w = attn_ext.attention_with_weights(q, k, v, **kw)
    floor = logit_rounding_floor(q, k, torch.float32, **kw)
    assert floor > logit_rounding_floor(q, k, torch.float32)  # the ALiBi term counted
    assert floor < 1e-4
    ref = attention_weights_reference(q, k, **kw)
    truth = ground_truth(lambda a, b: attention_weights_reference(a, b, **kw), q, k)
    assert_error_rule(w, ref, truth, name="weights", slack_ulps=4.0, floor=floor)


# ---------------------------------------------------------------- attention_with_weights
# attention's output and the probabilities it was formed with: the flash kernel, then
# attention_probabilities from its lse (mean_heads: their mean over heads, never per head).

MEAN = [pytest.param(False, id="heads"), pytest.param(True, id="mean")]


def _with_weights_reference(mean_heads, **kw):
    """(out, weights) as the plain reference forms them: weights @ V and the weights."""

    def fn(q, k, v):
        w = attention_weights_reference(q, k, **kw)
        out = w.to(v.dtype) @ expand_kv_heads(v, q.shape[1])
        return out, (w.mean(1) if mean_heads else w)

    return fn


def _value(k, dtype, device, dv=24):
    return rand((*k.shape[:-1], dv), dtype, device)


@pytest.mark.parametrize("mean_heads", MEAN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_with_weights_forward(device, dtype, case, mean_heads):
    q, k, kw = _setup(case, dtype, device)
    v = _value(k, dtype, device)
    out, w = attn_ext.attention_with_weights(q, k, v, mean_heads=mean_heads, **kw)
    # The output is attention's own: the same kernel on the same inputs.
    assert torch.equal(out, attn_ext.attention(q, k, v, **kw))
    ref_fn = _with_weights_reference(mean_heads, **kw)
    ref, tru = ref_fn(q, k, v)[1], ground_truth(lambda *a: ref_fn(*a)[1], q, k, v)
    assert w.shape == tru.shape and w.dtype == dtype and w.device == q.device
    assert_error_rule(w, ref, tru, name="weights")
    # The per-head weights are attention_weights' matrix, whose masked entries are exactly 0.
    if not mean_heads and kw.get("causal"):
        keep = window_keep(q.shape[2], k.shape[2], (-1, 0), False, device=device)
        assert (w[..., ~keep] == 0).all()


@pytest.mark.parametrize("mean_heads", MEAN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BACKWARD_CASES + ["alibi", "alibi_batch_softcap", "sinks"])
def test_with_weights_backward(device, dtype, case, mean_heads):
    """Gradients of a loss on both outputs: the flash backward for out, the softmax backward
    of the weights added."""
    q, k, kw = _setup(case, dtype, device)
    v = _value(k, dtype, device)

    def flat(fn):
        return lambda *a: torch.cat([t.flatten() for t in fn(*a)])

    ours = flat(lambda *a: attn_ext.attention_with_weights(*a, mean_heads=mean_heads, **kw))
    ref_fn = flat(_with_weights_reference(mean_heads, **kw))
    g = torch.randn(ours(q, k, v).shape, device=device).to(dtype)
    got = autograd_grads(ours, [q, k, v], g)
    ref = autograd_grads(ref_fn, [q, k, v], g)
    tru = ground_truth_grads(ref_fn, [q, k, v], g)
    for name, a, r, t in zip(("dq", "dk", "dv"), got, ref, tru):
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(a.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["plain", "causal", "gqa"])
def test_with_weights_unused_weights_give_attention_grads(device, dtype, case):
    """Weights that take no gradient cost the backward nothing: it is attention's own, bit for
    bit."""
    q, k, kw = _setup(case, dtype, device)
    v = _value(k, dtype, device)
    g = torch.randn(*q.shape[:-1], v.shape[-1], device=device).to(dtype)
    got = autograd_grads(lambda *a: attn_ext.attention_with_weights(*a, **kw)[0], [q, k, v], g)
    want = autograd_grads(lambda *a: attn_ext.attention(*a, **kw), [q, k, v], g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mean_heads", MEAN)
def test_with_weights_dropout(device, mean_heads):
    """With dropout the weights are the dropped, rescaled probabilities that out averaged (as
    torch's MultiheadAttention returns them): the mask dropout_keep_mask gives for the same
    generator state."""
    q, k, kw = _setup("gqa", torch.float64, device)
    v = _value(k, torch.float64, device)
    p = 0.3
    gen = torch.Generator().manual_seed(7)
    out, w = attn_ext.attention_with_weights(
        q, k, v, dropout_p=p, generator=gen, mean_heads=mean_heads, **kw
    )
    keep = attn_ext.dropout_keep_mask(
        *q.shape[:3], k.shape[2], p, generator=torch.Generator().manual_seed(7)
    ).to(device)
    dropped = attn_ext.attention_weights(q, k, **kw) * keep / (1 - p)
    want_out = dropped @ expand_kv_heads(v, q.shape[1])
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    want_w = dropped.mean(1) if mean_heads else dropped
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-10)
    assert not (keep.all() or (~keep).all())  # the mask did drop, and kept


@pytest.mark.parametrize("mean_heads", MEAN)
@pytest.mark.parametrize("case", list(GRADCHECK))
def test_with_weights_gradcheck(device, case, mean_heads):
    q, k, v, c = _gradcheck_inputs(case, device)

    def fn(q, k, v):
        return attn_ext.attention_with_weights(q, k, v, mean_heads=mean_heads, **c)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("mean_heads", MEAN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_with_weights_3d(device, dtype, mean_heads):
    q, k = rand((3, 13, 16), dtype, device), rand((3, 17, 16), dtype, device)
    v = rand((3, 17, 8), dtype, device)
    m = random_bool_mask((3, 13, 17), device)
    out, w = attn_ext.attention_with_weights(
        q, k, v, causal=True, attn_mask=m, mean_heads=mean_heads
    )
    assert out.shape == (3, 13, 8) and w.shape == (3, 13, 17)
    assert torch.equal(out, attn_ext.attention(q, k, v, causal=True, attn_mask=m))
    ref = attention_weights_reference(q, k, causal=True, attn_mask=m)
    tru = ground_truth(attention_weights_reference, q, k, causal=True, attn_mask=m)
    assert_error_rule(w, ref, tru, name="weights")


@pytest.mark.parametrize("mean_heads", MEAN)
@pytest.mark.parametrize("B,H,Sq,Sk", [(0, 2, 5, 7), (2, 2, 0, 7), (2, 2, 5, 0)])
def test_with_weights_empty(device, B, H, Sq, Sk, mean_heads):
    q, k, v = make_qkv(B, H, H, Sq, Sk, 8, device=device)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, w = attn_ext.attention_with_weights(q, k, v, causal=True, mean_heads=mean_heads)
    assert w.shape == ((B, Sq, Sk) if mean_heads else (B, H, Sq, Sk))
    (out.sum() + w.sum()).backward()
    assert (q.grad == 0).all() and (k.grad == 0).all() and (v.grad == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kw",
    [{}, dict(causal=True), dict(window_size=(300, 40)), dict(causal=True, softcap=2.0)],
    ids=["full", "causal", "window", "causal_softcap"],
)
def test_with_weights_mean_over_key_chunks(device, dtype, kw):
    """One (batch, query block) with 1100 keys: the CPU kernel splits the head mean into key
    chunks of whole tiles (each task owning its columns; float64 recomputes each row's lse over
    all its keys, not the chunk's). The mean is the reference's, and the per-head weights' mean
    to rounding."""
    q, k, _ = make_qkv(1, 4, 2, 50, 1100, 32, dtype=dtype, device=device)
    v = _value(k, dtype, device, dv=16)
    _, w = attn_ext.attention_with_weights(q, k, v, mean_heads=True, **kw)
    ref_fn = _with_weights_reference(True, **kw)
    ref, tru = ref_fn(q, k, v)[1], ground_truth(lambda *a: ref_fn(*a)[1], q, k, v)
    assert_error_rule(w, ref, tru, name="weights")
    _, per_head = attn_ext.attention_with_weights(q, k, v, **kw)
    # the mean of the stored per-head weights: their rounding to the dtype apart
    tol = {torch.float64: 1e-15, torch.float32: 1e-7}.get(dtype, 2.0**-8)
    torch.testing.assert_close(w.double(), per_head.double().mean(1), rtol=0, atol=tol)


def test_probabilities_count_a_sink(device):
    """From the lse of a call with sinks, each row's probabilities sum to one less the sink's
    share exp(sink - lse)."""
    q, k, v = make_qkv(2, 4, 2, 9, 11, 16, device=device)
    sinks = torch.tensor([0.5, 3.0, -2.0, 8.0], device=device)
    _, lse = attn_ext.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    p = attn_ext.attention_probabilities(q, k, lse, causal=True)
    sink_share = torch.exp(sinks[:, None] - lse)
    torch.testing.assert_close(p.sum(-1) + sink_share, torch.ones_like(lse))
    assert (sink_share > 1e-3).all()  # the sinks took a visible share


def test_probabilities_refuse_a_bad_lse(device):
    q, k, _ = make_qkv(2, 4, 2, 9, 11, 16, device=device)
    lse = torch.zeros(2, 4, 9, device=device)
    with pytest.raises(RuntimeError, match=r"lse must have shape \[2, 4, 9\], got \[2, 4, 8\]"):
        attn_ext.attention_probabilities(q, k, lse[..., :8])
    with pytest.raises(RuntimeError, match="lse must have dtype Float, got Double"):
        attn_ext.attention_probabilities(q, k, lse.double())


@pytest.mark.parametrize("mean_heads", MEAN)
def test_with_weights_dropout_gradcheck(device, mean_heads):
    """The dropped weights' gradient goes through the mask of the same rng_state: the ops on a
    fixed state are a deterministic function of q, k, v (both outputs differentiated)."""
    f64 = dict(dtype=torch.float64, device=device, requires_grad=True)
    q, k, v = rand((1, 4, 6, 5), **f64), rand((1, 2, 7, 5), **f64), rand((1, 2, 7, 3), **f64)
    state, p = torch.tensor([1234, 0]), 0.4
    ops = torch.ops.attn_ext

    def fn(q, k, v):
        out, lse = ops.attention(q, k, v, None, state, causal=True, dropout_p=p)
        w = ops.attention_probabilities(
            q, k, lse, None, state, causal=True, dropout_p=p, mean_heads=mean_heads
        )
        return out, w

    keep = ops.dropout_mask(state, 1, 4, 6, 7, p)
    assert not (keep.all() or (~keep).all())
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)
    # and the weights are the reference's dropped probabilities
    want = attention_weights_reference(q, k, causal=True) * keep.to(device) / (1 - p)
    want = want.mean(1) if mean_heads else want
    torch.testing.assert_close(fn(q, k, v)[1], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda q, k, lse: attn_ext.attention_weights(q, k, alibi_slopes=torch.ones(3)),
            r"attention_weights: alibi_slopes must have shape \(H,\) = \(4,\) or \(B, H\) = "
            r"\(1, 4\), got \[3\]",
        ),
        (
            lambda q, k, lse: attn_ext.attention_weights(q, k, sinks=torch.ones(2)),
            r"attention_weights: sinks must have shape \(H,\) = \(4,\), got \[2\]",
        ),
        (
            lambda q, k, lse: attn_ext.attention_weights(q, k, softcap=-1.0),
            r"attention_weights: softcap must be finite and >= 0 \(0 = off\), got -1",
        ),
        (
            lambda q, k, lse: torch.ops.attn_ext.attention_weights_backward(
                torch.ones(1, 4, 5, 6), torch.ones(1, 4, 5, 6), q, k, softcap=float("nan")
            ),
            r"attention_weights_backward: softcap must be finite and >= 0 \(0 = off\), got nan",
        ),
        (
            lambda q, k, lse: attn_ext.attention_probabilities(
                q, k, lse, alibi_slopes=torch.ones(4, dtype=torch.int32)
            ),
            "attention_probabilities: alibi_slopes must be floating, got Int",
        ),
    ],
    ids=["slopes_shape", "sinks_shape", "softcap_negative", "backward_softcap_nan", "slopes_int"],
)
def test_weights_refuse_bad_modifiers(call, message):
    """The score modifiers are checked as attention checks them, the message naming the op, the
    argument, what it must be and what it was."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(RuntimeError, match=message):
        call(q, k, torch.zeros(1, 4, 5))


def test_weights_refuse_slopes_grad(device):
    """ALiBi slopes are constants of the probabilities ops: a gradient for them raises rather
    than coming back as zero."""
    q, k, v = make_qkv(1, 2, 2, 5, 6, 8, device=device)
    slopes = torch.tensor([0.5, 0.25], device=device, requires_grad=True)
    with pytest.raises(NotImplementedError, match="alibi_slopes.detach()"):
        attn_ext.attention_weights(q, k, alibi_slopes=slopes)
    _, lse = attn_ext.attention(q, k, v, alibi_slopes=slopes.detach(), return_lse=True)
    with pytest.raises(NotImplementedError, match="alibi_slopes.detach()"):
        attn_ext.attention_probabilities(q, k, lse, alibi_slopes=slopes)


@pytest.mark.parametrize("op", ["weights", "with_weights", "with_weights_mean_dropout"])
def test_sinks_gradcheck(device, op):
    """The sinks' gradient through the probabilities (each row's sink share, -P_sink delta),
    alone and beside attention's own through out, with q and k (softcap on)."""
    f64 = dict(dtype=torch.float64, device=device, requires_grad=True)
    q, k, v = rand((2, 4, 5, 4), **f64), rand((2, 2, 6, 4), **f64), rand((2, 2, 6, 3), **f64)
    sinks = torch.tensor([0.3, -0.5, 1.0, 0.0], **f64)
    kw = dict(causal=True, softcap=1.5)

    if op == "weights":
        fn = lambda q, k, s: attn_ext.attention_weights(q, k, sinks=s, **kw)  # noqa: E731
    else:
        state, p = torch.tensor([5, 0]), (0.3 if op.endswith("dropout") else 0.0)
        ops = torch.ops.attn_ext

        def fn(q, k, s):
            out, lse = ops.attention(q, k, v, None, state, None, s, dropout_p=p, **kw)
            w = ops.attention_probabilities(
                q, k, lse, None, state, None, s, dropout_p=p, mean_heads=p > 0, **kw
            )
            return out, w

    assert torch.autograd.gradcheck(fn, (q, k, sinks), eps=1e-6, atol=1e-7, rtol=1e-5)
    # the weights alone give the sinks a gradient (not the attention call's backward on zeros)
    w = fn(q, k, sinks) if op == "weights" else fn(q, k, sinks)[1]
    (g,) = torch.autograd.grad((w * torch.randn_like(w)).sum(), sinks)
    assert (g != 0).all()


# ------------------------------------------------------------------------ the CUDA composite
# The weights ops' ATen implementation (csrc/attention/attention_weights.cpp) is what CUDA runs;
# redispatched to the CUDA key it runs on CPU tensors too, so it is checked here against the CPU
# kernels in float64, where both are exact to rounding.
CUDA_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
COMPOSITE_CASES = ["plain", "causal_sq_gt_sk", "window", "bool_mask", "float_mask", "gqa"]
COMPOSITE_CASES += ["softcap", "alibi", "alibi_batch_softcap", "sinks"]


def _composite(name, *args, **kwargs):
    return getattr(torch.ops.attn_ext, name).default.redispatch(CUDA_KEY, *args, **kwargs)


def _op_keywords(q, k, kw):
    """An attention_weights CASES entry as the ops' keywords (the 4-D form of its window)."""
    kw = dict(kw)
    left, right = kw.pop("window_size", (-1, -1))
    return dict(kw, window_left=left, window_right=right)


@pytest.mark.parametrize("case", COMPOSITE_CASES)
def test_composite_equals_cpu_kernels_float64(case):
    q, k, kw = _setup(case, torch.float64, "cpu")
    ops = torch.ops.attn_ext
    kw = _op_keywords(q, k, kw)
    tight = dict(rtol=1e-12, atol=1e-14)
    w = ops.attention_weights(q, k, **kw)
    torch.testing.assert_close(_composite("attention_weights", q, k, **kw), w, **tight)
    v = _value(k, torch.float64, "cpu")
    _, lse = ops.attention(q, k, v, **kw)
    for mean_heads in (False, True):
        got = _composite("attention_probabilities", q, k, lse, mean_heads=mean_heads, **kw)
        want = ops.attention_probabilities(q, k, lse, mean_heads=mean_heads, **kw)
        torch.testing.assert_close(got, want, **tight)
    g = torch.randn_like(w)
    softcap = kw.get("softcap", 0.0)
    got = _composite("attention_weights_backward", g, w, q, k, softcap=softcap)
    want = ops.attention_weights_backward(g, w, q, k, softcap=softcap)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
