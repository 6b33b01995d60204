"""GPU-only cases of attention_varlen and of the score modifiers (softcap, ALiBi, sinks) on
attention / attention_varlen: the CUDA kernels (the generic kernels' varlen / modifier
instantiation, csrc/attention/cuda/flash) against the CPU op on the same inputs and against
attn_ext/testing's references under the suite's error rule. Skipped without a visible GPU.

These kernels are on by default since they ran green on an H100 (tests and compute-sanitizer,
2026-11-27, dev/gpu_notes.md); this file is what keeps them so.
"""

import pytest
import torch

import attn_ext
from attn_ext.testing.attention import attention_reference, attention_varlen_reference
from attn_ext.testing.numerics import (
    assert_error_rule,
    assert_lse_close,
    autograd_grads,
    grad_slack_ulps,
    ground_truth,
    ground_truth_grads,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

DEV = "cuda"
DTYPES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.bfloat16, id="bfloat16"),
    pytest.param(torch.float16, id="float16"),
]
# (D, Dv): the tensor-core kernel's head dims (which route to the generic kernel here) and an
# odd pair with Dv != D.
HEAD_DIMS = [(64, 64), (128, 128), (37, 29)]
HEAD_DIM_IDS = [f"d{d}_{dv}" for d, dv in HEAD_DIMS]
H, HKV = 6, 2  # GQA: three query heads per key/value head

# Per-sequence lengths (q, k): empty q, one token, a sequence over several query blocks, one
# with queries but no keys (out 0, lse -inf), Sq > Sk (under causal: rows that see no key).
LENS_Q = [0, 1, 37, 130, 5, 16]
LENS_K = [4, 1, 37, 130, 0, 9]
BANDS = [
    ("plain", {}),
    ("causal", dict(causal=True)),
    ("window", dict(window_size=(7, 3))),
    ("causal_window", dict(causal=True, window_size=(20, -1))),
]
# (name, kwargs, alibi: None | "head" | "batch", sinks)
MODS = [
    ("softcap", dict(softcap=4.0), None, False),
    ("alibi_head_causal", dict(causal=True), "head", False),
    ("alibi_batch_window", dict(window_size=(9, 2)), "batch", False),
    ("sinks", {}, None, True),
    ("sinks_causal", dict(causal=True), None, True),
    ("everything", dict(causal=True, window_size=(24, -1), softcap=3.0), "batch", True),
]
# Largest normalized difference |cuda - cpu| / max(1, max|cpu|) between the two devices'
# results: both accumulate in fp32 (fp64) and round once, in different orders.
CPU_TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 4e-2, torch.float16: 5e-3}


def cu(lengths, device=DEV):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


def assert_matches_cpu(got, cpu, name):
    assert got.shape == cpu.shape and got.dtype == cpu.dtype, name
    g, c = got.detach().cpu().double(), cpu.detach().double()
    assert torch.equal(torch.isfinite(g), torch.isfinite(c)), f"{name}: non-finite pattern"
    fin = torch.isfinite(c)
    if not fin.any():
        return
    diff = (g[fin] - c[fin]).abs().max().item() / max(1.0, c[fin].abs().max().item())
    assert diff <= CPU_TOL[got.dtype], f"{name} ({got.dtype}): |cuda - cpu| = {diff:.3e}"


def modifier_kwargs(kw, alibi, batch, device=DEV):
    kw = dict(kw)
    if alibi == "head":
        kw["alibi_slopes"] = torch.rand(H, device=device) * 0.5
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(batch, H, device=device) * 0.5
    return kw


def to_cpu(kw):
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def varlen_tensors(dtype, D, Dv, with_sinks=False):
    q = torch.randn(sum(LENS_Q), H, D, device=DEV).to(dtype)
    k = torch.randn(sum(LENS_K), HKV, D, device=DEV).to(dtype)
    v = torch.randn(sum(LENS_K), HKV, Dv, device=DEV).to(dtype)
    return [q, k, v] + ([torch.randn(H, device=DEV).to(dtype)] if with_sinks else [])


def varlen_fn(cq, ck, **kw):
    """attention_varlen as f(q, k, v[, sinks]) -> (out, lse)."""

    def f(q, k, v, sinks=None):
        return attn_ext.attention_varlen(
            q, k, v, cq, ck, max(LENS_Q), max(LENS_K), sinks=sinks, return_lse=True, **kw
        )

    return f


