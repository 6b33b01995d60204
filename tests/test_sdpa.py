"""attn_ext.scaled_dot_product_attention is a drop-in for
torch.nn.functional.scaled_dot_product_attention: top-left ``is_causal``, bool
mask = keep, float mask = additive, ``enable_gqa``, ``scale``.

The ground truth is torch's own SDPA run on float64 copies of the inputs; at
the input dtype attn_ext must be within 2x torch SDPA's error (plus one
rounding unit, see reference.assert_error_rule). Cases with a row that sees
no key are tested separately: torch may give NaN there, attn_ext gives 0.
"""

import pytest
import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing.attention import attention_reference, sdpa_reference, top_left_causal_keep
from attn_ext.testing.numerics import (
    ALL_DTYPES,
    assert_error_rule,
    autograd_grads,
    grad_slack_ulps,
    ground_truth,
    make_qkv,
    rand,
    random_bool_mask,
    random_float_mask,
)

DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in ALL_DTYPES]


def check_sdpa(q, k, v, **kw):
    out = attn_ext.scaled_dot_product_attention(q, k, v, **kw)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    tru = ground_truth(F.scaled_dot_product_attention, q, k, v, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == ref.device
    assert torch.isfinite(tru).all()
    assert_error_rule(out, ref, tru)
    return out


def check_sdpa_grads(q, k, v, **kw):
    g = torch.randn(F.scaled_dot_product_attention(q, k, v, **kw).shape, device=q.device).to(
        q.dtype
    )
    ours = lambda a, b, c: attn_ext.scaled_dot_product_attention(a, b, c, **kw)  # noqa: E731
    theirs = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kw)  # noqa: E731
    got = autograd_grads(ours, [q, k, v], g)
    ref = autograd_grads(theirs, [q, k, v], g)
    # the truth: torch SDPA on float64 copies (float masks converted too)
    kw64 = {
        n: (m.double() if isinstance(m, torch.Tensor) and m.is_floating_point() else m)
        for n, m in kw.items()
    }
    theirs64 = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kw64)  # noqa: E731
    tru = autograd_grads(theirs64, [x.double() for x in (q, k, v)], g.double())
    for name, a, r, t in zip(("dq", "dk", "dv"), got, ref, tru):
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(a.dtype))


SHAPES = [(17, 17), (9, 30), (30, 9), (1, 64), (64, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_torch(device, dtype, sq, sk, is_causal):
    q, k, v = make_qkv(2, 3, 3, sq, sk, 32, dtype=dtype, device=device)
    check_sdpa(q, k, v, is_causal=is_causal)


def test_sdpa_is_causal_is_top_left(device):
    """With Sq != Sk, is_causal lets query i read keys j <= i (not bottom-right)."""
    q, k, v = make_qkv(1, 2, 2, 4, 9, 16, dtype=torch.float64, device=device)
    out = attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    first = attn_ext.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    torch.testing.assert_close(out[:, :, :1], first, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, :, :1], v[:, :, :1], rtol=1e-12, atol=1e-12)
    explicit = attn_ext.attention(q, k, v, attn_mask=top_left_causal_keep(4, 9, device=device))
    torch.testing.assert_close(out, explicit, rtol=1e-12, atol=1e-12)


MASK_SHAPES = [(2, 3, 11, 14), (11, 14), (2, 1, 11, 14), (1, 3, 1, 14), (2, 1, 1, 14)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_masks(device, dtype, shape, kind):
    q, k, v = make_qkv(2, 3, 3, 11, 14, 32, dtype=dtype, device=device)
    if kind == "bool":
        mask = random_bool_mask(shape, device)  # key 0 always kept: no empty row
    else:
        mask = random_float_mask(shape, dtype, device)
    check_sdpa(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_mask_and_is_causal_combine(device, kind):
    """torch's docs say both together are an error, but torch 2.13 accepts them and
    applies the mask and the top-left causal band together; the drop-in does what
    torch does, checked against torch with the band folded into the mask."""
    q, k, v = make_qkv(2, 2, 2, 10, 13, 16, device=device)
    if kind == "bool":
        mask = random_bool_mask((10, 13), device)
    else:
        mask = random_float_mask((2, 1, 10, 13), torch.float32, device)
    out = attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    band = top_left_causal_keep(10, 13, device)
    folded = mask & band if kind == "bool" else mask.masked_fill(~band, float("-inf"))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=folded)
    tru = ground_truth(F.scaled_dot_product_attention, q, k, v, attn_mask=folded)
    assert_error_rule(out, ref, tru)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv", [(4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_enable_gqa(device, dtype, h, hkv, is_causal):
    q, k, v = make_qkv(2, h, hkv, 13, 13, 32, dtype=dtype, device=device)
    check_sdpa(q, k, v, enable_gqa=True, is_causal=is_causal)


def test_sdpa_gqa_requires_flag(device):
    """Like torch, different head counts without enable_gqa are an error."""
    q, k, v = make_qkv(1, 4, 2, 5, 5, 8, device=device)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises((RuntimeError, ValueError)):
        attn_ext.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.1, 1.0, 2.5])
