"""float32 accuracy at every head dim, as a statistic over many outputs.

The per-element rule (attn_ext.testing.numerics) bounds the worst element of small cases; this
file bounds the *distribution* of the error at head dims up to 512, where a score's dot product
is long: each score summed as one fused multiply-add chain over D had 1.6x torch's mean error
at D = 256 and 1.9x at D = 512 (issue 24, item 6). The CPU kernels now sum it in chunks
(kDotChunk in csrc/attention/cpu/row_tiles.h). Measured 2026-11-24 (Zen 3): mean error 0.66x to
0.97x torch's SDPA, 99.99th percentile 0.53x to 0.91x, gradients 0.69x to 0.92x.
"""

import pytest
import torch
import torch.nn.functional as F

import attn_ext

HEAD_DIMS = [64, 96, 128, 192, 256, 384, 512]
# Targets of issue 24: mean |error| at most 1.1x torch's, the 99.99th percentile at most 1.5x
# (a tail statistic of ~1M errors moves more between seeds than the mean).
MEAN_RATIO = 1.1
TAIL_RATIO = 1.5
TAIL_Q = 0.9999
# torch.quantile refuses inputs past 16M elements; 2M samples pin the 99.99th percentile.
TAIL_SAMPLES = 2_000_000


def _errors(x, truth):
    return (x.double() - truth).abs().flatten()


def _tail(err):
    if err.numel() > TAIL_SAMPLES:
        err = err[torch.randperm(err.numel())[:TAIL_SAMPLES]]
    return torch.quantile(err, TAIL_Q).item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_float32_forward_error_matches_torch(head_dim, causal):
    # CPU only: the CUDA fp32 kernel still sums each score in one chain (issue 24, item 6,
    # its CUDA part waits for a GPU session).
    q, k, v = (torch.randn(2, 4, 256, head_dim) for _ in range(3))
    truth = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    ours = _errors(attn_ext.attention(q, k, v, causal=causal), truth)
    torch_err = _errors(F.scaled_dot_product_attention(q, k, v, is_causal=causal), truth)
    assert ours.mean() <= MEAN_RATIO * torch_err.mean(), (
        f"D={head_dim}: mean error {ours.mean():.3e} vs torch {torch_err.mean():.3e}"
    )
    assert _tail(ours) <= TAIL_RATIO * _tail(torch_err), f"D={head_dim}: 99.99th percentile"


@pytest.mark.parametrize("head_dim", [128, 256, 512])
def test_float32_gradient_error_matches_torch(head_dim):
    q, k, v, g = (torch.randn(2, 4, 256, head_dim) for _ in range(4))

    def grads(fn, dtype):
        x = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        fn(*x).backward(g.to(dtype))
        return [t.grad.double() for t in x]

    truth = grads(F.scaled_dot_product_attention, torch.float64)
    ours = grads(attn_ext.attention, torch.float32)
    theirs = grads(F.scaled_dot_product_attention, torch.float32)
    for name, o, t, r in zip("qkv", ours, theirs, truth):
        assert _errors(o, r).mean() <= MEAN_RATIO * _errors(t, r).mean(), f"grad_{name}"