def varlen_ref(cq, ck, **kw):
    def f(q, k, v, sinks=None):
        return attention_varlen_reference(q, k, v, cq, ck, sinks=sinks, return_lse=True, **kw)

    return f


def loss_of(fn, g, g_lse):
    """<out, g> (+ <lse, g_lse> when given: every row must then see a key or a sink, since the
    reference's lse has no gradient at an empty row)."""

    def f(*xs):
        out, lse = fn(*xs)
        loss = (out * g.to(out.dtype)).sum()
        return loss if g_lse is None else loss + (lse * g_lse).sum()

    return f


def check_forward(fn, ref, cpu_fn, tensors):
    out, lse = fn(*tensors)
    ref_out, ref_lse = ref(*tensors)
    tru_out, tru_lse = ground_truth(ref, *tensors)
    assert_error_rule(out, ref_out, tru_out, name="out")
    assert_lse_close(lse, ref_lse, tru_lse)
    cpu_out, cpu_lse = cpu_fn(*(t.cpu() for t in tensors))
    assert_matches_cpu(out, cpu_out, "out")
    assert_matches_cpu(lse, cpu_lse, "lse")
    return cpu_lse


def check_backward(fn, ref, cpu_fn, tensors, out_shape, lse_rows_finite):
    g = torch.randn(*out_shape, device=DEV)
    g_lse = torch.randn(H, sum(LENS_Q), device=DEV) if lse_rows_finite else None
    got = autograd_grads(loss_of(fn, g, g_lse), tensors, torch.tensor(1.0))
    reference = autograd_grads(loss_of(ref, g, g_lse), tensors, torch.tensor(1.0))
    truth = ground_truth_grads(loss_of(ref, g, g_lse), tensors, torch.tensor(1.0))
    cpu_g_lse = None if g_lse is None else g_lse.cpu()
    cpu = autograd_grads(
        loss_of(cpu_fn, g.cpu(), cpu_g_lse), [t.cpu() for t in tensors], torch.tensor(1.0)
    )
    for name, x, a, r, t, c in zip(
        ("dq", "dk", "dv", "dsinks"), tensors, got, reference, truth, cpu
    ):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        # dsinks and the lse term sum over every row: slack as for a reduction of that length
        slack = grad_slack_ulps(a.dtype) * (8 if name == "dsinks" or g_lse is not None else 1)
        assert_error_rule(a, r, t, name=name, slack_ulps=slack)
        assert_matches_cpu(a, c, name)


# --------------------------------------------------------------------------- #
# attention_varlen: bands, head dims, dtypes, GQA
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("band", BANDS, ids=[b[0] for b in BANDS])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_forward(dtype, dims, band):
    _, kw = band
    tensors = varlen_tensors(dtype, *dims)
    cq, ck = cu(LENS_Q), cu(LENS_K)
    check_forward(
        varlen_fn(cq, ck, **kw),
        varlen_ref(cq, ck, **kw),
        varlen_fn(cq.cpu(), ck.cpu(), **kw),
        tensors,
    )


@pytest.mark.parametrize("band", BANDS, ids=[b[0] for b in BANDS])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_backward(dtype, dims, band):
    _, kw = band
    tensors = varlen_tensors(dtype, *dims)
    cq, ck = cu(LENS_Q), cu(LENS_K)
    cpu_fn = varlen_fn(cq.cpu(), ck.cpu(), **kw)
    _, cpu_lse = cpu_fn(*(t.cpu() for t in tensors))
    check_backward(
        varlen_fn(cq, ck, **kw),
        varlen_ref(cq, ck, **kw),
        cpu_fn,
        tensors,
        (sum(LENS_Q), H, dims[1]),
        bool(torch.isfinite(cpu_lse).all()),
    )


# --------------------------------------------------------------------------- #
# Score modifiers: attention_varlen and attention (fixed length)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("mod", MODS, ids=[m[0] for m in MODS])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_modifiers(dtype, dims, mod):
    _, kw, alibi, with_sinks = mod
    kw = modifier_kwargs(kw, alibi, len(LENS_Q))
    tensors = varlen_tensors(dtype, *dims, with_sinks=with_sinks)
    cq, ck = cu(LENS_Q), cu(LENS_K)
    fn, ref = varlen_fn(cq, ck, **kw), varlen_ref(cq, ck, **kw)
    cpu_fn = varlen_fn(cq.cpu(), ck.cpu(), **to_cpu(kw))
    cpu_lse = check_forward(fn, ref, cpu_fn, tensors)
    check_backward(
        fn, ref, cpu_fn, tensors, (sum(LENS_Q), H, dims[1]), bool(torch.isfinite(cpu_lse).all())
    )


