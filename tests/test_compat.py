"""attn_ext.compat: each drop-in against the document's own code (attn_ext.testing.documents).

For every class: build the document's object and ours with the same arguments, load the
document's state dict into ours with strict=True, and compare the forward output and the
gradients of the inputs and of every parameter, in float64 (tight: both sides are exact up to
rounding, so 1e-10 catches any semantic difference, e.g. a float64 instead of float32 sqrt in the
004 scale) and in float32 (loose: the kernel's blocked online softmax and BLAS tiling round
differently from torch's matmul + softmax; the bound is a few hundred float32 ulps at these
O(1) values). Then: eval-mode determinism, train-mode dropout (exact, with the keep-mask the
kernel applies, and statistically), torch.compile(fullgraph=True) on a few classes, and clear
errors on bad input.
"""

import math

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import attn_ext
import attn_ext.compat.attention_zoo as zoo
import attn_ext.compat.llms_from_scratch as lfs
import attn_ext.compat.textbook as tb
import attn_ext.compat.torchcode as tc
from attn_ext.testing.documents import doc000, doc001, doc003, doc004, plain_state_dict, plain_to

DTYPES = [torch.float64, torch.float32]
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-4, atol=2e-5)}

# --------------------------------------------------------------------------------------------- #
# Cases: (id, document factory, our factory, constructor args, input shapes, plain-class flag)
# --------------------------------------------------------------------------------------------- #
MODULE_CASES = [
    (
        "001.SelfAttention_v1",
        doc001.SelfAttention_v1,
        lfs.SelfAttention_v1,
        (16, 8),
        [(7, 16)],
        False,
    ),
    (
        "001.SelfAttention_v2",
        doc001.SelfAttention_v2,
        lfs.SelfAttention_v2,
        (16, 8),
        [(7, 16)],
        False,
    ),
    (
        "001.CausalAttention",
        doc001.CausalAttention,
        lfs.CausalAttention,
        (16, 8, 12, 0.0),
        [(2, 7, 16)],
        False,
    ),
    (
        "001.CausalAttention.bias",
        doc001.CausalAttention,
        lfs.CausalAttention,
        (16, 8, 12, 0.0, True),
        [(2, 7, 16)],
        False,
    ),
    (
        "001.MultiHeadAttentionWrapper",
        doc001.MultiHeadAttentionWrapper,
        lfs.MultiHeadAttentionWrapper,
        (16, 8, 12, 0.0, 3),
        [(2, 7, 16)],
        False,
    ),
    (
        "001.MultiHeadAttentionWrapper.bias",
        doc001.MultiHeadAttentionWrapper,
        lfs.MultiHeadAttentionWrapper,
        (16, 8, 12, 0.0, 2, True),
        [(2, 7, 16)],
        False,
    ),
    (
        "001.MultiHeadAttention",
        doc001.MultiHeadAttention,
        lfs.MultiHeadAttention,
        (16, 12, 12, 0.0, 3),
        [(2, 7, 16)],
        False,
    ),
    (
        "001.MultiHeadAttention.bias.full",
        doc001.MultiHeadAttention,
        lfs.MultiHeadAttention,
        (16, 12, 7, 0.0, 3, True),
        [(2, 7, 16)],
        False,
    ),
    (
        "000.MultiHeadAttention",
        doc000.MultiHeadAttention,
        tc.MultiHeadAttention,
        (16, 4),
        [(2, 7, 16), (2, 5, 16), (2, 5, 16)],
        True,
    ),
    (
        "000.MultiHeadCrossAttention",
        doc000.MultiHeadCrossAttention,
        tc.MultiHeadCrossAttention,
        (16, 4),
        [(2, 7, 16), (2, 5, 16)],
        False,
    ),
    (
        "000.GroupQueryAttention",
        doc000.GroupQueryAttention,
        tc.GroupQueryAttention,
        (16, 8, 2),
        [(2, 7, 16)],
        True,
    ),
    (
        "000.GroupQueryAttention.mqa",
        doc000.GroupQueryAttention,
        tc.GroupQueryAttention,
        (16, 4, 1),
        [(2, 7, 16)],
        True,
    ),
    ("004.SelfAttention", doc004.SelfAttention, zoo.SelfAttention, (16, 6), [(2, 7, 16)], False),
    ("004.SelfAttention.2d", doc004.SelfAttention, zoo.SelfAttention, (16, 6), [(7, 16)], False),
    (
        "004.SelfAttention.4d",
        doc004.SelfAttention,
        zoo.SelfAttention,
        (16, 6),
        [(2, 3, 7, 16)],
        False,
    ),
    (
        "004.MultiHeadAttention",
        doc004.MultiHeadAttention,
        zoo.MultiHeadAttention,
        (16, 4, 24),
        [(2, 7, 16)],
        False,
    ),
    (
        "004.CrossAttention",
        doc004.CrossAttention,
        zoo.CrossAttention,
        (16, 6),
        [(2, 7, 16), (2, 5, 16)],
        False,
    ),
    (
        "004.CrossAttention.broadcast",
        doc004.CrossAttention,
        zoo.CrossAttention,
        (16, 6),
        [(2, 7, 16), (1, 5, 16)],
        False,
    ),
    (
        "004.GroupedAttention.g2",
        doc004.GroupedAttention,
        zoo.GroupedAttention,
        (16, 24, 6, 2),
        [(2, 7, 16)],
        False,
    ),
    (
        "004.GroupedAttention.g3",
        doc004.GroupedAttention,
        zoo.GroupedAttention,
        (16, 24, 6, 3),
        [(3, 7, 16)],
        False,
    ),
    (
        "004.GroupedAttention.g1",
        doc004.GroupedAttention,
        zoo.GroupedAttention,
        (16, 24, 6, 1),
        [(2, 7, 16)],
        False,
    ),
    (
        "004.GroupedAttention.g6",
        doc004.GroupedAttention,
        zoo.GroupedAttention,
        (16, 24, 6, 6),
        [(2, 7, 16)],
        False,
    ),
]
CASE_IDS = [c[0] for c in MODULE_CASES]
CASES = dict((c[0], c) for c in MODULE_CASES)


