"""GPU-only cases of attn_ext.attention (the CUDA kernels of csrc/attention/cuda/flash): the
shapes and paths the device-parametrized suite does not reach. Skipped without a visible GPU.

Numerics rule (design.md, with torch's own attention as the reference): the kernel's max-abs
error against a float64 truth computed from the very same inputs is at most 2x the error of
F.scaled_dot_product_attention (torch's default backend) at the same dtype, plus one rounding
unit of the output dtype (reference.assert_error_rule). 2x is the FlashAttention rule: both
kernels round P to the input dtype before P V, in different orders.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing.attention import attention_reference, window_keep
from attn_ext.testing.harness import cuda_kernel_names
from attn_ext.testing.numerics import (
    assert_error_rule,
    assert_lse_close,
    autograd_grads,
    grad_slack_ulps,
    ground_truth,
    ground_truth_grads,
    make_qkv,
    random_bool_mask,
    random_float_mask,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

DEV = "cuda"
LOW = [pytest.param(torch.bfloat16, id="bfloat16"), pytest.param(torch.float16, id="float16")]
DTYPES = LOW + [pytest.param(torch.float32, id="float32")]
TRUTH_CHUNK = 1024  # query rows per float64 truth chunk: 1024 x 16k x 8 B = 128 MiB of scores


def plain_chunked(q, k, v, causal, dtype=torch.float64):
    """softmax(q k^T / sqrt(D)) v at `dtype` (softmax in fp32 for 16-bit dtypes; bottom-right
    causal), query rows in chunks so that S = 16k fits; float64 is the truth."""
    q2, k2, v2 = (x.to(dtype) for x in (q, k, v))
    sq, sk = q.shape[2], k.shape[2]
    out = torch.empty(*q.shape[:3], v.shape[3], dtype=dtype, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[3])
    for i0 in range(0, sq, TRUTH_CHUNK):
        s = (q2[:, :, i0 : i0 + TRUTH_CHUNK] @ k2.transpose(-2, -1)) * scale
        if causal:
            i = torch.arange(i0, min(sq, i0 + TRUTH_CHUNK), device=q.device).unsqueeze(1) + (
                sk - sq
            )
            s = s.masked_fill(torch.arange(sk, device=q.device) > i, float("-inf"))
        p = torch.softmax(s.float() if dtype in (torch.bfloat16, torch.float16) else s, dim=-1)
        out[:, :, i0 : i0 + TRUTH_CHUNK] = p.to(dtype) @ v2
    return out


def less_exact(a, b, truth):
    """Whichever of two torch results is further from the truth: the allowance of the rule is
    torch's own error at this dtype, from its fused kernel (SDPA) or its plain matmul path,
    whichever is larger (fp32 SDPA on a GPU is exact to ~1 ulp, tighter than any blocked
    fp32 accumulation)."""

    def err(x):
        return (x.double() - truth).abs().max().item()

    return a if err(a) >= err(b) else b


def sdpa(q, k, v, causal=False, **kw):
    """torch's attention at the input dtype (Sq == Sk where causal: top-left == bottom-right)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)


def check_vs_truth(q, k, v, **kw):
    """Forward and lse: error rule against attention_reference at the input dtype (it
    handles every option)."""
    out, lse = attn_ext.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    tru, tru_lse = ground_truth(attention_reference, q, k, v, return_lse=True, **kw)
    assert_error_rule(out, ref, tru)
    assert_lse_close(lse, ref_lse, tru_lse)
    return out, lse


def check_grads(q, k, v, **kw):
    g = torch.randn(*q.shape[:-1], v.shape[-1], device=DEV).to(q.dtype)
    got = autograd_grads(lambda a, b, c: attn_ext.attention(a, b, c, **kw), [q, k, v], g)
    ref = autograd_grads(lambda a, b, c: attention_reference(a, b, c, **kw), [q, k, v], g)
    tru = ground_truth_grads(attention_reference, [q, k, v], g, **kw)
    for name, a, r, t in zip(("dq", "dk", "dv"), got, ref, tru):
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(a.dtype))


