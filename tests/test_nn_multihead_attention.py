"""attn_ext.nn.MultiheadAttention against torch.nn.MultiheadAttention.

Both modules hold the same weights (ours loads torch's state dict strictly, after torch's
zero-initialized biases are randomized so that they matter); forward outputs, returned
weights and the gradients of every input and parameter are compared in float64 (1e-10) and
float32, over batch_first, self / shared key-value / cross / kdim-vdim inputs, bool and float
masks (2-D and 3-D attn_mask, key_padding_mask, both merged), need_weights and
average_attn_weights, is_causal, add_bias_kv, add_zero_attn and unbatched inputs.
"""

import warnings

import pytest
import torch
import torch._dynamo

import attn_ext
import attn_ext.nn  # noqa: F401  (in case the package does not import it)

E, H = 8, 2  # embed_dim, num_heads (head_dim 4)
N, L, S = 3, 5, 7  # batch, target length, source length
KDIM, VDIM = 6, 10

F64 = dict(rtol=1e-10, atol=1e-10)
# float32: both sides round differently (blocked online softmax vs. torch's softmax, fused
# vs. unfused projections); errors of a few ulps accumulate through the projections and
# the backward, so compare at ~1e-5 relative.
F32 = dict(rtol=2e-5, atol=2e-5)


def _pair(device, dtype, **kw):
    theirs = torch.nn.MultiheadAttention(E, H, device=device, dtype=dtype, **kw)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = attn_ext.nn.MultiheadAttention(E, H, device=device, dtype=dtype, **kw)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert isinstance(ours, attn_ext.nn.MultiheadAttention)
    assert type(ours).forward is not torch.nn.MultiheadAttention.forward
    return theirs, ours


def _inputs(kv_mode, batch_first, device, dtype, unbatched=False):
    """query, key, value leaves (the same object where the mode shares them)."""

    def t(seq, width):
        if unbatched:
            shape = (seq, width)
        else:
            shape = (N, seq, width) if batch_first else (seq, N, width)
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    if kv_mode == "self":
        x = t(L, E)
        return x, x, x
    if kv_mode == "kv_same":
        y = t(S, E)
        return t(L, E), y, y
    if kv_mode == "cross":
        return t(L, E), t(S, E), t(S, E)
    if kv_mode == "kdim_vdim":
        return t(L, E), t(S, KDIM), t(S, VDIM)
    raise ValueError(kv_mode)


def _src_len(kv_mode):
    return L if kv_mode == "self" else S


def _bool(shape, device, p=0.3):
    m = torch.rand(shape, device=device) < p
    m[..., 0] = False  # key 0 always visible: no fully masked row (torch gives NaN there)
    return m


def _float(shape, device, dtype):
    m = torch.randn(shape, device=device, dtype=dtype)
    m = m.masked_fill(torch.rand(shape, device=device) < 0.2, float("-inf"))
    m[..., 0] = 0.5
    return m


def _masks(case, s, device, dtype, unbatched=False):
    """(attn_mask, key_padding_mask) in torch's convention (bool True = not allowed)."""
    nb = () if unbatched else (N,)
    am = kpm = None
    for part in case.split("+"):
        if part == "none":
            continue
        kind, typ = part[:-1], part[-1]
        if kind == "am2":
            shape = (L, s)
        elif kind == "am3":
            shape = ((H,) if unbatched else (N * H,)) + (L, s)
        elif kind == "kpm":
            shape = nb + (s,)
        else:
            raise ValueError(part)
        m = _bool(shape, device) if typ == "b" else _float(shape, device, dtype)
        if kind == "kpm":
            kpm = m
        else:
            am = m
    return am, kpm


def _run(mod, query, key, value, grad_seed=1, **kw):
    """Forward, then gradients of a fixed random projection of the outputs w.r.t. the
    distinct inputs and every parameter."""
    out, w = mod(query, key, value, **kw)
    g = torch.Generator(device="cpu").manual_seed(grad_seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)).sum()
    if w is not None:
        loss = loss + (w * torch.randn(w.shape, generator=g, dtype=w.dtype).to(w.device)).sum()
    leaves = []
    for x in (query, key, value):
        if not any(x is y for y in leaves):
            leaves.append(x)
    names, params = zip(*mod.named_parameters())
    grads = torch.autograd.grad(
        loss, leaves + list(params), allow_unused=True, materialize_grads=True
    )
    return out, w, dict(zip([f"input{i}" for i in range(len(leaves))] + list(names), grads))


