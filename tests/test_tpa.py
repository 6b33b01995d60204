"""Tensor Product Attention: the tpa_expand operator, attn_ext.nn.TensorProductAttention (causal,
factor-cache decoding) and the document-004 drop-in, against the reference of the paper's
equations (attn_ext/testing/tpa.py)."""

import pytest
import torch

import attn_ext
from attn_ext import TPAFactorCache
from attn_ext.compat import attention_zoo
from attn_ext.nn import TensorProductAttention
from attn_ext.testing.documents import doc004
from attn_ext.testing.numerics import ALL_DTYPES, assert_error_rule, grad_slack_ulps
from attn_ext.testing.tpa import tpa_decode_reference, tpa_expand_reference, tpa_reference

ops = torch.ops.attn_ext


def _factors(device, dtype, B=2, S=11, R=3, H=5, D=12, layout="contiguous", requires_grad=False):
    if layout == "contiguous":
        a = torch.randn(B, S, R, H, device=device, dtype=dtype)
        b = torch.randn(B, S, R, D, device=device, dtype=dtype)
    else:  # views of wider projections, rank-major and not contiguous
        a = torch.randn(B, S, R, H + 3, device=device, dtype=dtype)[..., 1 : H + 1]
        b = torch.randn(B, R, S, D, device=device, dtype=dtype).transpose(1, 2)
    return a.requires_grad_(requires_grad), b.requires_grad_(requires_grad)


# --------------------------------------------------------------------------------- tpa_expand


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("rope", [None, "default", "positions", "partial"])
def test_tpa_expand_against_reference(device, dtype, layout, rope):
    a, b = _factors(device, dtype, layout=layout)
    kw = {}
    if rope is not None:
        kw = dict(rope=True, rope_interleaved=rope != "positions", rope_base=500.0)
    if rope == "positions":
        kw["positions"] = torch.randint(0, 30000, (2, 11), device=device)
    if rope == "partial":
        kw.update(rotary_dim=6, positions=torch.arange(100, 111, device=device, dtype=torch.int32))
    out = attn_ext.tpa_expand(a, b, **kw)
    assert out.shape == (2, 11, 5, 12) and out.is_contiguous() and out.dtype == dtype
    truth = tpa_expand_reference(a, b, compute_dtype=torch.float64, **kw)
    assert_error_rule(out, tpa_expand_reference(a, b, **kw), truth, name="tpa_expand")


def test_tpa_expand_explicit_scale_and_odd_sizes(device):
    a, b = _factors(device, torch.float64, B=1, S=3, R=1, H=1, D=2)
    out = attn_ext.tpa_expand(a, b, scale=0.25)
    # R = H = 1: out = scale * a * b exactly.
    torch.testing.assert_close(
        out, 0.25 * a.squeeze(2).unsqueeze(-1) * b.squeeze(2).unsqueeze(2), rtol=0, atol=0
    )
    a, b = _factors(device, torch.float32, B=3, S=1, R=7, H=3, D=130)
    assert_error_rule(
        attn_ext.tpa_expand(a, b, rope=True),
        tpa_expand_reference(a, b, rope=True),
        tpa_expand_reference(a, b, rope=True, compute_dtype=torch.float64),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [False, True])
def test_tpa_expand_backward_against_autograd(device, dtype, rope):
    a, b = _factors(device, dtype, layout="strided", requires_grad=True)
    kw = dict(rope=rope, positions=torch.randint(0, 5000, (2, 11), device=device) if rope else None)
    g = torch.randn(2, 11, 5, 12, device=device, dtype=dtype)
    ga, gb = torch.autograd.grad(attn_ext.tpa_expand(a, b, **kw), (a, b), g)
    grads = {}
    for dt in (torch.float64, dtype):
        aa = a.detach().to(dt).requires_grad_(True)
        bb = b.detach().to(dt).requires_grad_(True)
        out = tpa_expand_reference(aa, bb, compute_dtype=dt, **kw)
        grads[dt] = torch.autograd.grad(out, (aa, bb), g.to(dt))
    for name, got, r, t in zip(("a", "b"), (ga, gb), grads[dtype], grads[torch.float64]):
        assert_error_rule(got, r, t, name=f"grad {name}", slack_ulps=grad_slack_ulps(dtype))


