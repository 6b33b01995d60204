"""The short timing table of ``python -m attn_ext``: attention against torch's SDPA at one
moderate size, and the fused CBAM spatial gate against the same gate in plain torch, timed by
:mod:`attn_ext.testing.harness` (candidates in interleaved rounds)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing import harness
from attn_ext.testing.selfcheck import CHECK_DTYPES
from attn_ext.testing.spatial import cbam_spatial

WARMUP_CALLS = 2  # the first call pays one-time costs (kernel load, allocator growth, autotune)


def time_interleaved(fns: dict, device: torch.device, repeats: int) -> harness.Timing:
    """``repeats`` interleaved rounds after the warm-up calls (attn_ext.testing.harness)."""
    return harness.time_interleaved(
        fns, device, warmup=WARMUP_CALLS, min_rounds=repeats, max_rounds=repeats
    )


def run_bench(devices: Sequence[torch.device], seqlen: int, repeats: int) -> None:
    impls = {
        "attn_ext": lambda c: lambda q, k, v: attn_ext.attention(q, k, v, causal=c),
        "sdpa": lambda c: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=c),
    }
    b, h, d = 1, 16, 64
    print(
        f"\ntiming: B={b} H={h} S={seqlen} D={d}, median of {repeats} interleaved rounds after "
        f"{WARMUP_CALLS} warmup calls (ratio = sdpa / attn_ext, > 1 means attn_ext is faster)"
    )
    print(
        f"{'device':6s} {'dtype':8s} {'causal':6s} {'mode':7s} {'attn_ext ms':>11s} "
        f"{'sdpa ms':>9s} {'ratio':>6s}"
    )
    for device in devices:
        for dtype in CHECK_DTYPES:
            torch.manual_seed(0)
            q, k, v, grad = (
                torch.randn(b, h, seqlen, d, device=device, dtype=dtype) for _ in range(4)
            )
            for causal in (False, True):
                for mode in ("fwd", "fwd+bwd"):
                    fns = {
                        name: harness.make_step(impl(causal), mode, (q, k, v), grad)
                        for name, impl in impls.items()
                    }
                    t = time_interleaved(fns, device, repeats)
                    for name, err in t.errors.items():
                        print(f"  timing failed: {name}: {err}")
                    print(
                        f"{device.type:6s} {str(dtype)[6:]:8s} {str(causal):6s} {mode:7s} "
                        f"{harness.fmt(t.ms('attn_ext'), '11.2f', 'nan'):>11s} "
                        f"{harness.fmt(t.ms('sdpa'), '9.2f', 'nan'):>9s} "
                        f"{harness.fmt(t.ratio('sdpa', 'attn_ext'), '5.2f', 'nan')}x"
                    )


def run_spatial_bench(devices: Sequence[torch.device], repeats: int) -> None:
    """attn_ext.nn.SpatialAttention (fused) vs the same gate in plain torch (document 004's
    x * sigmoid(conv(cat[mean, max])))."""
    n, c, hw = 8, 64, 56
    print(
        f"\ntiming: CBAM spatial gate, x ({n}, {c}, {hw}, {hw}) channels-last, median of {repeats} "
        f"interleaved rounds after {WARMUP_CALLS} warmup calls (ratio = torch / attn_ext)"
    )
    print(
        f"{'device':6s} {'dtype':8s} {'mode':7s} {'attn_ext ms':>11s} {'torch ms':>9s} "
        f"{'ratio':>6s}"
    )
    for device in devices:
        for dtype in CHECK_DTYPES:
            torch.manual_seed(0)
            ours = attn_ext.nn.SpatialAttention().to(device=device, dtype=dtype)
            w = ours.conv.weight
            x = torch.randn(n, c, hw, hw, device=device, dtype=dtype).contiguous(
                memory_format=torch.channels_last
            )
            grad = torch.randn_like(x)
            impls = {"attn_ext": ours, "torch": lambda t, w=w: cbam_spatial(t, w)}
            for mode in ("fwd", "fwd+bwd"):
                fns = {
                    name: harness.make_step(impl, mode, (x,), grad, [w])
                    for name, impl in impls.items()
                }
                t = time_interleaved(fns, device, repeats)
                print(
                    f"{device.type:6s} {str(dtype)[6:]:8s} {mode:7s} {t.ms('attn_ext'):11.2f} "
                    f"{t.ms('torch'):9.2f} {t.ratio('torch', 'attn_ext'):5.2f}x"
                )
