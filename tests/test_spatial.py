"""Spatial attention (CBAM): the fused channel pooling and sigmoid gate against plain-PyTorch
references (attn_ext/testing/spatial.py), document 004's SpatialAttention (the drop-in) and the
CBAM paper's modules (attn_ext.nn), in NCHW and channels-last, odd sizes and every dtype.

Tolerances: float64 results agree with the reference to rounding (1e-12: same math, other
summation order). At float32/bfloat16/float16 the numerics rule applies: the error against a
float64 ground truth on the same (rounded) inputs is at most twice the reference's own error at
that dtype, plus a floor of a few ulps of the dtype (the channel mean sums in another order).
"""

import pytest
import torch
import torch.nn.functional as F

import attn_ext
import attn_ext.compat.attention_zoo as zoo
from attn_ext.testing import spatial as ref
from attn_ext.testing.documents import doc004

ops = torch.ops.attn_ext

LOW = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = ["nchw", "channels_last"]
# (N, C, H, W): 1x1 maps, odd maps, channel counts below / above / not a multiple of the
# CPU kernel's 8 lanes, a map larger than one 512-pixel tile.
SHAPES = [(2, 3, 1, 1), (2, 5, 7, 9), (1, 1, 4, 6), (3, 8, 5, 5), (2, 37, 9, 7), (2, 20, 23, 29)]
ULPS = 4


def make_x(shape, dtype, layout, device, requires_grad=False):
    x = torch.randn(shape, dtype=torch.float64, device=device).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(requires_grad)


def eps_of(dtype):
    return torch.finfo(dtype).eps


def assert_numerics(ours, ref_lo, truth, dtype, what):
    """Our error vs the float64 truth <= 2x the reference's error at the dtype + a floor."""
    scale = truth.abs().max().item() + 1e-30
    err = (ours.double() - truth).abs().max().item()
    ref_err = (ref_lo.double() - truth).abs().max().item()
    bound = 2 * ref_err + ULPS * eps_of(dtype) * scale
    assert err <= bound, (
        f"{what}: error {err:.3e} > bound {bound:.3e} (reference error {ref_err:.3e})"
    )


def is_layout(t, layout, x_shape=None):
    """t is dense in the layout the kernels chose for x (channels-last only when x is dense
    channels-last and not also dense NCHW, i.e. C > 1 and H * W > 1)."""
    n, c, h, w = x_shape if x_shape is not None else t.shape
    if layout == "channels_last" and c > 1 and h * w > 1:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.is_contiguous()