def test_sdpa_scale(device, dtype, scale):
    q, k, v = make_qkv(1, 2, 2, 12, 15, 64, dtype=dtype, device=device)
    check_sdpa(q, k, v, scale=scale, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_3d_and_dv(device, dtype):
    q = rand((3, 7, 16), dtype, device)
    k = rand((3, 12, 16), dtype, device)
    v = rand((3, 12, 40), dtype, device)
    check_sdpa(q, k, v)
    check_sdpa(q, k, v, is_causal=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_5d_with_broadcast_mask(device, kind):
    """(N, A, H, L, E) inputs: the leading dims are flattened into the batch, and a mask that
    broadcasts over them (here (1, A, 1, L, S)) must follow the same flattening."""
    q = rand((2, 3, 2, 5, 8), torch.float32, device)
    k = rand((2, 3, 2, 6, 8), torch.float32, device)
    v = rand((2, 3, 2, 6, 8), torch.float32, device)
    shape = (1, 3, 1, 5, 6)
    if kind == "bool":
        mask = random_bool_mask(shape, device)
    else:
        mask = random_float_mask(shape, torch.float32, device)
    out = check_sdpa(q, k, v, attn_mask=mask)
    assert out.shape == (2, 3, 2, 5, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_strided(device, dtype):
    q, k, v = make_qkv(2, 4, 4, 19, 19, 32, dtype=dtype, device=device, layout="bshd")
    check_sdpa(q, k, v, is_causal=True)


def test_sdpa_fully_masked_row_is_zero(device):
    """Documented difference: a row that sees no key is 0 here (torch may give NaN)."""
    q, k, v = make_qkv(1, 2, 2, 6, 8, 16, dtype=torch.float64, device=device)
    mask = random_bool_mask((1, 2, 6, 8), device)
    mask[:, :, 2] = False
    out = attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out[:, :, 2] == 0).all()
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rows = [0, 1, 3, 4, 5]
    torch.testing.assert_close(out[:, :, rows], theirs[:, :, rows], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, sdpa_reference(q, k, v, attn_mask=mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case", ["plain", "causal", "causal_sq_gt_sk", "bool", "float", "gqa", "scale"]
)
def test_sdpa_backward(device, dtype, case):
    sq, sk, h, hkv = 13, 17, 2, 2
    kw = {}
    if case == "causal":
        kw["is_causal"] = True
    elif case == "causal_sq_gt_sk":
        sq, sk = 17, 9
        kw["is_causal"] = True
    elif case == "gqa":
        h, hkv = 4, 2
        kw.update(enable_gqa=True, is_causal=True)
    elif case == "scale":
        kw["scale"] = 0.3
    q, k, v = make_qkv(2, h, hkv, sq, sk, 32, dtype=dtype, device=device)
    if case == "bool":
        kw["attn_mask"] = random_bool_mask((2, 1, sq, sk), device)
    elif case == "float":
        kw["attn_mask"] = random_float_mask((1, h, sq, sk), dtype, device)
    check_sdpa_grads(q, k, v, **kw)


def test_sdpa_gradcheck(device):
    f64 = dict(dtype=torch.float64, device=device, requires_grad=True)
    q, k, v = rand((1, 4, 5, 4), **f64), rand((1, 2, 7, 4), **f64), rand((1, 2, 7, 3), **f64)
    mask = random_bool_mask((5, 7), device)

    def masked(q, k, v):
        return attn_ext.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True, scale=0.8
        )

    def causal(q, k, v):
        return attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    assert torch.autograd.gradcheck(masked, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradcheck(causal, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_sdpa_dropout_follows_default_generator(device):
    """dropout_p > 0 draws from the default generator: the same seed gives the
    same output, which is the reference with attn_ext.dropout_keep_mask's mask."""
    q, k, v = make_qkv(2, 2, 2, 9, 11, 16, dtype=torch.float64, device=device)
    p = 0.4
    torch.manual_seed(123)
    a = attn_ext.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    torch.manual_seed(123)
    b = attn_ext.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    assert torch.equal(a, b)
    c = attn_ext.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    assert not torch.equal(a, c)  # the generator moved on
    torch.manual_seed(123)
    keep = attn_ext.dropout_keep_mask(2, 2, 9, 11, p).to(device)
    ref = attention_reference(
        q,
        k,
        v,
        attn_mask=top_left_causal_keep(9, 11, device=device),
        dropout_p=p,
        dropout_keep=keep,
    )
    torch.testing.assert_close(a, ref, rtol=1e-10, atol=1e-10)
