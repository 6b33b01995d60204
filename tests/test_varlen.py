"""attn_ext.attention_varlen (FlashAttention's varlen layout) and the score modifiers
(softcap, ALiBi, attention sinks) of attention / attention_varlen, against the references of
attn_ext/testing/attention.py: attention_reference, and attention_varlen_reference, which
loops attention_reference over the sequences.

Numerics rule as in test_attention.py: error against the float64 truth at most twice the
plain reference's at the input dtype, plus one rounding unit (float64: ~1e-10).
"""

import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import attn_ext
from attn_ext.testing.attention import (
    assert_paged_like_packed,
    attention_reference,
    attention_varlen_reference,
    paged_varlen_kv,
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
)

ops = torch.ops.attn_ext


DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in ALL_DTYPES]

# Sequence lengths (q, k): empty sequences, one token, Sq != Sk both ways, many short + one
# long (the shape that needs dynamic scheduling), and a batch with no tokens at all.
LENGTHS = {
    "mixed": ([5, 0, 17, 1, 130], [5, 3, 17, 1, 130]),
    "cross": ([3, 70, 40], [50, 70, 41]),
    "short_and_long": ([2, 3, 1, 4, 2, 3, 200], [2, 3, 1, 4, 2, 3, 200]),
    "all_empty_q": ([0, 0], [4, 0]),
}
# Option sets: (name, attention kwargs, alibi kind, with sinks)
OPTIONS = [
    ("plain", {}, None, False),
    ("causal", dict(causal=True), None, False),
    ("window", dict(window_size=(7, 3)), None, False),
    ("causal_window_softcap", dict(causal=True, window_size=(16, -1), softcap=5.0), None, False),
    ("alibi_per_head", dict(causal=True), "head", False),
    ("alibi_per_batch", {}, "batch", False),
    ("sinks", dict(causal=True), None, True),
    ("everything", dict(causal=True, window_size=(9, -1), softcap=3.0), "batch", True),
]


def cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


def varlen_inputs(lens_q, lens_k, H, Hkv, D, Dv, dtype, device, option, grad=False):
    name, kw, alibi, with_sinks = option
    q = torch.randn(sum(lens_q), H, D, device=device).to(dtype)
    k = torch.randn(sum(lens_k), Hkv, D, device=device).to(dtype)
    v = torch.randn(sum(lens_k), Hkv, Dv, device=device).to(dtype)
    kw = dict(kw)
    if alibi == "head":
        kw["alibi_slopes"] = torch.rand(H, device=device) * 0.5
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(len(lens_q), H, device=device) * 0.5
    sinks = torch.randn(H, device=device).to(dtype) if with_sinks else None
    tensors = [q, k, v] + ([sinks] if with_sinks else [])
    if grad:
        for t in tensors:
            t.requires_grad_(True)
    return tensors, kw


def _split(tensors):
    q, k, v, *rest = tensors
    return q, k, v, (rest[0] if rest else None)