# ---------------------------------------------------------------------------------- ops


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_channel_pool_float64(device, shape, layout):
    x = make_x(shape, torch.float64, layout, device)
    pooled, argmax = attn_ext.channel_pool(x, return_argmax=True)
    expect = ref.channel_pool(x)
    torch.testing.assert_close(pooled, expect, rtol=1e-12, atol=1e-12)
    assert torch.equal(argmax.long(), torch.max(x, dim=1, keepdim=True).indices)
    assert argmax.dtype == torch.int32 and pooled.shape == (shape[0], 2, *shape[2:])
    assert pooled.is_contiguous(memory_format=torch.channels_last)  # always: the conv's layout


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_channel_pool_low_precision(device, shape, dtype, layout):
    x = make_x(shape, dtype, layout, device)
    pooled = attn_ext.channel_pool(x)
    assert pooled.dtype == dtype and pooled.is_contiguous(memory_format=torch.channels_last)
    truth = ref.channel_pool(x.double())
    assert_numerics(pooled, ref.channel_pool(x), truth, dtype, "pooled")
    # the max is a selection: exact at any dtype
    assert torch.equal(pooled[:, 1], torch.max(x, dim=1).values)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_channel_pool_ties_and_nan(device, layout, dtype):
    """Ties go to the first maximal channel and a NaN wins (the first NaN), as torch.max; with
    20 channels the CPU kernel's lanes hold channels j, j + 8 and the tail 16..19."""
    nan, inf = float("nan"), float("inf")
    x = torch.zeros(1, 20, 3, 3, device=device, dtype=dtype)
    x[0, 3, 0, 0] = x[0, 11, 0, 0] = 5.0  # tie within one lane: channel 3
    x[0, 2, 0, 1] = nan  # NaN beats a larger number
    x[0, 9, 0, 1] = 7.0
    x[0, 4, 0, 2] = x[0, 17, 0, 2] = nan  # first NaN: channel 4
    x[0, :, 1, 0] = -inf  # all -inf: channel 0
    x[0, 19, 1, 1] = 1.0  # max in the last channel (a lane tail)
    x[0, 6, 2, 0] = x[0, 9, 2, 0] = 5.0  # tie across lanes (6 in lane 6, 9 in lane 1): 6
    x[0, 18, 2, 1] = nan  # the only NaN in the tail
    x[0, :, 2, 2] = -inf
    x[0, 1, 2, 2], x[0, 12, 2, 2] = inf, nan  # NaN beats +inf in an earlier lane
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    pooled, argmax = attn_ext.channel_pool(x, return_argmax=True)
    expect_idx = torch.max(x, dim=1, keepdim=True).indices
    assert torch.equal(argmax.long(), expect_idx)
    assert argmax[0, 0, 0, 0] == 3 and argmax[0, 0, 0, 1] == 2 and argmax[0, 0, 0, 2] == 4
    assert argmax[0, 0, 1, 0] == 0 and argmax[0, 0, 1, 1] == 19
    assert argmax[0, 0, 2, 0] == 6 and argmax[0, 0, 2, 1] == 18 and argmax[0, 0, 2, 2] == 12
    eps = eps_of(dtype)  # one rounding of the mean
    torch.testing.assert_close(
        pooled.double(), ref.channel_pool(x.double()), equal_nan=True, rtol=eps, atol=0
    )
    # the max's gradient reaches only the argmax channel
    xg = x.clone().requires_grad_(True)
    attn_ext.channel_pool(xg)[:, 1].sum().backward()
    xr = x.clone().requires_grad_(True)
    torch.max(xr, dim=1).values.sum().backward()
    assert torch.equal(xg.grad, xr.grad)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_spatial_gate_float64(device, shape, layout):
    x = make_x(shape, torch.float64, layout, device, requires_grad=True)
    a = torch.randn(shape[0], 1, *shape[2:], dtype=torch.float64, device=device, requires_grad=True)
    out = attn_ext.spatial_gate(x, a)
    assert is_layout(out, layout)
    expect = ref.spatial_gate(x, a)
    torch.testing.assert_close(out, expect, rtol=1e-13, atol=1e-13)
    g = torch.randn_like(out)
    gx, ga = torch.autograd.grad(out, (x, a), g)
    rx, ra = torch.autograd.grad(expect, (x, a), g)
    torch.testing.assert_close(gx, rx, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ga, ra, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 5, 7, 9), (2, 37, 9, 7), (2, 20, 23, 29)], ids=lambda s: "x".join(map(str, s))
)
def test_spatial_gate_low_precision(device, shape, dtype, layout):
    x = make_x(shape, dtype, layout, device, requires_grad=True)
    a = torch.randn(shape[0], 1, *shape[2:], device=device).to(dtype).requires_grad_(True)
    g = torch.randn(shape, device=device).to(dtype)
    out = attn_ext.spatial_gate(x, a)
    gx, ga = torch.autograd.grad(out, (x, a), g)
    ref_out = ref.spatial_gate(x, a)
    rgx, rga = torch.autograd.grad(ref_out, (x, a), g)
    xd, ad = x.detach().double().requires_grad_(True), a.detach().double().requires_grad_(True)
    truth = ref.spatial_gate(xd, ad)
    tgx, tga = torch.autograd.grad(truth, (xd, ad), g.double())
    assert out.dtype == dtype and gx.dtype == dtype and ga.dtype == dtype
    assert_numerics(out, ref_out, truth, dtype, "out")
    assert_numerics(gx, rgx, tgx, dtype, "grad_x")
    assert_numerics(ga, rga, tga, dtype, "grad_gate")