# --------------------------------------------------------------------------- #
# Large shapes against torch's SDPA
# --------------------------------------------------------------------------- #
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "S,D,causal",
    [
        (2048, 64, False),
        (4096, 128, True),
        (16384, 128, True),
        (16384, 64, False),
        (8192, 256, True),
    ],
)
def test_large_forward_vs_sdpa(dtype, S, D, causal):
    q, k, v = make_qkv(1, 2, 2, S, S, D, dtype=dtype, device=DEV)
    out = attn_ext.attention(q, k, v, causal=causal)
    tru = plain_chunked(q, k, v, causal)
    assert_error_rule(
        out, less_exact(sdpa(q, k, v, causal), plain_chunked(q, k, v, causal, dtype), tru), tru
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_large_backward_vs_sdpa(dtype, causal):
    S, D = 2048, 128
    q, k, v = make_qkv(1, 2, 2, S, S, D, dtype=dtype, device=DEV)
    g = torch.randn(1, 2, S, D, device=DEV).to(dtype)
    got = autograd_grads(lambda a, b, c: attn_ext.attention(a, b, c, causal=causal), [q, k, v], g)
    ref = autograd_grads(lambda a, b, c: sdpa(a, b, c, causal), [q, k, v], g)
    tru = autograd_grads(
        lambda a, b, c: sdpa(a, b, c, causal), [x.double() for x in (q, k, v)], g.double()
    )
    for name, a, r, t in zip(("dq", "dk", "dv"), got, ref, tru):
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(a.dtype))


# --------------------------------------------------------------------------- #
# Odd lengths, head dims (tensor-core 64 / 128 / 256, padded, generic), Dv != D
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq", [1, 17, 127, 1000])
@pytest.mark.parametrize("sk", [1, 17, 127, 1000])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_lengths(dtype, sq, sk, causal):
    q, k, v = make_qkv(2, 2, 2, sq, sk, 64, dtype=dtype, device=DEV)
    out, lse = check_vs_truth(q, k, v, causal=causal)
    if causal:
        empty = ~window_keep(sq, sk, causal=True, device=DEV).any(-1)
        assert (out[:, :, empty] == 0).all() and (lse[:, :, empty] == float("-inf")).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "D,Dv",
    [
        (64, 64),
        (128, 128),
        (256, 256),
        (40, 40),
        (96, 96),
        (200, 200),
        (72, 136),
        (320, 320),
        (512, 64),
    ],
)
def test_head_dims(dtype, D, Dv):
    q, k, v = make_qkv(1, 3, 3, 130, 150, D, Dv, dtype=dtype, device=DEV)
    check_vs_truth(q, k, v)
    check_vs_truth(q, k, v, causal=True)
    check_grads(q, k, v, causal=True)


# --------------------------------------------------------------------------- #
# Masks, fully masked rows, windows, strides
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float", "bool_broadcast_key", "float_broadcast_head"])
def test_masks(dtype, kind):
    B, H, Sq, Sk, D = 2, 3, 100, 140, 64
    q, k, v = make_qkv(B, H, H, Sq, Sk, D, dtype=dtype, device=DEV)
    if kind == "bool":
        mask = random_bool_mask((B, H, Sq, Sk), DEV)
    elif kind == "float":
        mask = random_float_mask((B, H, Sq, Sk), dtype, DEV)
    elif kind == "bool_broadcast_key":
        mask = random_bool_mask((B, 1, 1, Sk), DEV)
    else:
        mask = random_float_mask((1, 1, Sq, Sk), dtype, DEV)
    check_vs_truth(q, k, v, attn_mask=mask)
    check_grads(q, k, v, attn_mask=mask, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(dtype):
    B, H, Sq, Sk, D = 2, 2, 150, 130, 128
    q, k, v = make_qkv(B, H, H, Sq, Sk, D, dtype=dtype, device=DEV)
    mask = random_bool_mask((B, H, Sq, Sk), DEV)
    dead = [0, 63, 64, 65, 149]  # across the 64-row blocks of the tensor-core kernel
    mask[:, :, dead] = False
    out, lse = check_vs_truth(q, k, v, attn_mask=mask, causal=True)
    empty = ~(mask & window_keep(Sq, Sk, causal=True, device=DEV)).any(-1)
    assert empty[:, :, dead].all()
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    attn_ext.attention(qg, kg, vg, attn_mask=mask, causal=True).float().square().sum().backward()
    for x in (qg, kg, vg):
        assert torch.isfinite(x.grad).all()
    assert (qg.grad[empty] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(100, 0), (31, 64), (0, 0), (-1, 33), (700, -1)])
