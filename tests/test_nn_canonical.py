"""attn_ext.nn.MultiHeadAttention (the canonical layer) against a plain reference written here:
the four projections, GQA by repeat_interleave of the key/value heads, bottom-right causal /
sliding-window band and attn_mask applied to the scores, a softmax whose fully masked rows are
zero, then the output projection."""

import math

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import attn_ext
import attn_ext.nn  # noqa: F401  (in case the package does not import it)
from attn_ext.nn import MultiHeadAttention

F64 = dict(rtol=1e-10, atol=1e-10)
# float32: the kernel's blocked online softmax and torch's softmax round differently; a few
# ulps through four projections and the backward.
F32 = dict(rtol=2e-5, atol=2e-5)


def reference(m, query, key=None, value=None, attn_mask=None):
    """Plain PyTorch: returns (out, per-head probabilities (B, H, Sq, Sk))."""
    key = query if key is None else key
    value = key if value is None else value
    if not m.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    B, Sq, _ = query.shape
    Sk = key.shape[1]
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    q = F.linear(query, m.q_proj.weight, m.q_proj.bias).reshape(B, Sq, H, D).transpose(1, 2)
    k = F.linear(key, m.k_proj.weight, m.k_proj.bias).reshape(B, Sk, Hkv, D).transpose(1, 2)
    v = F.linear(value, m.v_proj.weight, m.v_proj.bias).reshape(B, Sk, Hkv, D).transpose(1, 2)
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    # bottom-right band: query i sits at key position i + Sk - Sq
    left, right = m.window_size
    if m.causal:
        right = 0
    i = torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq)
    j = torch.arange(Sk, device=q.device)[None, :]
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            scores = scores + attn_mask
    scores = scores.masked_fill(~keep, float("-inf"))
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = (probs @ v).transpose(1, 2).reshape(B, Sq, H * D)
    out = F.linear(out, m.out_proj.weight, m.out_proj.bias)
    if not m.batch_first:
        out = out.transpose(0, 1)
    return out, probs


# name: (module kwargs, (B, Sq, Sk), cross, mask kind)
CASES = {
    "self": (dict(), (2, 7, 7), False, None),
    "causal": (dict(causal=True), (2, 7, 7), False, None),
    "causal_prefill": (dict(causal=True), (2, 4, 9), True, None),
    "causal_sq_gt_sk": (dict(causal=True), (2, 9, 4), True, None),  # first rows see nothing
    "window": (dict(window_size=(2, 1)), (2, 9, 9), False, None),
    "causal_window": (dict(causal=True, window_size=(3, -1)), (1, 8, 11), True, None),
    "gqa": (dict(num_heads=4, num_kv_heads=2, causal=True), (2, 6, 6), False, None),
    "mqa": (dict(num_heads=4, num_kv_heads=1), (2, 5, 8), True, None),
    "cross_kdim_vdim": (dict(kdim=6, vdim=10), (2, 5, 8), True, None),
    "gqa_cross_kdim": (dict(num_heads=4, num_kv_heads=2, kdim=6, vdim=10), (2, 5, 8), True, None),
    "bool_mask": (dict(), (2, 6, 8), True, "bool"),
    "float_mask": (dict(num_heads=4, num_kv_heads=2), (2, 6, 8), True, "float"),
    "causal_bool_mask": (dict(causal=True), (2, 7, 7), False, "bool"),
    "no_bias": (dict(bias=False, num_heads=4, num_kv_heads=1), (2, 5, 5), False, None),
    "seq_first": (dict(batch_first=False, causal=True), (3, 6, 6), False, None),
    "seq_first_cross": (
        dict(batch_first=False, kdim=6, num_heads=4, num_kv_heads=2),
        (3, 5, 7),
        True,
        "bool",
    ),
}
EMBED = 16