@pytest.mark.parametrize("rope", [False, True])
def test_tpa_expand_gradcheck(device, rope):
    a, b = _factors(
        device, torch.float64, B=2, S=3, R=2, H=3, D=6, layout="strided", requires_grad=True
    )
    pos = torch.tensor([[5, 9, 1000], [0, 1, 2]], device=device) if rope else None
    torch.autograd.gradcheck(
        lambda a, b: attn_ext.tpa_expand(
            a, b, positions=pos, rope=rope, rotary_dim=4 if rope else None
        ),
        (a, b),
    )


def test_tpa_expand_feeds_attention_without_copy(device):
    a, b = _factors(device, torch.float32, S=9)
    q = attn_ext.tpa_expand(a, b).transpose(1, 2)  # (B, H, S, D) view
    assert q.stride(-1) == 1 and not q.is_contiguous()
    out = attn_ext.attention(q, q, q, causal=True)
    torch.testing.assert_close(
        out, attn_ext.attention(q.contiguous(), q.contiguous(), q.contiguous(), causal=True)
    )


def test_tpa_expand_errors(device):
    a, b = _factors(device, torch.float32)
    with pytest.raises(RuntimeError, match=r"the rank R \(dim 2\) of a and b must be equal"):
        ops.tpa_expand(a, b[:, :, :2])
    with pytest.raises(RuntimeError, match=r"a must be 4-D \(B, S, R, H\), got 3-D"):
        ops.tpa_expand(a[0], b)
    with pytest.raises(RuntimeError, match=r"must agree in \(B, S\)"):
        ops.tpa_expand(a[:, :4], b)
    with pytest.raises(RuntimeError, match="b must have a's dtype"):
        ops.tpa_expand(a, b.double())
    with pytest.raises(RuntimeError, match="rotary_dim must be even"):
        ops.tpa_expand(a, b, rope=True, rotary_dim=5)
    with pytest.raises(RuntimeError, match="positions are given but rope=False"):
        ops.tpa_expand(a, b, torch.arange(11, device=device))
    with pytest.raises(RuntimeError, match=r"positions must have shape \(S,\) = \(11,\)"):
        ops.tpa_expand(a, b, torch.arange(10, device=device), rope=True)
    with pytest.raises(RuntimeError, match="grad_out must have shape"):
        ops.tpa_expand_backward(torch.zeros(2, 11, 5, 11, device=device), a, b)
    with pytest.raises(ValueError, match=r"rank R \(dim 2 of a\) must be >= 1"):
        attn_ext.tpa_expand(a[:, :, :0], b[:, :, :0])
    with pytest.raises(RuntimeError, match=r"rank R \(dim 2\) of a and b must be equal and >= 1"):
        ops.tpa_expand(a[:, :, :0], b[:, :, :0])


# -------------------------------------------------------------------------------- the modules


# ----------------------------------------------------------------------- tpa_decode_attention


def _factor_cache(B, N, rk, rv, H, D, dtype, device, grad=False):
    return [
        torch.randn(B, N, r, x, device=device, dtype=dtype, requires_grad=grad)
        for r, x in ((rk, H), (rk, D), (rv, H), (rv, D))
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("ranks", [(1, 1), (2, 3)])
@pytest.mark.parametrize("D", [8, 13, 64])
def test_decode_op_matches_formed_keys(device, dtype, S, ranks, D):
    # Against attention over the keys and values formed from the factors; lengths include an
    # empty sequence, one shorter than S (rows that see nothing give 0 / -inf) and a full one.
    B, H, N = 4, 3, 37
    q = torch.randn(B, H, S, D, device=device, dtype=dtype)
    factors = _factor_cache(B, N, *ranks, H, D, dtype, device)
    lengths = torch.tensor([N, 17, 0, 2], device=device, dtype=torch.int32)
    out, lse = attn_ext.tpa_decode_attention(q, *factors, lengths, return_lse=True)
    ref, _ = tpa_decode_reference(q, *factors, lengths, compute_dtype=None)
    tru, tru_lse = tpa_decode_reference(q, *factors, lengths, compute_dtype=torch.float64)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # the reference at the input dtype: formed in fp32 (fp64), rounded to the dtype like ours
    assert_error_rule(out, ref.to(dtype), tru, name="out")
    fin = torch.isfinite(tru_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin].double(), tru_lse[fin], rtol=1e-5, atol=1e-5)
    assert not out[2].any() and not out[3, :, : max(0, S - 2)].any()  # rows that see no token