def _compare(theirs, ours, args, kw, tol):
    t_out, t_w, t_g = _run(theirs, *args, **kw)
    o_out, o_w, o_g = _run(ours, *args, **kw)
    assert torch.isfinite(t_out).all(), "test setup: torch's output has NaN (fully masked row?)"
    assert torch.isfinite(o_out).all()
    torch.testing.assert_close(o_out, t_out, **tol)
    assert (o_w is None) == (t_w is None)
    if t_w is not None:
        torch.testing.assert_close(o_w, t_w, **tol)
    assert o_g.keys() == t_g.keys()
    for name in t_g:
        torch.testing.assert_close(
            o_g[name], t_g[name], **tol, msg=lambda m, name=name: f"grad of {name}: {m}"
        )
    return o_out, o_w


KV_MODES = ["self", "kv_same", "cross", "kdim_vdim"]
MASKS = ["none", "kpmb", "kpmf", "am2b", "am2f", "am3b", "am3f", "am2b+kpmb", "am3f+kpmf"]
WEIGHTS = {
    "no_weights": dict(need_weights=False),
    "avg_weights": dict(need_weights=True),
    "head_weights": dict(need_weights=True, average_attn_weights=False),
}


def _module_kw(kv_mode):
    return dict(kdim=KDIM, vdim=VDIM) if kv_mode == "kdim_vdim" else {}


# Every (kv_mode, mask) pair with every weights mode; the layout alternates so that each
# kv_mode and each mask case runs both batch_first=True and False (the full product would
# double the suite's time for little: the layout is handled before masks and heads).
MATRIX = [
    pytest.param(bf, kv, mask, wts, id=f"{'batch_first' if bf else 'seq_first'}-{kv}-{mask}-{wts}")
    for i, kv in enumerate(KV_MODES)
    for j, mask in enumerate(MASKS)
    for wts in WEIGHTS
    for bf in [(i + j) % 2 == 0]
]


@pytest.mark.parametrize("batch_first,kv_mode,mask_case,weights", MATRIX)
def test_matches_torch_float64(device, batch_first, kv_mode, mask_case, weights):
    theirs, ours = _pair(device, torch.float64, batch_first=batch_first, **_module_kw(kv_mode))
    args = _inputs(kv_mode, batch_first, device, torch.float64)
    am, kpm = _masks(mask_case, _src_len(kv_mode), device, torch.float64)
    kw = dict(WEIGHTS[weights], attn_mask=am, key_padding_mask=kpm)
    out, w = _compare(theirs, ours, args, kw, F64)
    assert out.shape == ((N, L, E) if batch_first else (L, N, E))
    if w is not None:
        s = _src_len(kv_mode)
        assert w.shape == ((N, L, s) if kw.get("average_attn_weights", True) else (N, H, L, s))


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("mask_case", ["none", "am2b+kpmb", "am3f", "kpmf"])
@pytest.mark.parametrize(
    "add_bias_kv,add_zero_attn",
    [(True, False), (False, True), (True, True)],
    ids=["bias_kv", "zero_attn", "both"],
)
def test_bias_kv_zero_attn_float64(device, add_bias_kv, add_zero_attn, mask_case, need_weights):
    theirs, ours = _pair(
        device,
        torch.float64,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        batch_first=True,
    )
    args = _inputs("cross", True, device, torch.float64)
    am, kpm = _masks(mask_case, S, device, torch.float64)
    kw = dict(
        attn_mask=am, key_padding_mask=kpm, need_weights=need_weights, average_attn_weights=False
    )
    _, w = _compare(theirs, ours, args, kw, F64)
    if w is not None:
        assert w.shape == (N, H, L, S + add_bias_kv + add_zero_attn)


