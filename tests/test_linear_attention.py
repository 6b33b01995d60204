"""attn_ext.linear_attention (issue 6) against the references of attn_ext/testing/linear.py.

Numerics follow attn_ext/testing/numerics.py's rule: the kernel's error against a float64 ground
truth is at most 2x the error of the plain reference run at the same dtype (plus one rounding unit
of the result), and float64 matches the truth to ~1e-10. The "plain reference" is document 000's
function for non-causal elu+1, the masked quadratic form otherwise; its float16/bfloat16 run
rounds after every step while the kernel accumulates in float32, so there the rule is loose for
the kernel, never for the reference.

On CUDA the ops run csrc/linear/linear_attention_composite.cpp (ATen ops, no fused kernel yet).
That composite is registered for CUDA in every build, so the last section below runs it on CPU
tensors (redispatched to the CUDA key) against the CPU kernel, also where there is no GPU.
"""

import math

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import attn_ext
from attn_ext.compat import torchcode
from attn_ext.testing.linear import (
    doc000_linear_attention,
    final_state,
    gradient_term_floors,
    linear_attention_quadratic,
    linear_attention_recurrent,
)
from attn_ext.testing.numerics import (
    ALL_DTYPES,
    assert_error_rule,
    autograd_grads,
    grad_slack_ulps,
    ground_truth,
    ground_truth_grads,
    rand,
)

ops = torch.ops.attn_ext

# Chunk boundaries of the causal kernel are multiples of 64: lengths around them, a prime one
# and one spanning many chunks.
LENGTHS = [1, 17, 63, 64, 65, 1000]


@pytest.fixture
def dev(device):
    return device


def _inputs(
    dev, B=2, H=3, S=17, D=16, Dv=24, dtype=torch.float32, layout="contiguous", Sk=None, grad=False
):
    Sk = S if Sk is None else Sk
    q = rand((B, H, S, D), dtype, dev, layout, grad)
    k = rand((B, H, Sk, D), dtype, dev, layout, grad)
    v = rand((B, H, Sk, Dv), dtype, dev, layout, grad)
    return q, k, v


def _plain_reference(causal, feature_map="elu+1", initial_state=None):
    """The reference a user would run at their dtype (document 000's when it applies)."""
    if not causal and feature_map == "elu+1" and initial_state is None:
        return lambda q, k, v: doc000_linear_attention(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        ).unflatten(0, q.shape[:2])
    return lambda q, k, v: linear_attention_quadratic(
        q, k, v, causal=causal, feature_map=feature_map, initial_state=initial_state
    )