@pytest.mark.parametrize("mod", MODS, ids=[m[0] for m in MODS])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_length_modifiers(dtype, dims, mod):
    """attention with modifiers (the generic kernel's modifier instantiation, also for the
    head dims the tensor-core kernel takes without them); Sq > Sk under causal leaves rows that
    see no key."""
    _, kw, alibi, with_sinks = mod
    B, Sq, Sk = 2, 70, 45
    kw = modifier_kwargs(kw, alibi, B)
    D, Dv = dims
    q = torch.randn(B, Sq, H, D, device=DEV).to(dtype).transpose(1, 2)  # (B, S, H, D) views
    k = torch.randn(B, Sk, HKV, D, device=DEV).to(dtype).transpose(1, 2)
    v = torch.randn(B, Sk, HKV, Dv, device=DEV).to(dtype).transpose(1, 2)
    tensors = [q, k, v] + ([torch.randn(H, device=DEV).to(dtype)] if with_sinks else [])

    def make(**kw_dev):
        def f(q, k, v, sinks=None):
            return attn_ext.attention(q, k, v, sinks=sinks, return_lse=True, **kw_dev)

        return f

    def ref(q, k, v, sinks=None):
        return attention_reference(q, k, v, sinks=sinks, return_lse=True, **kw)

    cpu_fn = make(**to_cpu(kw))
    out, lse = make(**kw)(*tensors)
    ref_out, ref_lse = ref(*tensors)
    tru_out, tru_lse = ground_truth(ref, *tensors)
    assert_error_rule(out, ref_out, tru_out, name="out")
    assert_lse_close(lse, ref_lse, tru_lse)
    cpu_out, cpu_lse = cpu_fn(*(t.cpu() for t in tensors))
    assert_matches_cpu(out, cpu_out, "out")
    assert_matches_cpu(lse, cpu_lse, "lse")

    g = torch.randn(B, H, Sq, Dv, device=DEV).to(dtype)
    got = autograd_grads(lambda *xs: make(**kw)(*xs)[0], tensors, g)
    reference = autograd_grads(lambda *xs: ref(*xs)[0], tensors, g)
    truth = ground_truth_grads(lambda *xs: ref(*xs)[0], tensors, g)
    cpu = autograd_grads(lambda *xs: cpu_fn(*xs)[0], [t.cpu() for t in tensors], g.cpu())
    for name, a, r, t, c in zip(("dq", "dk", "dv", "dsinks"), got, reference, truth, cpu):
        slack = grad_slack_ulps(a.dtype) * (8 if name == "dsinks" else 1)
        assert_error_rule(a, r, t, name=name, slack_ulps=slack)
        assert_matches_cpu(a, c, name)


# --------------------------------------------------------------------------- #
# Robustness: max_seqlen below the real lengths, offsets short of the tokens, determinism
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("max_q,max_k", [(16, 16), (0, 0), (1, 200)])
def test_max_seqlen_below_the_lengths(dtype, max_q, max_k):
    """max_seqlen is a promise the GPU op cannot check: the kernels loop over the query / key
    blocks the grid did not cover, so every row is still computed, bit for bit as with the true
    bound (the blocks keep their rows; only the grid changes)."""
    tensors = [t.requires_grad_(True) for t in varlen_tensors(dtype, 64, 64, with_sinks=True)]
    cq, ck = cu(LENS_Q), cu(LENS_K)
    kw = dict(causal=True, softcap=3.0, window_size=(40, -1))
    g = torch.randn(sum(LENS_Q), H, 64, device=DEV).to(dtype)
    results = []
    for mq, mk in ((max(LENS_Q), max(LENS_K)), (max_q, max_k)):
        q, k, v, sinks = tensors
        out, lse = attn_ext.attention_varlen(
            q, k, v, cq, ck, mq, mk, sinks=sinks, return_lse=True, **kw
        )
        grads = torch.autograd.grad((out * g).sum(), tensors)
        results.append([out, lse, *grads])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), *results):
        assert torch.equal(a, b), name


