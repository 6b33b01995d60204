"""torch.library.opcheck on every registered attn_ext operator.

opcheck runs test_schema (the schema's mutation/alias annotations are
honest), test_autograd_registration (grad flows through a registered
autograd formula, not a silent fallthrough), test_faketensor (the fake
kernel's shapes/dtypes/strides match the real kernel) and
test_aot_dispatch_dynamic (AOT autograd with dynamic shapes gives the same
outputs and gradients). Dropout samples pass rng_state = tensor([seed, 0])
explicitly, so every run of the op is deterministic.
"""

import pytest
import torch

import attn_ext  # noqa: F401  (registers the ops)
from attn_ext.testing.numerics import make_qkv, random_bool_mask, random_float_mask

ops = torch.ops.attn_ext


def _qkv(
    device,
    B=2,
    H=4,
    Hkv=2,
    Sq=7,
    Sk=9,
    D=16,
    Dv=None,
    dtype=torch.float32,
    layout="contiguous",
    grad=False,
):
    return make_qkv(
        B, H, Hkv, Sq, Sk, D, Dv, dtype=dtype, device=device, layout=layout, requires_grad=grad
    )


def attention_samples(device):
    s = []
    q, k, v = _qkv(device)
    s.append(("plain", (q, k, v), {}))
    q, k, v = _qkv(device, grad=True)
    s.append(("grad_causal", (q, k, v), dict(causal=True)))
    q, k, v = _qkv(device, layout="bshd", grad=True)
    s.append(
        ("strided_gqa_bool_mask", (q, k, v), dict(attn_mask=random_bool_mask((2, 1, 7, 9), device)))
    )
    q, k, v = _qkv(device, Hkv=1, Dv=24, grad=True)
    s.append(
        (
            "mqa_float_mask_window_scale",
            (q, k, v),
            dict(
                attn_mask=random_float_mask((1, 4, 1, 9), torch.float32, device),
                window_left=3,
                window_right=2,
                scale=0.3,
            ),
        )
    )
    q, k, v = _qkv(device, Sq=9, Sk=5, grad=True)
    s.append(("empty_rows", (q, k, v), dict(causal=True)))
    q, k, v = _qkv(device, grad=True)
    s.append(
        ("dropout", (q, k, v), dict(dropout_p=0.3, rng_state=torch.tensor([1234, 0]), causal=True))
    )
    q, k, v = _qkv(device, dtype=torch.float64, grad=True)
    s.append(("float64_key_offset", (q, k, v), dict(causal=True, key_offset=0)))
    q, k, v = _qkv(device, dtype=torch.bfloat16, grad=True)
    s.append(("bfloat16", (q, k, v), dict(causal=True)))
    return s


def _ids(samples):
    return [name for name, _, _ in samples]


ATT_IDS = _ids(attention_samples("cpu"))


@pytest.mark.parametrize("idx", range(len(ATT_IDS)), ids=ATT_IDS)
def test_opcheck_attention(device, idx):
    _, args, kwargs = attention_samples(device)[idx]
    torch.library.opcheck(ops.attention.default, args, kwargs)


def backward_samples(device):
    s = []
    for name, (q, k, v), kw in attention_samples(device):
        q, k, v = (x.detach() for x in (q, k, v))
        out, lse = ops.attention(q, k, v, **kw)
        g = torch.randn_like(out)
        s.append((name, (g, q, k, v, out, lse), kw))
    q, k, v = _qkv(device)
    out, lse = ops.attention(q, k, v, causal=True)
    s.append(
        (
            "grad_lse",
            (torch.randn_like(out), q, k, v, out, lse),
            dict(causal=True, grad_lse=torch.randn_like(lse)),
        )
    )
    return s


BWD_IDS = _ids(backward_samples("cpu"))


@pytest.mark.parametrize("idx", range(len(BWD_IDS)), ids=BWD_IDS)
def test_opcheck_attention_backward(device, idx):
    _, args, kwargs = backward_samples(device)[idx]
    torch.library.opcheck(ops.attention_backward.default, args, kwargs)