@pytest.mark.parametrize(
    "case", ["plain", "weights", "kpm", "cross", "zero_attn", "bias_kv_weights", "not_causal_mask"]
)
def test_is_causal_float64(device, case):
    """torch's is_causal hint: with need_weights=False and no key_padding_mask the attn_mask is
    replaced by a top-left causal mask (even a mask that is not causal, case not_causal_mask);
    otherwise the mask is used."""
    mod_kw = dict(
        batch_first=True, add_zero_attn=case == "zero_attn", add_bias_kv=case == "bias_kv_weights"
    )
    theirs, ours = _pair(device, torch.float64, **mod_kw)
    kv_mode = "cross" if case == "cross" else "self"
    s = _src_len(kv_mode)
    args = _inputs(kv_mode, True, device, torch.float64)
    am = torch.ones(L, s, dtype=torch.bool, device=device).triu(1)
    if case == "not_causal_mask":
        am = _bool((L, s), device)
    kw = dict(attn_mask=am, is_causal=True, need_weights=case in ("weights", "bias_kv_weights"))
    if case == "kpm":
        kw["key_padding_mask"] = _bool((N, s), device)
    _compare(theirs, ours, args, kw, F64)


def test_is_causal_requires_attn_mask(device):
    theirs, ours = _pair(device, torch.float64, batch_first=True)
    x = torch.randn(N, L, E, device=device, dtype=torch.float64, requires_grad=True)
    for mod in (theirs, ours):
        with pytest.raises(RuntimeError, match="Need attn_mask"):
            mod(x, x, x, is_causal=True, need_weights=False)


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("mask_case", ["none", "kpmb", "am2f", "am3b+kpmb", "am3f+kpmf"])
def test_unbatched_float64(device, mask_case, need_weights):
    theirs, ours = _pair(device, torch.float64, batch_first=True)
    args = _inputs("cross", True, device, torch.float64, unbatched=True)
    am, kpm = _masks(mask_case, S, device, torch.float64, unbatched=True)
    kw = dict(
        attn_mask=am, key_padding_mask=kpm, need_weights=need_weights, average_attn_weights=False
    )
    out, w = _compare(theirs, ours, args, kw, F64)
    assert out.shape == (L, E)
    if need_weights:
        assert w.shape == (H, L, S)


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_no_bias_float64(device, need_weights):
    theirs, ours = _pair(device, torch.float64, bias=False, kdim=KDIM, vdim=VDIM)
    assert ours.in_proj_bias is None and ours.out_proj.bias is None
    args = _inputs("kdim_vdim", False, device, torch.float64)
    am, kpm = _masks("am2b+kpmb", S, device, torch.float64)
    _compare(
        theirs, ours, args, dict(attn_mask=am, key_padding_mask=kpm, need_weights=need_weights), F64
    )