def test_decode_op_split_tokens_and_scales(device):
    # A long cache for one sequence: the tokens are split across tasks and merged.
    B, H, S, D, N = 1, 4, 2, 32, 3000
    q = torch.randn(B, H, S, D, device=device, dtype=torch.float64)
    factors = _factor_cache(B, N, 2, 2, H, D, torch.float64, device)
    lengths = torch.tensor([2900], device=device)
    kw = dict(scale=0.2, k_scale=0.9, v_scale=0.4)
    out, lse = attn_ext.tpa_decode_attention(q, *factors, lengths, return_lse=True, **kw)
    ref, ref_lse = tpa_decode_reference(q, *factors, lengths, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_decode_cuda_composite_equals_cpu_kernel(dtype):
    # The CUDA forward is an ATen composite registered for CUDA in every build: run it on CPU
    # tensors through the CUDA key against the CPU kernel (ragged, empty and short sequences).
    B, H, S, D, N = 4, 3, 2, 24, 150
    q = torch.randn(B, H, S, D, dtype=dtype)
    factors = _factor_cache(B, N, 2, 3, H, D, dtype, "cpu")
    lengths = torch.tensor([N, 17, 0, 1], dtype=torch.int32)
    kw = dict(scale=0.3, k_scale=0.8, v_scale=0.6)
    want = torch.ops.attn_ext.tpa_decode_attention(q, *factors, lengths, **kw)
    got = torch.ops.attn_ext.tpa_decode_attention.default.redispatch(
        torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), q, *factors, lengths, **kw
    )
    # float64: exact up to summation order; lower precision: the two round P and the output
    # differently, so each is held to the float64 truth by the suite's error rule
    if dtype == torch.float64:
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, equal_nan=True)
        return
    tru, _ = tpa_decode_reference(q, *factors, lengths, compute_dtype=torch.float64, **kw)
    assert_error_rule(got[0], want[0], tru, name="out")
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("N", [1, 19])
def test_decode_op_size_one_factor_dims_read_in_bounds(device, N):
    # Found by tests/test_fuzz.py: the CPU op merges a factor's (token, rank) dims into rows and
    # took their stride from dim 2 even when the rank R is 1, whose stride PyTorch leaves
    # arbitrary (a rank-major view (B, R, N, n).transpose(1, 2) has stride N * n there and
    # counts as contiguous): it read far past the tensor (random NaN/inf). With one token, a
    # rank dim expanded with stride 0 was read with the row length as stride instead.
    B, H, S, D = 3, 4, 1, 36
    q = torch.randn(B, H, S, D, device=device, dtype=torch.float64)
    rank_major = [
        torch.randn(B, 1, N, n, device=device, dtype=torch.float64).transpose(1, 2)
        for n in (H, D, H, D)
    ]
    expanded = [
        torch.randn(B, N, 1, n, device=device, dtype=torch.float64).expand(B, N, 3, n)
        for n in (H, D, H, D)
    ]
    lengths = torch.tensor([N, max(N - 13, 0), N], device=device, dtype=torch.int32)
    for factors in (rank_major, expanded, rank_major[:2] + expanded[2:]):
        out, lse = attn_ext.tpa_decode_attention(q, *factors, lengths, return_lse=True)
        dense = [f.contiguous() for f in factors]
        want, want_lse = tpa_decode_reference(q, *dense, lengths)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_decode_op_gradcheck(device):
    q = torch.randn(2, 3, 2, 5, device=device, dtype=torch.float64, requires_grad=True)
    factors = _factor_cache(2, 7, 2, 3, 3, 5, torch.float64, device, grad=True)
    lengths = torch.tensor([7, 3], device=device)
    torch.autograd.gradcheck(
        lambda *ts: attn_ext.tpa_decode_attention(*ts, lengths, scale=0.7), (q, *factors)
    )
    # lse is float32 (as attention's), too coarse for finite differences: its gradient is
    # compared with autograd through the reference instead
    g_lse = torch.randn(2, 3, 2, device=device, dtype=torch.float64)

    def lse_grads(fn):
        lse = fn(q, *factors, lengths, scale=0.7)[1]
        return torch.autograd.grad(
            (lse.double().masked_fill(~torch.isfinite(lse), 0) * g_lse).sum(), (q, *factors[:2])
        )  # lse does not depend on the values

    got = lse_grads(lambda *a, **kw: attn_ext.tpa_decode_attention(*a, return_lse=True, **kw))
    for a, b in zip(got, lse_grads(tpa_decode_reference)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_decode_op_errors(device):
    q = torch.randn(2, 3, 1, 8, device=device)
    factors = _factor_cache(2, 5, 2, 2, 3, 8, torch.float32, device)
    lengths = torch.tensor([5, 5], device=device)
    a_k, b_k, a_v, b_v = factors
    with pytest.raises(
        RuntimeError, match=r"b_k must have shape \(B, N, R, D\) = \(2, 5, R >= 1, 8\)"
    ):
        attn_ext.tpa_decode_attention(q, a_k, b_k[..., :7], a_v, b_v, lengths)
    with pytest.raises(
        RuntimeError, match=r"a_v must have shape \(B, N, R, H\) = \(2, 5, R >= 1, 3\)"
    ):
        attn_ext.tpa_decode_attention(q, a_k, b_k, a_v[..., :2], b_v, lengths)
    with pytest.raises(RuntimeError, match=r"b_v's rank \(dim 2\) must be a_v's 2, got 1"):
        attn_ext.tpa_decode_attention(q, a_k, b_k, a_v, b_v[:, :, :1], lengths)
    with pytest.raises(RuntimeError, match="a_k must have q's dtype"):
        attn_ext.tpa_decode_attention(q, a_k.double(), b_k, a_v, b_v, lengths)
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"cache_seqlens\[1\] must be in \[0, 5\], got 6"):
            attn_ext.tpa_decode_attention(q, *factors, torch.tensor([5, 6]))