def test_windows(dtype, window):
    q, k, v = make_qkv(1, 2, 2, 600, 777, 64, dtype=dtype, device=DEV)
    check_vs_truth(q, k, v, window_size=window)
    if window != (0, 0):
        # (0, 0): every row sees one key, so the reference's dq is exactly 0 (P = 1) while a
        # kernel recomputing P from lse gets P = 1 - O(eps): the 2x rule cannot apply there
        check_grads(q, k, v, window_size=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "noncontig", "expand_b", "misaligned"])
def test_strided_inputs(dtype, layout):
    B, H, S, D = 2, 4, 200, 64
    if layout == "misaligned":
        # row starts 16-byte aligned nowhere: the tensor-core kernel's element-wise load path
        q, k, v = (torch.randn(B, H, S, D + 1, device=DEV).to(dtype)[..., 1:] for _ in range(3))
    else:
        q, k, v = make_qkv(B, H, H, S, S, D, dtype=dtype, device=DEV, layout=layout)
    check_vs_truth(q, k, v, causal=True)
    check_grads(q, k, v)


# --------------------------------------------------------------------------- #
# GQA / MQA by index
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv", [(32, 8), (32, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_vs_sdpa(dtype, h, hkv, causal):
    S, D = 512, 128
    q, k, v = make_qkv(2, h, hkv, S, S, D, dtype=dtype, device=DEV)
    out = attn_ext.attention(q, k, v, causal=causal)
    tru = ground_truth(attention_reference, q, k, v, causal=causal)
    assert_error_rule(out, sdpa(q, k, v, causal, enable_gqa=True), tru)
    check_grads(q[:, :, :130], k[:, :, :150], v[:, :, :150], causal=causal)


# --------------------------------------------------------------------------- #
# Dropout: the CPU's keep mask bit for bit, its statistics, its backward
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_equals_cpu(dtype, p):
    """Zero queries give uniform probabilities; v = identity reads the keep mask back."""
    B, H, Sq, Sk = 2, 3, 77, 64
    q = torch.zeros(B, H, Sq, 64, device=DEV, dtype=dtype)
    k = torch.zeros(B, H, Sk, 64, device=DEV, dtype=dtype)
    eye = torch.eye(Sk, device=DEV, dtype=dtype).expand(B, H, Sk, Sk)
    out = attn_ext.attention(q, k, eye, dropout_p=p, generator=torch.Generator().manual_seed(11))
    keep = attn_ext.dropout_keep_mask(B, H, Sq, Sk, p, generator=torch.Generator().manual_seed(11))
    assert torch.equal((out != 0).cpu(), keep)
    expected = torch.tensor(1.0 / ((1.0 - p) * Sk), dtype=dtype).item()
    assert torch.equal(out[out != 0].cpu(), torch.full_like(out[out != 0].cpu(), expected))