@pytest.mark.parametrize("dtype", [torch.float64, *LOW], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_channel_pool_backward(device, layout, dtype):
    """30 pixels and 13 channels: the CPU kernels' 8-wide runs and their scalar tails."""
    x = make_x((2, 13, 6, 5), dtype, layout, device, requires_grad=True)
    pooled = attn_ext.channel_pool(x)
    g = torch.randn_like(pooled)
    (gx,) = torch.autograd.grad(pooled, x, g)
    xd = x.detach().double().requires_grad_(True)
    (rx,) = torch.autograd.grad(ref.channel_pool(xd), xd, g.double())
    # one rounding of g_avg / C + g_max to the dtype (the max's gradient reaches one channel)
    tol = 1e-13 if dtype == torch.float64 else eps_of(dtype)
    torch.testing.assert_close(gx.double(), rx, rtol=tol, atol=tol)
    assert is_layout(gx, layout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_spatial_gate_float32_gate(device, dtype):
    """A float32 gate (a float32 convolution's output) for a low-precision x: the gate is used
    unrounded and its gradient comes back in float32."""
    x = torch.randn(2, 6, 5, 7, device=device).to(dtype).requires_grad_(True)
    a = torch.randn(2, 1, 5, 7, device=device, requires_grad=True)
    out = attn_ext.spatial_gate(x, a)
    g = torch.randn_like(out)
    gx, ga = torch.autograd.grad(out, (x, a), g)
    assert out.dtype == dtype and gx.dtype == dtype and ga.dtype == torch.float32
    xd, ad = x.detach().double().requires_grad_(True), a.detach().double().requires_grad_(True)
    truth = ref.spatial_gate(xd, ad)
    tgx, tga = torch.autograd.grad(truth, (xd, ad), g.double())
    # one rounding to the dtype of a float32-exact value: half an ulp
    torch.testing.assert_close(out.double(), truth, rtol=eps_of(dtype), atol=0)
    torch.testing.assert_close(gx.double(), tgx, rtol=eps_of(dtype), atol=0)
    # grad_gate: float32 accumulation of C products of dtype-exact values
    torch.testing.assert_close(ga.double(), tga, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, *LOW], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_channel_pool_backward_accumulate(device, layout, dtype):
    x = make_x((2, 11, 5, 6), dtype, layout, device)
    _, argmax = attn_ext.channel_pool(x, return_argmax=True)
    gp = torch.randn(2, 2, 5, 6, device=device).to(dtype)
    base = make_x((2, 11, 5, 6), dtype, layout, device)
    acc = base.clone()
    ops.channel_pool_backward_accumulate_(acc, gp, argmax)
    fresh = ops.channel_pool_backward(gp, argmax, 11, channels_last=layout == "channels_last")
    expect = base.double() + fresh.double()
    tol = (
        dict(rtol=1e-13, atol=1e-13)
        if dtype == torch.float64
        else dict(rtol=eps_of(dtype), atol=eps_of(dtype))
    )
    torch.testing.assert_close(acc.double(), expect, **tol)
    with pytest.raises(RuntimeError, match="grad_x must be dense NCHW or channels-last"):
        ops.channel_pool_backward_accumulate_(base[:, :, :, :5], gp[..., :5], argmax[..., :5])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck(device, layout):
    x = make_x((2, 4, 3, 5), torch.float64, layout, device, requires_grad=True)
    a = torch.randn(2, 1, 3, 5, dtype=torch.float64, device=device, requires_grad=True)
    torch.autograd.gradcheck(lambda t: attn_ext.channel_pool(t), (x,))
    torch.autograd.gradcheck(attn_ext.spatial_gate, (x, a))
    conv = torch.randn(1, 2, 3, 3, dtype=torch.float64, device=device, requires_grad=True)
    torch.autograd.gradcheck(
        lambda t, w: attn_ext.spatial_gate(t, F.conv2d(attn_ext.channel_pool(t), w, padding=1)),
        (x, conv),
    )
    # the module's fused backward (gate and pooling gradients in one pass)
    sa = attn_ext.nn.SpatialAttention(3).to(device=device, dtype=torch.float64)
    torch.autograd.gradcheck(
        lambda t, w: torch.func.functional_call(sa, {"conv.weight": w}, (t,)), (x, conv)
    )


def test_strided_input_is_copied_not_misread(device):
    base = torch.randn(2, 10, 6, 8, dtype=torch.float64, device=device)
    x = base[:, ::2, :, 1:7]  # neither dense layout
    a = torch.randn(2, 1, 6, 6, dtype=torch.float64, device=device)
    torch.testing.assert_close(
        attn_ext.channel_pool(x), ref.channel_pool(x), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        attn_ext.spatial_gate(x, a), ref.spatial_gate(x, a), rtol=1e-13, atol=1e-13
    )
    # a gate given as a channels-last or expanded view
    a_view = torch.randn(2, 1, 1, 6, dtype=torch.float64, device=device).expand(2, 1, 6, 6)
    torch.testing.assert_close(attn_ext.spatial_gate(x, a_view), ref.spatial_gate(x, a_view))


def test_empty_maps(device):
    x = torch.randn(0, 3, 4, 4, device=device)
    assert attn_ext.channel_pool(x).shape == (0, 2, 4, 4)
    x = torch.randn(2, 0, 4, 4, device=device, requires_grad=True)
    a = torch.randn(2, 1, 4, 4, device=device, requires_grad=True)
    out = attn_ext.spatial_gate(x, a)
    out.sum().backward()
    assert out.shape == x.shape and torch.equal(a.grad, torch.zeros_like(a))


# ------------------------------------------------------------------------------ modules


def load_from(ours, doc):
    ours.load_state_dict(doc.state_dict(), strict=True)
    return ours


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel_size", [7, 3])
@pytest.mark.parametrize(
    "shape", [(2, 3, 16, 16), (2, 5, 7, 9), (3, 6, 1, 1)], ids=lambda s: "x".join(map(str, s))
)
def test_zoo_spatial_attention_matches_document(device, shape, kernel_size, layout):
    doc = doc004.SpatialAttention(kernel_size).to(device=device, dtype=torch.float64)
    ours = load_from(zoo.SpatialAttention(kernel_size), doc).to(device=device, dtype=torch.float64)
    x = make_x(shape, torch.float64, layout, device, requires_grad=True)
    m_doc, m_ours = doc(x), ours(x)
    torch.testing.assert_close(m_ours, m_doc, rtol=1e-12, atol=1e-12)
    assert m_ours.shape == (shape[0], 1, *shape[2:])
    # the document's usage: x * attn_map, differentiated end to end
    g = torch.randn(shape, dtype=torch.float64, device=device)
    gd = torch.autograd.grad(x * m_doc, [x, doc.conv1.weight], g)
    go = torch.autograd.grad(x * m_ours, [x, ours.conv1.weight], g)
    for a, b in zip(go, gd):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_zoo_spatial_attention_float32(device):
    doc = doc004.SpatialAttention().to(device)
    ours = load_from(zoo.SpatialAttention(), doc).to(device)
    x = torch.randn(2, 16, 20, 20, device=device)
    # float32: the channel mean sums in another order; a few ulps of the O(1) map
    torch.testing.assert_close(ours(x), doc(x), rtol=1e-5, atol=1e-6)


def test_zoo_spatial_attention_kernel_size_assert():
    with pytest.raises(AssertionError, match="kernel size must be 3 or 7"):
        zoo.SpatialAttention(5)


def _cbam_ref_params(m):
    return m.mlp[0].weight, m.mlp[2].weight, m.mlp[0].bias, m.mlp[2].bias


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_cbam_matches_paper(device, layout, bias):
    C = 32
    cbam = attn_ext.nn.CBAM(C, reduction_ratio=16, bias=bias).to(device=device, dtype=torch.float64)
    assert cbam.channel_attention.mlp[0].weight.shape == (2, C)  # C / r hidden units
    assert cbam.spatial_attention.conv.weight.shape == (1, 2, 7, 7)
    x = make_x((2, C, 9, 11), torch.float64, layout, device, requires_grad=True)
    out = cbam(x)
    w0, w1, b0, b1 = _cbam_ref_params(cbam.channel_attention)
    expect = ref.cbam(x, w0, w1, cbam.spatial_attention.conv.weight, b0, b1)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    assert is_layout(out, layout)
    params = [x] + list(cbam.parameters())
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(expect, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # the parts alone
    ca = cbam.channel_attention
    torch.testing.assert_close(ca(x), ref.cbam_channel(x, w0, w1, b0, b1), rtol=1e-12, atol=1e-12)
    sa = cbam.spatial_attention
    torch.testing.assert_close(sa(x), ref.cbam_spatial(x, sa.conv.weight), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        sa.attention_map(x), ref.doc_spatial_map(x, sa.conv.weight), rtol=1e-12, atol=1e-12
    )


def test_cbam_state_dict_round_trip(device):
    a = attn_ext.nn.CBAM(64, kernel_size=3).to(device)
    b = attn_ext.nn.CBAM(64, kernel_size=3).to(device)
    b.load_state_dict(a.state_dict(), strict=True)
    assert sorted(a.state_dict()) == [
        "channel_attention.mlp.0.weight",
        "channel_attention.mlp.2.weight",
        "spatial_attention.conv.weight",
    ]
    x = torch.randn(2, 64, 5, 5, device=device)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_spatial_gate_224(device, layout):
    sa = attn_ext.nn.SpatialAttention().to(device)
    x = make_x((1, 16, 224, 224), torch.float32, layout, device, requires_grad=True)
    out = sa(x)
    expect = ref.cbam_spatial(x, sa.conv.weight)
    # float32: the conv sees our pooled mean (other summation order) -> a few ulps
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    gx = torch.autograd.grad(out, x, g)[0]
    rx = torch.autograd.grad(expect, x, g)[0]
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cbam_low_precision_runs_in_dtype(device, dtype):
    m = attn_ext.nn.CBAM(32).to(device=device, dtype=dtype)
    x = torch.randn(2, 32, 8, 8, device=device, dtype=dtype, requires_grad=True)
    out = m(x)
    out.float().sum().backward()
    assert out.dtype == dtype and x.grad.dtype == dtype
    w0, w1, _, _ = _cbam_ref_params(m.channel_attention)
    xd = x.detach().double()
    truth = ref.cbam(xd, w0.double(), w1.double(), m.spatial_attention.conv.weight.double())
    ref_lo = ref.cbam(x.detach(), w0, w1, m.spatial_attention.conv.weight)
    assert_numerics(out.detach(), ref_lo, truth, dtype, "cbam")


# ---------------------------------------------------------------------------- bad input


def test_bad_input_messages(device):
    x = torch.randn(2, 4, 5, 5, device=device)
    with pytest.raises(RuntimeError, match=r"channel_pool: x must be 4-D \(N, C, H, W\), got 3-D"):
        attn_ext.channel_pool(x[0])
    with pytest.raises(RuntimeError, match="channel_pool: x must be a floating tensor"):
        attn_ext.channel_pool(x.long())
    with pytest.raises(RuntimeError, match="spatial_gate: gate must have shape"):
        attn_ext.spatial_gate(x, torch.randn(2, 2, 5, 5, device=device))
    with pytest.raises(
        RuntimeError, match="spatial_gate: gate must have x's dtype Float, got Double"
    ):
        attn_ext.spatial_gate(x, torch.randn(2, 1, 5, 5, device=device, dtype=torch.float64))
    with pytest.raises(
        RuntimeError, match="spatial_gate: gate must have x's dtype BFloat16 or float32, got Half"
    ):
        attn_ext.spatial_gate(
            x.bfloat16(), torch.randn(2, 1, 5, 5, device=device, dtype=torch.half)
        )
    with pytest.raises(RuntimeError, match="spatial_gate: x must be 4-D"):
        attn_ext.spatial_gate(x[0], torch.randn(2, 1, 5, 5, device=device))
    g = torch.randn(2, 2, 5, 5, device=device)
    with pytest.raises(RuntimeError, match="channel_pool_backward: argmax must be an int32 tensor"):
        ops.channel_pool_backward(g, torch.zeros(2, 1, 5, 5, device=device, dtype=torch.long), 4)
    with pytest.raises(
        RuntimeError, match="channel_pool_backward: grad_pooled must have 2 channels"
    ):
        ops.channel_pool_backward(
            torch.randn(2, 3, 5, 5, device=device),
            torch.zeros(2, 1, 5, 5, device=device, dtype=torch.int32),
            4,
        )
    with pytest.raises(RuntimeError, match="spatial_gate_backward: grad_out must have x's shape"):
        ops.spatial_gate_backward(
            torch.randn(2, 4, 5, 4, device=device), x, torch.randn(2, 1, 5, 5, device=device)
        )


def test_bad_module_input(device):
    with pytest.raises(ValueError, match=r"ChannelAttention: x must have 8 channels \(dim 1\)"):
        attn_ext.nn.ChannelAttention(8).to(device)(torch.randn(2, 4, 5, 5, device=device))
    with pytest.raises(ValueError, match="CBAM|ChannelAttention: x must be 4-D"):
        attn_ext.nn.CBAM(8).to(device)(torch.randn(8, 5, 5, device=device))
    with pytest.raises(ValueError, match="SpatialAttention: x must be 4-D"):
        attn_ext.nn.SpatialAttention().to(device)(torch.randn(8, 5, 5, device=device))
    with pytest.raises(ValueError, match=r"SpatialAttention: expected a 4-D input"):
        zoo.SpatialAttention().to(device)(torch.randn(8, 5, 5, device=device))
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        attn_ext.nn.SpatialAttention(4)


# ------------------------------------------------------------- vectorized CUDA kernels

# spatial_vec.cu: compiled, not yet run on a GPU, so its tests opt in (ATTN_EXT_UNVERIFIED_CUDA=1)
# and run on CUDA only (on the CPU the variable changes nothing). The shapes take both paths of
# every kernel: 16-byte vectors (H * W, for NCHW, or C, for channels-last, a multiple of
# 16 bytes / element size) and the scalar path (sizes that are not, or a storage offset of one
# element); the large ones make the grids stride.
VEC_DEVICE = "cuda"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
VEC_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
VEC_SHAPES = [
    (2, 37, 8, 8),  # NCHW vectors (P = 64); channels-last scalar (C = 37)
    (2, 24, 23, 29),  # NCHW scalar (P = 667); channels-last vectors (C = 24)
    (3, 256, 7, 8),  # both vectors, many channels per warp / lane group
    (2, 12, 5, 6),  # fp32: channels-last vectors only; bf16 / fp16: scalar; fp64: both
    (1, 3, 1, 1),  # fewer channels than warps in an NCHW block
    (32, 8, 128, 128),  # grid-stride in both layouts
]


@pytest.fixture
def vectorized(monkeypatch):
    monkeypatch.setenv("ATTN_EXT_UNVERIFIED_CUDA", "1")


def make_vec_x(shape, dtype, layout, offset, generator=torch.randn):
    """x on VEC_DEVICE, dense in `layout`, its data `offset` elements into its storage (an
    offset of 1 misaligns every 16-byte vector: the kernels must take the scalar path)."""
    n, c, h, w = shape
    dims = (n, h, w, c) if layout == "channels_last" else shape
    flat = generator(n * c * h * w + offset, dtype=torch.float64, device=VEC_DEVICE).to(dtype)
    x = flat[offset:].view(dims)
    return x.permute(0, 3, 1, 2) if layout == "channels_last" else x


vec_params = [
    pytest.mark.parametrize("offset", [0, 1]),
    pytest.mark.parametrize("layout", LAYOUTS),
    pytest.mark.parametrize("dtype", VEC_DTYPES, ids=str),
    pytest.mark.parametrize("shape", VEC_SHAPES, ids=lambda s: "x".join(map(str, s))),
]


def with_vec_params(fn):
    for mark in vec_params:
        fn = mark(fn)
    return requires_cuda(fn)


def assert_vec_close(ours, ref_lo, truth, dtype, what):
    if dtype == torch.float64:
        torch.testing.assert_close(ours, truth, rtol=1e-12, atol=1e-12, msg=what)
    else:
        assert_numerics(ours, ref_lo, truth, dtype, what)


@with_vec_params
def test_vectorized_channel_pool(vectorized, shape, dtype, layout, offset):
    x = make_vec_x(shape, dtype, layout, offset)
    pooled, argmax = attn_ext.channel_pool(x, return_argmax=True)
    assert pooled.dtype == dtype and pooled.is_contiguous(memory_format=torch.channels_last)
    assert_vec_close(pooled, ref.channel_pool(x), ref.channel_pool(x.double()), dtype, "pooled")
    assert torch.equal(argmax.long(), torch.max(x, dim=1, keepdim=True).indices)
    assert torch.equal(pooled[:, 1], torch.max(x, dim=1).values)


@with_vec_params
def test_vectorized_channel_pool_ties_and_nan(vectorized, shape, dtype, layout, offset):
    """Few distinct values (ties everywhere), -inf and NaN: the argmax is torch.max's."""

    def values(numel, dtype, device):
        v = torch.randint(-2, 3, (numel,), device=device).to(dtype)
        v[torch.rand(numel, device=device) < 0.02] = float("nan")
        v[torch.rand(numel, device=device) < 0.05] = float("-inf")
        return v

    x = make_vec_x(shape, dtype, layout, offset, generator=values)
    pooled, argmax = attn_ext.channel_pool(x, return_argmax=True)
    assert torch.equal(argmax.long(), torch.max(x, dim=1, keepdim=True).indices)
    torch.testing.assert_close(pooled[:, 1], torch.max(x, dim=1).values, equal_nan=True)


@requires_cuda
@pytest.mark.parametrize("dtype", VEC_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vectorized_channel_pool_fixed_ties(vectorized, layout, dtype):
    test_channel_pool_ties_and_nan(VEC_DEVICE, layout, dtype)


@with_vec_params
@pytest.mark.parametrize("gate_dtype", ["x", "float32"])
def test_vectorized_spatial_gate(vectorized, shape, dtype, layout, offset, gate_dtype):
    if gate_dtype == "float32" and dtype not in (torch.bfloat16, torch.float16):
        pytest.skip("a float32 gate is for bfloat16 / float16 x")
    x = make_vec_x(shape, dtype, layout, offset).requires_grad_(True)
    gdt = torch.float32 if gate_dtype == "float32" else dtype
    a = torch.randn(shape[0], 1, *shape[2:], device=VEC_DEVICE).to(gdt).requires_grad_(True)
    g = make_vec_x(shape, dtype, layout, offset)
    out = attn_ext.spatial_gate(x, a)
    gx, ga = torch.autograd.grad(out, (x, a), g)
    assert out.dtype == gx.dtype == dtype and ga.dtype == gdt
    assert is_layout(out, layout) and is_layout(gx, layout)
    ref_out = ref.spatial_gate(x, a)
    rgx, rga = torch.autograd.grad(ref_out, (x, a), g)
    xd, ad = x.detach().double().requires_grad_(True), a.detach().double().requires_grad_(True)
    truth = ref.spatial_gate(xd, ad)
    tgx, tga = torch.autograd.grad(truth, (xd, ad), g.double())
    assert_vec_close(out, ref_out, truth, dtype, "out")
    assert_vec_close(gx, rgx, tgx, dtype, "grad_x")
    assert_vec_close(ga, rga.to(gdt), tga, gdt if gdt == torch.float32 else dtype, "grad_gate")


@with_vec_params
@pytest.mark.parametrize("accumulate", [False, True])
def test_vectorized_channel_pool_backward(vectorized, shape, dtype, layout, offset, accumulate):
    x = make_vec_x(shape, dtype, layout, offset)
    _, argmax = attn_ext.channel_pool(x, return_argmax=True)
    gp = torch.randn(shape[0], 2, *shape[2:], device=VEC_DEVICE).to(dtype)
    # the pooling's gradient in float64: g_avg / C everywhere, g_max at the argmax channel
    expect = (gp[:, :1].double() / shape[1]).expand(shape).clone()
    expect.scatter_add_(1, argmax.long(), gp[:, 1:].double())
    channels_last = layout == "channels_last" and shape[1] > 1 and shape[2] * shape[3] > 1
    if accumulate:
        grad_x = make_vec_x(shape, dtype, layout, offset)
        expect += grad_x.double()
        ops.channel_pool_backward_accumulate_(grad_x, gp, argmax)
    else:
        grad_x = ops.channel_pool_backward(gp, argmax, shape[1], channels_last=channels_last)
        assert is_layout(grad_x, layout, shape)
    # each element is one or two roundings of float64-exact terms
    tol = 1e-13 if dtype == torch.float64 else 2 * eps_of(dtype)
    torch.testing.assert_close(grad_x.double(), expect, rtol=tol, atol=tol)


@requires_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vectorized_module_matches_verified(monkeypatch, layout, dtype):
    """The CBAM spatial gate, forward and backward, with the vectorized kernels against the
    verified ones on the same inputs (same formulas; sums in another order)."""
    sa = attn_ext.nn.SpatialAttention().to(device=VEC_DEVICE, dtype=dtype)
    x = make_vec_x((4, 64, 28, 28), dtype, layout, 0).requires_grad_(True)
    g = torch.randn_like(x)
    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("ATTN_EXT_UNVERIFIED_CUDA", flag)
        out = sa(x)
        results[flag] = (out, *torch.autograd.grad(out, (x, sa.conv.weight), g))
    for name, a, b in zip(("out", "grad_x", "grad_w"), results["1"], results["0"]):
        scale = b.abs().max().item()
        tol = 8 * eps_of(dtype) * scale if name != "grad_w" else 1e-3 * scale
        torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=name)