# --------------------------------------------------------------------------- #
# varlen against the per-sequence reference
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("option", OPTIONS, ids=[o[0] for o in OPTIONS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_forward(device, dtype, option, lengths):
    lens_q, lens_k = LENGTHS[lengths]
    tensors, kw = varlen_inputs(lens_q, lens_k, 4, 2, 32, 24, dtype, device, option)
    q, k, v, sinks = _split(tensors)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    args = (q, k, v, cq, ck)
    out, lse = attn_ext.attention_varlen(
        *args, max(lens_q), max(lens_k), sinks=sinks, return_lse=True, **kw
    )
    ref, ref_lse = attention_varlen_reference(*args, sinks=sinks, return_lse=True, **kw)
    tru, tru_lse = ground_truth(
        attention_varlen_reference, *args, sinks=sinks, return_lse=True, **kw
    )
    assert out.shape == (sum(lens_q), 4, 24) and out.dtype == dtype
    assert lse.shape == (4, sum(lens_q))
    assert_error_rule(out, ref, tru, name="out")
    assert_lse_close(lse, ref_lse, tru_lse)


@pytest.mark.parametrize("lengths", ["mixed", "short_and_long"])
@pytest.mark.parametrize("option", OPTIONS, ids=[o[0] for o in OPTIONS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_backward(device, dtype, option, lengths):
    lens_q, lens_k = LENGTHS[lengths]
    tensors, kw = varlen_inputs(lens_q, lens_k, 4, 2, 32, 24, dtype, device, option)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    mq, mk = max(lens_q), max(lens_k)

    def ours(q, k, v, sinks=None):
        out, lse = attn_ext.attention_varlen(
            q, k, v, cq, ck, mq, mk, sinks=sinks, return_lse=True, **kw
        )
        return out, lse

    def ref(q, k, v, sinks=None):
        return attention_varlen_reference(q, k, v, cq, ck, sinks=sinks, return_lse=True, **kw)

    # The loss reads lse too, so its gradient path (grad_lse) is checked as well.
    g = torch.randn(sum(lens_q), 4, 24, device=device).to(dtype)
    g_lse = torch.randn(4, sum(lens_q), device=device)

    def loss(fn):
        def f(*xs):
            out, lse = fn(*xs)
            return (out * g.to(out.dtype)).sum() + (lse * g_lse.to(lse.dtype)).sum()

        return f

    got = autograd_grads(loss(ours), tensors, torch.tensor(1.0))
    reference = autograd_grads(loss(ref), tensors, torch.tensor(1.0))
    truth = ground_truth_grads(loss(ref), tensors, torch.tensor(1.0))
    names = ("dq", "dk", "dv", "dsinks")
    for name, x, a, r, t in zip(names, tensors, got, reference, truth):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        # The loss sums ~total_q * H terms of lse, so its rounding grows with them: slack in
        # units of the summed magnitude, not of one element.
        assert_error_rule(a, r, t, name=name, slack_ulps=4 * grad_slack_ulps(a.dtype))


@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_varlen_head_dims_and_mqa(device, head_dim):
    lens = [3, 40, 0, 9]
    opt = ("causal_alibi", dict(causal=True), "head", True)
    tensors, kw = varlen_inputs(lens, lens, 6, 1, head_dim, head_dim, torch.float32, device, opt)
    q, k, v, sinks = _split(tensors)
    args = (q, k, v, cu(lens, device), cu(lens, device))
    out = attn_ext.attention_varlen(*args, 40, 40, sinks=sinks, **kw)
    ref = attention_varlen_reference(*args, sinks=sinks, **kw)
    tru = ground_truth(attention_varlen_reference, *args, sinks=sinks, **kw)
    assert_error_rule(out, ref, tru)


def test_varlen_equals_padded_attention(device):
    """Each sequence of a varlen batch gives what attention gives that sequence alone, and
    strided (B, S, H, D)-style views are read in place. Not bit for bit: the CPU kernel picks
    its block products from the longest sequence (packed panels) where a short sequence alone
    goes through BLAS, so the float32 sums differ in order (a few ulps)."""
    lens = [7, 33, 1]
    wide = torch.randn(sum(lens), 4, 2 * 32, device=device)
    q = wide[..., :32]  # last dim contiguous, token stride 64
    k = torch.randn(sum(lens), 2, 32, device=device)
    v = torch.randn(sum(lens), 2, 32, device=device)
    c = cu(lens, device)
    out = attn_ext.attention_varlen(q, k, v, c, c, 33, 33, causal=True, softcap=4.0)
    for b in range(len(lens)):
        s = slice(int(c[b]), int(c[b + 1]))
        one = attn_ext.attention(
            *(x[s].transpose(0, 1).unsqueeze(0) for x in (q, k, v)), causal=True, softcap=4.0
        )
        torch.testing.assert_close(out[s], one[0].transpose(0, 1), rtol=1e-5, atol=2e-6)


def test_varlen_dropout_matches_its_keep_mask(device):
    """Dropout's keep mask is keyed by (head, token, key in the sequence): dropout_mask over
    (1, H, total_q, max_seqlen_k) reproduces it, and the same generator state gives the same
    output."""
    lens = [5, 12, 3]
    opt = ("drop", dict(causal=True), None, False)
    (q, k, v), kw = varlen_inputs(lens, lens, 4, 2, 16, 16, torch.float64, device, opt)
    c = cu(lens, device)
    p = 0.3
    out = attn_ext.attention_varlen(
        q, k, v, c, c, 12, 12, dropout_p=p, generator=torch.Generator().manual_seed(5), **kw
    )
    again = attn_ext.attention_varlen(
        q, k, v, c, c, 12, 12, dropout_p=p, generator=torch.Generator().manual_seed(5), **kw
    )
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    keep = attn_ext.dropout_keep_mask(
        1, 4, sum(lens), 12, p, generator=torch.Generator().manual_seed(5)
    )[0].to(device)
    ref = attention_varlen_reference(q, k, v, c, c, dropout_p=p, dropout_keep=keep, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_varlen_gradcheck(device):
    lens = [3, 0, 5, 1]
    opt = ("all", dict(causal=True, window_size=(3, -1), softcap=2.0), "batch", True)
    tensors, kw = varlen_inputs(lens, lens, 2, 1, 4, 3, torch.float64, device, opt, grad=True)
    c = cu(lens, device)

    # out only: lse is float32 even for float64 inputs, too coarse for finite differences
    # (its gradient is checked against the reference in test_varlen_backward).
    def fn(q, k, v, sinks):
        return attn_ext.attention_varlen(q, k, v, c, c, 5, 5, sinks=sinks, **kw)

    assert torch.autograd.gradcheck(fn, tuple(tensors), eps=1e-6, atol=1e-7, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Score modifiers on attention (fixed length)
# --------------------------------------------------------------------------- #
MODS = [
    ("softcap", dict(softcap=2.5), None, False),
    ("alibi_head_causal", dict(causal=True), "head", False),
    ("alibi_batch_window", dict(window_size=(5, 2)), "batch", False),
    ("sinks", {}, None, True),
    ("sinks_causal_empty_rows", dict(causal=True), None, True),
    ("everything", dict(causal=True, softcap=4.0), "batch", True),
]


def fixed_inputs(dtype, device, option, Sq=37, Sk=45, grad=False):
    _, kw, alibi, with_sinks = option
    if option[0] == "sinks_causal_empty_rows":
        Sq, Sk = 20, 9  # the first 11 rows see no key: out 0, lse = sink
    q, k, v = make_qkv(2, 4, 2, Sq, Sk, 32, 24, dtype=dtype, device=device, layout="bshd")
    kw = dict(kw)
    if alibi == "head":
        kw["alibi_slopes"] = torch.rand(4, device=device)
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(2, 4, device=device)
    sinks = torch.randn(4, device=device).to(dtype) if with_sinks else None
    tensors = [q, k, v] + ([sinks] if with_sinks else [])
    if grad:
        tensors = [t.detach().requires_grad_(True) for t in tensors]
    return tensors, kw


@pytest.mark.parametrize("option", MODS, ids=[o[0] for o in MODS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_modifiers_forward(device, dtype, option):
    tensors, kw = fixed_inputs(dtype, device, option)
    q, k, v, sinks = _split(tensors)
    out, lse = attn_ext.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, sinks=sinks, return_lse=True, **kw)
    tru, tru_lse = ground_truth(attention_reference, q, k, v, sinks=sinks, return_lse=True, **kw)
    assert_error_rule(out, ref, tru, name="out")
    assert_lse_close(lse, ref_lse, tru_lse)


@pytest.mark.parametrize("option", MODS, ids=[o[0] for o in MODS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_modifiers_backward(device, dtype, option):
    tensors, kw = fixed_inputs(dtype, device, option)
    q = tensors[0]
    g = torch.randn(*q.shape[:3], 24, device=device).to(dtype)

    def ours(q, k, v, sinks=None):
        return attn_ext.attention(q, k, v, sinks=sinks, **kw)

    def ref(q, k, v, sinks=None):
        return attention_reference(q, k, v, sinks=sinks, **kw)

    got = autograd_grads(ours, tensors, g)
    reference = autograd_grads(ref, tensors, g)
    truth = ground_truth_grads(ref, tensors, g)
    for name, x, a, r, t in zip(("dq", "dk", "dv", "dsinks"), tensors, got, reference, truth):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        # dsinks sums B * H * Sq terms: slack scaled as for a reduction of that length.
        slack = grad_slack_ulps(a.dtype) * (8 if name == "dsinks" else 1)
        assert_error_rule(a, r, t, name=name, slack_ulps=slack)


def test_score_modifiers_gradcheck(device):
    option = ("everything", dict(causal=True, softcap=1.5, window_size=(4, -1)), "batch", True)
    tensors, kw = fixed_inputs(torch.float64, device, option, Sq=6, Sk=8, grad=True)

    def fn(q, k, v, sinks):  # out only, as in test_varlen_gradcheck
        return attn_ext.attention(q, k, v, sinks=sinks, **kw)

    assert torch.autograd.gradcheck(fn, tuple(tensors), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_sink_row_that_sees_no_key(device):
    """A row that sees no key attends only to its sink: zeros out, lse = the sink's logit."""
    q, k, v = make_qkv(1, 2, 2, 4, 2, 8, device=device)
    sinks = torch.tensor([0.5, -1.0], device=device)
    out, lse = attn_ext.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    torch.testing.assert_close(lse[0, :, :2], sinks.view(2, 1).expand(2, 2))


# --------------------------------------------------------------------------- #
# Paged keys and values (block_table): the pages read where they lie
# --------------------------------------------------------------------------- #
PAGED_OPTIONS = [
    o for o in OPTIONS if o[0] in ("plain", "causal", "causal_window_softcap", "everything")
]


@pytest.mark.parametrize("layout", ["flash_attn", "heads_first"])
@pytest.mark.parametrize("page", [1, 7, 16, 64])
@pytest.mark.parametrize("lengths", ["mixed", "cross"])
@pytest.mark.parametrize("option", PAGED_OPTIONS, ids=[o[0] for o in PAGED_OPTIONS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_varlen_equals_packed(dtype, option, lengths, page, layout):
    """The packed call on the same keys, bit for bit where the CPU's own products run
    (assert_paged_like_packed): pages of 1 row to 64, in shuffled order, in FlashAttention's
    layout and as a view of heads-first pages; the NaN rows no sequence owns are never read."""
    lens_q, lens_k = LENGTHS[lengths]
    tensors, kw = varlen_inputs(lens_q, lens_k, 4, 2, 32, 24, dtype, "cpu", option)
    q, k, v, sinks = _split(tensors)
    cq, ck = cu(lens_q, "cpu"), cu(lens_k, "cpu")
    k_pages, v_pages, table = paged_varlen_kv(k, v, lens_k, page, layout)
    mq, mk = max(lens_q), max(lens_k)
    want = attn_ext.attention_varlen(q, k, v, cq, ck, mq, mk, sinks=sinks, return_lse=True, **kw)
    got = attn_ext.attention_varlen(
        q, k_pages, v_pages, cq, ck, mq, mk, sinks=sinks, return_lse=True, block_table=table, **kw
    )
    for a, b in zip(got, want):
        assert_paged_like_packed(a, b, mq, mk)


# Queries per sequence that select each kind of products (few rows: BLAS; else the packed
# panels or bf16 pairs) on keys long enough at D 256 that no product packs the whole head
# (tile by tile: kMaxPackedHeadElems, kMaxConvertedHeadElems in kernel_traits.h).
@pytest.mark.parametrize("lens_q", [[20, 5], [3, 2]], ids=["packed_products", "blas"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_varlen_long_keys_tile_by_tile(dtype, lens_q):
    lens_k = [8200, 300]
    tensors, _ = varlen_inputs(lens_q, lens_k, 2, 1, 256, 256, dtype, "cpu", OPTIONS[0])
    q, k, v, _ = _split(tensors)
    cq, ck = cu(lens_q, "cpu"), cu(lens_k, "cpu")
    k_pages, v_pages, table = paged_varlen_kv(k, v, lens_k, 16)
    args = (cq, ck, max(lens_q), max(lens_k))
    want = attn_ext.attention_varlen(q, k, v, *args, causal=True, return_lse=True)
    got = attn_ext.attention_varlen(
        q, k_pages, v_pages, *args, causal=True, return_lse=True, block_table=table
    )
    for a, b in zip(got, want):
        assert_paged_like_packed(a, b, max(lens_q), max(lens_k))


PAGED_KERNELS_SCRIPT = r"""
import torch, attn_ext
from attn_ext.testing.attention import paged_varlen_kv
cu = lambda lens, device: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]).int()
torch.manual_seed(0)
lens_q, lens_k = [40, 3, 17], [60, 9, 200]
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    q = torch.randn(sum(lens_q), 4, 64).to(dtype)
    k, v = (torch.randn(sum(lens_k), 2, 64).to(dtype) for _ in range(2))
    k_pages, v_pages, table = paged_varlen_kv(k, v, lens_k, 16)
    args = (cu(lens_q, "cpu"), cu(lens_k, "cpu"), 40, 200)
    want = attn_ext.attention_varlen(q, k, v, *args, causal=True)
    got = attn_ext.attention_varlen(q, k_pages, v_pages, *args, causal=True, block_table=table)
    assert torch.equal(got, want), (dtype, (got - want).abs().max())
print("ok", attn_ext._C.cpu_block_kernels())
"""


@pytest.mark.parametrize("kernels", ["avx2", "auto"])
def test_paged_varlen_on_each_kernel_set(kernels):
    """The AVX2 panels (avx2) and this CPU's widest set (auto: AVX-512, or the bf16 pairs of
    AVX512-BF16 / AMX, whose packers read the pages too) pack paged keys as they pack rows."""
    env = dict(os.environ, ATTN_EXT_CPU_KERNELS=kernels)
    r = subprocess.run(
        [sys.executable, "-c", PAGED_KERNELS_SCRIPT], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


def _paged_args(**overrides):
    lens = [3, 20]
    q = torch.randn(23, 4, 8)
    k_pages, v_pages = torch.randn(4, 8, 2, 8), torch.randn(4, 8, 2, 8)
    table = torch.tensor([[3, 0, 1], [2, 1, 0]], dtype=torch.int32)
    a = dict(q=q, k=k_pages, v=v_pages, cq=cu(lens, "cpu"), ck=cu(lens, "cpu"), table=table)
    a.update(overrides)
    return a


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(table=torch.zeros(2, 3, dtype=torch.int64)), "block_table must be int32"),
        (dict(table=torch.zeros(3, 3, dtype=torch.int32)),
         r"block_table must have shape \(B, max_pages\) with B = 2"),
        (dict(k=torch.randn(32, 2, 8)),
         r"with a block_table, k must be 4-D \(num_pages, page_size, Hkv, D\)"),
        (dict(v=torch.randn(4, 4, 2, 8)), "v must have k's num_pages and page_size"),
        (dict(k=torch.randn(4, 8, 3, 8), v=torch.randn(4, 8, 3, 8)),
         "q heads must be a multiple of k heads"),
        (dict(ck=cu([3, 25], "cpu")),
         r"sequence 1 has 25 keys \(cu_seqlens_k\), more than its block_table row holds"),
        (dict(table=torch.tensor([[3, 0, 1], [2, 4, 0]], dtype=torch.int32)),
         r"block_table\[1, 1\] must be a page of the cache, in \[0, num_pages = 4\), got 4"),
        (dict(k=torch.randn(4, 8, 2, 8).bfloat16()), "k must have q's dtype"),
    ],
)  # fmt: skip
def test_paged_varlen_rejects_bad_pages(overrides, message):
    a = _paged_args(**overrides)
    with pytest.raises(RuntimeError, match=message):
        ops.attention_varlen(
            a["q"], a["k"], a["v"], a["cq"], a["ck"], block_table=a["table"],
            max_seqlen_q=20, max_seqlen_k=25,
        )  # fmt: skip


def test_paged_varlen_has_no_backward():
    """Gradients through pages are refused, not silently dropped (flash_attn_varlen_func gathers
    the pages when it needs them: test_flash_attn.py)."""
    a = _paged_args(q=torch.randn(23, 4, 8, requires_grad=True))
    with pytest.raises(NotImplementedError, match=r"paged k / v \(block_table\) have no backward"):
        attn_ext.attention_varlen(a["q"], a["k"], a["v"], a["cq"], a["ck"], 20, 20,
                                  block_table=a["table"])  # fmt: skip
    with torch.no_grad():  # the same call without a graph runs
        attn_ext.attention_varlen(a["q"], a["k"], a["v"], a["cq"], a["ck"], 20, 20,
                                  block_table=a["table"])  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_varlen_refused_on_cuda():
    a = {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in _paged_args().items()}
    with pytest.raises(NotImplementedError, match="block_table \\(paged k / v\\) runs on the CPU"):
        ops.attention_varlen(a["q"], a["k"], a["v"], a["cq"], a["ck"], block_table=a["table"],
                             max_seqlen_q=20, max_seqlen_k=20)  # fmt: skip


def test_opcheck_paged_varlen():
    a = _paged_args()
    torch.library.opcheck(
        ops.attention_varlen.default,
        (a["q"], a["k"], a["v"], a["cq"], a["ck"], None, None, torch.randn(4), a["table"]),
        dict(max_seqlen_q=20, max_seqlen_k=20, causal=True, softcap=2.0),
    )


def test_compile_paged_varlen():
    """fullgraph, dynamic: chunks of different lengths against the same pages, one graph (as in
    test_compile_varlen_without_recompiles, the first chunk's sizes avoid every other size of
    the inputs and every q has more than 4096 elements)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def fn(q, k, v, cq, ck, mq, mk, table):
        return attn_ext.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, block_table=table)

    cfn = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    lens_k = [40, 64]
    k, v = torch.randn(sum(lens_k), 2, 16), torch.randn(sum(lens_k), 2, 16)
    k_pages, v_pages, table = paged_varlen_kv(k, v, lens_k, 16)
    frames = None
    for lens_q in ([33, 50], [29, 41], [38, 34]):
        q = torch.randn(sum(lens_q), 4, 16)
        args = (q, k_pages, v_pages, cu(lens_q, "cpu"), cu(lens_k, "cpu"), max(lens_q), 64, table)
        assert torch.equal(cfn(*args), fn(*args))
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames, "recompiled for a new chunk of lengths"
    torch._dynamo.reset()


# --------------------------------------------------------------------------- #
# Validation, opcheck, torch.compile
# --------------------------------------------------------------------------- #
def _bad(device, **overrides):
    lens = [3, 4]
    q = torch.randn(7, 4, 8, device=device)
    k = torch.randn(7, 2, 8, device=device)
    v = torch.randn(7, 2, 8, device=device)
    args = dict(
        q=q, k=k, v=v, cu_seqlens_q=cu(lens, device), cu_seqlens_k=cu(lens, device),
        max_seqlen_q=4, max_seqlen_k=4,
    )  # fmt: skip
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int64)), "must be int32"),
        (dict(cu_seqlens_k=torch.tensor([0, 3], dtype=torch.int32)), "B \\+ 1 = 3"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)), r"\[0\] must be 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32)), "non-decreasing"),
        (dict(max_seqlen_q=3), "max_seqlen_q = 3 is less than the length of sequence"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32)), "must equal the token"),
        (dict(cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32)), "exceeds the token"),
        (dict(q=torch.randn(1, 7, 4, 8)), "must be 3-D"),
    ],
)
def test_varlen_rejects_bad_offsets(overrides, message):
    a = _bad("cpu", **overrides)
    with pytest.raises(RuntimeError, match=message):
        ops.attention_varlen(
            a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
            max_seqlen_q=a["max_seqlen_q"], max_seqlen_k=a["max_seqlen_k"],
        )  # fmt: skip


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(softcap=-1.0), "softcap must be finite and >= 0"),
        (dict(alibi_slopes=torch.rand(3)), r"alibi_slopes must have shape \(H,\) = \(4,\)"),
        (dict(alibi_slopes=torch.rand(4).int()), "alibi_slopes must be floating"),
        (dict(sinks=torch.rand(2, 4)), r"sinks must have shape \(H,\)"),
    ],
)
def test_score_modifier_validation(kw, message):
    q, k, v = make_qkv(2, 4, 2, 5, 5, 8)
    with pytest.raises(RuntimeError, match=message):
        attn_ext.attention(q, k, v, **kw)


def varlen_op_samples(device):
    lens = [3, 0, 6]
    c = cu(lens, device)
    s = []
    q, k, v = (torch.randn(9, h, 8, device=device, requires_grad=True) for h in (4, 2, 2))
    s.append(("plain", (q, k, v, c, c), dict(max_seqlen_q=6, max_seqlen_k=6)))
    s.append(
        (
            "causal_mods",
            (q, k, v, c, c, None, torch.rand(3, 4, device=device), torch.randn(4, device=device)),
            dict(max_seqlen_q=6, max_seqlen_k=6, causal=True, softcap=2.0),
        )
    )
    wide = torch.randn(9, 4, 16, device=device)
    qs = wide[..., :8].requires_grad_(False)  # token stride 64, head stride 16
    ks = torch.randn(2, 9, 8, device=device).transpose(0, 1)  # (total, Hkv, D), head-major
    s.append(("strided", (qs, ks, v, c, c), dict(max_seqlen_q=6, max_seqlen_k=6, causal=True)))
    s.append(
        (
            "dropout_window",
            (q, k, v, c, c, torch.tensor([7, 0])),
            dict(max_seqlen_q=6, max_seqlen_k=6, window_left=2, window_right=1, dropout_p=0.2),
        )
    )
    return s


VARLEN_IDS = [n for n, _, _ in varlen_op_samples("cpu")]


@pytest.mark.parametrize("idx", range(len(VARLEN_IDS)), ids=VARLEN_IDS)
def test_opcheck_attention_varlen(device, idx):
    _, args, kwargs = varlen_op_samples(device)[idx]
    torch.library.opcheck(ops.attention_varlen.default, args, kwargs)


@pytest.mark.parametrize("idx", range(len(VARLEN_IDS)), ids=VARLEN_IDS)
def test_opcheck_attention_varlen_backward(device, idx):
    _, args, kwargs = varlen_op_samples(device)[idx]
    q, k, v, cq, ck, *rest = (a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse = ops.attention_varlen(q, k, v, cq, ck, *rest, **kwargs)
    names = ("rng_state", "alibi_slopes", "sinks")
    bkw = dict(kwargs, **dict(zip(names, rest)), grad_lse=torch.randn_like(lse))
    torch.library.opcheck(
        ops.attention_varlen_backward.default,
        (torch.randn_like(out), q, k, v, out, lse, cq, ck),
        bkw,
    )


def test_opcheck_attention_with_modifiers(device):
    q, k, v = make_qkv(2, 4, 2, 7, 9, 16, device=device, requires_grad=True)
    args = (q, k, v, None, None, torch.rand(2, 4, device=device), torch.randn(4, device=device))
    torch.library.opcheck(ops.attention.default, args, dict(causal=True, softcap=3.0))
    out, lse = ops.attention(*(a.detach() if a is not None else a for a in args), softcap=3.0)
    torch.library.opcheck(
        ops.attention_backward.default,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse),
        dict(alibi_slopes=args[5], sinks=args[6], softcap=3.0),
    )


def test_compile_varlen_without_recompiles(device):
    """fullgraph, dynamic: batches of different cu_seqlens (count and lengths) reuse one graph,
    forward and backward."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def fn(q, k, v, cq, ck, mq, mk, sinks):
        out = attn_ext.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, sinks=sinks)
        return (out * 2.0).square().sum()

    cfn = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    frames = None
    # The first batch's sizes avoid every other size of the inputs (duck sizing would tie the
    # two symbols together, a guard of the test's making), and every q has more than 4096
    # elements (inductor guards on that threshold).
    for lens in ([17, 30, 13, 9], [29, 41, 4], [40, 3, 17, 8, 2, 11]):
        c = cu(lens, device)
        q, k, v = (torch.randn(sum(lens), h, 16, device=device) for h in (4, 2, 2))
        sinks = torch.randn(4, device=device)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
        loss = cfn(*leaves[:3], c, c, max(lens), max(lens), leaves[3])
        loss.backward()
        ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
        ref = fn(*ref_leaves[:3], c, c, max(lens), max(lens), ref_leaves[3])
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(leaves, ref_leaves):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames, "recompiled for a new batch of lengths"
    torch._dynamo.reset()