def _setup(case, device, dtype):
    kw, (B, Sq, Sk), cross, mask = CASES[case]
    kw = dict(kw)
    heads = kw.pop("num_heads", 2)
    m = MultiHeadAttention(EMBED, heads, device=device, dtype=dtype, **kw)
    with torch.no_grad():  # biases start at zero: make them matter
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))

    def t(s, width):
        shape = (B, s, width) if m.batch_first else (s, B, width)
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    query = t(Sq, EMBED)
    args = (query, t(Sk, m.kdim), t(Sk, m.vdim)) if cross else (query,)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(B, 1, Sq, Sk, device=device) < 0.7
        attn_mask[0, 0, 1] = False  # one fully masked row
    elif mask == "float":
        # float32-representable values: attn_ext reads a floating mask as float32 even for
        # float64 inputs (a kernel limitation, see test_nn_multihead_attention.py)
        attn_mask = torch.randn(B, m.num_heads, Sq, Sk, device=device).to(dtype)
    return m, args, attn_mask


def _grads(out, w, leaves, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)).sum()
    if w is not None:
        loss = loss + (w * torch.randn(w.shape, generator=g, dtype=w.dtype).to(w.device)).sum()
    return torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)


def _check(case, device, dtype, tol, need_weights):
    m, args, attn_mask = _setup(case, device, dtype)
    leaves = list(args) + list(m.parameters())
    res = m(*args, attn_mask=attn_mask, need_weights=need_weights)
    out, w = res if need_weights else (res, None)
    ref_out, ref_w = reference(m, *args, attn_mask=attn_mask)
    torch.testing.assert_close(out, ref_out, **tol)
    if need_weights:
        assert w.shape == ref_w.shape
        torch.testing.assert_close(w, ref_w, **tol)
    else:
        ref_w = None
    for name, a, b in zip(
        [f"input{i}" for i in range(len(args))] + [n for n, _ in m.named_parameters()],
        _grads(out, w, leaves),
        _grads(ref_out, ref_w, leaves),
    ):
        torch.testing.assert_close(a, b, **tol, msg=lambda s, name=name: f"grad of {name}: {s}")
    return m, out


@pytest.mark.parametrize("need_weights", [False, True], ids=["out", "weights"])
@pytest.mark.parametrize("case", list(CASES))
def test_canonical_float64(device, case, need_weights):
    _check(case, device, torch.float64, F64, need_weights)


@pytest.mark.parametrize("case", ["causal", "gqa", "float_mask", "seq_first_cross"])
def test_canonical_float32(device, case):
    _check(case, device, torch.float32, F32, need_weights=False)


def test_empty_rows_are_zero(device):
    """causal with Sq > Sk, bottom-right: the first Sq - Sk queries see no key; their attention
    output is zero (out = out_proj.bias) and nothing is NaN."""
    m, args, _ = _setup("causal_sq_gt_sk", device, torch.float64)
    out, w = m(*args, need_weights=True)
    sq, sk = args[0].shape[1], args[1].shape[1]
    empty = sq - sk
    torch.testing.assert_close(out[:, :empty], m.out_proj.bias.expand_as(out[:, :empty]), **F64)
    assert (w[:, :, :empty] == 0).all() and (w[:, :, empty:].sum(-1) - 1).abs().max() < 1e-12
    assert torch.isfinite(torch.autograd.grad(out.sum(), args[0])[0]).all()


def test_parameters_and_shapes(device):
    m = MultiHeadAttention(16, 4, num_kv_heads=2, kdim=6, vdim=10, device=device)
    assert m.head_dim == 4
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "q_proj.weight": (16, 16),
        "q_proj.bias": (16,),
        "k_proj.weight": (8, 6),
        "k_proj.bias": (8,),
        "v_proj.weight": (8, 10),
        "v_proj.bias": (8,),
        "out_proj.weight": (16, 16),
        "out_proj.bias": (16,),
    }
    m2 = MultiHeadAttention(16, 4, num_kv_heads=2, kdim=6, vdim=10, device=device)
    m2.load_state_dict(m.state_dict(), strict=True)
    assert all(
        isinstance(getattr(m, n), torch.nn.Linear)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj")
    )
    assert len(dict(MultiHeadAttention(16, 4, bias=False).named_parameters())) == 4
    x = torch.randn(3, 5, 16, device=device)
    out, w = m(
        x,
        torch.randn(3, 7, 6, device=device),
        torch.randn(3, 7, 10, device=device),
        need_weights=True,
    )
    assert out.shape == (3, 5, 16) and w.shape == (3, 4, 5, 7)


