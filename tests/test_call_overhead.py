"""What keeps a small call cheap (docs/performance.md, "Per-call overhead").

1. Autograd of every differentiable op is the C++ kernel of csrc/<family>/autograd.cpp.
   torch.library.register_autograd (the Python route) cost ~40 us per call with a graph and
   ~4 us without on torch 2.13 (csrc/common/autograd.h), which made small-shape training slower
   than SDPA. These tests fail if an op's autograd goes back through Python: a forward and
   backward of each op may run no Python code of torch's autograd.Function machinery. Gradient
   values are tested per op elsewhere (gradcheck, opcheck, the reference comparisons).
2. The package calls the ops through attn_ext._ops, which passes only the arguments that differ
   from the schema's defaults, and never drops one that does.
"""

import sys

import pytest
import torch

import attn_ext  # noqa: F401  (registers the ops)
from attn_ext._ops import _Op

ops = torch.ops.attn_ext

# Python frames that would mean an op's autograd runs in Python.
PYTHON_AUTOGRAD_FILES = ("torch/_library/autograd.py", "torch/autograd/function.py")


def _leaf(*shape):
    return torch.randn(*shape).requires_grad_()


def _attention(q, k, v):
    return ops.attention(q, k, v, sinks=torch.zeros(2, requires_grad=True), causal=True)


def _varlen(q, k, v):
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    return ops.attention_varlen(q, k, v, cu, cu, max_seqlen_q=3, max_seqlen_k=3)


def _probabilities(q, k, **kw):
    lse = ops.attention(q.detach(), k.detach(), k.detach())[1]
    return (ops.attention_probabilities(q, k, lse, **kw),)


def _merge(out_a, out_b):
    return ops.merge_attention_states(out_a, torch.randn(1, 2, 5), out_b, torch.randn(1, 2, 5))


def _tpa_decode(q, a_k, b_k, a_v, b_v):
    return ops.tpa_decode_attention(q, a_k, b_k, a_v, b_v, torch.tensor([6], dtype=torch.int32))


QKV = ((1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8))
# (name, the op's call returning its float outputs, the shapes of its differentiable inputs)
SAMPLES = [
    ("attention", _attention, QKV),
    ("attention_varlen", _varlen, ((5, 2, 8),) * 3),
    ("attention_weights", lambda q, k: (ops.attention_weights(q, k),), QKV[:2]),
    ("attention_probabilities", _probabilities, QKV[:2]),
    (
        "attention_probabilities_mean_dropout",
        lambda q, k: _probabilities(
            q, k, rng_state=torch.tensor([7, 0]), dropout_p=0.25, mean_heads=True
        ),
        QKV[:2],
    ),
    ("merge_attention_states", _merge, QKV[:1] * 2),
    ("rope", lambda x: (ops.rope(x, offset=3),), QKV[:1]),
    (
        "linear_attention",
        lambda q, k, v: ops.linear_attention(q, k, v, causal=True),
        QKV[1:] + QKV[2:],
    ),
    ("channel_pool", lambda x: ops.channel_pool(x)[:1], ((2, 3, 4, 5),)),
    ("spatial_gate", lambda x, gate: (ops.spatial_gate(x, gate),), ((2, 3, 4, 5), (2, 1, 4, 5))),
    ("tpa_expand", lambda a, b: (ops.tpa_expand(a, b),), ((1, 3, 2, 4), (1, 3, 2, 8))),
    ("tpa_decode_attention", _tpa_decode, ((1, 4, 1, 8),) + ((1, 6, 2, 4), (1, 6, 2, 8)) * 2),
]


@pytest.mark.parametrize("name,call,shapes", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_autograd_runs_no_python(name, call, shapes):
    leaves = [_leaf(*shape) for shape in shapes]
    files = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename.replace("\\", "/"))

    sys.setprofile(profile)
    try:
        loss = sum(out.sum() for out in call(*leaves))
        grads = torch.autograd.grad(loss, leaves)
    finally:
        sys.setprofile(None)
    assert all(g is not None and g.abs().sum() > 0 for g in grads), f"{name}: a zero gradient"
    python_autograd = sorted(f for f in files if f.endswith(PYTHON_AUTOGRAD_FILES))
    assert not python_autograd, f"{name}: autograd ran Python code in {python_autograd}"


def test_no_graph_call_refuses_nothing():
    # A mask that requires grad is refused only when a graph is recorded: under no_grad the
    # call is a plain forward, as before autograd moved to C++.
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.zeros(4, 4, requires_grad=True)
    with torch.no_grad():
        out, _ = ops.attention(q, k, v, attn_mask=mask)
    assert not out.requires_grad and out.grad_fn is None
    with pytest.raises(NotImplementedError, match="attn_mask"):
        ops.attention(q.requires_grad_(), k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "name,value,dropped",
    [
        ("scale", None, True),  # default None
        ("causal", False, True),  # default False
        ("window_left", -1, True),
        ("dropout_p", 0.0, True),
        ("causal", True, False),
        ("dropout_p", 0, False),  # another type is passed as given: the schema decides
        ("window_left", 3, False),
        ("dropout_p", None, False),
        ("scale", 0.0, False),
        ("dropout_p", torch.tensor(0.0), False),  # never a tensor
        ("causal", torch.tensor(False), False),
    ],
)
def test_op_drops_only_the_default_itself(name, value, dropped):
    calls = []
    op = _Op(torch.ops.attn_ext.attention)
    op._op = lambda *args, **kwargs: calls.append(kwargs)
    op(1, 2, 3, **{name: value})
    assert (name not in calls[0]) is dropped
    if not dropped:
        assert calls[0][name] is value


def test_op_passes_required_arguments():
    calls = []
    op = _Op(torch.ops.attn_ext.attention_varlen)
    op._op = lambda *args, **kwargs: calls.append(kwargs)
    op(1, 2, 3, 4, 5, max_seqlen_q=0, max_seqlen_k=None, causal=False)
    assert calls[0] == {"max_seqlen_q": 0, "max_seqlen_k": None}


def test_op_passes_only_what_differs():
    calls = []
    op = _Op(torch.ops.attn_ext.attention)
    op._op = lambda *args, **kwargs: calls.append((len(args), kwargs))
    mask = torch.zeros(2, 2)
    op(1, 2, 3, attn_mask=None, sinks=None, scale=None, causal=True, window_left=-1, softcap=0.0)
    op(1, 2, 3, attn_mask=mask, scale=0.5, causal=False, dropout_p=0.1, window_right=2)
    assert calls[0] == (3, {"causal": True})
    assert calls[1][1].keys() == {"attn_mask", "scale", "dropout_p", "window_right"}
    assert calls[1][1]["attn_mask"] is mask


def test_ops_cover_every_registered_operator():
    from attn_ext._ops import ops as wrapped

    names = [
        n.split("::", 1)[1]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("attn_ext::")
    ]
    assert len(names) >= 20
    assert all(isinstance(getattr(wrapped, n), _Op) for n in names)
