"""attn_ext.attention against the references of attn_ext/testing/attention.py.

Numerics rule (design.md): the kernel's max-abs error against a float64
ground truth (the reference run on float64 copies of the very same inputs) is
at most 2x the error of the plain PyTorch reference run at the input dtype,
plus one rounding unit (see reference.assert_error_rule); float64 results
match the truth to ~1e-10.
"""

import math

import pytest
import torch

import attn_ext
from attn_ext.testing.attention import (
    attention_reference,
    doc000_causal_attention,
    doc000_gqa_attention,
    doc000_kv_cache_attention,
    doc000_sdpa,
    doc000_sliding_window_attention,
    doc000_tiled_flash_attention,
    doc003_masked_stable_attention,
    doc003_temperature_attention,
    doc004_grouped_attention_heads,
    expand_kv_heads,
    kv_cache_additive_mask,
    repeat_kv,
    stored_output_grad_floors,
    symmetric_window_keep,
    window_keep,
)
from attn_ext.testing.numerics import (
    ALL_DTYPES,
    assert_error_rule,
    assert_lse_close,
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


def check_forward(q, k, v, **kw):
    """Forward + lse of attn_ext.attention against the reference (rule)."""
    out, lse = attn_ext.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    tru, tru_lse = ground_truth(attention_reference, q, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype
    assert out.device == q.device
    assert lse.device == q.device
    assert tuple(lse.shape) == tuple(tru_lse.shape)
    assert_error_rule(out, ref, tru, name="out")
    assert_lse_close(lse, ref_lse, tru_lse)
    return out, lse


def check_backward(q, k, v, **kw):
    """Gradients of attn_ext.attention against the reference's autograd (rule)."""
    inputs = [q, k, v]
    out_shape = attention_reference(q.detach(), k.detach(), v.detach(), **kw).shape
    g = torch.randn(out_shape, device=q.device).to(q.dtype)
    got = autograd_grads(lambda a, b, c: attn_ext.attention(a, b, c, **kw), inputs, g)
    ref = autograd_grads(lambda a, b, c: attention_reference(a, b, c, **kw), inputs, g)
    tru = ground_truth_grads(attention_reference, inputs, g, **kw)
    for name, x, a, r, t in zip(("dq", "dk", "dv"), inputs, got, ref, tru):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(a.dtype))
    return got


# --------------------------------------------------------------------------- #
# Forward numerics
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32, 40, 64, 80, 128])
def test_head_dims(device, dtype, D):
    q, k, v = make_qkv(2, 3, 3, 37, 45, D, dtype=dtype, device=device)
    out, lse = check_forward(q, k, v)
    assert out.shape == (2, 3, 37, D) and lse.shape == (2, 3, 37)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sq,sk",
    [(1, 1), (1, 17), (17, 1), (17, 17), (63, 65), (65, 63), (129, 129), (1, 300), (300, 17)],
)
def test_odd_lengths(device, dtype, sq, sk):
    q, k, v = make_qkv(1, 2, 2, sq, sk, 32, dtype=dtype, device=device)
    check_forward(q, k, v)


WINDOWS = [
    pytest.param(True, (-1, -1), id="causal"),
    pytest.param(False, (8, 0), id="win8_0"),
    pytest.param(False, (4, 4), id="win4_4"),
    pytest.param(False, (0, 0), id="win0_0"),
    pytest.param(False, (-1, 5), id="win-1_5"),
    pytest.param(False, (5, -1), id="win5_-1"),
    pytest.param(True, (16, -1), id="causal_left16"),
    pytest.param(False, (3, 100), id="win3_100"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", [(17, 17), (63, 65), (65, 63), (1, 129), (129, 5)])
@pytest.mark.parametrize("causal,window", WINDOWS)
def test_causal_and_window(device, dtype, sq, sk, causal, window):
    q, k, v = make_qkv(1, 2, 2, sq, sk, 32, dtype=dtype, device=device)
    out, lse = check_forward(q, k, v, causal=causal, window_size=window)
    # rows that see no key (bottom-right alignment with Sq > Sk) are exact zeros
    empty = ~window_keep(sq, sk, window, causal, device=device).any(-1)
    assert (out[:, :, empty] == 0).all()
    assert (lse[:, :, empty] == float("-inf")).all()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (700, -1))])