def _state(dev, B, H, D, Dv, dtype, grad=False):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    # A state as left by ~10 earlier keys of elu+1 features (positive z).
    kv = torch.randn(B, H, D, Dv, device=dev, dtype=acc) * 3
    ks = torch.rand(B, H, D, device=dev, dtype=acc) * 10 + 1
    return kv.requires_grad_(grad), ks.requires_grad_(grad)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("S", LENGTHS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_forward_numerics(dev, dtype, S, causal):
    q, k, v = _inputs(dev, S=S, dtype=dtype)
    out = attn_ext.linear_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == (2, 3, S, 24)
    ref = _plain_reference(causal)
    assert_error_rule(out, ref(q, k, v), ground_truth(ref, q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D,Dv", [(1, 5), (8, 8), (64, 64), (32, 80), (80, 32)])
def test_head_dims(dev, D, Dv, causal):
    q, k, v = _inputs(dev, S=130, D=D, Dv=Dv)
    out = attn_ext.linear_attention(q, k, v, causal=causal)
    ref = _plain_reference(causal)
    assert_error_rule(out, ref(q, k, v), ground_truth(ref, q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature_map", ["relu", "identity"])
def test_feature_maps(dev, feature_map, causal, dtype):
    q, k, v = _inputs(dev, S=100, dtype=dtype)
    if feature_map == "identity":  # keep phi(q) . z away from 0 (identity is not positive)
        q, k = q.abs(), k.abs()
    out = attn_ext.linear_attention(q, k, v, causal=causal, feature_map=feature_map)
    ref = _plain_reference(causal, feature_map)
    assert_error_rule(out, ref(q, k, v), ground_truth(ref, q, k, v))


def test_sq_differs_from_sk(dev):
    q, k, v = _inputs(dev, S=70, Sk=300)
    out = attn_ext.linear_attention(q, k, v)
    ref = _plain_reference(False)
    assert_error_rule(out, ref(q, k, v), ground_truth(ref, q, k, v))


def test_eps(dev):
    q, k, v = _inputs(dev, dtype=torch.float64)
    for eps in (0.0, 0.5):
        torch.testing.assert_close(
            attn_ext.linear_attention(q, k, v, causal=True, eps=eps),
            linear_attention_quadratic(q, k, v, causal=True, eps=eps),
        )


def test_empty_sequence_returns_initial_state(dev):
    q, k, v = _inputs(dev, S=0, dtype=torch.float64)
    init = _state(dev, 2, 3, 16, 24, torch.float64)
    for causal in (False, True):
        out, (kv, ks) = attn_ext.linear_attention(
            q, k, v, causal=causal, initial_state=init, return_state=True
        )
        assert out.shape == (2, 3, 0, 24)
        assert torch.equal(kv, init[0]) and torch.equal(ks, init[1])
        _, (kv, ks) = attn_ext.linear_attention(q, k, v, causal=causal, return_state=True)
        assert not kv.any() and not ks.any()


# ----------------------------------------------------------------------------- state


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_initial_and_final_state(dev, dtype, causal):
    q, k, v = _inputs(dev, S=65, dtype=dtype)
    init = _state(dev, 2, 3, 16, 24, dtype)
    out, (kv, ks) = attn_ext.linear_attention(
        q, k, v, causal=causal, initial_state=init, return_state=True
    )
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert kv.dtype == ks.dtype == acc and kv.shape == (2, 3, 16, 24) and ks.shape == (2, 3, 16)
    ref = _plain_reference(causal, initial_state=init)
    assert_error_rule(out, ref(q, k, v), ground_truth(ref, q, k, v))
    # The state accumulates in float32 / float64 from the inputs as given: compare with the
    # float64 truth at the state's precision.
    truth_kv, truth_k = ground_truth(final_state, k, v, initial_state=init)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kv.double(), truth_kv, **tol)
    torch.testing.assert_close(ks.double(), truth_k, **tol)


@pytest.mark.parametrize("S", [1, 63, 64, 65, 130, 200])
def test_causal_chunked_equals_recurrence(dev, S):
    q, k, v = _inputs(dev, S=S, dtype=torch.float64)
    init = _state(dev, 2, 3, 16, 24, torch.float64)
    out, (kv, ks) = attn_ext.linear_attention(
        q, k, v, causal=True, initial_state=init, return_state=True
    )
    ref_out, (ref_kv, ref_k) = linear_attention_recurrent(q, k, v, initial_state=init)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kv, ref_kv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ks, ref_k, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("splits", [[64], [1, 63], [17, 48, 1], [100], [1] * 5])
def test_pieces_with_state_equal_one_call(dev, splits):
    """A causal sequence run in pieces (prefill, then decode steps), each continuing from the
    previous piece's state, gives the outputs and final state of one call."""
    q, k, v = _inputs(dev, S=sum(splits) + 7, dtype=torch.float64)
    full, (kv_full, k_full) = attn_ext.linear_attention(q, k, v, causal=True, return_state=True)
    state, outs, i = None, [], 0
    for n in splits + [7]:
        o, state = attn_ext.linear_attention(
            q[:, :, i : i + n],
            k[:, :, i : i + n],
            v[:, :, i : i + n],
            causal=True,
            initial_state=state,
            return_state=True,
        )
        outs.append(o)
        i += n
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state[0], kv_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state[1], k_full, rtol=1e-10, atol=1e-10)


def test_decode_step_is_causal_or_not(dev):
    """One position with a state: causal and non-causal agree (the recurrent step)."""
    q, k, v = _inputs(dev, S=1)
    init = _state(dev, 2, 3, 16, 24, torch.float32)
    a = attn_ext.linear_attention(q, k, v, causal=True, initial_state=init, return_state=True)
    b = attn_ext.linear_attention(q, k, v, causal=False, initial_state=init, return_state=True)
    torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_3d_inputs(dev, causal):
    q, k, v = _inputs(dev, H=1, S=70)
    init = _state(dev, 2, 1, 16, 24, torch.float32)
    out4, (kv4, k4) = attn_ext.linear_attention(
        q, k, v, causal=causal, initial_state=init, return_state=True
    )
    out3, (kv3, k3) = attn_ext.linear_attention(
        q[:, 0],
        k[:, 0],
        v[:, 0],
        causal=causal,
        initial_state=(init[0][:, 0], init[1][:, 0]),
        return_state=True,
    )
    assert out3.shape == (2, 70, 24) and kv3.shape == (2, 16, 24) and k3.shape == (2, 16)
    assert (
        torch.equal(out3, out4[:, 0]) and torch.equal(kv3, kv4[:, 0]) and torch.equal(k3, k4[:, 0])
    )


@pytest.mark.parametrize("layout", ["bshd", "noncontig", "expand_b"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs(dev, layout, causal):
    """Transposed (B, S, H, D) views are read in place, other layouts copied; the results are
    those of contiguous inputs, bit for bit, and so are the gradients."""
    q, k, v = _inputs(dev, S=70, layout=layout)
    qc, kc, vc = (x.contiguous() for x in (q, k, v))
    out = attn_ext.linear_attention(q, k, v, causal=causal)
    assert torch.equal(out, attn_ext.linear_attention(qc, kc, vc, causal=causal))
    g = rand(out.shape, torch.float32, dev, "bshd" if layout == "bshd" else "noncontig")
    grads = ops.linear_attention_backward(g, q, k, v, causal=causal)
    grads_c = ops.linear_attention_backward(g.contiguous(), qc, kc, vc, causal=causal)
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("S", [17, 65, 300])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_backward_numerics(dev, dtype, S, causal):
    q, k, v = _inputs(dev, S=S, dtype=dtype)
    g = rand((2, 3, S, 24), dtype, dev)
    ref = _plain_reference(causal)
    grads = autograd_grads(
        lambda q, k, v: attn_ext.linear_attention(q, k, v, causal=causal), (q, k, v), g
    )
    ref_grads = autograd_grads(ref, (q, k, v), g)
    truth = ground_truth_grads(ref, (q, k, v), g)
    for name, a, r, t in zip("qkv", grads, ref_grads, truth):
        assert_error_rule(a, r, t, name=f"d{name}", slack_ulps=grad_slack_ulps(dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_state_gradients(dev, causal):
    """Gradients reach the initial state, and flow in from the final state."""
    q, k, v = _inputs(dev, S=70, dtype=torch.float64)
    init = _state(dev, 2, 3, 16, 24, torch.float64)
    g = torch.randn(2, 3, 70, 24, dtype=torch.float64, device=dev)
    gkv, gk = torch.randn_like(init[0]), torch.randn_like(init[1])

    def ours(q, k, v, s0, z0):
        out, (kv, ks) = attn_ext.linear_attention(
            q, k, v, causal=causal, initial_state=(s0, z0), return_state=True
        )
        return (out * g).sum() + (kv * gkv).sum() + (ks * gk).sum()

    def reference(q, k, v, s0, z0):
        out = linear_attention_quadratic(q, k, v, causal=causal, initial_state=(s0, z0))
        kv, ks = final_state(k, v, initial_state=(s0, z0))
        return (out * g).sum() + (kv * gkv).sum() + (ks * gk).sum()

    inputs = (q, k, v) + init
    a = autograd_grads(ours, inputs, torch.tensor(1.0, dtype=torch.float64))
    b = autograd_grads(reference, inputs, torch.tensor(1.0, dtype=torch.float64))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
    # Only one of the two state outputs used: the other's gradient is taken as zero.
    q1 = q.detach().requires_grad_()
    _, (kv, _) = attn_ext.linear_attention(q1, k, v, causal=causal, return_state=True)
    kv.sum().backward()
    assert q1.grad is not None and not q1.grad.any()  # the final state does not depend on q


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature_map", ["elu+1", "relu", "identity"])
def test_gradcheck(dev, feature_map, causal):
    # 70 positions cross a causal chunk boundary; D != Dv; a state in and out.
    S = 70 if causal else 9
    q, k = (
        torch.randn(1, 2, S, 4, dtype=torch.float64, device=dev, requires_grad=True)
        for _ in range(2)
    )
    v = torch.randn(1, 2, S, 3, dtype=torch.float64, device=dev, requires_grad=True)
    s0 = torch.randn(1, 2, 4, 3, dtype=torch.float64, device=dev, requires_grad=True)
    z0 = (torch.rand(1, 2, 4, dtype=torch.float64, device=dev) + 1).requires_grad_()
    # relu's kink at 0 is never hit by random inputs; identity's denominator may pass near
    # -eps, so it gets a large eps and positive q, k.
    eps = 2.0 if feature_map == "identity" else 1e-6
    if feature_map == "identity":
        q, k = (x.detach().abs().requires_grad_() for x in (q, k))

    def fn(q, k, v, s0, z0):
        return ops.linear_attention(
            q, k, v, s0, z0, causal=causal, eps=eps, feature_map=feature_map
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, s0, z0))


# ----------------------------------------------------------------------------- opcheck


def _samples(dev):
    s = []
    q, k, v = _inputs(dev, S=7, D=8, Dv=8)
    s.append(("plain", (q, k, v), {}))
    q, k, v = _inputs(dev, S=70, D=8, Dv=12, grad=True)
    s.append(("causal_grad", (q, k, v), dict(causal=True)))
    q, k, v = _inputs(dev, S=9, D=8, Dv=8, layout="bshd", grad=True)
    kv, ks = _state(dev, 2, 3, 8, 8, torch.float32, grad=True)
    s.append(("strided_state", (q, k, v, kv, ks), dict(causal=True)))
    q, k, v = _inputs(dev, S=1, D=8, Dv=4, grad=True)
    kv, ks = _state(dev, 2, 3, 8, 4, torch.float32)
    s.append(("decode_step", (q, k, v, kv, ks), dict(causal=True)))
    q, k, v = _inputs(dev, S=5, Sk=11, D=8, Dv=8, dtype=torch.float64, grad=True)
    s.append(("float64_cross_relu", (q, k, v), dict(feature_map="relu", eps=1e-3)))
    q, k, v = _inputs(dev, S=9, D=8, Dv=8, dtype=torch.bfloat16, grad=True)
    s.append(("bfloat16", (q, k, v), dict(causal=True)))
    return s


IDS = [name for name, _, _ in _samples("cpu")]


@pytest.mark.parametrize("idx", range(len(IDS)), ids=IDS)
def test_opcheck_linear_attention(dev, idx):
    _, args, kwargs = _samples(dev)[idx]
    torch.library.opcheck(ops.linear_attention.default, args, kwargs)


@pytest.mark.parametrize("idx", range(len(IDS)), ids=IDS)
def test_opcheck_linear_attention_backward(dev, idx):
    _, args, kwargs = _samples(dev)[idx]
    q, k, v, *state = (x.detach() for x in args)
    out, kv, ks = ops.linear_attention(q, k, v, *state, **kwargs)
    state += [None] * (2 - len(state))
    grad_state = [torch.randn_like(kv), torch.randn_like(ks)] if idx % 2 else [None, None]
    torch.library.opcheck(
        ops.linear_attention_backward.default,
        (torch.randn_like(out), q, k, v, *state, *grad_state),
        kwargs,
    )


# ----------------------------------------------------------------------------- torch.compile


def test_compile_no_recompile(dev):
    torch._dynamo.reset()

    def fn(q, k, v):
        out, (kv, ks) = attn_ext.linear_attention(q, k, v, causal=True, return_state=True)
        return out * 2.0, kv, ks

    counter = CompileCounterWithBackend("inductor")
    cfn = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    after_first = None
    # Lengths avoid 0/1 (specialized by design) and the other dims (duck sizing).
    for S in (23, 41, 70):
        q, k, v = _inputs(dev, S=S, grad=True)
        got = cfn(q, k, v)
        want = fn(q, k, v)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        sum(x.sum() for x in got).backward()
        grads = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        sum(x.sum() for x in want).backward()
        for a, x in zip(grads, (q, k, v)):
            torch.testing.assert_close(a, x.grad, rtol=1e-5, atol=1e-6)
        after_first = after_first or counter.frame_count
        assert counter.frame_count == after_first, "recompiled for a new sequence length"
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- modules


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("Sq,Sk,D,Dv", [(1024, 1024, 64, 64), (17, 65, 16, 24), (1, 3, 8, 8)])
def test_compat_torchcode_linear_attention(dev, dtype, Sq, Sk, D, Dv):
    Q, K, V = (rand((2, s, d), dtype, dev) for s, d in ((Sq, D), (Sk, D), (Sk, Dv)))
    out = torchcode.linear_attention(Q, K, V)
    assert out.dtype == dtype and out.shape == (2, Sq, Dv)
    assert_error_rule(
        out, doc000_linear_attention(Q, K, V), ground_truth(doc000_linear_attention, Q, K, V)
    )


def test_compat_torchcode_linear_attention_grad_and_rank(dev):
    Q, K, V = (torch.randn(2, 33, 8, dtype=torch.float64, device=dev) for _ in range(3))
    g = torch.randn(2, 33, 8, dtype=torch.float64, device=dev)
    for a, b in zip(
        autograd_grads(torchcode.linear_attention, (Q, K, V), g),
        autograd_grads(doc000_linear_attention, (Q, K, V), g),
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"linear_attention: expected a 3-D input"):
        torchcode.linear_attention(Q.unsqueeze(1), K.unsqueeze(1), V.unsqueeze(1))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nn_linear_attention_forward(dev, causal):
    torch.manual_seed(0)
    m = attn_ext.nn.LinearAttention(32, 4, causal=causal).to(dev).double()
    x = torch.randn(2, 70, 32, dtype=torch.float64, device=dev)
    y = m(x)
    q, k, v = (p(x).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    ref = m.out_proj(linear_attention_quadratic(q, k, v, causal=causal).transpose(1, 2).flatten(2))
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    y.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_nn_linear_attention_recurrent_decoding(dev):
    """Prompt, then one token per call with the state: the outputs of one causal call."""
    m = attn_ext.nn.LinearAttention(32, 4, causal=True).to(dev).double()
    x = torch.randn(2, 75, 32, dtype=torch.float64, device=dev)
    full, full_state = m(x, return_state=True)
    y, state = m(x[:, :66], return_state=True)
    assert isinstance(state, attn_ext.LinearAttentionState)
    assert state.kv.shape == (2, 4, 8, 8) and state.k.shape == (2, 4, 8)
    steps = [y]
    for t in range(66, 75):
        y_t, state = m(x[:, t : t + 1], state, return_state=True)
        steps.append(y_t)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.kv, full_state.kv, rtol=1e-10, atol=1e-10)


def test_nn_linear_attention_float32_and_errors(dev):
    m = attn_ext.nn.LinearAttention(16, 2, feature_map="relu").to(dev)
    assert m(torch.randn(3, 5, 16, device=dev)).shape == (3, 5, 16)
    assert "feature_map='relu'" in repr(m)
    with pytest.raises(ValueError, match=r"x must be 3-D \(B, S, 16\)"):
        m(torch.randn(3, 5, 8, device=dev))
    with pytest.raises(ValueError, match=r"must be divisible by num_heads"):
        attn_ext.nn.LinearAttention(10, 3)
    with pytest.raises(
        ValueError, match=r"feature_map must be one of 'elu\+1', 'relu', 'identity'"
    ):
        attn_ext.nn.LinearAttention(16, 2, feature_map="softmax")


# ----------------------------------------------------------------------------- bad input


def _bad_cases(dev):
    q, k, v = _inputs(dev, S=8, D=8, Dv=4)
    kv, ks = _state(dev, 2, 3, 8, 4, torch.float32)
    return [
        ("k_head_dim", (q, k[..., :4], v), {}, r"k head dim must equal q's 8, got 4"),
        ("v_length", (q, k, v[:, :, :5]), {}, r"v sequence length must equal k's 8, got 5"),
        ("heads", (q, k[:, :1], v[:, :1]), {}, r"k and v must have q's number of heads 3"),
        ("batch", (q, k[:1], v[:1]), {}, r"k and v batch size must equal q's 2"),
        ("dtype", (q, k.double(), v), {}, r"k must have q's dtype Float, got Double"),
        (
            "causal_lengths",
            (q, k[:, :, :5], v[:, :, :5]),
            dict(causal=True),
            r"causal linear attention needs Sq == Sk, got Sq=8 and Sk=5",
        ),
        (
            "feature_map",
            (q, k, v),
            dict(feature_map="softmax"),
            r'feature_map must be one of "elu\+1", "relu", "identity", got "softmax"',
        ),
        ("eps", (q, k, v), dict(eps=-1.0), r"eps must be finite and >= 0, got -1"),
        (
            "state_shape",
            (q, k, v, kv[..., :3], ks),
            {},
            r"initial_state_kv must have shape \[2, 3, 8, 4\], got \[2, 3, 8, 3\]",
        ),
        (
            "state_k_shape",
            (q, k, v, kv, ks[:1]),
            {},
            r"initial_state_k must have shape \[2, 3, 8\], got \[1, 3, 8\]",
        ),
        (
            "state_dtype",
            (q, k, v, kv.double(), ks),
            {},
            r"initial_state_kv must have dtype Float, got Double",
        ),
        (
            "state_half",
            (q, k, v, kv, None),
            {},
            r"initial_state_kv and initial_state_k must be given together",
        ),
        ("rank", (q[0], k, v), {}, r"q must be 4-D \(B, H, Sq, D\), got 3-D"),
        (
            "int",
            (q.long(), k.long(), v.long()),
            {},
            r"q must be float32, float64, bfloat16 or float16, got Long",
        ),
    ]


BAD_IDS = [c[0] for c in _bad_cases("cpu")]


@pytest.mark.parametrize("idx", range(len(BAD_IDS)), ids=BAD_IDS)
def test_bad_input(dev, idx):
    _, args, kwargs, msg = _bad_cases(dev)[idx]
    with pytest.raises(RuntimeError, match=r"attn_ext\.linear_attention: " + msg):
        ops.linear_attention(*args, **kwargs)


def test_bad_input_backward_and_wrapper(dev):
    q, k, v = _inputs(dev, S=8, D=8, Dv=4)
    with pytest.raises(
        RuntimeError, match=r"linear_attention_backward: grad_out must have shape \[2, 3, 8, 4\]"
    ):
        ops.linear_attention_backward(torch.randn(2, 3, 8, 5, device=dev), q, k, v)
    with pytest.raises(
        RuntimeError, match=r"grad_state_kv and grad_state_k must be given together"
    ):
        ops.linear_attention_backward(
            torch.randn(2, 3, 8, 4, device=dev),
            q,
            k,
            v,
            None,
            None,
            torch.zeros(2, 3, 8, 4, device=dev),
            None,
        )
    with pytest.raises(
        ValueError, match=r"q must be 3-D \(B, S, D\) or 4-D \(B, H, S, D\), got 2-D"
    ):
        attn_ext.linear_attention(q[0, 0], k[0, 0], v[0, 0])
    with pytest.raises(ValueError, match=r"initial_state must be a pair \(kv_state, k_state\)"):
        attn_ext.linear_attention(q, k, v, initial_state=torch.zeros(3))


def test_no_quadratic_buffer(dev):
    """A causal call over 2^16 positions (one S x S float32 matrix: 16 GiB) runs with inputs of
    a few MiB: the kernel never forms the score matrix."""
    q, k, v = _inputs(dev, B=1, H=1, S=1 << 16, D=8, Dv=8)
    out, (kv, _) = attn_ext.linear_attention(q, k, v, causal=True, return_state=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(kv, final_state(k, v)[0], rtol=1e-4, atol=1e-2)
    assert math.isfinite(out.sum().item())


# ----------------------------------------------------------------------------- the CUDA composite
CUDA_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def _composite(name, *args, **kwargs):
    """The op's CUDA implementation (the ATen composite) run on whatever device args are on."""
    return getattr(ops, name).default.redispatch(CUDA_KEY, *args, **kwargs)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("feature_map", ["elu+1", "relu", "identity"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("S", [1, 63, 64, 65, 130])
def test_composite_equals_cpu_kernel_float64(S, causal, feature_map, with_state):
    """In float64 both implementations are exact up to rounding: they must agree to ~1e-12
    relative, forward (output and final state) and backward (all five gradients), for lengths
    around the chunk size and with every optional state given."""
    q, k, v = _inputs("cpu", S=S, dtype=torch.float64)
    init = _state("cpu", 2, 3, 16, 24, torch.float64) if with_state else (None, None)
    kw = dict(causal=causal, eps=1e-6, feature_map=feature_map)
    for a, b in zip(
        ops.linear_attention(q, k, v, *init, **kw),
        _composite("linear_attention", q, k, v, *init, **kw),
    ):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12 * max(1.0, a.abs().max().item()))
    g = rand((2, 3, S, 24), torch.float64, "cpu")
    gs = _state("cpu", 2, 3, 16, 24, torch.float64) if with_state else (None, None)
    want = ops.linear_attention_backward(g, q, k, v, *init, *gs, **kw)
    got = _composite("linear_attention_backward", g, q, k, v, *init, *gs, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "d_init_kv", "d_init_k"), want, got):
        assert b.shape == a.shape and b.dtype == a.dtype and b.is_contiguous(), name
        torch.testing.assert_close(
            b, a, rtol=1e-11, atol=1e-11 * max(1.0, a.abs().max().item()), msg=name
        )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_composite_numerics(dtype, causal):
    """At lower precision the composite obeys the suite's error rule against the float64 truth
    (it accumulates in float32, as the CPU kernel does)."""
    q, k, v = _inputs("cpu", S=200, dtype=dtype)
    ref = _plain_reference(causal)
    out = _composite("linear_attention", q, k, v, causal=causal)[0]
    assert out.dtype == dtype
    assert_error_rule(out, ref(q, k, v), ground_truth(ref, q, k, v))


def test_composite_shapes_and_errors():
    q, k, v = _inputs("cpu", S=5, Sk=9, D=4, Dv=3, dtype=torch.float64)  # Sq != Sk, non-causal
    for a, b in zip(ops.linear_attention(q, k, v), _composite("linear_attention", q, k, v)):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    e = [torch.randn(1, 2, 0, d, dtype=torch.float64) for d in (4, 4, 3)]
    out, kv, ks = _composite("linear_attention", *e, causal=True)
    assert out.shape == (1, 2, 0, 3) and kv.abs().max() == 0 and ks.abs().max() == 0
    grads = _composite(
        "linear_attention_backward", torch.randn(1, 2, 0, 3, dtype=torch.float64), *e, causal=True
    )
    assert [tuple(t.shape) for t in grads] == [
        (1, 2, 0, 4),
        (1, 2, 0, 4),
        (1, 2, 0, 3),
        (1, 2, 4, 3),
        (1, 2, 4),
    ]
    with pytest.raises(RuntimeError, match=r"attn_ext\.linear_attention: "):
        _composite("linear_attention", q, k, v, causal=True)  # causal needs Sq == Sk
    with pytest.raises(RuntimeError, match=r"grad_out must have shape"):
        _composite(
            "linear_attention_backward", torch.randn(2, 3, 5, 4, dtype=torch.float64), q, k, v
        )


def test_fp16_grad_where_plain_reference_is_nan():
    """--fuzz find (float16, relu, D = 1, one query): a query whose feature is 0 has
    normalizer eps = 1e-6, and the plain float16 reference's gradient there is 0 * inf = NaN
    while the truth is 0. The kernel (float32 inside) gives 0; the error rule measures the
    reference over the entries it got finite, so the kernel passes, and a planted error in
    those entries still fails."""
    q = torch.tensor([[[[-0.5]], [[0.7]]]], dtype=torch.float16)  # (1, 2, 1, 1): relu(q) = 0, > 0
    k = torch.tensor([[[[0.3]], [[-0.2]]]], dtype=torch.float16)
    v = torch.tensor([[[[0.9]], [[-1.1]]]], dtype=torch.float16)
    kw = dict(causal=True, eps=1e-6, feature_map="relu")
    inputs, g = [q, k, v], torch.ones(1, 2, 1, 1, dtype=torch.float16)

    def ours(q, k, v):
        return attn_ext.linear_attention(q, k, v, **kw)

    def ref(q, k, v):
        return linear_attention_quadratic(q, k, v, **kw)

    got = autograd_grads(ours, inputs, g)
    plain = autograd_grads(ref, inputs, g)
    truth = ground_truth_grads(ref, inputs, g)
    assert any(torch.isnan(r).any() for r in plain)  # the case: the reference breaks down
    for a, r, t in zip(got, plain, truth):
        assert torch.isfinite(t).all() and torch.equal(a.double(), t)
        assert_error_rule(a, r, t, name="grad", slack_ulps=grad_slack_ulps(a.dtype))
    bad = got[0] + torch.tensor([0.0, 0.25], dtype=torch.float16).view(1, 2, 1, 1)
    with pytest.raises(AssertionError, match="kernel error"):
        assert_error_rule(bad, plain[0], truth[0], name="grad", slack_ulps=16.0)


def test_fp32_dq_cancelling_terms_at_head_dim_one():
    """--fuzz find (float32, identity features, D = 1, Sq = 78, Sk = 44, Dv = 24, an initial
    state of 28 keys, not causal): dq is the difference of a numerator and a normalizer term
    that cancel up to eps (the exact dq is S dO eps / den^2, ~1e-2 here, the terms ~600), so
    the kernel's and the plain reference's errors are both ~1 float32 ulp of the terms and
    their ratio is luck (the find: 3.8x). The rule's floor is GRADIENT_TERM_ULPS ulps of the
    numerator term: the kernel passes it, and a dq missing its normalizer term (or zero) fails."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, s, 1, generator=gen).abs() for s in (78, 44))
    v = torch.randn(1, 1, 44, 24, generator=gen)
    k0, v0 = torch.randn(1, 1, 28, 1, generator=gen).abs(), torch.randn(1, 1, 28, 24, generator=gen)
    inputs = [q, k, v, *(t.float() for t in final_state(k0, v0, feature_map="identity"))]
    g = torch.randn(1, 1, 78, 24, generator=gen)
    kw = dict(eps=1e-6, feature_map="identity")

    def ours(q, k, v, s0, z0):
        return attn_ext.linear_attention(q, k, v, initial_state=(s0, z0), **kw)

    def ref(q, k, v, s0, z0, normalizer_grad=True):
        init = (s0, z0)
        return linear_attention_quadratic(
            q, k, v, initial_state=init, normalizer_grad=normalizer_grad, **kw
        )

    got = autograd_grads(ours, inputs, g)
    plain = autograd_grads(ref, inputs, g)
    truth = ground_truth_grads(ref, inputs, g)
    floors = gradient_term_floors(lambda *x: ref(*x, normalizer_grad=False), inputs, g)
    numerator_dq = ground_truth_grads(lambda *x: ref(*x, normalizer_grad=False), inputs, g)[0]
    # the case: dq is small against the terms it is the difference of
    assert numerator_dq.abs().max() > 1e4 * truth[0].abs().max() > 0
    for a, r, t, fl in zip(got, plain, truth, floors):
        assert_error_rule(a, r, t, name="grad", slack_ulps=grad_slack_ulps(a.dtype), floor=fl)
    for bad in (numerator_dq.float(), torch.zeros_like(got[0])):
        with pytest.raises(AssertionError, match="kernel error"):
            assert_error_rule(bad, plain[0], truth[0], name="grad", floor=floors[0])