def weights_samples(device):
    s = []
    q, k, _ = _qkv(device)
    s.append(("plain", (q, k), {}))
    q, k, _ = _qkv(device, grad=True)
    s.append(("grad_causal", (q, k), dict(causal=True)))
    q, k, _ = _qkv(device, layout="bshd", grad=True)
    s.append(("strided_gqa_mask", (q, k), dict(attn_mask=random_bool_mask((7, 9), device))))
    q, k, _ = _qkv(device, Sq=9, Sk=5, grad=True)
    s.append(
        (
            "window_float_mask_empty_rows",
            (q, k),
            dict(
                window_left=1,
                window_right=0,
                attn_mask=random_float_mask((2, 4, 9, 5), torch.float32, device),
                scale=0.5,
            ),
        )
    )
    # attention's score modifiers (slopes and sinks constant: they take no gradient here)
    q, k, _ = _qkv(device, grad=True)
    H = q.size(1)
    slopes = torch.linspace(0.05, 0.5, 2 * H, device=device).view(2, H)
    s.append(("softcap_alibi", (q, k), dict(alibi_slopes=slopes, softcap=0.7, causal=True)))
    sinks = torch.linspace(-1.0, 2.0, H, device=device)
    s.append(("sinks_softcap", (q, k), dict(sinks=sinks, softcap=1.5)))
    return s


W_IDS = _ids(weights_samples("cpu"))


@pytest.mark.parametrize("idx", range(len(W_IDS)), ids=W_IDS)
def test_opcheck_attention_weights(device, idx):
    _, args, kwargs = weights_samples(device)[idx]
    torch.library.opcheck(ops.attention_weights.default, args, kwargs)


@pytest.mark.parametrize("idx", range(len(W_IDS)), ids=W_IDS)
def test_opcheck_attention_weights_backward(device, idx):
    _, (q, k), kw = weights_samples(device)[idx]
    q, k = q.detach(), k.detach()
    w = ops.attention_weights(q, k, **kw)
    torch.library.opcheck(
        ops.attention_weights_backward.default,
        (torch.randn_like(w), w, q, k),
        dict(scale=kw.get("scale"), softcap=kw.get("softcap", 0.0)),
    )


def probabilities_samples(device):
    """attention_probabilities on the lse of the attention call with the same masks; the
    weights samples' inputs, per head and averaged over heads."""
    s = []
    for name, (q, k), kw in weights_samples(device):
        v = torch.randn_like(k.detach())
        _, lse = ops.attention(q.detach(), k.detach(), v, **kw)
        for mean_heads in (False, True):
            label = f"{name}_mean" if mean_heads else name
            s.append((label, (q, k, lse), dict(kw, mean_heads=mean_heads)))
    # the dropped probabilities of a call with dropout (the same rng_state)
    q, k, _ = _qkv(device, grad=True)
    v, state = torch.randn_like(k.detach()), torch.tensor([77, 0])
    _, lse = ops.attention(q.detach(), k.detach(), v, rng_state=state, dropout_p=0.3)
    for mean_heads in (False, True):
        s.append(
            (
                "dropout_mean" if mean_heads else "dropout",
                (q, k, lse),
                dict(rng_state=state, dropout_p=0.3, mean_heads=mean_heads),
            )
        )
    return s


P_IDS = _ids(probabilities_samples("cpu"))


@pytest.mark.parametrize("idx", range(len(P_IDS)), ids=P_IDS)
def test_opcheck_attention_probabilities(device, idx):
    _, args, kwargs = probabilities_samples(device)[idx]
    torch.library.opcheck(ops.attention_probabilities.default, args, kwargs)