@pytest.mark.parametrize("p", [0.1, 0.3, 0.9])
def test_dropout_statistics(p):
    """Kept fraction over 4M entries within 5 sigma of 1 - p, and per key column."""
    B, H, Sq, Sk = 4, 4, 512, 512
    q = torch.zeros(B, H, Sq, 64, device=DEV, dtype=torch.bfloat16)
    v = torch.eye(Sk, device=DEV, dtype=torch.bfloat16).expand(B, H, Sk, Sk)
    out = attn_ext.attention(q, q[:, :, :Sk], v, dropout_p=p)
    kept = (out != 0).float()
    n = kept.numel()
    assert abs(kept.mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    col = kept.mean(dim=(0, 1, 2))
    assert ((col - (1 - p)).abs() < 6 * math.sqrt(p * (1 - p) / (B * H * Sq))).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_backward(dtype, causal):
    B, H, Hkv, Sq, Sk, D, p = 2, 4, 2, 130, 200, 64, 0.3
    q, k, v = make_qkv(B, H, Hkv, Sq, Sk, D, dtype=dtype, device=DEV)
    keep = attn_ext.dropout_keep_mask(
        B, H, Sq, Sk, p, generator=torch.Generator().manual_seed(3)
    ).to(DEV)
    kw = dict(causal=causal, dropout_p=p)

    def fn(a, b, c):
        return attn_ext.attention(a, b, c, generator=torch.Generator().manual_seed(3), **kw)

    def ref_fn(a, b, c, **extra):
        return attention_reference(a, b, c, dropout_keep=keep, **kw, **extra)

    assert_error_rule(fn(q, k, v), ref_fn(q, k, v), ground_truth(ref_fn, q, k, v))
    g = torch.randn(B, H, Sq, D, device=DEV).to(dtype)
    got = autograd_grads(fn, [q, k, v], g)
    ref = autograd_grads(ref_fn, [q, k, v], g)
    tru = ground_truth_grads(ref_fn, [q, k, v], g)
    for name, a, r, t in zip(("dq", "dk", "dv"), got, ref, tru):
        assert_error_rule(a, r, t, name=name, slack_ulps=grad_slack_ulps(a.dtype))


# --------------------------------------------------------------------------- #
# Determinism, streams, float64
# --------------------------------------------------------------------------- #
@pytest.fixture
def deterministic_algorithms():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_deterministic(dtype, deterministic_algorithms):
    """Under torch.use_deterministic_algorithms, identical bits twice: the CuTe backward (the
    default for bf16 / fp16) adds dQ by atomics, so it yields to the generic kernel there."""
    q, k, v = make_qkv(2, 8, 2, 300, 300, 64, dtype=dtype, device=DEV)
    g = torch.randn(2, 8, 300, 64, device=DEV).to(dtype)
    a = autograd_grads(lambda x, y, z: attn_ext.attention(x, y, z, causal=True), [q, k, v], g)
    b = autograd_grads(lambda x, y, z: attn_ext.attention(x, y, z, causal=True), [q, k, v], g)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# (B, H, Hkv, Sq, Sk, D, options): the CuTe backward's inputs (D == Dv in 64 / 128) at block
# edges (64 query rows, 128 keys), odd lengths, GQA / MQA, causal both alignments, windows
CUTE_BWD_CASES = [
    (2, 4, 4, 128, 128, 64, {}),
    (1, 4, 2, 129, 257, 128, {}),
    (1, 8, 1, 1, 300, 64, {}),
    (1, 2, 2, 300, 1, 128, {}),
    (2, 4, 4, 200, 200, 128, dict(causal=True)),
    (1, 4, 2, 65, 300, 64, dict(causal=True)),
    (1, 4, 4, 300, 65, 128, dict(causal=True)),
    (1, 2, 2, 333, 333, 64, dict(window_size=(31, 17))),
    (1, 2, 2, 256, 400, 128, dict(window_size=(-1, 40))),
]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", CUTE_BWD_CASES, ids=str)
def test_cute_backward(dtype, case):
    """The CuTe backward (the default since it ran green on an H100, 2026-11-27) by the suite's
    error rule against the reference's gradients and float64."""
    B, H, Hkv, Sq, Sk, D, kw = case
    q, k, v = make_qkv(B, H, Hkv, Sq, Sk, D, dtype=dtype, device=DEV)
    check_grads(q, k, v, **kw)


# The two-stage kernel's loop alternates stages over many query blocks: 16 of them here.
PREFETCH_CASES = CUTE_BWD_CASES + [(1, 2, 1, 1000, 700, 128, dict(causal=True))]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", PREFETCH_CASES, ids=str)
def test_cute_backward_prefetch(dtype, case, monkeypatch):
    """The CuTe backward with two query stages (ATTN_EXT_CUDA_BWD_KERNEL=cute_prefetch: the next
    query block's Q / dO load while this block's products run; compiled, not yet run on a GPU,
    so opted in here) by the one-stage kernel's rule."""
    monkeypatch.setenv("ATTN_EXT_CUDA_BWD_KERNEL", "cute_prefetch")
    monkeypatch.setenv("ATTN_EXT_UNVERIFIED_CUDA", "1")
    B, H, Hkv, Sq, Sk, D, kw = case
    q, k, v = make_qkv(B, H, Hkv, Sq, Sk, D, dtype=dtype, device=DEV)
    check_grads(q, k, v, **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_backward_kernel_choice(monkeypatch):
    """ATTN_EXT_CUDA_BWD_KERNEL: unset or cute runs the one-stage CuTe backward, cute_prefetch
    the two-stage one (only with ATTN_EXT_UNVERIFIED_CUDA=1 until it has run on a GPU), generic
    the generic kernel (the profiler says which); other values are clear errors."""
    q, k, v = make_qkv(1, 2, 2, 200, 300, 128, dtype=torch.bfloat16, device=DEV)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attn_ext.attention(q, k, v, causal=True)
    g = torch.randn_like(out)

    def backward_kernels():
        names = cuda_kernel_names(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
        return [n for n in names if "flash_bwd" in n and "preprocess" not in n]

    monkeypatch.delenv("ATTN_EXT_UNVERIFIED_CUDA", raising=False)
    for value, expected in ((None, "128, 1>"), ("cute", "128, 1>"), ("generic", "flash_bwd_dq")):
        if value is None:
            monkeypatch.delenv("ATTN_EXT_CUDA_BWD_KERNEL", raising=False)
        else:
            monkeypatch.setenv("ATTN_EXT_CUDA_BWD_KERNEL", value)
        names = backward_kernels()
        assert any(expected in n for n in names), (value, names)
    monkeypatch.setenv("ATTN_EXT_CUDA_BWD_KERNEL", "cute_prefetch")
    with pytest.raises(RuntimeError, match="has not yet run on a GPU"):
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    monkeypatch.setenv("ATTN_EXT_UNVERIFIED_CUDA", "1")
    names = backward_kernels()
    assert any("128, 2>" in n for n in names), names
    monkeypatch.setenv("ATTN_EXT_CUDA_BWD_KERNEL", "flash2")
    with pytest.raises(RuntimeError, match="expected 'cute', 'cute_prefetch' or 'generic'"):
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


# (B, H, Hkv, Sq, Sk, D, options): the CuTe and Hopper forwards' inputs (D == Dv in 64 / 128 /
# 256) at their block edges (128 query rows; 64 or 128 keys), odd lengths, one row or one key,
# GQA / MQA, causal with Sq != Sk both ways (bottom-right), windows
TC_FWD_CASES = [
    (2, 4, 4, 128, 128, 64, {}),
    (1, 4, 2, 129, 257, 128, {}),
    (1, 8, 1, 1, 300, 64, {}),
    (1, 2, 2, 300, 1, 128, {}),
    (1, 2, 2, 200, 333, 256, {}),
    (2, 4, 4, 200, 200, 128, dict(causal=True)),
    (1, 4, 2, 65, 300, 64, dict(causal=True)),
    (1, 4, 4, 300, 65, 128, dict(causal=True)),
    (1, 2, 1, 257, 257, 256, dict(causal=True)),
    (1, 2, 2, 333, 333, 64, dict(window_size=(31, 17))),
    (1, 2, 2, 256, 400, 128, dict(window_size=(-1, 40))),
]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", TC_FWD_CASES, ids=str)
def test_cute_forward(dtype, case, monkeypatch):
    """The CuTe forward with its FoldScale exp2 step (ATTN_EXT_CUDA_FWD_KERNEL=cute: on compute
    capability 9.x the default is the Hopper kernel) by the suite's error rule, out and lse;
    the profiler says that kernel ran."""
    monkeypatch.setenv("ATTN_EXT_CUDA_FWD_KERNEL", "cute")
    B, H, Hkv, Sq, Sk, D, kw = case
    q, k, v = make_qkv(B, H, Hkv, Sq, Sk, D, dtype=dtype, device=DEV)
    check_vs_truth(q, k, v, **kw)
    names = cuda_kernel_names(lambda: attn_ext.attention(q, k, v, **kw))
    assert any("flash_fwd_cute" in n and "FoldScale" in n for n in names), names


@pytest.mark.parametrize("scale", [-0.125, 0.0])
def test_cute_forward_keeps_its_scale_rule(scale, monkeypatch):
    """FoldScale takes the row max over unscaled scores, which is the scaled max only for
    scale > 0: other scales run the ScaleFirst exp2 step, with the same results."""
    monkeypatch.setenv("ATTN_EXT_CUDA_FWD_KERNEL", "cute")
    q, k, v = make_qkv(1, 4, 2, 200, 300, 128, dtype=torch.bfloat16, device=DEV)
    check_vs_truth(q, k, v, scale=scale, causal=True)
    names = cuda_kernel_names(lambda: attn_ext.attention(q, k, v, scale=scale))
    assert any("flash_fwd_cute" in n and "ScaleFirst" in n for n in names), names


def on_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not on_hopper(), reason="the Hopper forward runs on compute capability 9.x")
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("layout", ["contiguous", "bshd"])
@pytest.mark.parametrize("case", TC_FWD_CASES, ids=str)
def test_hopper_forward(dtype, layout, case, monkeypatch):
    """The sm_90a forward (the default on compute capability 9.x) by the suite's error rule, out
    and lse, on contiguous (B, H, S, D) inputs and (B, S, H, D) views (the TMA descriptors from
    other strides)."""
    monkeypatch.setenv("ATTN_EXT_CUDA_FWD_KERNEL", "hopper")
    B, H, Hkv, Sq, Sk, D, kw = case
    q, k, v = make_qkv(B, H, Hkv, Sq, Sk, D, dtype=dtype, device=DEV, layout=layout)
    check_vs_truth(q, k, v, **kw)


@pytest.mark.skipif(not on_hopper(), reason="the Hopper forward runs on compute capability 9.x")
def test_hopper_forward_falls_back_on_expanded_batch(monkeypatch):
    """Stride-0 (expanded) batches are not TMA-legal: the sm_80 kernel serves them."""
    monkeypatch.setenv("ATTN_EXT_CUDA_FWD_KERNEL", "hopper")
    q, k, v = make_qkv(2, 4, 2, 200, 300, 128, dtype=torch.bfloat16, device=DEV, layout="expand_b")
    check_vs_truth(q, k, v, causal=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forward_kernel_choice(monkeypatch):
    """Unset, ATTN_EXT_CUDA_FWD_KERNEL runs the Hopper forward on compute capability 9.x and the
    CuTe forward elsewhere (the profiler says which); =hopper off 9.x and unknown values are
    clear errors, never a silent change of kernel."""
    q, k, v = make_qkv(1, 2, 2, 200, 300, 128, dtype=torch.bfloat16, device=DEV)
    monkeypatch.delenv("ATTN_EXT_CUDA_FWD_KERNEL", raising=False)
    names = cuda_kernel_names(lambda: attn_ext.attention(q, k, v, causal=True))
    expected = "flash_fwd_hopper" if on_hopper() else "flash_fwd_cute"
    assert any(expected in n for n in names), names
    monkeypatch.setenv("ATTN_EXT_CUDA_FWD_KERNEL", "hopper")
    if not on_hopper():
        with pytest.raises(RuntimeError, match="needs a device of compute capability 9.x"):
            attn_ext.attention(q, k, v)
    monkeypatch.setenv("ATTN_EXT_CUDA_FWD_KERNEL", "wgmma")
    with pytest.raises(RuntimeError, match="expected 'hopper', 'cute' or 'mma'"):
        attn_ext.attention(q, k, v)


def test_runs_on_the_current_stream():
    q, k, v = make_qkv(2, 4, 4, 256, 256, 64, dtype=torch.bfloat16, device=DEV)
    expected = attn_ext.attention(q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = attn_ext.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got, expected)


def test_float64_exact():
    q, k, v = make_qkv(1, 2, 2, 70, 90, 48, 40, dtype=torch.float64, device=DEV)
    check_vs_truth(q, k, v, causal=True)
    check_grads(q, k, v, causal=True)


def test_cpu_and_cuda_agree():
    q, k, v = make_qkv(1, 4, 2, 100, 120, 64, dtype=torch.float32, device="cpu")
    mask = random_bool_mask((1, 1, 100, 120), "cpu")
    kw = dict(causal=True, attn_mask=mask, dropout_p=0.2)
    cpu = attn_ext.attention(q, k, v, generator=torch.Generator().manual_seed(9), **kw)
    gpu = attn_ext.attention(
        q.to(DEV),
        k.to(DEV),
        v.to(DEV),
        generator=torch.Generator().manual_seed(9),
        **{**kw, "attn_mask": mask.to(DEV)},
    )
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-5)