def _doc_params(doc, plain):
    return plain_state_dict(doc) if plain else dict(doc.named_parameters())


def build(case_id, device, dtype, args=None):
    """The document's object and ours, ours loaded strictly from the document's state dict.
    Ours is constructed after the document's, so its random initialization differs: only the
    load makes the two agree."""
    _, doc_cls, our_cls, default_args, _, plain = CASES[case_id]
    args = default_args if args is None else args
    doc = doc_cls(*args)
    doc = plain_to(doc, device, dtype) if plain else doc.to(device=device, dtype=dtype)
    ours = our_cls(*args).to(device=device, dtype=dtype)
    state = plain_state_dict(doc) if plain else doc.state_dict()
    ours.load_state_dict(state, strict=True)
    return doc, ours


def make_inputs(case_id, device, dtype, requires_grad=True):
    shapes = CASES[case_id][4]
    xs = [(0.5 * torch.randn(s, dtype=dtype, device=device)) for s in shapes]
    return [x.requires_grad_(requires_grad) for x in xs]


def _clone(xs):
    return [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]


def assert_same_forward_backward(doc_fn, our_fn, inputs, doc_params, our_params, dtype):
    """Forward outputs, gradients of the inputs and of every parameter (matched by name)."""
    xd, xo = _clone(inputs), _clone(inputs)
    out_d, out_o = doc_fn(*xd), our_fn(*xo)
    assert out_o.shape == out_d.shape and out_o.dtype == out_d.dtype
    torch.testing.assert_close(out_o, out_d, **TOL[dtype])
    g = torch.randn_like(out_d)
    out_d.backward(g)
    out_o.backward(g)
    for i, (a, b) in enumerate(zip(xo, xd)):
        if b.requires_grad:
            assert a.grad is not None and b.grad is not None, f"input {i} has no gradient"
            torch.testing.assert_close(
                a.grad, b.grad, **TOL[dtype], msg=lambda m, i=i: f"input {i}: {m}"
            )
    assert set(our_params) == set(doc_params)
    for name, p in doc_params.items():
        q = our_params[name]
        assert q.grad is not None and p.grad is not None, f"parameter {name} has no gradient"
        torch.testing.assert_close(
            q.grad, p.grad, **TOL[dtype], msg=lambda m, name=name: f"parameter {name}: {m}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_module_matches_document(case_id, dtype, device):
    doc, ours = build(case_id, device, dtype)
    plain = CASES[case_id][5]
    assert_same_forward_backward(
        doc.forward,
        ours.forward,
        make_inputs(case_id, device, dtype),
        _doc_params(doc, plain),
        dict(ours.named_parameters()),
        dtype,
    )


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_state_dict_layout_matches_document(case_id):
    """Same keys, shapes and dtypes both ways (ours -> document loads strictly as well)."""
    doc, ours = build(case_id, "cpu", torch.float32)
    plain = CASES[case_id][5]
    theirs = plain_state_dict(doc) if plain else doc.state_dict()
    mine = ours.state_dict()
    assert list(mine) == list(theirs)
    for k in theirs:
        assert mine[k].shape == theirs[k].shape and mine[k].dtype == theirs[k].dtype, k
    if not plain:
        doc.load_state_dict(mine, strict=True)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_eval_mode_is_deterministic(case_id, device):
    _, ours = build(case_id, device, torch.float32)
    ours.eval()
    xs = make_inputs(case_id, device, torch.float32, requires_grad=False)
    with torch.no_grad():
        a, b = ours(*xs), ours(*xs)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------- #
# Functions
# --------------------------------------------------------------------------------------------- #
def _qkv(shapes, device, dtype):
    return [torch.randn(s, dtype=dtype, device=device, requires_grad=True) for s in shapes]


FUNCTION_CASES = [
    (
        "000.sdpa.3d",
        doc000.scaled_dot_product_attention,
        tc.scaled_dot_product_attention,
        [(2, 7, 8), (2, 9, 8), (2, 9, 5)],
        {},
    ),
    (
        "000.sdpa.4d",
        doc000.scaled_dot_product_attention,
        tc.scaled_dot_product_attention,
        [(2, 3, 7, 8), (2, 3, 9, 8), (2, 3, 9, 5)],
        {},
    ),
    (
        "000.sdpa.2d",
        doc000.scaled_dot_product_attention,
        tc.scaled_dot_product_attention,
        [(7, 8), (9, 8), (9, 5)],
        {},
    ),
    (
        "000.sdpa.5d.broadcast",
        doc000.scaled_dot_product_attention,
        tc.scaled_dot_product_attention,
        [(2, 2, 3, 7, 8), (1, 2, 3, 9, 8), (2, 2, 3, 9, 5)],
        {},
    ),
    ("000.causal.square", doc000.causal_attention, tc.causal_attention, [(2, 3, 9, 8)] * 3, {}),
    (
        "000.causal.sq<sk",
        doc000.causal_attention,
        tc.causal_attention,
        [(2, 6, 8), (2, 9, 8), (2, 9, 4)],
        {},
    ),
    (
        "000.causal.sq>sk",
        doc000.causal_attention,
        tc.causal_attention,
        [(2, 9, 8), (2, 6, 8), (2, 6, 4)],
        {},
    ),
    (
        "000.sliding.w0",
        doc000.sliding_window_attention,
        tc.sliding_window_attention,
        [(2, 9, 8)] * 3,
        dict(window_size=0),
    ),
    (
        "000.sliding.w2",
        doc000.sliding_window_attention,
        tc.sliding_window_attention,
        [(2, 9, 8), (2, 9, 8), (2, 9, 5)],
        dict(window_size=2),
    ),
    (
        "000.sliding.wide",
        doc000.sliding_window_attention,
        tc.sliding_window_attention,
        [(2, 9, 8)] * 3,
        dict(window_size=20),
    ),
    (
        "000.flash",
        doc000.flash_attention,
        tc.flash_attention,
        [(2, 37, 8)] * 3,
        dict(block_size=16),
    ),
    ("000.flash.default_block", doc000.flash_attention, tc.flash_attention, [(2, 9, 8)] * 3, {}),
    (
        "001.simplified",
        doc001.simplified_self_attention,
        lfs.simplified_self_attention,
        [(6, 3)],
        {},
    ),
    (
        "003.attention.nomask",
        doc003.attention,
        tb.attention,
        [(2, 3, 7, 8), (2, 3, 9, 8), (2, 3, 9, 5)],
        {},
    ),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FUNCTION_CASES, ids=[c[0] for c in FUNCTION_CASES])
def test_function_matches_document(case, dtype, device):
    _, doc_fn, our_fn, shapes, kw = case
    xs = _qkv(shapes, device, dtype)
    assert_same_forward_backward(
        lambda *a: doc_fn(*a, **kw), lambda *a: our_fn(*a, **kw), xs, {}, {}, dtype
    )


def test_simplified_self_attention_document_example():
    """The document's six-token example; its printed context vector for "journey" row."""
    inputs = torch.tensor(
        [
            [0.43, 0.15, 0.89],
            [0.55, 0.87, 0.66],
            [0.57, 0.85, 0.64],
            [0.22, 0.58, 0.33],
            [0.77, 0.25, 0.10],
            [0.05, 0.80, 0.55],
        ]
    )
    out = lfs.simplified_self_attention(inputs)
    torch.testing.assert_close(out[1], torch.tensor([0.4419, 0.6515, 0.5683]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out, doc001.simplified_self_attention(inputs), atol=1e-6, rtol=1e-5)


def test_sliding_window_zero_returns_v(device):
    Q = K = V = torch.randn(1, 8, 16, device=device)
    torch.testing.assert_close(
        tc.sliding_window_attention(Q, K, V, window_size=0), V, atol=1e-6, rtol=0
    )


def test_flash_attention_block_size_does_not_change_result(device):
    Q, K, V = (torch.randn(2, 50, 8, device=device, dtype=torch.float64) for _ in range(3))
    a = tc.flash_attention(Q, K, V, block_size=7)
    torch.testing.assert_close(a, tc.flash_attention(Q, K, V, block_size=64), rtol=0, atol=1e-14)
    torch.testing.assert_close(
        a, doc000.flash_attention(Q, K, V, block_size=7), rtol=1e-10, atol=1e-10
    )


MASK_LAYOUTS = {  # q shape, mask shape (k: Tk = 9, Dh = 8; v: Dv = 5)
    "4d.head_broadcast": ((2, 3, 7, 8), (2, 1, 7, 9)),
    "4d.full": ((2, 3, 7, 8), (2, 3, 7, 9)),
    "3d.2d_mask": ((2, 7, 8), (7, 9)),
    "5d.2d_mask": ((2, 2, 3, 7, 8), (7, 9)),
}


@pytest.mark.parametrize("layout", list(MASK_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_textbook_attention_mask_matches_document(layout, dtype, device):
    """bool mask (True = visible), broadcast, including one fully masked row (the document's
    finfo.min fill gives that row uniform weights, i.e. the mean of v)."""
    qs, ms = MASK_LAYOUTS[layout]
    q, k, v = _qkv([qs, qs[:-2] + (9, 8), qs[:-2] + (9, 5)], device, dtype)
    mask = torch.rand(ms, device=device) > 0.4
    mask[..., 0] = True
    empty_row = (0,) * (len(ms) - 2) + (2,)
    mask[empty_row] = False  # a row with no visible key
    assert_same_forward_backward(
        lambda *a: doc003.attention(*a, mask=mask),
        lambda *a: tb.attention(*a, mask=mask),
        [q, k, v],
        {},
        {},
        dtype,
    )
    out = tb.attention(q, k, v, mask)
    empty = (~mask.any(-1)).expand(out.shape[:-1])
    assert empty.any()
    torch.testing.assert_close(
        out[empty], v.mean(-2, keepdim=True).expand_as(out)[empty], **TOL[dtype]
    )


def test_textbook_repeat_kv(device):
    x = torch.randn(2, 3, 5, 4, device=device)
    for n in (1, 2, 4):
        r = tb.repeat_kv(x, n)
        assert torch.equal(r, doc003.repeat_kv(x, n))
        assert r.shape == (2, 3 * n, 5, 4)
        assert torch.equal(r[:, n * 2 + n - 1], x[:, 2])  # head h of the result is head h // n
    assert tb.repeat_kv(x, 1) is x


def test_textbook_repeat_kv_agrees_with_grouped_attention(device):
    q = torch.randn(2, 6, 7, 8, device=device, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 8, device=device, dtype=torch.float64)
    v = torch.randn(2, 2, 9, 8, device=device, dtype=torch.float64)
    torch.testing.assert_close(
        tb.attention(q, tb.repeat_kv(k, 3), tb.repeat_kv(v, 3)),
        attn_ext.attention(q, k, v),
        rtol=1e-12,
        atol=1e-12,
    )


# --------------------------------------------------------------------------------------------- #
# Document-specific semantics
# --------------------------------------------------------------------------------------------- #
def test_grouped_attention_keeps_document_head_mapping_at_batch_one(device):
    """At batch size 1 the document's literal code is right: ours must equal it exactly, which
    pins the head mapping h -> h % (num_heads // num_groups)."""
    lit = doc004.GroupedAttentionLiteral(16, 24, 6, 3).to(device=device, dtype=torch.float64)
    ours = zoo.GroupedAttention(16, 24, 6, 3).to(device=device, dtype=torch.float64)
    ours.load_state_dict(lit.state_dict(), strict=True)
    x = torch.randn(1, 7, 16, device=device, dtype=torch.float64)
    torch.testing.assert_close(ours(x), lit(x), rtol=1e-10, atol=1e-10)


def test_grouped_attention_does_not_copy_document_batch_bug(device):
    """batch_size == num_groups: the literal document code runs but mixes batch elements;
    ours agrees with the corrected reference, and each batch element is independent."""
    lit = doc004.GroupedAttentionLiteral(16, 24, 6, 2).to(device=device, dtype=torch.float64)
    ours = zoo.GroupedAttention(16, 24, 6, 2).to(device=device, dtype=torch.float64)
    ours.load_state_dict(lit.state_dict(), strict=True)
    x = torch.randn(2, 7, 16, device=device, dtype=torch.float64)
    out = ours(x)
    assert (out - lit(x)).abs().max() > 1e-3
    torch.testing.assert_close(out[1:], ours(x[1:]), rtol=1e-10, atol=1e-10)


def test_document_004_scale_is_float32_sqrt():
    """head_dim 6: 1/sqrt(6) in float64 vs the document's float32 sqrt differ by ~1e-8 relative;
    the float64 module comparison (1e-10) would fail on the wrong one. Here: it really differs."""
    assert abs(math.sqrt(6) - float(torch.sqrt(torch.tensor(6).float()))) > 1e-8
    from attn_ext.compat import _float32_sqrt

    assert _float32_sqrt(6) == float(torch.sqrt(torch.tensor(6).float()))


def test_document_004_scale_is_torchs_float32_sqrt_for_every_head_size():
    """The drop-ins' scale is the number the document's torch.sqrt gives in this process, not
    the correctly rounded float32 sqrt: MKL's float32 sqrt is one ulp off for some n (on this
    CPU's code path or another's), which moved CrossAttention's float64 results by 1e-7 x
    the 1e-10 bound (the CI failure of test_fuzz_compat_modules, D = 19)."""
    from attn_ext.compat import _float32_sqrt

    n = torch.arange(1, 4097)
    want = torch.sqrt(n.float()).tolist()
    assert [_float32_sqrt(i) for i in range(1, 4097)] == want


@pytest.mark.parametrize("mkl_cbwr", ["COMPATIBLE", "AVX2"])
def test_cross_attention_float64_with_mkl_code_path(mkl_cbwr):
    """Regression (CI: test_fuzz_compat_modules, CrossAttention(1, 19), float64, seed 0): under
    MKL's SSE/AVX code path (MKL_CBWR=COMPATIBLE, as on the CI machine) torch's float32 sqrt(19)
    is one ulp below the correctly rounded one that the drop-in used; the float64 output was
    1.5e-9 off the document's (bound 1.2e-10). A fresh process: MKL picks its path at load."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from attn_ext.compat import attention_zoo\n"
        "from attn_ext.testing.documents import doc004\n"
        "from attn_ext.testing.selfcheck_compat import CompatCase, run_compat_case\n"
        "case = CompatCase('CrossAttention', doc004.CrossAttention, attention_zoo.CrossAttention,"
        " ((1, 1, 1), (1, 2, 1)), args=(1, 19))\n"
        "r = run_compat_case(case, torch.device('cpu'), torch.float64, seed=0)\n"
        "assert r.ok, r.errors\n"
    )
    env = dict(os.environ, MKL_CBWR=mkl_cbwr)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_causal_buffer_kept(device):
    doc, ours = build("001.MultiHeadAttention", device, torch.float32)
    assert torch.equal(ours.mask, doc.mask) and ours.mask.shape == (12, 12)
    assert "mask" in dict(ours.named_buffers())


# --------------------------------------------------------------------------------------------- #
# Dropout
# --------------------------------------------------------------------------------------------- #
class _KeepMaskDropout(nn.Module):
    """Stands in for the document's nn.Dropout: applies a given keep-mask with 1/(1-p)."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, w):
        return w * self.keep.view(w.shape).to(w.dtype) / (1.0 - self.p)


@pytest.mark.parametrize(
    "case_id,heads", [("001.CausalAttention", 1), ("001.MultiHeadAttention", 3)]
)
def test_train_mode_dropout_is_the_kernels_keep_mask(case_id, heads, device):
    """Exact: the document's module with its dropout replaced by the keep-mask that attn_ext
    applies for the same RNG state must give our train-mode output and gradients."""
    p = 0.3
    args = CASES[case_id][3][:3] + (p,) + CASES[case_id][3][4:]
    doc, ours = build(case_id, device, torch.float64, args=args)
    doc.train(), ours.train()
    x = make_inputs(case_id, device, torch.float64)[0]
    B, S = x.shape[0], x.shape[1]
    torch.manual_seed(1234)
    keep = attn_ext.dropout_keep_mask(B, heads, S, S, p).to(device)
    assert 0 < keep.sum() < keep.numel()
    doc.dropout = _KeepMaskDropout(keep, p)

    def ours_seeded(*a):
        torch.manual_seed(1234)
        return ours(*a)

    assert_same_forward_backward(
        doc.forward,
        ours_seeded,
        [x],
        dict(doc.named_parameters()),
        dict(ours.named_parameters()),
        torch.float64,
    )


def test_textbook_dropout_is_the_kernels_keep_mask(device):
    p = 0.25
    q, k, v = _qkv([(2, 3, 7, 8), (2, 3, 9, 8), (2, 3, 9, 5)], device, torch.float64)
    torch.manual_seed(99)
    keep = attn_ext.dropout_keep_mask(2, 3, 7, 9, p).to(device)
    torch.manual_seed(99)
    out = tb.attention(q, k, v, dropout_p=p, training=True)
    w = doc003.attention(q, k, torch.eye(9, device=device, dtype=torch.float64).expand(2, 3, 9, 9))
    torch.testing.assert_close(out, (w * keep / (1 - p)) @ v, rtol=1e-10, atol=1e-10)
    # training=False: no dropout at all, whatever dropout_p says
    torch.testing.assert_close(
        tb.attention(q, k, v, dropout_p=p, training=False),
        doc003.attention(q, k, v),
        rtol=1e-10,
        atol=1e-10,
    )


def test_dropout_statistics(device):
    """With v = identity the output *is* the dropped-out probability matrix: the dropped
    fraction is p and the kept entries are the probabilities scaled by 1/(1-p)."""
    p, S = 0.4, 64
    q = torch.randn(4, 2, S, 16, device=device, dtype=torch.float64)
    k = torch.randn(4, 2, S, 16, device=device, dtype=torch.float64)
    eye = torch.eye(S, device=device, dtype=torch.float64).expand(4, 2, S, S)
    probs = tb.attention(q, k, eye)
    dropped = tb.attention(q, k, eye, dropout_p=p, training=True)
    kept = dropped != 0
    frac = 1 - kept.double().mean().item()
    n = kept.numel()
    assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / n), frac
    torch.testing.assert_close(dropped[kept], probs[kept] / (1 - p), rtol=1e-10, atol=1e-12)
    # a second call draws a new mask
    assert not torch.equal(kept, tb.attention(q, k, eye, dropout_p=p, training=True) != 0)


@pytest.mark.parametrize(
    "case_id", ["001.CausalAttention", "001.MultiHeadAttentionWrapper", "001.MultiHeadAttention"]
)
def test_module_dropout_train_vs_eval(case_id, device):
    """Train mode: random, unbiased (mean over draws -> eval output); eval: no dropout, equal to
    the document's module in eval mode."""
    p = 0.5
    args = CASES[case_id][3][:3] + (p,) + CASES[case_id][3][4:]
    doc, ours = build(case_id, device, torch.float64, args=args)
    x = make_inputs(case_id, device, torch.float64, requires_grad=False)[0]
    doc.eval(), ours.eval()
    ref = doc(x)
    torch.testing.assert_close(ours(x), ref, rtol=1e-10, atol=1e-10)
    ours.train()
    with torch.no_grad():
        draws = torch.stack([ours(x) for _ in range(200)])
    assert not torch.equal(draws[0], draws[1])
    err = (draws.mean(0) - ref).abs().max().item()
    spread = draws.std(0).max().item() / math.sqrt(draws.size(0))
    assert err < 6 * spread + 1e-12, (err, spread)


def test_dropout_one_drops_everything(device):
    doc, ours = build("001.MultiHeadAttention", device, torch.float64, args=(16, 12, 12, 1.0, 3))
    doc.train(), ours.train()
    x = make_inputs("001.MultiHeadAttention", device, torch.float64, requires_grad=False)[0]
    torch.testing.assert_close(ours(x), doc(x), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------- #
# torch.compile
# --------------------------------------------------------------------------------------------- #
# Inductor for the flagship class (about 12 s on a 2-core CPU); aot_eager (the same dynamo
# capture with fullgraph=True and the same AOT-autograd trace through the fake kernels, without
# code generation) for the others, to keep the suite short.
@pytest.mark.parametrize(
    "case_id,backend",
    [
        ("001.MultiHeadAttention", "inductor"),
        ("004.GroupedAttention.g2", "aot_eager"),
        ("000.GroupQueryAttention", "aot_eager"),
        ("001.MultiHeadAttentionWrapper", "aot_eager"),
    ],
)
def test_compile_fullgraph(case_id, backend, device):
    torch._dynamo.reset()
    _, ours = build(case_id, device, torch.float32)
    xs = make_inputs(case_id, device, torch.float32)
    compiled = torch.compile(ours, fullgraph=True, backend=backend)
    out_c = compiled(*_clone(xs))
    out_e = ours(*_clone(xs))
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    out_c.sum().backward()
    assert all(p.grad is not None for p in ours.parameters())
    torch._dynamo.reset()


def test_compile_fullgraph_train_mode_dropout(device):
    """Dropout in a compiled graph: same seed, same mask as eager (the seed is drawn from torch's
    default generator inside the graph)."""
    torch._dynamo.reset()
    _, ours = build("001.MultiHeadAttention", device, torch.float32, args=(16, 12, 12, 0.3, 3))
    x = torch.randn(2, 7, 16, device=device)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    a = compiled(x)
    torch.manual_seed(5)
    b = ours(x)
    torch.manual_seed(6)
    c = ours(x)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(b, c)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------- #
# Low precision: error against a float64 ground truth at most the document's own error (x2)
# --------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "case_id", ["001.MultiHeadAttention", "000.GroupQueryAttention", "004.GroupedAttention.g3"]
)
def test_low_precision_error_rule(case_id, dtype, device):
    doc, ours = build(case_id, device, torch.float64)
    plain = CASES[case_id][5]
    xs = make_inputs(case_id, device, torch.float64, requires_grad=False)
    with torch.no_grad():
        truth = doc.forward(*xs)
        doc = plain_to(doc, device, dtype) if plain else doc.to(dtype)
        ours = ours.to(dtype)
        low = [x.to(dtype) for x in xs]
        err_doc = (doc.forward(*low).double() - truth).abs().max().item()
        out = ours(*low)
        assert out.dtype == dtype
        err_ours = (out.double() - truth).abs().max().item()
    assert err_ours <= 2 * err_doc + 1e-6, (err_ours, err_doc)


# --------------------------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "case_id",
    [
        c
        for c in CASE_IDS
        if not c.startswith("004.SelfAttention") and not c.startswith("004.CrossAttention")
    ],
)
def test_wrong_rank_is_a_clear_error(case_id):
    _, ours = build(case_id, "cpu", torch.float32)
    xs = make_inputs(case_id, "cpu", torch.float32, requires_grad=False)
    bad = [xs[0].unsqueeze(0)] + xs[1:]
    with pytest.raises(ValueError, match=r"expected a .*-D input"):
        ours(*bad)
    bad = [xs[0][0]] + xs[1:]
    with pytest.raises(ValueError, match=r"expected a .*-D input"):
        ours(*bad)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_wrong_embed_dim_is_a_clear_error(case_id):
    _, ours = build(case_id, "cpu", torch.float32)
    xs = make_inputs(case_id, "cpu", torch.float32, requires_grad=False)
    bad = [torch.randn(*xs[-1].shape[:-1], xs[-1].shape[-1] + 1)]
    with pytest.raises(ValueError, match=r"must have last dimension 16"):
        ours(*(xs[:-1] + bad))


def test_zoo_rank_one_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 2-D"):
        zoo.SelfAttention(16, 6)(torch.randn(16))
    with pytest.raises(ValueError, match="at least 2-D"):
        zoo.CrossAttention(16, 6)(torch.randn(3, 16), torch.randn(16))


@pytest.mark.parametrize(
    "case_id",
    [
        "001.CausalAttention",
        "001.MultiHeadAttention",
        "001.MultiHeadAttentionWrapper",
        "000.MultiHeadCrossAttention",
        "004.GroupedAttention.g2",
    ],
)
def test_state_dict_missing_or_extra_keys(case_id):
    doc, ours = build(case_id, "cpu", torch.float32)
    state = doc.state_dict()
    missing = dict(state)
    missing.pop(next(iter(missing)))
    with pytest.raises(RuntimeError, match="Missing key"):
        ours.load_state_dict(missing, strict=True)
    extra = dict(state, bogus=torch.zeros(1))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        ours.load_state_dict(extra, strict=True)
    wrong = dict(state)
    k0 = next(iter(wrong))
    wrong[k0] = torch.zeros(*wrong[k0].shape[:-1], wrong[k0].shape[-1] + 1)
    with pytest.raises(RuntimeError, match="size mismatch"):
        ours.load_state_dict(wrong, strict=True)


def test_mask_buffer_is_required_for_strict_loading():
    doc, ours = build("001.MultiHeadAttention", "cpu", torch.float32)
    state = {k: v for k, v in doc.state_dict().items() if k != "mask"}
    with pytest.raises(RuntimeError, match="Missing key.*mask"):
        ours.load_state_dict(state, strict=True)


@pytest.mark.parametrize(
    "case_id", ["001.CausalAttention", "001.MultiHeadAttention", "001.MultiHeadAttentionWrapper"]
)
def test_sequence_longer_than_context_length(case_id):
    _, ours = build(case_id, "cpu", torch.float32)
    ours(torch.randn(2, 12, 16))  # exactly context_length is fine
    with pytest.raises(ValueError, match=r"13 tokens, more than context_length = 12"):
        ours(torch.randn(2, 13, 16))


def test_function_bad_inputs():
    x3 = torch.randn(2, 9, 8)
    with pytest.raises(ValueError, match="non-negative integer"):
        tc.sliding_window_attention(x3, x3, x3, -1)
    with pytest.raises(ValueError, match="same sequence length"):
        tc.sliding_window_attention(x3, torch.randn(2, 8, 8), torch.randn(2, 8, 8), 2)
    with pytest.raises(ValueError, match="expected a 3-D input"):
        tc.sliding_window_attention(x3[None], x3[None], x3[None], 2)
    with pytest.raises(ValueError, match="positive integer"):
        tc.flash_attention(x3, x3, x3, block_size=0)
    with pytest.raises(ValueError, match="expected a 3-D input"):
        tc.flash_attention(x3[None], x3[None], x3[None])
    with pytest.raises(ValueError, match="feature sizes differ"):
        tc.scaled_dot_product_attention(x3, torch.randn(2, 9, 7), x3)
    with pytest.raises(ValueError, match="feature sizes differ"):
        tc.causal_attention(x3, torch.randn(2, 9, 7), x3)
    with pytest.raises(ValueError, match="key and value lengths differ"):
        tc.scaled_dot_product_attention(x3, x3, torch.randn(2, 8, 8))
    with pytest.raises(ValueError, match="do not broadcast"):
        tc.scaled_dot_product_attention(x3, torch.randn(3, 9, 8), torch.randn(3, 9, 8))
    with pytest.raises(ValueError, match="expected a 2-D input"):
        lfs.simplified_self_attention(x3)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        tb.attention(x3, x3, x3, mask=torch.ones(9, 9))
    with pytest.raises(ValueError, match="repeat_kv: x must be 4-D"):
        tb.repeat_kv(x3, 2)
    with pytest.raises(ValueError, match="same sequence length|K and V"):
        tc.MultiHeadAttention(8, 2)(x3, x3, torch.randn(2, 5, 8))
