"""Bad input gets an error that names the argument; non-finite input
propagates like the reference and nothing crashes."""

import re

import pytest
import torch

import attn_ext
from attn_ext.testing.attention import attention_reference
from attn_ext.testing.numerics import make_qkv

ERRORS = (RuntimeError, ValueError)


def names(arg):
    """Regex: the message names `arg` as a word (e.g. 'k' but not inside 'mask')."""
    return rf"(?<![A-Za-z0-9_]){re.escape(arg)}(?![A-Za-z0-9_])"


def qkv(device, B=2, H=4, Hkv=2, Sq=5, Sk=6, D=8, Dv=8, dtype=torch.float32):
    return make_qkv(B, H, Hkv, Sq, Sk, D, Dv, dtype=dtype, device=device)


BAD_SHAPES = {
    # name: (q shape, k shape, v shape, argument the message must name)
    "k_batch": ((2, 4, 5, 8), (3, 2, 6, 8), (3, 2, 6, 8), "k"),
    "v_batch": ((2, 4, 5, 8), (2, 2, 6, 8), (3, 2, 6, 8), "v"),
    "k_head_dim": ((2, 4, 5, 8), (2, 2, 6, 16), (2, 2, 6, 8), "k"),
    "v_heads": ((2, 4, 5, 8), (2, 2, 6, 8), (2, 4, 6, 8), "v"),
    "v_seq": ((2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 7, 8), "v"),
    "gqa_not_divisible": ((2, 4, 5, 8), (2, 3, 6, 8), (2, 3, 6, 8), "k"),
    "q_rank_5": ((1, 2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8), "q"),
    "q_rank_2": ((5, 8), (2, 2, 6, 8), (2, 2, 6, 8), "q"),
    "k_rank_5": ((2, 2, 5, 8), (1, 2, 2, 6, 8), (2, 2, 6, 8), "k"),
    "v_rank_2": ((2, 2, 5, 8), (2, 2, 6, 8), (6, 8), "v"),
}


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_bad_shapes(device, case):
    qs, ks, vs, arg = BAD_SHAPES[case]
    q, k, v = (torch.randn(s, device=device) for s in (qs, ks, vs))
    with pytest.raises(ERRORS, match=names(arg)):
        attn_ext.attention(q, k, v)
    if case not in ("v_seq", "v_rank_2", "v_heads", "v_batch"):
        with pytest.raises(ERRORS, match=names(arg)):
            attn_ext.attention_weights(q, k)


def test_gqa_message_gives_both_head_counts(device):
    q, k, v = qkv(device, H=4, Hkv=3)
    with pytest.raises(ERRORS) as e:
        attn_ext.attention(q, k, v)
    assert "4" in str(e.value) and "3" in str(e.value)


@pytest.mark.parametrize(
    "shape", [(2, 4, 5, 7), (3, 4, 5, 6), (2, 3, 5, 6), (5, 7), (1, 2, 2, 4, 5, 6)]
)
def test_bad_mask_shape(device, shape):
    q, k, v = qkv(device)  # broadcast target (2, 4, 5, 6)
    mask = torch.ones(shape, dtype=torch.bool, device=device)
    with pytest.raises(ERRORS, match=names("attn_mask")) as e:
        attn_ext.attention(q, k, v, attn_mask=mask)
    # the message says what it got
    assert str(tuple(shape)).replace(" ", "").strip("(),") in str(e.value).replace(" ", "").replace(
        "[", "("
    ).replace("]", ")")
    with pytest.raises(ERRORS, match=names("attn_mask")):
        attn_ext.attention_weights(q, k, attn_mask=mask)


@pytest.mark.parametrize("mask_dtype", [torch.int32, torch.int64, torch.uint8, torch.complex64])
def test_bad_mask_dtype(device, mask_dtype):
    q, k, v = qkv(device)
    mask = torch.ones(2, 4, 5, 6, device=device).to(mask_dtype)
    with pytest.raises(ERRORS, match=names("attn_mask")):
        attn_ext.attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("bad", ["k", "v"])
def test_mixed_dtypes(device, bad):
    q, k, v = qkv(device)
    if bad == "k":
        k = k.double()
    else:
        v = v.to(torch.bfloat16)
    with pytest.raises(ERRORS, match=names(bad)) as e:
        attn_ext.attention(q, k, v)
    msg = str(e.value)
    assert "Float" in msg or "float32" in msg  # the expected dtype is named


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_float_inputs(device, dtype):
    q, k, v = (x.to(dtype) for x in qkv(device))
    with pytest.raises(ERRORS, match=names("q")):
        attn_ext.attention(q, k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bad", ["k", "v", "attn_mask"])
def test_mixed_devices(bad):
    q, k, v = qkv("cuda")
    mask = None
    if bad == "k":
        k = k.cpu()
    elif bad == "v":
        v = v.cpu()
    else:
        mask = torch.ones(5, 6, dtype=torch.bool)
    with pytest.raises(ERRORS, match=names(bad)):
        attn_ext.attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5)])