@pytest.mark.parametrize(
    "shape,p", [((2, 3, 5, 7), 0.25), ((1, 1, 16, 33), 0.5), ((0, 2, 3, 4), 0.1)]
)
def test_opcheck_dropout_mask(shape, p):
    torch.library.opcheck(ops.dropout_mask.default, (torch.tensor([99, 0]), *shape, p))


def test_fake_shapes_match(device):
    """Under FakeTensorMode the ops report the documented shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q = torch.empty(2, 4, 7, 16, device=device, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 9, 16, device=device, dtype=torch.bfloat16)
        v = torch.empty(2, 2, 9, 24, device=device, dtype=torch.bfloat16)
        out, lse = ops.attention(q, k, v, causal=True)
        w = ops.attention_weights(q, k)
        p = ops.attention_probabilities(q, k, lse, causal=True)
        p_mean = ops.attention_probabilities(q, k, lse, causal=True, mean_heads=True)
    assert mode is not None
    assert p.shape == (2, 4, 7, 9) and p.dtype == torch.bfloat16
    assert p_mean.shape == (2, 7, 9) and p_mean.dtype == torch.bfloat16
    assert out.shape == (2, 4, 7, 24) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    assert w.shape == (2, 4, 7, 9) and w.dtype == torch.bfloat16


# ------------------------------------------------------------------------------- decoding ops


def rope_samples(device):
    x = torch.randn(2, 3, 5, 8, device=device)
    xs = torch.randn(2, 5, 3, 8, device=device).transpose(1, 2)
    pos = torch.randint(0, 50, (2, 5), device=device)
    return [
        ("plain", (x,), {}),
        ("grad_strided_interleaved", (xs.requires_grad_(True),), dict(interleaved=True, offset=3)),
        (
            "positions_partial",
            (x.double().requires_grad_(True), pos),
            dict(rotary_dim=4, base=500.0),
        ),
        ("shared_positions_bf16", (x.bfloat16(), pos[0].int()), {}),
    ]


ROPE_IDS = _ids(rope_samples("cpu"))


@pytest.mark.parametrize("idx", range(len(ROPE_IDS)), ids=ROPE_IDS)
def test_opcheck_rope(device, idx):
    _, args, kwargs = rope_samples(device)[idx]
    torch.library.opcheck(ops.rope.default, args, kwargs)
    detached = tuple(a.detach() if a.is_floating_point() else a for a in args)
    torch.library.opcheck(ops.rope_backward.default, detached, kwargs)
    torch.library.opcheck(ops.rope_.default, (detached[0].clone(), *detached[1:]), kwargs)


def test_opcheck_kv_cache_append(device):
    kc = torch.zeros(2, 2, 12, 8, device=device)
    vc = torch.zeros(2, 2, 12, 6, device=device)
    lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    k = torch.randn(2, 2, 3, 8, device=device)
    v = torch.randn(2, 2, 3, 6, device=device)
    # opcheck runs the op several times on copies; leave room for every run
    torch.library.opcheck(ops.kv_cache_append.default, (kc, vc, lens, k, v), {})
    torch.library.opcheck(
        ops.kv_cache_append.default,
        (
            kc.clone(),
            vc.clone(),
            torch.zeros(2, dtype=torch.long, device=device),
            k,
            v,
            torch.tensor([3, 1], device=device),
        ),
        dict(rope=True, rope_interleaved=True),
    )


@pytest.mark.parametrize("splits", [1, 3])
def test_opcheck_decode_attention(device, splits):
    q = torch.randn(2, 4, 2, 16, device=device).transpose(1, 2).contiguous().transpose(1, 2)
    kc = torch.randn(2, 2, 40, 16, device=device)
    vc = torch.randn(2, 2, 40, 24, device=device)[..., :12]
    lens = torch.tensor([40, 7], dtype=torch.int32, device=device)
    torch.library.opcheck(
        ops.decode_attention.default, (q, kc, vc, lens), dict(num_splits=splits, window_left=5)
    )


def test_opcheck_decode_attention_flash_attn_arguments():
    """CPU only: on CUDA these arguments are not yet supported."""
    q = torch.randn(2, 4, 2, 16)
    kc = torch.randn(3, 40, 2, 16).transpose(1, 2)  # FlashAttention's (B, L, Hkv, D) cache
    vc = torch.randn(3, 40, 2, 16).transpose(1, 2)
    lens = torch.tensor([40, 9], dtype=torch.int32)
    kw = dict(
        causal=False,
        window_left=6,
        window_right=2,
        softcap=3.0,
        alibi_slopes=torch.rand(2, 4),
        sinks=torch.randn(4),
        cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
        cache_leftpad=torch.tensor([1, 4], dtype=torch.int32),
        num_splits=2,
    )
    torch.library.opcheck(ops.decode_attention.default, (q, kc, vc, lens), kw)


# ------------------------------------------------------------------------- spatial (CBAM) ops


def spatial_samples(device):
    x = torch.randn(2, 5, 7, 9, device=device)
    x_cl = torch.randn(2, 12, 4, 6, device=device).contiguous(memory_format=torch.channels_last)
    x_strided = torch.randn(2, 10, 6, 8, device=device)[:, ::2, :, 1:7]
    return [
        ("nchw", x),
        ("channels_last_grad", x_cl.requires_grad_(True)),
        ("strided_float64_grad", x_strided.double().requires_grad_(True)),
        ("bf16_1x1", torch.randn(3, 9, 1, 1, device=device).bfloat16()),
    ]


SPATIAL_IDS = _ids((n, None, None) for n, _ in spatial_samples("cpu"))


@pytest.mark.parametrize("idx", range(len(SPATIAL_IDS)), ids=SPATIAL_IDS)
def test_opcheck_spatial_ops(device, idx):
    _, x = spatial_samples(device)[idx]
    torch.library.opcheck(ops.channel_pool.default, (x,))
    N, C, H, W = x.shape
    gate = torch.randn(N, 1, H, W, device=device, dtype=x.dtype, requires_grad=x.requires_grad)
    torch.library.opcheck(ops.spatial_gate.default, (x, gate))
    xd, gd = x.detach(), gate.detach()
    pooled, argmax = ops.channel_pool(xd)
    cl = (not xd.is_contiguous()) and xd.is_contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(
        ops.channel_pool_backward.default,
        (torch.randn_like(pooled), argmax, C),
        dict(channels_last=cl),
    )
    torch.library.opcheck(ops.spatial_gate_backward.default, (torch.randn_like(xd), xd, gd))
    dense = xd.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    torch.library.opcheck(
        ops.channel_pool_backward_accumulate_.default,
        (torch.randn_like(dense), torch.randn_like(pooled), argmax),
    )


def test_opcheck_spatial_gate_float32_gate(device):
    x = torch.randn(2, 6, 5, 5, device=device).bfloat16().requires_grad_(True)
    gate = torch.randn(2, 1, 5, 5, device=device, requires_grad=True)
    torch.library.opcheck(ops.spatial_gate.default, (x, gate))


# ------------------------------------------------------------------ tensor product attention


def tpa_samples(device):
    a = torch.randn(2, 5, 3, 4, device=device)
    b = torch.randn(2, 3, 5, 8, device=device).transpose(1, 2)  # strided (B, S, R, D)
    pos = torch.randint(0, 50, (2, 5), device=device)
    return [
        ("plain", (a, b), dict(scale=1 / 3)),
        (
            "grad_rope_positions",
            (a.clone().requires_grad_(True), b.clone().requires_grad_(True), pos),
            dict(scale=0.5, rope=True, rope_interleaved=True),
        ),
        (
            "grad_rope_partial_f64",
            (a.double().requires_grad_(True), b.double().requires_grad_(True)),
            dict(rope=True, rotary_dim=4, rope_base=500.0),
        ),
        ("shared_positions_bf16", (a.bfloat16(), b.bfloat16(), pos[0].int()), dict(rope=True)),
    ]


TPA_IDS = _ids(tpa_samples("cpu"))


@pytest.mark.parametrize("idx", range(len(TPA_IDS)), ids=TPA_IDS)
def test_opcheck_tpa_expand(device, idx):
    _, args, kwargs = tpa_samples(device)[idx]
    torch.library.opcheck(ops.tpa_expand.default, args, kwargs)
    a, b = (t.detach() for t in args[:2])
    g = torch.randn(a.size(0), a.size(1), a.size(3), b.size(3), device=device, dtype=a.dtype)
    torch.library.opcheck(ops.tpa_expand_backward.default, (g, a, b, *args[2:]), kwargs)


def tpa_decode_samples(device):
    def cache(B, N, rk, rv, H, D, dtype=torch.float32, grad=False):
        ts = [
            torch.randn(B, N, rk, H, device=device, dtype=dtype),
            torch.randn(B, N, rk, D, device=device, dtype=dtype),
            torch.randn(B, N, rv, H, device=device, dtype=dtype),
            torch.randn(B, rv, N, D, device=device, dtype=dtype).transpose(1, 2),
        ]  # strided b_v
        return [t.requires_grad_(grad) for t in ts]

    lengths = torch.tensor([9, 4], device=device, dtype=torch.int32)
    return [
        (
            "decode_step",
            (torch.randn(2, 4, 1, 8, device=device), *cache(2, 9, 2, 2, 4, 8), lengths),
            {},
        ),
        (
            "grad_chunk_strided_q",
            (
                torch.randn(2, 3, 4, 8, device=device).transpose(1, 2).requires_grad_(True),
                *cache(2, 9, 1, 3, 4, 8, grad=True),
                lengths,
            ),
            dict(scale=0.3, k_scale=0.7, v_scale=1.1),
        ),
        (
            "grad_f64",
            (
                torch.randn(2, 4, 2, 6, device=device, dtype=torch.float64, requires_grad=True),
                *cache(2, 9, 2, 2, 4, 6, dtype=torch.float64, grad=True),
                lengths.long(),
            ),
            {},
        ),
        (
            "bf16",
            (
                torch.randn(2, 4, 1, 8, device=device).bfloat16(),
                *cache(2, 9, 2, 2, 4, 8, dtype=torch.bfloat16),
                lengths,
            ),
            {},
        ),
    ]


TPA_DECODE_IDS = _ids(tpa_decode_samples("cpu"))


@pytest.mark.parametrize("idx", range(len(TPA_DECODE_IDS)), ids=TPA_DECODE_IDS)
def test_opcheck_tpa_decode_attention(device, idx):
    _, args, kwargs = tpa_decode_samples(device)[idx]
    torch.library.opcheck(ops.tpa_decode_attention.default, args, kwargs)
    q, *factors, lengths = (t.detach() for t in args)
    g = torch.randn_like(q).contiguous()
    glse = torch.randn(q.shape[:3], device=device)
    torch.library.opcheck(
        ops.tpa_decode_attention_backward.default, (g, glse, q, *factors, lengths), kwargs
    )
    torch.library.opcheck(
        ops.tpa_decode_attention_backward.default, (g, None, q, *factors, lengths), kwargs
    )


def test_opcheck_latent_cache_append(device):
    cache = torch.zeros(2, 1, 12, 10, device=device)
    c_kv = torch.randn(2, 1, 3, 6, device=device)
    k_rope = torch.randn(2, 3, 1, 4, device=device).transpose(1, 2)  # strided
    lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    torch.library.opcheck(ops.latent_cache_append.default, (cache, lens, c_kv, k_rope), {})
    torch.library.opcheck(
        ops.latent_cache_append.default,
        (
            cache.clone(),
            torch.zeros(2, dtype=torch.long, device=device),
            c_kv,
            k_rope,
            torch.tensor([3, 1], device=device),
        ),
        dict(rope_interleaved=True, rope_base=500.0),
    )
