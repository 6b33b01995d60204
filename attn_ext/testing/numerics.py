"""The suite's numerics rule and input makers, shared by the tests, ``python -m attn_ext``
and the benchmarks: a float64 ground truth computed on the kernel's own (rounded) inputs,
the error rule (the kernel's error against it at most ``factor`` x the plain PyTorch
reference's error at the same dtype, plus a floor of a few ulps), and random inputs in every
layout the ops accept (contiguous, transposed views, strided).

Plain PyTorch; it does not import attn_ext.
"""

from __future__ import annotations

from typing import Sequence

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- #
# Float64 ground truth
# --------------------------------------------------------------------------- #
def to_f64(x):
    """Float64 copies of floating tensors (in lists and tuples too); other values as they are."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(torch.float64)
    if isinstance(x, (list, tuple)):
        return type(x)(to_f64(y) for y in x)
    return x


def ground_truth(fn, *args, **kwargs):
    """Run a reference on float64 copies of every floating tensor argument
    (bool masks are passed as they are). The inputs are the values actually
    given to the kernel, so the truth is exact up to float64 rounding."""
    return fn(*to_f64(args), **{k: to_f64(v) for k, v in kwargs.items()})


def autograd_grads(fn, inputs: Sequence[torch.Tensor], grad_out, **kwargs):
    """Gradients of <fn(*inputs, **kwargs), grad_out> w.r.t. inputs (fresh leaves)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def ground_truth_grads(fn, inputs, grad_out, **kwargs):
    return autograd_grads(
        fn, to_f64(list(inputs)), to_f64(grad_out), **{k: to_f64(v) for k, v in kwargs.items()}
    )


# --------------------------------------------------------------------------- #
# Numerics rule (design.md): error against the float64 truth, at most twice
# the error of the plain PyTorch reference run at the same dtype.
# --------------------------------------------------------------------------- #
F64_RTOL = 1e-10
F64_ATOL = 1e-10


def _check_nonfinite(actual, truth, name):
    a_nan, t_nan = torch.isnan(actual), torch.isnan(truth)
    assert torch.equal(a_nan, t_nan), f"{name}: NaN pattern differs from the truth"
    t_inf = torch.isinf(truth)
    assert torch.equal(torch.isinf(actual), t_inf), f"{name}: inf pattern differs from the truth"
    if t_inf.any():
        assert torch.equal(actual[t_inf], truth[t_inf]), f"{name}: wrong sign of inf"


def max_abs_err(x, truth) -> float:
    x = x.detach().to(torch.float64)
    truth = truth.detach().to(torch.float64)
    fin = torch.isfinite(truth)
    if not fin.any():
        return 0.0
    return (x[fin] - truth[fin]).abs().max().item()


def assert_error_rule(
    actual,
    ref_same_dtype,
    truth,
    *,
    name="out",
    factor=2.0,
    slack_ulps: float = 1.0,
    floor: float = 0.0,
):
    """err(actual) <= factor * err(ref_same_dtype) + slack, errors = max-abs
    difference to the float64 truth over the finite entries (non-finite entries
    must match the truth exactly; the reference's error skips entries where it
    alone is non-finite). float64 results must equal the truth to
    ~1e-10 instead.

    slack = slack_ulps * eps(actual.dtype) * max(1, max|truth|): one rounding
    unit of the result dtype at the scale of the result. Reason: the kernel
    rounds its fp32 accumulator to the output dtype once, which the reference
    can avoid by luck (e.g. rows whose probabilities are exactly 0/1 give the
    reference zero error), so a pure 2x rule would demand bit-exactness there.
    ``floor`` raises the slack to an absolute value (``perturbation_floor``: the
    problem's conditioning, for drawn problems).
    """
    truth = truth.detach().to(torch.float64)
    assert tuple(actual.shape) == tuple(truth.shape), (
        f"{name}: shape {tuple(actual.shape)} != {tuple(truth.shape)}"
    )
    a64 = actual.detach().to(torch.float64).cpu()
    truth = truth.cpu()
    _check_nonfinite(a64, truth, name)
    if actual.dtype == torch.float64:
        fin = torch.isfinite(truth)
        torch.testing.assert_close(
            a64[fin],
            truth[fin],
            rtol=F64_RTOL,
            atol=F64_ATOL,
            msg=lambda m: f"{name} (float64): {m}",
        )
        return
    err_a = max_abs_err(a64, truth)
    # The plain reference's error over the entries it got finite: where it overflows or gives
    # NaN and the truth is finite (float16 gradients of 1 / (phi(q) . z + eps) with phi(q) = 0,
    # found by the --fuzz runs), it breaks down rather than rounds, and its error there (inf or
    # NaN, which failed every kernel) bounds nothing; the kernel is held to the bound set by the
    # reference's other entries there too.
    ref64 = ref_same_dtype.detach().to(torch.float64).cpu()
    err_r = max_abs_err(ref64, truth.masked_fill(~torch.isfinite(ref64), float("nan")))
    fin = torch.isfinite(truth)
    mag = truth[fin].abs().max().item() if fin.any() else 0.0
    slack = max(slack_ulps * torch.finfo(actual.dtype).eps * max(1.0, mag), floor)
    assert err_a <= factor * err_r + slack, (
        f"{name} ({actual.dtype}): kernel error {err_a:.3e} > {factor} x reference error "
        f"{err_r:.3e} + slack {slack:.3e}"
    )