def test_long_head_packed_per_tile(device, dtype, causal, window):
    # The CPU forward packs (AVX2) or converts (BLAS, bf16/fp16) a head's K/V once per head
    # when it fits a per-thread budget (Sk * (D + Dv) <= 2^22 resp. 2^21 elements), else
    # tile by tile: this shape takes the per-tile path of both.
    q, k, v = make_qkv(1, 2, 1, 150, 16500, 128, dtype=dtype, device=device)
    check_forward(q, k, v, causal=causal, window_size=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_head_reused_across_blocks_and_heads(device, dtype):
    # Many query blocks per head, a GQA group sharing each kv head, and a window whose
    # key range starts past 0 (and off the 16-key panel grid): the per-thread packed or
    # converted K/V must follow every switch.
    q, k, v = make_qkv(2, 4, 2, 700, 900, 64, dtype=dtype, device=device)
    check_forward(q, k, v, causal=True, window_size=(301, -1))
    check_forward(q, k, v)


def test_causal_is_bottom_right(device):
    """Causal with Sq < Sk: the last query sees every key, the first query the
    first Sk - Sq + 1 keys (a KV-cache prefill)."""
    q, k, v = make_qkv(1, 1, 1, 3, 8, 16, dtype=torch.float64, device=device)
    out = attn_ext.attention(q, k, v, causal=True)
    full = attn_ext.attention(q[:, :, -1:], k, v)
    torch.testing.assert_close(out[:, :, -1:], full, rtol=1e-12, atol=1e-12)
    first = attn_ext.attention(q[:, :, :1], k[:, :, :6], v[:, :, :6])
    torch.testing.assert_close(out[:, :, :1], first, rtol=1e-12, atol=1e-12)


MASK_SHAPES = {
    "full": lambda B, H, Sq, Sk: (B, H, Sq, Sk),
    "2d": lambda B, H, Sq, Sk: (Sq, Sk),
    "b1qk": lambda B, H, Sq, Sk: (B, 1, Sq, Sk),
    "1h1k": lambda B, H, Sq, Sk: (1, H, 1, Sk),
    "b11k": lambda B, H, Sq, Sk: (B, 1, 1, Sk),
    "bhq1": lambda B, H, Sq, Sk: (B, H, Sq, 1),  # broadcast over keys: column stride 0
    "2d_t": lambda B, H, Sq, Sk: (Sk, Sq),  # built transposed, read as .mT: column stride Sq
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", list(MASK_SHAPES))
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks(device, dtype, mask_shape, kind, causal):
    B, H, Sq, Sk = 2, 3, 19, 23
    q, k, v = make_qkv(B, H, H, Sq, Sk, 32, dtype=dtype, device=device)
    shape = MASK_SHAPES[mask_shape](B, H, Sq, Sk)
    if mask_shape == "bhq1":
        # one entry per row: -inf / False empties the row (zeros), a finite shift is a no-op
        mask = (
            random_bool_mask(shape, device, ensure_row=False)
            if kind == "bool"
            else random_float_mask(shape, dtype, device, p_neg_inf=0.4, ensure_row=False)
        )
        assert 0 < (mask if kind == "bool" else mask.isfinite()).sum() < mask.numel()
    elif kind == "bool":
        mask = random_bool_mask(shape, device)
        mask[..., -1] = True  # keep a key the causal mask keeps too
    else:
        mask = random_float_mask(shape, dtype, device)
        mask[..., -1] = 0.0
    if mask_shape == "2d_t":
        mask = mask.mT
        mask[..., -1] = True if kind == "bool" else 0.0
    check_forward(q, k, v, attn_mask=mask, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_broadcast_mask_matches_dense_copy(device, dtype, kind):
    """A mask read through stride-0 dimensions gives the same bits as its dense copy."""
    B, H, Sq, Sk = 2, 3, 19, 23
    q, k, v = make_qkv(B, H, H, Sq, Sk, 32, dtype=dtype, device=device)
    for shape in [(B, H, Sq, 1), (B, 1, 1, Sk), (Sq, Sk)]:
        mask = (
            random_bool_mask(shape, device, ensure_row=False)
            if kind == "bool"
            else random_float_mask(shape, dtype, device, p_neg_inf=0.3, ensure_row=False)
        )
        dense = mask.expand(B, H, Sq, Sk).contiguous()
        out = attn_ext.attention(q, k, v, attn_mask=mask)
        assert torch.equal(out, attn_ext.attention(q, k, v, attn_mask=dense)), shape
        assert out.isfinite().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv", [(4, 2), (4, 1), (6, 3), (3, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_gqa(device, dtype, h, hkv, causal, with_mask):
    q, k, v = make_qkv(2, h, hkv, 21, 26, 32, dtype=dtype, device=device)
    # a per-query-head mask checks that masks are indexed by the query head
    mask = random_bool_mask((1, h, 21, 26), device) if with_mask else None
    check_forward(q, k, v, causal=causal, attn_mask=mask)


def test_gqa_head_mapping(device):
    """Query head h reads KV head h // (H // Hkv): change one KV head and only
    its query group moves."""
    q, k, v = make_qkv(1, 6, 3, 5, 7, 8, dtype=torch.float64, device=device)
    out = attn_ext.attention(q, k, v)
    v2 = v.clone()
    v2[:, 1] += 1.0
    out2 = attn_ext.attention(q, k, v2)
    moved = (out2 - out).abs().amax(dim=(0, 2, 3)) > 0.5
    assert moved.tolist() == [False, False, True, True, False, False]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", [(16, 32), (64, 16), (80, 48), (32, 1)])
def test_cross_attention_dv(device, dtype, d, dv):
    q, k, v = make_qkv(2, 2, 2, 7, 29, d, dv, dtype=dtype, device=device)
    out, _ = check_forward(q, k, v)
    assert out.shape == (2, 2, 7, dv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bsk", "sk"])
def test_3d_inputs(device, dtype, causal, mask):
    B, Sq, Sk, D = 3, 13, 17, 16
    q = rand((B, Sq, D), dtype, device)
    k = rand((B, Sk, D), dtype, device)
    v = rand((B, Sk, 24), dtype, device)
    m = None
    if mask == "bsk":
        m = random_bool_mask((B, Sq, Sk), device)
        m[..., -1] = True
    elif mask == "sk":
        m = random_float_mask((Sq, Sk), dtype, device)
        m[..., -1] = 0.0
    out, lse = check_forward(q, k, v, causal=causal, attn_mask=m)
    assert out.shape == (B, Sq, 24) and lse.shape == (B, Sq)
    # same numbers as the 4-D call with one head
    m4 = None if m is None else (m.unsqueeze(1) if m.dim() == 3 else m)
    out4 = attn_ext.attention(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), causal=causal, attn_mask=m4
    )
    torch.testing.assert_close(out, out4.squeeze(1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "noncontig", "expand_b"])
@pytest.mark.parametrize("gqa", [False, True])
def test_strided_inputs(device, dtype, layout, gqa):
    B, H, Hkv, Sq, Sk, D = 2, 4, (2 if gqa else 4), 19, 33, 32
    q = rand((B, H, Sq, D), dtype, device, "bshd" if layout == "expand_b" else layout)
    k = rand((B, Hkv, Sk, D), dtype, device, layout)
    v = rand((B, Hkv, Sk, D), dtype, device, layout)
    if layout == "bshd":
        assert not q.is_contiguous() and q.stride(-1) == 1
    out, _ = check_forward(q, k, v, causal=True)
    # same result as on contiguous copies, bit for bit is not required but
    # float64 must agree to rounding
    ref = attn_ext.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    torch.testing.assert_close(out.double(), ref.double(), **_tol(dtype))


def _tol(dtype):
    return {
        torch.float64: dict(rtol=1e-12, atol=1e-12),
        torch.float32: dict(rtol=1e-5, atol=1e-6),
        torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
    }[dtype]


def test_bshd_view_is_not_copied():
    """The (B, S, H, D).transpose(1, 2) view is read in place: it costs no
    more copies than contiguous inputs (design.md)."""
    from torch.profiler import ProfilerActivity, profile

    def copies(q, k, v):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            attn_ext.attention(q, k, v, causal=True)
        return sum(e.name in ("aten::copy_", "aten::clone") for e in prof.events())

    qs, ks, vs = make_qkv(2, 4, 2, 64, 64, 32, layout="bshd")
    qc, kc, vc = qs.contiguous(), ks.contiguous(), vs.contiguous()
    copies(qc, kc, vc)  # warm up lazy initialisation
    assert copies(qs, ks, vs) == copies(qc, kc, vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_scores_are_stable(device, dtype):
    """Scores of magnitude ~1e3 (softmax needs the running max) stay finite and accurate."""
    q, k, v = make_qkv(1, 2, 2, 33, 40, 64, dtype=torch.float32, device=device)
    q = (q * 40).to(dtype)
    k, v = k.to(dtype), v.to(dtype)
    out, lse = check_forward(q, k, v, causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.abs().max() > 50


def test_fp32_error_tail_matches_torch(device):
    """The fp32 forward's rare large errors are no worse than torch's own SDPA. The max-abs
    rule above allows one rounding unit of slack, which hid this: scaling Q by
    scale * log2(e) before Q K^T (instead of scaling the scores) rounds every q_d first, and
    rows with one dominant key then lose ~40 ulps. These inputs (seed 0) contain such rows:
    that formulation gave 2.3x torch's 99.99th percentile |error| here (and 2.4-3.3x torch's
    max error in 3 of 16 random draws of this shape); scaling the scores gives ~1.0x. The
    percentile (the ~26 worst of 262k outputs) is stable against a single lucky row; the 50%
    margin covers the summation order."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 2048, 64, generator=gen).to(device) for _ in range(3))
    truth = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())

    def tail(x):
        return torch.quantile((x.double() - truth).abs().flatten().float().cpu(), 0.9999).item()

    ours = tail(attn_ext.attention(q, k, v))
    torch_err = tail(torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert ours <= 1.5 * torch_err, f"99.99th pct |error| {ours:.2e} vs torch's {torch_err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.05, 0.5, 1.0, 3.0])
def test_explicit_scale(device, dtype, scale):
    q, k, v = make_qkv(2, 2, 2, 11, 14, 32, dtype=dtype, device=device)
    check_forward(q, k, v, scale=scale, causal=True)


def test_default_scale_is_inv_sqrt_d(device):
    q, k, v = make_qkv(1, 2, 2, 9, 9, 48, dtype=torch.float64, device=device)
    a = attn_ext.attention(q, k, v)
    b = attn_ext.attention(q, k, v, scale=1.0 / math.sqrt(48))
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    c = attn_ext.attention(q, k, v, scale=0.5)
    assert (a - c).abs().max() > 1e-3


def test_return_lse_flag(device):
    q, k, v = make_qkv(2, 2, 2, 9, 12, 16, device=device)
    out = attn_ext.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    res = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    assert torch.equal(out, res[0])
    assert res[1].dtype == torch.float32 and res[1].shape == (2, 2, 9)


# --------------------------------------------------------------------------- #
# Empty inputs and rows that see no key
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("B,H,Sq,Sk", [(0, 2, 5, 7), (2, 2, 0, 7), (2, 2, 5, 0), (1, 2, 0, 0)])
def test_empty(device, dtype, B, H, Sq, Sk):
    q, k, v = make_qkv(B, H, H, Sq, Sk, 16, 8, dtype=dtype, device=device)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, lse = attn_ext.attention(q, k, v, return_lse=True, causal=True)
    assert out.shape == (B, H, Sq, 8) and out.dtype == dtype
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    if Sk == 0:  # no key at all: every row is empty
        assert (out == 0).all() and (lse == float("-inf")).all()
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape
        assert (x.grad == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["bool", "float", "causal_sq_gt_sk", "window", "padding"])
def test_fully_masked_rows(device, dtype, how):
    B, H, Sq, Sk, D = 2, 2, 12, 10, 16
    kw = {}
    if how == "bool":
        mask = random_bool_mask((B, H, Sq, Sk), device)
        mask[:, :, [0, 5, 11]] = False
        kw["attn_mask"] = mask
        empty = ~mask.any(-1)
    elif how == "float":
        mask = random_float_mask((B, 1, Sq, Sk), dtype, device)
        mask[:, :, [2, 3]] = float("-inf")
        kw["attn_mask"] = mask
        empty = torch.isinf(mask).all(-1).expand(B, H, Sq)
    elif how == "causal_sq_gt_sk":
        kw["causal"] = True
        empty = ~window_keep(Sq, Sk, causal=True, device=device).any(-1)
        empty = empty.expand(B, H, Sq)
    elif how == "window":
        kw["window_size"] = (0, 0)  # query i reads only key i - 2: rows 0, 1 read nothing
        empty = ~window_keep(Sq, Sk, (0, 0), device=device).any(-1)
        empty = empty.expand(B, H, Sq)
    else:  # key padding mask that hides every key of batch element 1
        mask = torch.ones(B, 1, 1, Sk, dtype=torch.bool, device=device)
        mask[1] = False
        kw["attn_mask"] = mask
        empty = torch.zeros(B, H, Sq, dtype=torch.bool, device=device)
        empty[1] = True
    assert empty.any()
    q, k, v = make_qkv(B, H, H, Sq, Sk, D, dtype=dtype, device=device)
    out, lse = check_forward(q, k, v, **kw)
    assert (out[empty] == 0).all()
    assert (lse[empty] == float("-inf")).all()
    assert torch.isfinite(lse[~empty]).all()
    # gradient: zero for the empty query rows, finite everywhere
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    attn_ext.attention(qg, kg, vg, **kw).float().square().sum().backward()
    for x in (qg, kg, vg):
        assert torch.isfinite(x.grad).all()
    assert (qg.grad[empty] == 0).all()
    if how == "padding":
        # keys that no query row sees get no gradient either
        assert (kg.grad[1] == 0).all() and (vg.grad[1] == 0).all()


# --------------------------------------------------------------------------- #
# Backward
# --------------------------------------------------------------------------- #
BACKWARD_CASES = {
    "plain": dict(shape=(2, 2, 2, 17, 17, 32)),
    "causal_sq_lt_sk": dict(shape=(1, 2, 2, 9, 21, 32), causal=True),
    "causal_sq_gt_sk": dict(shape=(1, 2, 2, 21, 9, 32), causal=True),
    "window": dict(shape=(1, 2, 2, 33, 33, 16), window_size=(4, 2)),
    "bool_mask": dict(shape=(2, 2, 2, 15, 19, 32), mask="bool"),
    "float_mask": dict(shape=(2, 2, 2, 15, 19, 32), mask="float"),
    "gqa": dict(shape=(2, 4, 2, 17, 20, 32), causal=True),
    "mqa": dict(shape=(1, 4, 1, 17, 20, 64)),
    "cross_dv": dict(shape=(2, 2, 2, 7, 29, 16), dv=40),
    "bshd": dict(shape=(2, 4, 2, 17, 17, 32), layout="bshd", causal=True),
    "long": dict(shape=(1, 1, 1, 129, 257, 64), causal=True),
    "d128": dict(shape=(1, 2, 2, 65, 63, 128)),
    # several key blocks and query tiles, head dims off the CPU kernels' 16-wide panels
    "odd_dims_blocks": dict(shape=(1, 2, 1, 150, 270, 40), dv=24, window_size=(100, 20)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_backward(device, dtype, case):
    c = dict(BACKWARD_CASES[case])
    B, H, Hkv, Sq, Sk, D = c.pop("shape")
    q, k, v = make_qkv(
        B,
        H,
        Hkv,
        Sq,
        Sk,
        D,
        c.pop("dv", None),
        dtype=dtype,
        device=device,
        layout=c.pop("layout", "contiguous"),
    )
    mask = c.pop("mask", None)
    if mask == "bool":
        c["attn_mask"] = random_bool_mask((B, H, Sq, Sk), device)
    elif mask == "float":
        c["attn_mask"] = random_float_mask((B, 1, Sq, Sk), dtype, device)
    check_backward(q, k, v, **c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_3d(device, dtype):
    q = rand((2, 11, 16), dtype, device)
    k = rand((2, 14, 16), dtype, device)
    v = rand((2, 14, 8), dtype, device)
    mask = random_bool_mask((2, 11, 14), device)
    check_backward(q, k, v, causal=True, attn_mask=mask)


GRADCHECK_CASES = {
    "plain": dict(shape=(1, 2, 2, 5, 6, 4)),
    "causal_sq_gt_sk": dict(shape=(1, 2, 2, 7, 5, 6), causal=True),
    "causal_sq_lt_sk": dict(shape=(1, 2, 2, 5, 8, 6), causal=True),
    "window": dict(shape=(1, 2, 2, 9, 9, 4), window_size=(2, 1)),
    "bool_mask": dict(shape=(1, 2, 2, 6, 7, 5), mask="bool"),
    "float_mask": dict(shape=(1, 2, 2, 6, 7, 5), mask="float"),
    "gqa": dict(shape=(1, 4, 2, 5, 6, 4), causal=True),
    "mqa_dv": dict(shape=(1, 2, 1, 5, 6, 4), dv=7),
    "scale": dict(shape=(1, 2, 2, 5, 5, 8), scale=0.9),
    "3d": dict(shape=(2, None, None, 5, 6, 4)),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck(device, case):
    c = dict(GRADCHECK_CASES[case])
    B, H, Hkv, Sq, Sk, D = c.pop("shape")
    Dv = c.pop("dv", D)
    f64 = dict(dtype=torch.float64, device=device, requires_grad=True)
    if H is None:
        q, k, v = rand((B, Sq, D), **f64), rand((B, Sk, D), **f64), rand((B, Sk, Dv), **f64)
    else:
        q, k, v = (
            rand((B, H, Sq, D), **f64),
            rand((B, Hkv, Sk, D), **f64),
            rand((B, Hkv, Sk, Dv), **f64),
        )
    mask = c.pop("mask", None)
    if mask == "bool":
        m = random_bool_mask((B, 1, Sq, Sk), device)
        m[0, 0, 2] = False  # one fully masked row
        c["attn_mask"] = m
    elif mask == "float":
        c["attn_mask"] = random_float_mask((1, H, Sq, Sk), torch.float64, device)

    def fn(q, k, v):
        return attn_ext.attention(q, k, v, **c)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_lse_gradient_is_correct_or_refused(device):
    """The lse output is differentiable or refuses to be: never a silently
    wrong (e.g. ignored) gradient."""
    q, k, v = make_qkv(1, 2, 2, 6, 7, 8, dtype=torch.float64, device=device)
    g_out = torch.randn(1, 2, 6, 8, dtype=torch.float64, device=device)
    g_lse = torch.randn(1, 2, 6, dtype=torch.float64, device=device)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v, causal=True, return_lse=True)
        return (out * g_out).sum() + (lse.double() * g_lse).sum()

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    try:
        got = torch.autograd.grad(loss(attn_ext.attention, *leaves), leaves)
    except (RuntimeError, NotImplementedError) as e:
        assert "lse" in str(e)
        return
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = torch.autograd.grad(loss(attention_reference, *ref_leaves), ref_leaves)
    for a, r in zip(got, ref):
        # lse is float32, so its contribution is only float32-accurate
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- #
# The source documents
# --------------------------------------------------------------------------- #
DOC_DTYPES = [pytest.param(torch.float64, id="float64"), pytest.param(torch.float32, id="float32")]


def _doc_check(actual, doc_fn, *inputs, **kw):
    ref = doc_fn(*inputs, **kw)
    tru = ground_truth(doc_fn, *inputs, **kw)
    assert_error_rule(actual, ref, tru)


@pytest.mark.parametrize("dtype", DOC_DTYPES)
def test_doc000_self_and_cross_attention(device, dtype):
    # self attention: Q = K = V, (2, 6, 64)
    x = rand((2, 6, 64), dtype, device)
    out = attn_ext.attention(x, x, x)
    assert out.shape == (2, 6, 64)
    _doc_check(out, doc000_sdpa, x, x, x)
    # cross attention: (1, 3, 16) queries, 10 keys, values of width 32
    q2, k2, v2 = (
        rand((1, 3, 16), dtype, device),
        rand((1, 10, 16), dtype, device),
        rand((1, 10, 32), dtype, device),
    )
    out2 = attn_ext.attention(q2, k2, v2)
    assert out2.shape == (1, 3, 32)
    _doc_check(out2, doc000_sdpa, q2, k2, v2)


@pytest.mark.parametrize("dtype", DOC_DTYPES)
def test_doc000_multi_head(device, dtype):
    """000 MultiHeadAttention core on (B, S, d_model) split into heads with
    view + transpose (a strided view)."""
    B, S, d_model, nh = 2, 10, 64, 8
    x = rand((B, S, d_model), dtype, device)
    heads = x.view(B, S, nh, d_model // nh).transpose(1, 2)
    out = attn_ext.attention(heads, heads, heads)
    _doc_check(out, doc000_sdpa, heads, heads, heads)
    merged = out.transpose(1, 2).reshape(B, S, d_model)
    assert merged.shape == (B, S, d_model)


@pytest.mark.parametrize("dtype", DOC_DTYPES)
def test_doc000_causal_attention(device, dtype):
    x = rand((1, 4, 8), dtype, device)
    out = attn_ext.attention(x, x, x, causal=True)
    _doc_check(out, doc000_causal_attention, x, x, x)
    # "position 0 only sees itself, so its output equals V[0]"
    torch.testing.assert_close(
        out[:, 0], x[:, 0], rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12
    )
    # 4-D, several heads
    q, k, v = make_qkv(2, 3, 3, 31, 31, 16, dtype=dtype, device=device)
    out = attn_ext.attention(q, k, v, causal=True)
    _doc_check(out, doc000_causal_attention, q, k, v)


@pytest.mark.parametrize("dtype", DOC_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 1), (4, 4)])
def test_doc000_group_query_attention(device, dtype, num_heads, num_kv_heads):
    B, S, dk = 2, 6, 4
    q = rand((B, num_heads, S, dk), dtype, device, "bshd")
    k = rand((B, num_kv_heads, S, dk), dtype, device, "bshd")
    v = rand((B, num_kv_heads, S, dk), dtype, device, "bshd")
    out = attn_ext.attention(q, k, v)
    _doc_check(out, doc000_gqa_attention, q, k, v)


def test_doc003_repeat_kv_equals_repeat_interleave(device):
    x = torch.randn(2, 3, 5, 4, device=device)
    for n_rep in (1, 2, 4):
        assert torch.equal(repeat_kv(x, n_rep), expand_kv_heads(x, 3 * n_rep))


@pytest.mark.parametrize("dtype", DOC_DTYPES)
@pytest.mark.parametrize("w", [0, 1, 2, 5, 7, 40])
def test_doc000_sliding_window(device, dtype, w):
    """|i - j| <= w is window_size=(w, w) when Sq == Sk."""
    x = rand((1, 8, 16), dtype, device)
    out = attn_ext.attention(x, x, x, window_size=(w, w))
    _doc_check(out, doc000_sliding_window_attention, x, x, x, w=w)
    if w == 0:  # every position only sees itself: the output is V
        torch.testing.assert_close(out, x, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)
    if w >= 8:  # the window covers everything: full attention
        torch.testing.assert_close(out, attn_ext.attention(x, x, x), rtol=0, atol=0)
    q, k, v = make_qkv(2, 2, 2, 37, 37, 32, dtype=dtype, device=device)
    out = attn_ext.attention(q, k, v, window_size=(w, w))
    _doc_check(out, doc000_sliding_window_attention, q, k, v, w=w)
    assert torch.equal(symmetric_window_keep(37, w), window_keep(37, 37, (w, w)))


@pytest.mark.parametrize("dtype", DOC_DTYPES)
@pytest.mark.parametrize("s_new,s_total", [(6, 6), (4, 10), (1, 9)])
def test_doc000_kv_cache_prefill_mask(device, dtype, s_new, s_total):
    """000's KV-cache mask triu(-inf, S_total - S_new + 1) is causal=True."""
    q, k, v = make_qkv(2, 4, 4, s_new, s_total, 16, dtype=dtype, device=device)
    out = attn_ext.attention(q, k, v, causal=True)
    _doc_check(out, doc000_kv_cache_attention, q, k, v)
    keep = kv_cache_additive_mask(s_new, s_total) == 0
    assert torch.equal(keep, window_keep(s_new, s_total, causal=True))


@pytest.mark.parametrize("hkv", [4, 2])
def test_doc000_incremental_decoding_matches_full(device, hkv):
    """Prefill 4 tokens then decode one at a time against the growing cache:
    the outputs equal one causal pass over all 6 tokens."""
    q, k, v = make_qkv(1, 4, hkv, 6, 6, 16, dtype=torch.float64, device=device)
    full = attn_ext.attention(q, k, v, causal=True)
    parts = [attn_ext.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], causal=True)]
    for t in (4, 5):
        parts.append(
            attn_ext.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], causal=True)
        )
    torch.testing.assert_close(torch.cat(parts, dim=2), full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block_size", [16, 7, 32, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_doc000_tiled_flash_reference_is_exact(device, block_size, masked):
    """Self-check of the tiled reference: online softmax == plain softmax."""
    q, k, v = make_qkv(2, 2, 2, 45, 70, 16, 24, dtype=torch.float64, device=device)
    keep = window_keep(45, 70, (10, 0), device=device) if masked else None
    out, lse = doc000_tiled_flash_attention(q, k, v, block_size=block_size, keep=keep)
    ref, ref_lse = attention_reference(q, k, v, attn_mask=keep, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DOC_DTYPES)
@pytest.mark.parametrize("sq,sk", [(64, 64), (33, 100), (100, 33)])
@pytest.mark.parametrize("causal", [False, True])
def test_doc000_flash_attention(device, dtype, sq, sk, causal):
    q, k, v = make_qkv(1, 2, 2, sq, sk, 32, dtype=dtype, device=device)
    keep = window_keep(sq, sk, causal=True, device=device) if causal else None
    out, lse = attn_ext.attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = doc000_tiled_flash_attention(q, k, v, block_size=16, keep=keep)
    tru, tru_lse = ground_truth(doc000_tiled_flash_attention, q, k, v, block_size=16, keep=keep)
    assert_error_rule(out, ref, tru)
    assert_lse_close(lse, ref_lse, tru_lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [(2, 3, 17, 17), (17, 17), (2, 1, 1, 17)])
def test_doc003_masked_stable_attention(device, dtype, mask_shape):
    """003: bool mask (True = visible), softmax in float32; a row with no
    visible key gives 0 (corrected)."""
    q, k, v = make_qkv(2, 3, 3, 17, 17, 32, dtype=dtype, device=device)
    mask = random_bool_mask(mask_shape, device)
    if len(mask_shape) == 4 and mask_shape[2] > 1:
        mask[0, :, 4] = False  # a fully masked row
    out = attn_ext.attention(q, k, v, attn_mask=mask)
    _doc_check(out, doc003_masked_stable_attention, q, k, v, mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tau", [0.25, 0.5, 1.0, 2.0, 10.0])
def test_doc003_temperature(device, dtype, tau):
    """003: softmax(s / tau) with s = q.k / sqrt(d_h) == scale 1 / (tau sqrt(d_h))."""
    D = 32
    q, k, v = make_qkv(2, 2, 2, 13, 16, D, dtype=dtype, device=device)
    out = attn_ext.attention(q, k, v, scale=1.0 / (tau * math.sqrt(D)))
    _doc_check(out, doc003_temperature_attention, q, k, v, tau=tau)


def test_doc003_temperature_entropy_monotone(device):
    """003: attention entropy does not decrease with tau."""
    q, k = make_qkv(1, 2, 2, 9, 12, 16, dtype=torch.float64, device=device)[:2]
    ent = []
    for tau in (0.25, 0.5, 1.0, 2.0, 4.0):
        p = attn_ext.attention_weights(q, k, scale=1.0 / (tau * 4.0))
        ent.append(-(p * p.clamp_min(1e-300).log()).sum(-1))
    for a, b in zip(ent, ent[1:]):
        assert (b >= a - 1e-12).all()


def test_doc003_convex_hull(device):
    """003: each output lies in the convex hull of the visible values, so every
    coordinate is within the visible values' min and max."""
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, dtype=torch.float64, device=device)
    out = attn_ext.attention(q, k, v, window_size=(3, 0))
    keep = window_keep(16, 16, (3, 0), device=device)
    for i in range(16):
        vis = v[:, :, keep[i]]
        assert (out[:, :, i] >= vis.amin(2) - 1e-12).all()
        assert (out[:, :, i] <= vis.amax(2) + 1e-12).all()


def test_doc003_permutation_equivariance(device):
    """003: without position or mask, permuting the sequence permutes the output."""
    q, k, v = make_qkv(2, 2, 2, 11, 11, 16, dtype=torch.float64, device=device)
    perm = torch.randperm(11, device=device)
    out = attn_ext.attention(q, k, v)
    out_p = attn_ext.attention(q[:, :, perm], k[:, :, perm], v[:, :, perm])
    torch.testing.assert_close(out_p, out[:, :, perm], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DOC_DTYPES)
def test_doc004_grouped_attention_head_mapping(device, dtype):
    """004 GroupedAttention reads KV head h % Hkv (tiling). attn_ext reads
    h // (H // Hkv); reordering the query heads turns one into the other."""
    B, H, Hkv, S, d = 2, 4, 2, 10, 8
    q, k, v = make_qkv(B, H, Hkv, S, S, d, dtype=dtype, device=device)
    G = H // Hkv
    # query head h goes to slot (h % Hkv) * G + h // Hkv, which reads KV head h % Hkv
    slot = torch.tensor([(h % Hkv) * G + h // Hkv for h in range(H)], device=device)
    q_perm = torch.empty_like(q)
    q_perm[:, slot] = q
    out = attn_ext.attention(q_perm, k, v)[:, slot]
    _doc_check(out, doc004_grouped_attention_heads, q, k, v)


def test_one_key_rows_low_precision_grads_fuzz_regression():
    """tests/test_fuzz.py --fuzz (2026-11-29): bf16, every row sees one key (causal with window
    (0, -1)), Dv 29, dropout 0.3, q / k / v expanded over the batch. The reference's dq and dk
    are exactly 0 (P = 1); the kernel's dq was 0.17 (21 bf16 ulps), the rounding of the stored
    output in delta = rowsum(dO * O), as in FlashAttention's backward. stored_output_grad_floors
    bounds that part; the kernel stays within twice it, and the bound matches the error (a
    wrong delta or dS would be far above)."""
    torch.manual_seed(128)
    dt = torch.bfloat16
    q, k, v = (rand((1, 1, s, d), dt, "cpu") for s, d in ((11, 1), (14, 1), (14, 29)))

    def view(x):
        return x.expand(2, *x.shape[1:])

    kw = dict(causal=True, window_size=(0, -1))
    keep = attn_ext.dropout_keep_mask(2, 1, 11, 14, 0.3, torch.Generator().manual_seed(0))

    def ours(q, k, v):
        gen = torch.Generator().manual_seed(0)
        return attn_ext.attention(view(q), view(k), view(v), dropout_p=0.3, generator=gen, **kw)

    def ref(q, k, v):
        return attention_reference(
            view(q), view(k), view(v), dropout_p=0.3, dropout_keep=keep, **kw
        )

    out = ours(q, k, v)
    g = torch.randn(out.shape).to(dt)
    fq, fk = stored_output_grad_floors(view(q), view(k), out, ground_truth(ref, q, k, v), g, **kw)
    floors = [2 * fq.sum(0).max().item(), 2 * fk.sum(0).max().item(), 0.0]
    got = autograd_grads(ours, [q, k, v], g)
    tru = ground_truth_grads(ref, [q, k, v], g)
    for a, r, t, fl in zip(got, autograd_grads(ref, [q, k, v], g), tru, floors):
        assert_error_rule(a, r, t, name="grad", slack_ulps=16.0, floor=fl)
    err_q = (got[0].double() - tru[0]).abs().max().item()
    assert 0.25 * floors[0] <= err_q <= floors[0]
