"""attn_ext.flash_attn against FlashAttention 2's documented semantics
(attn_ext/testing/flash_attn.py), every public function and argument; numerics rule as in
test_attention.py (error against the float64 truth at most 2x the plain reference's at the
input dtype, plus one rounding unit)."""

import pytest
import torch

import attn_ext.flash_attn as fa
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


@pytest.fixture(autouse=True)
def _unverified_cuda(monkeypatch):
    """On a GPU these tests are what verifies the varlen / score-modifier CUDA kernels, which
    are off by default until they have run green (csrc/common/cuda/unverified.h)."""
    monkeypatch.setenv("ATTN_EXT_UNVERIFIED_CUDA", "1")


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
    assert s_dmask is None  # FlashAttention returns S_dmask only with dropout
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


def test_dropout_s_dmask_and_determinism(device):
    """With dropout, S_dmask is the probabilities with dropped entries negated, and the output
    equals the reference's for that mask."""
    q, k, v = (torch.randn(1, 12, 2, 8, dtype=torch.float64, device=device) for _ in range(3))
    torch.manual_seed(7)
    out, lse, s = fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    assert s.shape == (1, 2, 12, 12)
    keep = s >= 0
    probs = s.abs()
    ref = ((probs * keep / 0.7) @ v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.manual_seed(7)
    again = fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.testing.assert_close(out, again, rtol=0, atol=0)


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
    assert s is None and lse.shape == (H, sum(lq))
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


def test_block_table_is_not_supported_yet():
    q = torch.randn(3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="paged KV cache"):
        fa.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, block_table=torch.zeros(1, 1).int())


# ------------------------------------------------------------------------ flash_attn_with_kvcache
KVCACHE_CASES = {
    "append_causal": dict(causal=True),
    "no_append": dict(causal=True, append=False),
    "rotary_interleaved": dict(causal=True, rotary=True, rotary_interleaved=True),
    "rotary_halves_noncausal": dict(rotary=True, rotary_interleaved=False),
    "rotary_partial_window": dict(rotary=True, rotary_dim=16, window_size=(7, 0)),
    "batch_idx": dict(causal=True, cache_batch_idx=True),
    "leftpad": dict(causal=True, cache_leftpad=True, rotary=True),
    "window_both_sides": dict(window_size=(5, 3)),
    "softcap_alibi": dict(causal=True, softcap=2.0, alibi="batch"),
    "int_seqlens_splits": dict(causal=True, int_seqlens=True, num_splits=3),
    "whole_cache": dict(causal=True, append=False, no_seqlens=True),
}


def _kvcache_args(case, dtype, device, sq):
    c = dict(KVCACHE_CASES[case])
    B, H, Hkv, D, L, s_new = 3, 4, 2, 32, 64, sq
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