def test_mismatched_mask_types_warn_and_match(device):
    theirs, ours = _pair(device, torch.float64, batch_first=True)
    args = _inputs("cross", True, device, torch.float64)
    am = _float((L, S), device, torch.float64)
    kpm = _bool((N, S), device)
    for mod in (theirs, ours):
        with pytest.warns(UserWarning, match="mismatched key_padding_mask and attn_mask"):
            mod(*args, attn_mask=am, key_padding_mask=kpm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _compare(
            theirs, ours, args, dict(attn_mask=am, key_padding_mask=kpm, need_weights=False), F64
        )


@pytest.mark.parametrize("kv_mode", ["self", "kdim_vdim"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_matches_torch_float32(device, kv_mode, need_weights):
    theirs, ours = _pair(
        device, torch.float32, batch_first=True, add_bias_kv=True, **_module_kw(kv_mode)
    )
    args = _inputs(kv_mode, True, device, torch.float32)
    am, kpm = _masks("am3b+kpmb", _src_len(kv_mode), device, torch.float32)
    _compare(
        theirs, ours, args, dict(attn_mask=am, key_padding_mask=kpm, need_weights=need_weights), F32
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(kdim=KDIM, vdim=VDIM, bias=False),
        dict(add_bias_kv=True, add_zero_attn=True, batch_first=True),
    ],
    ids=["packed", "separate_no_bias", "bias_kv"],
)
def test_same_parameters_init_and_state_dict(device, kw):
    torch.manual_seed(123)
    theirs = torch.nn.MultiheadAttention(E, H, device=device, **kw)
    torch.manual_seed(123)
    ours = attn_ext.nn.MultiheadAttention(E, H, device=device, **kw)
    assert isinstance(ours, torch.nn.MultiheadAttention)
    t_sd, o_sd = theirs.state_dict(), ours.state_dict()
    assert list(o_sd) == list(t_sd)
    for name in t_sd:
        assert torch.equal(o_sd[name], t_sd[name]), name  # same init draws in the same order
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert type(ours.out_proj) is type(theirs.out_proj)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # and back
    with pytest.raises(RuntimeError, match="Missing key"):
        ours.load_state_dict({k: v for k, v in t_sd.items() if k != "out_proj.weight"}, strict=True)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        ours.load_state_dict(dict(t_sd, extra=torch.zeros(1)), strict=True)


def _error_cases(device):
    d = dict(device=device, dtype=torch.float64)
    x = torch.randn(N, L, E, **d)
    return {
        "4d_query": (torch.randn(1, N, L, E, **d), x, x, {}),
        "2d_key_3d_query": (x, torch.randn(L, E, **d), x, {}),
        "embed_dim": (torch.randn(N, L, E + 1, **d),) * 3 + ({},),
        "key_value_shape": (x, torch.randn(N, S, E, **d), torch.randn(N, S + 1, E, **d), {}),
        "attn_mask_2d_shape": (
            x,
            x,
            x,
            dict(attn_mask=torch.zeros(L, L + 1, dtype=torch.bool, device=device)),
        ),
        "attn_mask_3d_shape": (
            x,
            x,
            x,
            dict(attn_mask=torch.zeros(N, L, L, dtype=torch.bool, device=device)),
        ),
        "attn_mask_4d": (
            x,
            x,
            x,
            dict(attn_mask=torch.zeros(1, 1, L, L, dtype=torch.bool, device=device)),
        ),
        "attn_mask_int": (
            x,
            x,
            x,
            dict(attn_mask=torch.zeros(L, L, dtype=torch.int64, device=device)),
        ),
        "kpm_shape": (
            x,
            x,
            x,
            dict(key_padding_mask=torch.zeros(N, L + 1, dtype=torch.bool, device=device)),
        ),
        "kpm_3d": (
            x,
            x,
            x,
            dict(key_padding_mask=torch.zeros(N, 1, L, dtype=torch.bool, device=device)),
        ),
    }


@pytest.mark.parametrize("case", list(_error_cases("cpu")))
def test_bad_input_raises_like_torch(device, case):
    theirs, ours = _pair(device, torch.float64, batch_first=True)
    q, k, v, kw = _error_cases(device)[case]
    with pytest.raises(Exception) as t_err:
        theirs(q, k, v, **kw)
    with pytest.raises(type(t_err.value)) as o_err:
        ours(q, k, v, **kw)
    if case != "key_value_shape":  # torch prints the shapes after its internal (S, N, E) transpose
        assert str(o_err.value) == str(t_err.value)


def test_fully_masked_row_is_zero_not_nan(device):
    """A query row that sees no key: torch 2.13's need_weights=False path (SDPA) gives zero
    attention there, which we match exactly (outputs and gradients); its need_weights=True path
    gives NaN, where ours gives zero attention (out = out_proj.bias), zero weights and finite
    gradients -- the documented difference."""
    theirs, ours = _pair(device, torch.float64, batch_first=True)
    x = torch.randn(N, L, E, device=device, dtype=torch.float64, requires_grad=True)
    am = torch.zeros(L, L, dtype=torch.bool, device=device)
    am[2] = True  # query 2 sees nothing
    am[:, 4] = True
    t_out, _ = theirs(x, x, x, attn_mask=am, need_weights=True)
    assert torch.isnan(t_out[:, 2]).all()
    if device == "cpu":  # torch's CPU SDPA zeroes such rows (a CUDA backend may not)
        _compare(theirs, ours, (x, x, x), dict(attn_mask=am, need_weights=False), F64)
    for need_weights in (False, True):
        out, w = ours(x, x, x, attn_mask=am, need_weights=need_weights)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[:, 2], ours.out_proj.bias.expand(N, E), **F64)
        torch.testing.assert_close(out[:, [0, 1, 3, 4]], t_out[:, [0, 1, 3, 4]], **F64)
        if need_weights:
            assert (w[:, 2] == 0).all() and (w[:, :, 4] == 0).all()
        (g,) = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(g).all()


def test_float64_mask_precision(device):
    theirs, ours = _pair(device, torch.float64, batch_first=True)
    args = _inputs("cross", True, device, torch.float64)
    am = torch.randn(L, S, device=device, dtype=torch.float64)  # not float32-representable
    _compare(theirs, ours, args, dict(attn_mask=am, need_weights=False), F64)


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_eval_is_deterministic_and_ignores_dropout(device, need_weights):
    theirs, ours = _pair(device, torch.float64, dropout=0.5, batch_first=True)
    theirs.eval(), ours.eval()
    q, k, v = _inputs("cross", True, device, torch.float64)
    a, wa = ours(q, k, v, need_weights=need_weights)
    b, wb = ours(q, k, v, need_weights=need_weights)
    assert torch.equal(a, b)
    t, _ = theirs(q, k, v, need_weights=need_weights)
    torch.testing.assert_close(a, t, **F64)


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_train_dropout_statistics(device, need_weights):
    """Training mode drops attention probabilities: outputs differ from eval and between calls,
    and their mean over many calls is the eval output (dropout rescales by 1/(1-p))."""
    p, runs = 0.3, 200
    _, ours = _pair(device, torch.float64, dropout=p, batch_first=True)
    q, k, v = (t.detach() for t in _inputs("cross", True, device, torch.float64))
    with torch.no_grad():
        ours.eval()
        ref, ref_w = ours(q, k, v, need_weights=True, average_attn_weights=False)
        ours.train()
        samples, zero_frac = [], []
        for _ in range(runs):
            out, w = ours(q, k, v, need_weights=need_weights, average_attn_weights=False)
            samples.append(out)
            if w is not None:
                zero_frac.append((w == 0).double().mean().item())
    samples = torch.stack(samples)
    assert not torch.allclose(samples[0], ref)
    assert not torch.equal(samples[0], samples[1])
    mean, std = samples.mean(0), samples.std(0)
    # 5 standard errors per element (plus a little for the std estimate itself).
    bound = 5 * std / runs**0.5 + 1e-6
    assert ((mean - ref).abs() <= bound).float().mean() > 0.99, (mean - ref).abs().max()
    assert (mean - ref).abs().max() < 0.25 * ref.abs().max()
    if need_weights:
        assert ref_w.min() > 0  # every eval weight is positive, so every zero is a dropped one
        assert abs(sum(zero_frac) / runs - p) < 0.02


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_torch_compile_fullgraph(device, need_weights):
    torch._dynamo.reset()
    theirs, ours = _pair(device, torch.float32, batch_first=True, add_zero_attn=True)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    q, k, v = _inputs("kv_same", True, device, torch.float32)
    kpm = _bool((N, S), device)
    am = _bool((L, S), device)
    kw = dict(key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
    out, w = compiled(q, k, v, **kw)
    ref, ref_w = theirs(q, k, v, **kw)
    torch.testing.assert_close(out, ref, **F32)
    if need_weights:
        torch.testing.assert_close(w, ref_w, **F32)
    g = torch.autograd.grad(out.sum(), [q, k, ours.in_proj_weight])
    g_ref = torch.autograd.grad(ref.sum(), [q, k, theirs.in_proj_weight])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **F32)
    torch._dynamo.reset()


def test_torch_compile_inductor_inference(device):
    torch._dynamo.reset()
    theirs, ours = _pair(device, torch.float32, batch_first=True)
    compiled = torch.compile(ours, fullgraph=True)
    x = torch.randn(N, L, E, device=device)
    am = torch.ones(L, L, dtype=torch.bool, device=device).triu(1)
    with torch.no_grad():
        out, _ = compiled(x, x, x, attn_mask=am, is_causal=True, need_weights=False)
        ref, _ = theirs(x, x, x, attn_mask=am, is_causal=True, need_weights=False)
    torch.testing.assert_close(out, ref, **F32)
    torch._dynamo.reset()
