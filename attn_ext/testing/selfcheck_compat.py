"""The compat half of ``python -m attn_ext``: each :mod:`attn_ext.compat` class or function
against its document's code (:mod:`attn_ext.testing.documents`), built with the same arguments,
ours loaded strictly from the document's state dict; the output and the gradients of every input
and parameter compared in float64 (to the document in float64) and in float32 (to the document in
float64, within twice the document's own float32 error, the self-check's rule).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from attn_ext.compat import attention_zoo, llms_from_scratch, textbook, torchcode
from attn_ext.testing.documents import doc000, doc001, doc003, doc004, plain_state_dict, plain_to
from attn_ext.testing.selfcheck import ACC_ULPS, CheckResult, accumulation_floor, max_error

COMPAT_DTYPES = (torch.float64, torch.float32)
# In float64 both sides are exact up to rounding, so a bound this tight (relative to the result's
# magnitude) still catches any semantic difference, e.g. 004's float32 square root in the scale,
# which is 1e-8 relative.
COMPAT_F64_RTOL = 1e-10


@dataclass
class CompatCase:
    """One attn_ext.compat class or function against its document's reproduction.

    A class is built as ``document(*args)`` and ``ours(*args)``, ours loaded strictly from the
    document's state dict, and called with the inputs; a function is called with the inputs and
    ``kwargs(device)``. Inputs are ``0.5 * randn(shape)`` for each of ``shapes``; the output,
    every input's gradient and every parameter's gradient are compared.
    """

    name: str
    document: Callable
    ours: Callable
    shapes: Tuple[Tuple[int, ...], ...]
    args: Tuple = ()
    kwargs: Callable[[torch.device], dict] = lambda device: {}
    # float64 tolerance relative to the magnitude, where the document itself computes part of
    # its float64 result in float32 (default COMPAT_F64_RTOL: the document is exact in float64).
    # At the other dtypes it is also a floor: the document's float32 values (apply_rope's
    # frequency tables) and ours can differ by as much, which the truth, the document's own
    # arithmetic in float64, does not see.
    f64_rtol: Optional[float] = None


def _concat(fn):
    """A function returning a tuple of tensors, as one tensor (the checks compare one output)."""
    return lambda *xs, **kw: torch.cat(fn(*xs, **kw), dim=-1)


def compat_cases() -> List[CompatCase]:
    tc, lfs, tb, zoo = torchcode, llms_from_scratch, textbook, attention_zoo
    x, kv = (2, 7, 16), (2, 9, 16)  # (B, S, embed) for the modules; S_kv != S_q where allowed
    qkv3 = ((2, 7, 8), (2, 9, 8), (2, 9, 5))
    qkv4 = ((2, 3, 7, 8), (2, 3, 9, 8), (2, 3, 9, 5))
    same3 = ((2, 9, 8), (2, 9, 8), (2, 9, 5))
    return [
        CompatCase(
            "torchcode.scaled_dot_product_attention",
            doc000.scaled_dot_product_attention,
            tc.scaled_dot_product_attention,
            qkv4,
        ),
        CompatCase(
            "torchcode.MultiHeadAttention",
            doc000.MultiHeadAttention,
            tc.MultiHeadAttention,
            (x, kv, kv),
            args=(16, 4),
        ),
        CompatCase(
            "torchcode.causal_attention", doc000.causal_attention, tc.causal_attention, qkv3
        ),
        CompatCase(
            "torchcode.MultiHeadCrossAttention",
            doc000.MultiHeadCrossAttention,
            tc.MultiHeadCrossAttention,
            (x, kv),
            args=(16, 4),
        ),
        CompatCase(
            "torchcode.GroupQueryAttention",
            doc000.GroupQueryAttention,
            tc.GroupQueryAttention,
            (x,),
            args=(16, 8, 2),
        ),
        CompatCase(
            "torchcode.sliding_window_attention",
            doc000.sliding_window_attention,
            tc.sliding_window_attention,
            same3,
            kwargs=lambda device: {"window_size": 2},
        ),
        CompatCase(
            "torchcode.flash_attention",
            doc000.flash_attention,
            tc.flash_attention,
            ((2, 37, 8),) * 3,
            kwargs=lambda device: {"block_size": 16},
        ),
        # The document's cos/sin tables are float32 for any input (angle error ~ position x 2^-24),
        # while attn_ext takes cos/sin of the same fp32 angles in float64 for float64 inputs.
        CompatCase(
            "torchcode.apply_rope (q_rot, k_rot)",
            _concat(doc000.apply_rope),
            _concat(tc.apply_rope),
            ((2, 37, 16), (2, 37, 16)),
            f64_rtol=37 * 2.0**-22,
        ),
        CompatCase(
            "torchcode.linear_attention",
            doc000.linear_attention,
            tc.linear_attention,
            ((2, 37, 8), (2, 37, 8), (2, 37, 5)),
        ),
        CompatCase(
            "llms_from_scratch.simplified_self_attention",
            doc001.simplified_self_attention,
            lfs.simplified_self_attention,
            ((6, 3),),
        ),
        CompatCase(
            "llms_from_scratch.SelfAttention_v1",
            doc001.SelfAttention_v1,
            lfs.SelfAttention_v1,
            ((7, 16),),
            args=(16, 8),
        ),
        CompatCase(
            "llms_from_scratch.SelfAttention_v2",
            doc001.SelfAttention_v2,
            lfs.SelfAttention_v2,
            ((7, 16),),
            args=(16, 8),
        ),
        CompatCase(
            "llms_from_scratch.CausalAttention",
            doc001.CausalAttention,
            lfs.CausalAttention,
            (x,),
            args=(16, 8, 12, 0.0),
        ),
        CompatCase(
            "llms_from_scratch.MultiHeadAttentionWrapper",
            doc001.MultiHeadAttentionWrapper,
            lfs.MultiHeadAttentionWrapper,
            (x,),
            args=(16, 8, 12, 0.0, 3),
        ),
        CompatCase(
            "llms_from_scratch.MultiHeadAttention",
            doc001.MultiHeadAttention,
            lfs.MultiHeadAttention,
            (x,),
            args=(16, 12, 12, 0.0, 3, True),
        ),
        CompatCase(
            "textbook.attention",
            doc003.attention,
            tb.attention,
            qkv4,
            kwargs=lambda device: {
                "mask": torch.ones(7, 9, dtype=torch.bool, device=device).tril(2)
            },
        ),
        CompatCase(
            "textbook.repeat_kv",
            doc003.repeat_kv,
            tb.repeat_kv,
            ((2, 3, 5, 4),),
            kwargs=lambda device: {"n_rep": 2},
        ),
        CompatCase(
            "attention_zoo.SelfAttention",
            doc004.SelfAttention,
            zoo.SelfAttention,
            (x,),
            args=(16, 6),
        ),
        CompatCase(
            "attention_zoo.MultiHeadAttention",
            doc004.MultiHeadAttention,
            zoo.MultiHeadAttention,
            (x,),
            args=(16, 4, 24),
        ),
        CompatCase(
            "attention_zoo.CrossAttention",
            doc004.CrossAttention,
            zoo.CrossAttention,
            (x, kv),
            args=(16, 6),
        ),
        CompatCase(
            "attention_zoo.GroupedAttention",
            doc004.GroupedAttention,
            zoo.GroupedAttention,
            (x,),
            args=(16, 24, 6, 2),
        ),
        CompatCase(
            "attention_zoo.SpatialAttention",
            doc004.SpatialAttention,
            zoo.SpatialAttention,
            ((2, 3, 16, 16),),
        ),
        CompatCase(
            "attention_zoo.TemporalAttention (out, weights)",
            doc004.TemporalAttention,
            zoo.TemporalAttention,
            (x, (2, 1, 8)),
            args=(16, 12, 8),
        ),
    ]


def compat_candidates(case: CompatCase, device: torch.device, dtype: torch.dtype):
    """(callable, parameters by name) for the document at ``dtype``, the document in float64 (the
    same rounded weights: the ground truth) and ours at ``dtype`` loaded strictly."""
    if not isinstance(case.document, type):
        kw = case.kwargs(device)
        return [
            ((lambda *xs, fn=fn: fn(*xs, **kw)), {})
            for fn in (case.document, case.document, case.ours)
        ]
    doc = case.document(*case.args)
    plain = not isinstance(doc, torch.nn.Module)  # document 000's plain classes

    def cast(obj, to):
        return plain_to(obj, device, to) if plain else obj.to(device=device, dtype=to)

    def params(obj):
        return plain_state_dict(obj) if plain else dict(obj.named_parameters())

    doc = cast(doc, dtype)
    exact = cast(copy.deepcopy(doc), torch.float64)
    ours = case.ours(*case.args).to(device=device, dtype=dtype)
    ours.load_state_dict(plain_state_dict(doc) if plain else doc.state_dict(), strict=True)
    if set(params(ours)) != set(params(doc)):
        raise RuntimeError(
            f"parameters differ: ours {sorted(params(ours))}, document {sorted(params(doc))}"
        )
    return [(obj.forward, params(obj)) for obj in (doc, exact, ours)]


def _one_output(out):
    """A tuple of outputs (e.g. (output, attn_weights)) as one tensor along the last dim."""
    return torch.cat(out, dim=-1) if isinstance(out, tuple) else out


def compat_forward_backward(fn, params, inputs, grad_out) -> Dict[str, torch.Tensor]:
    """The output and the gradients of (out * grad_out).sum(), by label: out, dx<i>, d<param>."""
    xs = [x.detach().requires_grad_() for x in inputs]
    out = _one_output(fn(*xs))
    names = sorted(params)
    grads = torch.autograd.grad(
        (out * grad_out.to(out.dtype)).sum(), xs + [params[n] for n in names]
    )
    labels = ["out"] + [f"dx{i}" for i in range(len(xs))] + [f"d{n}" for n in names]
    return dict(zip(labels, [out.detach(), *grads]))


def run_compat_case(
    case: CompatCase,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    grad_floor_ulps: float = 0.0,
) -> CheckResult:
    """The case at one dtype; ``seed`` seeds the weights, inputs and output gradient
    (tests/test_fuzz.py draws it). ``grad_floor_ulps`` raises the float32 floor of the
    gradients to that many ulps of their magnitude (the fuzz's drawn shapes include rows that
    see one key, where the document's gradient of q and k is exactly 0 and ours is a
    rounding: tests/test_fuzz.py's GRAD_ULPS_F32)."""
    res = CheckResult(case.name, str(device), str(dtype).replace("torch.", ""))
    torch.manual_seed(seed)
    try:
        (doc, doc_p), (exact, exact_p), (ours, ours_p) = compat_candidates(case, device, dtype)
        inputs = [0.5 * torch.randn(s, device=device, dtype=dtype) for s in case.shapes]
        exact_inputs = [x.double() for x in inputs]  # ground truth sees the rounded inputs
        with torch.no_grad():
            out_shape = _one_output(exact(*exact_inputs)).shape
        grad_out = torch.randn(out_shape, device=device, dtype=dtype).double()
        want = compat_forward_backward(exact, exact_p, exact_inputs, grad_out)
        base = compat_forward_backward(doc, doc_p, inputs, grad_out)
        got = compat_forward_backward(ours, ours_p, inputs, grad_out)
    except Exception as e:  # a crash (including a failed strict load) is a failed check
        res.exception = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return res
    for label, w in want.items():
        g, b = got[label], base[label]
        if g.shape != b.shape or g.dtype != b.dtype:
            res.exception = (
                f"{label}: {g.dtype} {tuple(g.shape)}, document gives {b.dtype} {tuple(b.shape)}"
            )
            return res
        if dtype == torch.float64:
            finite = w.abs().masked_fill(w.isinf(), 0)
            tol = (case.f64_rtol or COMPAT_F64_RTOL) * max(
                1.0, finite.max().item() if finite.numel() else 0.0
            )
        else:
            floor = accumulation_floor(w)
            if label != "out" and grad_floor_ulps:
                floor = max(floor, floor * grad_floor_ulps / ACC_ULPS)
            if case.f64_rtol:
                finite = w.abs().masked_fill(w.isinf(), 0)
                magnitude = finite.max().item() if finite.numel() else 0.0
                floor = max(floor, case.f64_rtol * magnitude)
            tol = 2 * max_error(b, w) + floor
        res.errors[label] = (max_error(g, w), tol)
    return res


def format_compat_row(by_dtype: Sequence[CheckResult]) -> str:
    """One line per class: per dtype the worst (error, tolerance) pair and what it was for."""
    ok = all(r.ok for r in by_dtype)
    cells = []
    for r in by_dtype:
        if r.exception:
            cells.append(f"{r.dtype} {r.exception}")
            continue
        label = max(
            r.errors, key=lambda k: r.errors[k][0] / r.errors[k][1] if r.errors[k][1] else math.inf
        )
        err, tol = r.errors[label]
        cells.append(
            f"{r.dtype:7s} {err:7.1e} {'<=' if err <= tol else '> '} {tol:7.1e} {label:23s}"
        )
    row = f"{'PASS' if ok else 'FAIL'}  {by_dtype[0].device:4s} {by_dtype[0].name:44s} " + " ".join(
        cells
    )
    return row.rstrip()


def run_compat_checks(devices: Sequence[torch.device]) -> bool:
    print(
        "\ncompat: each attn_ext.compat class/function vs its document's code "
        "(attn_ext.testing.documents),\n"
        "same arguments, document's state dict loaded strictly; output and input/parameter "
        "gradients,\n"
        "the worst of them shown as max abs error <= tolerance (what). float64: vs the document,\n"
        f"tol {COMPAT_F64_RTOL:.0e} x magnitude; float32: vs the document in float64, "
        f"tol 2 x the document's own float32 error + {ACC_ULPS} float32 ulps"
    )
    rows = []
    for device in devices:
        for case in compat_cases():
            rows.append([run_compat_case(case, device, dtype) for dtype in COMPAT_DTYPES])
            print(format_compat_row(rows[-1]), flush=True)
    failed = [r for r in rows if not all(x.ok for x in r)]
    print(f"{len(rows) - len(failed)}/{len(rows)} compat classes/functions passed")
    return not failed