def _layer(device, dtype, cls=TensorProductAttention, **kw):
    args = dict(r_q=4, r_k=2, r_v=3)
    args.update(kw)
    return cls(48, 4, 10, **args).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_module_against_reference(device, dtype, rope, interleaved):
    m = _layer(device, dtype, rope=rope, rope_interleaved=interleaved)
    x = torch.randn(2, 23, 48, device=device, dtype=dtype)
    with torch.no_grad():
        out = m(x)
    assert_error_rule(
        out,
        tpa_reference(m, x, rope=rope),
        tpa_reference(m, x, rope=rope, compute_dtype=torch.float64),
        name="tpa",
    )


def test_module_positions_and_gradients(device):
    m = _layer(device, torch.float32)
    x = torch.randn(2, 13, 48, device=device, requires_grad=True)
    pos = torch.randint(0, 4000, (2, 13), device=device)
    g = torch.randn(2, 13, 48, device=device)
    params = [x, *m.parameters()]
    got = torch.autograd.grad(m(x, positions=pos), params, g)
    ref = {}
    for dt in (torch.float64, torch.float32):
        m2 = _layer(device, dt)
        m2.load_state_dict(m.state_dict())
        xx = x.detach().to(dt).requires_grad_(True)
        out = tpa_reference(m2, xx, positions=pos, compute_dtype=dt)
        # The reference reads detached weights: differentiate x only through it, and the
        # parameters through a float64 copy of the module run by attn_ext below.
        ref[dt] = torch.autograd.grad(out, xx, g.to(dt))[0]
    assert_error_rule(
        got[0],
        ref[torch.float32],
        ref[torch.float64],
        name="grad x",
        slack_ulps=grad_slack_ulps(torch.float32),
    )
    m64 = _layer(device, torch.float64)
    m64.load_state_dict(m.state_dict())
    got64 = torch.autograd.grad(
        m64(x.detach().double(), positions=pos), list(m64.parameters()), g.double()
    )
    for (name, _), a, t in zip(m.named_parameters(), got[1:], got64):
        torch.testing.assert_close(
            a.double(), t, rtol=1e-4, atol=1e-4, msg=lambda s, n=name: f"grad {n}: {s}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("materialize", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_decode_equals_full_forward(device, dtype, materialize, chunk):
    # Prompt, then steps of `chunk` tokens; the factor cache (A_K, B_K, A_V, B_V) and the
    # materialized K/V cache both equal the full causal forward at every position.
    m = _layer(device, dtype)
    x = torch.randn(2, 20, 48, device=device, dtype=dtype)
    cache = m.new_cache(2, 24, materialize=materialize)
    with torch.no_grad():
        outs = [m(x[:, :5], cache)] + [m(x[:, t : t + chunk], cache) for t in range(5, 20, chunk)]
        full = m(x)
    out = torch.cat(outs, dim=1)
    assert cache.lengths.tolist() == [20, 20]
    truth = tpa_reference(m, x, compute_dtype=torch.float64)
    # The factor form sums in another order than attention over formed keys; float32: 4x.
    assert_error_rule(out, tpa_reference(m, x), truth, name="decode", factor=4.0)
    assert_error_rule(full, tpa_reference(m, x), truth, name="full")


def test_factor_cache_holds_factors(device):
    m = TensorProductAttention(2048, 16, 128, r_q=6, r_k=2, r_v=2).to(device)
    cache = m.new_cache(1, 8)
    assert isinstance(cache, TPAFactorCache)
    per_token = cache.nbytes_per_token()
    assert (
        per_token
        == attn_ext.kv_cache_bytes(
            "tpa", num_heads=16, head_dim=128, r_k=2, r_v=2, dtype=torch.float32
        )
        == 2 * 2 * (16 + 128) * 4
    )
    mat = m.new_cache(1, 8, materialize=True)
    assert mat.k[0, :, 0].numel() * 2 * 4 == attn_ext.kv_cache_bytes(
        "mha", num_heads=16, head_dim=128, dtype=torch.float32
    )
    x = torch.randn(1, 3, 2048, device=device)
    with torch.no_grad():
        m(x, cache)
    a_q, b_q, a_k, b_k, a_v, b_v = m.factors(x)
    torch.testing.assert_close(cache.a_k[:, :3], a_k)
    torch.testing.assert_close(cache.b_v[:, :3], b_v)
    rotated = attn_ext.rope(b_k.transpose(1, 2), interleaved=False).transpose(1, 2)
    torch.testing.assert_close(cache.b_k[:, :3], rotated)
    # rows past the length untouched; the host mirror of the lengths follows the device's
    assert not cache.a_v[:, 3:].any() and not cache.b_k[:, 3:].any()
    assert cache.max_length() == 3 and cache.lengths.tolist() == [3]


def test_module_errors(device):
    with pytest.raises(ValueError, match="r_k must be >= 1"):
        TensorProductAttention(16, 2, 8, r_k=0)
    with pytest.raises(ValueError, match="head_dim must be even"):
        TensorProductAttention(16, 2, 7)
    m = _layer(device, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \(B, S, d_model = 48\)"):
        m(torch.randn(2, 3, 47, device=device))
    with pytest.raises(TypeError, match="TPAFactorCache or an attn_ext.KVCache"):
        m(torch.randn(2, 1, 48, device=device), cache=object())
    cache = m.new_cache(1, 4)
    with torch.no_grad(), pytest.raises(RuntimeError, match="overflow"):
        m(torch.randn(1, 5, 48, device=device), cache)
    assert cache.lengths.tolist() == [0]


# ----------------------------------------------------------------------- document 004 drop-in


def test_dropin_loads_document_state_dict_strictly(device):
    doc = doc004.TensorProductAttentionLiteral(32, 4, 8, r_q=6, r_k=2, r_v=2)
    ours = attention_zoo.TensorProductAttention(32, 4, 8)
    ours.load_state_dict(doc.state_dict(), strict=True)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in doc.named_parameters()]
    for n, p in ours.named_parameters():
        assert p.shape == dict(doc.named_parameters())[n].shape, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_positions", [False, True])
def test_dropin_computes_the_paper(device, dtype, with_positions):
    doc = doc004.TensorProductAttentionLiteral(32, 4, 8, r_q=6, r_k=2, r_v=2)
    m = attention_zoo.TensorProductAttention(32, 4, 8)
    m.load_state_dict(doc.state_dict())
    m = m.to(device=device, dtype=dtype)
    x = torch.randn(3, 17, 32, device=device, dtype=dtype)
    pos = torch.arange(17, device=device) + 40 if with_positions else None
    with torch.no_grad():
        out = m(x, pos)
    kw = dict(
        positions=pos, rope=with_positions, causal=False, scale=1 / float(torch.tensor(8.0).sqrt())
    )
    assert_error_rule(
        out,
        tpa_reference(m, x, **kw),
        tpa_reference(m, x, compute_dtype=torch.float64, **kw),
        name="drop-in",
    )
    # The document attends across heads; the paper (and the drop-in) across positions.
    with torch.no_grad():
        literal = doc.to(device=device, dtype=dtype)(x)
    assert not torch.allclose(literal, m(x), atol=1e-3)


def test_dropin_reads_the_document_multiplier_as_positions(device):
    # Document 004's script passes a float (S, d_k) "rope_pos": taken as RoPE at 0..S-1.
    m = attention_zoo.TensorProductAttention(32, 4, 8).to(device)
    x = torch.randn(1, 5, 32, device=device)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="positions 0..S-1"):
            out = m(x, torch.randn(5, 8, device=device))
        assert torch.equal(out, m(x, torch.arange(5, device=device)))
        assert not torch.allclose(out, m(x), atol=1e-4)
    with pytest.raises(TypeError, match="integer token positions"):
        m(x, torch.randn(5, 6, device=device))
    with pytest.raises(ValueError, match="3-D"):
        m(torch.randn(5, 32, device=device))