def perturbation_floor(fn, inputs, dtype, *, ulps: float = 32.0, seed: int = 0, **kwargs):
    """A floor for the error rule from the problem's conditioning: ``ulps`` times how far the
    float64 result of ``fn`` moves when every floating tensor in ``inputs`` (a list; tensors in
    nested lists, tuples and dicts too) moves by one rounding unit of ``dtype`` (relative, random
    sign). Any implementation at ``dtype`` rounds its inputs' products and sums by about that
    much, so its error is a multiple of this change (up to the length of its sums, whatever
    their order): measured, the kernels' error minus 2x the reference's was at most 20x the
    change over 300 seeds at each shape the --fuzz runs flagged, hence ``ulps`` = 32.

    Why: the max-abs error of one small problem is luck-prone. Where a result cancels (a
    linear attention denominator near 0) or amplifies a rounding (softmax of scores far from
    1, a sum of large terms with a small total), the kernel's and the plain reference's errors
    are both of this size and their ratio falls anywhere: tests/test_fuzz.py's --fuzz runs
    found single examples at 4-140x while the median ratio over seeds was 0.5-1.3x. Used by
    the property fuzzing, where shapes and scales are drawn; the suite's chosen cases keep
    the plain rule."""
    gen = torch.Generator().manual_seed(seed)
    eps = torch.finfo(dtype).eps

    def nudge(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x64 = x.detach().to(torch.float64).cpu()
            u = 2 * torch.rand(x64.shape, generator=gen, dtype=torch.float64) - 1
            return (x64 * (1 + eps * u)).to(x.device)
        if isinstance(x, (list, tuple)):
            return type(x)(nudge(y) for y in x)
        if isinstance(x, dict):  # a weight dict (attn_ext.testing.mla)
            return {k: nudge(v) for k, v in x.items()}
        return x

    def first(r):
        return r[0] if isinstance(r, (list, tuple)) else r

    base = first(ground_truth(fn, *inputs, **kwargs))
    moved = first(fn(*nudge(list(inputs)), **{k: to_f64(v) for k, v in kwargs.items()}))
    return ulps * max_abs_err(moved, base)


def grad_slack_ulps(dtype) -> float:
    """Slack (in ulps of max|truth|) for gradients.

    float32 is looser (4 ulps): the kernel's backward recomputes the
    probabilities as exp(scale * q.k - lse) from the saved float32 lse, a
    relative error of ~|s| * eps per probability that torch's autograd (which
    keeps the forward's probabilities) does not have, and every gradient is a
    reduction over Sq or Sk such terms. On the small tensors of the tests
    the max-abs error of the reference is itself often only ~1 ulp, so a pure
    2x rule measures luck. bf16/fp16 keep one ulp: there the reference's own
    rounding to the low-precision dtype dominates by far.
    """
    return 4.0 if dtype == torch.float32 else 1.0


def assert_lse_close(lse, ref_lse_same_dtype, truth_lse, *, name="lse"):
    """lse is float32 for every input dtype. Rule as above with the reference's
    lse stored in float32, and a slack of 4 float32 ulps at |lse| (the lse is
    only as exact as a float32 log/sum of exponentials: a few roundings)."""
    assert lse.dtype == torch.float32, f"{name}: dtype {lse.dtype}, expected float32"
    ref32 = ref_lse_same_dtype.detach().float()
    assert_error_rule(lse, ref32, truth_lse, name=name, slack_ulps=4.0)


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #
def rand(shape, dtype, device, layout="contiguous", requires_grad=False, scale=1.0):
    """Random normal tensor of logical shape (B, H, S, D) (or any shape for
    layout='contiguous').

    layout:
      'contiguous'  plain tensor;
      'bshd'        made as (B, S, H, D) then transpose(1, 2) (4-D only): the
                    layout of a projected sequence, last dim contiguous;
      'noncontig'   every other element of a wider last dim (stride 2 in D);
      'expand_b'    batch dim broadcast with stride 0 (4-D only).
    """
    shape = tuple(shape)
    if layout == "contiguous":
        x = torch.randn(shape, device=device) * scale
        x = x.to(dtype)
    elif layout == "bshd":
        b, h, s, d = shape
        x = (torch.randn(b, s, h, d, device=device) * scale).to(dtype).transpose(1, 2)
    elif layout == "noncontig":
        *lead, d = shape
        x = (torch.randn(*lead, 2 * d, device=device) * scale).to(dtype)[..., ::2]
    elif layout == "expand_b":
        b = shape[0]
        x = (torch.randn(1, *shape[1:], device=device) * scale).to(dtype).expand(b, *shape[1:])
    else:
        raise ValueError(layout)
    assert tuple(x.shape) == shape
    if requires_grad:
        x.requires_grad_(True)
    return x


def make_qkv(
    B,
    H,
    Hkv,
    Sq,
    Sk,
    D,
    Dv=None,
    *,
    dtype=torch.float32,
    device="cpu",
    layout="contiguous",
    requires_grad=False,
):
    Dv = D if Dv is None else Dv
    q = rand((B, H, Sq, D), dtype, device, layout, requires_grad)
    k = rand((B, Hkv, Sk, D), dtype, device, layout, requires_grad)
    v = rand((B, Hkv, Sk, Dv), dtype, device, layout, requires_grad)
    return q, k, v


def random_bool_mask(shape, device, p_keep=0.7, ensure_row=True):
    """Random keep mask; with ensure_row the last dim has at least one True."""
    m = torch.rand(shape, device=device) < p_keep
    if ensure_row and m.shape[-1] > 0:
        m[..., 0] = True
    return m


def random_float_mask(shape, dtype, device, p_neg_inf=0.2, ensure_row=True):
    """Additive mask: normal values with some -inf entries."""
    m = torch.randn(shape, device=device)
    m = m.masked_fill(torch.rand(shape, device=device) < p_neg_inf, float("-inf"))
    if ensure_row and m.shape[-1] > 0:
        m[..., 0] = 0.0
    return m.to(dtype)