def test_bad_window(device, window):
    q, k, v = qkv(device)
    with pytest.raises(ERRORS, match="window"):
        attn_ext.attention(q, k, v, window_size=window)


def test_window_must_be_a_pair(device):
    q, k, v = qkv(device)
    with pytest.raises(ERRORS, match="window"):
        attn_ext.attention(q, k, v, window_size=3)


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_bad_dropout_p(device, p):
    q, k, v = qkv(device)
    with pytest.raises(ERRORS, match="dropout_p"):
        attn_ext.attention(q, k, v, dropout_p=p)


def test_bad_scale(device):
    q, k, v = qkv(device)
    with pytest.raises(ERRORS, match="scale"):
        attn_ext.attention(q, k, v, scale=float("nan"))


@pytest.mark.parametrize("fn", ["attention", "attention_weights"])
def test_mask_gradient_is_refused(device, fn):
    q, k, v = qkv(device)
    q.requires_grad_(True)
    mask = torch.zeros(5, 6, device=device, requires_grad=True)
    with pytest.raises(ERRORS + (NotImplementedError,), match="attn_mask"):
        if fn == "attention":
            out = attn_ext.attention(q, k, v, attn_mask=mask)
        else:
            out = attn_ext.attention_weights(q, k, attn_mask=mask)
        out.sum().backward()
    # a detached mask is fine
    out = attn_ext.attention(q, k, v, attn_mask=mask.detach())
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_raw_op_errors_name_the_argument(device):
    """The registered op checks its inputs too (not only the Python wrapper)."""
    q, k, v = qkv(device)
    with pytest.raises(RuntimeError, match=names("k")):
        torch.ops.attn_ext.attention(q, k[..., :4], v)
    with pytest.raises(RuntimeError, match=names("q")):
        torch.ops.attn_ext.attention(q[0], k, v)
    with pytest.raises(RuntimeError, match="rng_state"):
        torch.ops.attn_ext.attention(q, k, v, dropout_p=0.5, rng_state=torch.tensor([1.0, 0.0]))


# --------------------------------------------------------------------------- #
# NaN / Inf
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_nan_in_query_row(device, dtype):
    """A NaN in query row i makes output row i NaN, like the reference; the
    other rows are unaffected."""
    q, k, v = make_qkv(1, 2, 2, 7, 9, 16, dtype=dtype, device=device)
    q[0, 1, 3, 5] = float("nan")
    out, lse = attn_ext.attention(q, k, v, return_lse=True, causal=True)
    ref = attention_reference(q, k, v, causal=True)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.isnan(out[0, 1, 3]).all()
    assert torch.isnan(lse[0, 1, 3])
    ok = ~torch.isnan(ref)
    torch.testing.assert_close(out[ok].double(), ref[ok].double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_in_key_spreads_to_every_row(device, dtype):
    q, k, v = make_qkv(1, 2, 2, 7, 9, 16, dtype=dtype, device=device)
    k[0, 0, 4, 0] = float("nan")
    out = attn_ext.attention(q, k, v)
    ref = attention_reference(q, k, v)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.isnan(out[0, 0]).all() and not torch.isnan(out[0, 1]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inf_input(device, dtype):
    """An inf in query row i yields a non-finite row i (as in the reference),
    finite correct rows elsewhere, and the backward runs."""
    q, k, v = make_qkv(1, 2, 2, 7, 9, 16, dtype=dtype, device=device)
    q[0, 0, 2, 3] = float("inf")
    ref = attention_reference(q, k, v)
    assert not torch.isfinite(ref[0, 0, 2]).all()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = attn_ext.attention(*leaves)
    assert not torch.isfinite(out[0, 0, 2]).all()
    fine = torch.ones(out.shape[:-1], dtype=torch.bool, device=device)
    fine[0, 0, 2] = False
    torch.testing.assert_close(out[fine], ref[fine], rtol=1e-5, atol=1e-5)
    out.sum().backward()  # must not crash
    assert leaves[0].grad.shape == q.shape
    # gradients of the rows of the other head are unaffected
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    attention_reference(*ref_leaves).sum().backward()
    torch.testing.assert_close(leaves[0].grad[0, 1], ref_leaves[0].grad[0, 1], rtol=1e-5, atol=1e-5)


def test_huge_finite_mask_values(device):
    """Additive masks of -1e30 / finfo.min (a common 'large negative' idiom)
    act as masking and do not overflow to NaN."""
    q, k, v = make_qkv(1, 2, 2, 6, 8, 16, device=device)
    for big in (-1e30, torch.finfo(torch.float32).min):
        mask = torch.zeros(6, 8, device=device)
        mask[:, 5:] = big
        out = attn_ext.attention(q, k, v, attn_mask=mask)
        ref = attn_ext.attention(q, k[:, :, :5], v[:, :, :5])
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