def test_default_key_value(device):
    """key defaults to query, value to key."""
    m = MultiHeadAttention(16, 2, kdim=16, vdim=16, device=device, dtype=torch.float64)
    x = torch.randn(2, 5, 16, device=device, dtype=torch.float64)
    y = torch.randn(2, 6, 16, device=device, dtype=torch.float64)
    torch.testing.assert_close(m(x), m(x, x, x), **F64)
    torch.testing.assert_close(m(x, y), m(x, y, y), **F64)
    assert not torch.allclose(m(x, y), m(x))


def test_eval_deterministic_train_dropout(device):
    p, runs = 0.3, 200
    m = MultiHeadAttention(16, 2, dropout=p, causal=True, device=device, dtype=torch.float64)
    x = torch.randn(2, 6, 16, device=device, dtype=torch.float64)
    with torch.no_grad():
        m.eval()
        ref = m(x)
        assert torch.equal(m(x), ref)
        torch.testing.assert_close(ref, reference(m, x)[0], **F64)
        m.train()
        samples = torch.stack([m(x) for _ in range(runs)])
        w = torch.stack([m(x, need_weights=True)[1] for _ in range(20)])
    assert not torch.allclose(samples[0], ref) and not torch.equal(samples[0], samples[1])
    mean, std = samples.mean(0), samples.std(0)
    assert ((mean - ref).abs() <= 5 * std / runs**0.5 + 1e-6).float().mean() > 0.99
    visible = torch.ones(6, 6, dtype=torch.bool, device=device).tril()
    frac = (w[..., visible] == 0).double().mean().item()
    assert abs(frac - p) < 0.05, frac  # 1680 visible weights: std of frac ~0.011


BAD_FORWARD = {
    "query_2d": (lambda x, y, z: (x[0],), "query must be 3-D"),
    "query_4d": (lambda x, y, z: (x[None],), "query must be 3-D"),
    "query_embed": (
        lambda x, y, z: (torch.randn(2, 5, 15),),
        r"query must have 16 features \(embed_dim\).*got 15",
    ),
    "key_kdim": (
        lambda x, y, z: (x, torch.randn(2, 7, 5), z),
        r"key must have 6 features \(kdim\).*got 5",
    ),
    "value_vdim": (
        lambda x, y, z: (x, y, torch.randn(2, 7, 6)),
        r"value must have 10 features \(vdim\).*got 6",
    ),
    "value_2d": (lambda x, y, z: (x, y, z[0]), "value must be 3-D"),
    "batch": (lambda x, y, z: (x, y[:1], z[:1]), "same batch size, got 2, 1 and 1"),
    "key_value_len": (lambda x, y, z: (x, y, z[:, :6]), "same sequence length, got 7 and 6"),
}


@pytest.mark.parametrize("case", list(BAD_FORWARD))
def test_bad_forward_input(case):
    m = MultiHeadAttention(16, 4, num_kv_heads=2, kdim=6, vdim=10)
    x, y, z = torch.randn(2, 5, 16), torch.randn(2, 7, 6), torch.randn(2, 7, 10)
    make, msg = BAD_FORWARD[case]
    with pytest.raises(ValueError, match=msg):
        m(*make(x, y, z))


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(embed_dim=16, num_heads=3), r"embed_dim \(16\) must be divisible by num_heads \(3\)"),
        (
            dict(embed_dim=16, num_heads=4, num_kv_heads=3),
            r"num_heads \(4\) must be a positive multiple of num_kv_heads \(3\)",
        ),
        (dict(embed_dim=0, num_heads=4), "embed_dim and num_heads must be > 0"),
        (dict(embed_dim=16, num_heads=4, dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(embed_dim=16, num_heads=4, window_size=3), "window_size must be a pair"),
    ],
)
def test_bad_constructor(kw, msg):
    with pytest.raises(ValueError, match=msg):
        MultiHeadAttention(**kw)


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    m, args, attn_mask = _setup("gqa_cross_kdim", device, torch.float32)
    compiled = torch.compile(m, fullgraph=True)
    out = compiled(*args, attn_mask=attn_mask)
    ref = m(*args, attn_mask=attn_mask)
    torch.testing.assert_close(out, ref, **F32)
    g = torch.autograd.grad(out.sum(), [args[0], m.k_proj.weight])
    g_ref = torch.autograd.grad(ref.sum(), [args[0], m.k_proj.weight])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **F32)
    torch._dynamo.reset()
