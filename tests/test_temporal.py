"""Temporal attention: document 004's TemporalAttention (the drop-in) and the canonical
multi-head attn_ext.nn.TemporalAttention against references that build the time matrix T
explicitly and materialize the scores (attn_ext/testing/spatial.py, documents.doc004).

Tolerances: float64 agrees to rounding (1e-10: the drop-in forms T^T T as S E^T E and the norm
as sqrt(S) ||E||, the document sums S copies). float32 is loose (2e-4 relative): the kernel's
blocked online softmax rounds differently from torch's matmul + softmax, and the scores here are
scaled up by sqrt(S) by the formula itself.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attn_ext
import attn_ext.compat.attention_zoo as zoo
from attn_ext.testing import spatial as ref
from attn_ext.testing.documents import doc004

TOL64 = dict(rtol=1e-10, atol=1e-10)
TOL32 = dict(rtol=2e-4, atol=2e-5)


def build_zoo(device, dtype, args=(24, 16, 8)):
    doc = doc004.TemporalAttention(*args).to(device=device, dtype=dtype)
    ours = zoo.TemporalAttention(*args)
    ours.load_state_dict(doc.state_dict(), strict=True)
    return doc, ours.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(
    "tp_shape", [(2, 1, 8), (2, 3, 8), (1, 1, 8)], ids=["per_seq", "three_points", "batch1"]
)
@pytest.mark.parametrize("seq_len", [1, 7, 33])
def test_zoo_temporal_matches_document(device, dtype, tp_shape, seq_len):
    doc, ours = build_zoo(device, dtype)
    # a small scale keeps the document's sqrt(S)-growing scores in a range where float32
    # softmax is well conditioned
    x = (0.3 * torch.randn(2, seq_len, 24, device=device, dtype=dtype)).requires_grad_(True)
    tp = torch.randn(tp_shape, device=device, dtype=dtype).requires_grad_(True)
    out_d, w_d = doc(x, tp)
    out_o, w_o = ours(x, tp)
    tol = TOL64 if dtype == torch.float64 else TOL32
    assert out_o.shape == out_d.shape == (2, seq_len, 16) and w_o.shape == w_d.shape == (
        2,
        seq_len,
        seq_len,
    )
    torch.testing.assert_close(out_o, out_d, **tol)
    torch.testing.assert_close(w_o, w_d, **tol)
    go, gw = torch.randn_like(out_d), torch.randn_like(w_d)
    leaves_d = [x, tp] + list(doc.parameters())
    leaves_o = [x, tp] + list(ours.parameters())
    gd = torch.autograd.grad((out_d * go).sum() + (w_d * gw).sum(), leaves_d)
    g_o = torch.autograd.grad((out_o * go).sum() + (w_o * gw).sum(), leaves_o)
    for name, a, b in zip(["x", "time_points"] + [n for n, _ in doc.named_parameters()], g_o, gd):
        torch.testing.assert_close(
            a,
            b,
            **(TOL64 if dtype == torch.float64 else dict(rtol=1e-3, atol=1e-4)),
            msg=lambda m, name=name: f"grad of {name}: {m}",
        )


def test_zoo_temporal_without_weights(device):
    doc, ours = build_zoo(device, torch.float64)
    x = torch.randn(2, 9, 24, device=device, dtype=torch.float64)
    tp = torch.randn(2, 1, 8, device=device, dtype=torch.float64)
    out, w = ours(x, tp, need_weights=False)
    assert w is None
    torch.testing.assert_close(out, doc(x, tp)[0], **TOL64)


def test_zoo_temporal_state_dict_keys():
    doc, ours = build_zoo("cpu", torch.float32)
    assert list(ours.state_dict()) == list(doc.state_dict())


def test_zoo_temporal_gradcheck(device):
    _, ours = build_zoo(device, torch.float64, args=(6, 4, 3))
    x = torch.randn(2, 5, 6, dtype=torch.float64, device=device, requires_grad=True)
    tp = torch.randn(2, 1, 3, dtype=torch.float64, device=device, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: ours(a, b), (x, tp))


# ------------------------------------------------------------------------------ canonical


def canonical(device, dtype, E=32, H=4, Et=8):
    return attn_ext.nn.TemporalAttention(E, H, Et).to(device=device, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tp_kind", ["2d", "per_seq", "per_token", "batch1"])
def test_canonical_temporal_matches_reference(device, tp_kind, causal):
    m = canonical(device, torch.float64)
    B, S = 2, 11
    x = (0.5 * torch.randn(B, S, 32, dtype=torch.float64, device=device)).requires_grad_(True)
    tp = {"2d": (B, 8), "per_seq": (B, 1, 8), "per_token": (B, S, 8), "batch1": (1, 1, 8)}[tp_kind]
    tp = torch.randn(tp, dtype=torch.float64, device=device, requires_grad=True)
    out, w = m(x, tp, causal=causal, need_weights=True)
    r_out, r_w = ref.temporal_multihead(m, x, tp, causal=causal)
    torch.testing.assert_close(out, r_out, **TOL64)
    torch.testing.assert_close(w, r_w, **TOL64)
    assert w.shape == (B, 4, S, S)
    out2 = m(x, tp, causal=causal)
    # With weights the output is weights @ v; without, the flash kernel: same math, so the two
    # agree to float64 rounding.
    torch.testing.assert_close(out2, out, **TOL64)
    leaves = [x, tp] + list(m.parameters())
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out2, leaves, g), torch.autograd.grad(r_out, leaves, g)):
        torch.testing.assert_close(a, b, **TOL64)


def test_canonical_temporal_bfloat16(device):
    m = canonical(device, torch.bfloat16)
    x = torch.randn(2, 19, 32, device=device, dtype=torch.bfloat16)
    tp = torch.randn(2, 1, 8, device=device, dtype=torch.bfloat16)
    out = m(x, tp)
    m64 = canonical(device, torch.float64)
    m64.load_state_dict(m.state_dict())
    truth, _ = ref.temporal_multihead(m64, x.double(), tp.double())
    ref_lo, _ = ref.temporal_multihead(m, x, tp)
    err = (out.double() - truth).abs().max().item()
    ref_err = (ref_lo.double() - truth).abs().max().item()
    assert out.dtype == torch.bfloat16 and err <= 2 * ref_err + 1e-2, (err, ref_err)


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_canonical_temporal_memory_linear_without_weights():
    m = canonical("cpu", torch.float32, E=16, H=2, Et=4)
    S = 2048
    x = torch.randn(1, S, 16, requires_grad=True)
    tp = torch.randn(1, 1, 4)
    with MaxNumel() as rec:
        m(x, tp).sum().backward()
    assert rec.max_numel < 64 * S, f"an op produced {rec.max_numel} elements (S*S = {S * S})"
    with MaxNumel() as rec:
        m(x, tp, need_weights=True)
    assert rec.max_numel >= S * S  # the check above can fail


# ------------------------------------------------------------------------------ bad input


def test_bad_input_messages(device):
    _, z = build_zoo(device, torch.float32)
    x = torch.randn(2, 5, 24, device=device)
    tp = torch.randn(2, 1, 8, device=device)
    with pytest.raises(ValueError, match=r"TemporalAttention: expected a 3-D input x"):
        z(x[0], tp)
    with pytest.raises(ValueError, match="x must have last dimension 24"):
        z(torch.randn(2, 5, 23, device=device), tp)
    with pytest.raises(ValueError, match="time_points must have last dimension 8"):
        z(x, torch.randn(2, 1, 7, device=device))
    with pytest.raises(ValueError, match="expected a 3-D input time_points"):
        z(x, torch.randn(2, 8, device=device))
    with pytest.raises(ValueError, match="time_points must have batch size 1 or 2"):
        z(x, torch.randn(3, 1, 8, device=device))
    m = canonical(device, torch.float32)
    x = torch.randn(2, 5, 32, device=device)
    with pytest.raises(ValueError, match="x must be 3-D"):
        m(x[0], torch.randn(2, 8, device=device))
    with pytest.raises(ValueError, match="x must have last dimension embed_dim=32"):
        m(torch.randn(2, 5, 31, device=device), torch.randn(2, 8, device=device))
    with pytest.raises(ValueError, match="time_points must have last dimension time_emb_dim=8"):
        m(x, torch.randn(2, 1, 9, device=device))
    with pytest.raises(ValueError, match=r"time_points must be \(B or 1, 1 or S, time_emb_dim\)"):
        m(x, torch.randn(2, 3, 8, device=device))
    with pytest.raises(ValueError, match="divisible by num_heads"):
        attn_ext.nn.TemporalAttention(30, 4, 8)