def test_offsets_short_of_the_tokens():
    """Offsets the GPU op cannot check (the CPU op rejects them): tokens past cu_seqlens_q[B]
    belong to no sequence; they read out 0 and lse -inf, get no gradient, and add nothing to
    the sinks' gradient."""
    lens = [3, 9]
    q = torch.randn(16, H, 32, device=DEV, requires_grad=True)  # 4 tokens past the last sequence
    k = torch.randn(12, HKV, 32, device=DEV, requires_grad=True)
    v = torch.randn(12, HKV, 32, device=DEV, requires_grad=True)
    sinks = torch.randn(H, device=DEV, requires_grad=True)
    c = cu(lens)
    out, lse = attn_ext.attention_varlen(q, k, v, c, c, 9, 9, sinks=sinks, return_lse=True)
    assert torch.equal(out[12:], torch.zeros_like(out[12:]))
    assert torch.isneginf(lse[:, 12:]).all()
    dq, dk, dv, dsinks = torch.autograd.grad(out.square().sum(), [q, k, v, sinks])
    assert torch.equal(dq[12:], torch.zeros_like(dq[12:]))
    # the same batch without the stray tokens
    leaves = [x.detach().requires_grad_(True) for x in (q[:12], k, v, sinks)]
    out12 = attn_ext.attention_varlen(*leaves[:3], c, c, 9, 9, sinks=leaves[3])
    dq12, dk12, dv12, dsinks12 = torch.autograd.grad(out12.square().sum(), leaves)
    assert torch.equal(out[:12], out12)
    for name, a, b in (("dq", dq[:12], dq12), ("dk", dk, dk12), ("dv", dv, dv12)):
        assert torch.equal(a, b), name
    # (a sum over 16 rows per head against one over 12: the order may differ)
    torch.testing.assert_close(dsinks, dsinks12, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_deterministic(dtype):
    """Bit-identical gradients run to run, dsinks included (summed in a fixed order)."""
    tensors = varlen_tensors(dtype, 64, 64, with_sinks=True)
    cq, ck = cu(LENS_Q), cu(LENS_K)
    kw = dict(causal=True, alibi_slopes=torch.rand(len(LENS_Q), H, device=DEV), softcap=5.0)
    g = torch.randn(sum(LENS_Q), H, 64, device=DEV)
    f = loss_of(varlen_fn(cq, ck, **kw), g, None)
    a = autograd_grads(f, tensors, torch.tensor(1.0))
    b = autograd_grads(f, tensors, torch.tensor(1.0))
    for name, x, y in zip(("dq", "dk", "dv", "dsinks"), a, b):
        assert torch.equal(x, y), name


def test_varlen_dropout_equals_cpu():
    """Dropout keep bits are keyed by (head, token, key in the sequence) on both devices: float64
    results agree to rounding, forward and backward."""
    tensors = varlen_tensors(torch.float64, 40, 24, with_sinks=True)
    cq, ck = cu(LENS_Q), cu(LENS_K)
    kw = dict(causal=True, window_size=(30, -1), dropout_p=0.25, softcap=2.0)
    g = torch.randn(sum(LENS_Q), H, 24, device=DEV, dtype=torch.float64)

    def run(device):
        c_q, c_k = cq.to(device), ck.to(device)
        xs = [t.to(device) for t in tensors]

        def f(q, k, v, sinks):
            out, _ = varlen_fn(c_q, c_k, generator=torch.Generator().manual_seed(3), **kw)(
                q, k, v, sinks
            )
            return (out * g.to(device)).sum()

        leaves = [x.detach().requires_grad_(True) for x in xs]
        loss = f(*leaves)
        return [loss, *torch.autograd.grad(loss, leaves)]

    for name, a, b in zip(("loss", "dq", "dk", "dv", "dsinks"), run(DEV), run("cpu")):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-10, atol=1e-10, msg=name)


def test_float64_varlen_with_every_modifier():
    tensors = varlen_tensors(torch.float64, 48, 40, with_sinks=True)
    cq, ck = cu(LENS_Q), cu(LENS_K)
    kw = modifier_kwargs(dict(causal=True, window_size=(17, -1), softcap=2.5), "batch", 6)
    fn, ref = varlen_fn(cq, ck, **kw), varlen_ref(cq, ck, **kw)
    cpu_fn = varlen_fn(cq.cpu(), ck.cpu(), **to_cpu(kw))
    check_forward(fn, ref, cpu_fn, tensors)
    check_backward(fn, ref, cpu_fn, tensors, (sum(LENS_Q), H, 40), False)
